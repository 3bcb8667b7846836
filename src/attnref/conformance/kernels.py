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
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "*batch h"] | None = None,
    sinks: Float[Tensor, " h"] | None = None,
    return_lse: bool = False,
    window_exclusive: bool = False,
    window_top_left: bool = False,
    causal_window_symmetric: bool = False,
    softcap_dropped: bool = False,
    softcap_before_scale: bool = False,
    alibi_sign: float = -1.0,
    alibi_top_left: bool = False,
    sink_count: int = 1,
    sink_numerator: bool = False,
    sink_first_split_only: bool = False,
    lse_base2: bool = False,
    lse_relative_max: bool = False,
    lse_empty_split_overwrites: bool = False,
) -> Out | tuple[Out, Float[Tensor, "*batch h Tq"]]:
    """Materialised attention with switches for planted bugs (all off: a correct kernel).

    ``softmax(Q K^T * scale + mask) V``: scores and the softmax in float32 (float64 for
    float64 inputs), as kernels accumulate them; the probabilities rounded to the inputs'
    dtype before ``P @ V``, as kernels round them; zeros for a query with no visible key.
    The variants of docs/variants.md in their order (softcap, ALiBi, mask, visibility,
    sinks) and the log-sum-exp on request. The ``naive`` backend is this with every
    switch off; each mutant turns one on. The split-KV switches act as a kernel that
    visits the keys in two splits, ``[0, ceil(Tk / 2))`` and the rest, would.
    """
    h = query.shape[-3]
    key, value = kv_heads(key, value, h, tiled_gqa)
    d = query.shape[-1]
    scale = scale_rule(d) if scale is None or ignore_scale else scale
    acc = torch.promote_types(query.dtype, torch.float32)
    s = query.to(acc) @ key.to(acc).transpose(-2, -1)
    if softcap and softcap_before_scale:  # c * tanh(q.k / c) * scale
        s = softcap * torch.tanh(s / softcap) * scale
    else:
        s = s * scale
        if softcap and not softcap_dropped:
            s = softcap * torch.tanh(s / softcap)
    Tq, Tk = s.shape[-2], s.shape[-1]
    offset = 0 if causal_alignment == "top_left" else Tk - Tq
    rows = torch.arange(Tq, device=s.device).unsqueeze(-1)  # (Tq, 1)
    cols = torch.arange(Tk, device=s.device)
    if alibi_slopes is not None:
        at = rows + (0 if alibi_top_left else offset)
        distance = (at - cols).abs().to(acc)  # (Tq, Tk)
        s = s + alibi_sign * alibi_slopes.to(acc)[..., None, None] * distance
    if attn_mask is not None and not (attn_mask.dtype == torch.bool or float_mask_as_bool):
        s = s + attn_mask.to(acc)
    causal_now = is_causal and not (causal_window_symmetric and window is not None)
    if causal_now:
        visible = causal_mask(Tq, Tk, causal_alignment, device=s.device)
        if diagonal:
            visible = torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).tril(offset + diagonal)
        s = s.masked_fill(~visible, fill)
    if window is not None:
        left, right = window
        if is_causal and causal_window_symmetric:  # (w, w) where (w, 0) was meant
            right = left
        pos = rows + (0 if window_top_left else offset)
        seen = torch.ones(Tq, Tk, dtype=torch.bool, device=s.device)
        if left >= 0:
            seen = seen & ((cols > pos - left) if window_exclusive else (cols >= pos - left))
        if right >= 0:
            seen = seen & (cols <= pos + right)
        s = s.masked_fill(~seen, fill)
    if attn_mask is not None:
        if float_mask_as_bool and attn_mask.is_floating_point():
            attn_mask = attn_mask.bool()
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(attn_mask if invert_mask else ~attn_mask, fill)
    hidden = s == -math.inf
    empty = hidden.all(dim=softmax_dim, keepdim=True)
    if zero_empty_rows:  # finite scores in empty rows, so that no NaN reaches the backward
        s = s.masked_fill(empty, 0.0)
    if sinks is not None:
        p = _with_sinks(s, hidden, sinks.to(acc), sink_count, sink_numerator, sink_first_split_only)
    elif subtract_max:
        p = torch.softmax(s, dim=softmax_dim)
    else:  # exp in the input dtype, no max subtracted: overflows on large scores
        e = torch.exp(s.to(query.dtype)).to(acc)
        p = e / e.sum(dim=softmax_dim, keepdim=True)
    if zero_empty_rows:
        p = p.masked_fill(empty, 0.0)
    p = p.to(query.dtype)
    if dropout_p > 0 or dropout_floor > 0:
        p = torch.nn.functional.dropout(p, max(dropout_p, dropout_floor))
    # a NaN row of P (an empty row's softmax of -inf) is set in the output after the
    # matmul: some CPU matmuls (oneDNN's bfloat16 one, oneDNN#5717) spread a NaN row of
    # A to its neighbours, and a planted bug must be the same on every machine
    nan_rows = torch.isnan(p).any(dim=-1, keepdim=True)
    out = p.nan_to_num(nan=0.0) @ value
    out = out.masked_fill(nan_rows, math.nan)
    if not return_lse:
        return out
    lse = _lse(s, hidden, lse_base2, lse_relative_max, lse_empty_split_overwrites)
    return out, lse


