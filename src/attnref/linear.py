"""Linear attention with a recurrent state: the gated delta rule (Gated DeltaNet) and KDA.

Hybrid models (Qwen3-Next and Qwen3.5: three of every four layers; Kimi Linear) keep a
linear attention whose whole history is one fixed-size state per value head, ``S`` of
``(K, V)``. For each token ``t``, in order (docs/linear.md, after flash-linear-attention's
``naive_recurrent_gated_delta_rule`` and the Gated Delta Networks paper, arXiv
2412.06464):

    S   = exp(g_t) * S                  (decay; KDA: exp(gk_t) per key channel, diag(...) S)
    u_t = beta_t * (v_t - S^T k_t)      (the correction: what the state mispredicts)
    S   = S + k_t u_t^T                 (the delta rule's update)
    o_t = S^T (scale * q_t)             (read out with the updated state)

Shapes follow fla's convention: ``q, k (B, T, H, K)``, ``v (B, T, HV, V)`` with ``HV`` a
multiple of ``H`` (value head ``j`` reads query/key head ``j // (HV // H)``: GVA),
``g, beta (B, T, HV)``, ``gk (B, T, HV, K)``, states ``(N, HV, K, V)``, ``scale`` by
default ``K ** -0.5``. Packed sequences come as ``cu_seqlens`` (``N + 1`` offsets, ``B =
1``); each sequence starts from its own initial state and no state crosses a boundary.
With ``l2norm``, ``q`` and ``k`` are first divided by ``sqrt(sum x^2 + 1e-6)`` (fla's
``use_qk_l2norm_in_kernel``).

`gated_delta_rule` is the recurrence itself, token by token; `chunked_gated_delta_rule`
computes the same in chunks of 64 tokens as the prefill kernels do (the WY, or UT,
representation: one triangular solve a chunk), and Hypothesis holds the two equal
(tests/property/test_linear_props.py). Both compute in the inputs' dtype (float32 or
float64) and return the output in it and the final states.
"""

import itertools
import math

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from attnref._checking import checked

__all__ = ["L2NORM_EPS", "chunked_gated_delta_rule", "gated_delta_rule", "l2norm"]

#: what fla's L2 norm adds under the square root (``fla.modules.l2norm``)
L2NORM_EPS = 1e-6


@checked
def l2norm(x: Float[Tensor, "*shape D"], eps: float = L2NORM_EPS) -> Float[Tensor, "*shape D"]:
    """``x / sqrt(sum x^2 + eps)`` over its last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _spans(cu_seqlens: Tensor | None, B: int, T: int) -> list[tuple[int, int, int]]:
    """``(batch row, start, end)`` of each sequence: one a batch row, or the packed ones
    (a clear error for offsets that are not ``N + 1`` rising integers from 0 within T)."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
        raise ValueError(
            f"cu_seqlens must be a 1-d int32 or int64 tensor, got {cu_seqlens.dtype} of shape "
            f"{tuple(cu_seqlens.shape)}"
        )
    if B != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need a batch of 1, got {B}")
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] > T:
        raise ValueError(f"cu_seqlens must rise from 0 to at most T = {T}, got {offsets}")
    if any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError(f"cu_seqlens must never decrease, got {offsets}")
    return [(0, a, b) for a, b in itertools.pairwise(offsets)]


