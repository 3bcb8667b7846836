"""Each interpreter's check of itself: a kernel of attnref's own, known to be right, run
through the interpreter in every dtype and compared with float64 attention computed by
torch. A dtype whose error passes its bound is left out of the audit, with the error
measured: the interpreter's, not the kernel under audit's (`attnref.interpreted`).
"""

import math
from typing import Any

import torch
from jaxtyping import Float, Float64
from torch import Tensor

from attnref._checking import checked_internal

__all__ = ["BOUNDS", "pallas_self_check", "triton_self_check"]

#: the error (in units of V, whose values are standard normal) a right kernel stays
#: under in each dtype: a few roundings of the output and of P, with room to spare; an
#: interpreter that breaks a dtype misses by far more (Triton 3.9 in bfloat16: 8e8)
BOUNDS = {"float64": 1e-9, "float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}


@checked_internal
def _attention(
    q: Float[Tensor, "B Tq h D"],
    k: Float[Tensor, "B Tk g D"],
    v: Float[Tensor, "B Tk g Dv"],
    causal: bool,
) -> Float64[Tensor, "B Tq h Dv"]:
    """float64 attention of ``(B, T, h, D)`` tensors, GQA, bottom-right causal."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        Tq, Tk = scores.shape[-2:]
        seen = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
        scores = scores.masked_fill(~seen, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _verdicts(
    errors: dict[str, float], what: str, raised: dict[str, str] | None = None
) -> dict[str, Any]:
    out = {
        d: f"{what} is off by {e:.3g} in {d} (a right kernel stays under {BOUNDS[d]:g})"
        for d, e in errors.items()
        if not e <= BOUNDS[d]  # NaN included
    }
    out.update({d: f"{what} cannot run in {d}: {why}"[:300] for d, why in (raised or {}).items()})
    if len(out) == len(BOUNDS):
        raise RuntimeError("; ".join(out.values()))
    return {"dtypes_out": out, "checked": {d: float(e) for d, e in errors.items()}}


def triton_self_check() -> dict[str, Any]:
    """attnref's Triton flash kernel in every dtype, on a case that crosses its tiles
    (37 queries against 50 keys, 16-row tiles, causal, two query heads per KV head), and
    the reductions of `triton_flash.reductions` (sum, max, min, cumsum, argmax)."""
    from attnref.interpreted.triton_flash import flash_attn_func

    errors: dict[str, float] = {}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, h, 32, generator=g, dtype=torch.float64)
               for n, h in ((37, 4), (50, 2), (50, 2)))  # fmt: skip
    want = _attention(q, k, v, causal=True)
    rows = torch.randn(8, 16, generator=g, dtype=torch.float64) * 4
    for name in BOUNDS:
        dtype = getattr(torch, name)
        got = flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
        assert isinstance(got, Tensor)  # no LSE asked for
        # and the reductions kernels use, in each dtype (tl.sum over bfloat16 was summed
        # as integers; a kernel took the blame for it)
        errors[name] = max(float((got.double() - want).abs().max()),
                           _reduction_error(rows.to(dtype)))  # fmt: skip
    return _verdicts(errors, "attnref's own Triton kernel, interpreted,")


@checked_internal
def _reduction_error(x: Float[Tensor, "M N"]) -> float:
    """How far Triton's reductions of ``x``'s rows (`triton_flash.reductions`: sum, max,
    min, running sums, argmax) are from float64's of the same values, relative to the
    size of each result (the interpreter once summed bfloat16 bits as integers)."""
    from attnref.interpreted.triton_flash import reductions

    exact = x.double()
    want = torch.stack([exact.sum(1), exact.max(1).values, exact.min(1).values,
                        exact.cumsum(1).sum(1), exact.argmax(1).double()])  # fmt: skip
    got = reductions(x).double()
    size = exact.abs().sum(1).clamp_min(1.0)  # what rounding each sum scales with
    size = torch.stack([size, size, size, size * x.shape[1], torch.ones_like(size)])
    if x.dtype != torch.float64:  # ties of rounded values may pick either index
        got[4], want[4] = x.double()[torch.arange(x.shape[0]), got[4].long()], exact.max(1).values
    return float(((got - want).abs() / size).nan_to_num(nan=float("inf")).max())


def pallas_self_check() -> dict[str, Any]:
    """A one-block attention kernel of attnref's own in Pallas, interpreted, in every
    dtype (20 queries against 24 keys, head dim 16)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl

    def kernel(q_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any) -> None:
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        acc = jnp.promote_types(q.dtype, jnp.float32)  # float64 stays float64
        s = jnp.dot(q, k.T, preferred_element_type=acc) / math.sqrt(q.shape[-1])
        p = jnp.exp(s - s.max(axis=-1, keepdims=True))
        o = jnp.dot(p.astype(v.dtype), v, preferred_element_type=acc)
        o_ref[...] = (o / p.sum(axis=-1, keepdims=True)).astype(o_ref.dtype)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 1, 16, generator=g, dtype=torch.float64)
               for n in (20, 24, 24))  # fmt: skip
    want = _attention(q, k, v, causal=False)[0, :, 0]
    errors: dict[str, float] = {}
    raised: dict[str, str] = {}
    struct: Any = jax.ShapeDtypeStruct  # typed where JAX is installed
    for name in BOUNDS:
        dtype = getattr(jnp, name)
        canonical = jax.dtypes.canonicalize_dtype(dtype)
        if canonical != np.dtype(dtype):  # float64 without jax_enable_x64
            raised[name] = f"JAX computes it as {canonical} (jax_enable_x64 is off)"
            continue
        args = [jnp.asarray(t[0, :, 0].numpy()).astype(dtype) for t in (q, k, v)]
        call = pl.pallas_call(kernel, out_shape=struct((20, 16), dtype), interpret=True)
        got = torch.from_numpy(np.array(call(*args).astype(jnp.float32))).double()
        errors[name] = float((got - want).abs().max())
    return _verdicts(errors, "attnref's own Pallas kernel, interpreted,", raised)
