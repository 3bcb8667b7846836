"""Planted-bug backends for the audit's own tests (importable as ``tests.planted:NAME``).

Each is torch's SDPA signature with one real bug class of BUG_CLASSES.md planted.
"""

import math
import time
from typing import Any

import torch
from torch import Tensor


def _naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    tile_gqa: bool = False,
    fill: float = float("-inf"),
    causal_diagonal: int = 0,
    scale_rule: str = "sqrt",
    invert_mask: bool = False,
    empty_row_zero: bool = True,
) -> Tensor:
    """Materialised attention in the inputs' dtype, with switches for planted bugs."""
    h, g = q.shape[-3], k.shape[-3]
    if g != h:
        if tile_gqa:
            reps = [1] * (k.dim() - 3) + [h // g, 1, 1]
            k, v = k.repeat(*reps), v.repeat(*reps)
        else:
            k, v = k.repeat_interleave(h // g, -3), v.repeat_interleave(h // g, -3)
    d = q.shape[-1]
    if scale is None:
        scale = 1 / math.sqrt(d) if scale_rule == "sqrt" else 1 / d
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    Tq, Tk = s.shape[-2], s.shape[-1]
    if is_causal:
        visible = torch.ones(Tq, Tk, dtype=torch.bool).tril(causal_diagonal)
        s = s.masked_fill(~visible, fill)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            m = ~attn_mask if invert_mask else attn_mask
            s = s.masked_fill(~m, fill)
        else:
            s = s + attn_mask
    w = torch.softmax(s, dim=-1)
    if empty_row_zero:  # a row of all -inf gives NaN in softmax: zero it, as torch >= 2.5
        w = w.masked_fill((s == float("-inf")).all(dim=-1, keepdim=True), 0.0)
    return (w @ v.float()).to(q.dtype)


def correct(*args: Any, **kwargs: Any) -> Tensor:
    """A correct materialised backend."""
    return _naive(*args, **kwargs)


def empty_row_nan(*args: Any, **kwargs: Any) -> Tensor:
    """A query with no visible key returns NaN (class 1)."""
    return _naive(*args, **kwargs, empty_row_zero=False)


def gqa_tiled(*args: Any, **kwargs: Any) -> Tensor:
    """GQA heads tiled instead of interleaved (class 9)."""
    return _naive(*args, **kwargs, tile_gqa=True)


def empty_row_uniform(*args: Any, **kwargs: Any) -> Tensor:
    """Finite fill: a query with no visible key averages V uniformly (class 2)."""
    return _naive(*args, **kwargs, fill=-1e9)


def causal_excludes_self(*args: Any, **kwargs: Any) -> Tensor:
    """Off-by-one on the causal diagonal (class 5)."""
    return _naive(*args, **kwargs, causal_diagonal=-1)


def scale_by_d(*args: Any, **kwargs: Any) -> Tensor:
    """Default scale 1/d instead of 1/sqrt(d) (class 14)."""
    return _naive(*args, **kwargs, scale_rule="d")


def mask_inverted(*args: Any, **kwargs: Any) -> Tensor:
    """Boolean mask polarity inverted (class 16)."""
    return _naive(*args, **kwargs, invert_mask=True)


def contiguous_assumed(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Reads non-contiguous inputs as if they were contiguous (class 6)."""

    def raw(t: Tensor) -> Tensor:
        contiguous_strides = torch.empty(t.shape, device="meta").stride()
        return torch.as_strided(t, t.shape, contiguous_strides, t.storage_offset())

    return torch.nn.functional.scaled_dot_product_attention(raw(q), raw(k), raw(v), *args, **kwargs)


def wrong_dtype(*args: Any, **kwargs: Any) -> Tensor:
    """Returns float64 whatever the input dtype."""
    return _naive(*args, **kwargs).double()


def raises(*args: Any, **kwargs: Any) -> Tensor:
    """Always raises."""
    raise RuntimeError("kernel launch failed\nsecond line of the message")


def wrong_shape(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Returns the query."""
    return q[..., :1]


def not_a_tensor(*args: Any, **kwargs: Any) -> Any:
    """Returns a list."""
    return [1, 2, 3]


def hangs(*args: Any, **kwargs: Any) -> Tensor:
    """Sleeps far longer than any timeout."""
    time.sleep(30)
    raise AssertionError("unreachable")


def no_mask_argument(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Lacks SDPA's keyword arguments."""
    return query


NOT_CALLABLE = 3
