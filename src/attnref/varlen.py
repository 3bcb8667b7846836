"""Packed (variable-length) attention: many sequences of different lengths in one call.

Serving engines pack a batch of sequences end to end, with no padding, and describe the
pack by cumulative lengths (FlashAttention's ``flash_attn_varlen_func``): sequence ``n``
holds queries ``cu_seqlens_q[n] .. cu_seqlens_q[n + 1] - 1`` and keys
``cu_seqlens_k[n] .. cu_seqlens_k[n + 1] - 1``. Each sequence is attended on its own,
with its own ``Tq``, ``Tk`` and bottom-right offset ``Tk - Tq``, exactly as the dense
reference (`attnref.functional.scaled_dot_product_attention`) attends it: this module
unpacks, attends and packs, so one semantics serves both. Lengths of 0 and 1 are
legal; tokens after ``cu_seqlens[-1]`` are padding, never read, and get output 0.
"""

import itertools
from typing import Literal, overload

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked
from attnref.masks import Window

__all__ = ["attend_one", "check_cu_seqlens", "seqlens", "varlen_attention"]


@checked
def check_cu_seqlens(
    name: str, cu: Shaped[Tensor, "*shape"], total: int, max_seqlen: int | None = None
) -> None:
    """A clear error unless ``cu`` is an int32 ``(N + 1,)`` tensor of cumulative lengths:
    starting at 0, never decreasing, ending at most at ``total`` (the tokens there are),
    each length at most ``max_seqlen`` when it is given."""
    if cu.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must have shape (N + 1,), got {tuple(cu.shape)}")
    values = [int(x) for x in cu.tolist()]
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    for n, (a, b) in enumerate(itertools.pairwise(values)):
        if b < a:
            raise ValueError(f"{name} decreases at sequence {n}: {a} then {b}")
        if max_seqlen is not None and b - a > max_seqlen:
            raise ValueError(
                f"sequence {n} has {b - a} tokens, more than max_seqlen {max_seqlen} (from {name})"
            )
    if values[-1] > total:
        raise ValueError(f"{name} ends at {values[-1]}, past the {total} tokens given")


@checked
def seqlens(cu: Int[Tensor, " N1"]) -> list[tuple[int, int]]:
    """``(start, end)`` of each sequence of cumulative lengths ``cu``."""
    values = [int(x) for x in cu.tolist()]
    return list(itertools.pairwise(values))


@checked
def attend_one(
    q: Float[Tensor, "Tq h Dh"],
    k: Float[Tensor, "Tk g Dh"],
    v: Float[Tensor, "Tk g Dv"],
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Float[Tensor, " h"] | None = None,
    sinks: Float[Tensor, " h"] | None = None,
    key_mask: Float[Tensor, "#Tq Tk"] | None = None,
) -> tuple[Float[Tensor, "Tq h Dv"], Float[Tensor, "h Tq"]]:
    """One sequence in FlashAttention's layout ``(T, heads, D)``, bottom-right: its output
    and log-sum-exp, by the dense reference. ``key_mask`` (0 or ``-inf``) hides keys
    from it too (split-KV computes each split's part this way)."""
    h, g = q.shape[1], k.shape[1]
    window = None if tuple(window_size) == (-1, -1) else window_size
    out, lse = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        None if key_mask is None else key_mask.to(q.dtype),
        is_causal=causal,
        scale=softmax_scale,
        enable_gqa=h != g,
        causal_alignment="bottom_right",
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        return_lse=True,
    )
    return out[0].transpose(0, 1), lse[0]


@overload
def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: Window = ...,
    softcap: float = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    return_lse: Literal[False] = ...,
) -> Tensor: ...


@overload
def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: Window = ...,
    softcap: float = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    return_lse: Literal[True],
) -> tuple[Tensor, Tensor]: ...


@checked
def varlen_attention(
    q: Float[Tensor, "total_q h Dh"],
    k: Float[Tensor, "total_k g Dh"],
    v: Float[Tensor, "total_k g Dv"],
    cu_seqlens_q: Int[Tensor, " Nq"],
    cu_seqlens_k: Int[Tensor, " Nk"],
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "N h"] | None = None,
    sinks: Float[Tensor, " h"] | None = None,
    return_lse: bool = False,
) -> (
    Float[Tensor, "total_q h Dv"] | tuple[Float[Tensor, "total_q h Dv"], Float[Tensor, "h total_q"]]
):
    """Attention over packed sequences, each on its own (module docstring).

    Args:
        q: ``(total_q, h, Dh)``, the packed queries.
        k: ``(total_k, g, Dh)``, the packed keys (GQA when ``g < h``).
        v: ``(total_k, g, Dv)``, their values.
        cu_seqlens_q: int32 ``(N + 1,)`` cumulative query lengths from 0.
        cu_seqlens_k: the same for the keys.
        max_seqlen_q: at least every sequence's query length (kernels size their grids
            by it; the reference only checks it).
        max_seqlen_k: the same for the keys.
        softmax_scale: the scale (``1/sqrt(Dh)`` when ``None``).
        causal: causal, bottom-right per sequence.
        window_size: a sliding window ``(left, right)``, ``-1`` unbounded.
        softcap: ``softcap * tanh(score / softcap)``, 0 off.
        alibi_slopes: ``(h,)`` or one row per sequence ``(N, h)``.
        sinks: one sink logit per head ``(h,)``.
        return_lse: also return the log-sum-exp ``(h, total_q)`` (``-inf`` for a query
            that sees no key, and for padding).

    Raises:
        ValueError: ``cu_seqlens`` malformed or not matching the tensors, a length over
            ``max_seqlen``, or slopes for a different number of sequences.
    """
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    N = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() - 1 != N:
        raise ValueError(
            f"cu_seqlens_q describes {N} sequences and cu_seqlens_k "
            f"{cu_seqlens_k.numel() - 1}: they must describe the same ones"
        )
    if alibi_slopes is not None and alibi_slopes.dim() == 2 and alibi_slopes.shape[0] != N:
        raise ValueError(f"alibi_slopes has {alibi_slopes.shape[0]} rows, one per sequence is {N}")
    h, Dv = q.shape[1], v.shape[2]
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    for n, ((q0, q1), (k0, k1)) in enumerate(
        zip(seqlens(cu_seqlens_q), seqlens(cu_seqlens_k), strict=True)
    ):
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[n]
        out, lse = attend_one(
            q[q0:q1],
            k[k0:k1],
            v[k0:k1],
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=slopes,
            sinks=sinks,
        )
        outs.append(out)
        lses.append(lse)
    pad = q.shape[0] - int(cu_seqlens_q[-1])
    outs.append(q.new_zeros((pad, h, Dv)))
    lse_dtype = lses[0].dtype if lses else F.compute_dtype(q.dtype)
    lses.append(torch.full((h, pad), float("-inf"), dtype=lse_dtype, device=q.device))
    packed = torch.cat(outs, dim=0)
    if return_lse:
        return packed, torch.cat(lses, dim=1)
    return packed
