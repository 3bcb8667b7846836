"""OpenVINO's ``ScaledDotProductAttention`` operator (opset 13) on its CPU plugin, behind
torch SDPA's signature.

Tested with openvino 2026.4.1. The operator takes ``[N, ..., L, E]`` queries, keys and
values of one element type (V's last dim its own), an ``attention_mask`` (boolean,
True: attend, or added to the scores), a ``scale`` and a ``causal`` attribute that, as
its documentation says, "autogenerates causal attention mask instead of using
attention_mask input. In this case attention_mask input is ignored". The adapter builds
one model per element type, kind of mask, causal flag and explicit scale (the shapes are
dynamic), compiles it for the CPU, and runs it on the inputs moved through NumPy
(bfloat16 as its raw bits).

Precision: on a CPU with bfloat16 instructions, the CPU plugin runs a float32 model in
bfloat16 unless told otherwise (its ``INFERENCE_PRECISION_HINT`` defaults to bf16 there);
the adapter compiles with ``EXECUTION_MODE_HINT=ACCURACY``, which keeps each call in its
own element type, so that the audit judges the operator and not that default.
"""

import functools
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnref.adapters import as_4d, declare, expand_mask, no_dropout, unflatten

#: the adapter's error for a call the operator cannot take (declared: a refusal)
REFUSAL = "OpenVINO's ScaledDotProductAttention takes"


@functools.cache
def _compiled(dtype: torch.dtype, mask: torch.dtype | None, causal: bool, scaled: bool) -> Any:
    """The operator compiled for the CPU: inputs q, k, v, then the mask and the scale
    where the call has them (a scale without a mask gets the scalar 0 for a mask)."""
    import openvino as ov
    import openvino.opset13 as ops

    kind = {torch.float64: ov.Type.f64, torch.float32: ov.Type.f32,
            torch.float16: ov.Type.f16, torch.bfloat16: ov.Type.bf16}[dtype]  # fmt: skip
    q, k, v = (ops.parameter([-1, -1, -1, -1], kind, name=n) for n in "qkv")
    inputs = [q, k, v]
    attention_mask: Any = None
    if mask is not None:
        attention_mask = ops.parameter(
            [-1, -1, -1, -1], ov.Type.boolean if mask == torch.bool else kind, name="mask"
        )
        inputs.append(attention_mask)
    scale: Any = None
    if scaled:
        scale = ops.parameter([], kind, name="scale")
        inputs.append(scale)
        if attention_mask is None:
            attention_mask = ops.constant(np.zeros((), dtype=np.float32)).output(0)
            attention_mask = ops.convert(attention_mask, kind)
    node = ops.scaled_dot_product_attention(q, k, v, attention_mask, scale, causal)
    model = ov.Model([node], inputs)
    config = {"EXECUTION_MODE_HINT": "ACCURACY", "INFERENCE_NUM_THREADS": 1}
    return ov.Core().compile_model(model, "CPU", config)


def _tensor(t: Tensor) -> Any:
    import openvino as ov

    t = t.detach().contiguous()
    if t.dtype != torch.bfloat16:
        return ov.Tensor(t.numpy().copy())
    out = ov.Tensor(ov.Type.bf16, list(t.shape))
    out.data.view(np.uint16)[...] = t.view(torch.int16).numpy().view(np.uint16)
    return out


def _back(out: Any, dtype: torch.dtype) -> Tensor:
    data = np.asarray(out.data)
    if dtype == torch.bfloat16:
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(data.copy())


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``ScaledDotProductAttention(q, k, v, attention_mask, scale; causal)``."""
    no_dropout(dropout_p)
    if key.shape[-3] != query.shape[-3]:
        raise NotImplementedError(f"{REFUSAL} as many key heads as query heads (no GQA)")
    full = expand_mask(attn_mask, query, key)
    inputs = [as_4d(t) for t in (query, key, value)]
    if full is not None:
        inputs.append(full if full.dtype == torch.bool else full.to(query.dtype))
    if scale is not None:
        inputs.append(torch.tensor(scale, dtype=query.dtype))
    compiled = _compiled(query.dtype, None if full is None else full.dtype, is_causal,
                         scale is not None)  # fmt: skip
    request = compiled.create_infer_request()
    request.infer([_tensor(t) for t in inputs])
    out = _back(request.get_output_tensor(0), query.dtype)
    return unflatten(out, query, value.shape[-1])


def _declare() -> None:
    declare(
        attention,
        dropout=False,
        gradients=False,  # a compiled inference model has no backward
        gqa=False,  # key heads broadcast to the query heads' count, or the call raises
        causal_with_mask=False,  # documented: with causal, the mask input is ignored
        # the specification's pseudo-code: a boolean mask hides with -inf, a float mask is
        # added; a query that sees no key is then a softmax of -inf alone
        empty_row="nan",
        refuses=(REFUSAL,),
    )


_declare()
