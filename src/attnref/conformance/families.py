"""API families: the calling conventions the audit speaks, as entries of one registry.

A family says how a backend is called and how its answer is read back, so the runner,
the properties and the checks never ask which convention a backend uses. An entry has:

- a name (``--api NAME``) and the signature a function must have (`ApiFamily.check`);
- the capabilities an undeclared function is taken to claim (`ApiFamily.defaults`);
- `ApiFamily.build`: how the `Inputs` of a `Case` become positional and keyword
  arguments (raising `Skip` for what the convention cannot express);
- `ApiFamily.read`: how the result becomes the output, and the log-sum-exp when asked,
  in the audit's layout ``(*batch, h, Tq, Dv)`` and ``(*batch, h, Tq)``;
- `ApiFamily.to_layout` and `ApiFamily.from_layout`: a tensor of the audit's layout
  into the family's and back (the gradient property's upstream gradient and results).

``sdpa`` is torch's ``scaled_dot_product_attention`` with the variants as keyword
extensions; ``flash`` is FlashAttention 2's ``flash_attn_func``; ``flash-varlen`` its
packed ``flash_attn_varlen_func`` and ``flash-kvcache`` its ``flash_attn_with_kvcache``.
Every family runs every dense case (a dense case is a pack of its samples, or a cache
holding its keys: `attnref.conformance.serving`); the packed and paged families also
build their own calls (`pack_arguments`, `cache_arguments`) for the properties only
they can have.
"""

import inspect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnref.conformance.backends import PRESETS, Backend, BackendError, Capabilities
from attnref.conformance.cases import Inputs
from attnref.conformance.serving import CacheCall, Pack, dense_cache, dense_pack
from attnref.conformance.verdicts import Failure, Skip
from attnref.masks import causal_mask

__all__ = [
    "FAMILIES",
    "ApiFamily",
    "cache_arguments",
    "family_of",
    "get_family",
    "pack_arguments",
    "read_cache",
    "read_pack",
]

