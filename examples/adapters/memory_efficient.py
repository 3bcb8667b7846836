"""memory-efficient-attention-pytorch behind torch SDPA's signature.

Tested with memory-efficient-attention-pytorch 0.1.6. Its functions take ``(B, h, T, D)``
tensors with one head count, a boolean key-padding ``mask`` of shape ``(B, Tk)`` (True:
attend), an additive float ``attn_bias``, ``causal``, and no scale (always
``1/sqrt(D)``):

- `chunked`: ``memory_efficient_attention`` (Rabe and Staats' chunked softmax), with
  buckets of 4 queries and 4 keys so that the audit's small cases span several buckets;
- `plain`: ``attention``, the same library's materialised reference.

An explicit scale is folded into the query, as x-transformers does for its flash path.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnref.adapters import as_4d, declare, expand_mask, no_dropout, unflatten

BUCKET = 4
#: what the adapter raises for a mask the library cannot take (declared as a refusal)
REFUSAL = "takes key-padding masks only"


def _call(
    fn: Callable[..., Tensor],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    **extra: Any,
) -> Tensor:
    no_dropout(dropout_p)
    q, k, v = as_4d(query), as_4d(key), as_4d(value)
    if scale is not None and q.shape[-1]:
        q = q * (scale * q.shape[-1] ** 0.5)
    mask = expand_mask(attn_mask, query, key)
    padding, bias = None, None
    if mask is not None and mask.dtype == torch.bool:
        # a key-padding mask is the same for every head and query
        if not bool((mask == mask[:, :1, :1, :]).all()):
            raise NotImplementedError(REFUSAL)
        padding = mask[:, 0, 0, :]
    elif mask is not None:
        bias = mask
    out = fn(q, k, v, mask=padding, causal=is_causal, attn_bias=bias, **extra)
    return unflatten(out, query, value.shape[-1])


def chunked(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``memory_efficient_attention``: its causal mask is top-left (``triu(q_start - k_start
    + 1)`` per bucket)."""
    from memory_efficient_attention_pytorch.memory_efficient_attention import (
        memory_efficient_attention,
    )

    return _call(
        memory_efficient_attention,
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        q_bucket_size=BUCKET,
        k_bucket_size=BUCKET,
    )


def plain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    causal_alignment: str = "bottom_right",
) -> Tensor:
    """``attention``: its causal mask is ``triu(Tk - Tq + 1)``, bottom-right."""
    from memory_efficient_attention_pytorch.memory_efficient_attention import attention

    return _call(attention, query, key, value, attn_mask, dropout_p, is_causal, scale)


def _declare() -> None:
    common: dict[str, Any] = {
        "dropout": False,
        "gqa": False,  # one head count for queries, keys and values
        "causal_with_mask": True,
        "refuses": (REFUSAL,),
    }
    from attnref.conformance import EmptyRows

    # hidden scores are filled with -finfo.max, so a row that sees nothing averages V;
    # -inf in attn_bias is a softmax of -inf
    common["empty_row"] = EmptyRows(bool_mask="uniform", float_mask="nan", causal="uniform")
    declare(chunked, causal_alignments=("top_left",), **common)
    declare(plain, causal_alignments=("bottom_right",), **common)


_declare()
