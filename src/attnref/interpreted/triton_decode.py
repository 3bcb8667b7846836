"""A split-KV decode kernel written in Triton, in FlashAttention's ``flash-kvcache``
convention (``flash_attn_with_kvcache``): attnref's own, run through Triton's
interpreter on a CPU, and the correct twin of the planted decode kernels
(``tests/planted_triton.py``), whose bugs ``BUG`` switches on in its Triton code.

Two stages, as SGLang's and vLLM's Triton decode kernels have:

1. one program per (batch row, block of 16 queries, head, split): the row's keys cut
   into ``S`` splits of ``cdiv(L, S)`` keys (a split may be empty), each read through
   the block table a key block at a time (FP8 keys and values scaled by their
   per-(batch, KV head) descales),
   with an online softmax; each split stores its normalised output and log-sum-exp;
2. one program per (batch row, block of 16 queries, head): the splits merged, each
   weighted by ``exp(lse_s - max lse)``.

The new tokens (``k``, ``v``) are written into the cache first (by torch indexing, as
the callers of those kernels do in a kernel of their own), and the output is stored in
float32 (float64 for float64 inputs) and rounded to its dtype by torch: Triton 3.9's
interpreter truncates a float32 to bfloat16 instead of rounding it.
"""

import torch
import triton
import triton.language as tl
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from attnref._checking import checked
from attnref.kvcache import cache_slots, cached_lengths

__all__ = ["BUGS", "flash_attn_with_kvcache"]

#: the planted bugs ``BUG`` switches on (0: none)
BUGS = {
    "page_off_by_one": 1,  # a key's page is block_table[(t + 1) // page]: the last slot of
    # every page is read from the next page
    "merge_unweighted": 2,  # the splits averaged, not weighted by their log-sum-exps
    "v_descale_dropped": 3,  # FP8 values read without their descale
}


