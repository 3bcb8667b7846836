"""The side of the worker that runs in its process, behind the sandbox: the second of the
worker's three parts (`attnref.conformance.worker` has the whole).

`serve` is the worker's loop: enter the sandbox (`attnref._sandbox`) and say what it
enforced, import the modules that register more kinds of job (`HANDLERS`: the bench's),
resolve the backend with the loader the layer above set (`set_loader`), say what it
declares, then answer job after job (`handle`). Around each call it checks that the
backend left its inputs as it got them, snapshots the output the moment the call returns,
and reads it again a moment later when the backend left a thread running.
"""

import contextlib
import faulthandler
import importlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Shaped
from torch import Tensor

from attnref import _sandbox
from attnref._checking import checked_internal, set_checking
from attnref._dies_with_parent import die_with_parent
from attnref.conformance.declarations import (
    Backend,
    BackendError,
    declaration,
)
from attnref.conformance.family import FAMILIES
from attnref.conformance.jobs import error_reply
from attnref.conformance.wire import (
    GUARD,
    SHARED,
    Rejected,
    broken_guards,
    decode,
    encode,
    map_shared,
)

__all__ = [
    "HANDLERS",
    "Loader",
    "handle",
    "invoke_backend",
    "loader",
    "rewrite",
    "serve",
    "set_loader",
    "snapshot",
]


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


def _encode_unsupported(obj: Any) -> Any:
    """The snapshot with `_Unsupported` markers as the wire's ``unsupported`` nodes."""
    if isinstance(obj, _Unsupported):
        raise Rejected(obj.what)
    if type(obj) in (tuple, list):
        return type(obj)(_encode_unsupported(x) for x in obj)
    if type(obj) is dict:
        return {k: _encode_unsupported(v) for k, v in obj.items()}
    return obj


#: what a module that sets up Triton's interpreter itself, undeclared, is told
UNDECLARED_TRITON = (
    "its module sets TRITON_INTERPRET=1 but does not declare interpreter='triton': audited "
    "as declared (imported again after attnref set the interpreter up, at the sizes and "
    "timeouts of an interpreted kernel); declare it to say so"
)


def _declared(backend: Backend, interpreter: str | None) -> dict[str, Any]:
    """``backend``'s declaration as the worker sends it. A kernel run through an
    interpreter declares it: where its module set ``TRITON_INTERPRET=1`` at import
    without declaring ``interpreter="triton"`` (it was given a native kernel's sizes and
    60 s timeouts, and failed 35 properties for them), the declaration says "triton"
    and a note says why; where the worker set an interpreter up, the declaration names
    it."""
    said = declaration(backend)
    caps = said["capabilities"]
    if not caps["interpreter"] and interpreter:
        caps["interpreter"] = interpreter
    elif not caps["interpreter"] and os.environ.get("TRITON_INTERPRET") == "1":
        caps["interpreter"] = "triton"
        said["note"] = UNDECLARED_TRITON
    if interpreter == "triton":  # its autotuned kernels, defined as its module imported
        from attnref.interpreted import autotuned

        said["autotuned"] = autotuned()
    return said


#: the storages of the job at hand, whose guard bytes the worker reads after a call
#: (`attnref.conformance.wire.decode`'s ``guards``: address, size)
GUARDS: dict[int, int] = {}


