"""Planted kernels of the gated delta rule's serving form (``--api gated-delta-decode``:
vLLM's ``fused_recurrent_gated_delta_rule``, a pool of states read and written at each
request's slots), in plain torch, importable without attnref (a bug report's repro.py
runs them so). ``right`` is correct; ``slot_by_order`` reads and writes slot ``n`` for
request ``n`` (a prefill slot read as a decode slot, class 37); ``output_as_keys``
returns its output in a buffer shaped as the keys, as vLLM's ``fused_recurrent_kda``
allocates it (``o = torch.empty_like(k)``)."""

from typing import Any

import torch
from torch import Tensor


def _decode(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
    pool: Tensor, cu_seqlens: Tensor, indices: Tensor, accepted: Tensor | None,
    l2norm: bool, by_order: bool,
) -> Tensor:  # fmt: skip
    """Token by token in float32 (float64 for float64 calls): each request from its slot
    (the last accepted token's, in a speculative step), each token's state written to
    its slot."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf, gf, bf = (x.to(work) for x in (q, k, v, g, beta))
    H, HV = qf.shape[2], vf.shape[2]
    qf, kf = (x.repeat_interleave(HV // H, dim=2) for x in (qf, kf))
    if l2norm:
        qf = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    scale = qf.shape[-1] ** -0.5 if scale is None else scale
    cu = [int(x) for x in cu_seqlens.tolist()]
    o = torch.zeros_like(vf)
    for n in range(len(cu) - 1):
        row = indices[n] if indices.dim() == 2 else indices[n : n + 1]
        if by_order:
            row = torch.arange(n * len(row), (n + 1) * len(row))
        first = 0 if accepted is None else int(accepted[n]) - 1
        S = pool[int(row[first])].to(work).clone()  # (HV, K, V)
        for i, t in enumerate(range(cu[n], cu[n + 1])):
            decay = gf[0, t].exp()
            S = S * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
            u = bf[0, t][:, None] * (vf[0, t] - torch.einsum("hkv,hk->hv", S, kf[0, t]))
            S = S + kf[0, t][:, :, None] * u[:, None, :]
            o[0, t] = scale * torch.einsum("hkv,hk->hv", S, qf[0, t])
            pool[int(row[min(i, len(row) - 1)])] = S.to(pool.dtype)
    return o.to(q.dtype)


def _kernel(by_order: bool = False, as_keys: bool = False) -> Any:
    def kernel(
        q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
        initial_state: Any = None, inplace_final_state: bool = True,
        cu_seqlens: Any = None, ssm_state_indices: Any = None, num_accepted_tokens: Any = None,
        use_qk_l2norm_in_kernel: bool = False,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        o = _decode(q, k, v, g, beta, scale, initial_state, cu_seqlens, ssm_state_indices,
                    num_accepted_tokens, use_qk_l2norm_in_kernel, by_order)  # fmt: skip
        if not as_keys:
            return o, initial_state
        out = torch.zeros_like(k)  # its first HV x V values a token laid out as they come
        n = min(out[0, 0].numel(), o[0, 0].numel())
        flat = o.reshape(o.shape[0], o.shape[1], -1)
        out.view(out.shape[0], out.shape[1], -1)[..., :n] = flat[..., :n]
        return out, initial_state

    return kernel


#: correct
right = _kernel()
#: request ``n`` reads and writes slot ``n``, whatever its index names
slot_by_order = _kernel(by_order=True)
#: right values, in an output buffer shaped as the keys ``(1, T, H, K)``: wrong wherever
#: ``V != K``
output_as_keys = _kernel(as_keys=True)
