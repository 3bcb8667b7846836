"""MLA decode kernels over FP8 latent caches (vLLM's FlashMLA FP8 path: q and the cache
in FP8, ``descale_q`` and ``descale_k`` per tensor) with bugs of class 34, written here
on their own (plain torch, none of attnref's references, adapters or mutant switches),
importable as ``tests.planted_mla_fp8:NAME`` with ``--api mla``.

Each folds the descales into float32 scores, as FlashAttention 3 does, rather than
dequantizing first; each plants the class in a way the ``mla_fp8_*`` mutants do not.
``correct_mla_fp8`` is the same kernel without a bug, which must pass.
"""

import math
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from attnref.conformance.families.mla import mla_naive

CLAIMS = replace(
    mla_naive.capabilities,  # type: ignore[attr-defined]
    dtypes=(torch.bfloat16,),
    fp8=("e4m3fn", "e5m2"),
)

#: the query-key dims at the end of a latent row that carry rotary (DeepSeek's 64 of 576)
ROPE = 8


def _kernel(bug: str = "") -> Any:
    def mla(
        q: Tensor,
        k_cache: Tensor,
        block_table: Tensor,
        cache_seqlens: Tensor,
        head_dim_v: int,
        tile_scheduler_metadata: object = None,
        num_splits: object = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        descale_q: Tensor | None = None,
        descale_k: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        B, Tq, h, D = q.shape
        page = k_cache.shape[1]
        fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        out_dtype = torch.bfloat16 if fp8 else q.dtype
        sq = float(descale_q[0]) if descale_q is not None else 1.0
        sk = float(descale_k[0]) if descale_k is not None else 1.0
        if bug == "descale_k_reciprocal":
            sk = 1.0 / sk  # read as the quantization scale, not its inverse
        scale = D**-0.5 if softmax_scale is None else softmax_scale
        out = torch.zeros(B, Tq, h, head_dim_v, dtype=out_dtype, device=q.device)
        lse = torch.full((B, h, Tq), math.inf, dtype=torch.float32, device=q.device)
        for b in range(B):
            n = int(cache_seqlens[b])
            if n == 0:
                continue
            pages = -(-n // page)
            ids = block_table[b, :pages].long()
            rows = k_cache[ids].reshape(pages * page, D)[:n].float()  # as stored
            qb = q[b].float()  # (Tq, h, D), as stored
            if bug == "rope_undescaled" and D > ROPE:
                # the rotary dims taken as if kept unquantized: only the rest descaled
                nope = qb[..., :-ROPE] @ rows[:, :-ROPE].T * (sq * sk)
                s = (nope + qb[..., -ROPE:] @ rows[:, -ROPE:].T * sq) * scale
            else:
                s = qb @ rows.T * (sq * sk * scale)  # (Tq, h, n): FP8 products are exact
            j = torch.arange(n, device=q.device)
            if causal:
                seen = j[None, :] <= n - Tq + torch.arange(Tq, device=q.device)[:, None]
                s = s.masked_fill(~seen[:, None, :], -math.inf)
            m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
            e = torch.exp(s - m)
            total = e.sum(-1, keepdim=True)
            v_scale = sq if bug == "values_by_descale_q" else sk
            o = (e @ rows[:, :head_dim_v]) * v_scale / total.clamp(min=1e-30)
            empty = total[..., 0] == 0  # (Tq, h)
            o = o.masked_fill(empty[..., None], 0.0)
            lse_b = (torch.log(total) + m)[..., 0].masked_fill(empty, math.inf)
            out[b] = o.to(out_dtype)
            lse[b] = lse_b.transpose(0, 1)
        return out, lse

    mla.capabilities = CLAIMS  # type: ignore[attr-defined]
    mla.__name__ = bug or "correct_mla_fp8"
    return mla


correct_mla_fp8 = _kernel()
values_by_descale_q = _kernel("values_by_descale_q")
rope_undescaled = _kernel("rope_undescaled")
descale_k_reciprocal = _kernel("descale_k_reciprocal")

#: each buggy kernel: the class of its bug
UNSEEN: dict[str, int] = {
    "values_by_descale_q": 34,
    "rope_undescaled": 34,
    "descale_k_reciprocal": 34,
}
