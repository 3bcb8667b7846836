"""FlashInfer's MLA decode behind the ``mla`` convention (FlashMLA's call).

FlashInfer's ``BatchMLAPagedAttentionWrapper`` (https://docs.flashinfer.ai/api/mla.html)
takes what FlashMLA takes in one tensor in two parts, and describes the pages in CSR
form:

- the query as ``q_nope (N, h, D_ckv)`` and ``q_pe (N, h, D_kpe)``, and the cache as
  ``ckv (pages, P, D_ckv)`` and ``kpe (pages, P, D_kpe)``: FlashMLA's ``q (B, Tq, h,
  576)`` and ``k_cache (blocks, P, 1, 576)`` cut after their first ``head_dim_v`` dims;
- the values are ``ckv`` itself (FlashMLA's "V is the cache's first 512 dims");
- request ``b`` owns the pages ``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]`` and has
  ``kv_len[b]`` tokens; its queries are rows ``qo_indptr[b] : qo_indptr[b + 1]`` of the
  flattened ``N = B * Tq`` (``plan(qo_indptr, kv_indptr, kv_indices, kv_len, ...)``);
- the LSE comes back in **base 2** (FlashInfer's default; ``return_lse_base_on_e`` is
  not in every version), ``(N, h)``: the adapter multiplies it by ``ln 2``.

`flashinfer_mla(run)` takes a function of that convention, ``run(q_nope, q_pe, ckv,
kpe, *, qo_indptr, kv_indptr, kv_indices, kv_len, page_size, sm_scale, causal) -> (out,
lse_base2)`` (a planned wrapper's ``run`` behind a small lambda, on a GPU), and returns
one ``attnref audit --api mla`` can audit. `reference_run` is that convention in plain
torch, so that the adapter is tested without FlashInfer (tests/test_adapters.py);
``natural_lse=True`` plants the class-35 bug of a caller that forgets the base.
"""

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from attnref.conformance.families.mla import mla_naive

__all__ = ["CAPABILITIES", "csr_layout", "flashinfer_mla", "reference_run"]

#: the mla family's declaration of attnref's own kernels (any head dims, any page
#: size, float32 and the half types); FlashInfer itself takes 512 + 64 and bf16/fp16.
#: No FP8 latent cache: the adapter passes no descales
CAPABILITIES = replace(
    mla_naive.capabilities,  # type: ignore[attr-defined]
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    fp8=(),
)


