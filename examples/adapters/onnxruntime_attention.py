"""ONNX's ``Attention`` operator (opset 23 and 24), run by ONNX Runtime on the CPU, behind
torch SDPA's signature.

Tested with onnx 1.23.2 and onnxruntime 1.32.0 (``CPUExecutionProvider``). The operator
takes 4-D ``(B, h, T, D)`` Q, K and V (``h`` a multiple of K's heads: GQA; V's head dim
its own), an ``attn_mask`` broadcastable to ``(B, h, Tq, Tk)``, boolean (True: attend)
or added to the scores, and the attributes ``is_causal``, ``scale`` and ``softcap``. The
adapter builds one single-node model per dtype, kind of mask and attribute values (the
shapes are symbolic, so one session serves every shape) and runs it on the inputs moved
through NumPy: what an exported model does with the node.
"""

import functools
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnref.adapters import as_4d, declare, expand_mask, no_dropout, unflatten

#: the adapter's error for a call ONNX Runtime's CPU kernel cannot run (declared: refusal)
REFUSAL = "onnxruntime's CPU Attention takes"

_NUMPY = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}


@functools.cache
def _session(
    dtype: torch.dtype, mask: torch.dtype | None, causal: bool, scale: float | None, softcap: float
) -> Any:
    """An inference session of one ``Attention`` node (opset 24), symbolic shapes."""
    import onnxruntime
    from onnx import TensorProto, helper

    kind = {torch.float64: TensorProto.DOUBLE, torch.float32: TensorProto.FLOAT,
            torch.float16: TensorProto.FLOAT16}[dtype]  # fmt: skip
    shapes = (("Q", "h", "Tq", "D"), ("K", "g", "Tk", "D"), ("V", "g", "Tk", "Dv"))
    inputs = [helper.make_tensor_value_info(n, kind, ["B", a, t, d]) for n, a, t, d in shapes]
    if mask is not None:
        mask_kind = TensorProto.BOOL if mask == torch.bool else kind
        inputs.append(helper.make_tensor_value_info("M", mask_kind, ["B", "m", "Tq", "Tk"]))
    attributes: dict[str, Any] = {"is_causal": int(causal)}
    if scale is not None:
        attributes["scale"] = scale
    if softcap:
        attributes["softcap"] = softcap
    names = [i.name for i in inputs]
    node = helper.make_node("Attention", names, ["Y"], **attributes)
    output = helper.make_tensor_value_info("Y", kind, None)
    graph = helper.make_graph([node], "attention", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    model.ir_version = 10
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    return onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    softcap: float = 0.0,
) -> Tensor:
    """``Attention(Q, K, V, attn_mask; is_causal, scale, softcap)`` in ONNX Runtime."""
    no_dropout(dropout_p)
    if query.dtype not in _NUMPY:
        raise NotImplementedError(f"{REFUSAL} float64, float32 and float16, not {query.dtype}")
    q, k, v = (as_4d(t).contiguous().numpy() for t in (query, key, value))
    feeds = {"Q": q, "K": k, "V": v}
    full = expand_mask(attn_mask, query, key)
    if full is not None:
        feeds["M"] = full.contiguous().numpy()
    session = _session(
        query.dtype, None if full is None else full.dtype, is_causal, scale, float(softcap)
    )
    (out,) = session.run(None, feeds)
    return unflatten(torch.from_numpy(np.asarray(out).copy()), query, value.shape[-1])


def _declare() -> None:
    declare(
        attention,
        dtypes=(torch.float64, torch.float32, torch.float16),
        dropout=False,
        gradients=False,  # ONNX Runtime's inference sessions have no backward
        softcap=True,
        refuses=(REFUSAL,),
    )


_declare()