@triton.jit
def _split(
    Q, K, V, BT, LENS, QD, KD, VD, MID_O, MID_L,
    sq_r, sq_h, sk_p, sk_s, sk_h, sv_p, sv_s, sv_h, sbt, sqd, smo_r, smo_h, smo_s, sml_r,
    Tq, H, GROUP, DQK, DV, PAGES, scale, left, right,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr, ACC: tl.constexpr, BUG: tl.constexpr,
):  # fmt: skip
    tiles = tl.cdiv(Tq, BLOCK_M)
    b = tl.program_id(0) // tiles
    i = (tl.program_id(0) % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)  # its queries
    h = tl.program_id(1)
    s = tl.program_id(2)
    hk = h // GROUP
    rows = b * Tq + i
    L = tl.load(LENS + b)
    diag = L - Tq + i  # bottom right: each query's diagonal key
    hi = tl.zeros([BLOCK_M], tl.int32) + L
    if CAUSAL:
        hi = tl.minimum(hi, diag + 1)
    lo = tl.zeros([BLOCK_M], tl.int32)
    if WINDOW:
        if right >= 0:
            hi = tl.minimum(hi, diag + right + 1)
        if left >= 0:
            lo = tl.maximum(lo, diag - left)
    chunk = tl.cdiv(L, SPLITS)
    start = s * chunk
    end = tl.minimum(L, start + chunk)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + rows[:, None] * sq_r + h * sq_h + offs_dq[None, :],
        mask=(i[:, None] < Tq) & (offs_dq[None, :] < DQK), other=0.0,
    ).to(ACC)  # fmt: skip
    q = q * tl.load(QD + b * sqd + hk).to(ACC) * scale
    k_scale = tl.load(KD + b * sqd + hk).to(ACC)
    v_scale = tl.load(VD + b * sqd + hk).to(ACC)
    if BUG == 3:
        v_scale = k_scale * 0.0 + 1.0
    m = tl.full([BLOCK_M], float("-inf"), ACC)
    total = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + offs_n
        inside = t < end
        index = t // PAGE
        if BUG == 1:
            index = tl.minimum((t + 1) // PAGE, PAGES - 1)
        page = tl.load(BT + b * sbt + index, mask=inside, other=0)
        slot = t % PAGE
        k = tl.load(
            K + page[None, :] * sk_p + slot[None, :] * sk_s + hk * sk_h + offs_dq[:, None],
            mask=inside[None, :] & (offs_dq[:, None] < DQK), other=0.0,
        ).to(ACC)  # fmt: skip
        scores = tl.dot(q, k) * k_scale
        visible = inside[None, :] & (t[None, :] >= lo[:, None]) & (t[None, :] < hi[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - base[:, None])
        alpha = tl.exp(m - base)
        v = tl.load(
            V + page[:, None] * sv_p + slot[:, None] * sv_s + hk * sv_h + offs_dv[None, :],
            mask=inside[:, None] & (offs_dv[None, :] < DV), other=0.0,
        ).to(ACC)  # fmt: skip
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v) * v_scale
        m = m_new
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    here = i < Tq
    tl.store(
        MID_O + rows[:, None] * smo_r + h * smo_h + s * smo_s + offs_dv[None, :], out,
        mask=here[:, None] & (offs_dv[None, :] < DV),
    )  # fmt: skip
    tl.store(MID_L + rows * sml_r + h * SPLITS + s, lse, mask=here)


@triton.jit
def _merge(
    MID_O, MID_L, OUT, LSE, smo_r, smo_h, smo_s, sml_r, so_r, so_h, Tq, H, DV,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, BUG: tl.constexpr,
):  # fmt: skip
    tiles = tl.cdiv(Tq, BLOCK_M)
    b = tl.program_id(0) // tiles
    i = (tl.program_id(0) % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    here = i < Tq
    rows = b * Tq + i
    offs_s = tl.arange(0, SPLITS)
    offs_dv = tl.arange(0, BLOCK_DV)
    lses = tl.load(MID_L + rows[:, None] * sml_r + h * SPLITS + offs_s[None, :],
                   mask=here[:, None], other=float("-inf"))  # fmt: skip
    top = tl.max(lses, 1)
    base = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lses - base[:, None])
    if BUG == 2:
        w = tl.where(lses == float("-inf"), 0.0, 1.0)
    total = tl.sum(w, 1)
    seen = total > 0
    out = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
    for s in range(SPLITS):
        part = tl.load(
            MID_O + rows[:, None] * smo_r + h * smo_h + s * smo_s + offs_dv[None, :],
            mask=here[:, None] & (offs_dv[None, :] < DV), other=0.0,
        )  # fmt: skip
        weight = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), 1)
        out += weight[:, None] * part
    out = out / tl.where(seen, total, 1.0)[:, None]
    tl.store(OUT + rows[:, None] * so_r + h * so_h + offs_dv[None, :], out,
             mask=here[:, None] & (offs_dv[None, :] < DV))  # fmt: skip
    lse = tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), float("inf"))
    tl.store(LSE + rows * H + h, lse, mask=here)


def _block(n: int) -> int:
    return max(16, int(triton.next_power_of_2(n)))


