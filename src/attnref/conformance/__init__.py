"""The conformance suite: audit any SDPA-compatible backend against the float64 reference.

``audit(resolve_backend("torch-sdpa"))`` returns an `AuditReport`;
``attnref audit --backend module:function`` does the same from the command line.
"""

from attnref.conformance.backends import (
    BUILTIN_BACKENDS,
    Backend,
    BackendError,
    Capabilities,
    resolve_backend,
)
from attnref.conformance.cases import Case, build, fixed_grid
from attnref.conformance.oracle import compare
from attnref.conformance.report import AuditReport, CaseResult
from attnref.conformance.runner import audit

__all__ = [
    "BUILTIN_BACKENDS",
    "AuditReport",
    "Backend",
    "BackendError",
    "Capabilities",
    "Case",
    "CaseResult",
    "audit",
    "build",
    "compare",
    "fixed_grid",
    "resolve_backend",
]
