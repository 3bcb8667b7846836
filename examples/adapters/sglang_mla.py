"""SGLang's Triton decode kernel on a latent cache (``decode_attention_fwd``, SGLang
0.5.23: ``sglang/kernels/ops/attention/decode_attention.py``, what its Triton backend
runs for DeepSeek's MLA decode: one KV head, so the grouped path,
``decode_attention_fwd_grouped``) behind FlashMLA's ``flash_mla_with_kvcache`` signature
(``--api mla``), run through Triton's interpreter on the CPU (docs/interpreted.md,
docs/mla.md).

SGLang reads a pool of token slots ``(slots, 1, D)`` through ``kv_indptr`` and
``kv_indices``: the adapter flattens the paged latent cache into that pool (a slot a
page row), lists each query's slots through its block table, and passes the pool as K
and its first ``head_dim_v`` dims as V, as SGLang's MLA backend does with its
``kv_c_and_k_pe`` buffer. The kernel takes one query a row: a call of ``Tq`` queries is
``B * Tq`` rows, and a causal row ``t`` lists its request's keys but the ``Tq - 1 - t``
last. ``num_kv_splits`` 4 a row, as in ``examples.adapters.sglang_decode``. It returns no
final LSE (its ``attn_lse`` is each split's): declared ``lse=False``, the adapter
returns ``(out, None)``.

Declared as SGLang runs DeepSeek's models: head dims 576 (keys) and 512 (values);
float16 and bfloat16; a request has at least one key and as many as its queries (a row
with none divides 0 by 0).

What importing it took: as ``examples.adapters.sglang_decode``.
"""

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from examples.adapters.sglang_decode import SPLITS, offsets


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
) -> tuple[Tensor, None]:
    """SGLang's ``decode_attention_fwd``, interpreted, one row a query."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    B, Tq, h, D = q.shape
    page = k_cache.shape[1]
    slots = []
    for b in range(B):
        pages = block_table[b].tolist()
        every = [int(pages[t // page]) * page + t % page for t in range(int(cache_seqlens[b]))]
        for t in range(Tq):
            seen = len(every) - (Tq - 1 - t) if causal else len(every)
            slots.append(torch.tensor(every[: max(seen, 0)], dtype=torch.int64))
    rows = B * Tq
    pool = k_cache.reshape(-1, 1, D)
    out = torch.empty(rows, h, head_dim_v, dtype=q.dtype)
    logits = torch.empty(rows, h, SPLITS, head_dim_v, dtype=torch.float32)
    lse = torch.empty(rows, h, SPLITS, dtype=torch.float32)
    splits = torch.full((rows,), SPLITS, dtype=torch.int32)
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    decode_attention_fwd(
        q.reshape(rows, h, D).contiguous(), pool, pool[..., :head_dim_v], out,
        offsets(slots), torch.cat(slots).to(torch.int32), logits, lse, splits, SPLITS,
        scale, 1.0, 1.0,
    )  # fmt: skip
    return out.reshape(B, Tq, h, head_dim_v), None


def _declare() -> None:
    try:
        from attnref.conformance.families.mla import FLASH_MLA
    except ImportError:  # a bug report's repro.py, without attnref
        return
    mla_decode.capabilities = replace(  # type: ignore[attr-defined]
        FLASH_MLA,
        dtypes=(torch.float16, torch.bfloat16),
        lse=False,
        page_multiple=1,
        empty_sequences=False,
        queries_at_most_keys=True,
        interpreter="triton",
        tile_keys=32,
        kv_splits=SPLITS,
    )


_declare()