@checked
def flash_attn_with_kvcache(
    q: Shaped[Tensor, "B Tq h Dh"],
    k_cache: Shaped[Tensor, "Bc S g Dh"],
    v_cache: Shaped[Tensor, "Bc S g Dv"],
    k: Shaped[Tensor, "B Tn g Dh"] | None = None,
    v: Shaped[Tensor, "B Tn g Dv"] | None = None,
    cache_seqlens: Int[Tensor, " B"] | int | None = None,
    cache_batch_idx: Int[Tensor, " B"] | None = None,
    block_table: Int[Tensor, "B P"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    num_splits: int = 0,
    q_descale: Float[Tensor, "B g"] | None = None,
    k_descale: Float[Tensor, "B g"] | None = None,
    v_descale: Float[Tensor, "B g"] | None = None,
    return_softmax_lse: bool = False,
    *,
    kv_splits: int = 4,
    block_n: int = 16,
    bug: int = 0,
) -> Float[Tensor, "B Tq h Dv"] | tuple[Float[Tensor, "B Tq h Dv"], Float[Tensor, "B h Tq"]]:
    """FlashAttention's ``flash_attn_with_kvcache`` by the two Triton kernels above:
    ``q`` ``(B, Tq, h, D)``; a contiguous cache ``(B_cache, T, g, D)`` (rows picked by
    ``cache_batch_idx``) or a paged one ``(pages, page, g, D)`` with ``block_table``;
    ``k``, ``v``: new tokens appended in place at ``cache_seqlens``; FP8 ``q``, caches
    and new tokens with FlashAttention 3's ``(B, g)`` descales return bfloat16. The keys
    are cut into ``num_splits`` splits (else ``kv_splits``); ``bug``: a planted bug of
    `BUGS` (0: none)."""
    B, Tq, H, DQK = q.shape
    G, DV = k_cache.shape[2], v_cache.shape[3]
    T_new = 0 if k is None else k.shape[1]
    page = k_cache.shape[1]
    if block_table is None:  # a contiguous cache: one page a row, as long as the cache
        rows = torch.arange(B) if cache_batch_idx is None else cache_batch_idx.long()
        table = rows.reshape(B, 1).to(torch.int32)
    else:
        table = block_table.to(torch.int32)
    # the tokens already cached (FlashAttention's rule: none given, the cache is full)
    before = cached_lengths(cache_seqlens, B, table.shape[1] * page, T_new)
    if k is not None and v is not None:  # the new tokens at each row's next slots
        for b, n in enumerate(before):
            row = b if cache_batch_idx is None else int(cache_batch_idx[b])
            for t, (r, s) in enumerate(cache_slots(b, range(n, n + T_new), block_table, page, row)):
                k_cache[r, s], v_cache[r, s] = k[b, t], v[b, t]
    lengths = torch.tensor([n + T_new for n in before], dtype=torch.int32)
    fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    ones = torch.ones(B, G, dtype=torch.float32)
    qd, kd, vd = (ones if d is None else d.float().contiguous()
                  for d in (q_descale, k_descale, v_descale))  # fmt: skip
    splits = triton.next_power_of_2(max(1, num_splits or kv_splits))
    scale = DQK**-0.5 if softmax_scale is None else float(softmax_scale)
    left, right = (int(w) for w in window_size)
    qr = q.reshape(B * Tq, H, DQK).contiguous()
    k_read = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_read = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    mid_o = torch.zeros(B * Tq, H, splits, DV, dtype=acc)
    mid_l = torch.full((B * Tq, H, splits), float("-inf"), dtype=acc)
    out = torch.zeros(B * Tq, H, DV, dtype=acc)
    lse = torch.full((B * Tq, H), float("inf"), dtype=acc)
    tl_acc = tl.float64 if acc == torch.float64 else tl.float32
    block_m = 16
    if B * Tq * H:
        _split[(B * triton.cdiv(Tq, block_m), H, splits)](
            qr, k_read, v_read, table, lengths, qd, kd, vd, mid_o, mid_l,
            qr.stride(0), qr.stride(1), k_read.stride(0), k_read.stride(1),
            k_read.stride(2), v_read.stride(0), v_read.stride(1), v_read.stride(2),
            table.stride(0), qd.stride(0), mid_o.stride(0), mid_o.stride(1),
            mid_o.stride(2), mid_l.stride(0),
            Tq, H, H // G, DQK, DV, table.shape[1], scale, left, right,
            CAUSAL=causal, WINDOW=(left, right) != (-1, -1), PAGE=page, SPLITS=splits,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DQK=_block(DQK), BLOCK_DV=_block(DV),
            ACC=tl_acc,
            BUG=bug,
        )  # fmt: skip
        _merge[(B * triton.cdiv(Tq, block_m), H)](
            mid_o, mid_l, out, lse, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_l.stride(0), out.stride(0), out.stride(1), Tq, H, DV,
            SPLITS=splits, BLOCK_M=block_m, BLOCK_DV=_block(DV), ACC=tl_acc, BUG=bug,
        )  # fmt: skip
    dtype = torch.bfloat16 if fp8 else q.dtype
    result = out.reshape(B, Tq, H, DV).to(dtype)
    if return_softmax_lse:
        lse_out = lse.reshape(B, Tq, H).transpose(1, 2).contiguous()
        return result, lse_out if acc == torch.float64 else lse_out.float()
    return result
