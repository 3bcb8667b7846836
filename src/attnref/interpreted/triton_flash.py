"""A flash-attention forward kernel written in Triton, in FlashAttention 2's ``flash``
convention: attnref's own, known to be right, run through Triton's interpreter on a CPU.

It is the interpreter's check of itself (`attnref.interpreted.self_check`): before an
audit of an interpreted Triton kernel judges anything, this kernel must match the
float64 oracle there, so that a broken interpreter is not blamed on the kernel. It is
also the correct twin of the planted Triton kernels (``tests/planted_triton.py``), whose
bugs are switched on by ``BUG``, a compile-time constant of the kernel: each is a line
of Triton, not of torch.

The kernel: one program per (query block, batch and head); online softmax over key
blocks of ``BLOCK_N``; GQA by ``h // (h / g)``; causal from the bottom right (query ``i``
sees key ``j`` where ``j <= i + Tk - Tq``); a sliding window ``(left, right)`` about that
diagonal; the log-sum-exp (``+inf`` for a query that sees no key, whose output is 0).
"""

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

from attnref._checking import checked

__all__ = ["BUGS", "flash_attn_func", "reductions"]

#: the planted bugs ``BUG`` switches on (0: none)
BUGS = {
    "tail_dropped": 1,  # the last, partial key block is never visited
    "causal_top_left": 2,  # the causal diagonal from the top left when Tq != Tk
    "no_rescale": 3,  # the running sum is not rescaled when the running max grows
}


@triton.jit
def _flash_fwd(
    Q, K, V, Out, L,
    sqb, sqt, sqh, sqd,
    skb, skt, skh, skd,
    svb, svt, svh, svd,
    sob, sot, soh, sod,
    Tq, Tk, H, GROUP, DQK, DV, scale, left, right,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BUG: tl.constexpr,
    SUMS_IN_INPUT: tl.constexpr = False,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_dq[None, :] * sqd
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < Tq) & (offs_dq[None, :] < DQK), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    shift = Tk - Tq  # bottom right: query i's diagonal is key i + Tk - Tq
    if BUG == 2:
        shift = 0
    hi = Tk
    if CAUSAL:
        hi = tl.minimum(Tk, tl.maximum((pid_m + 1) * BLOCK_M + shift, 0))
    if WINDOW and right >= 0:
        hi = tl.minimum(hi, tl.maximum((pid_m + 1) * BLOCK_M + shift + right, 0))
    blocks = tl.cdiv(hi, BLOCK_N)
    if BUG == 1:
        blocks = hi // BLOCK_N
    for start in range(0, blocks * BLOCK_N, BLOCK_N):
        kn = start + offs_n
        k_ptrs = K + b * skb + hk * skh + kn[None, :] * skt + offs_dq[:, None] * skd
        k = tl.load(k_ptrs, mask=(kn[None, :] < Tk) & (offs_dq[:, None] < DQK), other=0.0)
        s = tl.dot(q, k) * scale
        visible = (kn[None, :] < Tk) & (offs_m[:, None] < Tq)
        if CAUSAL:
            visible = visible & (kn[None, :] <= offs_m[:, None] + shift)
        if WINDOW:
            if left >= 0:
                visible = visible & (kn[None, :] >= offs_m[:, None] + shift - left)
            if right >= 0:
                visible = visible & (kn[None, :] <= offs_m[:, None] + shift + right)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m_i - base)
        if BUG == 3:
            alpha = tl.full([BLOCK_M], 1.0, tl.float32)
        if SUMS_IN_INPUT:  # the row sums over P as P V reads it (bfloat16 for bfloat16)
            l_i = l_i * alpha + tl.sum(p.to(V.dtype.element_ty), 1)
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = V + b * svb + hk * svh + kn[:, None] * svt + offs_dv[None, :] * svd
        v = tl.load(v_ptrs, mask=(kn[:, None] < Tk) & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = Out + b * sob + h * soh + offs_m[:, None] * sot + offs_dv[None, :] * sod
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < Tq) & (offs_dv[None, :] < DV))  # fmt: skip
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("inf"))
    tl.store(L + bh * Tq + offs_m, lse.to(L.dtype.element_ty), mask=offs_m < Tq)


