"""torch's SDPA for the test backends that wrap it, taking every call its signature
takes: torch raises on ``is_causal=True`` with an ``attn_mask``, which the default
declaration tests, so the (top-left) diagonal is folded into the mask here, as a
library that takes both would apply it."""

from typing import Any

import torch
from torch import Tensor

_NAMES = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention(q, k, v, *args, **kwargs)``,
    with a causal diagonal and a mask passed together folded into one mask."""
    kwargs.update(zip(_NAMES, args, strict=False))
    mask = kwargs.get("attn_mask")
    if kwargs.get("is_causal") and mask is not None:
        seen = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        bool_mask = mask.dtype == torch.bool
        mask = mask & seen if bool_mask else mask.masked_fill(~seen, float("-inf"))
        kwargs.update(attn_mask=mask, is_causal=False)
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    return out


def sdpa_unless_checked(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """`sdpa`, raising where attnref's runtime shape checking is on in its process: the
    worker of an audit runs its harness as the judge does (`audit_checking`)."""
    from attnref._checking import checking_enabled

    if checking_enabled():
        raise RuntimeError("shape checking is on in this worker")
    return sdpa(q, k, v, *args, **kwargs)
