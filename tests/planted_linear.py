"""Planted gated delta rule kernels in fla's chunk convention, in plain torch, written
apart from attnref's reference and importable without attnref (a bug report's repro.py
can load them): ``fn(q, k, v, g, beta, scale=None, initial_state=None,
output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None) -> (o,
final_state)``.

The kernel is the chunked (WY) form as fla's Triton kernels compute it: chunks of 64, the
log decays summed in float32 within a chunk, ``(I + A)^-1`` of each chunk, and every
matmul's operands rounded to the inputs' dtype (``k * beta``, the WY factors, the state
before the output's dot), accumulated in float32. ``right`` is correct; the others each
plant one point of class 37.
"""

from typing import Any

import torch
from torch import Tensor

CHUNK = 64


def _kernel(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None, *, bug: str = "",
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    dtype = q.dtype
    f = torch.float64 if dtype == torch.float64 else torch.float32

    def rd(x: Tensor) -> Tensor:  # an operand as the kernel's dot reads it
        return x.to(dtype).to(f)

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    qf = q.to(f).repeat_interleave(HV // H, 2)
    kf = k.to(f).repeat_interleave(HV // H, 2)
    if use_qk_l2norm_in_kernel:
        qf = rd(qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + 1e-6))
        kf = rd(kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6))
    vf, gf, bf = v.to(f), g.to(torch.float32).to(f), beta.to(f)
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(x) for x in cu_seqlens.tolist()]
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = torch.zeros(B, T, HV, V, dtype=f)
    finals = []
    carry = torch.zeros(HV, dtype=f)
    for n, (b, s, e) in enumerate(spans):
        S = torch.zeros(HV, K, V, dtype=f) if initial_state is None else initial_state[n].to(f)
        for c0 in range(s, e, CHUNK):
            c1 = min(e, c0 + CHUNK)
            C = c1 - c0
            G = gf[b, c0:c1].transpose(0, 1).cumsum(-1)  # (HV, C), float32
            if bug == "gate_sum_crosses_sequences" and c0 == s:
                G = G + carry  # the previous sequence's running sum not reset
            lower = torch.ones(C, C, dtype=torch.bool).tril()
            if bug == "underflowing_ratio":
                D = (G.exp()[:, :, None] / G.exp()[:, None, :]).masked_fill(~lower, 0.0)
            else:
                diff = (G[:, :, None] - G[:, None, :]).masked_fill(~lower, -torch.inf)
                D = diff.exp()
            qc, kc = qf[b, c0:c1].transpose(0, 1), kf[b, c0:c1].transpose(0, 1)
            vc, bc = vf[b, c0:c1].transpose(0, 1), bf[b, c0:c1].transpose(0, 1)
            kb = rd(kc * bc[..., None])
            A = (kb @ rd(kc).transpose(1, 2)) * D.tril(-1)
            eye = torch.eye(C, dtype=f).expand(HV, C, C)
            Tm = rd(torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True))
            w = Tm @ rd(kb * G.exp()[..., None])
            u = Tm @ rd(vc * bc[..., None])
            v_new = u - rd(w) @ rd(S)
            qk = (rd(qc) @ rd(kc).transpose(1, 2)) * D
            out = rd(qc * G.exp()[..., None]) @ rd(S) + rd(qk) @ rd(v_new)
            o[b, c0:c1] = (scale * out).transpose(0, 1)
            last = G[:, -1]
            if bug == "tail_decay_skipped" and C < CHUNK:
                last = torch.zeros_like(last)  # the partial chunk's own decay left out
            k_end = rd(kc * (G[:, -1:] - G).exp()[..., None])
            S = last.exp()[:, None, None] * S + k_end.transpose(1, 2) @ rd(v_new)
        carry = G[:, -1] if e > s else carry
        finals.append(S)
    states = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    final = torch.stack(finals).to(states) if output_final_state else None
    return o.to(dtype), final


def right(*args: object, **kwargs: object) -> tuple[Tensor, Tensor | None]:
    """Correct."""
    return _kernel(*args, **kwargs)  # type: ignore[arg-type]


def gate_sum_crosses_sequences(*args: object, **kwargs: object) -> tuple[Tensor, Tensor | None]:
    """In a pack, each sequence's running sum of log decays starts from the previous
    sequence's last one, not from 0: its initial state is decayed by the other's gates."""
    return _kernel(*args, **kwargs, bug="gate_sum_crosses_sequences")  # type: ignore[arg-type]


def tail_decay_skipped(*args: object, **kwargs: object) -> tuple[Tensor, Tensor | None]:
    """The last, partial chunk's decay left out of the state it carries over: the final
    state is wrong whenever T is not a multiple of 64 (the outputs are right)."""
    return _kernel(*args, **kwargs, bug="tail_decay_skipped")  # type: ignore[arg-type]


def underflowing_ratio(*args: object, **kwargs: object) -> tuple[Tensor, Tensor | None]:
    """A chunk's decays as exp(G_i) / exp(G_j): 0 / 0 once the running sum passes
    float32's smallest exp (a model's -exp(A) * softplus decays reach it)."""
    return _kernel(*args, **kwargs, bug="underflowing_ratio")  # type: ignore[arg-type]


def returns_output_only(*args: object, **kwargs: object) -> Tensor:
    """Returns ``o`` alone, not ``(o, final_state)``."""
    return _kernel(*args, **kwargs)[0]  # type: ignore[arg-type]


class _StateGradientDropped(torch.autograd.Function):
    """The chunk kernel with a backward of its own that recomputes the output's graph
    and drops the final state's upstream gradient (``dht``)."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> tuple[Tensor, Tensor]:
        q, k, v, g, beta, h0, scale, l2, cu = inputs
        ctx.save_for_backward(q, k, v, g, beta, h0)
        ctx.options = (scale, l2, cu)
        o, final = _kernel(q, k, v, g, beta, scale, h0, True, l2, cu)
        assert final is not None
        return o, final

    @staticmethod
    def backward(ctx: Any, *upstream: Any) -> tuple[Tensor | None, ...]:
        d_o, _d_final = upstream  # the bug: the final state's gradient is dropped
        scale, l2, cu = ctx.options
        with torch.enable_grad():
            leaves: list[Any] = [None if x is None else x.detach().requires_grad_(True)
                                 for x in ctx.saved_tensors]  # fmt: skip
            q, k, v, g, beta, h0 = leaves
            o, _ = _kernel(q, k, v, g, beta, scale, h0, True, l2, cu)
            wanted = [x for x in leaves if x is not None]
            found = iter(torch.autograd.grad(o, wanted, d_o, allow_unused=True))
        grads = tuple(None if x is None else next(found) for x in leaves)
        return (*grads, None, None, None)


def final_state_gradient_ignored(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Right forward; its backward recomputes the output alone and drops the final
    state's upstream gradient: wrong gradients whenever a loss reads the final state
    (the state handed to the next chunk of a chunked prefill, or a test's ``dht``)."""
    o, final = _StateGradientDropped.apply(  # type: ignore[no-untyped-call]
        q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel, cu_seqlens
    )
    return o, (final if output_final_state else None)


def _declare() -> None:
    """Each kernel's declaration where attnref imports (a bug report's repro.py loads
    this module without it): fla's chunk convention, gradients included."""
    try:
        from dataclasses import replace

        from attnref.conformance.families.gated_delta import FLA_CHUNK
    except ImportError:
        return
    for fn in (right, final_state_gradient_ignored):
        fn.capabilities = replace(FLA_CHUNK, gradients=True)  # type: ignore[attr-defined]


_declare()
