"""Where backend code runs: a supervised worker process, or (``--in-process``) a thread.

A backend under audit may do anything to the process it runs in: exit (with any code),
segfault, abort, hang, allocate without bound. The audit's verdict must survive all of
it, so by default backend code runs in one long-lived worker process that the audit
supervises (`Supervised`): a call that never answers is killed after its timeout, a
worker that dies in the middle of a call is reported with its exit code or signal, and
either way a fresh worker serves the next call. The worker is forked where that is safe
(Linux, CUDA not initialised in the audit's process) and spawned otherwise; a spawned
worker resolves the backend again by its name.

A `Job` is what crosses into the worker: the call's arguments (and, for the gradient
property, the output's gradient). The worker also checks that the backend left its
inputs exactly as it got them, bit for bit.

`InProcess` runs the same jobs in a daemon thread of the audit's own process, as before
(``--in-process``, for debugging a backend with pdb or a profiler).
"""

import contextlib
import ctypes
import faulthandler
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Shaped
from torch import Tensor

from attnref._checking import checked_internal
from attnref.conformance.backends import Backend

__all__ = ["BackendDied", "Executor", "InProcess", "Job", "ModifiedInputs", "Raised", "Supervised"]


class Raised(Exception):  # noqa: N818 (a wrapper, not an error of ours)
    """What the backend raised (``.error``), carried out of the executor as it was, so
    that the audit's own interrupts (Ctrl-C in this process) are never mistaken for it."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class BackendDied(Exception):  # noqa: N818 (a verdict: the backend ended its process)
    """The worker process ended during a call: ``str()`` says how (exit code or signal)."""


class ModifiedInputs(Exception):  # noqa: N818 (a verdict on the backend)
    """The backend changed a tensor it was given."""


class _Packed:
    """A CPU tensor as plain data: its storage's bytes and how it views them (dtype,
    shape, strides, offset), so that layouts (transposed, sliced, stride 0) cross the
    pipe as they are. Much cheaper than pickling the tensor itself."""

    __slots__ = ("data", "dtype", "offset", "shape", "stride")

    def __init__(self, t: Shaped[Tensor, "..."]) -> None:
        storage = t.untyped_storage()
        self.data = ctypes.string_at(storage.data_ptr(), storage.nbytes())
        self.dtype = str(t.dtype).removeprefix("torch.")
        self.shape, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()

    def tensor(self) -> Shaped[Tensor, "..."]:
        dtype = getattr(torch, self.dtype)
        raw = (
            torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
            if self.data
            else torch.empty(0, dtype=torch.uint8)
        )
        return raw.view(dtype).as_strided(self.shape, self.stride, self.offset)


def _pack(obj: Any) -> Any:
    """``obj`` with every CPU tensor in it (in a `Job`, tuples, lists, dicts) as `_Packed`."""
    if isinstance(obj, Tensor) and obj.device.type == "cpu" and not obj.requires_grad:
        return _Packed(obj)
    if isinstance(obj, Job):
        return Job(_pack(obj.args), _pack(obj.kwargs), _pack(obj.d_out), obj.writable)
    if isinstance(obj, tuple | list):
        return type(obj)(_pack(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    return obj


def _unpack(obj: Any) -> Any:
    if isinstance(obj, _Packed):
        return obj.tensor()
    if isinstance(obj, Job):
        return Job(_unpack(obj.args), _unpack(obj.kwargs), _unpack(obj.d_out), obj.writable)
    if isinstance(obj, tuple | list):
        return type(obj)(_unpack(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _unpack(v) for k, v in obj.items()}
    return obj


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(_pack(obj), protocol=pickle.HIGHEST_PROTOCOL)


def _loads(data: bytes) -> Any:
    return _unpack(pickle.loads(data))


@checked_internal
def _fingerprint(t: Shaped[Tensor, "..."]) -> tuple[Any, ...]:
    """Shape, strides, offset and every byte of ``t``: equal only if nothing changed (NaN
    compared as bits, so a NaN left in place is unchanged)."""
    data = t.detach().contiguous().cpu()
    raw = data.view(torch.uint8) if data.element_size() == 1 else data.view(-1).view(torch.uint8)
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, raw.clone())


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[:4] == b[:4] and torch.equal(a[4], b[4])


@dataclass
class Job:
    """One call of backend code: ``backend(*args, **kwargs)``; with ``d_out``, also the
    backward pass, returning ``(dQ, dK, dV)`` for the first three arguments.

    ``writable``: the positional arguments the backend may change in place (a KV cache
    it appends to); the job then returns ``(result, those arguments as it left them)``,
    so that a supervised worker sends them back to be judged.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    d_out: Tensor | None = None
    writable: tuple[int, ...] = ()

    def run(self, backend: Backend) -> Any:
        args, kwargs = self.args, self.kwargs
        sinks = None
        if self.d_out is not None:  # the query, key and value (and sinks) become leaves
            args = (*(t.detach().requires_grad_(True) for t in args[:3]), *args[3:])
            if isinstance(kwargs.get("sinks"), Tensor):
                sinks = kwargs["sinks"].detach().requires_grad_(True)
                kwargs = {**kwargs, "sinks": sinks}
        tensors = [
            (f"argument {i}", t)
            for i, t in enumerate(args)
            if isinstance(t, Tensor) and i not in self.writable
        ] + [(k, t) for k, t in kwargs.items() if isinstance(t, Tensor)]
        before = [_fingerprint(t) for _, t in tensors]
        out: Any = backend(*args, **kwargs)
        if self.d_out is not None:
            if not isinstance(out, Tensor) or not out.requires_grad:
                raise RuntimeError("the output does not require grad: no gradient reaches Q, K, V")
            # backward() as a training loop calls it (torch.autograd.grad would refuse a
            # reentrant torch.utils.checkpoint inside the backend)
            torch.autograd.backward(out, self.d_out)
            leaves = (*args[:3], *(() if sinks is None else (sinks,)))
            out = tuple(None if t.grad is None else t.grad.detach() for t in leaves)
        changed = [
            name
            for (name, t), b in zip(tensors, before, strict=True)
            if not _same(_fingerprint(t), b)
        ]
        if changed:
            names = {"argument 0": "query", "argument 1": "key", "argument 2": "value"}
            raise ModifiedInputs(
                "the backend modified its inputs: " + ", ".join(names.get(n, n) for n in changed)
            )
        result = out.detach() if isinstance(out, Tensor) else out
        if self.writable:
            return result, tuple(args[i] for i in self.writable)
        return result


