"""Where backend code runs: a supervised worker process behind a trust boundary.

The process that judges (draws cases, computes the oracle, writes the report, decides the
exit code) never runs a line of backend code. A backend under audit may do anything to
the process it runs in: exit, segfault, hang, patch torch, register ``atexit`` hooks,
start threads, return objects that run code when read. So:

- The backend's module is imported in the worker only. The worker is forked from a
  forkserver, a clean interpreter that has imported torch and attnref and nothing else
  (spawned where there is no forkserver), never from the judge, which holds cases and
  expected outputs. Its first message is the backend's declaration, as plain data
  (`attnref.conformance.backends.declaration`), which the judge validates.
- Everything crosses as data through `attnref.conformance.wire`: jobs one way; outputs,
  errors (type name, message, traceback text) and verdicts of the worker's own checks
  the other. Nothing is unpickled.
- The worker checks, around each call, that the backend left its inputs as it got them
  (bit for bit, but for the arguments it may write, `Job.writable`), snapshots the output
  the moment the call returns, and, when the backend left a thread running (or the job
  asks, `Job.recheck`), reads the output again a moment later: a backend still writing
  after it returned is caught, and its thread named.

Before it loads the backend, the worker enters a sandbox (`attnref._sandbox`, Linux):
it writes only in a scratch folder of its own, which the judge removes when the worker
stops; it opens no socket, signals no process outside it, and everything it starts ends
with it. Its first frame, sent before any code of the backend's runs, says what the
platform enforced (`Supervised.sandbox`); docs/untrusted.md has the threat model.

`Supervised` is the judge's handle on such a worker: a call that never answers is killed
after its timeout, a worker that dies is reported with its exit code or signal, and a
fresh worker serves the next call. `InProcess` runs the same jobs in a thread of the
judge's own process (``--in-process``, for debugging with pdb or a profiler): it then
trusts the backend.
"""

import contextlib
import faulthandler
import importlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import select
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Shaped
from torch import Tensor

from attnref import _forkserver, _sandbox
from attnref._checking import checked_internal, checking_enabled, set_checking
from attnref._dies_with_parent import die_with_parent
from attnref.conformance.declarations import (
    DEFAULT_API,
    Backend,
    BackendError,
    declaration,
    from_declaration,
)
from attnref.conformance.family import FAMILIES
from attnref.conformance.wire import (
    SHARED,
    Arena,
    Rejected,
    decode,
    encode,
    encode_shared,
    map_shared,
)

