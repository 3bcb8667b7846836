"""FlashAttention's Triton backend (``flash_attn/flash_attn_triton_amd``, FlashAttention
2.8.3's PyPI release: the kernel its ``FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE`` build runs
for ``flash_attn_func`` on AMD GPUs, ``fwd_prefill.py``'s ``attn_fwd``), called through
FlashAttention's own ``flash_attn_func`` (``--api flash``) and run by Triton's
interpreter on the CPU (docs/interpreted.md).

Two things stand between a CPU and that call, and the adapter does each in the open:

- ``flash_attn_triton_amd/bwd_prefill_onekernel.py`` does not import under Triton 3.9:
  its ``@triton.autotune`` keys name ``IS_CAUSAL``, ``dropout_p``, ``MAX_SEQLENS_Q``, ...,
  which are not that kernel's arguments, and Triton since 3.3 refuses such keys at import
  (FlashAttention's README asks for Triton 3.2). The forward never touches it: the adapter
  puts a module in its place whose backward raises, so the package imports (the
  declaration says ``gradients=False``).
- ``flash_attn_func`` reaches the kernel through a torch custom op registered for CUDA
  only (``flash_attn::_flash_attn_forward``): the adapter registers the op's own Python
  body (``interface_fa.fwd``, as on a GPU) as its CPU kernel too.

What the README of 2.8.3 lists as supported is declared: causal masks, GQA, any head
size and length, float32, float16 and bfloat16; not ALiBi, which it lists too: its host
code asserts ``alibi_slopes.is_cuda`` (``utils.py``, ``need_alibi``), which no CPU
tensor is (an audit of it here only finds that assertion). Sliding windows are "work in
progress" there and softcap is not listed: both are declared absent. (Its ``fwd`` takes
``window_size_left``, ``window_size_right`` and ``softcap`` and uses none of them: a
caller who passes them gets full attention without a word. attnref does not audit what a
kernel declares absent.) Its tiles, without ``FLASH_ATTENTION_TRITON_AMD_AUTOTUNE``, are
64 x 64 (``get_autotune_configs``' one config off AMD's data-centre and consumer GPUs).
``return_attn_probs=True`` returns ``(out, lse, S)``: the LSE (natural log) is audited.

What importing it took (``nox -s peers`` does this): FlashAttention's source release
built with ``FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE
FLASH_ATTENTION_FORCE_BUILD=TRUE pip install --no-build-isolation --no-deps
flash-attn==2.8.3.post2`` (no CUDA, nothing compiled), and einops.

The module imports attnref only for its declaration, where attnref is installed: a bug
report's repro.py (docs/reports.md) calls ``flash_attn_func`` with torch, FlashAttention
and this file.
"""

import os
import sys
import types
import warnings
from dataclasses import replace
from typing import Any

import torch

#: the tiles of ``attn_fwd`` as audited (``BLOCK_M``, ``BLOCK_N``)
BLOCK_M = BLOCK_N = 64

# the Triton backend, not the CUDA extension this build does not have (read at import)
os.environ["FLASH_ATTENTION_TRITON_AMD_ENABLE"] = "TRUE"
_BACKWARD = "flash_attn.flash_attn_triton_amd.bwd_prefill_onekernel"


def _no_backward(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        "FlashAttention 2.8.3's one-kernel Triton backward does not import under this "
        "Triton (its autotune keys are not its arguments); only the forward is audited"
    )


if _BACKWARD not in sys.modules:
    _stand_in = types.ModuleType(_BACKWARD)
    _stand_in.attention_prefill_backward_triton_split_oneKernel_impl = _no_backward  # type: ignore[attr-defined]
    sys.modules[_BACKWARD] = _stand_in

with warnings.catch_warnings():  # its autotune arguments Triton 3.9 deprecates
    warnings.simplefilter("ignore", DeprecationWarning)
    from flash_attn import flash_attn_interface

_FORWARDS = (
    flash_attn_interface._flash_attn_forward,
    flash_attn_interface._flash_attn_varlen_forward,
)
for _op in _FORWARDS:  # the ops' own Python bodies, as their CPU kernels
    _op.register_kernel("cpu")(_op._init_fn)

#: FlashAttention's own ``flash_attn_func``, now callable on CPU tensors
flash_attn_func = flash_attn_interface.flash_attn_func


def _declare() -> None:
    try:
        from attnref.conformance.families.flash import FLASH_ATTN_2
    except ImportError:  # a bug report's repro.py, without attnref
        return
    flash_attn_func.capabilities = replace(
        FLASH_ATTN_2,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        window=False,
        softcap=False,
        alibi=False,
        gradients=False,
        interpreter="triton",
        tile_queries=BLOCK_M,
        tile_keys=BLOCK_N,
    )


_declare()