@runtime_checkable
class Executor(Protocol):
    """Runs jobs for one backend; ``slowest`` is its slowest answered job, in seconds."""

    slowest: float

    def run(self, job: Job, timeout: float) -> Any:
        """What the job returns. Raises `Raised` (what the backend raised, including
        `ModifiedInputs`), `BackendDied`, or ``TimeoutError`` after ``timeout`` seconds."""
        ...

    def close(self) -> None: ...


class InProcess:
    """Jobs in a daemon thread of this process; a job still running after its timeout is
    abandoned (the thread cannot be killed)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.slowest = 0.0

    def run(self, job: Job, timeout: float) -> Any:
        t0 = time.perf_counter()
        result: list[Any] = []
        error: list[BaseException] = []

        def target() -> None:
            try:
                result.append(job.run(self.backend))
            except BaseException as e:
                error.append(e)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"no answer within {timeout:g} s")
        self.slowest = max(self.slowest, time.perf_counter() - t0)
        if error:
            raise Raised(error[0])
        return result[0]

    def close(self) -> None:
        pass


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


def _serve(
    conn: multiprocessing.connection.Connection,
    backend: Backend | None,
    spec: str,
    api: str,
    threads: int,
    memory_limit: int | None,
) -> None:
    """The worker's loop: receive a pickled job, run it, send back a pickled result."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the audit's to handle
    faulthandler.disable()  # a crash is the audit's to report, in one line
    torch.set_num_threads(threads)
    if memory_limit is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    if backend is None:  # spawned: resolve the backend again, by name
        from attnref.conformance.options import load_backend

        backend = load_backend(spec, api)
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            return
        job: Job = _loads(message)
        try:
            reply = ("ok", job.run(backend))
        except BaseException as e:
            reply = ("error", e)
        try:
            data = _dumps(reply)
        except Exception as e:  # an unpicklable result or exception: say what it was
            data = _dumps(("error", RuntimeError(f"{type(e).__name__}: {e}")))
        conn.send_bytes(data)
        sys.stdout.flush()


class Supervised:
    """Jobs in a long-lived worker process, restarted after a crash or a timeout.

    Args:
        backend: what the worker calls.
        threads: torch intra-op threads in the worker.
        memory_limit: bytes of address space the worker may use (None: no limit).
    """

    def __init__(
        self, backend: Backend, *, threads: int = 1, memory_limit: int | None = None
    ) -> None:
        self.backend = backend
        self.threads = threads
        self.memory_limit = memory_limit
        self.restarts = 0
        self.slowest = 0.0
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None

    def _start(self) -> multiprocessing.connection.Connection:
        cuda_ready: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        fork = sys.platform.startswith("linux") and not cuda_ready
        ctx = multiprocessing.get_context("fork" if fork else "spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(  # type: ignore[attr-defined]
            target=_serve,
            args=(
                child,
                self.backend if fork else None,
                self.backend.name,
                self.backend.api,
                self.threads,
                self.memory_limit,
            ),
            daemon=True,
        )
        process.start()
        child.close()
        self._process, self._conn = process, parent
        return parent

    def _stop(self) -> None:
        if self._process is not None:
            with contextlib.suppress(Exception):
                self._process.kill()
                self._process.join(5)
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._process = self._conn = None

    def run(self, job: Job, timeout: float) -> Any:
        conn = self._conn or self._start()
        t0 = time.perf_counter()
        try:
            conn.send_bytes(_dumps(job))
            if not conn.poll(timeout):
                self._stop()
                self.restarts += 1
                raise TimeoutError(f"no answer within {timeout:g} s (the worker was killed)")
            status, value = _loads(conn.recv_bytes())
            self.slowest = max(self.slowest, time.perf_counter() - t0)
        except TimeoutError:
            raise
        except (EOFError, OSError):  # the pipe broke: the worker is gone
            process = self._process
            if process is not None:
                process.join(5)
            code = None if process is None else process.exitcode
            self._stop()
            self.restarts += 1
            raise BackendDied(_describe_exit(code)) from None
        if status == "error":
            raise Raised(value)
        return value

    def close(self) -> None:
        self._stop()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._stop()
