"""vLLM's Triton attention kernel (``unified_attention``, vLLM 0.34.0:
``vllm/v1/attention/ops/triton_unified_attention.py``, what its ``TRITON_ATTN`` backend
runs for prefill, chunked prefill and decode alike) behind FlashAttention's
``flash_attn_with_kvcache`` signature (``--api flash-kvcache``), run through Triton's
interpreter on the CPU (docs/interpreted.md).

``unified_attention`` takes vLLM's varlen paged form: the queries of every request packed
``(tokens, h, D)`` with ``cu_seqlens_q``; the cache as pages ``(blocks, page, g, D)``
through ``block_table``; each request's keys counted by ``seqused_k`` (its cache and its
new tokens, which vLLM writes into the cache in a kernel of its own before attention).
The adapter writes the new tokens ``k``, ``v`` in place at each row's next slots, passes
a paged cache and its block table as they are, and a contiguous cache ``(B_cache, T, g,
D)`` as pages of ``T`` slots, one a row (``cache_batch_idx`` names it). Causal calls are
bottom-right aligned in vLLM as in FlashAttention.

Launch as vLLM's backend sets it up (``TritonAttentionMetadataBuilder``): 16 softmax
segments (``NUM_PAR_SOFTMAX_SEGMENTS``: KV splits, merged by a second kernel) where the
batch is small (``seq_threshold_3D = 128 // g`` query blocks) and the queries few (at
most 8 a request, causal); the single-pass 2D kernel otherwise. Its tiles: 16 query rows
of a KV head's group (``BLOCK_M``), keys in tiles of 16 (decode) or 32 (prefill).

Declared as vLLM calls it. Sliding windows: the kernel reads ``window_size[0]`` alone,
and a window without causal reaches as far right as left (``compute_kv_seq_mask``:
``sw_left & sw_right``, vLLM's encoder windows ``(w - 1, w - 1)``): the adapter passes a
window ``(left, 0)`` without causal as the causal call it equals, a ``(left, left)`` one
as it is, and refuses any other (declared); ``causal_windows_only`` draws windows that
end at the query. Queries never outnumber their keys (``queries_at_most_keys``: vLLM's
new tokens are in the cache before attention, so each query sees itself at least; a row
with no key is 0 / 0, NaN). Softcap; sinks (one logit a query head, float32);
GQA; no LSE; ``Dv = Dqk``; no ALiBi here (vLLM's is the signed distance of causal
decoders, not FlashAttention's absolute one); no FP8 (vLLM's scales are per tensor, the
family's per row and KV head). A request has at least one key (``empty_sequences=False``).

vLLM takes Triton for absent unless exactly one GPU driver is active, or
``CUDA_VISIBLE_DEVICES`` is empty (its reading of a distributed worker not yet given a
device); without one it binds placeholders, and ``triton.next_power_of_2`` fails. Under
the interpreter the adapter sets ``CUDA_VISIBLE_DEVICES=""`` before importing vLLM.

What importing it took (``nox -s peers`` does this): vLLM's wheel installed ``--no-deps``
(it pins a CUDA torch), and ``regex``.

The module imports attnref only for its declaration, where attnref is installed: a bug
report's repro.py (docs/reports.md) calls ``unified`` with torch, vLLM and this file.
"""

import os
from dataclasses import replace

import torch
from torch import Tensor

from examples.adapters.sglang_decode import append_new

#: the adapter's error for a window vLLM cannot express (declared a refusal)
REFUSAL = "vLLM's windows are (left, 0) or, without causal, (left, left)"
#: softmax segments (KV splits) of vLLM's 3D kernel, and its 2D kernel's least grid
SEGMENTS, MIN_GRID_2D = 16, 128


def unified(
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
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    num_splits: int = 0,
    sinks: Tensor | None = None,
) -> Tensor:
    """vLLM's ``unified_attention``, interpreted, on the cache as its pages."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # before vLLM first looks for Triton
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    left, right = window_size
    if not causal and right != left:
        if right != 0:  # vLLM's non-causal window reaches as far right as left
            raise ValueError(f"{REFUSAL}: window {tuple(window_size)} without causal")
        causal = True  # (left, 0) ends at the query: FlashAttention's causal window
    B, Tq, H, D = q.shape
    g = k_cache.shape[2]
    T_new = 0 if k is None else k.shape[1]
    before, rows = append_new(
        k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, B
    )
    pages = block_table if block_table is not None else torch.tensor(rows).view(B, 1)
    seqused = torch.tensor([n + T_new for n in before], dtype=torch.int32)
    out = torch.empty(B * Tq, H, D, dtype=q.dtype)
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    padded = 1 << (D - 1).bit_length()
    tokens = B * Tq
    unified_attention(
        q.reshape(tokens, H, D).contiguous(), k_cache, v_cache, out,
        cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32) * Tq, max_seqlen_q=Tq,
        seqused_k=seqused, max_seqlen_k=int(seqused.max()), softmax_scale=scale,
        causal=causal, window_size=tuple(window_size), block_table=pages.to(torch.int32),
        softcap=float(softcap), q_descale=None, k_descale=None, v_descale=None,
        seq_threshold_3D=MIN_GRID_2D // g, num_par_softmax_segments=SEGMENTS,
        softmax_segm_output=torch.empty(tokens, H, SEGMENTS, padded, dtype=torch.float32),
        softmax_segm_max=torch.empty(tokens, H, SEGMENTS, dtype=torch.float32),
        softmax_segm_expsum=torch.empty(tokens, H, SEGMENTS, dtype=torch.float32),
        sinks=None if sinks is None else sinks.float().contiguous(),
    )  # fmt: skip
    return out.reshape(B, Tq, H, D)


def _declare() -> None:
    try:
        from attnref.conformance.families.flash_kvcache import FLASH_ATTN_2_KVCACHE
    except ImportError:  # a bug report's repro.py, without attnref
        return
    unified.capabilities = replace(  # type: ignore[attr-defined]
        FLASH_ATTN_2_KVCACHE,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        window=True,
        causal_windows_only=True,
        softcap=True,
        alibi=False,
        rotary=False,
        lse=False,
        sinks=True,
        distinct_value_dim=False,
        page_multiple=1,
        empty_sequences=False,
        queries_at_most_keys=True,
        refuses=(REFUSAL,),
        interpreter="triton",
        tile_queries=16,
        tile_keys=16,
        kv_splits=SEGMENTS,
    )


_declare()
