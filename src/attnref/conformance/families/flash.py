"""The ``flash`` family: FlashAttention 2's ``flash_attn_func``, ``(B, T, h, D)``,
bottom-right causal, ``window_size``, ``softcap``, ``alibi_slopes``, the LSE through
``return_attn_probs`` (``sinks=`` as attnref's extension).

Everything of the family is here: the convention, `flash_form` (a function of the
``sdpa`` family seen through this convention, so that the reference, the naive kernel,
FlexAttention and the mutants exist in both from one implementation), the preset
(`FLASH_ATTN_2`, what FlashAttention 2 documents), the built-in backends and the
mutants of the variants (classes 22-25). The packed and paged families build on it.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from attnref._checking import checked_internal
from attnref.conformance.cases import Inputs
from attnref.conformance.declarations import Backend, Capabilities
from attnref.conformance.families.sdpa import (
    FLEX_CAPS,
    NAIVE_CAPS,
    REFERENCE_CAPS,
    flex,
    naive,
    reference,
    reference_chunked,
)
from attnref.conformance.family import ApiFamily, Arguments, pair, variant_kwargs
from attnref.conformance.mutants import Mutant
from attnref.conformance.verdicts import Failure, Skip

__all__ = [
    "FAMILY",
    "FLASH_ATTN_2",
    "flash_flex",
    "flash_form",
    "flash_naive",
    "flash_reference",
    "flash_reference_chunked",
]


def flash_caps(caps: Capabilities, family: str = "flash") -> Capabilities:
    """``caps`` as a flash-convention backend of ``family`` declares them: no masks,
    bottom-right."""
    return replace(
        caps,
        family=family,
        bool_mask=False,
        float_mask=False,
        causal_alignments=("bottom_right",),
        causal_with_mask=False,
    )


#: what FlashAttention 2 documents for flash_attn_func (its README and docstring):
#: fp16 and bf16, head dims up to 256 with Dv = Dqk, bottom-right causal, a window,
#: softcap, ALiBi, the log-sum-exp (+inf for a query with no visible key), no sinks, no
#: masks. The preset of the ``flash`` family: the default of an undeclared ``--api
#: flash`` function, and where a declaration of one starts (``replace(FLASH_ATTN_2, ...)``)
FLASH_ATTN_2 = Capabilities(
    family="flash",
    dtypes=(torch.float16, torch.bfloat16),
    bool_mask=False,
    float_mask=False,
    causal_alignments=("bottom_right",),
    zero_head_dim=False,
    max_head_dim=256,
    distinct_value_dim=False,
    window=True,
    softcap=True,
    alibi=True,
    lse=True,
    empty_lse="+inf",
)


# ----------------------------------------------------------------- the convention


def flat_batch(inputs: Inputs) -> int:
    return math.prod(inputs.query.shape[:-3])


@checked_internal
def flash_layout(t: Float[Tensor, "*batch h T D"], inputs: Inputs) -> Float[Tensor, "B T h D"]:
    """``(*batch, h, T, D)`` as ``(B, T, h, D)``: the batch dims flattened (one when
    there are none), contiguous when the original was, its strides kept otherwise."""
    flat = t.reshape(flat_batch(inputs), *t.shape[-3:]).transpose(1, 2)  # (B, T, h, D)
    return flat.contiguous() if t.is_contiguous() else flat


@checked_internal
def flash_back(
    t: Float[Tensor, "B T h D"], like: Float[Tensor, "*batch h T D"]
) -> Float[Tensor, "*batch h T D"]:
    """``(B, T, h, D)`` back to the audit's ``(*batch, h, T, D)`` shape of ``like``."""
    return t.transpose(1, 2).reshape(like.shape)


def flash_native_causal(caps: Capabilities, inputs: Inputs) -> bool:
    return inputs.causal is not None


