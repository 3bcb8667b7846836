"""HF transformers' attention functions behind torch SDPA's signature.

Tested with transformers 5.24. Two of the functions a model's ``config._attn_implementation``
selects:

- `sdpa`: ``transformers.integrations.sdpa_attention.sdpa_attention_forward``, which
  prepares the call (GQA, ``is_causal``) and calls torch's SDPA;
- `eager`: Llama's ``eager_attention_forward``, the materialised path: an additive
  float mask, softmax in float32, ``P @ V`` in the inputs' dtype.

Both take ``(B, h, T, D)`` and return ``(B, T, h, D)``; a model passes them a module
whose ``num_key_value_groups`` (and ``is_causal``) they read.
"""

from typing import Any

import torch
from torch import Tensor

from attnref.adapters import additive, as_4d, declare, expand_mask, no_dropout, unflatten


class _Module(torch.nn.Module):
    """What the functions read from the attention layer that calls them."""

    def __init__(self, groups: int, is_causal: bool) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = is_causal
        self.training = False


def sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``sdpa_attention_forward``: the mask and ``is_causal`` passed as a model passes them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    no_dropout(dropout_p)
    q, k, v = as_4d(query), as_4d(key), as_4d(value)
    module = _Module(q.shape[1] // k.shape[1], is_causal)
    out: Any
    out, _ = sdpa_attention_forward(
        module,
        q,
        k,
        v,
        expand_mask(attn_mask, query, key),
        dropout=0.0,
        scaling=scale,
        is_causal=is_causal,
    )
    return unflatten(out.transpose(1, 2), query, value.shape[-1])


def _eager(
    forward: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """A model's ``eager_attention_forward`` called as the model calls it: an additive
    float mask with ``torch.finfo(dtype).min`` at hidden keys (transformers' mask
    utilities), so a boolean mask is turned into that and a float mask passed as it is;
    causality only as a mask; ``sinks``: the module's sink logits, in the model's dtype."""
    no_dropout(dropout_p)
    if is_causal:
        raise NotImplementedError("the eager path takes causality as a mask")
    q, k, v = as_4d(query), as_4d(key), as_4d(value)
    mask = expand_mask(attn_mask, query, key)
    if mask is not None and mask.dtype == torch.bool:
        mask = additive(mask, q.dtype, torch.finfo(q.dtype).min)
    s = (q.shape[-1] ** -0.5 if q.shape[-1] else 1.0) if scale is None else scale
    module = _Module(q.shape[1] // k.shape[1], False)
    if sinks is not None:
        module.sinks = sinks.to(q.dtype)
    out: Any
    out, _ = forward(module, q, k, v, mask, scaling=s, dropout=0.0)
    return unflatten(out.transpose(1, 2), query, value.shape[-1])


def eager(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Llama's ``eager_attention_forward``: the materialised path, softmax in float32."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return _eager(
        eager_attention_forward, query, key, value, attn_mask, dropout_p, is_causal, scale
    )


def gpt_oss(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: Tensor | None = None,
) -> Tensor:
    """GPT-OSS's ``eager_attention_forward``: a learned sink logit per head (the
    module's ``sinks``) joins each row's softmax and is dropped after it."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    if sinks is None:
        raise NotImplementedError("GPT-OSS's attention always has sink logits")
    return _eager(
        eager_attention_forward, query, key, value, attn_mask, dropout_p, is_causal, scale, sinks
    )


def _declare() -> None:
    from attnref.conformance import EmptyRows

    # torch's SDPA underneath: its semantics (zeros for an empty row on the CPU). It drops
    # is_causal when a mask is passed (a model folds the diagonal into its mask): a
    # causal call with a mask leaks future keys (docs/adapters.md), so the diagonal
    # reaches it folded into the mask, as a model passes it
    declare(sdpa, dropout=False, causal_with_mask=False)
    declare(
        gpt_oss,
        dropout=False,
        causal_alignments=(),  # every causal case reaches it as a mask
        sinks=True,
        sinks_required=True,  # a sink logit per head on every call
    )
    declare(
        eager,
        dropout=False,
        causal_alignments=(),  # every causal case reaches it as a mask
        # a finfo.min fill averages V; -inf in a float mask is a softmax of -inf
        empty_row=EmptyRows(bool_mask="uniform", float_mask="nan", causal="uniform"),
    )


_declare()
