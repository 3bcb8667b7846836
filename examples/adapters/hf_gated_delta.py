"""transformers' torch fallbacks of the gated delta rule for Qwen3-Next
(``transformers/models/qwen3_next/modeling_qwen3_next.py``, transformers 5.24.0:
``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule``, what a
Qwen3-Next layer runs where fla's kernels are not installed), declared for the
``gated-delta`` family (docs/linear.md).

Their signature is fla's without ``scale`` (always ``K ** -0.5``) and without packed
sequences: ``fn(query, key, value, g, beta, chunk_size=64, initial_state=None,
output_final_state=False, use_qk_l2norm_in_kernel=False)``, ``(B, T, H, K)`` layouts,
GVA by repeating the query/key heads. The adapters take fla's names and pass them on;
the declaration says what the functions do not take (an explicit scale, ``cu_seqlens``)
and that they compute in float32 whatever the inputs' dtype (their code casts every
input to float32 first), so float64 is not declared.

Both names are decorated (``use_kernel_func_from_hub_with_fallback``): where fla imports,
the call goes to fla's Triton kernel instead, whatever the device, so on a machine
without a GPU but with fla installed the "torch" fallback raises Triton's "0 active
drivers" (confirmed without attnref: docs/linear.md). The adapters call the torch path
itself (``inspect.unwrap``), which is what they audit.
"""

import inspect
from dataclasses import replace
from typing import Any

import torch

from attnref.conformance.families.gated_delta import FLA_CHUNK

#: what the fallbacks take: no explicit scale, no packed sequences, float32 compute
HF = replace(
    FLA_CHUNK,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    explicit_scale=False,
    linear_packed=False,
)


def _call(name: str, q: Any, k: Any, v: Any, g: Any, beta: Any, scale: Any,
          initial_state: Any, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
          cu_seqlens: Any) -> Any:  # fmt: skip
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    if scale is not None or cu_seqlens is not None:
        raise ValueError("transformers' fallbacks take no scale and no cu_seqlens")
    # the torch path itself: transformers dispatches the decorated name to fla's Triton
    # kernel whenever fla imports, with no device check (module docstring)
    fn = inspect.unwrap(getattr(qwen3_next, name))
    return fn(q, k, v, g, beta, initial_state=initial_state,
              output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)  # fmt: skip


def chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> Any:  # fmt: skip
    """transformers' ``torch_chunk_gated_delta_rule`` (chunks of 64)."""
    return _call("torch_chunk_gated_delta_rule", q, k, v, g, beta, scale, initial_state,
                 output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)  # fmt: skip


def recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> Any:  # fmt: skip
    """transformers' ``torch_recurrent_gated_delta_rule`` (token by token)."""
    return _call("torch_recurrent_gated_delta_rule", q, k, v, g, beta, scale, initial_state,
                 output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)  # fmt: skip


chunk.capabilities = HF  # type: ignore[attr-defined]
recurrent.capabilities = HF  # type: ignore[attr-defined]
