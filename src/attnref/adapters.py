"""Helpers for adapters: a third-party attention function behind torch SDPA's signature.

`attnref audit` calls a backend as torch's SDPA is called: ``(*batch, h, T, D)`` tensors
(any number of batch dimensions, none included), a mask broadcastable to ``(*batch, h,
Tq, Tk)``, boolean (True: attend) or additive. Most libraries take one batch dimension,
a mask of their own shape, or an additive mask only; every adapter of the cookbook
(``examples/adapters``, docs/adapters.md) needed the same few conversions, and these are
they::

    from attnref.adapters import as_4d, declare, expand_mask, no_dropout, unflatten

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False):
        no_dropout(dropout_p)
        q, k, v = as_4d(query), as_4d(key), as_4d(value)
        out = library.attention(q, k, v, mask=expand_mask(attn_mask, query, key))
        return unflatten(out, query, value.shape[-1])

    declare(attention, dropout=False, causal_with_mask=False)

`declare` attaches the declaration `attnref audit` reads (`Capabilities`, from an API
family's preset): what the library claims, so that the audit draws its cases inside it.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from attnref._checking import checked
from attnref.masks import additive_mask

__all__ = ["additive", "as_4d", "declare", "expand_mask", "no_dropout", "unflatten"]


@checked
def as_4d(t: Shaped[Tensor, "*batch h T D"]) -> Shaped[Tensor, "N h T D"]:
    """``(*batch, h, T, D)`` as ``(N, h, T, D)``, ``N`` the product of the batch dims (1
    for none): the one batch dimension most libraries take. A view where it can be."""
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


@checked
def unflatten(
    out: Shaped[Tensor, "N h Tq Dv"], query: Shaped[Tensor, "*batch h Tq Dh"], dv: int
) -> Shaped[Tensor, "*batch h Tq Dv"]:
    """``(N, h, Tq, Dv)`` back to the query's batch dimensions (undoes `as_4d`)."""
    return out.reshape(*query.shape[:-1], dv)


@checked
def expand_mask(
    mask: Shaped[Tensor, "..."] | None,
    query: Shaped[Tensor, "*batch h Tq Dh"],
    key: Shaped[Tensor, "*batch g Tk Dh"],
) -> Shaped[Tensor, "N m Tq Tk"] | None:
    """An SDPA mask (broadcastable to ``(*batch, h, Tq, Tk)``) as ``(N, m, Tq, Tk)``:
    one batch dimension, ``m`` its heads (``h``, or 1 for a mask shared by every head),
    its own dtype kept. None stays None.

    Raises:
        ValueError: ``mask`` does not broadcast to the call's shape (named with it).
    """
    if mask is None:
        return None
    batch, Tq, Tk = query.shape[:-3], query.shape[-2], key.shape[-2]
    heads = mask.shape[-3] if mask.dim() >= 3 else 1
    try:
        full = mask.expand(*batch, heads, Tq, Tk)
    except RuntimeError:
        raise ValueError(
            f"attn_mask of shape {tuple(mask.shape)} does not broadcast to "
            f"(*batch, h, Tq, Tk) = {(*batch, query.shape[-3], Tq, Tk)}"
        ) from None
    return full.reshape(math.prod(batch), heads, Tq, Tk)


@checked
def additive(
    mask: Bool[Tensor, "*shape"] | Float[Tensor, "*shape"], dtype: torch.dtype, fill: float
) -> Float[Tensor, "*shape"]:
    """A mask as an additive one in ``dtype``: a boolean mask becomes 0 where a key is
    seen and ``fill`` where it is hidden (``-inf``, or the finite ``torch.finfo(dtype).min``
    many libraries use: then a query that sees no key averages V); a float mask is cast."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return additive_mask(mask, dtype, fill)


def no_dropout(dropout_p: float) -> None:
    """Refuse ``dropout_p != 0`` (the audit calls with 0; an adapter that does not wire
    dropout says so rather than ignore it).

    Raises:
        NotImplementedError: ``dropout_p`` is not 0.
    """
    if dropout_p != 0.0:
        raise NotImplementedError(f"the adapter audits dropout_p = 0 only, got {dropout_p!r}")


def declare(fn: Callable[..., Any], family: str = "sdpa", **capabilities: Any) -> None:
    """Attach to ``fn`` the declaration `attnref audit` reads: API family ``family``'s
    preset (`attnref.conformance.Capabilities.preset`) with ``capabilities`` changed.

    Raises:
        ValueError: an unknown family, or a capability of the wrong value (named).
        TypeError: an unknown capability.
    """
    from attnref.conformance import Capabilities

    fn.capabilities = Capabilities.preset(family, **capabilities)  # type: ignore[attr-defined]
