"""JAX's Pallas flash-attention kernel for GPUs (``jax.experimental.pallas.ops.gpu.
attention.mha``), run through Pallas' interpret mode on the CPU, behind FlashAttention's
``flash_attn_func`` signature (``--api flash``; docs/interpreted.md).

Tested with jax 0.10.2. ``mha(q, k, v, segment_ids, sm_scale, causal, block_sizes,
interpret=True)`` takes ``(B, T, h, D)`` arrays of one head count (no GQA) and one head
dim (``Dv = Dqk``), a causal flag whose diagonal is the top left's (query ``i`` sees keys
``<= i``), and lengths that are multiples of its blocks, or shorter than a block (a block
is cut to the length): other lengths raise ``ValueError: ... must be a multiple of ...``,
declared a refusal. Its blocks here are 16 x 16, so that tile boundaries are cheap to
reach interpreted. ``sm_scale`` defaults to 1 in Pallas (not ``1/sqrt(D)``): the adapter
passes FlashAttention's default. The LSE it keeps as a residual is base 2 and not
returned.
"""

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from attnref.adapters import no_dropout
from attnref.conformance.families.flash import FLASH_ATTN_2
from examples.adapters.jax_attention import to_jax, to_torch

#: the tiles of the kernel as audited (`BlockSizes(block_q, block_k)`)
BLOCK_Q = BLOCK_K = 16


def mha(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> Tensor:
    """Pallas' GPU flash attention, interpreted, on the inputs moved to JAX."""
    from jax.experimental.pallas.ops.gpu.attention import BlockSizes
    from jax.experimental.pallas.ops.gpu.attention import mha as pallas_mha

    no_dropout(dropout_p)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    blocks = BlockSizes(block_q=BLOCK_Q, block_k=BLOCK_K)
    args = (to_jax(t.contiguous()) for t in (q, k, v))
    out: Any = pallas_mha(
        *args, None, sm_scale=scale, causal=causal, block_sizes=blocks, interpret=True
    )
    return to_torch(out, q.dtype)


mha.capabilities = replace(  # type: ignore[attr-defined]
    FLASH_ATTN_2,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    window=False,
    softcap=False,
    alibi=False,
    lse=False,
    gqa=False,
    gradients=False,  # JAX differentiates its own arrays, not torch's
    causal_alignments=("top_left",),
    refuses=("must be a multiple of",),
    interpreter="pallas",
    tile_queries=BLOCK_Q,
    tile_keys=BLOCK_K,
)