def _flash_build(
    caps: Capabilities, inputs: Inputs, lse: bool, overrides: dict[str, Any]
) -> Arguments:
    """``flash_attn_func``'s call: ``(B, T, h, D)`` tensors, no mask, bottom-right
    causal; the window and softcap passed only when on (FlashAttention 2's defaults
    otherwise), ALiBi slopes as ``(h,)`` or ``(B, h)``."""
    if inputs.attn_mask is not None:
        raise Skip("attn_mask: the flash convention takes no mask")
    Tq, Tk = inputs.query.shape[-2], inputs.key.shape[-2]
    # a kernel that declares causal_alignments=("top_left",) computes causal=True from
    # the top left (FlashAttention before 2.1 did): its Tq != Tk calls are judged so
    if inputs.causal is not None and Tq != Tk and inputs.causal not in caps.causal_alignments:
        raise Skip(
            f"{inputs.causal.replace('_', '-')} causal with Tq != Tk: the backend's causal "
            f"diagonal is declared {' or '.join(caps.causal_alignments)}"
        )
    kwargs: dict[str, Any] = {
        "dropout_p": 0.0,
        "softmax_scale": inputs.scale,
        "causal": inputs.causal is not None,
    }
    kwargs.update(variant_kwargs(caps, inputs))
    if inputs.window is not None:
        kwargs["window_size"] = inputs.window
    slopes = inputs.alibi_slopes
    if slopes is not None and slopes.dim() > 1:
        kwargs["alibi_slopes"] = slopes.reshape(flat_batch(inputs), slopes.shape[-1])
    if lse:
        kwargs["return_attn_probs"] = True
    kwargs.update(overrides)
    args = tuple(flash_layout(t, inputs) for t in (inputs.query, inputs.key, inputs.value))
    return args, kwargs


def _flash_read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    first, lse_out = pair(out, "return_attn_probs=True") if lse else (out, None)
    shape = (*inputs.query.shape[:-1], inputs.value.shape[-1])
    B, h, Tq = flat_batch(inputs), inputs.query.shape[-3], inputs.query.shape[-2]
    if isinstance(first, Tensor):
        if tuple(first.shape) != (B, Tq, h, shape[-1]):
            raise Failure(
                f"returned shape {tuple(first.shape)}, expected {(B, Tq, h, shape[-1])} "
                "(B, Tq, h, Dv)"
            )
        first = first.transpose(1, 2).reshape(shape)
    if isinstance(lse_out, Tensor):
        if tuple(lse_out.shape) != (B, h, Tq):
            raise Failure(
                f"returned a log-sum-exp of shape {tuple(lse_out.shape)}, expected "
                f"{(B, h, Tq)} (B, h, Tq)"
            )
        lse_out = lse_out.reshape(shape[:-1])
    return first, lse_out


# ------------------------------------------- what the flash conventions share


def flash_checks(inputs: Inputs) -> None:
    """What no FlashAttention convention can express: a mask, top-left with Tq != Tk."""
    if inputs.attn_mask is not None:
        raise Skip("attn_mask: the flash conventions take no mask")
    Tq, Tk = inputs.query.shape[-2], inputs.key.shape[-2]
    if inputs.causal == "top_left" and Tq != Tk:
        raise Skip("top-left causal with Tq != Tk: the flash conventions are bottom-right")


@checked_internal
def flash_kwargs(
    caps: Capabilities, first: Inputs, slopes: Float[Tensor, "..."] | None
) -> dict[str, Any]:
    """The keywords the flash conventions share, for inputs like ``first``."""
    kwargs: dict[str, Any] = {"softmax_scale": first.scale, "causal": first.causal is not None}
    kwargs.update(variant_kwargs(caps, first))
    if first.window is not None:
        kwargs["window_size"] = first.window
    if slopes is not None:
        kwargs["alibi_slopes"] = slopes
    return kwargs


def dense_read(
    out: object, inputs: Inputs, lse: bool, parts: tuple[list[object], list[object] | None]
) -> tuple[object, object | None]:
    """Per-sample results stacked back into the dense case's shape."""
    outs, lses = parts
    shape = (*inputs.query.shape[:-1], inputs.value.shape[-1])
    if all(isinstance(o, Tensor) for o in outs) and outs:
        first: object = torch.stack(outs).reshape(shape)  # type: ignore[arg-type]
    else:
        first = outs[0] if outs else out
    if lses is None:
        return first, None
    if all(isinstance(x, Tensor) for x in lses) and lses:
        return first, torch.stack(lses).reshape(shape[:-1])  # type: ignore[arg-type]
    return first, lses[0] if lses else None