__all__ = [
    "BackendDied",
    "Executor",
    "InProcess",
    "InternalError",
    "Job",
    "LateWrite",
    "ModifiedInputs",
    "Probe",
    "Raised",
    "RemoteError",
    "Series",
    "Supervised",
    "Unaccepted",
    "invoke_backend",
    "loader",
    "read_reply",
    "set_loader",
    "start_executor",
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

    ``writable``: the positional arguments the backend may change in place (a KV cache
    it appends to); the job then returns ``(result, those arguments as it left them)``.
    ``recheck``: read the output again this many seconds after the call returned, and
    fail if it changed (0: only when the backend left a thread running).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    d_out: Tensor | None = None
    writable: tuple[int, ...] = ()
    recheck: float = 0.0

    def message(self) -> dict[str, Any]:
        return {
            "job": "call",
            "args": self.args,
            "kwargs": self.kwargs,
            "d_out": self.d_out,
            "writable": list(self.writable),
            "recheck": self.recheck,
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


# ----------------------------------------------------------- the worker's side


class _Unsupported:
    """What `snapshot` puts where the backend returned something that may not cross."""

    def __init__(self, what: str) -> None:
        self.what = what


def snapshot(obj: Any) -> Any:
    """``obj`` with every plain tensor copied as it is now (so a later write by the
    backend cannot change what is judged), and anything else that may not cross named."""
    if type(obj) is Tensor:
        if obj.layout != torch.strided:
            return _Unsupported(f"a {str(obj.layout).removeprefix('torch.')} tensor")
        return obj.detach().clone()
    if isinstance(obj, Tensor):
        kind = type(obj)
        return _Unsupported(
            f"a tensor subclass {kind.__module__}.{kind.__qualname__} (only plain strided "
            "torch.Tensor outputs are accepted)"
        )
    if type(obj) in (tuple, list):
        return type(obj)(snapshot(x) for x in obj)
    if type(obj) is dict:
        return {k: snapshot(v) for k, v in obj.items()}
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    kind = type(obj)
    return _Unsupported(f"an object of type {kind.__module__}.{kind.__qualname__}")


def _tensors(obj: Any) -> list[Tensor]:
    if type(obj) is Tensor:
        return [obj]
    if type(obj) in (tuple, list):
        return [t for x in obj for t in _tensors(x)]
    if type(obj) is dict:
        return [t for x in obj.values() for t in _tensors(x)]
    return []


@checked_internal
def _fingerprint(t: Shaped[Tensor, "..."], copy: bool = True) -> tuple[Any, ...]:
    """Shape, strides, offset and every byte of ``t``'s values: equal only if nothing
    changed (NaN compared as bits). Any layout: a size-1 dimension may have any stride.
    ``copy=False``: a contiguous ``t`` is read where it lies, if its bytes start on a
    word (the fingerprint taken after a call, compared at once with the copy taken
    before)."""
    data = t.detach().cpu()
    word = _word(data.numel() * data.element_size())
    aligned = data.storage_offset() * data.element_size() % word.itemsize == 0
    if copy or not data.is_contiguous() or not aligned:
        data = data.clone(memory_format=torch.contiguous_format)
    # contiguous: its elements lie in order from its offset (a size-1 dim may have any
    # stride, which a reshape would keep)
    words = data.as_strided((data.numel(),), (1,)).view(torch.uint8).view(word)
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, words)


def _word(nbytes: int) -> torch.dtype:
    """The widest integer type that tiles ``nbytes`` bytes: `torch.equal` compares eight
    bytes at a time about seven times faster than one."""
    return next(
        d for d in (torch.int64, torch.int32, torch.int16, torch.uint8) if nbytes % d.itemsize == 0
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[:4] == b[:4] and torch.equal(a[4], b[4])


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


def _encode_unsupported(obj: Any) -> Any:
    """The snapshot with `_Unsupported` markers as the wire's ``unsupported`` nodes."""
    if isinstance(obj, _Unsupported):
        raise Rejected(obj.what)
    if type(obj) in (tuple, list):
        return type(obj)(_encode_unsupported(x) for x in obj)
    if type(obj) is dict:
        return {k: _encode_unsupported(v) for k, v in obj.items()}
    return obj


def _call(backend: Backend, job: dict[str, Any], buffers: tuple[Any, Any] | None = None) -> Any:
    """Run one call job in this (the worker's) process; a reply tree."""
    args, kwargs = buffers if buffers is not None else (tuple(job["args"]), dict(job["kwargs"]))
    d_out, writable, recheck = job["d_out"], tuple(job["writable"]), float(job["recheck"])
    sinks = None
    if d_out is not None:  # the query, key and value (and sinks) become leaves
        args = (*(t.detach().requires_grad_(True) for t in args[:3]), *args[3:])
        if isinstance(kwargs.get("sinks"), Tensor):
            sinks = kwargs["sinks"].detach().requires_grad_(True)
            kwargs = {**kwargs, "sinks": sinks}
    tensors = [
        (f"argument {i}", t)
        for i, t in enumerate(args)
        if isinstance(t, Tensor) and i not in writable
    ] + [(k, t) for k, t in kwargs.items() if isinstance(t, Tensor)]
    before = [_fingerprint(t) for _, t in tensors]
    threads = set(threading.enumerate())
    try:
        out: Any = invoke_backend(backend, args, kwargs)
        if d_out is not None:
            if not isinstance(out, Tensor) or not out.requires_grad:
                raise RuntimeError("the output does not require grad: no gradient reaches Q, K, V")
            # backward() as a training loop calls it (torch.autograd.grad would refuse a
            # reentrant torch.utils.checkpoint inside the backend)
            torch.autograd.backward(out, d_out)
            leaves = (*args[:3], *(() if sinks is None else (sinks,)))
            out = tuple(None if t.grad is None else t.grad.detach() for t in leaves)
        if writable:
            out = (out, tuple(args[i] for i in writable))
        if out is not None and type(out) is Tensor:
            out = out.detach()
        value = snapshot(out)  # as it stood when the call returned
    except BaseException as e:
        return error_reply("raised", e)
    changed = [
        name
        for (name, t), b in zip(tensors, before, strict=True)
        if not _same(_fingerprint(t, copy=False), b)
    ]
    if changed:
        names = {"argument 0": "query", "argument 1": "key", "argument 2": "value"}
        return {"status": "modified", "names": [names.get(n, n) for n in changed]}
    left = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
    if left or recheck > 0:
        late = _late_write(out, value, max(recheck, 0.05), left)
        if late is not None:
            return {"status": "late", "message": late}
    try:
        return {"status": "ok", "value": _encode_unsupported(value)}
    except Rejected as e:
        return {"status": "unaccepted", "message": str(e)}


def invoke_backend(backend: Backend, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One call of the backend, as its family makes it (`ApiFamily.invoke`)."""
    family = FAMILIES.get(backend.api)
    if family is not None and family.invoke is not None:
        return family.invoke(backend, args, kwargs)
    return backend(*args, **kwargs)


def _late_write(out: Any, value: Any, wait: float, left: list[threading.Thread]) -> str | None:
    """Why the output changed since ``value`` was taken, ``wait`` seconds later, or None."""
    time.sleep(wait)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()  # work on a side stream lands too
    now, then = _tensors(snapshot(out)), _tensors(value)
    if len(now) == len(then) and all(
        _same(_fingerprint(a, copy=False), _fingerprint(b, copy=False))
        for a, b in zip(now, then, strict=True)
    ):
        return None
    threads = ", ".join(repr(t.name) for t in left)
    running = f"; a thread it left running: {threads}" if threads else ""
    return (
        f"the backend was still writing its output after it returned (it changed within "
        f"{wait:g} s of the return){running}"
    )


def rewrite(dst: Any, src: Any) -> None:
    """Write every tensor of ``src`` into the tensor at the same place in ``dst``."""
    for a, b in zip(_tensors(dst), _tensors(src), strict=True):
        same_view = (a.shape, a.stride(), a.storage_offset()) == (
            b.shape,
            b.stride(),
            b.storage_offset(),
        )
        if same_view and a.untyped_storage().nbytes() == b.untyped_storage().nbytes():
            a.untyped_storage().copy_(b.untyped_storage())  # stride 0 and padding included
        else:
            a.copy_(b)


def _series(backend: Backend, job: dict[str, Any]) -> Any:
    kept: list[tuple[Any, Any]] = []
    replies = []
    for call, into in zip(job["calls"], job["into"], strict=True):
        buffers = (tuple(call["args"]), dict(call["kwargs"]))
        if into is not None:
            rewrite(kept[into], buffers)
            buffers = kept[into]
        kept.append(buffers)
        replies.append(_call(backend, call, buffers))
    return {"status": "ok", "value": replies}


def _probe(backend: Backend, job: dict[str, Any]) -> Any:
    import importlib.util

    device = str(job["device"])
    if backend.needs is not None and importlib.util.find_spec(backend.needs) is None:
        why = f"{backend.name} needs the {backend.needs} package, which is not installed here"
        return {"status": "ok", "value": why}
    if backend.probe and backend.available(device) is None:
        q = torch.randn(1, 1, 8, 64, device=device, dtype=backend.capabilities.dtypes[-1])
        try:
            backend(q, q, q)
        except Exception as e:  # the backend says why it cannot run here
            first = (str(e).strip().splitlines() or [""])[0]
            return {"status": "ok", "value": f"{backend.name} is unavailable on {device}: {first}"}
    return {"status": "ok", "value": None}


#: what the worker does for each kind of job; more kinds register here: a module named
#: in a worker's ``jobs`` (`Supervised`) does when the worker imports it (the bench's,
#: `attnref.bench.worker`), so that the engine names no job but its own
HANDLERS: dict[str, Callable[[Backend, dict[str, Any]], Any]] = {
    "call": _call,
    "series": _series,
    "probe": _probe,
}


def handle(backend: Backend, message: dict[str, Any]) -> bytearray:
    """The encoded reply to one job message; attnref's own failures are marked internal."""
    try:
        kind = message["job"]
        if kind not in HANDLERS:
            raise ValueError(f"no handler for a job of kind {kind!r}: its module is not among "
                             "the worker's jobs")  # fmt: skip
        reply = _encode_unsupported(HANDLERS[kind](backend, message))
    except Rejected as e:  # the backend returned something that may not cross
        reply = {"status": "unaccepted", "message": str(e)}
    except BaseException as e:
        reply = error_reply("internal", e)
    try:
        return encode(reply)
    except Rejected as e:  # the backend returned something that may not cross
        return encode({"status": "unaccepted", "message": str(e)})
    except BaseException as e:
        return encode(error_reply("internal", e))


#: how a worker resolves a backend's spec: ``(spec, api) -> Backend``
Loader = Callable[[str, str | None], Backend]
_LOADER: list[Loader] = []


def set_loader(load: Loader) -> None:
    """Make ``load`` what workers resolve their backend with (the layer above the
    registry, `attnref.conformance.backends.load_backend`, sets it when imported). It
    reaches the worker as a reference to a module-level function, which the worker
    imports: the engine never imports the families."""
    _LOADER[:] = [load]


def loader() -> Loader:
    """The loader `set_loader` set; `BackendError` if none was."""
    if not _LOADER:
        raise BackendError(
            "no backend loader is set: import attnref.conformance.backends (it installs the "
            "API families) before starting a worker"
        )
    return _LOADER[0]


def _serve(
    conn: multiprocessing.connection.Connection,
    spec: str,
    api: str | None,
    threads: int,
    memory_limit: int | None,
    checking: bool,
    load: "Loader",
    env: dict[str, str | None] | None = None,
    scratch: str | None = None,
    policy: _sandbox.Policy | None = None,
    jobs: tuple[str, ...] = (),
) -> None:
    """The worker's loop: enter the sandbox (in ``scratch``, as ``policy`` allows) and
    say what it enforced, resolve the backend with ``load``, say what it declares, then
    answer job after job. ``env``: set (None: removed) before anything else
    (``CUDA_VISIBLE_DEVICES``, before CUDA starts). ``jobs``: modules that register more
    kinds of job (`HANDLERS`), imported before the backend."""
    for name, value in (env or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # its own process group, so that the judge can end what it starts
    die_with_parent()  # the forkserver, which itself ends with the judge
    if scratch is not None:
        _drop_resource_tracker()
        # from here the worker is one process of a PID namespace of its own (where the
        # kernel allows), ended with the one the judge started (which only waits)
        try:
            enforced = _sandbox.enter(scratch, policy)
            die_with_parent()
        except BaseException as e:  # attnref's own code: an error of ours, said as such
            conn.send_bytes(encode(error_reply("raised", e)))
            return
        conn.send_bytes(encode({"status": "ok", "value": enforced.message()}))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the audit's to handle
    faulthandler.disable()  # a crash is the audit's to report, in one line
    torch.set_num_threads(threads)
    set_checking(checking)  # as in the judge when the worker was asked for
    if memory_limit is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    try:
        for module in jobs:
            importlib.import_module(module)
        backend = load(spec, api)
        conn.send_bytes(encode({"status": "ok", "value": declaration(backend)}))
    except BaseException as e:
        conn.send_bytes(encode(error_reply("raised", e)))
        return
    while True:
        try:
            message = conn.recv_bytes()
            shared = None
            if message[: len(SHARED)] == SHARED:  # the tensors' bytes in a sealed file
                shared = map_shared(multiprocessing.reduction.recv_handle(conn))
                message = message[len(SHARED) :]
        except EOFError:
            return
        conn.send_bytes(handle(backend, decode(message, shared=shared)))
        del shared  # unmapped once the job's tensors are gone
        sys.stdout.flush()


def _drop_resource_tracker() -> None:
    """Close the pipe to the judge's resource tracker, which the worker inherited and does
    not use: on it, backend code could ask that process (outside any sandbox) to unlink
    the user's shared-memory segments and semaphores when the audit ends."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    fd = getattr(tracker, "_fd", None)
    if isinstance(fd, int):
        with contextlib.suppress(OSError):
            os.close(fd)
        tracker._fd = None  # type: ignore[attr-defined]


# ------------------------------------------------------------ the judge's side


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


#: the judge's own work to do while a job runs (`Executor.run`)
Meanwhile = Callable[[], None] | None


@runtime_checkable
class Executor(Protocol):
    """Runs jobs for one backend; ``slowest`` is its slowest answered job, in seconds;
    ``trusted``: whether the backend runs in the judge's own process; ``sandbox``: what
    confines its code (`Supervised.sandbox`)."""

    slowest: float
    trusted: bool
    backend: Backend
    sandbox: dict[str, dict[str, str]]

    def run(
        self, job: Job | Series | Probe | Any, timeout: float, meanwhile: Meanwhile = None
    ) -> Any:
        """What the job returns. Raises `Raised` (what the backend did wrong),
        `BackendDied`, ``TimeoutError`` after ``timeout`` seconds, or `InternalError`.
        ``meanwhile``: the judge's own work, done while the job runs where the executor
        can (a worker, in another process), else after it; it must not raise."""
        ...

    def close(self) -> None: ...


class InProcess:
    """Jobs in a daemon thread of this process; a job still running after its timeout is
    abandoned (the thread cannot be killed). The replies take the same path as a
    worker's (encoded, decoded), so every check holds, but the backend is trusted: its
    code runs in the judge's process."""

    trusted = True

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        #: nothing is enforced: the backend's code runs in the judge's process
        self.sandbox: dict[str, dict[str, str]] = {
            "enforced": {},
            "missing": {"all": "the backend runs in the judge's own process (--in-process)"},
            "allowed": {},
        }
        self.slowest = 0.0
        #: right outputs of earlier fresh_values calls, with their inputs' digests
        self.history: list[tuple[Tensor, str]] = []

    def run(self, job: Any, timeout: float, meanwhile: Meanwhile = None) -> Any:
        t0 = time.perf_counter()
        result: list[bytearray] = []
        message = decode(encode(job.message()))

        def target() -> None:
            result.append(handle(self.backend, message))

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        if meanwhile is not None:
            meanwhile()
        thread.join(max(0.0, timeout - (time.perf_counter() - t0)))
        if thread.is_alive():
            raise TimeoutError(f"no answer within {timeout:g} s")
        self.slowest = max(self.slowest, time.perf_counter() - t0)
        return read_reply(result[0])

    def close(self) -> None:
        pass


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


#: the socket buffers of a worker's connection: a case's tensors (megabytes at the long
#: sizes) then cross in a few large writes, not hundreds of the default's (about 200 KB),
#: each a switch between the two processes (a 10 MB round trip: 24 ms -> 9 ms)
PIPE_BUFFER = 4 << 20


def _widen(*conns: multiprocessing.connection.Connection) -> None:
    """Give the sockets of ``conns`` buffers of `PIPE_BUFFER` bytes (as far as the system
    allows: Linux caps them at ``net.core.wmem_max`` and ``rmem_max``); best effort."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            sock = socket.socket(fileno=os.dup(conn.fileno()))
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PIPE_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, PIPE_BUFFER)
            finally:
                sock.close()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "the worker process stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the backend's process was killed by {name} (signal {-code})"
    return f"the backend ended its process with exit code {code}"


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """The judge's ``__main__`` hidden while a worker starts: the worker needs only
    attnref, and multiprocessing would otherwise run the judge's script again there."""
    main = sys.modules["__main__"]
    saved: dict[str, Any] = {
        k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__
    }
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def start_forkserver() -> None:
    """Start the forkserver now, in the background of whatever the judge does next."""
    _forkserver.start()


class Supervised:
    """Jobs in a worker process behind the trust boundary, restarted after a crash or a
    timeout. The worker starts at once, before any case or oracle value exists.

    Args:
        backend: a spec (``module:function``, a built-in or ``mutant.NAME``), resolved in
            the worker only, its declaration read back as data (`backend`); or a `Backend`
            built by the caller, which the judge keeps (its declaration is the caller's)
            and the worker resolves by its ``spec``.
        api: the API family of a spec (default: sdpa; a built-in has its own).
        threads: torch intra-op threads in the worker.
        memory_limit: bytes of address space the worker may use (None: no limit).
        start_timeout: seconds the worker may take to import the backend.
        env: environment variables the worker sets (None: removes) first (a family's: the
            GPU of a rank).
        network: the worker may open sockets (a family whose processes talk to each
            other); its sandbox says so.
        jobs: modules the worker imports to take more kinds of job (`HANDLERS`: the
            bench's, ``attnref.bench.worker``).

    Raises:
        BackendError: the worker could not resolve the backend (its message says why),
            or sent a declaration the audit does not accept.
    """

    trusted = False

    def __init__(
        self,
        backend: Backend | str,
        api: str | None = None,
        *,
        threads: int = 1,
        memory_limit: int | None = None,
        start_timeout: float = 300.0,
        env: dict[str, str | None] | None = None,
        network: bool = False,
        jobs: tuple[str, ...] = (),
    ) -> None:
        self.spec = backend if isinstance(backend, str) else backend.spec or backend.name
        self.jobs = tuple(jobs)
        self.env = dict(env or {})
        self.policy = _sandbox.Policy(network=network)
        #: what the worker's sandbox enforced, as its first frame said (before any code of
        #: the backend's ran): ``{"enforced": {part: how}, "missing": {part: why}, "allowed":
        #: {part: why}}``
        self.sandbox: dict[str, dict[str, str]] = {}
        self._scratch: str | None = None
        self.api = api if isinstance(backend, str) else backend.api
        self.threads = threads
        self.memory_limit = memory_limit
        self.start_timeout = start_timeout
        self.restarts = 0
        self.slowest = 0.0
        #: right outputs of earlier fresh_values calls, with their inputs' digests
        self.history: list[tuple[Tensor, str]] = []
        self.last_read = 0.0  # seconds the last reply took to receive and decode
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._arena = Arena()  # the file large jobs' tensors cross in, reused
        declared = self._start()
        self.backend = declared if isinstance(backend, str) else backend

    def _start(self) -> Backend:
        ctx = _forkserver.context()  # a clean parent, never a fork of the judge
        parent, child = ctx.Pipe()
        _widen(parent, child)
        self._scratch = tempfile.mkdtemp(prefix="attnref-worker-")
        process = ctx.Process(
            target=_serve,
            args=(
                child,
                self.spec,
                self.api,
                self.threads,
                self.memory_limit,
                checking_enabled(),
                loader(),
                self.env,
                self._scratch,
                self.policy,
                self.jobs,
            ),
            daemon=True,
        )
        with _main_hidden():
            process.start()
        child.close()
        self._process, self._conn = process, parent
        try:
            if not parent.poll(self.start_timeout):
                raise BackendError(f"{self.spec}: its worker did not start in time")
            self.sandbox = _read_sandbox(
                receive_frame(parent, time.perf_counter(), DECLARATION_LIMIT), self.policy
            )
            if not parent.poll(self.start_timeout):
                raise BackendError(
                    f"{self.spec}: its worker did not finish importing it within "
                    f"{self.start_timeout:g} s"
                )
            first = receive_frame(parent, time.perf_counter(), DECLARATION_LIMIT)
        except FrameError as e:
            self._stop()
            raise BackendError(f"{self.spec}: {e} as its declaration") from None
        except (EOFError, OSError):
            process.join(5)
            self._stop()
            raise BackendError(
                f"{self.spec}: its worker ended while importing it: "
                f"{_describe_exit(process.exitcode)}"
            ) from None
        except BackendError:
            self._stop()
            raise
        try:
            return from_declaration(read_reply(first))
        except Raised as e:
            self._stop()
            error = e.error
            name = getattr(error, "type_name", type(error).__name__)
            text = str(error) if name == "BackendError" else f"{name}: {error}"
            raise BackendError(text) from None
        except (ValueError, TypeError) as e:
            self._stop()
            raise BackendError(f"{self.spec}: its worker sent a bad declaration: {e}") from None

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(Exception):
                if process.pid is not None:
                    os.killpg(process.pid, signal.SIGKILL)  # and whatever it started
            with contextlib.suppress(Exception):
                process.kill()
                process.join(5)
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None
        scratch, self._scratch = self._scratch, None
        if scratch is not None:  # what the worker wrote: not a byte outlives it
            shutil.rmtree(scratch, ignore_errors=True)

    def run(self, job: Any, timeout: float, meanwhile: Meanwhile = None) -> Any:
        # large tensors in a sealed file sent after the message, small ones in it
        message, fd = encode_shared(job.message(), self._arena)
        data = self.exchange(message, timeout, meanwhile, fd=fd)
        t1 = time.perf_counter()
        try:
            return read_reply(data)
        finally:  # decoding the reply, on the judge's clock
            self.last_read += time.perf_counter() - t1

    def exchange(
        self,
        message: bytes | bytearray,
        timeout: float,
        meanwhile: Meanwhile = None,
        fd: int | None = None,
    ) -> bytes | bytearray:
        """An encoded job in, the worker's reply out as it came: untrusted bytes, for
        `attnref.conformance.wire.decode` (``run`` decodes them; a relay forwards them).
        ``meanwhile`` runs here while the worker computes; ``timeout`` counts from the
        send, and a reply that came while ``meanwhile`` ran is read at once. ``fd``: the
        sealed file of `attnref.conformance.wire.encode_shared`, sent after the message
        and closed here.

        Raises:
            TimeoutError: no answer within ``timeout`` seconds (the worker was killed).
            BackendDied: the worker's process ended.
        """
        if self._conn is None:
            self._start()
        conn = self._conn
        assert conn is not None
        # what the reply may hold: four times the job (its file's size included)
        limit = REPLY_SLACK + 4 * (len(message) + (0 if fd is None else os.fstat(fd).st_size))
        t0 = time.perf_counter()
        try:
            conn.send_bytes(message)
            if fd is not None:
                multiprocessing.reduction.send_handle(conn, fd, 0)  # (a pid: Windows')
        except OSError:  # the pipe broke: the worker is gone
            raise self._died() from None
        finally:
            if fd is not None:
                os.close(fd)
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException:  # its reply would be left in the pipe: end the worker
                self._stop()
                raise
        try:
            if not conn.poll(max(0.0, timeout - (time.perf_counter() - t0))):
                self._stop()
                self.restarts += 1
                raise TimeoutError(f"no answer within {timeout:g} s (the worker was killed)")
            t1 = time.perf_counter()
            data = self._receive(conn, t0 + timeout, limit)
            # from the send: the judge's work meanwhile too, where it took longer
            self.slowest = max(self.slowest, time.perf_counter() - t0)
            self.last_read = time.perf_counter() - t1  # receiving it, on the judge's clock
        except TimeoutError:
            raise
        except (EOFError, OSError):  # the pipe broke: the worker is gone
            raise self._died() from None
        return data

    def _receive(self, conn: Any, deadline: float, limit: int) -> bytes | bytearray:
        """The worker's reply, read on the judge's clock with a size limit
        (`receive_frame`): a frame larger than the job allows, or one that stalls, ends
        the worker and is reported as what it is."""
        try:
            return receive_frame(conn, deadline, limit)
        except FrameError as e:
            self._stop()
            self.restarts += 1
            if e.stalled:  # a call that did not answer in time, as a hang is
                raise TimeoutError(f"{e} (the worker was ended)") from None
            raise BackendDied(f"{e} (the worker was ended)") from None

    def _died(self) -> BackendDied:
        """The worker's process ended (its pipe broke): it is stopped and counted."""
        process = self._process
        if process is not None:
            process.join(5)
        code = None if process is None else process.exitcode
        self._stop()
        self.restarts += 1
        return BackendDied(_describe_exit(code))

    def close(self) -> None:
        self._stop()
        self._arena.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


#: what a reply may hold beyond four times its job's bytes: outputs, gradients and
#: caches come from the inputs and are no larger, but for a few shapes (many queries
#: against few keys of a tiny head dim)
REPLY_SLACK = 256 * 2**20
#: the largest declaration a worker may send (a few KiB in practice)
DECLARATION_LIMIT = 2**20
#: how fast a worker must write a reply once it has begun (bytes a second), after a
#: grace of `FRAME_GRACE` seconds past the call's deadline
FRAME_RATE = 100 * 2**20
FRAME_GRACE = 5.0


def _read_sandbox(frame: bytes | bytearray, policy: _sandbox.Policy) -> dict[str, dict[str, str]]:
    """The worker's first frame (its sandbox, sent by attnref's code before the backend
    loaded), checked; what ``policy`` leaves open is listed as ``allowed``."""
    try:
        value = read_reply(frame)
    except Raised as e:
        raise BackendError(f"its worker could not enter its sandbox: {e.error}") from None
    parts = {}
    for key in ("enforced", "missing"):
        part = value.get(key) if isinstance(value, dict) else None
        if not isinstance(part, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in part.items()
        ):
            raise BackendError("its worker sent a malformed sandbox record")
        parts[key] = dict(part)
    parts["allowed"] = policy.allowed()
    return parts


class FrameError(Exception):
    """A reply frame that announced more than it may hold, or stalled before it was
    whole (``stalled``; the worker's doing: its own process wrote it)."""

    def __init__(self, message: str, stalled: bool = False) -> None:
        super().__init__(message)
        self.stalled = stalled


def receive_frame(conn: Any, deadline: float, limit: int) -> bytes | bytearray:
    """One frame of ``multiprocessing.connection.Connection.send_bytes`` read from
    ``conn`` without trusting it: the length it announces (4 bytes, or -1 and 8 more) must
    be at most ``limit``, and the whole frame must arrive by ``deadline`` (a
    `time.perf_counter` reading) plus `FRAME_GRACE` seconds and its size at `FRAME_RATE`.
    Where the platform has no ``select`` on the pipe (Windows), ``conn.recv_bytes()``.

    Raises:
        FrameError: it announced more than ``limit``, or stalled (how much came of it).
        EOFError: the pipe closed (the worker is gone).
    """
    if os.name == "nt":  # pragma: no cover - select() takes sockets only there
        data: bytes = conn.recv_bytes()
        return data
    fd = conn.fileno()
    until = deadline + FRAME_GRACE
    (size,) = struct.unpack("!i", _exactly(fd, 4, until, "its header"))
    if size == -1:
        (size,) = struct.unpack("!Q", _exactly(fd, 8, until, "its header"))
    if size < 0 or size > limit:
        raise FrameError(
            f"its worker announced a reply of {size:,} bytes, more than the {limit:,} its "
            "job allows"
        )
    return _exactly(fd, size, until + size / FRAME_RATE, f"a reply of {size:,} bytes")


def _exactly(fd: int, n: int, until: float, what: str) -> bytearray:
    """``n`` bytes from ``fd`` by ``until``, read into one buffer."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = until - time.perf_counter()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise FrameError(f"its worker sent {got:,} bytes of {what}, then nothing", True)
        read = os.readv(fd, [view[got:]])
        if read == 0:
            raise EOFError
        got += read
    return buf


def start_executor(
    backend: Backend | str,
    api: str | None = None,
    *,
    isolate: bool = True,
    threads: int = 1,
    memory_limit: int | None = None,
    world_size: int | None = None,
    require_sandbox: bool = False,
    jobs: tuple[str, ...] = (),
) -> "Executor":
    """Where ``backend``'s code will run, as its family says (`ApiFamily.executor`):
    by default one supervised worker (``isolate``) or a thread of this process.
    ``world_size``: the processes one call runs on, for a family that spreads a call
    over several (None: the family's default). A built-in name given without ``api`` is
    looked up here to find its family (our code: nothing of the backend's runs).

    ``require_sandbox``: a sandbox the platform does not wholly enforce is an error.
    ``jobs``: modules every worker imports to take more kinds of job (`Supervised`).

    Raises:
        BackendError: the backend cannot be resolved or started, ``world_size`` is
            given to a family that runs on one process, or ``require_sandbox`` is not met.
    """
    executor = _start_executor(backend, api, isolate, threads, memory_limit, world_size, jobs)
    missing = executor.sandbox.get("missing") or {}
    if require_sandbox and missing:
        executor.close()
        raise BackendError(
            "--require-sandbox: the backend's worker is not wholly confined: "
            + "; ".join(f"{part}: {why}" for part, why in missing.items())
        )
    return executor


def _start_executor(
    backend: Backend | str,
    api: str | None,
    isolate: bool,
    threads: int,
    memory_limit: int | None,
    world_size: int | None,
    jobs: tuple[str, ...] = (),
) -> "Executor":
    if isinstance(backend, Backend):
        api = backend.api
    elif api is None and ":" not in backend:
        api = loader()(backend, None).api
    family = FAMILIES.get(api or DEFAULT_API)
    if family is not None and family.executor is not None:
        made: Executor = family.executor(
            backend,
            api,
            isolate=isolate,
            threads=threads,
            memory_limit=memory_limit,
            world_size=world_size or family.world_size,
            jobs=jobs,
        )
        return made
    if world_size not in (None, 1):
        raise BackendError(
            f"world size {world_size}: the {api or DEFAULT_API!r} family runs each call on "
            "one process"
        )
    if isolate:
        return Supervised(backend, api, threads=threads, memory_limit=memory_limit, jobs=jobs)
    for module in jobs:  # the judge's own process takes them too
        importlib.import_module(module)
    return InProcess(loader()(backend, api) if isinstance(backend, str) else backend)
