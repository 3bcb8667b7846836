"""The registry of API families: the one place that lists them.

Each family is one module of this package, holding everything of its own (its
convention, adapter, preset, built-in backends, properties, mutants and bench entry:
`attnref.conformance.family.ApiFamily`). The engine never imports a family; installing
them here fills the tables it reads (`FAMILIES`, `PRESETS`, `PROPERTIES`, `MUTANTS`).
Adding a family is a module here and its line below.
"""

from attnref.conformance import mutants, properties
from attnref.conformance.declarations import Backend, register_preset
from attnref.conformance.families import (
    context_parallel,
    flash,
    flash_kvcache,
    flash_varlen,
    gated_delta,
    gated_delta_decode,
    mla,
    sdpa,
    sparse_mla,
    sparse_mla_fp8,
)
from attnref.conformance.family import FAMILIES, ApiFamily, family_of, get_family
from attnref.conformance.mutants import MUTANTS
from attnref.conformance.properties import PROPERTIES

__all__ = [
    "FAMILIES",
    "MATRIX_PROPERTIES",
    "MUTANTS",
    "PROPERTIES",
    "ApiFamily",
    "builtin_backends",
    "family_of",
    "get_family",
    "install",
]


def install(*families: ApiFamily) -> dict[str, ApiFamily]:
    """Install ``families``: each one's preset, properties and mutants join the tables
    the engine reads, in this order. Returns `FAMILIES`."""
    for family in families:
        if family.name in FAMILIES:
            raise ValueError(f"API family {family.name!r} is installed twice")
        FAMILIES[family.name] = family
        register_preset(family.name, family.defaults)
        properties.register(family.properties)
        mutants.register(family.mutants)
    return FAMILIES


# the families, one line each
install(
    sdpa.FAMILY,
    flash.FAMILY,
    flash_varlen.FAMILY,
    flash_kvcache.FAMILY,
    context_parallel.FAMILY,
    mla.FAMILY,
    sparse_mla.FAMILY,
    sparse_mla_fp8.FAMILY,
    gated_delta.FAMILY,
    gated_delta_decode.FAMILY,
)

#: the properties of the kill matrix (docs/kill-matrix.md): those aimed at attention bugs
MATRIX_PROPERTIES: tuple[str, ...] = properties.matrix_properties()


def builtin_backends() -> dict[str, Backend]:
    """Every family's built-in backends, by name, in the registry's order."""
    return {b.name: b for family in FAMILIES.values() for b in family.builtins()}