@checked_internal
def empty_part(
    q: Float[Tensor, "..."], h: int, Dv: int, rows: int
) -> tuple[Float[Tensor, "rows h Dv"], Float[Tensor, "h rows"]]:
    """The output and LSE of ``rows`` queries that see no key: 0 and ``-inf``."""
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (
        q.new_zeros((rows, h, Dv)),
        torch.full((h, rows), float("-inf"), dtype=lse_dtype, device=q.device),
    )


# ---------------------------------------------- the adapter from a dense callable


def flash_form(fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
    """``fn`` (SDPA family, variants as keywords) with ``flash_attn_func``'s signature.

    Tensors ``(B, T, h, D)`` are transposed to ``(B, h, T, D)`` and back; ``causal`` is
    bottom-right; ``window_size=(-1, -1)`` is no window; ``return_attn_probs=True``
    returns ``(out, lse, None)`` with ``lse (B, h, Tq)``, as FlashAttention 2 does
    (its third item, the probabilities, is not computed). ``sinks`` (one logit per head)
    is an extension FlashAttention 2 does not have.
    """

    @checked_internal
    def flash(
        q: Float[Tensor, "B Tq h Dh"],
        k: Float[Tensor, "B Tk g Dh"],
        v: Float[Tensor, "B Tk g Dv"],
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "B h"] | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        sinks: Float[Tensor, " h"] | None = None,
    ) -> (
        Float[Tensor, "B Tq h Dv"]
        | tuple[Float[Tensor, "B Tq h Dv"], Float[Tensor, "B h Tq"], None]
    ):
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


# ------------------------------------------------------------------ the builtins


def declared(fn: Callable[..., Any], caps: Capabilities) -> Callable[..., Any]:
    """``fn`` with ``caps`` as its declaration (its ``capabilities`` attribute)."""
    fn.capabilities = caps  # type: ignore[attr-defined]
    return fn


def _flash_attn(*args: Any, **kwargs: Any) -> Any:
    """FlashAttention 2's ``flash_attn_func`` (the ``flash_attn`` package, CUDA only)."""
    from flash_attn import flash_attn_func

    return flash_attn_func(*args, **kwargs)


#: the reference, FlexAttention and the naive kernel in the flash convention, as plain
#: functions with their declarations: ``attnref audit --api flash --backend
#: attnref.conformance.families.flash:flash_reference`` audits one as a user's kernel
flash_reference = declared(flash_form(reference, "flash_reference"), flash_caps(REFERENCE_CAPS))
flash_reference_chunked = declared(
    flash_form(reference_chunked, "flash_reference_chunked"),
    flash_caps(replace(REFERENCE_CAPS, dropout=False)),
)
flash_naive = declared(flash_form(naive, "flash_naive"), flash_caps(NAIVE_CAPS))
flash_flex = declared(flash_form(flex, "flash_flex"), flash_caps(FLEX_CAPS))


def _builtins() -> list[Backend]:
    return [
        *(
            Backend(name, fn, description, fn.capabilities, api="flash")  # type: ignore[attr-defined]
            for name, fn, description in (
                ("flash-reference", flash_reference, "attnref's reference in the flash convention"),
                (
                    "flash-reference-chunked",
                    flash_reference_chunked,
                    "attnref's chunked attention (blocks of 4 keys), flash convention",
                ),
                ("flash-naive", flash_naive, "the naive kernel in the flash convention"),
                (
                    "flash-flex",
                    flash_flex,
                    "FlexAttention in the flash convention (mask_mod for causal and "
                    "window, score_mod for softcap and ALiBi)",
                ),
            )
        ),
        Backend(
            "flash-attn",
            _flash_attn,
            "FlashAttention 2's flash_attn_func (skipped where flash_attn is absent)",
            replace(FLASH_ATTN_2, devices=("cuda",)),
            api="flash",
            needs="flash_attn",
        ),
    ]


