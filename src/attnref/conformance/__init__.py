"""The conformance suite: audit any SDPA-compatible backend against the float64 reference.

``audit(resolve_backend("torch-sdpa"))`` returns an `AuditReport`;
``attnref audit --backend module:function`` does the same from the command line, and
``pytest --attnref-backend=module:function`` from a test run.
"""

from attnref.conformance.backends import (
    BUILTIN_BACKENDS,
    Backend,
    BackendError,
    Capabilities,
    resolve_backend,
)
from attnref.conformance.calls import Failure, Skip
from attnref.conformance.cases import Case, Inputs, build, fixed_grid
from attnref.conformance.oracle import expect, reference
from attnref.conformance.profiles import PROFILES, Profile
from attnref.conformance.properties import PROPERTIES, Property, check_case
from attnref.conformance.report import AuditReport, PropertyResult
from attnref.conformance.runner import audit, run_property

__all__ = [
    "BUILTIN_BACKENDS",
    "PROFILES",
    "PROPERTIES",
    "AuditReport",
    "Backend",
    "BackendError",
    "Capabilities",
    "Case",
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
]
