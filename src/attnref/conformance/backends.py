"""Backends by name: the built-in ones of every family, the mutants, and ``module:function``.

The layer above the registry (`attnref.conformance.families`): `resolve_backend` turns a
spec into a `Backend` of an installed family, and `load_backend` does so with the folder
the audit was started in importable (what a worker runs, behind the trust boundary).
A plain function with no declaration is taken to claim its family's preset (`PRESETS`);
a declaration starts from one and names it (`Capabilities.family`). The declarations
themselves are `attnref.conformance.declarations`', re-exported here with each family's
preset.
"""

import importlib
import inspect
import os
import sys

from attnref.conformance.declarations import (
    DEFAULT_API,
    PRESETS,
    VARIANTS,
    Backend,
    BackendError,
    Capabilities,
    EmptyLse,
    EmptyRows,
    declaration,
    family_mismatch,
    from_declaration,
)
from attnref.conformance.families import builtin_backends, get_family
from attnref.conformance.families.flash import FLASH_ATTN_2
from attnref.conformance.families.flash_kvcache import FLASH_ATTN_2_KVCACHE
from attnref.conformance.families.flash_varlen import FLASH_ATTN_2_VARLEN
from attnref.conformance.families.sdpa import SDPA_DEFAULTS
from attnref.conformance.mutants import MUTANTS
from attnref.conformance.worker import set_loader

__all__ = [
    "BUILTIN_BACKENDS",
    "FLASH_ATTN_2",
    "FLASH_ATTN_2_KVCACHE",
    "FLASH_ATTN_2_VARLEN",
    "PRESETS",
    "SDPA_DEFAULTS",
    "VARIANTS",
    "Backend",
    "BackendError",
    "Capabilities",
    "EmptyLse",
    "EmptyRows",
    "declaration",
    "from_declaration",
    "load_backend",
    "resolve_backend",
]

#: every family's built-in backends, by name
BUILTIN_BACKENDS: dict[str, Backend] = builtin_backends()


def _short(api: str) -> str:
    """A family's name as its built-ins' prefix: ``flash-varlen`` -> ``varlen``."""
    return api.rpartition("-")[2]


def resolve_backend(spec: str, api: str | None = None) -> Backend:
    """A built-in backend by name, ``mutant.NAME``, or ``module:function`` for any
    callable with the signature of API family ``api`` (default ``sdpa``: torch SDPA's;
    or any installed family, `attnref.conformance.families`).

    A callable may carry a ``capabilities`` attribute (`Capabilities`) declaring
    what it supports; without one it is taken to claim the family's defaults. A
    built-in or a mutant has an API of its own: ``api`` must match it (``--api flash
    --backend reference`` names ``flash-reference``, ``--api flash-varlen --backend
    reference`` names ``varlen-reference``).

    Raises:
        BackendError: unknown name or family, import error, missing attribute, not
            callable, or a signature that cannot take the family's arguments.
    """
    family = get_family(api or DEFAULT_API)
    builtin: Backend | None = None
    if spec in BUILTIN_BACKENDS:
        builtin = BUILTIN_BACKENDS[spec]
    elif spec.startswith("mutant."):
        if spec.removeprefix("mutant.") not in MUTANTS:
            raise BackendError(
                f"unknown mutant {spec!r}: give one of mutant.{', mutant.'.join(MUTANTS)}"
            )
        builtin = MUTANTS[spec.removeprefix("mutant.")].backend()
    if builtin is not None:
        if api is None or builtin.api == api:
            return builtin
        for other in BUILTIN_BACKENDS.values():  # the same backend in that family
            if other.api == api and other.name in (f"{api}-{spec}", f"{_short(api)}-{spec}"):
                return other
        raise BackendError(f"{spec} is a backend of the {builtin.api!r} API family, not {api!r}")
    if ":" not in spec:
        known = ", ".join(sorted(BUILTIN_BACKENDS))
        raise BackendError(f"unknown backend {spec!r}: give one of {known}, or module:function")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure of user code is reported, not raised
        where = ""
        if isinstance(e, ModuleNotFoundError):
            where = (
                f" (module:function imports from the working folder, {os.getcwd()}, and "
                "sys.path: run from the folder that holds the module, or put it on "
                "PYTHONPATH)"
            )
        raise BackendError(
            f"cannot import module {module_name!r}: {type(e).__name__}: {e}{where}"
        ) from e
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BackendError(f"module {module_name!r} has no attribute {attr!r}") from None
    fn = family.check(obj, spec)
    caps = getattr(fn, "capabilities", family.defaults)
    if not isinstance(caps, Capabilities):
        raise BackendError(f"{spec}.capabilities must be an attnref Capabilities, got {caps!r}")
    if caps.family != family.name:
        raise BackendError(family_mismatch(spec, caps.family, family.name))
    why = family.cannot_honour(caps)
    if why is not None:
        raise BackendError(f"{spec}: {why}")
    doc = (inspect.getdoc(fn) or "").split("\n")[0]
    return Backend(spec, fn, doc or spec, caps, api=family.name, spec=spec)


def load_backend(spec: str, api: str | None = None) -> Backend:
    """`resolve_backend` (``api``: the API family), with the current folder importable
    first: ``module:function`` may name a file where the audit was started.

    Raises:
        BackendError: as `resolve_backend`.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return resolve_backend(spec, api)


set_loader(load_backend)  # what a worker resolves its backend with
