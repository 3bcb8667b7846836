"""flash-attention-softmax-n's attention behind torch SDPA's signature.

Tested with flash-attention-softmax-n 0.3.2. ``softmax_n(x) = exp(x) / (n + sum exp(x))``
is attention with a sink (docs/variants.md) of logit ``log n`` shared by every head,
a constant: ``n = 0`` (the default) is plain softmax, no sink. The adapters take
attnref's ``sinks`` keyword (one logit per head) and pass ``n = exp(sink)``.

- `slow`: ``slow_attention_n``, the materialised version with torch SDPA's signature
  (any ``n >= 0``; causal bottom-right, ``tril(S - L)``);
- `flash`: ``flash_attention_n``, which calls torch's SDPA with ``n`` zero keys and
  values padded in front (integer ``n`` only).
"""

import math
from typing import Any

from torch import Tensor

from attnref.adapters import as_4d, declare, expand_mask, no_dropout, unflatten

#: the sink logits the adapters take: no sink (n = 0), n = 1 and n = 2
SINKS = (-math.inf, 0.0, math.log(2.0))


def _n(sinks: Tensor | None, integer: bool) -> float | int | None:
    """softmax_n's ``n`` for attnref's sink logits (one value shared by every head)."""
    if sinks is None:
        return None
    n = math.exp(float(sinks.flatten()[0]))
    return round(n) if integer else n


def slow(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    causal_alignment: str = "bottom_right",
    sinks: Tensor | None = None,
) -> Tensor:
    """``slow_attention_n(q, k, v, attn_mask, 0.0, is_causal, scale, softmax_n_param=n)``.
    A float mask must be ``(L, S)``, as its docstring says (one broadcast over the batch
    and heads is passed so; others are refused)."""
    from flash_attention_softmax_n import slow_attention_n

    no_dropout(dropout_p)
    if attn_mask is not None and attn_mask.is_floating_point():
        if any(n != 1 for n in attn_mask.shape[:-2]):
            raise NotImplementedError("slow_attention_n takes a float mask of shape (L, S)")
        attn_mask = attn_mask.reshape(attn_mask.shape[-2:])
    out: Tensor = slow_attention_n(
        query, key, value, attn_mask, 0.0, is_causal, scale, softmax_n_param=_n(sinks, False),
        train=False,
    )  # fmt: skip
    return out


def flash(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    causal_alignment: str = "bottom_right",
    sinks: Tensor | None = None,
) -> Tensor:
    """``flash_attention_n(q, k, v, n, scale, 0.0, attn_mask=..., is_causal=...)`` on
    ``(B, h, T, D)``: a float mask goes in as its ``attn_bias``; its mask must be 4-d."""
    from flash_attention_softmax_n import flash_attention_n

    no_dropout(dropout_p)
    mask = bias = expand_mask(attn_mask, query, key)
    if mask is not None:
        mask = mask.expand(-1, query.shape[-3], -1, -1)
        mask, bias = (None, mask) if mask.is_floating_point() else (mask, None)
    q, k, v = as_4d(query), as_4d(key), as_4d(value)
    out: Any = flash_attention_n(
        q, k, v, _n(sinks, True), scale, 0.0, attn_mask=mask, attn_bias=bias,
        is_causal=is_causal,
    )  # fmt: skip
    return unflatten(out, query, value.shape[-1])


def _declare() -> None:
    from attnref.conformance import EmptyRows

    common: dict[str, Any] = {
        "dropout": False,
        "gqa": False,  # both multiply q by k without expanding KV heads
        "sinks": True,
        "sink_shared": True,
        "sink_values": SINKS,
        "sink_gradients": False,  # n is a constant
    }
    # the documented formula: a row of -inf is a softmax of -inf (NaN), causal is
    # tril(S - L), bottom-right, and is_causal asserts no mask is given
    declare(
        slow,
        causal_alignments=("bottom_right",),
        empty_row="nan",
        refuses=("takes a float mask of shape (L, S)",),
        **common,
    )
    # torch's SDPA underneath (zeros for a row a mask empties); is_causal without a mask
    # becomes a bias with -finfo.max / 2 at hidden keys (the mean of V), with a mask it
    # joins the boolean mask (zeros): the policy depends on whether a mask was passed
    declare(
        flash,
        causal_alignments=("bottom_right",),
        causal_with_mask=True,
        # its diagonal empties a row to the mean of V, alone or with a float mask (the
        # fill joins the bias), to zeros with a boolean one (torch's SDPA)
        empty_row=EmptyRows(causal="uniform", causal_masked="zero", causal_float_masked="uniform"),
        **common,
    )


_declare()
