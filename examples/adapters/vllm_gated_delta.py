"""vLLM's vendored copy of fla's fused recurrent gated delta rule
(``fused_recurrent_gated_delta_rule``, vLLM 0.34.0:
``vllm/third_party/flash_linear_attention/ops/fused_recurrent.py``, what vLLM's
Qwen3-Next and Qwen3.5 layers decode with) in the ``gated-delta-decode`` convention,
run through Triton's interpreter on the CPU (docs/linear.md, docs/interpreted.md).

The call is vLLM's own, its arguments as the family passes them: the requests' tokens
packed by ``cu_seqlens``, a pool of states read and written in place at
``ssm_state_indices`` (one slot a request in decode; one a drafted token, with
``num_accepted_tokens``, in speculative decoding). Two things of vLLM's pool differ
from the family's, and the adapter maps them in the open, around the call:

- vLLM 0.34's copy keeps a state as ``(HV, V, K)`` (its docstring and its kernel:
  ``i_hv * V * K + o_v * K + o_k``), fla's and the family's as ``(HV, K, V)``: the pool
  is handed over transposed, and the states vLLM left are transposed back;
- slot 0 is vLLM's null block (``NULL_BLOCK_ID``: a request whose slot is ``<= 0`` is
  skipped, its output not written): the family's slot ``s`` is vLLM's ``s + 1``, with a
  slot 0 of zeros before them.

Every slot of the family's pool is copied back from vLLM's after the call, so a write to
a slot no request names is still seen (the family fills those with NaN and holds them
bit for bit).

vLLM takes Triton for absent unless exactly one GPU driver is active, or
``CUDA_VISIBLE_DEVICES`` is empty: under the interpreter the adapter sets the latter
before importing vLLM (as examples/adapters/vllm_unified.py does). What importing it
took (``nox -s peers`` does this): vLLM's wheel installed ``--no-deps``, and ``regex``.

The module imports attnref only for its declaration, where attnref is installed: a bug
report's repro.py calls ``decode`` with torch, vLLM and this file.
"""

import os
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor


def decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    inplace_final_state: bool = True,
    cu_seqlens: Tensor | None = None,
    ssm_state_indices: Tensor | None = None,
    num_accepted_tokens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor]:
    """vLLM's ``fused_recurrent_gated_delta_rule``, interpreted, on the pool as vLLM
    keeps it (transposed states, a null slot 0)."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # before vLLM first looks for Triton
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from vllm.third_party.flash_linear_attention.ops.fused_recurrent import (
        fused_recurrent_gated_delta_rule,
    )

    if not inplace_final_state:
        raise NotImplementedError("the adapter takes vLLM's serving form: a pool, in place")

    def call(theirs: Tensor, indices: Tensor) -> Any:
        o, _ = fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, scale, theirs, True, cu_seqlens, indices, num_accepted_tokens,
            use_qk_l2norm_in_kernel,
        )  # fmt: skip
        return o

    return _on_vllms_pool(call, initial_state, ssm_state_indices)


def _on_vllms_pool(call: Any, pool: Tensor | None, indices: Tensor | None) -> tuple[Tensor, Tensor]:
    """``call(theirs, indices)`` on the pool as vLLM keeps it (states ``(HV, V, K)``,
    slot 0 its null block, each index one more), every slot copied back after it; the
    output and the family's pool."""
    if pool is None or indices is None:
        raise NotImplementedError("the adapter takes vLLM's serving form: a pool, in place")
    slots, HV, K, V = pool.shape
    theirs = torch.zeros((slots + 1, HV, V, K), dtype=pool.dtype, device=pool.device)
    theirs[1:] = pool.transpose(-1, -2)
    o = call(theirs, indices.to(torch.int64) + 1)
    pool.copy_(theirs[1:].transpose(-1, -2))
    return o, pool


def kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    inplace_final_state: bool = True,
    cu_seqlens: Tensor | None = None,
    ssm_state_indices: Tensor | None = None,
    num_accepted_tokens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor]:
    """vLLM's ``fused_recurrent_kda`` (``ops/kda.py``: KDA, ``g (1, T, HV, K)``, one decay
    a key channel), interpreted, on the pool as vLLM keeps it; the L2 norm passed as the
    family asks (vLLM's default is on). It takes no ``num_accepted_tokens`` (its
    ``**kwargs`` would swallow one): declared without speculative decoding."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from vllm.third_party.flash_linear_attention.ops.kda import fused_recurrent_kda

    if num_accepted_tokens is not None or not inplace_final_state:
        raise NotImplementedError("the adapter takes vLLM's KDA decode form: no speculation")

    def call(theirs: Tensor, indices: Tensor) -> Any:
        o, _ = fused_recurrent_kda(
            q, k, v, g, beta, scale=scale, initial_state=theirs, inplace_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
            ssm_state_indices=indices,
        )  # fmt: skip
        return o

    return _on_vllms_pool(call, initial_state, ssm_state_indices)


def _declare() -> None:
    try:
        from attnref.conformance.families.gated_delta_decode import VLLM_FUSED_RECURRENT
    except ImportError:  # a bug report's repro.py, without attnref
        return
    # dtypes: the kernel keeps its state and computes in float32 whatever the inputs;
    # float64 calls come out at float32's precision (1.9e-7 off), which is its design,
    # not a bug: vLLM serves it in half precision and float32
    decode.capabilities = replace(  # type: ignore[attr-defined]
        VLLM_FUSED_RECURRENT,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        interpreter="triton",
    )
    kda.capabilities = replace(  # type: ignore[attr-defined]
        decode.capabilities,  # type: ignore[attr-defined]
        linear_gate="key",
        gqa=False,  # Kimi Linear's heads: as many value heads as query/key heads
        speculative=False,
    )


_declare()
