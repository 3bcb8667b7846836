"""x-transformers' ``Attend`` behind torch SDPA's signature.

Tested with x-transformers 2.31. ``Attend(...)(q, k, v, mask=None, attn_bias=None,
causal=None)`` takes ``(B, h, T, D)`` queries and ``(B, g, T, D)`` keys and values, a
boolean ``mask`` (True: attend) and an additive float ``attn_bias``, and returns
``(out, intermediates)``. Its scale is a constructor argument.

- `attend`: the einsum path (``flash=False``), hidden scores filled with
  ``-finfo(dtype).max``;
- `attend_flash`: ``flash=True``, which calls torch's SDPA.

Both get causality the way ``forward`` documents it, ``causal=is_causal``.
"""

from typing import Any

from torch import Tensor

from attnref.adapters import as_4d, declare, expand_mask, no_dropout, unflatten


def _attend(
    flash: bool,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> Tensor:
    from x_transformers.attend import Attend

    no_dropout(dropout_p)
    q, k, v = as_4d(query), as_4d(key), as_4d(value)
    mask = expand_mask(attn_mask, query, key)
    bias = None
    if mask is not None and mask.is_floating_point():
        mask, bias = None, mask
    attend = Attend(flash=flash, scale=scale).eval()
    out: Any
    out, _ = attend(q, k, v, mask=mask, attn_bias=bias, causal=is_causal)
    return unflatten(out, query, value.shape[-1])


def attend(
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
    """``Attend(flash=False)``: its causal mask is ``triu(Tk - Tq + 1)``, bottom-right."""
    return _attend(False, query, key, value, attn_mask, dropout_p, is_causal, scale)


def attend_flash(
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
    """``Attend(flash=True)``: declared like the einsum path, which it should equal."""
    return _attend(True, query, key, value, attn_mask, dropout_p, is_causal, scale)


def _declare() -> None:
    from attnref.conformance import EmptyRows

    for fn in (attend, attend_flash):
        declare(
            fn,
            dropout=False,
            causal_alignments=("bottom_right",),
            causal_with_mask=True,
            # rows a mask empties are zeroed; the causal fill -finfo.max averages V; -inf
            # in attn_bias is a softmax of -inf
            empty_row=EmptyRows(bool_mask="zero", float_mask="nan", causal="uniform"),
        )


_declare()
