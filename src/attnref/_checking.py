"""The one runtime-checking mechanism of attnref, and the dimension glossary.

Every function or ``forward`` that takes or returns a tensor is decorated with
`checked`: its jaxtyping annotations (dtype and shape) are enforced by beartype on
every call, and the dimension names bind consistently across the arguments and the
return value of that one call.

Dimension glossary (a letter means the same thing in every file and in the docs):

=======  ==========================================================================
``B``    batch
``Tq``   number of queries
``Tk``   number of keys (= number of values)
``T``    sequence length where queries and keys are the same sequence
``H``    model width, ``num_hiddens`` (``H = h * Dh``)
``h``    number of query heads
``g``    number of key/value heads (``h % g == 0``; ``g = h`` is plain MHA, ``g = 1`` MQA)
``Dh``   head dim of queries and keys
``Dv``   head dim of values
``Dq``   raw query feature width (additive attention: queries and keys may differ)
``Dk``   raw key feature width
``D``    a head dim that may be ``Dh`` or ``Dv`` (functions taking keys and values alike)
``N``    number of rows (D2L's ``sequence_mask``)
``Tb``   keys in one block of chunked attention
``V``    vocabulary size
``L``    number of layers
=======  ==========================================================================

A leading ``*batch`` stands for any number of leading batch dims, a leading ``#`` marks a
dim that may be 1 and broadcast.

Checking is on by default. ``JAXTYPING_DISABLE=1`` in the environment, or
`set_checking(False)` at run time, turns every checked function into a
plain call (one attribute lookup of overhead): benchmarks use it.

Private helpers are annotated too, with `checked_internal`: their inputs were
checked at the public boundary, so they are re-checked only when
``ATTNREF_CHECK_INTERNALS=1`` is set before attnref is imported. The test suite sets it,
so every property-test example also verifies the internal shape contracts, while users
pay nothing for them.
"""

import os
from collections.abc import Callable
from typing import Any, TypeVar

import jaxtyping
from beartype import beartype
from jaxtyping import jaxtyped

__all__ = [
    "CHECKED_ATTR",
    "CHECK_INTERNALS",
    "audit_checking",
    "checked",
    "checked_internal",
    "checking_enabled",
    "set_checking",
]

F = TypeVar("F", bound=Callable[..., Any])

#: Attribute set on every function that went through `checked`; the test suite
#: walks the package and fails on any public tensor function that lacks it.
CHECKED_ATTR = "__attnref_checked__"


def checked(fn: F) -> F:
    """Enforce ``fn``'s jaxtyping annotations with beartype on every call.

    Use on plain functions and on ``nn.Module.forward``; never on a class (dimension
    bindings would then leak across calls).
    """
    wrapped = jaxtyped(typechecker=beartype)(fn)
    setattr(wrapped, CHECKED_ATTR, True)
    return wrapped


#: Whether private helpers are checked too (``ATTNREF_CHECK_INTERNALS=1`` at import).
CHECK_INTERNALS = os.environ.get("ATTNREF_CHECK_INTERNALS", "0") == "1"


def checked_internal(fn: F) -> F:
    """`checked` for private helpers, applied only under ``ATTNREF_CHECK_INTERNALS=1``."""
    return checked(fn) if CHECK_INTERNALS else fn


def checking_enabled() -> bool:
    """Whether checked functions currently check their arguments."""
    return not jaxtyping.config.jaxtyping_disable


def set_checking(enabled: bool) -> None:
    """Turn runtime shape and dtype checking on or off for the whole process."""
    jaxtyping.config.update("jaxtyping_disable", not enabled)


def audit_checking() -> bool:
    """Whether an audit's own code runs checked: the judge's oracle and laws, and the
    harness in its workers (decoding a job, calling the backend through its family).
    Off unless ``ATTNREF_CHECK_JUDGE=1``: its inputs are the audit's own cases, and the
    test suite runs the same code checked outside audits. A worker started before the
    audit began (the CLI starts it to read the declaration) checks as the audit will."""
    return os.environ.get("ATTNREF_CHECK_JUDGE") == "1"
