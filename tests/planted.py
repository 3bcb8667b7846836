"""Backends that misbehave as programs, not as attention (importable as ``tests.planted:NAME``).

The attention bugs live in `attnref.conformance.mutants`; these check that the audit
reports a backend that raises, hangs or returns the wrong thing without crashing.
"""

import time
from typing import Any

import torch
from torch import Tensor


def raises(*args: Any, **kwargs: Any) -> Tensor:
    """Always raises."""
    raise RuntimeError("kernel launch failed\nsecond line of the message")


def wrong_shape(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Returns the query's first column."""
    return q[..., :1]


def wrong_dtype(*args: Any, **kwargs: Any) -> Tensor:
    """Returns float64 whatever the input dtype."""
    return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs).double()


def not_a_tensor(*args: Any, **kwargs: Any) -> Any:
    """Returns a list."""
    return [1, 2, 3]


def hangs(*args: Any, **kwargs: Any) -> Tensor:
    """Sleeps far longer than any timeout."""
    time.sleep(30)
    raise AssertionError("unreachable")


def refuses_masks(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **kw: Any
) -> Tensor:
    """Refuses any mask with an error it declares as a refusal."""
    if attn_mask is not None:
        raise NotImplementedError("masks are not supported by this kernel")
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)


def uniform_empty_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Correct, with the "uniform" policy: hidden scores are a finite minimum, so a query
    with no visible key averages V (declared as such)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    low = torch.finfo(torch.float32).min / 4
    mask = torch.zeros(q.shape[-2], k.shape[-2], dtype=acc)
    if is_causal:
        mask = mask.masked_fill(~torch.ones_like(mask, dtype=torch.bool).tril(), low)
    if attn_mask is not None:
        extra = (
            torch.zeros(attn_mask.shape, dtype=acc).masked_fill(~attn_mask, low)
            if attn_mask.dtype == torch.bool
            else attn_mask.to(acc).clamp(min=low)
        )
        mask = mask + extra
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(
        q.to(acc), k.to(acc), v.to(acc), mask, scale=scale, enable_gqa=enable_gqa
    )
    return out.to(q.dtype)


def no_mask_argument(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Lacks SDPA's keyword arguments."""
    return query


NOT_CALLABLE = 3


def _declare() -> None:
    from attnref.conformance import Capabilities

    refuses_masks.capabilities = Capabilities(  # type: ignore[attr-defined]
        refuses=("not supported by this kernel",)
    )
    uniform_empty_rows.capabilities = Capabilities(  # type: ignore[attr-defined]
        empty_row="uniform", dropout=False
    )


_declare()
