"""vLLM's Triton MLA decode (``decode_attention_fwd(..., is_mla=True)``, vLLM 0.34.0:
``vllm/v1/attention/ops/triton_decode_attention.py``, what its ``TRITON_MLA`` backend's
``forward_mqa`` runs) behind FlashMLA's ``flash_mla_with_kvcache`` signature (``--api
mla``), run through Triton's interpreter on the CPU (docs/interpreted.md, docs/mla.md).

The call is written out as ``TritonMLAImpl.forward_mqa`` makes it: the latent cache
``(blocks, page, 1, D)`` is K, and its first ``head_dim_v`` dims are V; every query row
``(B * Tq)`` is a program row of its own with its request's block table, and a causal
row ``t`` of ``Tq`` sees its request's keys but the ``Tq - 1 - t`` last (the kernel has no
causal flag: ``seq_lens`` per row); ``num_kv_splits`` as vLLM computes it
(``_compute_num_kv_splits``: the next power of two of ``max_seq_len // 512``, at most
twice the SMs, here an H100's 132). Its LSE comes back in q's dtype, as vLLM allocates it
(``lse = torch.zeros(B, h, dtype=q.dtype)``); the adapter returns it as FlashMLA's
float32 ``(B, h, Tq)``, values unchanged.

Declared as vLLM runs DeepSeek's models: head dims 576 (keys) and 512 (values); float16
and bfloat16; no FP8 (vLLM's scales here are per layer, ``k_scale`` and ``v_scale`` of
one value, not the family's FP8 calls); a request has at least one key and as many as
its queries (``empty_sequences=False``, ``queries_at_most_keys``: vLLM's new tokens are
in the cache before attention; a row with no key is skipped by stage 1, and stage 2
divides 0 by 0).

What importing it took: as ``examples.adapters.vllm_unified`` (vLLM's wheel
``--no-deps``, and ``regex``), and its ``CUDA_VISIBLE_DEVICES`` under the interpreter.
"""

import os
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

#: vLLM's split rule (``_MIN_WORK_PER_SPLIT``, ``_SPLIT_OCCUPANCY_MULTIPLIER``) on an H100
MIN_WORK_PER_SPLIT, MAX_SPLITS = 512, 2 * 132


def _splits(max_len: int) -> int:
    ideal = max(1, max_len // MIN_WORK_PER_SPLIT)
    return min(1 << (ideal - 1).bit_length(), MAX_SPLITS)


def mla_decode(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: Any = None,
    num_splits: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """vLLM's Triton MLA decode, interpreted, one program row a query."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # before vLLM first looks for Triton
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    B, Tq, h, D = q.shape
    rows = B * Tq
    lengths = cache_seqlens.to(torch.int32)
    table = block_table.to(torch.int32).repeat_interleave(Tq, dim=0)
    if causal and Tq > 1:  # row t sees the prefix and the block's tokens 0..t
        back = torch.arange(1 - Tq, 1, dtype=torch.int32)
        seq_lens = (lengths.unsqueeze(1) + back).flatten().clamp(min=0)
    else:
        seq_lens = lengths.repeat_interleave(Tq)
    splits = _splits(int(lengths.max()))
    o = torch.zeros(rows, h, head_dim_v, dtype=q.dtype)
    lse = torch.zeros(rows, h, dtype=q.dtype)
    logits = torch.empty(rows, h, splits, head_dim_v + 1, dtype=torch.float32)
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    decode_attention_fwd(
        q.reshape(rows, h, D).contiguous(), k_cache, k_cache[..., :head_dim_v], o, lse,
        table, seq_lens, logits, splits, scale, k_cache.shape[1], is_mla=True,
    )  # fmt: skip
    out = o.reshape(B, Tq, h, head_dim_v)
    return out, lse.float().reshape(B, Tq, h).transpose(1, 2).contiguous()


def _declare() -> None:
    try:
        from attnref.conformance.families.mla import FLASH_MLA
    except ImportError:  # a bug report's repro.py, without attnref
        return
    mla_decode.capabilities = replace(  # type: ignore[attr-defined]
        FLASH_MLA,
        dtypes=(torch.float16, torch.bfloat16),
        page_multiple=1,
        empty_sequences=False,
        queries_at_most_keys=True,
        interpreter="triton",
        tile_keys=32,
    )


_declare()