def _block(n: int) -> int:
    return max(16, int(triton.next_power_of_2(n)))


@checked
def flash_attn_func(
    q: Float[Tensor, "B Tq h Dh"],
    k: Float[Tensor, "B Tk g Dh"],
    v: Float[Tensor, "B Tk g Dv"],
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    return_attn_probs: bool = False,
    *,
    block_m: int = 16,
    block_n: int = 16,
    bug: int = 0,
    sums_in_input: bool = False,
) -> Float[Tensor, "B Tq h Dv"] | tuple[Float[Tensor, "B Tq h Dv"], Float[Tensor, "B h Tq"], None]:
    """FlashAttention 2's ``flash_attn_func`` on ``(B, T, h, D)`` tensors, by the Triton
    kernel above; ``return_attn_probs=True`` returns ``(out, lse, None)``, ``lse``
    ``(B, h, Tq)`` in float32 (float64 for float64 inputs). ``block_m``, ``block_n``: its
    tiles; ``bug``: a planted bug of `BUGS` (0: none); ``sums_in_input``: the softmax's
    row sums taken over P rounded to the inputs' dtype, as ``P V`` reads it (a
    ``tl.sum`` over a bfloat16 tile for bfloat16 inputs: right, and what the
    interpreter's unfixed reductions got wrong)."""
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p={dropout_p}: this kernel has no dropout")
    B, Tq, H, DQK = q.shape
    Tk, G, DV = k.shape[1], k.shape[2], v.shape[3]
    if H % G:
        raise ValueError(f"{H} query heads cannot share {G} key heads")
    scale = DQK**-0.5 if softmax_scale is None else float(softmax_scale)
    out = torch.empty(B, Tq, H, DV, dtype=q.dtype, device=q.device)
    # the LSE in float32, as FlashAttention's, but float64 for float64 inputs (the audit
    # holds a float64 call to float64's precision: its own audit found this)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.empty(B, H, Tq, dtype=lse_dtype, device=q.device)
    left, right = (int(w) for w in window_size)
    if B * H and Tq:
        grid = (triton.cdiv(Tq, block_m), B * H)
        _flash_fwd[grid](
            q, k, v, out, lse,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            Tq, Tk, H, H // G, DQK, DV, scale, left, right,
            CAUSAL=causal, WINDOW=(left, right) != (-1, -1),
            BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_DQK=_block(DQK), BLOCK_DV=_block(DV), BUG=bug,
            SUMS_IN_INPUT=sums_in_input,
        )  # fmt: skip
    return (out, lse, None) if return_attn_probs else out


@triton.jit
def _reduce_rows(X, Out, M: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, M)[:, None]
    cols = tl.arange(0, N)[None, :]
    x = tl.load(X + rows * N + cols)
    at = tl.arange(0, M)
    tl.store(Out + 0 * M + at, tl.sum(x, 1))
    tl.store(Out + 1 * M + at, tl.max(x, 1))
    tl.store(Out + 2 * M + at, tl.min(x, 1))
    tl.store(Out + 3 * M + at, tl.sum(tl.cumsum(x, 1), 1))
    tl.store(Out + 4 * M + at, tl.argmax(x, 1).to(Out.dtype.element_ty))


@checked
def reductions(x: Float[Tensor, "M N"]) -> Float[Tensor, "5 M"]:
    """Each row of ``x`` (``M``, ``N`` powers of two) reduced by Triton in ``x``'s dtype:
    its sum, max, min, the sum of its running sums (``tl.cumsum``) and its argmax: the
    reductions the interpreter's check of itself runs (`attnref.interpreted.checks`)."""
    out = torch.empty(5, x.shape[0], dtype=x.dtype)
    _reduce_rows[(1,)](x.contiguous(), out, M=x.shape[0], N=x.shape[1])
    return out
