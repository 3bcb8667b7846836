"""An SDPA-shaped function seen through FlashAttention's calling convention.

`flash_form` turns a function that speaks the ``sdpa`` family's language (``(*batch, h,
T, D)`` tensors, the variants as keywords, ``causal_alignment``) into one with
``flash_attn_func``'s signature, so that the reference, the naive kernel, FlexAttention
and the mutants each exist in both conventions from one implementation.
"""

from collections.abc import Callable
from typing import Any

from torch import Tensor

__all__ = ["flash_form"]


def flash_form(fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
    """``fn`` (SDPA family, variants as keywords) with ``flash_attn_func``'s signature.

    Tensors ``(B, T, h, D)`` are transposed to ``(B, h, T, D)`` and back; ``causal`` is
    bottom-right; ``window_size=(-1, -1)`` is no window; ``return_attn_probs=True``
    returns ``(out, lse, None)`` with ``lse (B, h, Tq)``, as FlashAttention 2 does
    (its third item, the probabilities, is not computed). ``sinks`` (one logit per head)
    is an extension FlashAttention 2 does not have.
    """

    def flash(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        sinks: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor, None]:
        kwargs: dict[str, Any] = {"causal_alignment": "bottom_right"}
        if tuple(window_size) != (-1, -1):
            kwargs["window"] = tuple(window_size)
        if softcap:
            kwargs["softcap"] = softcap
        if alibi_slopes is not None:
            kwargs["alibi_slopes"] = alibi_slopes
        if sinks is not None:
            kwargs["sinks"] = sinks
        if return_attn_probs:
            kwargs["return_lse"] = True
        h, g = q.shape[-2], k.shape[-2]
        result = fn(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            None,
            dropout_p,
            causal,
            softmax_scale,
            h != g,
            **kwargs,
        )
        if return_attn_probs:
            out, lse = result
            return out.transpose(1, 2), lse, None
        out_: Tensor = result.transpose(1, 2)
        return out_

    flash.__name__ = flash.__qualname__ = name or f"flash_{fn.__name__}"
    flash.__doc__ = fn.__doc__  # not functools.wraps: the signature must stay flash's
    return flash
