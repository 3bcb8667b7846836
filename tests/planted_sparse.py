"""Sparse MLA kernels (FlashMLA's conventions) with bugs of classes 33 to 36, written
here on their own (plain torch, none of attnref's references, adapters or mutant
switches), importable as ``tests.planted_sparse:NAME`` with ``--api sparse-mla`` (the
prefill kernels) or ``--api sparse-mla-fp8`` (the ``*_fp8`` ones).

Each walks a query's top-k list in blocks of 64 entries with an online softmax, as
FlashMLA's kernels do, and plants one bug: ``invalid_read_as_zero`` (an invalid entry
reads row 0), ``partial_block_dropped`` (a list's last, partial block of 64 skipped),
``duplicates_merged`` (a row listed twice attended once), ``lse_in_base_2``,
``max_logits_before_scale``, ``max_started_at_zero`` (the online softmax's running
max started at 0, not -inf: rows whose scores all lie far below 0 underflow; class 33),
``tile_scale_off_by_one_fp8`` (tile ``t`` of a packed row
dequantized with tile ``t - 1``'s scale; tile 0 with its own), ``past_1024_dropped_fp8``
(a list's entries past 1024 never read: size-gated, below DeepSeek's top-k of 2048),
``model1_per_token_fp8`` (DeepSeek-V4's MODEL1 pages read as if each 584-byte row of the
view were one token's bytes), ``sink_as_base_2`` (the prefill's ``attn_sink`` taken as a
base-2 logit, as a kernel working in base 2 that scales its scores by ``log2 e`` but not
the sink would), ``indices_16_bit`` (a row index kept in 16 bits: rows past 2**16 wrap;
class 21 with 36). ``right``, ``right_fp8`` and ``right_model1_fp8`` are the
same kernels without a bug, which must pass.
"""

import math
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from attnref.conformance.families.sparse_mla import sparse_sdpa
from attnref.conformance.families.sparse_mla_fp8 import fp8_reference

BLOCK = 64
CLAIMS = replace(
    sparse_sdpa.capabilities,  # type: ignore[attr-defined]
    dtypes=(torch.float32, torch.bfloat16),
    topk_length=False,
)
#: the decode kernels read the 656-byte V32 cache; the MODEL1 ones the 584-byte pages
CLAIMS_FP8 = replace(fp8_reference.capabilities, topk_length=False, sparse_caches=("V32",))  # type: ignore[attr-defined]
CLAIMS_MODEL1 = replace(CLAIMS_FP8, sparse_caches=("MODEL1",))


