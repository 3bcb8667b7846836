"""Kernels as a library ships them: plain torch, no import of attnref (its declaration,
where it needs one, is the family's default). What a bug report's repro.py imports with
attnref not installed (docs/reports.md).

``tests.plain_kernels:scale_off_by_two`` multiplies the scores by twice the scale."""

import torch
from torch import Tensor


def scale_off_by_two(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """torch's SDPA with the scale doubled: every row that sees two keys or more is off."""
    used = (query.shape[-1] ** -0.5 if scale is None else scale) * 2
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale=used, enable_gqa=enable_gqa
    )
    return out


def gradient_doubled(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """torch's SDPA, right in its values, whose backward gives twice the gradients (the
    output counted twice in the graph, once detached)."""
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return out + (out - out.detach())
