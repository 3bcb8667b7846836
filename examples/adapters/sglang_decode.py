"""SGLang's Triton decode kernel (``decode_attention_fwd``, SGLang 0.5.23:
``sglang/kernels/ops/attention/decode_attention.py``) behind FlashAttention's
``flash_attn_with_kvcache`` signature (``--api flash-kvcache``), run through Triton's
interpreter on the CPU (docs/interpreted.md).

SGLang's decode reads a pool of token slots ``(slots, g, D)`` through ``kv_indptr``
(``B + 1`` offsets) and ``kv_indices`` (each row's slots, in order): a block table of
pages of one slot. The adapter writes the new tokens into the cache (SGLang does that in
a kernel of its own before attention), flattens the cache (paged ``(pages, page, g, D)``
or contiguous ``(B_cache, T, g, D)``) into that pool, lists each row's slots through
its block table (or ``cache_batch_idx``), and calls the kernel with ``num_kv_splits`` of
4 a row (its stage 1 cuts a row's keys into 4 splits of ``cdiv(cdiv(L, 4), 32) * 32``
keys, in blocks of 32; its stage 2 merges them). One query a row (``single_query``), and
a row always has a key (``empty_sequences=False``: a row with none divides 0 by 0).
``sinks`` (one logit a query head) reach its ``sinks``; its ``logit_cap`` is not
audited here, nor its per-tensor FP8 scales (the family's FP8 calls carry per-row
descales). It returns no LSE.

What importing it took (``nox -s peers`` does this): SGLang's wheel installed
``--no-deps``, and the pure-Python packages that ``sglang.srt.environ`` and
``sglang.srt.utils`` import (pinned in examples/adapters/constraints.txt).

The module imports attnref only for its declaration, where attnref is installed: a bug
report's repro.py (docs/reports.md) calls ``decode`` with torch, SGLang and this file.
"""

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

#: KV splits a row, as SGLang's scheduler picks for short contexts
SPLITS = 4


def _cached_lengths(cache_seqlens: Tensor | int | None, B: int, capacity: int,
                    T_new: int) -> list[int]:  # fmt: skip
    """The tokens already in each of the ``B`` rows (FlashAttention's rule: none given,
    the cache is full but for the ``T_new`` appended ones)."""
    if cache_seqlens is None:
        return [capacity - T_new] * B
    if isinstance(cache_seqlens, int):
        return [cache_seqlens] * B
    return [int(x) for x in cache_seqlens.tolist()]


def _cache_slots(b: int, positions: range, block_table: Tensor | None, page: int,
                 row: int) -> list[tuple[int, int]]:  # fmt: skip
    """``(cache row or physical page, slot)`` of each logical position of batch row
    ``b`` (``row``: its cache row, for a contiguous cache)."""
    if block_table is None:
        return [(row, p) for p in positions]
    pages = block_table[b].tolist()
    return [(int(pages[p // page]), p % page) for p in positions]


def append_new(
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    cache_seqlens: Tensor | int | None,
    cache_batch_idx: Tensor | None,
    block_table: Tensor | None,
    B: int,
) -> tuple[list[int], list[int]]:
    """The new tokens ``k``, ``v`` written in place at each of the ``B`` rows' next
    slots (serving engines write them in a kernel of their own before attention).
    Returns the tokens each row held before them, and each row's cache row."""
    T_new = 0 if k is None else k.shape[1]
    page = k_cache.shape[1]
    capacity = page if block_table is None else block_table.shape[1] * page
    # the tokens already cached (FlashAttention's rule: none given, the cache is full)
    before = _cached_lengths(cache_seqlens, B, capacity, T_new)
    rows = [b if cache_batch_idx is None else int(cache_batch_idx[b]) for b in range(B)]
    if k is not None and v is not None:  # in place, in the caller's cache
        for b, n in enumerate(before):
            new = _cache_slots(b, range(n, n + T_new), block_table, page, rows[b])
            for t, (r, s) in enumerate(new):
                k_cache[r, s], v_cache[r, s] = k[b, t], v[b, t]
    return before, rows


def slot_pool(
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    cache_seqlens: Tensor | int | None,
    cache_batch_idx: Tensor | None,
    block_table: Tensor | None,
    B: int,
) -> tuple[list[Tensor], Tensor, Tensor]:
    """The cache as SGLang's pool of token slots: each of the ``B`` rows' keys as slot
    indices into the cache flattened to ``(slots, g, D)`` (a physical page or a cache
    row times its length, plus the slot), with the new tokens ``k``, ``v`` written in
    place first at each row's next slots (SGLang writes them in a kernel of its own
    before attention). Returns the rows' slots, and the K and V pools."""
    T_new = 0 if k is None else k.shape[1]
    page = k_cache.shape[1]
    before, rows = append_new(
        k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, B
    )
    slots = []
    for b, n in enumerate(before):
        where = _cache_slots(b, range(n + T_new), block_table, page, rows[b])
        slots.append(torch.tensor([r * page + s for r, s in where], dtype=torch.int64))
    return slots, k_cache.reshape(-1, *k_cache.shape[2:]), v_cache.reshape(-1, *v_cache.shape[2:])


def offsets(rows: list[Tensor]) -> Tensor:
    """CSR offsets of ``rows`` (``kv_indptr``): ``B + 1`` int32 starts."""
    lengths = torch.tensor([0, *(len(r) for r in rows)])
    return lengths.cumsum(0).to(torch.int32)


def decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    cache_seqlens: Tensor | int | None = None,
    cache_batch_idx: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    num_splits: int = 0,
    sinks: Tensor | None = None,
) -> Tensor:
    """SGLang's ``decode_attention_fwd``, interpreted, on the cache as its slot pool."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    B, Tq, H, D = q.shape
    Dv = v_cache.shape[3]
    if Tq != 1:
        raise ValueError(f"SGLang's decode takes one query a row, got {Tq}")
    slots, k_pool, v_pool = slot_pool(
        k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, B
    )
    indptr, indices = offsets(slots), torch.cat(slots).to(torch.int32)
    out = torch.empty(B, H, Dv, dtype=q.dtype)
    logits = torch.empty(B, H, SPLITS, Dv, dtype=torch.float32)
    lse = torch.empty(B, H, SPLITS, dtype=torch.float32)
    splits = torch.full((B,), SPLITS, dtype=torch.int32)
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    sink: Any = None if sinks is None else sinks.float().contiguous()
    decode_attention_fwd(q[:, 0].contiguous(), k_pool, v_pool, out, indptr, indices, logits,
                         lse, splits, SPLITS, scale, 1.0, 1.0, sinks=sink)  # fmt: skip
    return out.unsqueeze(1)


def _declare() -> None:
    try:
        from attnref.conformance.families.flash_kvcache import FLASH_ATTN_2_KVCACHE
    except ImportError:  # a bug report's repro.py, without attnref
        return
    decode.capabilities = replace(  # type: ignore[attr-defined]
        FLASH_ATTN_2_KVCACHE,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        window=False,
        softcap=False,
        alibi=False,
        rotary=False,
        lse=False,
        sinks=True,
        distinct_value_dim=True,
        page_multiple=1,
        single_query=True,
        empty_sequences=False,
        interpreter="triton",
        tile_keys=32,
        kv_splits=SPLITS,
    )


_declare()