def _call(backend: Backend, job: dict[str, Any], buffers: tuple[Any, Any] | None = None) -> Any:
    """Run one call job in this (the worker's) process; a reply tree."""
    args, kwargs = buffers if buffers is not None else (tuple(job["args"]), dict(job["kwargs"]))
    d_out, writable, recheck = job["d_out"], tuple(job["writable"]), float(job["recheck"])
    chosen: list[Tensor] = []
    leaf_names = [n if type(n) is str else int(n) for n in job.get("leaves") or ()]
    if d_out is not None and leaf_names:  # the arguments named become leaves
        args, kwargs = list(args), dict(kwargs)
        for n in leaf_names:
            box: Any = kwargs if isinstance(n, str) else args
            box[n] = box[n].detach().requires_grad_(True)
            chosen.append(box[n])
        args = tuple(args)
    elif d_out is not None:  # the query, key and value (and sinks) become leaves
        args = (*(t.detach().requires_grad_(True) for t in args[:3]), *args[3:])
        chosen = list(args[:3])
        if isinstance(kwargs.get("sinks"), Tensor):
            kwargs = {**kwargs, "sinks": kwargs["sinks"].detach().requires_grad_(True)}
            chosen.append(kwargs["sinks"])
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
            # backward() as a training loop calls it (torch.autograd.grad would refuse a
            # reentrant torch.utils.checkpoint inside the backend)
            torch.autograd.backward(*_backward_pairs(out, d_out))
            out = tuple(None if t.grad is None else t.grad.detach() for t in chosen)
        if writable:
            out = (out, tuple(args[i] for i in writable))
        if out is not None and type(out) is Tensor:
            out = out.detach()
        value = snapshot(out)  # as it stood when the call returned
    except BaseException as e:
        return error_reply("raised", e)
    family = FAMILIES.get(backend.api)
    name_of = (lambda i: f"argument {i}") if family is None else family.argument_name

    def named(n: str) -> str:
        return name_of(int(n.split()[1])) if n.startswith("argument ") else n

    every = [(f"argument {i}", t) for i, t in enumerate(args) if isinstance(t, Tensor)]
    every += [(k, t) for k, t in kwargs.items() if isinstance(t, Tensor)]
    past = []  # writable ones too: a cache appended past its end
    for n, t in every:
        side = (
            broken_guards(GUARDS, t.untyped_storage().data_ptr())
            if t.device.type == "cpu"
            else None
        )
        if side is not None:
            past.append(f"{named(n)} ({GUARD} guard bytes {side} changed)")
    if past:
        return {"status": "past", "names": past}
    changed = [
        name
        for (name, t), b in zip(tensors, before, strict=True)
        if not _same(_fingerprint(t, copy=False), b)
    ]
    if changed:
        return {"status": "modified", "names": [named(n) for n in changed]}
    left = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
    if left or recheck > 0:
        late = _late_write(out, value, max(recheck, 0.05), left)
        if late is not None:
            return {"status": "late", "message": late}
    try:
        return {"status": "ok", "value": _encode_unsupported(value)}
    except Rejected as e:
        return {"status": "unaccepted", "message": str(e)}


def _backward_pairs(out: Any, d_out: Any) -> tuple[list[Tensor], list[Tensor]]:
    """The results and their upstream gradients a backward pass starts from: ``out``
    itself for one ``d_out``; for a tuple of them, each part of the tuple ``out`` given
    one (a clear error where a part cannot take it)."""
    if not isinstance(d_out, tuple | list):
        if not isinstance(out, Tensor) or not out.requires_grad:
            raise RuntimeError("the output does not require grad: no gradient reaches Q, K, V")
        return [out], [d_out]
    if not isinstance(out, tuple | list) or len(out) != len(d_out):
        raise RuntimeError(
            f"the backward needs a tuple of {len(d_out)} results, the backend returned "
            f"{type(out).__name__}"
        )
    parts, grads = [], []
    for i, (o, d) in enumerate(zip(out, d_out, strict=True)):
        if d is None:
            continue
        if not isinstance(o, Tensor) or not o.requires_grad:
            raise RuntimeError(
                f"result {i} does not require grad: its upstream gradient reaches no input"
            )
        parts.append(o)
        grads.append(d)
    return parts, grads


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


#: where a worker's stdout and stderr go, in its scratch folder: the backend's, which the
#: judge reads after each job (`attnref.conformance.executors.Supervised.output`) and
#: prints only when asked (a library's own logging ran to 12 MB around an audit's lines)
OUTPUT_FILE = "output.log"
#: set to ``show`` in the judge's environment: the backend's stdout and stderr go where
#: the judge's go, as they come (to watch a backend's own logging, or a test's marks)
SHOW_OUTPUT = "ATTNREF_BACKEND_OUTPUT"


def _capture_output(scratch: str) -> None:
    """File descriptors 1 and 2 (the C library's and Python's) into `OUTPUT_FILE`,
    appended to, so that the judge may empty it between jobs."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    fd = os.open(os.path.join(scratch, OUTPUT_FILE), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def serve(
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
    capture: bool = True,
    interpreter: str = "",
) -> None:
    """The worker's loop: enter the sandbox (in ``scratch``, as ``policy`` allows) and
    say what it enforced, resolve the backend with ``load``, say what it declares, then
    answer job after job. ``env``: set (None: removed) before anything else
    (``CUDA_VISIBLE_DEVICES``, before CUDA starts). ``jobs``: modules that register more
    kinds of job (`HANDLERS`), imported before the backend. ``capture``: its stdout and
    stderr go to `OUTPUT_FILE` (else where the judge's go: `SHOW_OUTPUT`).
    ``interpreter``: set up, and checked, before the backend's module is imported
    (`attnref.interpreted.prepare`); what it said goes in the first frame."""
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
        said: dict[str, Any] = dict(enforced.message())
        if interpreter:
            from attnref.interpreted import prepare

            said["interpreter"] = prepare(interpreter, scratch)
        conn.send_bytes(encode({"status": "ok", "value": said}))
        if capture:
            _capture_output(scratch)
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
        conn.send_bytes(encode({"status": "ok", "value": _declared(backend, interpreter)}))
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
        GUARDS.clear()
        conn.send_bytes(handle(backend, decode(message, shared=shared, guards=GUARDS)))
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
