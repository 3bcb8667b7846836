"""MLA decode kernels (FlashMLA's convention) with bugs of classes 25, 27 and 35, written
here on their own (plain torch, none of attnref's references, adapters or mutant
switches), importable as ``tests.planted_mla:NAME`` with ``--api mla``.

They are the audit's test against bugs it was not built around: each plants a bug of
the class in a way the mutants of the ``mla`` family do not. ``correct_mla`` is the
same kernel without a bug, which must pass.
"""

import math
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from attnref.conformance.families.mla import mla_naive

#: no FP8 latent caches: these kernels take no descales (tests/planted_mla_fp8.py does)
CLAIMS = replace(
    mla_naive.capabilities,  # type: ignore[attr-defined]
    dtypes=(torch.float32, torch.bfloat16),
    fp8=(),
)


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
    ) -> tuple[Tensor, Tensor]:
        B, Tq, h, D = q.shape
        page = k_cache.shape[1]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        if softmax_scale is None:
            softmax_scale = (head_dim_v if bug == "default_scale_from_dv" else D) ** -0.5
        if bug == "scale_ignored_many_heads" and h >= 16:
            softmax_scale = D**-0.5  # the many-head path reads the default
        out = torch.zeros(B, Tq, h, head_dim_v, dtype=q.dtype, device=q.device)
        lse = torch.full((B, h, Tq), math.inf, dtype=acc, device=q.device)
        previous: tuple[Tensor, Tensor] | None = None
        for b in range(B):
            n = int(cache_seqlens[b])
            if n == 0:
                if bug == "empty_sequence_stale" and previous is not None:
                    out[b], lse[b] = previous  # the last sequence's buffers, not cleared
                if bug == "nan_empty":  # a softmax of nothing, as a torch reference has it
                    out[b] = math.nan
                continue
            pages = -(-n // page)
            span = pages * page if bug == "nan_tail_unmasked" else n
            ids = block_table[b, :pages].long()
            rows = k_cache[ids].reshape(pages * page, D)[:span].to(acc)  # (span, D)
            s = q[b].to(acc) @ rows.T * softmax_scale  # (Tq, h, span)
            j = torch.arange(span, device=q.device)
            seen = (j < n).expand(Tq, span)
            if causal:
                seen = seen & (j[None, :] <= n - Tq + torch.arange(Tq, device=q.device)[:, None])
            s = s.masked_fill(~seen[:, None, :], -math.inf)
            values = rows[:, :head_dim_v]
            if bug == "split_unscaled" and span > 64:
                o, total = _split_unscaled(s, values, 64)
            else:
                m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
                e = torch.exp(s - m)
                total = e.sum(-1, keepdim=True)
                o = (e @ values) / total.clamp(min=1e-300)
                total = (torch.log(total) + m)[..., 0]
            empty = ~seen.any(-1)  # (Tq,)
            o = o.masked_fill(empty[:, None, None], math.nan if bug == "nan_empty" else 0.0)
            lse_b = total.transpose(0, 1).masked_fill(empty[None, :], math.inf)  # (h, Tq)
            if bug == "lse_base2_past_page" and n > page:
                lse_b = lse_b / math.log(2)
            out[b] = o.to(q.dtype)
            lse[b] = lse_b
            previous = (out[b].clone(), lse[b].clone())
        return out, lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)

    mla.capabilities = CLAIMS  # type: ignore[attr-defined]
    if bug == "nan_empty":  # right, as declared: NaN where a query sees no key
        mla.capabilities = replace(CLAIMS, empty_row="nan")  # type: ignore[attr-defined]
    mla.__name__ = bug or "correct_mla"
    return mla


def _split_unscaled(s: Tensor, values: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Split-KV over chunks of ``chunk`` keys, each normalised by its own max, merged by
    their sums without rescaling to a common max (the LSE itself is right)."""
    outs, sums = [], []
    for lo in range(0, s.shape[-1], chunk):
        part = s[..., lo : lo + chunk]
        m = part.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
        e = torch.exp(part - m)
        outs.append(e @ values[lo : lo + chunk])
        sums.append(e.sum(-1, keepdim=True))
    total = torch.stack(sums).sum(0)
    o = torch.stack(outs).sum(0) / total.clamp(min=1e-300)
    return o, torch.logsumexp(s, dim=-1)


correct_mla = _kernel()
default_scale_from_dv = _kernel("default_scale_from_dv")
scale_ignored_many_heads = _kernel("scale_ignored_many_heads")
empty_sequence_stale = _kernel("empty_sequence_stale")
nan_tail_unmasked = _kernel("nan_tail_unmasked")
split_unscaled = _kernel("split_unscaled")
#: NaN for a query with no key (a softmax over nothing), declared empty_row="nan": right
nan_empty = _kernel("nan_empty")
lse_base2_past_page = _kernel("lse_base2_past_page")

#: each buggy kernel: the class of its bug
UNSEEN: dict[str, int] = {
    "default_scale_from_dv": 35,
    "scale_ignored_many_heads": 35,
    "empty_sequence_stale": 35,
    "lse_base2_past_page": 35,
    "nan_tail_unmasked": 27,
    "split_unscaled": 25,
}


def flashmla_signature(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: object,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """The correct kernel with FlashMLA's exact signature: the scheduler metadata has no
    default, and ``num_splits`` must be None (FlashMLA asserts both)."""
    assert num_splits is None, "num_splits must be None"
    out: tuple[Tensor, Tensor] = correct_mla(
        q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale=softmax_scale,
        causal=causal,
    )  # fmt: skip
    return out


flashmla_signature.capabilities = CLAIMS  # type: ignore[attr-defined]


def without_lse(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: object = None,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> tuple[Tensor, None]:
    """The correct kernel returning no log-sum-exp, ``(out, None)``, and declaring so
    (``lse=False``), as SGLang's Triton MLA decode does."""
    out, _ = correct_mla(
        q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale=softmax_scale,
        causal=causal,
    )  # fmt: skip
    return out, None


without_lse.capabilities = replace(CLAIMS, lse=False)  # type: ignore[attr-defined]
