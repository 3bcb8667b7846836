"""Attention against a KV cache, as decode kernels take it (FlashAttention's
``flash_attn_with_kvcache``): contiguous or paged caches, an in-place append, rotary
positions for the new tokens, and split-KV.

The cache is ``(B_cache, T_cache, g, D)``, or paged ``(num_blocks, page_size, g, D)``
with ``block_table (B, max_blocks)`` naming the physical page of each logical page:
logical position ``p`` of row ``b`` lives at ``[block_table[b, p // page_size],
p % page_size]``. ``cache_seqlens[b]`` tokens are already in row ``b``. New keys and
values ``k``, ``v (B, T_new, g, D)`` are written at positions ``cache_seqlens[b] ..
cache_seqlens[b] + T_new - 1`` (rotated first, when rotary tables are given), and the
queries attend to the ``cache_seqlens[b] + T_new`` valid keys, bottom-right. Nothing
else in the cache changes; slots past the valid keys (the unused tail of the last page,
unused pages) are never read.

Rotary (``rotary_cos``/``rotary_sin`` ``(T_ro, R / 2)``): the new keys turn at positions
``cache_seqlens + t``; the queries at ``cache_seqlens + t`` when causal or windowed, and
all at ``cache_seqlens`` otherwise (FlashAttention's documented rule).

``num_splits > 1`` is split-KV (flash-decoding): the valid keys are cut into that many
contiguous parts, each attended on its own, and the parts combined by
`attnref.functional.merge_attention`. It must not change the result; here it is real,
so that the merge itself is what the reference computes.

Each row is attended by the dense reference (`attnref.varlen.attend_one`).
"""

import itertools
from typing import Any, Literal, overload

import torch
from jaxtyping import Float, Int
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked
from attnref.masks import Window
from attnref.rotary import check_rotary_dim, rotary
from attnref.varlen import attend_one

__all__ = [
    "cache_slots",
    "cached_lengths",
    "key_positions",
    "kvcache_attention",
    "query_positions",
    "valid_keys",
]


