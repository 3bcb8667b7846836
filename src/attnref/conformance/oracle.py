"""The float64 oracle and the pass/fail rule.

The oracle is the reference computed in float64 from the case's inputs (already rounded
to the case's dtype, then upcast). A backend's output passes when

    max|out - oracle|  <= max(floor, FUDGE * max|reference_same_dtype - oracle|)
    mean|out - oracle| <= max(floor, FUDGE * mean|reference_same_dtype - oracle|)

with ``floor = max(atol[dtype], eps * kappa * max|V|)`` (`error_floor`), and it has
no NaN or inf where the oracle is finite. Constants and the reasoning behind the floor:
`attnref.tolerances`.
"""

from dataclasses import dataclass

import torch
from jaxtyping import Float, Float64
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked
from attnref.conformance.cases import Inputs
from attnref.tolerances import FUDGE, attention_atol

__all__ = ["Comparison", "compare", "error_floor", "reference"]


@checked
def reference(inputs: Inputs) -> Float[Tensor, "*batch h Tq Dv"]:
    """The reference's output for ``inputs``, in their dtype (float64 inputs: the oracle)."""
    return F.scaled_dot_product_attention(
        inputs.query,
        inputs.key,
        inputs.value,
        inputs.attn_mask,
        is_causal=inputs.causal is not None,
        scale=inputs.scale,
        enable_gqa=inputs.enable_gqa,
        causal_alignment="top_left" if inputs.causal is None else inputs.causal,
    )


def error_floor(inputs: Inputs) -> float:
    """``max(atol[dtype], eps * kappa * max|V|)``: the error no correct backend can avoid.

    See `attnref.tolerances.attention_atol`.
    """
    return attention_atol(inputs.query, inputs.key, inputs.value, inputs.scale)


@dataclass(frozen=True)
class Comparison:
    """How far a backend's output lies from the oracle, and whether that passes."""

    ok: bool
    max_err: float
    mean_err: float
    max_bound: float
    mean_bound: float
    message: str = ""


@checked
def compare(
    out: object,
    oracle: Float64[Tensor, "*shape"],
    same_dtype: Float[Tensor, "*shape"],
    dtype: torch.dtype,
    floor: float,
) -> Comparison:
    """Judge ``out`` against the float64 ``oracle``; the reference's own error is the yardstick."""
    nan = float("nan")
    if not isinstance(out, Tensor):
        return Comparison(False, nan, nan, nan, nan, f"returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(oracle.shape):
        return Comparison(
            False,
            nan,
            nan,
            nan,
            nan,
            f"returned shape {tuple(out.shape)}, expected {tuple(oracle.shape)}",
        )
    if out.dtype != dtype:
        return Comparison(
            False, nan, nan, nan, nan, f"returned dtype {out.dtype}, expected {dtype}"
        )
    got = out.detach().to(device=oracle.device, dtype=torch.float64)
    ref_err = (same_dtype.to(torch.float64) - oracle).abs()
    max_bound = max(floor, FUDGE * float(ref_err.max())) if ref_err.numel() else floor
    mean_bound = max(floor, FUDGE * float(ref_err.mean())) if ref_err.numel() else floor
    bad = ~torch.isfinite(got) & torch.isfinite(oracle)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        return Comparison(
            False,
            nan,
            nan,
            max_bound,
            mean_bound,
            f"{int(bad.sum())} NaN/inf values where the oracle is finite (first at {first})",
        )
    err = (got - oracle).abs()
    if err.numel() == 0:
        return Comparison(True, 0.0, 0.0, max_bound, mean_bound)
    max_err, mean_err = float(err.max()), float(err.mean())
    ok = max_err <= max_bound and mean_err <= mean_bound
    message = ""
    if not ok:
        where = tuple(int(i) for i in (err == err.max()).nonzero()[0])
        message = (
            f"max error {max_err:.3g} (bound {max_bound:.3g}), mean error {mean_err:.3g} "
            f"(bound {mean_bound:.3g}); worst at {where}: got {float(got[where]):.6g}, "
            f"oracle {float(oracle[where]):.6g}"
        )
    return Comparison(ok, max_err, mean_err, max_bound, mean_bound, message)
