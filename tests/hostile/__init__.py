"""Backends that attack the judge instead of computing attention (class 31).

Each is a pattern of the table "Gaming the judge" in BUG_CLASSES.md, written in plain
torch, away from the mutant switches (`attnref.conformance.mutants` plants attention
bugs; these plant attacks on the harness). Importable as ``tests.hostile:NAME``; the
attacks that happen at import time are modules of their own (``tests.hostile.at_exit``,
``tests.hostile.patches_torch``, ``tests.hostile.slow_clock``). `tests.test_hostile`
audits and benches every one of them.
"""

import itertools
import os
import threading
import time
from typing import Any

import torch
from torch import Tensor

from tests.torch_sdpa import sdpa


def _sdpa(*args: Any, **kwargs: Any) -> Tensor:
    return sdpa(*args, **kwargs)


def returns_zeros(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Zeros of the right shape: passes an absolute tolerance on small outputs."""
    return q.new_zeros((*q.shape[:-1], v.shape[-1]))


def returns_empty(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``torch.empty``: whatever the allocator's freed memory held (the reference's
    result, in a harness that shares a process with it)."""
    return torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)


def zeroes_inputs(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Zeroes its inputs, then returns zeros: a reference run afterwards on the same
    tensors would agree."""
    for t in (q, k, v):
        t.zero_()
    return returns_zeros(q, k, v)


_BY_POINTER: dict[tuple[int, ...], Tensor] = {}


def replays_by_pointer(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Computes once per set of buffer addresses and replays the result after."""
    key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), *q.shape, *v.shape)
    if key not in _BY_POINTER:
        _BY_POINTER[key] = _sdpa(q, k, v, *args, **kwargs)
    return _BY_POINTER[key].clone()


_BY_SHAPE: dict[tuple[Any, ...], Tensor] = {}


def replays_by_shape(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Computes once per shape and replays the result for any values of that shape
    ("pointer-keyed graphs, stale preprocessing")."""
    mask = kwargs.get("attn_mask", args[0] if args else None)
    key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, mask is None, str(kwargs))
    if key not in _BY_SHAPE:
        _BY_SHAPE[key] = _sdpa(q, k, v, *args, **kwargs)
    return _BY_SHAPE[key].clone()


_CALLS = [0]


def right_once_then_stale(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Computes every call but every third returns the previous call's output."""
    _CALLS[0] += 1
    out = _sdpa(q, k, v, *args, **kwargs)
    last = _BY_SHAPE.get(("last", out.shape))
    _BY_SHAPE[("last", out.shape)] = out
    return last.clone() if _CALLS[0] % 3 == 0 and last is not None else out


def tuned_for_benchmark_shapes(
    q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any
) -> Tensor:
    """Right when every length and the head dim are powers of two (a public benchmark's
    shapes), zeros elsewhere."""
    sizes = (q.shape[-2], k.shape[-2], q.shape[-1])
    if all(s > 0 and s & (s - 1) == 0 for s in sizes):
        return _sdpa(q, k, v, *args, **kwargs)
    return returns_zeros(q, k, v)


def fills_in_background(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Returns a zeroed buffer at once and fills it from a thread shortly after, a tenth
    of its rows every 10 ms: on a loaded machine the judge's snapshot of the output may
    come tens of milliseconds after the return, and a change must still follow it."""
    out = returns_zeros(q, k, v)

    def fill() -> None:
        right = _sdpa(q, k, v, *args, **kwargs)
        rows = list(itertools.product(*(range(n) for n in out.shape[:-1])))
        for part in range(10):
            time.sleep(0.01)
            for i in rows[part::10]:
                out[i] = right[i]

    threading.Thread(target=fill, name="hostile-filler", daemon=True).start()
    return out


def fills_in_background_fast(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Computes the right output, returns it, and scribbles over it from a thread once
    the caller has had a first look (a race a check at the return alone misses)."""
    out = _sdpa(q, k, v, *args, **kwargs)

    def scribble() -> None:
        time.sleep(0.02)
        out.zero_()

    threading.Thread(target=scribble, name="hostile-scribbler", daemon=True).start()
    return out


class LazyTensor(torch.Tensor):
    """A tensor subclass that computes only when something reads it."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]


def returns_lazy_subclass(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Returns a tensor subclass: what the checker reads is the subclass's to decide."""
    out: Tensor = _sdpa(q, k, v, *args, **kwargs).as_subclass(LazyTensor)
    return out


class _ExitsWhenUnpickled:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os._exit, (0,))


def replies_with_exit(*args: Any, **kwargs: Any) -> Any:
    """Returns an object whose unpickling ends the process that reads it with code 0."""
    return _ExitsWhenUnpickled()


class ExitingError(RuntimeError):
    """An exception whose unpickling ends the process that reads it with code 0."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os._exit, (0,))


def raises_with_exit(*args: Any, **kwargs: Any) -> Tensor:
    """Raises an `ExitingError`."""
    raise ExitingError("caught me")


def refuses_everything(*args: Any, **kwargs: Any) -> Tensor:
    """Declares every error a refusal, then refuses every call."""
    raise NotImplementedError("not supported")


def _declare() -> None:
    from attnref.conformance import Capabilities

    refuses_everything.capabilities = Capabilities(refuses=("",))  # type: ignore[attr-defined]


_declare()


def side_stream(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """CUDA: computes on a side stream after a long sleep there, and returns without
    making the caller's stream wait (timing events on the current stream miss the work,
    and a reader of the output at the return sees zeros). On the CPU: returns zeros."""
    out = returns_zeros(q, k, v)
    if not q.is_cuda:
        return out
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
        out.copy_(_sdpa(q, k, v, *args, **kwargs))
    return out


_DECODES: dict[tuple[Any, ...], Any] = {}


def kvcache_replays_by_shape(q: Tensor, k_cache: Tensor, v_cache: Tensor, **kwargs: Any) -> Any:
    """A decode kernel (flash-kvcache) that computes once per shape and replays after."""
    from attnref.kvcache import kvcache_attention

    key = (tuple(q.shape), tuple(k_cache.shape), "block_table" in kwargs)
    if key not in _DECODES:
        _DECODES[key] = kvcache_attention(q, k_cache, v_cache, **kwargs)
    return _DECODES[key].clone()


def _declare_decode() -> None:
    from attnref.conformance import BUILTIN_BACKENDS

    caps = BUILTIN_BACKENDS["kvcache-reference"].capabilities
    kvcache_replays_by_shape.capabilities = caps  # type: ignore[attr-defined]


_declare_decode()