def _prepared(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
    spans: list[tuple[int, int, int]],
    l2: bool,
) -> tuple[Tensor, Tensor, float, Tensor]:
    """``q`` and ``k`` per value head (GVA: each query/key head repeated for its value
    heads), L2-normed where asked, the scale, and the initial states (zeros by default)."""
    H, HV = q.shape[-2], v.shape[-2]
    if HV % H:
        raise ValueError(f"v's heads (HV = {HV}) must be a multiple of q's and k's (H = {H})")
    if l2:
        q, k = l2norm(q), l2norm(k)
    q = q.repeat_interleave(HV // H, dim=-2)
    k = k.repeat_interleave(HV // H, dim=-2)
    K, V = k.shape[-1], v.shape[-1]
    if initial_state is None:
        initial_state = v.new_zeros(len(spans), HV, K, V)
    elif initial_state.shape != (len(spans), HV, K, V):
        raise ValueError(
            f"initial_state must have shape (N, HV, K, V) = {(len(spans), HV, K, V)} for "
            f"{len(spans)} sequences, got {tuple(initial_state.shape)}"
        )
    return q, k, (K**-0.5 if scale is None else scale), initial_state


@checked
def gated_delta_rule(
    q: Float[Tensor, "B T H K"],
    k: Float[Tensor, "B T H K"],
    v: Float[Tensor, "B T HV V"],
    g: Float[Tensor, "B T HV"] | None,
    beta: Float[Tensor, "B T HV"],
    *,
    scale: float | None = None,
    initial_state: Float[Tensor, "N HV K V"] | None = None,
    l2norm_qk: bool = False,
    cu_seqlens: Integer[Tensor, " N1"] | None = None,
    gk: Float[Tensor, "B T HV K"] | None = None,
) -> tuple[Float[Tensor, "B T HV V"], Float[Tensor, "N HV K V"]]:
    """The gated delta rule, token by token (the module docstring's recurrence): the
    output and each sequence's final state. ``g`` decays the whole state, ``gk`` each key
    channel of it (KDA); either may be None (no decay). Tokens past the last packed
    sequence are padding: never read, output 0."""
    B, T = q.shape[:2]
    spans = _spans(cu_seqlens, B, T)
    q, k, scale, state = _prepared(q, k, v, scale, initial_state, spans, l2norm_qk)
    out = torch.zeros_like(v)
    final = torch.empty_like(state)
    for n, (b, start, end) in enumerate(spans):
        S = state[n].clone()  # (HV, K, V)
        for t in range(start, end):
            if g is not None:
                S = S * g[b, t].exp()[:, None, None]
            if gk is not None:
                S = S * gk[b, t].exp()[:, :, None]
            predicted = torch.einsum("hkv,hk->hv", S, k[b, t])
            u = beta[b, t][:, None] * (v[b, t] - predicted)
            S = S + k[b, t][:, :, None] * u[:, None, :]
            out[b, t] = torch.einsum("hkv,hk->hv", S, scale * q[b, t])
        final[n] = S
    return out, final


#: the prefill kernels' chunk (fla's ``chunk_size=64``)
CHUNK = 64


@checked
def chunked_gated_delta_rule(
    q: Float[Tensor, "B T H K"],
    k: Float[Tensor, "B T H K"],
    v: Float[Tensor, "B T HV V"],
    g: Float[Tensor, "B T HV"] | None,
    beta: Float[Tensor, "B T HV"],
    *,
    scale: float | None = None,
    initial_state: Float[Tensor, "N HV K V"] | None = None,
    l2norm_qk: bool = False,
    cu_seqlens: Integer[Tensor, " N1"] | None = None,
    gk: Float[Tensor, "B T HV K"] | None = None,
    chunk: int = CHUNK,
) -> tuple[Float[Tensor, "B T HV V"], Float[Tensor, "N HV K V"]]:
    """`gated_delta_rule` computed a chunk of ``chunk`` tokens at a time, as prefill
    kernels do. Within a chunk starting from state ``S0``, with ``D[i, j, c]`` the decay
    from token ``j`` to token ``i`` (``exp`` of the summed log decays of tokens ``j + 1 ..
    i``, per key channel ``c``; 1 without decay), every correction is known at once
    (the WY / UT representation):

        (I + A) U = diag(beta) (V - (D0 * K) S0)
        A[i, j]   = beta_i sum_c k_ic D[i, j, c] k_jc               (j < i)
        O  = scale ((D0 * Q) S0 + (sum_c q_ic D[i, j, c] k_jc, j <= i) U)
        S1 = (Dend * S0) + sum_j (D[end, j] * k_j) u_j^T

    with ``D0[i]`` the decay from the chunk's start through token ``i``. Each decay is
    formed from differences of the running log sums, never as a ratio of two exps: a
    running sum far below 0 (a model's ``-exp(A) * softplus``) would underflow a ratio's
    terms to 0 / 0."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    B, T = q.shape[:2]
    spans = _spans(cu_seqlens, B, T)
    q, k, scale, state = _prepared(q, k, v, scale, initial_state, spans, l2norm_qk)
    K = k.shape[-1]
    HV = v.shape[-2]
    out = torch.zeros_like(v)
    final = torch.empty_like(state)
    for n, (b, start, end) in enumerate(spans):
        S = state[n].clone()  # (HV, K, V)
        for c0 in range(start, end, chunk):
            c1 = min(end, c0 + chunk)
            C = c1 - c0
            # the log decay of each token per value head and key channel: (HV, C, K)
            log = q.new_zeros(HV, C, K)
            if g is not None:
                log = log + g[b, c0:c1].transpose(0, 1)[:, :, None]
            if gk is not None:
                log = log + gk[b, c0:c1].transpose(0, 1)
            run = log.cumsum(1)  # through token i, from the chunk's start
            # D[h, i, j, c] = exp(run_i - run_j) for j <= i, else 0
            lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
            diff = (run[:, :, None, :] - run[:, None, :, :]).masked_fill(
                ~lower[None, :, :, None], -math.inf
            )
            D = diff.exp()
            qc = q[b, c0:c1].transpose(0, 1)  # (HV, C, K)
            kc = k[b, c0:c1].transpose(0, 1)
            vc = v[b, c0:c1].transpose(0, 1)  # (HV, C, V)
            bc = beta[b, c0:c1].transpose(0, 1)  # (HV, C)
            start_decay = run.exp()  # (HV, C, K): from S0 through token i
            kk = torch.einsum("hic,hijc,hjc->hij", kc, D, kc)
            A = bc[:, :, None] * kk.tril(-1)
            eye = torch.eye(C, dtype=q.dtype, device=q.device)
            rhs = bc[:, :, None] * (vc - torch.einsum("hic,hcv->hiv", start_decay * kc, S))
            U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
            qk = torch.einsum("hic,hijc,hjc->hij", qc, D, kc)
            reads = torch.einsum("hic,hcv->hiv", start_decay * qc, S)
            out[b, c0:c1] = (scale * (reads + qk @ U)).transpose(0, 1)
            to_end = (run[:, -1:, :] - run).exp()  # (HV, C, K): from token j to the end
            S = run[:, -1, :].exp()[:, :, None] * S + torch.einsum("hjc,hjv->hcv", to_end * kc, U)
        final[n] = S
    return out, final