# ------------------------------------------------------------------- the mutants


def _mutant_fn(self: Mutant) -> Callable[..., Any]:
    """A mutant of the materialised kernel (its switches on) in the flash convention."""
    kernel = functools.partial(self.kernel, **self.switches)
    kernel.__name__ = self.name  # type: ignore[attr-defined]
    flash = flash_form(kernel, self.name)
    flash.__doc__ = f"Class {self.bug_class}: {self.summary}"
    flash.capabilities = self.capabilities  # type: ignore[attr-defined]
    return flash


#: what a flash-convention kernel with every variant declares (the mutants of classes
#: 22-25 claim it): the naive kernel's declaration in the flash convention
FLASH_LIKE: Capabilities = flash_naive.capabilities  # type: ignore[attr-defined]
_LIKE: dict[str, Any] = {"api": "flash", "capabilities": FLASH_LIKE}

MUTANTS: tuple[Mutant, ...] = (
    Mutant("window_bound_exclusive", 22, "the window's left bound is exclusive: a "
           "query sees one key too few", {"window_exclusive": True}, **_LIKE),
    Mutant("window_causal_symmetric", 22, "causal with window_size (w, -1) attends "
           "(w, w): w keys past the query", {"causal_window_symmetric": True},
           **_LIKE),
    Mutant("window_top_left", 22, "the window is measured from the top-left (query i "
           "at position i) when Tq != Tk", {"window_top_left": True}, **_LIKE),
    Mutant("softcap_dropped", 23, "softcap accepted and never applied",
           {"softcap_dropped": True}, **_LIKE),
    Mutant("softcap_before_scale", 23, "softcap applied to q.k before the softmax "
           "scale: c tanh(q.k / c) * scale", {"softcap_before_scale": True}, **_LIKE),
    Mutant("alibi_sign", 23, "ALiBi added with the wrong sign: +m |i - j| rewards "
           "distant keys", {"alibi_sign": 1.0}, **_LIKE),
    Mutant("alibi_top_left", 23, "ALiBi distance measured top-left, |i - j|, "
           "ignoring the Tk - Tq offset", {"alibi_top_left": True}, **_LIKE),
    Mutant("sink_in_numerator", 24, "the sink's probability mass is handed to the "
           "visible keys instead of dropped", {"sink_numerator": True}, **_LIKE),
    Mutant("sink_per_split", 24, "split-KV over two splits adds the sink to each "
           "split's denominator: counted twice", {"sink_count": 2}, **_LIKE),
    Mutant("sink_lost_on_empty_split", 24, "the sink is added in the first split, "
           "which a query with no visible key there skips", {"sink_first_split_only":
           True}, **_LIKE),
    Mutant("lse_base2", 25, "the log-sum-exp is returned in base 2 (log2), as the "
           "kernel computes it", {"lse_base2": True}, **_LIKE),
    Mutant("lse_relative_max", 25, "the log-sum-exp is returned relative to the row's "
           "max (log l, not m + log l)", {"lse_relative_max": True}, **_LIKE),
    Mutant("lse_empty_split_overwrites", 25, "an empty second split's -inf LSE "
           "overwrites the real one in the merge", {"lse_empty_split_overwrites":
           True}, **_LIKE),
)  # fmt: skip


FAMILY = ApiFamily(
    name="flash",
    summary="FlashAttention 2's flash_attn_func: (B, T, h, D), bottom-right causal, "
    "window_size, softcap, alibi_slopes, the LSE through return_attn_probs",
    signature="fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, "
    "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
    "return_attn_probs=False)",
    positional=3,
    keywords=("softmax_scale", "causal"),
    defaults=FLASH_ATTN_2,
    build=_flash_build,
    read=_flash_read,
    to_layout=flash_layout,
    from_layout=flash_back,
    native_causal=flash_native_causal,
    builtins=_builtins,
    mutants=MUTANTS,
    mutant_fn=_mutant_fn,
)
