"""SGLang's Triton extend kernel (``extend_attention_fwd``, SGLang 0.5.23:
``sglang/kernels/ops/attention/extend_attention.py``) behind FlashAttention's
``flash_attn_with_kvcache`` signature (``--api flash-kvcache``), run through Triton's
interpreter on the CPU (docs/interpreted.md).

SGLang's extend attends a chunk of new tokens (``q_extend``, ``k_extend``, ``v_extend``,
rows cut by ``qo_indptr``) against each row's cached prefix (a slot pool read through
``kv_indptr`` and ``kv_indices``), causal within the chunk (``is_causal``): bottom-right
causal over prefix and chunk. The adapter writes the new tokens into the cache, then
takes each row's last ``Tq`` keys as the chunk and the keys before them as the prefix,
so a call's queries are its last ``Tq`` positions, as FlashAttention's are: a row with
more queries than keys has no such split, and is refused (``queries_at_most_keys``).
``sinks`` (a logit a query head) reach its ``sinks``, and its ``lse_extend`` (natural
log) is returned as the LSE; it counts the sink (``lse_with_sink``). On a CPU its tiles
are 64 x 64 (its table's fallback for head dims up to 128; 32 x 32 above). Its window
(``sliding_window_size``), ``logit_cap``, custom mask and FP8 scales are not audited
here. Importing it takes what ``examples.adapters.sglang_decode`` says, whose slot pool
(``slot_pool``, ``offsets``) it shares. Like it, the module imports attnref only for its
declaration: a bug report's repro.py runs it without attnref.
"""

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from examples.adapters.sglang_decode import offsets, slot_pool

#: the adapter's error for a call SGLang's extend cannot express (declared a refusal)
REFUSAL = "SGLang's extend needs its queries among the keys"


def extend(
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
    return_softmax_lse: bool = False,
) -> Any:
    """SGLang's ``extend_attention_fwd``, interpreted: each row's last ``Tq`` keys as
    its chunk, the keys before them as its cached prefix."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    B, Tq, H, D = q.shape
    Dv = v_cache.shape[3]
    slots, k_pool, v_pool = slot_pool(
        k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, B
    )
    short = min(len(s) for s in slots)
    if short < Tq:
        raise ValueError(f"{REFUSAL}: {Tq} queries against {short} keys")
    prefixes = [s[: len(s) - Tq] for s in slots]
    chunks = torch.cat([s[len(s) - Tq :] for s in slots])
    kv_indptr, kv_indices = offsets(prefixes), torch.cat(prefixes).to(torch.int32)
    qo_indptr = torch.arange(B + 1, dtype=torch.int32) * Tq
    out = torch.empty(B * Tq, H, Dv, dtype=q.dtype)
    lse = torch.empty(B * Tq, H, dtype=torch.float32) if return_softmax_lse else None
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    sink: Any = None if sinks is None else sinks.float().contiguous()
    extend_attention_fwd(
        q.reshape(B * Tq, H, D).contiguous(), k_pool[chunks].contiguous(),
        v_pool[chunks].contiguous(), out, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices,
        None, causal, None, Tq, 1.0, 1.0, sm_scale=scale, sinks=sink, lse_extend=lse,
    )  # fmt: skip
    result = out.reshape(B, Tq, H, Dv)
    if lse is None:
        return result
    return result, lse.reshape(B, Tq, H).transpose(1, 2).contiguous()


def _declare() -> None:
    try:
        from attnref.conformance.families.flash_kvcache import FLASH_ATTN_2_KVCACHE
    except ImportError:  # a bug report's repro.py, without attnref
        return
    extend.capabilities = replace(  # type: ignore[attr-defined]
        FLASH_ATTN_2_KVCACHE,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        window=False,
        softcap=False,
        alibi=False,
        rotary=False,
        sinks=True,
        lse_with_sink=True,
        distinct_value_dim=True,
        page_multiple=1,
        queries_at_most_keys=True,
        empty_sequences=False,
        refuses=(REFUSAL,),
        interpreter="triton",
        tile_queries=64,
        tile_keys=64,
    )


_declare()
