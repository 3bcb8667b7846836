"""Planted gated delta rule kernels in plain Triton, fla's chunk convention
(``--api gated-delta``), audited through Triton's interpreter
(``interpreter="triton"``): one program a (sequence, value head), token by token, the
state in float32 registers, as fla's and vLLM's fused recurrent kernels are written.

Written as real kernels are, so that auditing them needs what auditing those needs: the
loop's variable used as a tensor (``i.to(tl.int64)``: valid Triton, where the
interpreter's loop gives a Python ``int``), and an autotuner built as a class, not
through ``triton.autotune`` (fla's ``CachedAutotuner``), which attnref must pin all the
same. ``right`` is correct; ``gva_modulo`` reads query/key head ``j % H`` for value head
``j``; ``last_token_unwritten`` stores each sequence's final state from before its last
token.
"""

from dataclasses import replace
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.autotuner import Autotuner

from attnref.conformance.families.gated_delta import FLA_CHUNK

CAPABILITIES = replace(
    FLA_CHUNK,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    interpreter="triton",
    max_call_work=2**15,  # one program a token loop: few heads, small head dims
)


def _recurrent(
    q: Any, k: Any, v: Any, g: Any, beta: Any, o: Any, h0: Any, ht: Any, cu: Any,
    scale: Any, T: Any, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
    PACKED: tl.constexpr, L2: tl.constexpr, BUG: tl.constexpr,
) -> None:  # fmt: skip
    i_nh = tl.program_id(0)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv % H if BUG == 1 else i_hv // (HV // H)
    if PACKED:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        bos = i_n * T
        eos = bos + T
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    mkv = mk[:, None] & mv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + i_nh * K * V + o_k[:, None] * V + o_v[None, :], mask=mkv, other=0.0)
    before = S
    for i in range(eos - bos):
        t = bos + i.to(tl.int64)  # type: ignore[attr-defined]  # a tensor on a device
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=mk, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=mk, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=mv, other=0.0).to(tl.float32)
        if L2:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        before = S
        S = S * tl.exp(tl.load(g + t * HV + i_hv).to(tl.float32))
        b_v = b_v - tl.sum(S * b_k[:, None], 0)
        b_v = b_v * tl.load(beta + t * HV + i_hv).to(tl.float32)
        S = S + b_k[:, None] * b_v[None, :]
        b_o = tl.sum(S * (b_q * scale)[:, None], 0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mv)
    if BUG == 2:
        S = before
    tl.store(ht + i_nh * K * V + o_k[:, None] * V + o_v[None, :], S, mask=mkv)


_JIT = triton.jit(_recurrent)
#: an autotuner built as a class (as fla builds its CachedAutotuner), two configurations
_TUNED = Autotuner(
    _JIT, _JIT.arg_names, [triton.Config({}, num_warps=1), triton.Config({}, num_warps=4)],
    ["K", "V"], None, None,
)  # fmt: skip


def _call(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
    initial_state: Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Tensor | None, bug: int,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    o = torch.empty_like(v)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
    h0 = ht if initial_state is None else initial_state.float().contiguous()
    cu = ht if cu_seqlens is None else cu_seqlens
    _TUNED[(N * HV,)](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        o, h0, ht, cu, K**-0.5 if scale is None else scale, T, H=H, HV=HV, K=K, V=V,
        BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V),
        USE_H0=initial_state is not None, PACKED=cu_seqlens is not None,
        L2=use_qk_l2norm_in_kernel, BUG=bug,
    )  # fmt: skip
    states = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    return o, (ht.to(states) if output_final_state else None)


def right(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Correct."""
    return _call(q, k, v, g, beta, scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, cu_seqlens, 0)  # fmt: skip


def gva_modulo(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Value head ``j`` reads query/key head ``j % H``, not ``j // (HV / H)``."""
    return _call(q, k, v, g, beta, scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, cu_seqlens, 1)  # fmt: skip


def last_token_unwritten(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Each sequence's final state stored from before its last token."""
    return _call(q, k, v, g, beta, scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, cu_seqlens, 2)  # fmt: skip


for _fn in (right, gva_modulo, last_token_unwritten):
    _fn.capabilities = CAPABILITIES  # type: ignore[attr-defined]
