"""flash-linear-attention's gated delta rule kernels (fla-core 0.6.0:
``fla/ops/gated_delta_rule/chunk.py`` and ``fused_recurrent.py``), declared for the
``gated-delta`` family and run through Triton's interpreter on the CPU
(docs/linear.md, docs/interpreted.md).

``chunk`` is ``chunk_gated_delta_rule`` itself, whose signature is the family's: the
declaration only says what it takes. fla's kernels compute in float32 with the inputs'
dtype for the dots' operands; they do not take float64 (a ``tl.dot`` of a float32 and a
float64 tile), so float64 is not declared. ``recurrent`` is
``fused_recurrent_gated_delta_rule`` in the same convention, called by name: its own
signature takes ``gk`` and ``gv`` positionally after ``g`` (``(q, k, v, g, gk, gv,
beta, ...)``), so a call in the chunk kernel's positional order would pass ``beta`` as
``gk``. It has no pool of states (vLLM's copy adds ``ssm_state_indices``).

What importing it took: ``pip install --no-deps fla-core==0.6.0 einops`` (fla-core's
``cpu`` extra would pull triton and a torch of its own choosing; the project's pinned
CPU torch and triton 3.9 are enough). attnref's interpreter fixes let it run there: the
autotuners fla builds itself (``CachedAutotuner``) are pinned to their first kept
configuration, and a ``range`` loop's variable is a tensor as on a device
(``i_t.to(tl.int64)`` in ``chunk_gated_delta_rule_fwd_kernel_h``).
"""

from dataclasses import replace
from typing import Any

import torch

from attnref.conformance.families.gated_delta import FLA_CHUNK

#: what fla's kernels take, as attnref audits them interpreted: no float64
FLA = replace(
    FLA_CHUNK,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    interpreter="triton",
    # an interpreted call costs per program (batch row, value head) and chunk: cases of
    # up to 131 tokens keep their lengths and give up batch rows and heads past this
    max_call_work=2**17,
)


def chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> Any:  # fmt: skip
    """fla's ``chunk_gated_delta_rule``, as a user calls it."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  cu_seqlens=cu_seqlens)  # fmt: skip


chunk.capabilities = FLA  # type: ignore[attr-defined]


def recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> Any:  # fmt: skip
    """fla's ``fused_recurrent_gated_delta_rule``, in the chunk kernel's convention."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    # by name: fla's fused recurrent takes gk and gv positionally after g (0.6.0), where
    # the chunk kernel takes beta
    return fused_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
    )  # fmt: skip


#: the fused recurrent kernel's programs are (value block of 8 channels, sequence, value
#: head), each looping over every token: its calls are held to smaller head dims
FLA_RECURRENT = replace(FLA, max_call_work=2**15)
recurrent.capabilities = FLA_RECURRENT  # type: ignore[attr-defined]


def chunk_backward(*args: Any, **kwargs: Any) -> Any:
    """fla's ``chunk_gated_delta_rule`` declared with its backward (``gradients``): the
    same call, audited by ``gdn_gradient`` as well (fla's ``ChunkGatedDeltaRuleFunction``
    returns ``dq, dk, dv, dg, dbeta`` and ``dh0``, and takes ``dht``)."""
    return chunk(*args, **kwargs)


chunk_backward.capabilities = replace(FLA, gradients=True)  # type: ignore[attr-defined]


def kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> Any:  # fmt: skip
    """fla's ``chunk_kda`` (KDA, Kimi Linear's linear attention): the family's call with
    ``g`` a log decay a key channel, ``(B, T, H, K)``, the shape of ``q`` and ``k``."""
    from fla.ops.kda import chunk_kda

    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     cu_seqlens=cu_seqlens)  # fmt: skip


#: KDA as fla takes it: a decay a key channel, no GVA (q, k and g of one shape); its
#: chunk kernels (a decay per key channel within the chunk) cost the interpreter more
#: than the gated delta rule's: its calls are held to the fused recurrent's bound
kda.capabilities = replace(  # type: ignore[attr-defined]
    FLA, linear_gate="key", gqa=False, max_call_work=2**15
)