def _check_ints(name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


# ------------------------------------------- the rules a decode call follows, once
# (the reference below and the conformance adapter, `kvcache_form`, both use them)


@checked
def cached_lengths(
    cache_seqlens: Int[Tensor, " B"] | int | None, B: int, capacity: int, T_new: int
) -> list[int]:
    """The tokens already in each of the ``B`` rows: ``cache_seqlens`` (one int for every
    row, or one per row); without it, a full cache less the ``T_new`` appended tokens
    (``capacity``: a row's slots, or pages times the page size when paged)."""
    if cache_seqlens is None:
        return [capacity - T_new] * B
    if isinstance(cache_seqlens, int):
        return [cache_seqlens] * B
    return [int(x) for x in cache_seqlens.tolist()]


@checked
def key_positions(cached: int, T_new: int) -> Int[Tensor, " T_new"]:
    """The positions the appended keys are rotated to: right after the ``cached`` ones."""
    return torch.arange(cached, cached + T_new)


@checked
def query_positions(
    cached: int, Tq: int, causal: bool, window_size: tuple[int, int]
) -> Int[Tensor, " Tq"]:
    """The positions the queries are rotated to: ``cached + t`` when causal or windowed
    (each query is the token it appends), else all at ``cached`` (FlashAttention's
    documented rule for ``rotary_cos`` in ``flash_attn_with_kvcache``)."""
    if causal or tuple(window_size) != (-1, -1):
        return torch.arange(cached, cached + Tq)
    return torch.full((Tq,), cached, dtype=torch.int64)


@checked
def cache_slots(
    b: int,
    positions: range,
    block_table: Int[Tensor, "B pages"] | None,
    page_size: int,
    row: int,
) -> list[tuple[int, int]]:
    """``(cache row or physical page, slot)`` of each logical ``position`` of batch row
    ``b`` (``row``: its cache row, for a contiguous cache)."""
    if block_table is None:
        return [(row, p) for p in positions]
    pages = block_table[b].tolist()
    return [(int(pages[p // page_size]), p % page_size) for p in positions]


@checked
def valid_keys(
    cache: Float[Tensor, "rows slots g D"],
    b: int,
    length: int,
    block_table: Int[Tensor, "B pages"] | None,
    row: int,
) -> Float[Tensor, "length g D"]:
    """The first ``length`` logical positions of batch row ``b``, gathered."""
    page_size = cache.shape[1]
    if block_table is None:
        return cache[row, :length]
    n_pages = -(-length // page_size)
    pages = block_table[b, :n_pages].to(torch.long)
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def _split_kv(
    q: Tensor, keys: Tensor, values: Tensor, splits: int, kwargs: dict[str, Any]
) -> tuple[Tensor, Tensor]:
    """Split-KV: the keys cut into ``splits`` contiguous parts, each attended on its own
    (the others hidden), the parts merged by their log-sum-exps."""
    Tk = keys.shape[0]
    bounds = [Tk * s // splits for s in range(splits + 1)]
    parts = []
    for lo, hi in itertools.pairwise(bounds):
        hide = torch.full((1, Tk), float("-inf"), dtype=torch.float64, device=q.device)
        hide[:, lo:hi] = 0.0
        o, m = attend_one(q, keys, values, key_mask=hide, **kwargs)
        parts.append((o.transpose(0, 1), m))  # (h, Tq, Dv), (h, Tq)
    out, lse = parts[0]
    for o, m in parts[1:]:
        out, lse = F.merge_attention(out, lse, o, m)
    return out.transpose(0, 1), lse


@overload
def kvcache_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = ...,
    v: Tensor | None = ...,
    rotary_cos: Tensor | None = ...,
    rotary_sin: Tensor | None = ...,
    cache_seqlens: Tensor | int | None = ...,
    cache_batch_idx: Tensor | None = ...,
    cache_leftpad: Tensor | None = ...,
    block_table: Tensor | None = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: Window = ...,
    softcap: float = ...,
    rotary_interleaved: bool = ...,
    alibi_slopes: Tensor | None = ...,
    num_splits: int = ...,
    return_softmax_lse: Literal[False] = ...,
) -> Tensor: ...


@overload
def kvcache_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = ...,
    v: Tensor | None = ...,
    rotary_cos: Tensor | None = ...,
    rotary_sin: Tensor | None = ...,
    cache_seqlens: Tensor | int | None = ...,
    cache_batch_idx: Tensor | None = ...,
    cache_leftpad: Tensor | None = ...,
    block_table: Tensor | None = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: Window = ...,
    softcap: float = ...,
    rotary_interleaved: bool = ...,
    alibi_slopes: Tensor | None = ...,
    num_splits: int = ...,
    *,
    return_softmax_lse: Literal[True],
) -> tuple[Tensor, Tensor]: ...


@checked
def kvcache_attention(
    q: Float[Tensor, "B Tq h Dh"],
    k_cache: Float[Tensor, "rows slots g Dh"],
    v_cache: Float[Tensor, "rows slots g Dv"],
    k: Float[Tensor, "B Tnew g Dh"] | None = None,
    v: Float[Tensor, "B Tnew g Dv"] | None = None,
    rotary_cos: Float[Tensor, "Tro half"] | None = None,
    rotary_sin: Float[Tensor, "Tro half"] | None = None,
    cache_seqlens: Int[Tensor, " B"] | int | None = None,
    cache_batch_idx: Int[Tensor, " B"] | None = None,
    cache_leftpad: Int[Tensor, " B"] | None = None,
    block_table: Int[Tensor, "B pages"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "B h"] | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Float[Tensor, "B Tq h Dv"] | tuple[Float[Tensor, "B Tq h Dv"], Float[Tensor, "B h Tq"]]:
    """Decode attention against a KV cache, appending ``k``, ``v`` in place (module
    docstring). Returns ``out (B, Tq, h, Dv)``, and with ``return_softmax_lse`` the
    log-sum-exp ``(B, h, Tq)`` too.

    Raises:
        ValueError: ``k`` without ``v``; ``cache_seqlens``, ``cache_batch_idx`` or
            ``block_table`` of the wrong dtype or shape, out of range, or naming a page
            that does not exist; an append past the cache's capacity; rotary dims odd or
            larger than the head dim, or tables too short for the positions;
            ``cache_leftpad`` (not supported); ``num_splits < 0``.
    """
    B, Tq = q.shape[0], q.shape[1]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and their values)")
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad is not supported by the reference")
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(
            f"num_splits must be an int >= 0 (0: the kernel's choice), got {num_splits!r}"
        )
    paged = block_table is not None
    rows, slots = k_cache.shape[0], k_cache.shape[1]
    if paged:
        assert block_table is not None
        _check_ints("block_table", block_table, (B, block_table.shape[1]))
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with a paged cache (block_table)")
        capacity = block_table.shape[1] * slots
    else:
        capacity = slots
    if cache_batch_idx is not None:
        _check_ints("cache_batch_idx", cache_batch_idx, (B,))
        bad = [int(i) for i in cache_batch_idx.tolist() if not 0 <= int(i) < rows]
        if bad:
            raise ValueError(f"cache_batch_idx names cache row {bad[0]}; the cache has {rows} rows")
    elif not paged and rows < B:
        raise ValueError(f"the cache has {rows} rows for a batch of {B} (pass cache_batch_idx)")
    T_new = 0 if k is None else k.shape[1]
    if isinstance(cache_seqlens, Tensor):
        _check_ints("cache_seqlens", cache_seqlens, (B,))
    lengths = cached_lengths(cache_seqlens, B, capacity, T_new)
    for b, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] is {n}; it must be >= 0")
        if n + T_new > capacity:
            raise ValueError(
                f"row {b}: {n} cached tokens + {T_new} new ones is past the cache's capacity "
                f"{capacity}"
            )
    if paged:
        assert block_table is not None
        for b, n in enumerate(lengths):
            used = block_table[b, : -(-(n + T_new) // slots)].tolist()
            bad = [int(p) for p in used if not 0 <= int(p) < rows]
            if bad:
                raise ValueError(
                    f"block_table[{b}] names page {bad[0]}; the cache has {rows} pages"
                )
    rotate = rotary_cos is not None or rotary_sin is not None
    if rotate:
        if rotary_cos is None or rotary_sin is None or rotary_cos.shape != rotary_sin.shape:
            raise ValueError("rotary_cos and rotary_sin must be given together, of one shape")
        check_rotary_dim(2 * rotary_cos.shape[-1], q.shape[-1])
        need = max(n + max(T_new, Tq) for n in lengths) if lengths else 0
        if rotary_cos.shape[0] < need:
            raise ValueError(
                f"rotary tables have {rotary_cos.shape[0]} positions; {need} are needed"
            )
    if alibi_slopes is not None and alibi_slopes.dim() == 2 and alibi_slopes.shape[0] != B:
        raise ValueError(f"alibi_slopes has {alibi_slopes.shape[0]} rows for a batch of {B}")

    def angles(positions: Tensor) -> tuple[Tensor, Tensor]:
        assert rotary_cos is not None
        assert rotary_sin is not None
        return rotary_cos[positions].unsqueeze(-2), rotary_sin[positions].unsqueeze(-2)

    outs, lses = [], []
    for b, n in enumerate(lengths):
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        if k is not None and v is not None:
            new_k = k[b]
            if rotate:
                new_k = rotary(
                    new_k, *angles(key_positions(n, T_new)), interleaved=rotary_interleaved
                )
            for t, (r, s) in enumerate(
                cache_slots(b, range(n, n + T_new), block_table, slots, row)
            ):
                k_cache[r, s] = new_k[t]
                v_cache[r, s] = v[b, t]
        qb = q[b]
        if rotate:
            positions = query_positions(n, Tq, causal, window_size)
            qb = rotary(qb, *angles(positions), interleaved=rotary_interleaved)
        keys = valid_keys(k_cache, b, n + T_new, block_table, row)
        values = valid_keys(v_cache, b, n + T_new, block_table, row)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        kwargs = {
            "softmax_scale": softmax_scale,
            "causal": causal,
            "window_size": window_size,
            "softcap": softcap,
            "alibi_slopes": slopes,
        }
        if num_splits <= 1 or keys.shape[0] == 0:
            out, lse = attend_one(qb, keys, values, **kwargs)  # type: ignore[arg-type]
        else:
            out, lse = _split_kv(qb, keys, values, num_splits, kwargs)
        outs.append(out)
        lses.append(lse)
    result = torch.stack(outs) if outs else q.new_zeros((0, Tq, q.shape[2], v_cache.shape[-1]))
    if return_softmax_lse:
        lse_all = torch.stack(lses) if lses else q.new_zeros((0, q.shape[2], Tq))
        return result, lse_all
    return result
