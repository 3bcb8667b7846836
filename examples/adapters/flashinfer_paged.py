"""FlashInfer's paged decode behind the ``flash-kvcache`` convention.

FlashInfer describes a paged cache in CSR form, not by a block table
(``BatchDecodeWithPagedKVCacheWrapper.plan``; https://docs.flashinfer.ai/api/decode.html):
request ``b`` owns the pages ``indices[indptr[b] : indptr[b + 1]]``, in order, and its
last page holds ``last_page_len[b]`` valid tokens (1 to ``page_size``), so it has
``(pages - 1) * page_size + last_page_len`` of them. A block table and
``cache_seqlens`` say the same thing: `paged_layout` turns one into the other.

Two more differences the adapter bridges:

- the new token is appended by a separate call in FlashInfer
  (``flashinfer.page.append_paged_kv_cache``); ``flash_attn_with_kvcache`` appends it
  itself, so the adapter writes it first, through the block table;
- FlashInfer's decode returns its log-sum-exp in base 2 (flashinfer-ai/flashinfer#2113);
  the convention's is natural, so it is multiplied by ``ln 2``.

`flashinfer_kvcache(decode)` takes a function with FlashInfer's calling convention,
``decode(q (B, h, D), (k_pages, v_pages), indptr, indices, last_page_len, *, sm_scale,
window_left, logits_soft_cap, return_lse)`` (a planned wrapper's ``run`` behind a small
lambda, on a GPU), and returns one ``attnref audit --api flash-kvcache`` can audit.
`reference_decode` is that convention written in plain torch, so the adapter is tested
without FlashInfer (tests/test_adapters.py), and its last page's tail can be counted on
purpose (``tail_counted``, the class-27 bug of flashinfer-ai/flashinfer#3716).
"""

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnref.conformance import Capabilities

__all__ = ["CAPABILITIES", "flashinfer_kvcache", "paged_layout", "reference_decode"]

#: decode only (one query per request), paged, no ALiBi and no rotary here (FlashInfer's
#: own positional modes are not flash_attn_with_kvcache's tables); declared from the
#: flash-kvcache family's preset (FlashAttention 2's flash_attn_with_kvcache)
CAPABILITIES = Capabilities.preset(
    "flash-kvcache",
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    dropout=False,
    max_head_dim=None,
    alibi=False,
    rotary=False,
    page_multiple=1,  # any page size
    empty_lse="-inf",
    # drawn inside: one query per request, each with a key (a refusal of most cases made
    # the audit's passes thin: 2 of 34 kvcache cases judged)
    single_query=True,
    empty_sequences=False,
    refuses=("FlashInfer's decode takes one query per request",),
)


def paged_layout(
    cache_seqlens: Tensor, block_table: Tensor, page_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(indptr, indices, last_page_len)`` of a block table whose rows hold
    ``cache_seqlens`` tokens (at least one each: FlashInfer has no empty request)."""
    lengths = [int(n) for n in cache_seqlens.tolist()]
    if min(lengths, default=1) < 1:
        raise ValueError("FlashInfer's paged decode needs at least one token per request")
    pages = [-(-n // page_size) for n in lengths]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.cat([block_table[b, :p] for b, p in enumerate(pages)]).to(torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lengths, pages, strict=True)])
    return indptr, indices, last.to(torch.int32)


def reference_decode(
    q: Tensor,
    kv: tuple[Tensor, Tensor],
    indptr: Tensor,
    indices: Tensor,
    last_page_len: Tensor,
    *,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    return_lse: bool = False,
    tail_counted: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """FlashInfer's paged decode convention in plain torch: ``q (B, h, D)`` against each
    request's pages, ``k_pages``/``v_pages (num_pages, page_size, g, D)`` (NHD); the LSE
    in base 2, as FlashInfer returns it."""
    k_pages, v_pages = kv
    page_size = k_pages.shape[1]
    B, h, D = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for b in range(B):
        own = indices[int(indptr[b]) : int(indptr[b + 1])].long()
        n = (own.numel() - 1) * page_size + int(last_page_len[b])
        if tail_counted:
            n = own.numel() * page_size
        keys = k_pages[own].reshape(-1, *k_pages.shape[2:])[:n].to(acc)
        values = v_pages[own].reshape(-1, *v_pages.shape[2:])[:n].to(acc)
        group = h // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        s = torch.einsum("hd,thd->ht", q[b].to(acc), keys)
        s = s * (sm_scale if sm_scale is not None else 1 / math.sqrt(D))
        if logits_soft_cap:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        if window_left >= 0:
            s[:, : max(0, n - 1 - window_left)] = -math.inf
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.einsum("ht,thd->hd", torch.exp(s - lse[:, None]), values))
        lses.append(lse / math.log(2))
    out = torch.stack(outs).to(q.dtype)
    return (out, torch.stack(lses).float()) if return_lse else out


def flashinfer_kvcache(decode: Callable[..., Any], name: str = "flashinfer") -> Callable[..., Any]:
    """``decode`` (FlashInfer's paged convention) as a ``flash_attn_with_kvcache``."""

    def kvcache(
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        k: Tensor | None = None,
        v: Tensor | None = None,
        rotary_cos: Tensor | None = None,
        rotary_sin: Tensor | None = None,
        cache_seqlens: Tensor | None = None,
        cache_batch_idx: Tensor | None = None,
        cache_leftpad: Tensor | None = None,
        block_table: Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        rotary_interleaved: bool = True,
        alibi_slopes: Tensor | None = None,
        num_splits: int = 0,
        return_softmax_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if q.shape[1] != 1 or block_table is None or cache_seqlens is None:
            raise ValueError("FlashInfer's decode takes one query per request, a paged cache")
        if rotary_cos is not None or alibi_slopes is not None or cache_batch_idx is not None:
            raise ValueError("rotary, ALiBi and cache_batch_idx are not bridged here")
        page = k_cache.shape[1]
        lengths = cache_seqlens.clone()
        if k is not None and v is not None:  # FlashInfer appends in a call of its own
            for b in range(q.shape[0]):
                for t in range(k.shape[1]):
                    p = int(cache_seqlens[b]) + t
                    physical = int(block_table[b, p // page])
                    k_cache[physical, p % page] = k[b, t]
                    v_cache[physical, p % page] = v[b, t]
            lengths = lengths + k.shape[1]
        if int(lengths.min()) < 1:
            raise ValueError("FlashInfer's decode takes one query per request with a key")
        indptr, indices, last = paged_layout(lengths, block_table, page)
        result = decode(
            q[:, 0],
            (k_cache, v_cache),
            indptr,
            indices,
            last,
            sm_scale=softmax_scale,
            window_left=window_size[0],
            logits_soft_cap=softcap,
            return_lse=return_softmax_lse,
        )
        if not return_softmax_lse:
            return result[:, None]  # type: ignore[no-any-return]
        out, lse2 = result
        return out[:, None], (lse2 * math.log(2))[:, :, None]

    kvcache.__name__ = kvcache.__qualname__ = name
    kvcache.capabilities = CAPABILITIES  # type: ignore[attr-defined]
    return kvcache


#: the stand-in audited by tests/test_adapters.py, and the same with the class-27 bug
flashinfer_reference = flashinfer_kvcache(reference_decode, "flashinfer_reference")
flashinfer_tail_counted = flashinfer_kvcache(
    lambda *a, **kw: reference_decode(*a, tail_counted=True, **kw), "flashinfer_tail_counted"
)
