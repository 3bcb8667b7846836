"""Adapters that let `attnref audit` call third-party attention implementations.

Each module wraps one library behind torch SDPA's signature and declares, in a
``capabilities`` attribute, what the library claims to support (docs/adapters.md). Run
from the repository root: ``attnref audit --backend examples.adapters.hf_transformers:sdpa``.
``nox -s peers`` installs every library, pinned, and audits each adapter.
"""

import math
from collections.abc import Callable
from typing import Any

from torch import Tensor

__all__ = ["as_4d", "declare", "expand_mask", "no_dropout", "unflatten"]


def as_4d(t: Tensor) -> Tensor:
    """``(*batch, h, T, D)`` as ``(B, h, T, D)``: the libraries take one batch dimension."""
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


def expand_mask(mask: Tensor | None, query: Tensor, key: Tensor) -> Tensor | None:
    """A mask broadcast over ``(*batch, h or 1, Tq, Tk)``, as ``(B, h or 1, Tq, Tk)``."""
    if mask is None:
        return None
    batch, heads = query.shape[:-3], mask.shape[-3] if mask.dim() >= 3 else 1
    full = mask.expand(*batch, heads, query.shape[-2], key.shape[-2])
    return full.reshape(math.prod(batch), *full.shape[-3:])


def unflatten(out: Tensor, query: Tensor, dv: int) -> Tensor:
    """``(B, h, Tq, Dv)`` back to the query's batch dimensions."""
    return out.reshape(*query.shape[:-1], dv)


def declare(fn: Callable[..., Any], **capabilities: Any) -> None:
    """Attach a `Capabilities` declaration to ``fn`` (attnref is imported lazily)."""
    from attnref.conformance import Capabilities

    fn.capabilities = Capabilities(**capabilities)  # type: ignore[attr-defined]


def no_dropout(dropout_p: float) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError("the adapter audits dropout_p = 0 only")
