"""The two outcomes of a check other than a pass: `Failure` and `Skip`.

Every check of the audit returns (a pass) or raises one of these; nothing a backend does
escapes as anything else (`attnref.conformance.calls`).
"""

import os
import re
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["Failure", "Skip", "cause_key", "cause_of", "one_line", "shorten"]


class Failure(Exception):  # noqa: N818 (a verdict on the backend, not an error of ours)
    """The backend got a check wrong; ``str(failure)`` is a one-line summary.

    ``fatal`` failures (a hang) stop the search: calling the backend again only costs time.
    """

    def __init__(
        self,
        message: str,
        *,
        got: float | None = None,
        expected: float | None = None,
        where: tuple[int, ...] | None = None,
        fatal: bool = False,
        kind: str = "",
        small: bool = False,
    ) -> None:
        super().__init__(message)
        self.got = got
        self.expected = expected
        self.where = where
        self.fatal = fatal
        #: what went wrong, for grouping failures by cause (`cause_of`): "nan" (NaN/inf
        #: where the oracle is finite), "policy" (finite where the policy gives NaN),
        #: "error" (values off by more than the bound), "died" (the backend's process
        #: ended), "" (anything else)
        self.kind = kind
        #: an "error" under 5% of the values' spread and within `PRECISION_TIMES` its bound
        #: (`attnref.conformance.oracle.close`): what a precision loss looks like
        self.small = small
        #: where the values were wrong, for the report's heatmap: made on demand
        #: (`attnref.conformance.oracle.error_map`, only for the failure a search keeps);
        #: None where a check has no tensor to show
        self.errors_from: Callable[[], dict[str, Any]] | None = None

    def reworded(self, message: str) -> "Failure":
        """The same failure with another message."""
        failure = Failure(
            message,
            got=self.got,
            expected=self.expected,
            where=self.where,
            fatal=self.fatal,
            kind=self.kind,
            small=self.small,
        )
        failure.errors_from = self.errors_from
        return failure


def cause_of(failure: Failure, dtype: str) -> str:
    """The cause a failure is grouped under in a report: what went wrong, in which rows
    (those that see keys, or those that see none and under which declared policy) and,
    for small errors (the size of a precision loss), in which dtype. Failures of
    different properties with one cause (a softmax in half precision, an empty-row
    policy) share it; anything else is its message, up to where it names the first
    element, its numbers as they are (`cause_key` groups those that differ only in
    numbers and dtypes)."""
    text = str(failure)
    row = ""
    # the failing row as the message names it; a hint after it may speak of another
    # row ("head 1 at the same position sees no key"), which does not label this one
    named = _NAMED_ROW.search(text)
    if named is not None and named.group(1) == "no key":
        row = " in rows that see no key" + _policy(text)
    elif named is not None:
        row = " in rows that see keys"
    if failure.kind == "nan":
        return "NaN/inf where the oracle is finite" + row
    if failure.kind == "policy":
        return "finite values where the declared policy gives NaN" + row
    if failure.kind == "error" and failure.small and not row.startswith(" in rows that see no"):
        # (a row that sees no key holds a policy's value: an error there breaks the
        # policy, whatever its size)
        return f"precision loss: errors above the bound, of a size rounding makes{row}, in {dtype}"
    if failure.kind == "error":
        return "wrong values (errors past what rounding makes)" + row
    return shorten(text.split("; first at")[0])


#: how `attnref.conformance.checks.Context.row` names the failing row
_NAMED_ROW = re.compile(r"query \d+ sees (no key|\d+ of \d+ keys)")
#: a number standing alone (not a part of a name, such as the 32 of float32)
_NUMBER = re.compile(r"(?<![\w.])-?\d+(\.\d+)?(e[-+]?\d+)?(?!\w)")


def cause_key(cause: str) -> str:
    """What failures of one cause share: ``cause`` with its standalone numbers (sizes,
    ranks, values) taken out, so that one bug seen in several shapes or ranks is one
    finding. Dtype names stay: a cause that names a dtype (a precision miss, "in
    float16") is kept apart by it, so a finding's title names a dtype only where every
    failure in it is of that dtype; a cause that names none (wrong values, NaN, a
    policy) is one finding across dtypes."""
    return _NUMBER.sub("N", _THEN.sub("", cause))


#: the ranks a context-parallel failure spread to after its culprit's (`RankGroup`)
_THEN = re.compile(r" \(then ranks? [\d, ]+\)")


def _policy(text: str) -> str:
    found = re.search(r"declared policy '(\w+)'", text)
    return f" (declared policy {found.group(1)!r})" if found else ""


class Skip(Exception):  # noqa: N818 (a signal, like pytest.skip)
    """The backend declares it does not support this call, or (``refused``) it raised an
    error its declaration names as a refusal."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``; for an exception with no message (a bare
    ``assert`` in a library), where it was raised: its file, line and source."""
    text = str(e).strip().splitlines()
    name = getattr(e, "type_name", type(e).__name__)  # a RemoteError: the backend's type
    if text and not _EMPTY.fullmatch(re.sub(r"[()'\"\s]", "", text[0])):
        return f"{name}: {text[0]}"
    where = _raised_at(e)
    said = f"{name}: {text[0]}" if text else f"{name} with no message"
    return said + (f", raised at {where}" if where else "")


#: a message that only names an empty exception (Triton's interpreter wraps a kernel's
#: failed ``assert`` as ``InterpreterError("AssertionError('')")``), its brackets and
#: quotes removed
_EMPTY = re.compile(r"(\w+(Error|Exception))?")
#: where a chained traceback's text starts its next exception
_CHAINED = re.compile(
    r"\n\s*(?:The above exception was the direct cause of the following exception:"
    r"|During handling of the above exception, another exception occurred:)"
)
#: frames of the runtimes a kernel runs in, not of its own code
_RUNTIME = re.compile(r"[/\\](?:triton|torch|jax|jaxlib|numpy|attnref)[/\\]")


#: a frame of a traceback's text: its file, its line and the source line under it
_FRAME = re.compile(r'File "([^"\n]+)", line (\d+), in [^\n]*\n[ \t]+(\S[^\n]*)')


def _raised_at(e: BaseException) -> str:
    """``file, line N: source`` of the frame that raised ``e`` (from the traceback's
    text for an exception that crossed from the worker: the backend's word), or ""."""
    text = getattr(e, "traceback_text", "")
    # the first exception of a chain is where it started (an interpreter's wrapper is
    # raised from it); there, the innermost frame of the kernel's own code
    frames = _FRAME.findall(_CHAINED.split(text)[0]) if text else []
    own = [f for f in frames if not _RUNTIME.search(f[0])]
    if frames:
        path, line, source = (own or frames)[-1]
    elif e.__traceback__ is not None:
        last = traceback.extract_tb(e.__traceback__)[-1]
        path, line, source = last.filename, str(last.lineno), (last.line or "").strip()
    else:
        return ""
    return f"{os.path.basename(path)}, line {line}: {source}"[:200]


def shorten(text: str, limit: int = 200) -> str:
    """``text`` cut to at most ``limit`` characters at a word's end, with "..." where it
    was cut (a title cut mid-word read "the crash nee")."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 3]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ,;:") + "..."