def _attend(
    q: Tensor,
    rows: Tensor,
    idx: Tensor,
    scale: float,
    d_v: int,
    bug: str,
    sink: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One query ``q (h, D)`` against ``rows (n, D)`` through its list ``idx (topk,)``,
    block by block: ``(out (h, d_v), max_logits (h,), lse (h,))`` in float32; with a sink
    logit per head ``sink (h,)``, the output over the keys and the sink."""
    h = q.shape[0]
    n, topk = rows.shape[0], idx.shape[0]
    qf = q.float()
    # the softmax's running max; a kernel that starts it at 0 (where -inf belongs) loses
    # every row whose scores all lie far below 0: exp underflows to 0
    m = torch.zeros(h) if bug == "max_started_at_zero" else torch.full((h,), -math.inf)
    top = torch.full((h,), -math.inf)  # max_logits
    s = torch.zeros(h)
    acc = torch.zeros(h, d_v)
    seen: set[int] = set()
    stop = topk // BLOCK * BLOCK if bug == "partial_block_dropped" else topk
    if bug == "past_1024_dropped_fp8":  # a long list's later blocks never loaded
        stop = min(topk, 1024)
    for start in range(0, stop, BLOCK):
        block = idx[start : min(start + BLOCK, stop)].long()
        if bug == "indices_16_bit":  # a row index kept in 16 bits: rows past 2**16 wrap
            block = torch.where(block >= 0, block % 2**16, block)
        ok = (block >= 0) & (block < n)
        if bug == "invalid_read_as_zero":
            block, ok = torch.where(ok, block, 0), torch.ones_like(ok)
        if bug == "duplicates_merged":
            for j, i in enumerate(block.tolist()):
                if ok[j] and i in seen:
                    ok[j] = False
                seen.add(i)
        k = torch.where(ok[:, None], rows[block.clamp(0, max(n - 1, 0))].float(), 0.0)
        logits = (qf @ k.T) * scale
        logits = logits.masked_fill(~ok[None], -math.inf)
        top = torch.maximum(top, logits.amax(-1))
        m_new = torch.maximum(m, logits.amax(-1))
        safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
        alpha = torch.exp(m - safe)
        p = torch.exp(logits - safe[:, None])
        s = s * alpha + p.sum(-1)
        acc = acc * alpha[:, None] + p @ k[:, :d_v]
        m = m_new
    empty = s == 0
    out = torch.where(empty[:, None], 0.0, acc / torch.where(empty, 1.0, s)[:, None])
    lse = torch.where(empty, math.inf, m + torch.log(s))
    if sink is not None:  # the sink joins the denominator: exp(m) s + exp(sink)
        sigma = sink.float() * (math.log(2) if bug == "sink_as_base_2" else 1.0)
        keep = torch.where(empty, 0.0, 1.0 / (1.0 + torch.exp(sigma - lse)))
        out = out * keep[:, None]
    if bug == "lse_in_base_2":
        lse = lse / math.log(2)
    peak = top / scale if bug == "max_logits_before_scale" else top
    return out, peak, lse


def _prefill(bug: str = "") -> Any:
    def sparse(
        q: Tensor,
        kv: Tensor,
        indices: Tensor,
        sm_scale: float,
        d_v: int = 512,
        attn_sink: Tensor | None = None,
        topk_length: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if bug.startswith("materialised"):
            out, peak, lse = _gathered(q, kv, indices, sm_scale, d_v, bug.endswith("sentinels"))
        else:
            parts = [
                _attend(q[i], kv[:, 0], indices[i, 0], sm_scale, d_v, bug, attn_sink)
                for i in range(q.shape[0])
            ]
            out, peak, lse = (torch.stack(x) for x in zip(*parts, strict=True))
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        return out.to(q.dtype), peak.to(wide), lse.to(wide)

    sparse.capabilities = CLAIMS  # type: ignore[attr-defined]
    if bug.startswith("materialised"):  # NaN may propagate, and an empty query is NaN
        sparse.capabilities = replace(  # type: ignore[attr-defined]
            CLAIMS, masked_nan="propagates", empty_row="nan", empty_lse="-inf", attn_sink=False
        )
    return sparse


def _dequantize(k_cache: Tensor, bug: str) -> Tensor:
    """The 656-byte rows as float32 rows of 576 dims."""
    raw = k_cache.contiguous().view(torch.uint8)
    nope = raw[..., :512].contiguous().view(torch.float8_e4m3fn).float()
    scales = raw[..., 512:528].contiguous().view(torch.float32)
    if bug == "tile_scale_off_by_one_fp8":
        scales = torch.cat([scales[..., :1], scales[..., :-1]], dim=-1)
    tiles = nope.reshape(*nope.shape[:-1], 4, 128) * scales[..., None]
    rope = raw[..., 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat([tiles.reshape(*nope.shape), rope], dim=-1)


def _dequantize_model1(k_cache: Tensor, bug: str) -> Tensor:
    """MODEL1 pages (FlashMLA's ``tests/quant.py``) as float32 rows of 512 dims: a page's
    tokens' 576 value bytes each, then their 8 scale bytes each. ``model1_per_token_fp8``
    reads each 584-byte row of the view as one token's bytes instead (448 e4m3, 128
    rope, 7 scales, a pad), a layout the page-wise one is easily taken for."""
    blocks, page = k_cache.shape[:2]
    raw = k_cache.view(torch.uint8).reshape(blocks, page * 584)
    if bug == "model1_per_token_fp8":
        tokens = raw.reshape(blocks, page, 584)
        values, exps = tokens[..., :576], tokens[..., 576:583]
    else:
        values = raw[:, : page * 576].reshape(blocks, page, 576)
        exps = raw[:, page * 576 :].reshape(blocks, page, 8)[..., :7]
    nope = values[..., :448].contiguous().view(torch.float8_e4m3fn).float()
    rope = values[..., 448:].contiguous().view(torch.bfloat16).float()
    scales = torch.pow(2.0, exps.float() - 127)
    tiles = nope.reshape(blocks, page, 7, 64) * scales[..., None]
    return torch.cat([tiles.reshape(blocks, page, 448), rope], dim=-1)


def _decode(bug: str = "") -> Any:
    def sparse(
        q: Tensor,
        k_cache: Tensor,
        block_table: Tensor | None,
        cache_seqlens: Tensor | None,
        head_dim_v: int,
        tile_scheduler_metadata: object = None,
        num_splits: object = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        is_fp8_kvcache: bool = False,
        indices: Tensor | None = None,
        attn_sink: Tensor | None = None,
        topk_length: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        assert indices is not None
        B, Tq, h, D = q.shape
        if k_cache.shape[-1] == 584:
            rows = _dequantize_model1(k_cache, bug).reshape(-1, D)
        else:
            rows = _dequantize(k_cache, bug).reshape(-1, D)
        scale = D**-0.5 if softmax_scale is None else softmax_scale
        out = torch.empty(B, Tq, h, head_dim_v)
        lse = torch.empty(B, h, Tq)
        for b in range(B):
            for i in range(Tq):
                o, _, e = _attend(q[b, i], rows, indices[b, i], scale, head_dim_v, bug, attn_sink)
                out[b, i], lse[b, :, i] = o, e
        return out.to(q.dtype), lse

    sparse.capabilities = (  # type: ignore[attr-defined]
        CLAIMS_MODEL1 if bug.startswith("model1") else CLAIMS_FP8
    )
    return sparse


def _gathered(
    q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int, clamp_only: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """P @ V materialised over every entry's gathered row, as FlashMLA's torch reference,
    DeepSeek-V3.2's model code and fla's naive_dsa do: weight 0 times a NaN row is NaN,
    and a query with no valid entry is a softmax of -inf (NaN). ``clamp_only``: the bug,
    a sentinel's clamped row read as a token."""
    idx = indices[:, 0].long()  # (Tq, topk)
    n = kv.shape[0]
    valid = (idx >= 0) & (idx < n)
    rows = kv[idx.clamp(0, max(n - 1, 0)), 0].float()  # (Tq, topk, D): every entry
    logits = torch.einsum("qhd,qkd->qhk", q.float(), rows) * sm_scale
    if not clamp_only:
        logits = logits.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(logits, dim=-1)  # -inf for a query with no valid entry
    out = torch.softmax(logits, dim=-1) @ rows[..., :d_v]  # NaN there, and 0 * NaN
    return out, logits.amax(-1), lse


right = _prefill()
#: `_gathered`: right as declared (masked_nan="propagates", empty_row="nan")
materialised = _prefill("materialised")
#: `_gathered`, a sentinel's clamped row read as a token: wrong however declared
materialised_reads_sentinels = _prefill("materialised_reads_sentinels")
invalid_read_as_zero = _prefill("invalid_read_as_zero")
partial_block_dropped = _prefill("partial_block_dropped")
duplicates_merged = _prefill("duplicates_merged")
lse_in_base_2 = _prefill("lse_in_base_2")
max_logits_before_scale = _prefill("max_logits_before_scale")
max_started_at_zero = _prefill("max_started_at_zero")
sink_as_base_2 = _prefill("sink_as_base_2")
indices_16_bit = _prefill("indices_16_bit")
right_fp8 = _decode()
tile_scale_off_by_one_fp8 = _decode("tile_scale_off_by_one_fp8")
past_1024_dropped_fp8 = _decode("past_1024_dropped_fp8")
#: a row index kept in 16 bits, in the FP8 decode kernel: rows past 2**16 wrap
indices_16_bit_fp8 = _decode("indices_16_bit")
right_model1_fp8 = _decode("model1")
model1_per_token_fp8 = _decode("model1_per_token_fp8")

#: the planted bugs, by the family their kernel speaks
UNSEEN = {
    "invalid_read_as_zero": "sparse-mla",
    "partial_block_dropped": "sparse-mla",
    "duplicates_merged": "sparse-mla",
    "lse_in_base_2": "sparse-mla",
    "max_logits_before_scale": "sparse-mla",
    "max_started_at_zero": "sparse-mla",
    "sink_as_base_2": "sparse-mla",
    "indices_16_bit": "sparse-mla",
    "tile_scale_off_by_one_fp8": "sparse-mla-fp8",
    "past_1024_dropped_fp8": "sparse-mla-fp8",
    "model1_per_token_fp8": "sparse-mla-fp8",
    "indices_16_bit_fp8": "sparse-mla-fp8",
}
