"""Mutants: attention backends with one real bug planted, at least one per bug class.

Each mutant is a small function with torch SDPA's signature whose docstring names the
class of ``BUG_CLASSES.md`` it plants (the table in docs/architecture.md). They are the
suite's proof of power: its tests audit every mutant with the ``quick`` profile and
assert that it FAILS, and which property catches it; docs/kill-matrix.md shows every
mutant against every property.

Most mutants are the ``naive`` backend's kernel
(`attnref.conformance.kernels.materialised`: scores and softmax in float32,
probabilities rounded to the input dtype before ``P @ V``, like real kernels) with one
thing done wrong; a few wrap the reference (gradient bugs) or a blocked online-softmax
kernel (`_blocked`: tile bugs). Use one as a backend with ``--backend mutant.NAME``.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked, checked_internal
from attnref.conformance.backends import Backend, Capabilities
from attnref.conformance.kernels import Key, Mask, Out, Query, Value, kv_heads, materialised
from attnref.masks import Alignment, causal_mask

__all__ = ["MUTANTS", "Mutant"]

#: what the materialised kernel honestly declares: torch's semantics
TORCH_LIKE = Capabilities()
#: what the reference declares (mutants of the reference claim the same)
REFERENCE_LIKE = Capabilities(
    causal_alignments=("top_left", "bottom_right"), causal_with_mask=True, masked_nan="contained"
)


@checked_internal
def _blocked(
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
    """Online-softmax attention over key blocks of ``block``, with switches for tile bugs."""
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


@checked_internal
def _raw(t: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """``t`` read the way a kernel that ignores strides and offsets reads it: its storage
    from the start, as if contiguous; memory past the end of the storage reads as zeros."""
    available = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.as_strided(t, (min(available, t.numel()),), (1,), 0)
    if flat.numel() < t.numel():
        flat = torch.cat([flat, flat.new_zeros(t.numel() - flat.numel())])
    return flat.reshape(t.shape)


# ----------------------------------------------------------------------- the mutants


@checked
def empty_row_nan(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 1: a query with no visible key returns NaN (softmax of a row of -inf)."""
    return materialised(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        zero_empty_rows=False,
    )