Arguments = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class ApiFamily:
    """One calling convention (see the module docstring)."""

    name: str
    summary: str
    #: the signature, as its users know it (for error messages and docs)
    signature: str
    #: how many tensors a function takes positionally, first
    positional: int
    #: the keyword arguments every call passes
    keywords: tuple[str, ...]
    #: what a function that declares nothing is taken to claim
    defaults: Capabilities
    build: Callable[[Capabilities, Inputs, bool, dict[str, Any]], Arguments]
    read: Callable[[object, Inputs, bool], tuple[object, object | None]]
    to_layout: Callable[[Tensor, Inputs], Tensor]
    from_layout: Callable[[Tensor, Tensor], Tensor]
    #: whether the backend applies the causal diagonal of these inputs itself
    native_causal: Callable[[Capabilities, Inputs], bool]
    #: whether the convention takes ``dropout_p`` (flash_attn_with_kvcache does not)
    dropout: bool = True

    def check(self, fn: object, spec: str) -> Callable[..., Any]:
        """``fn`` if its signature can take this family's calls, else `BackendError`."""
        if not callable(fn):
            raise BackendError(f"{spec} is not callable (it is a {type(fn).__name__})")
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return fn  # a builtin without a signature: trust it, calls will tell
        params = sig.parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        takes_args = any(p.kind is p.VAR_POSITIONAL for p in params.values())
        positional = [
            p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        missing = [n for n in self.keywords if n not in params and not takes_kwargs]
        if (len(positional) < self.positional and not takes_args) or missing:
            lacks = f"; it lacks {', '.join(missing)}" if missing else ""
            raise BackendError(
                f"{spec} does not have the signature of the {self.name!r} API family, "
                f"{self.signature}{lacks}; its signature is {sig}"
                f"{_other_families(self.name, sig)}"
            )
        return fn

    def call(
        self, backend: Backend, inputs: Inputs, lse: bool = False, **overrides: Any
    ) -> Arguments:
        """The arguments to call ``backend`` with for ``inputs`` (`Skip` if the
        convention cannot express them); ``lse``: ask for the log-sum-exp too."""
        return self.build(backend.capabilities, inputs, lse, overrides)


def _other_families(name: str, sig: inspect.Signature) -> str:
    """A hint naming the family a signature does match, if one does (the one whose
    keywords it has the most of, when several)."""
    ranked = sorted(FAMILIES.values(), key=lambda f: -len(f.keywords))
    for family in ranked:
        if family.name == name:
            continue
        if all(n in sig.parameters for n in family.keywords):
            return f" (it looks like the {family.name!r} family: pass --api {family.name})"
    return ""


def _variant_kwargs(caps: Capabilities, inputs: Inputs) -> dict[str, Any]:
    """The keyword arguments of the variants ``inputs`` turn on (`Skip` for a variant, or
    a combination, the backend does not declare)."""
    on = inputs.variants
    for variant in on:
        if not getattr(caps, variant):
            raise Skip(f"{variant} not declared")
    if len(on) > 1 and not caps.combined_variants:
        raise Skip(f"{' and '.join(on)} together not declared")
    kwargs: dict[str, Any] = {}
    if inputs.softcap:
        kwargs["softcap"] = inputs.softcap
    if inputs.alibi_slopes is not None:
        kwargs["alibi_slopes"] = inputs.alibi_slopes
    if inputs.sinks is not None:
        kwargs["sinks"] = inputs.sinks
    return kwargs


# --------------------------------------------------------------------------- sdpa


def _sdpa_native_causal(caps: Capabilities, inputs: Inputs) -> bool:
    return inputs.causal is not None and (
        inputs.causal in caps.causal_alignments
        and (inputs.attn_mask is None or caps.causal_with_mask)
    )


def _sdpa_build(
    caps: Capabilities, inputs: Inputs, lse: bool, overrides: dict[str, Any]
) -> Arguments:
    """torch SDPA's call. A causal alignment the backend does not compute itself (or
    causal with a mask, where it cannot take both) reaches it folded into a boolean
    mask, so that every case runs on every backend. A window and ALiBi are placed by
    ``causal_alignment`` (passed when it is not torch's top-left)."""
    mask = inputs.attn_mask
    kwargs: dict[str, Any] = {"dropout_p": 0.0, "is_causal": False, "scale": inputs.scale}
    if inputs.enable_gqa:
        kwargs["enable_gqa"] = True
    kwargs.update(_variant_kwargs(caps, inputs))
    if inputs.window is not None:
        kwargs["window"] = inputs.window
    positional = inputs.window is not None or inputs.alibi_slopes is not None
    if positional and inputs.alignment != "top_left":
        if inputs.alignment not in caps.causal_alignments:
            raise Skip(f"{', '.join(inputs.variants)} placed {inputs.alignment} not declared")
        kwargs["causal_alignment"] = inputs.alignment
    if inputs.causal is not None:
        if _sdpa_native_causal(caps, inputs):
            kwargs["is_causal"] = True
            if inputs.causal != "top_left":
                kwargs["causal_alignment"] = inputs.causal
        else:
            Tq, Tk = inputs.query.shape[-2], inputs.key.shape[-2]
            visible = causal_mask(Tq, Tk, inputs.causal, device=inputs.query.device)
            if mask is None:
                mask = visible
            elif mask.dtype == torch.bool:
                mask = mask & visible
            else:
                mask = mask.masked_fill(~visible, float("-inf"))
    kwargs["attn_mask"] = mask
    if lse:
        kwargs["return_lse"] = True
    kwargs.update(overrides)
    return (inputs.query, inputs.key, inputs.value), kwargs


def _pair(out: object, what: str) -> tuple[object, object]:
    if not isinstance(out, tuple | list) or len(out) < 2:
        raise Failure(f"asked for the log-sum-exp ({what}), returned {type(out).__name__}")
    return out[0], out[1]


def _sdpa_read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    return _pair(out, "return_lse=True") if lse else (out, None)


def _same(t: Tensor, inputs: Inputs) -> Tensor:
    return t


def _same_back(t: Tensor, like: Tensor) -> Tensor:
    return t


SDPA_FAMILY = ApiFamily(
    name="sdpa",
    summary="torch's scaled_dot_product_attention, (*batch, h, T, D), with the variants "
    "as keyword extensions",
    signature="fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, "
    "scale=None, enable_gqa=False, *, window=None, softcap=0.0, alibi_slopes=None, "
    "sinks=None, return_lse=False)",
    positional=3,
    keywords=("attn_mask", "dropout_p", "is_causal", "scale"),
    defaults=PRESETS["sdpa"],
    build=_sdpa_build,
    read=_sdpa_read,
    to_layout=_same,
    from_layout=_same_back,
    native_causal=_sdpa_native_causal,
)


# -------------------------------------------------------------------------- flash


def _flat_batch(inputs: Inputs) -> int:
    return math.prod(inputs.query.shape[:-3])


def _flash_layout(t: Tensor, inputs: Inputs) -> Tensor:
    """``(*batch, h, T, D)`` as ``(B, T, h, D)``: the batch dims flattened (one when
    there are none), contiguous when the original was, its strides kept otherwise."""
    flat = t.reshape(_flat_batch(inputs), *t.shape[-3:]).transpose(1, 2)  # (B, T, h, D)
    return flat.contiguous() if t.is_contiguous() else flat


def _flash_back(t: Tensor, like: Tensor) -> Tensor:
    """``(B, T, h, D)`` back to the audit's ``(*batch, h, T, D)`` shape of ``like``."""
    return t.transpose(1, 2).reshape(like.shape)


def _flash_native_causal(caps: Capabilities, inputs: Inputs) -> bool:
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
    if inputs.causal == "top_left" and Tq != Tk:
        raise Skip("top-left causal with Tq != Tk: the flash convention is bottom-right")
    kwargs: dict[str, Any] = {
        "dropout_p": 0.0,
        "softmax_scale": inputs.scale,
        "causal": inputs.causal is not None,
    }
    kwargs.update(_variant_kwargs(caps, inputs))
    if inputs.window is not None:
        kwargs["window_size"] = inputs.window
    slopes = inputs.alibi_slopes
    if slopes is not None and slopes.dim() > 1:
        kwargs["alibi_slopes"] = slopes.reshape(_flat_batch(inputs), slopes.shape[-1])
    if lse:
        kwargs["return_attn_probs"] = True
    kwargs.update(overrides)
    args = tuple(_flash_layout(t, inputs) for t in (inputs.query, inputs.key, inputs.value))
    return args, kwargs


def _flash_read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    first, lse_out = _pair(out, "return_attn_probs=True") if lse else (out, None)
    shape = (*inputs.query.shape[:-1], inputs.value.shape[-1])
    B, h, Tq = _flat_batch(inputs), inputs.query.shape[-3], inputs.query.shape[-2]
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


FLASH_FAMILY = ApiFamily(
    name="flash",
    summary="FlashAttention 2's flash_attn_func: (B, T, h, D), bottom-right causal, "
    "window_size, softcap, alibi_slopes, the LSE through return_attn_probs",
    signature="fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, "
    "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
    "return_attn_probs=False)",
    positional=3,
    keywords=("softmax_scale", "causal"),
    defaults=PRESETS["flash"],
    build=_flash_build,
    read=_flash_read,
    to_layout=_flash_layout,
    from_layout=_flash_back,
    native_causal=_flash_native_causal,
)


# ------------------------------------------------------------------- flash-varlen


def _flash_checks(inputs: Inputs) -> None:
    """What no FlashAttention convention can express: a mask, top-left with Tq != Tk."""
    if inputs.attn_mask is not None:
        raise Skip("attn_mask: the flash conventions take no mask")
    Tq, Tk = inputs.query.shape[-2], inputs.key.shape[-2]
    if inputs.causal == "top_left" and Tq != Tk:
        raise Skip("top-left causal with Tq != Tk: the flash conventions are bottom-right")


def _flash_kwargs(caps: Capabilities, first: Inputs, slopes: Tensor | None) -> dict[str, Any]:
    """The keywords the flash conventions share, for inputs like ``first``."""
    kwargs: dict[str, Any] = {"softmax_scale": first.scale, "causal": first.causal is not None}
    kwargs.update(_variant_kwargs(caps, first))
    if first.window is not None:
        kwargs["window_size"] = first.window
    if slopes is not None:
        kwargs["alibi_slopes"] = slopes
    return kwargs


def pack_arguments(
    caps: Capabilities, pack: Pack, lse: bool, overrides: dict[str, Any] | None = None
) -> Arguments:
    """``flash_attn_varlen_func``'s call for ``pack``."""
    for s in pack.seqs:
        _flash_checks(s)
    q, k, v = pack.tensors()
    args = (
        q,
        k,
        v,
        pack.cu_seqlens("q"),
        pack.cu_seqlens("k"),
        pack.max_seqlen("q"),
        pack.max_seqlen("k"),
    )
    kwargs = {"dropout_p": 0.0, **_flash_kwargs(caps, pack.first, pack.alibi_slopes)}
    if lse:
        kwargs["return_attn_probs"] = True
    kwargs.update(overrides or {})
    return args, kwargs


def read_pack(out: object, pack: Pack, lse: bool) -> tuple[list[object], list[object] | None]:
    """The output (and LSE) of each sequence of ``pack``, in the audit's layouts
    ``(h, Tq, Dv)`` and ``(h, Tq)``; what is not a tensor passes through for the caller
    to judge."""
    first, lse_out = _pair(out, "return_attn_probs=True") if lse else (out, None)
    q, _, v = pack.tensors()
    total, h, Dv = q.shape[0], q.shape[1], v.shape[-1]
    cu = pack.cu_seqlens("q").tolist()
    spans = list(itertools.pairwise(cu))
    outs: list[object] = [first] * len(spans)
    if isinstance(first, Tensor):
        if tuple(first.shape) != (total, h, Dv):
            raise Failure(
                f"returned shape {tuple(first.shape)}, expected {(total, h, Dv)} (total_q, h, Dv)"
            )
        outs = [first[a:b].transpose(0, 1) for a, b in spans]
    if not lse:
        return outs, None
    lses: list[object] = [lse_out] * len(spans)
    if isinstance(lse_out, Tensor):
        if tuple(lse_out.shape) != (h, total):
            raise Failure(
                f"returned a log-sum-exp of shape {tuple(lse_out.shape)}, expected "
                f"{(h, total)} (h, total_q)"
            )
        lses = [lse_out[:, a:b] for a, b in spans]
    return outs, lses


def _varlen_build(
    caps: Capabilities, inputs: Inputs, lse: bool, overrides: dict[str, Any]
) -> Arguments:
    """A dense case as a pack of its samples (equal lengths)."""
    _flash_checks(inputs)
    return pack_arguments(caps, dense_pack(inputs), lse, overrides)


def _dense_read(
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


def _varlen_read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    return _dense_read(out, inputs, lse, read_pack(out, dense_pack(inputs), lse))


def _packed_layout(t: Tensor, inputs: Inputs) -> Tensor:
    """``(*batch, h, T, D)`` as ``(B * T, h, D)``."""
    return _flash_layout(t, inputs).reshape(-1, *t.shape[-3:-2], t.shape[-1]).contiguous()


def _packed_back(t: Tensor, like: Tensor) -> Tensor:
    h, T, D = like.shape[-3:]
    return t.reshape(-1, T, h, D).transpose(1, 2).reshape(like.shape)


FLASH_VARLEN_FAMILY = ApiFamily(
    name="flash-varlen",
    summary="FlashAttention 2's flash_attn_varlen_func: packed sequences (total, h, D) "
    "described by int32 cu_seqlens, each attended on its own, bottom-right",
    signature="fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
    "dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
    "alibi_slopes=None, deterministic=False, return_attn_probs=False)",
    positional=7,
    keywords=("cu_seqlens_q", "cu_seqlens_k", "softmax_scale", "causal"),
    defaults=PRESETS["flash-varlen"],
    build=_varlen_build,
    read=_varlen_read,
    to_layout=_packed_layout,
    from_layout=_packed_back,
    native_causal=_flash_native_causal,
)


# ------------------------------------------------------------------ flash-kvcache


def cache_arguments(
    caps: Capabilities, call: CacheCall, lse: bool, overrides: dict[str, Any] | None = None
) -> Arguments:
    """``flash_attn_with_kvcache``'s call for ``call``: keywords left at FlashAttention's
    defaults are not passed."""
    for row in call.rows:
        _flash_checks(row)
    if call.first.sinks is not None:
        raise Skip("sinks: the flash-kvcache convention takes none")
    if call.rotary_cos is not None and not caps.rotary:
        raise Skip("rotary not declared")
    if call.block_table is not None:
        if not caps.paged:
            raise Skip("a paged cache not declared")
        page = call.k_cache.shape[1]
        if page % caps.page_multiple:
            raise Skip(
                f"page size {page}: the declared sizes are multiples of {caps.page_multiple}"
            )
    kwargs: dict[str, Any] = {"cache_seqlens": call.cache_seqlens}
    if call.k_new is not None:
        kwargs["k"], kwargs["v"] = call.k_new, call.v_new
    if call.rotary_cos is not None:
        kwargs["rotary_cos"], kwargs["rotary_sin"] = call.rotary_cos, call.rotary_sin
        kwargs["rotary_interleaved"] = call.interleaved
    if call.cache_batch_idx is not None:
        kwargs["cache_batch_idx"] = call.cache_batch_idx
    if call.block_table is not None:
        kwargs["block_table"] = call.block_table
    kwargs.update(_flash_kwargs(caps, call.first, call.alibi_slopes))
    if call.num_splits:
        kwargs["num_splits"] = call.num_splits
    if lse:
        kwargs["return_softmax_lse"] = True
    kwargs.update(overrides or {})
    return (call.q, call.k_cache, call.v_cache), kwargs


def read_cache(out: object, call: CacheCall, lse: bool) -> tuple[list[object], list[object] | None]:
    """The output (and LSE) of each batch row of ``call``, as ``(h, Tq, Dv)`` and
    ``(h, Tq)``."""
    first, lse_out = _pair(out, "return_softmax_lse=True") if lse else (out, None)
    B, Tq, h = call.q.shape[:3]
    Dv = call.v_cache.shape[-1]
    outs: list[object] = [first] * B
    if isinstance(first, Tensor):
        if tuple(first.shape) != (B, Tq, h, Dv):
            raise Failure(
                f"returned shape {tuple(first.shape)}, expected {(B, Tq, h, Dv)} (B, Tq, h, Dv)"
            )
        outs = list(first.transpose(1, 2).unbind(0))
    if not lse:
        return outs, None
    lses: list[object] = [lse_out] * B
    if isinstance(lse_out, Tensor):
        if tuple(lse_out.shape) != (B, h, Tq):
            raise Failure(
                f"returned a log-sum-exp of shape {tuple(lse_out.shape)}, expected "
                f"{(B, h, Tq)} (B, h, Tq)"
            )
        lses = list(lse_out.unbind(0))
    return outs, lses


def _kvcache_build(
    caps: Capabilities, inputs: Inputs, lse: bool, overrides: dict[str, Any]
) -> Arguments:
    """A dense case as a decode call: its keys in a contiguous cache, nothing appended."""
    _flash_checks(inputs)
    return cache_arguments(caps, dense_cache(inputs), lse, overrides)


def _kvcache_read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    return _dense_read(out, inputs, lse, read_cache(out, dense_cache(inputs), lse))


FLASH_KVCACHE_FAMILY = ApiFamily(
    name="flash-kvcache",
    summary="FlashAttention 2's flash_attn_with_kvcache: decoding against a contiguous or "
    "paged KV cache, an in-place append, rotary for the new tokens, split-KV",
    signature="fn(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
    "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, "
    "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
    "rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False)",
    positional=3,
    keywords=("cache_seqlens", "softmax_scale", "causal"),
    defaults=PRESETS["flash-kvcache"],
    build=_kvcache_build,
    read=_kvcache_read,
    to_layout=_flash_layout,
    from_layout=_flash_back,
    native_causal=_flash_native_causal,
    dropout=False,
)

FAMILIES: dict[str, ApiFamily] = {
    f.name: f for f in (SDPA_FAMILY, FLASH_FAMILY, FLASH_VARLEN_FAMILY, FLASH_KVCACHE_FAMILY)
}


def get_family(name: str) -> ApiFamily:
    """The family called ``name``; a clear error for an unknown one."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise BackendError(
            f"unknown API family {name!r}: use one of {', '.join(FAMILIES)}"
        ) from None


def family_of(backend: Backend) -> ApiFamily:
    """The calling convention of ``backend``."""
    return get_family(backend.api)
