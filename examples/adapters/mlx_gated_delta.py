"""mlx-lm's gated delta rule (mlx-lm 0.32.2, ``mlx_lm/models/gated_delta.py``:
``gated_delta_ops``, what its Qwen3-Next and Qwen3.5 models run where Metal is not
available, as on Linux with ``mlx[cpu]``), behind fla's ``chunk_gated_delta_rule``
convention for the ``gated-delta`` family (docs/linear.md).

mlx-lm's convention differs from fla's, and the adapter converts, in MLX, what the
model's own code does before the call: ``g`` is the decay itself, not its log (mlx-lm's
``compute_g`` returns ``exp(-exp(A_log) * softplus(a + dt_bias))``), so the adapter
passes ``exp(g)``; the state is ``(B, HV, V, K)``, V before K, so states are transposed
both ways; there is no ``scale`` argument (the model scales ``q`` first, in
``normalize_qk``), so the adapter multiplies ``q`` by the scale; there is no in-kernel L2
norm and no ``cu_seqlens``, which the declaration says. Tensors cross as float32 NumPy
arrays and are cast to the call's dtype in MLX (NumPy has no bfloat16).

What importing it took: ``pip install --no-deps mlx==0.32.4 mlx-cpu==0.32.4
mlx-lm==0.32.2`` (mlx-lm's own dependencies, transformers among them, are not needed to
import ``mlx_lm.models.gated_delta``).
"""

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from attnref.conformance.families.gated_delta import FLA_CHUNK

#: what gated_delta_ops takes: no in-kernel L2 norm, no packed sequences; the decays and
#: the state in float32, the inputs in float32, float16 or bfloat16
MLX = replace(
    FLA_CHUNK,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    qk_l2norm=False,
    linear_packed=False,
)

_MX = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def ops(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> Any:  # fmt: skip
    """mlx-lm's ``gated_delta_ops`` in fla's convention (module docstring)."""
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_ops

    if use_qk_l2norm_in_kernel or cu_seqlens is not None:
        raise ValueError("gated_delta_ops takes no in-kernel L2 norm and no cu_seqlens")
    dtype = getattr(mx, _MX[q.dtype])

    def to_mx(x: torch.Tensor, as_dtype: Any = None) -> Any:
        return mx.array(x.detach().float().cpu().numpy()).astype(as_dtype or dtype)

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qm = to_mx(q) * mx.array(scale, dtype=dtype)
    state = None
    if initial_state is not None:
        state = to_mx(initial_state.transpose(-1, -2), mx.float32)
    y, final = gated_delta_ops(qm, to_mx(k), to_mx(v), mx.exp(to_mx(g, mx.float32)),
                               to_mx(beta), state)  # fmt: skip
    mx.eval(y, final)
    out = torch.from_numpy(np.array(y.astype(mx.float32))).to(q.dtype)
    states = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    last = torch.from_numpy(np.array(final.astype(mx.float32)))
    return out, (last.transpose(-1, -2).to(states).contiguous() if output_final_state else None)


ops.capabilities = MLX  # type: ignore[attr-defined]