@checked
def empty_row_uniform(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 2: masks filled with a finite -1e9: a query with no visible key averages V."""
    return materialised(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, fill=-1e9
    )


@checked
def masked_nan_leaks(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 3: claims NaN in masked-out K/V is contained, but ``P @ V`` gives 0 * NaN."""
    return materialised(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@checked
def causal_bottom_right(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 4: ``is_causal`` aligned bottom-right while claiming torch's top-left."""
    return materialised(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal_alignment="bottom_right",
    )


@checked
def causal_alignment_ignored(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    causal_alignment: Alignment = "top_left",
) -> Out:
    """Class 4: declares both alignments but always aligns top-left."""
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    )


@checked
def causal_excludes_self(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 5: the causal diagonal is off by one: a query does not see its own key."""
    return materialised(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, diagonal=-1
    )


@checked
def causal_leaks_next(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 5: the causal diagonal is off by one: a query sees the next token."""
    return materialised(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, diagonal=1
    )


@checked
def strides_ignored(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 6: transposed, sliced or offset inputs read as if contiguous from offset 0."""
    q, k, v = (t if t.is_contiguous() or 0 in t.stride() else _raw(t) for t in (query, key, value))
    return materialised(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@checked
def broadcast_misread(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 7: stride-0 (broadcast) K/V read as if every sample had its own storage."""
    k, v = (_raw(t) if 0 in t.stride() and t.numel() else t for t in (key, value))
    return materialised(query, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@checked
def no_max_subtraction(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 8: ``exp`` of raw scores in the input dtype, no max subtracted: overflow."""
    return materialised(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        subtract_max=False,
    )


@checked
def gqa_tiled(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 9: GQA heads tiled (head i reads KV head i % g) instead of interleaved."""
    return materialised(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, tiled_gqa=True
    )


@checked
def gqa_decode_tiled(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 10: GQA with a single query (the decode path) maps heads tiled."""
    return materialised(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        tiled_gqa=query.shape[-2] == 1,
    )


@checked
def gqa_mask_per_kv_head(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 10: GQA with a per-head mask: query head i gets the mask of head i // group."""
    h, g = query.shape[-3], key.shape[-3]
    if attn_mask is not None and h != g and attn_mask.dim() >= 3 and attn_mask.shape[-3] == h:
        attn_mask = attn_mask[..., [i // (h // g) for i in range(h)], :, :]
    return materialised(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@checked_internal
def _with_grad_hook(
    t: Float[Tensor, "*shape"], hook: Callable[[Tensor], Tensor]
) -> Float[Tensor, "*shape"]:
    if not t.requires_grad:
        return t
    t = t.view_as(t)
    t.register_hook(hook)  # type: ignore[no-untyped-call]
    return t


@checked
def grad_tail_block_dropped(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    causal_alignment: Alignment = "top_left",
) -> Out:
    """Class 11: the backward drops dK and dV of the last partial tile of 16 keys."""
    Tk = key.shape[-2]
    tail = Tk - Tk % 16

    def drop(g: Tensor) -> Tensor:
        g = g.clone()
        g[..., tail:, :] = 0
        return g

    return F.scaled_dot_product_attention(
        query,
        _with_grad_hook(key, drop),
        _with_grad_hook(value, drop),
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal_alignment=causal_alignment,
    )


@checked
def grad_query_unscaled(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    causal_alignment: Alignment = "top_left",
) -> Out:
    """Class 11: the backward forgets the softmax scale in dQ."""
    s = F.default_scale(query.shape[-1]) if scale is None else scale
    return F.scaled_dot_product_attention(
        _with_grad_hook(query, lambda g: g / s if s else g),
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal_alignment=causal_alignment,
    )


@checked
def tail_block_dropped(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 12: tiles of 16 keys; the last partial tile is never visited."""
    return _blocked(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, drop_tail=True
    )


@checked
def online_softmax_no_rescale(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 13: online softmax over tiles of 8 keys that never rescales the accumulator."""
    return _blocked(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        block=8,
        rescale=False,
    )


@checked
def scale_by_d(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 14: the default scale is 1/d instead of 1/sqrt(d)."""
    return materialised(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        scale_rule=lambda d: 1 / d if d else 1.0,
    )


@checked
def scale_ignored(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 14: an explicit ``scale`` is ignored; 1/sqrt(d) is always used."""
    return materialised(query, key, value, attn_mask, dropout_p, is_causal, None, enable_gqa)


@checked
def softmax_over_queries(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 15: the softmax normalises over queries (dim -2) instead of keys."""
    return materialised(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softmax_dim=-2
    )


@checked
def mask_inverted(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 16: boolean mask polarity inverted (True read as "hide")."""
    return materialised(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, invert_mask=True
    )


@checked
def float_mask_as_bool(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 16: a float (additive) mask is read as a boolean one (nonzero = visible)."""
    return materialised(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        float_mask_as_bool=True,
    )


@checked
def heads_folded_by_reshape(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 17: K and V folded (head, batch) by a reshape where (batch, head) was meant."""
    batch = key.shape[:-3]
    if len(batch) >= 1:
        n = math.prod(batch)
        g, Tk = key.shape[-3], key.shape[-2]
        key, value = (
            t.reshape(g, n, Tk, t.shape[-1]).transpose(0, 1).reshape(t.shape) for t in (key, value)
        )
    return materialised(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@checked
def decode_drops_last_key(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 18: the one-query (decode) path reads one key too few (cache length - 1)."""
    if query.shape[-2] == 1 and key.shape[-2] > 1:
        key, value = key[..., :-1, :], value[..., :-1, :]
        if attn_mask is not None and attn_mask.shape[-1] > 1:
            attn_mask = attn_mask[..., :-1]
    return materialised(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@checked
def dropout_at_zero(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 19: dropout is applied (p = 0.05) even when ``dropout_p == 0``."""
    return materialised(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        dropout_floor=0.05,
    )


@checked
def single_key_shortcut(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 20: with one key, returns V for every query, ignoring the mask."""
    if key.shape[-2] == 1:
        _, v = kv_heads(key, value, query.shape[-3])
        return v.expand(*query.shape[:-1], value.shape[-1]).clone()
    return materialised(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@checked
def zero_head_dim_nan(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 20: Dqk = 0 gives scale 1/sqrt(0) = inf, and 0 * inf = NaN scores."""
    return materialised(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        scale_rule=lambda d: 1 / math.sqrt(d) if d else math.inf,
    )


@checked
def index_wraps_16bit(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Out:
    """Class 21: key rows addressed by a 16-bit flat index that wraps past 32767 rows.

    A scaled-down instance of 32-bit offset overflow: the same arithmetic error shows
    at 2**15 key rows instead of 2**31 elements, so it can be caught on a CPU.
    """

    def gather(t: Tensor) -> Tensor:
        rows = t.numel() // max(t.shape[-1], 1)
        if rows == 0:
            return t
        flat = t.reshape(rows, t.shape[-1])
        index = torch.arange(rows, device=t.device).to(torch.int16).to(torch.int64) % rows
        return flat[index].reshape(t.shape)

    return materialised(
        query, gather(key), gather(value), attn_mask, dropout_p, is_causal, scale, enable_gqa
    )


class Mutant:
    """A mutant's metadata: its function, bug class and declared capabilities."""

    def __init__(self, fn: Callable[..., Any], bug_class: int, caps: Capabilities) -> None:
        self.fn = fn
        self.bug_class = bug_class
        self.capabilities = caps
        self.name = fn.__name__
        self.summary = (fn.__doc__ or "").split("\n")[0].split(": ", 1)[-1]
        fn.capabilities = caps  # type: ignore[attr-defined]  # read by resolve_backend

    def backend(self) -> Backend:
        return Backend(f"mutant.{self.name}", self.fn, self.summary, self.capabilities)


MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        Mutant(empty_row_nan, 1, TORCH_LIKE),
        Mutant(empty_row_uniform, 2, TORCH_LIKE),
        Mutant(masked_nan_leaks, 3, Capabilities(masked_nan="contained")),
        Mutant(causal_bottom_right, 4, TORCH_LIKE),
        Mutant(causal_alignment_ignored, 4, REFERENCE_LIKE),
        Mutant(causal_excludes_self, 5, TORCH_LIKE),
        Mutant(causal_leaks_next, 5, TORCH_LIKE),
        Mutant(strides_ignored, 6, TORCH_LIKE),
        Mutant(broadcast_misread, 7, TORCH_LIKE),
        Mutant(no_max_subtraction, 8, TORCH_LIKE),
        Mutant(gqa_tiled, 9, TORCH_LIKE),
        Mutant(gqa_decode_tiled, 10, TORCH_LIKE),
        Mutant(gqa_mask_per_kv_head, 10, TORCH_LIKE),
        Mutant(grad_tail_block_dropped, 11, REFERENCE_LIKE),
        Mutant(grad_query_unscaled, 11, REFERENCE_LIKE),
        Mutant(tail_block_dropped, 12, TORCH_LIKE),
        Mutant(online_softmax_no_rescale, 13, TORCH_LIKE),
        Mutant(scale_by_d, 14, TORCH_LIKE),
        Mutant(scale_ignored, 14, TORCH_LIKE),
        Mutant(softmax_over_queries, 15, TORCH_LIKE),
        Mutant(mask_inverted, 16, TORCH_LIKE),
        Mutant(float_mask_as_bool, 16, TORCH_LIKE),
        Mutant(heads_folded_by_reshape, 17, TORCH_LIKE),
        Mutant(decode_drops_last_key, 18, TORCH_LIKE),
        Mutant(dropout_at_zero, 19, TORCH_LIKE),
        Mutant(single_key_shortcut, 20, TORCH_LIKE),
        Mutant(zero_head_dim_nan, 20, TORCH_LIKE),
        Mutant(index_wraps_16bit, 21, TORCH_LIKE),
    )
}
