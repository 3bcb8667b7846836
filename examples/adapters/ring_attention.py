"""ring-attention-pytorch's ``ring_flash_attn`` in the ``context-parallel`` family.

Tested with ring-attention-pytorch 0.5.20 on the CPU (gloo). ``ring_flash_attn(q, k, v,
mask=None, causal=False, bucket_size=1024, ring_reduce_col=False, ...)`` takes each
rank's ``(B, T_local, h, D)`` shard, the family's layout; with ``ring_reduce_col=True``
it passes K and V around the ring of every rank and merges blocks of ``bucket_size``
keys by online softmax, forward and backward (its own autograd function). What it takes:

- the process group of every rank: the ring's ranks and size come from the default
  group (``dist.get_rank()``, cached by the library on first use; the adapter clears
  those caches, else a call before the group is joined fixes the size at 1);
- contiguous shards of equal lengths (the causal mask is placed by bucket index,
  ``rank * T_local / bucket_size + j``, from the rank's own length);
- the default scale only (``D ** -0.5``), values shaped like keys (``Dv = D``), no
  LSE; ``softclamp_value`` is a softcap on the scaled scores.

``ring`` calls it with the library's default buckets (1024 keys: one block per shard at
the audit's sizes), ``ring_buckets`` with 4-key buckets, so that small cases go through
its online softmax and its causal bucket logic.
"""

from typing import Any

import torch.distributed as dist
from torch import Tensor

from attnref.adapters import declare

#: the adapter's errors for calls outside what the library takes (declared: refusals)
REFUSAL = "ring_flash_attn takes"


def _call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bucket_size: int,
    group: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    sharding: str = "contiguous",
    softcap: float = 0.0,
    return_lse: bool = False,
) -> Tensor:
    from ring_attention_pytorch import distributed as rd
    from ring_attention_pytorch import ring_flash_attention as rf

    if sharding != "contiguous":
        raise NotImplementedError(f"{REFUSAL} contiguous shards, not {sharding!r}")
    if softmax_scale is not None:
        raise NotImplementedError(f"{REFUSAL} no scale (it uses D ** -0.5)")
    if return_lse:
        raise NotImplementedError(f"{REFUSAL} no request for the log-sum-exp")
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        raise NotImplementedError(f"{REFUSAL} the group of every rank only")
    for cached in (rd.get_rank, rd.get_world_size, rd.is_distributed):
        cached.cache_clear()
    out: Tensor = rf.ring_flash_attn(
        q,
        k,
        v,
        causal=causal,
        bucket_size=bucket_size,
        ring_reduce_col=True,
        softclamp_qk_sim=softcap > 0,
        softclamp_value=softcap if softcap > 0 else 50.0,
    )
    return out


def ring(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """``ring_flash_attn(..., ring_reduce_col=True)`` with the default 1024-key buckets."""
    return _call(q, k, v, bucket_size=1024, **kwargs)


def ring_buckets(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """``ring_flash_attn(..., ring_reduce_col=True, bucket_size=4)``."""
    return _call(q, k, v, bucket_size=4, **kwargs)


def _declare() -> None:
    import torch

    for fn in (ring, ring_buckets):
        declare(
            fn,
            family="context-parallel",
            # float64 overflows its float32 row maxima (-finfo(float64).max), and float16
            # and bfloat16 meet float32 accumulators in a matmul: both raise
            dtypes=(torch.float32,),
            lse=False,
            explicit_scale=False,
            distinct_value_dim=False,  # assert k.shape[-2:] == v.shape[-2:]
            softcap=True,
            cp_full_group=True,
            cp_shardings=("contiguous",),
            cp_equal_shards=True,
            refuses=(REFUSAL,),
        )


_declare()