def _split(num_keys: int) -> int:
    """Where a two-split kernel cuts the keys: the first split is ``[0, ceil(Tk / 2))``."""
    return -(-num_keys // 2)


@checked
def _with_sinks(
    s: Float[Tensor, "*batch h Tq Tk"],
    hidden: Bool[Tensor, "*batch h Tq Tk"],
    sinks: Float[Tensor, " h"],
    count: int,
    numerator: bool,
    first_split_only: bool,
) -> Float[Tensor, "*batch h Tq Tk"]:
    """``exp(s_ij) / (exp(sigma_h) + sum_k exp(s_ik))`` (hidden scores are ``-inf``), with
    the sink bugs of class 24 as switches: counted ``count`` times (once per split);
    its mass given back to the visible keys (in the numerator); counted only in the
    first split, which a row with no visible key there skips."""
    sigma = sinks[:, None, None].expand(*s.shape[:-1], 1)  # (*batch, h, Tq, 1)
    m = torch.maximum(s.amax(dim=-1, keepdim=True), sigma)
    m = m.masked_fill(~torch.isfinite(m), 0.0)
    e = torch.exp(s - m).masked_fill(hidden, 0.0)
    sink = torch.exp(sigma - m) * count
    if first_split_only:
        sink = sink * (~hidden[..., : _split(s.shape[-1])]).any(dim=-1, keepdim=True)
    total = e.sum(dim=-1, keepdim=True) + sink
    if numerator:  # the sink's mass spread over the visible keys instead of dropped
        n = (~hidden).sum(dim=-1, keepdim=True).clamp(min=1)
        e = e + (~hidden) * sink / n
    return e / total.masked_fill(total == 0, 1.0)


@checked
def _lse(
    s: Float[Tensor, "*batch h Tq Tk"],
    hidden: Bool[Tensor, "*batch h Tq Tk"],
    base2: bool,
    relative_max: bool,
    empty_split_overwrites: bool,
) -> Float[Tensor, "*batch h Tq"]:
    """``log sum_j exp(s_ij)`` over visible keys (``-inf`` for none), with the LSE bugs
    of class 25 as switches: base 2; relative to the row's max; overwritten by ``-inf``
    where the second of two splits has no visible key."""
    s = s.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    if base2:
        lse = lse / math.log(2)
    if relative_max:
        top = s.amax(dim=-1)
        lse = torch.where(torch.isfinite(top), lse - top, lse)
    if empty_split_overwrites:
        second_empty = hidden[..., _split(s.shape[-1]) :].all(dim=-1)
        lse = lse.masked_fill(second_empty, -math.inf)
    return lse


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
