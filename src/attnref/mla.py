"""Multi-head latent attention decode, as FlashMLA takes it (``flash_mla_with_kvcache``).

The absorbed path of `attnref.layers.MultiHeadLatentAttention` (docs/mla.md), as a
kernel's call: queries ``q (B, Tq, h, D)`` (the absorbed ``q_nope`` then the rotated
``q_pe``: ``D = kv_rank + d_rope``, 576 in DeepSeek V3) against a paged cache of latent
rows ``k_cache (blocks, page, 1, D)`` (``c_kv`` then ``k_pe``), one key/value head for
every query head. **V is the cache itself**: its first ``head_dim_v`` dims (512). Token
``t`` of sequence ``b`` sits at ``k_cache[block_table[b, t // page], t % page]``;
``cache_seqlens[b]`` tokens are valid, and nothing past them is read (an unused slot,
the tail of the last page, a page the table pads with a huge id). Causal, with several
queries a sequence, is bottom-right: query ``j`` sees the keys at positions up to
``cache_seqlens[b] - Tq + j``. Returns ``out (B, Tq, h, head_dim_v)`` and the
log-sum-exp ``(B, h, Tq)`` in float32 (float64 for float64 inputs, the audit's oracle
precision), natural log; a query that sees no key gets zeros and an LSE of ``+inf``
(FlashMLA's).

The scale: ``softmax_scale=None`` is the kernel's default, ``D ** -0.5`` (``576 **
-0.5``), which is **not** the model's (``d_qk ** -0.5`` times YaRN's ``mscale ** 2``:
`attnref.layers.mla_softmax_scale`); a caller passes the model's.

FlashMLA's ``tile_scheduler_metadata`` and ``num_splits`` (from ``get_mla_metadata``)
only schedule the work: taken and ignored here. Each sequence is attended by the KV
cache reference (`attnref.kvcache.kvcache_attention`, with V the cache's leading dims).
"""

import torch
from jaxtyping import Float, Int
from torch import Tensor

from attnref._checking import checked
from attnref.kvcache import kvcache_attention

__all__ = ["mla_kvcache_attention"]


@checked
def mla_kvcache_attention(
    q: Float[Tensor, "B Tq h D"],
    k_cache: Float[Tensor, "blocks page 1 D"],
    block_table: Int[Tensor, "B pages"],
    cache_seqlens: Int[Tensor, " B"],
    head_dim_v: int,
    tile_scheduler_metadata: object = None,
    num_splits: object = None,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> tuple[Float[Tensor, "B Tq h {head_dim_v}"], Float[Tensor, "B h Tq"]]:
    """FlashMLA's decode over a paged latent cache (module docstring): ``(out, lse)``.

    Raises:
        ValueError: ``head_dim_v`` not in ``1 .. D``; ``block_table`` or
            ``cache_seqlens`` not int32, or naming a page or a length the cache does not
            have.
    """
    D = q.shape[-1]
    if not isinstance(head_dim_v, int) or not 1 <= head_dim_v <= D:
        raise ValueError(
            f"head_dim_v must be an int in 1 .. {D} (q's head dim), got {head_dim_v!r}"
        )
    values = k_cache[..., :head_dim_v]  # V is the cache itself
    out, lse = kvcache_attention(
        q, k_cache, values, cache_seqlens=cache_seqlens, block_table=block_table,
        softmax_scale=softmax_scale, causal=causal, return_softmax_lse=True,
    )  # fmt: skip
    lse = torch.where(torch.isneginf(lse), torch.inf, lse)  # a row with no key: +inf
    return out, lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
