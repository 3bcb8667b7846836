"""The jobs a worker runs and the verdicts that come back: the first of the worker's three
parts (`attnref.conformance.worker` has the whole).

A job is plain data for the worker (`Job`: one call; `Series`: calls in one go, for the
laws between calls; `Probe`: is the backend there at all); a reply is plain data back,
which `read_reply` decodes with the restricted decoder and `outcome` turns into the value
or the exception it stands for: what the backend did wrong (`Raised`, wrapping a
`RemoteError`, `ModifiedInputs`, `LateWrite` or `Unaccepted`), `BackendDied`, or an error
of attnref's own code in the worker (`InternalError`).
"""

import traceback
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from attnref.conformance.wire import (
    Rejected,
    decode,
)

__all__ = [
    "BackendDied",
    "InternalError",
    "Job",
    "LateWrite",
    "ModifiedInputs",
    "Probe",
    "Raised",
    "RemoteError",
    "Series",
    "Unaccepted",
    "error_reply",
    "outcome",
    "read_reply",
    "series_outcomes",
]


class RemoteError(Exception):
    """An exception raised by backend code, as it crossed the boundary: its type's name,
    its message and its traceback's text (the exception object itself never crosses)."""

    def __init__(self, type_name: str, message: str, traceback_text: str = "") -> None:
        super().__init__(message)
        self.type_name = type_name
        self.traceback_text = traceback_text


class Raised(Exception):  # noqa: N818 (a wrapper, not an error of ours)
    """What the backend raised (``.error``), carried out of the executor, so that the
    audit's own interrupts (Ctrl-C in this process) are never mistaken for it."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class BackendDied(Exception):  # noqa: N818 (a verdict: the backend ended its process)
    """The worker process ended during a call: ``str()`` says how (exit code or signal)."""


class ModifiedInputs(Exception):  # noqa: N818 (a verdict on the backend)
    """The backend changed a tensor it was given."""


class LateWrite(Exception):  # noqa: N818 (a verdict on the backend)
    """The backend's output changed after its call returned."""


class Unaccepted(Exception):  # noqa: N818 (a verdict on the backend)
    """The backend returned (or its worker sent) something the audit does not accept."""


class InternalError(Exception):
    """attnref's own code failed in the worker: an error of attnref, not of the backend."""


@dataclass
class Job:
    """One call of backend code: ``backend(*args, **kwargs)``; with ``d_out``, also the
    backward pass, returning ``(dQ, dK, dV)`` for the first three arguments.

    ``leaves``: the arguments whose gradients the backward returns, in order, each a
    position or a keyword's name (empty: the first three, and ``sinks=`` where given).
    ``d_out`` is then one upstream gradient for a tensor result, or one for each part of
    a tuple result (None for a part no gradient flows into: the gated delta rule's
    ``(o, final_state)``).

    ``writable``: the positional arguments the backend may change in place (a KV cache
    it appends to); the job then returns ``(result, those arguments as it left them)``.
    ``recheck``: read the output again this many seconds after the call returned, and
    fail if it changed (0: only when the backend left a thread running).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    d_out: Tensor | tuple[Tensor | None, ...] | None = None
    writable: tuple[int, ...] = ()
    recheck: float = 0.0
    leaves: tuple[int | str, ...] = ()

    def message(self) -> dict[str, Any]:
        return {
            "job": "call",
            "args": self.args,
            "kwargs": self.kwargs,
            "d_out": self.d_out,
            "writable": list(self.writable),
            "recheck": self.recheck,
            "leaves": list(self.leaves),
        }


@dataclass
class Series:
    """Several calls in one worker, in order; ``into[i] = j`` writes call ``i``'s tensor
    values into call ``j``'s buffers in place and calls the backend on those buffers
    (``None``: on call ``i``'s own, new buffers). Returns each call's outcome: its
    output, or the exception it raised (`Raised`, `ModifiedInputs`, ...)."""

    calls: tuple[Job, ...]
    into: tuple[int | None, ...]

    def message(self) -> dict[str, Any]:
        return {"job": "series", "calls": [c.message() for c in self.calls], "into": self.into}


@dataclass
class Probe:
    """Whether the backend can run on ``device``: ``None``, or why not (its package is
    missing, or a small call raised)."""

    device: str

    def message(self) -> dict[str, Any]:
        return {"job": "probe", "device": self.device}


def error_reply(status: str, e: BaseException) -> dict[str, Any]:
    try:
        message = str(e)
    except BaseException:
        message = "<the exception's message could not be read>"
    try:
        text = "".join(traceback.format_exception(e))
    except BaseException:
        text = ""
    return {"status": status, "type": type(e).__name__, "message": message, "traceback": text}


def outcome(reply: Any) -> Any:
    """The value of a decoded reply, or the exception it stands for (raised).

    Raises:
        Raised: the backend raised (``.error`` a `RemoteError`), modified its inputs
            (`ModifiedInputs`), wrote its output late (`LateWrite`), or returned something
            the audit does not accept (`Unaccepted`).
        InternalError: attnref's own code failed in the worker.
    """
    if type(reply) is not dict or type(reply.get("status")) is not str:
        raise Raised(Unaccepted(f"the worker sent a malformed reply: {str(reply)[:200]}"))
    status = reply["status"]
    if status == "ok":
        return reply.get("value")
    text = {k: str(reply.get(k, "")) for k in ("type", "message", "traceback")}
    if status == "raised":
        raise Raised(RemoteError(text["type"], text["message"], text["traceback"]))
    if status == "modified":
        names = reply.get("names")
        listed = ", ".join(str(n) for n in names) if type(names) is list else "?"
        raise Raised(ModifiedInputs(f"the backend modified its inputs: {listed}"))
    if status == "past":
        names = reply.get("names")
        listed = ", ".join(str(n) for n in names) if type(names) is list else "?"
        raise Raised(ModifiedInputs(f"the backend wrote outside its arguments' memory: {listed}"))
    if status == "late":
        raise Raised(LateWrite(text["message"]))
    if status == "unaccepted":
        raise Raised(
            Unaccepted(
                f"the backend returned an object the audit does not accept: {text['message']}"
            )
        )
    if status == "internal":
        raise InternalError(
            f"attnref's own code failed in the worker (a bug of attnref, not of the backend): "
            f"{text['type']}: {text['message']}\n{text['traceback']}"
        )
    raise Raised(Unaccepted(f"the worker sent a reply of unknown status {status[:50]!r}"))


def series_outcomes(replies: Any, count: int) -> list[Any]:
    """A `Series`' replies, each its value or the `Raised` / `InternalError` it stands for."""
    if type(replies) is not list or len(replies) != count:
        raise Raised(Unaccepted("the worker sent a malformed reply to a series of calls"))
    results: list[Any] = []
    for reply in replies:
        try:
            results.append(outcome(reply))
        except (Raised, InternalError) as e:
            results.append(e)
    return results


def read_reply(data: bytes | bytearray) -> Any:
    """A worker's reply bytes (untrusted), decoded by the restricted decoder: the value,
    or the exception it stands for (`outcome`)."""
    try:
        reply = decode(data)
    except Rejected as e:
        raise Raised(
            Unaccepted(f"the worker sent a message the audit does not accept: {e}")
        ) from None
    except Exception as e:  # a tensor that cannot be rebuilt here, say
        message = f"{type(e).__name__}: {e}"[:300]
        raise Raised(
            Unaccepted(f"the worker sent a message the audit cannot read: {message}")
        ) from None
    return outcome(reply)