def csr_layout(cache_seqlens: Tensor, block_table: Tensor, page_size: int) -> tuple[Tensor, Tensor]:
    """``(kv_indptr, kv_indices)`` of a block table whose rows hold ``cache_seqlens``
    tokens: each request's pages, in order, end to end (none for an empty request)."""
    pages = [-(-int(n) // page_size) for n in cache_seqlens.tolist()]
    indptr = torch.tensor([0, *torch.tensor(pages, dtype=torch.long).cumsum(0).tolist()])
    parts = [block_table[b, :p] for b, p in enumerate(pages)]
    indices = torch.cat(parts) if parts else block_table.new_zeros(0)
    return indptr.to(torch.int32), indices.to(torch.int32)


def reference_run(
    q_nope: Tensor,
    q_pe: Tensor,
    ckv: Tensor,
    kpe: Tensor,
    *,
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_len: Tensor,
    page_size: int,
    sm_scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """FlashInfer's MLA convention in plain torch: ``out (N, h, D_ckv)``, the LSE ``(N,
    h)`` in base 2 (``-inf`` for a query that sees no key, whose output is 0)."""
    acc = torch.float64 if q_nope.dtype == torch.float64 else torch.float32
    out = torch.zeros(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.full(q_nope.shape[:2], -math.inf, dtype=torch.float32, device=q_nope.device)
    for b in range(len(kv_len)):
        n = int(kv_len[b])
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        ids = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        c = ckv[ids].flatten(0, 1)[:n].to(acc)  # (n, D_ckv)
        r = kpe[ids].flatten(0, 1)[:n].to(acc)  # (n, D_kpe): 0 dims when there is no rope
        s = (q_nope[lo:hi].to(acc) @ c.T + q_pe[lo:hi].to(acc) @ r.T) * sm_scale  # (Tq, h, n)
        Tq = hi - lo
        seen = torch.ones(Tq, n, dtype=torch.bool, device=s.device)
        if causal:
            seen = seen.tril(diagonal=n - Tq)
        s = s.masked_fill(~seen[:, None, :], -math.inf)
        row = torch.logsumexp(s, dim=-1)  # (Tq, h)
        w = torch.exp(s - row[..., None]).nan_to_num(nan=0.0)
        out[lo:hi] = (w @ c).to(out.dtype)
        lse[lo:hi] = (row / math.log(2)).float()
    return out, lse


def flashinfer_mla(run: Callable[..., Any], *, natural_lse: bool = False) -> Callable[..., Any]:
    """``run`` (FlashInfer's MLA convention, module docstring) as a function of the
    ``mla`` family. ``natural_lse``: take ``run``'s LSE as natural (a bug)."""

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
        kv_indptr, kv_indices = csr_layout(cache_seqlens.cpu(), block_table.cpu(), page)
        flat = q.reshape(B * Tq, h, D)
        out, lse2 = run(
            flat[..., :head_dim_v],
            flat[..., head_dim_v:],
            k_cache[:, :, 0, :head_dim_v],
            k_cache[:, :, 0, head_dim_v:],
            qo_indptr=torch.arange(B + 1, dtype=torch.int32) * Tq,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices.to(q.device),
            kv_len=cache_seqlens,
            page_size=page,
            sm_scale=D**-0.5 if softmax_scale is None else softmax_scale,
            causal=causal,
        )
        lse = lse2.float() if natural_lse else lse2.float() * math.log(2)
        lse = torch.where(torch.isneginf(lse), math.inf, lse)  # FlashMLA's empty row
        if q.dtype == torch.float64:
            lse = lse.double()
        out = out.reshape(B, Tq, h, head_dim_v)
        return out, lse.reshape(B, Tq, h).transpose(1, 2)

    mla.capabilities = CAPABILITIES  # type: ignore[attr-defined]
    return mla


#: the adapter around the plain-torch convention (what tests/test_adapters.py audits),
#: and the same with the base-2 LSE taken as natural
flashinfer_reference = flashinfer_mla(reference_run)
flashinfer_lse_base2 = flashinfer_mla(reference_run, natural_lse=True)


def _flashinfer_run(
    q_nope: Tensor,
    q_pe: Tensor,
    ckv: Tensor,
    kpe: Tensor,
    *,
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_len: Tensor,
    page_size: int,
    sm_scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """FlashInfer's ``BatchMLAPagedAttentionWrapper``, planned for this one call (a GPU
    with flashinfer installed; written from its documented ``plan`` and ``run``, not yet
    run here)."""
    import flashinfer

    device = q_nope.device
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.int8, device=device)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
    wrapper.plan(
        qo_indptr.to(device), kv_indptr.to(device), kv_indices.to(device), kv_len.to(device),
        q_nope.shape[1], ckv.shape[-1], kpe.shape[-1], page_size, causal, sm_scale,
        q_nope.dtype, ckv.dtype,
    )  # fmt: skip
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    return out, lse


#: FlashInfer's own MLA decode (``attnref audit --api mla --device cuda --backend
#: examples.adapters.flashinfer_mla:flashinfer_gpu``): DeepSeek's dims, bf16 and fp16
flashinfer_gpu = flashinfer_mla(_flashinfer_run)
flashinfer_gpu.capabilities = replace(  # type: ignore[attr-defined]
    CAPABILITIES, dtypes=(torch.bfloat16, torch.float16), head_dims=(576, 512), devices=("cuda",)
)
