"""The conformance suite: audit any SDPA-compatible backend against the float64 reference.

``audit(resolve_backend("torch-sdpa"))`` returns an `AuditReport`;
``attnref audit --backend module:function`` does the same from the command line, and
``pytest --attnref-backend=module:function`` from a test run.

Names load on first use, so that the pytest plugin can declare its options
(`attnref.conformance.options`) without importing torch in every test run. The first
name used installs the API families (`attnref.conformance.families`, through
`attnref.conformance.backends`), whatever module it comes from.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnref.conformance.backends import (
        BUILTIN_BACKENDS,
        FLASH_ATTN_2,
        FLASH_ATTN_2_KVCACHE,
        FLASH_ATTN_2_VARLEN,
        PRESETS,
        SDPA_DEFAULTS,
        Backend,
        BackendError,
        Capabilities,
        EmptyRows,
        resolve_backend,
    )
    from attnref.conformance.cases import Case, Inputs, build, fixed_grid
    from attnref.conformance.oracle import expect, reference
    from attnref.conformance.profiles import PROFILES, Profile
    from attnref.conformance.properties import PROPERTIES, Property
    from attnref.conformance.report import AuditReport, PropertyResult
    from attnref.conformance.runner import audit, check_case, run_property
    from attnref.conformance.verdicts import Failure, Skip

_WHERE = {
    "backends": (
        "BUILTIN_BACKENDS",
        "FLASH_ATTN_2",
        "FLASH_ATTN_2_KVCACHE",
        "FLASH_ATTN_2_VARLEN",
        "PRESETS",
        "SDPA_DEFAULTS",
        "Backend",
        "BackendError",
        "Capabilities",
        "EmptyRows",
        "resolve_backend",
    ),
    "cases": ("Case", "Inputs", "build", "fixed_grid"),
    "oracle": ("expect", "reference"),
    "profiles": ("PROFILES", "Profile"),
    "properties": ("PROPERTIES", "Property"),
    "report": ("AuditReport", "PropertyResult"),
    "runner": ("audit", "check_case", "run_property"),
    "verdicts": ("Failure", "Skip"),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}

__all__ = [
    "BUILTIN_BACKENDS",
    "FLASH_ATTN_2",
    "FLASH_ATTN_2_KVCACHE",
    "FLASH_ATTN_2_VARLEN",
    "PRESETS",
    "PROFILES",
    "PROPERTIES",
    "SDPA_DEFAULTS",
    "AuditReport",
    "Backend",
    "BackendError",
    "Capabilities",
    "Case",
    "EmptyRows",
    "Failure",
    "Inputs",
    "Profile",
    "Property",
    "PropertyResult",
    "Skip",
    "audit",
    "build",
    "check_case",
    "expect",
    "fixed_grid",
    "reference",
    "resolve_backend",
    "run_property",
]  # the names of _WHERE (tests/test_checking.py checks it)


def __getattr__(name: str) -> Any:
    if name in _MODULE:
        importlib.import_module("attnref.conformance.backends")  # the families, installed
        return getattr(importlib.import_module(f"attnref.conformance.{_MODULE[name]}"), name)
    raise AttributeError(f"module 'attnref.conformance' has no attribute {name!r}")
