"""The kernels shared by the ``naive`` backend and the mutants: `materialised` (scores,
softmax, ``P @ V``) and `blocked` (online softmax over tiles of keys).

With every switch off each is a correct backend (``naive`` is `materialised`); each
mutant in `attnref.conformance.mutants` turns one switch on, so a mutant differs from a
correct kernel by exactly its planted bug.
"""

import math
from collections.abc import Callable

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked
from attnref.masks import Alignment, causal_mask

__all__ = ["Key", "Mask", "Out", "Query", "Value", "blocked", "kv_heads", "materialised"]

Query = Float[Tensor, "*batch h Tq Dh"]
Key = Float[Tensor, "*batch g Tk Dh"]
Value = Float[Tensor, "*batch g Tk Dv"]
Mask = Bool[Tensor, "*#mbatch #Tq #Tk"] | Float[Tensor, "*#mbatch #Tq #Tk"] | None
Out = Float[Tensor, "*batch h Tq Dv"]


@checked
def kv_heads(
    k: Float[Tensor, "*batch g Tk Dh"],
    v: Float[Tensor, "*batch g Tk Dv"],
    h: int,
    tiled: bool = False,
) -> tuple[Float[Tensor, "*batch {h} Tk Dh"], Float[Tensor, "*batch {h} Tk Dv"]]:
    """K and V heads expanded to ``h``: interleaved (correct) or ``tiled`` (a bug)."""
    g = k.shape[-3]
    if g == h:
        return k, v
    if tiled:  # head i reads KV head i % g: the tiled mapping
        reps = [1] * (k.dim() - 3) + [h // g, 1, 1]
        return k.repeat(*reps), v.repeat(*reps)
    return F.expand_kv_heads(k, h), F.expand_kv_heads(v, h)


@checked
def materialised(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_alignment: Alignment = "top_left",
    tiled_gqa: bool = False,
    fill: float = -math.inf,
    diagonal: int = 0,
    scale_rule: Callable[[int], float] = lambda d: 1 / math.sqrt(d) if d else 1.0,
    ignore_scale: bool = False,
    invert_mask: bool = False,
    float_mask_as_bool: bool = False,
    zero_empty_rows: bool = True,
    softmax_dim: int = -1,
    subtract_max: bool = True,
    dropout_floor: float = 0.0,
) -> Out:
    """Materialised attention with switches for planted bugs (all off: a correct kernel).

    ``softmax(Q K^T * scale + mask) V``: scores and the softmax in float32 (float64 for
    float64 inputs), as kernels accumulate them; the probabilities rounded to the inputs'
    dtype before ``P @ V``, as kernels round them; zeros for a query with no visible key.
    The ``naive`` backend is this with every switch off; each mutant turns one on.
    """
    h = query.shape[-3]
    key, value = kv_heads(key, value, h, tiled_gqa)
    d = query.shape[-1]
    scale = scale_rule(d) if scale is None or ignore_scale else scale
    acc = torch.promote_types(query.dtype, torch.float32)
    s = (query.to(acc) @ key.to(acc).transpose(-2, -1)) * scale
    Tq, Tk = s.shape[-2], s.shape[-1]
    if is_causal:
        visible = causal_mask(Tq, Tk, causal_alignment, device=s.device)
        if diagonal:
            offset = 0 if causal_alignment == "top_left" else Tk - Tq
            visible = torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).tril(offset + diagonal)
        s = s.masked_fill(~visible, fill)
    if attn_mask is not None:
        if float_mask_as_bool and attn_mask.is_floating_point():
            attn_mask = attn_mask.bool()
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(attn_mask if invert_mask else ~attn_mask, fill)
        else:
            s = s + attn_mask.to(acc)
    empty = (s == -math.inf).all(dim=softmax_dim, keepdim=True)
    if zero_empty_rows:  # finite scores in empty rows, so that no NaN reaches the backward
        s = s.masked_fill(empty, 0.0)
    if subtract_max:
        p = torch.softmax(s, dim=softmax_dim)
    else:  # exp in the input dtype, no max subtracted: overflows on large scores
        e = torch.exp(s.to(query.dtype)).to(acc)
        p = e / e.sum(dim=softmax_dim, keepdim=True)
    if zero_empty_rows:
        p = p.masked_fill(empty, 0.0)
    p = p.to(query.dtype)
    if dropout_p > 0 or dropout_floor > 0:
        p = torch.nn.functional.dropout(p, max(dropout_p, dropout_floor))
    return p @ value


@checked
def blocked(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    block: int = 16,
    drop_tail: bool = False,
    rescale: bool = True,
) -> Out:
    """Online-softmax attention over key blocks of ``block``, with switches for tile bugs.

    With every switch off it computes what `materialised` does, one tile of keys at a
    time: a running maximum, a running denominator, and the accumulator rescaled
    whenever the maximum grows (FlashAttention's recurrence).
    """
    h = query.shape[-3]
    key, value = kv_heads(key, value, h)
    Tq, Tk = query.shape[-2], key.shape[-2]
    acc = torch.promote_types(query.dtype, torch.float32)
    q = query.to(acc) * (1 / math.sqrt(query.shape[-1]) if scale is None else scale)
    k, v = key.to(acc), value.to(acc)
    bias = torch.zeros((Tq, Tk), dtype=acc, device=q.device)
    if is_causal:
        bias = bias.masked_fill(~causal_mask(Tq, Tk, device=q.device), -math.inf)
    if attn_mask is not None:
        extra = (
            torch.zeros_like(attn_mask, dtype=acc).masked_fill(~attn_mask, -math.inf)
            if attn_mask.dtype == torch.bool
            else attn_mask.to(acc)
        )
        bias = bias + extra
    shape = (*q.shape[:-1], 1)
    m = torch.full(shape, -math.inf, dtype=acc, device=q.device)
    denom = torch.zeros(shape, dtype=acc, device=q.device)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
    end = Tk - Tk % block if drop_tail else Tk
    for start in range(0, end, block):
        stop = min(start + block, Tk)
        s = q @ k[..., start:stop, :].transpose(-2, -1) + bias[..., start:stop]
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        safe = torch.where(m_new == -math.inf, 0.0, m_new)
        p = torch.exp(s - safe)
        correction = torch.exp(torch.where(m == -math.inf, -math.inf, m - safe))
        if rescale:
            denom = denom * correction + p.sum(dim=-1, keepdim=True)
            out = out * correction + p @ v[..., start:stop, :]
        else:  # forgets to rescale what was accumulated under the old maximum
            denom = denom + p.sum(dim=-1, keepdim=True)
            out = out + p @ v[..., start:stop, :]
        m = m_new
    return (out / denom.masked_fill(denom == 0, 1.0)).to(query.dtype)
