"""The ``sdpa`` family: torch's ``scaled_dot_product_attention``, ``(*batch, h, T, D)``,
with the variants as keyword extensions (docs/variants.md).

Everything of the family is here: the convention (how a case becomes a call and how
the answer is read back), its preset (`SDPA_DEFAULTS`: torch SDPA's semantics), its
built-in backends (attnref's reference, torch SDPA with each kernel forced,
FlexAttention, the naive kernel) and its mutants (classes 1-21), the planted bugs of the
attention arithmetic itself. The kernels here are also what the flash families wrap.
"""

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked, checked_internal
from attnref.conformance.cases import Inputs
from attnref.conformance.declarations import Backend, Capabilities
from attnref.conformance.family import ApiFamily, Arguments, pair, variant_kwargs
from attnref.conformance.kernels import (
    Key,
    Mask,
    Out,
    Query,
    Value,
    blocked,
    kv_heads,
    materialised,
)
from attnref.conformance.mutants import (
    REFERENCE_LIKE,
    Inputs4,
    Mutant,
    Some,
    SomeMask,
)
from attnref.conformance.verdicts import Skip
from attnref.masks import Alignment, causal_mask

__all__ = ["FAMILY", "SDPA_DEFAULTS"]

#: ALiBi slopes, one per head, or per sample and head
Slopes = Float[Tensor, " h"] | Float[Tensor, "*batch h"] | None

#: the ``sdpa`` family's preset (`Capabilities()`): torch SDPA's signature, every
#: combination of its arguments tested, a causal call with a mask included
SDPA_DEFAULTS = Capabilities()
#: torch's own SDPA: it raises on ``is_causal=True`` with an ``attn_mask``
TORCH_SDPA_CAPS = Capabilities(causal_with_mask=False)


# ----------------------------------------------------------------- the convention


def _sdpa_native_causal(caps: Capabilities, inputs: Inputs) -> bool:
    square = inputs.query.shape[-2] == inputs.key.shape[-2]
    return inputs.causal is not None and (
        inputs.causal in caps.causal_alignments
        and (inputs.attn_mask is None or caps.causal_with_mask)
        and (square or not caps.causal_square_only)
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
    kwargs.update(variant_kwargs(caps, inputs))
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


def _sdpa_error_hint(caps: Capabilities, kwargs: dict[str, Any], error: str) -> str:
    """A raise on ``is_causal=True`` with an ``attn_mask``, which the default declaration
    makes and torch's own SDPA refuses, that speaks of the mask or causality: the
    declaration that keeps such calls out (an error of another kind, a compiler's on
    such a call, gets no hint)."""
    both = kwargs.get("is_causal") is True and kwargs.get("attn_mask") is not None
    about = any(word in error.lower() for word in ("mask", "causal"))
    if not (both and caps.causal_with_mask and about):
        return ""
    return (
        " (the call passed is_causal=True and an attn_mask together; a backend that "
        "does not take both declares causal_with_mask=False, and the diagonal then "
        "reaches it folded into the mask)"
    )


def _sdpa_read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    return pair(out, "return_lse=True") if lse else (out, None)


def _same(t: Tensor, inputs: Inputs) -> Tensor:
    return t


def _same_back(t: Tensor, like: Tensor) -> Tensor:
    return t


# ------------------------------------------------------------------ the kernels


def reference(*args: Any, **kwargs: Any) -> Any:
    return F.scaled_dot_product_attention(*args, **kwargs)


def reference_chunked(*args: Any, **kwargs: Any) -> Any:
    return F.chunked_attention(*args, **kwargs, block_size=4)


@checked_internal
def naive(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **variants: Any,
) -> Any:
    """Textbook attention materialised with plain torch ops, in the inputs' dtype.

    ``softmax(Q K^T * scale + mask) V``: `attnref.conformance.kernels.materialised` with
    every switch off (scores and softmax in float32, probabilities rounded to the inputs'
    dtype before ``P @ V``, zeros for a query with no visible key), and the variants
    (``causal_alignment``, ``window``, ``softcap``, ``alibi_slopes``, ``sinks``,
    ``return_lse``) as keywords.
    """
    if dropout_p != 0.0:
        raise ValueError("the naive backend has no dropout")
    from attnref.conformance.kernels import materialised

    return materialised(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, **variants)


@functools.cache
def compiled_flex() -> Callable[..., Tensor]:
    """FlexAttention compiled once, for every shape: the path its users call, on every
    device (fused on CUDA; on the CPU, inference only and no log-sum-exp)."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled: Callable[..., Tensor] = torch.compile(flex_attention, dynamic=True)
    return compiled


@checked_internal
def flex(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_alignment: Alignment = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Slopes = None,
    sinks: Float[Tensor, " h"] | None = None,
    return_lse: bool = False,
) -> Out | tuple[Out, Float[Tensor, "*batch h Tq"]]:
    """FlexAttention: the mask, softcap and ALiBi as a ``score_mod``, the causal diagonal
    and the window as a ``mask_mod`` (a block mask), through ``torch.compile`` on every
    device: the path users call (on the CPU it has no backward and no log-sum-exp).
    Its log-sum-exp comes from ``return_aux``; sinks are applied from it afterwards
    (`attnref.functional.apply_sinks`), on a call in float32 for half-precision inputs,
    so that the output is rounded to their dtype once.

    Every setting reaches the two functions as a tensor, and both always apply every
    modifier (a neutral one when off): FlexAttention traces them with Dynamo even in
    eager mode, and a Python number or a new branch in them would trace again on every
    call with a new value (about a second each on a CPU).
    """
    import warnings

    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    if dropout_p != 0.0:
        raise ValueError("FlexAttention has no dropout")
    batch = query.shape[:-3]
    h, Tq, Tk = query.shape[-3], query.shape[-2], key.shape[-2]
    B = math.prod(batch)
    device = query.device
    q, k, v = (t.reshape(B, *t.shape[-3:]) for t in (query, key, value))
    ctype = torch.promote_types(query.dtype, torch.float32)  # what the scores are in
    if sinks is not None:  # the sink factor joins before the one rounding to the dtype
        q, k, v = q.to(ctype), k.to(ctype), v.to(ctype)
    if attn_mask is None:
        bias = torch.zeros((1, 1, 1, 1), device=device, dtype=ctype)
    else:
        full = attn_mask.expand(*batch, h, Tq, Tk).reshape(B, h, Tq, Tk)
        bias = (
            torch.zeros(full.shape, device=device, dtype=ctype).masked_fill(~full, -math.inf)
            if full.dtype == torch.bool
            else full.to(ctype)
        )
    masked = attn_mask is not None  # a branch fixed for the mask's lifetime
    slopes = torch.zeros((B, h), device=device, dtype=ctype)
    if alibi_slopes is not None:  # in the scores' dtype: m * |i - j| is not rounded
        slopes = alibi_slopes.to(ctype).reshape(-1, h).expand(B, h)
    offset = torch.tensor(0 if causal_alignment == "top_left" else Tk - Tq, device=device)
    cap = torch.tensor(float(softcap), device=device)
    left, right = (torch.tensor(w, device=device) for w in (window or (-1, -1)))
    causal = torch.tensor(is_causal, device=device)

    def score_mod(score: Tensor, b: Tensor, hh: Tensor, qi: Tensor, kj: Tensor) -> Tensor:
        capped = cap * torch.tanh(score / torch.where(cap > 0, cap, 1.0))
        score = torch.where(cap > 0, capped, score)
        score = score - slopes[b, hh] * (qi + offset - kj).abs()
        if masked:
            score = score + bias[b, hh, qi, kj]
        return score

    def mask_mod(b: Tensor, hh: Tensor, qi: Tensor, kj: Tensor) -> Tensor:
        pos = qi + offset
        seen = ~causal | (kj <= pos)
        return seen & ((left < 0) | (kj >= pos - left)) & ((right < 0) | (kj <= pos + right))

    fn = compiled_flex()  # the path users call, on every device
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block_mask = create_block_mask(mask_mod, None, None, Tq, Tk, device=device)
        # the log-sum-exp only when it is needed (compiled for the CPU, FlexAttention
        # has none: it raises, a declared refusal)
        need_lse = return_lse or sinks is not None
        got = fn(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=h != k.shape[-3],
            return_aux=AuxRequest(lse=True) if need_lse else None,
        )
    if not need_lse:
        plain: Tensor = got
        return plain.reshape(*batch, h, Tq, value.shape[-1])
    out, aux = got
    out = out.reshape(*batch, h, Tq, value.shape[-1])
    lse = aux.lse.reshape(*batch, h, Tq)
    if sinks is not None:
        out = F.apply_sinks(out, lse, sinks).to(query.dtype)
    return (out, lse) if return_lse else out


@checked_internal
def sdpa_with_bias(
    query: Query,
    key: Key,
    value: Value,
    attn_mask: Mask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_alignment: Alignment = "top_left",
    window: tuple[int, int] | None = None,
    alibi_slopes: Slopes = None,
) -> Out:
    """torch SDPA with the variants a float mask can express: the causal diagonal (any
    alignment), the window as ``-inf`` and ALiBi as ``-m |i - j|``, added to the mask."""
    from attnref.masks import causal_mask, sliding_window_mask

    Tq, Tk = query.shape[-2], key.shape[-2]
    ctype = torch.promote_types(query.dtype, torch.float32)
    bias = torch.zeros((Tq, Tk), dtype=ctype, device=query.device)
    if alibi_slopes is not None:
        offset = 0 if causal_alignment == "top_left" else Tk - Tq
        rows = torch.arange(Tq, device=query.device).unsqueeze(-1) + offset
        distance = (rows - torch.arange(Tk, device=query.device)).abs().to(ctype)
        bias = -alibi_slopes.to(ctype).reshape(*alibi_slopes.shape, 1, 1) * distance
    seen = torch.ones((Tq, Tk), dtype=torch.bool, device=query.device)
    if is_causal:
        seen = seen & causal_mask(Tq, Tk, causal_alignment, device=query.device)
    if window is not None:
        seen = seen & sliding_window_mask(Tq, Tk, window, causal_alignment, query.device)
    bias = bias.masked_fill(~seen, -math.inf)
    if attn_mask is not None:
        bias = (
            bias.masked_fill(~attn_mask, -math.inf)
            if attn_mask.dtype == torch.bool
            else bias + attn_mask.to(ctype)
        )
    if alibi_slopes is not None and alibi_slopes.dim() > 1:  # (*batch, h) slopes
        bias = bias.expand(*query.shape[:-1], Tk)
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, bias.to(query.dtype), dropout_p, scale=scale, enable_gqa=enable_gqa
    )
    return out


def _force(
    backend: "torch.nn.attention.SDPBackend",
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        import warnings

        from torch.nn.attention import sdpa_kernel

        # a forced kernel that refuses an input warns why before it raises; the error
        # is the verdict, the warning only noise
        with sdpa_kernel(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield

    return ctx


# a forced kernel may refuse inputs it does not handle ("No available kernel"): a skip


FORCED_CAPS = Capabilities(causal_with_mask=False, refuses=("No available kernel",))
#: every variant, and the log-sum-exp with -inf for a query with no visible key
ALL_VARIANTS: dict[str, Any] = {
    "window": True,
    "softcap": True,
    "alibi": True,
    "sinks": True,
    "lse": True,
}
#: compiled for the CPU, FlexAttention has no backward, no log-sum-exp and no float64,
#: and says so (refused there; on CUDA they run)
FLEX_CPU_REFUSAL = "torch.compile on CPU only supports inference"
# it divides by sqrt(Dqk) in Python, so Dqk = 0 raises ZeroDivisionError
FLEX_CAPS = Capabilities(
    dropout=False,
    zero_head_dim=False,
    refuses=(
        FLEX_CPU_REFUSAL,
        "does not support backward on CPU",
        # compiled for the CPU: float32, float16 and bfloat16 only
        "are supported in FlexAttention for CPU device",
    ),
    causal_alignments=("top_left", "bottom_right"),
    **ALL_VARIANTS,
)
REFERENCE_CAPS = Capabilities(
    causal_alignments=("top_left", "bottom_right"),
    causal_with_mask=True,
    masked_nan="contained",
    **ALL_VARIANTS,
)
NAIVE_CAPS = Capabilities(
    dropout=False, causal_alignments=("top_left", "bottom_right"), **ALL_VARIANTS
)

SDPA_BIAS_CAPS = Capabilities(
    dtypes=(torch.float64, torch.float32),
    causal_alignments=("top_left", "bottom_right"),
    causal_with_mask=True,
    window=True,
    alibi=True,
)


# ------------------------------------------------------------------ the builtins


def _builtins() -> list[Backend]:
    from torch.nn.attention import SDPBackend

    torch_sdpa = torch.nn.functional.scaled_dot_product_attention
    return [
        Backend("reference", reference, "attnref's reference, in the case's dtype", REFERENCE_CAPS),
        Backend(
            "reference-chunked",
            reference_chunked,
            "attnref's online-softmax chunked attention, blocks of 4 keys",
            REFERENCE_CAPS,
        ),
        Backend("torch-sdpa", torch_sdpa, "torch SDPA, default dispatch", TORCH_SDPA_CAPS),
        Backend(
            "torch-sdpa-math",
            torch_sdpa,
            "torch SDPA with the MATH backend forced",
            TORCH_SDPA_CAPS,
            context=_force(SDPBackend.MATH),
        ),
        *(
            Backend(
                f"torch-sdpa-{name}",
                torch_sdpa,
                f"torch SDPA with the {kernel.name} backend forced (skipped where absent)",
                FORCED_CAPS,
                context=_force(kernel),
                probe=True,
            )
            for name, kernel in (
                ("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION),
            )
        ),
        Backend(
            "torch-sdpa-bias",
            sdpa_with_bias,
            "torch SDPA with the window and ALiBi folded into its float mask",
            # not half precision: torch SDPA takes the mask in the query's dtype, and
            # rounding the ALiBi bias m * |i - j| to it grows with the distance
            SDPA_BIAS_CAPS,
        ),
        Backend(
            "torch-flex",
            flex,
            "FlexAttention (torch.nn.attention.flex_attention), compiled (torch.compile)",
            FLEX_CAPS,
        ),
        Backend(
            "naive",
            naive,
            "textbook softmax(QK^T * scale + mask) V, materialised in the inputs' dtype",
            NAIVE_CAPS,
        ),
    ]


# ------------------------------------------------------------------- the mutants


def _mutant_fn(self: Mutant) -> Callable[..., Tensor]:
    """A mutant as a function with torch SDPA's signature: its kernel with its switches,
    after its misreading of the inputs, if any."""

    @checked
    def mutant(
        query: Query,
        key: Key,
        value: Value,
        attn_mask: Mask = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        **extra: Any,  # causal_alignment, where the mutant declares it
    ) -> Out:
        if self.prepare is not None:
            query, key, value, attn_mask = self.prepare(query, key, value, attn_mask, scale)
        out: Tensor = self.kernel(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            **extra,
            **self.switches,
        )
        return out

    mutant.__name__ = mutant.__qualname__ = self.name
    mutant.__doc__ = f"Class {self.bug_class}: {self.summary}"
    mutant.capabilities = self.capabilities  # type: ignore[attr-defined]
    return mutant


# ------------------------------------------------- inputs misread, kernels of their own


@checked_internal
def _raw(t: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """``t`` read the way a kernel that ignores strides and offsets reads it: its storage
    from the start, as if contiguous; memory past the end of the storage reads as zeros."""
    available = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.as_strided(t, (min(available, t.numel()),), (1,), 0)
    if flat.numel() < t.numel():
        flat = torch.cat([flat, flat.new_zeros(t.numel() - flat.numel())])
    return flat.reshape(t.shape)


@checked_internal
def _strides_ignored(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    q, k, v = (t if t.is_contiguous() or 0 in t.stride() else _raw(t) for t in (q, k, v))
    return q, k, v, m


@checked_internal
def _broadcast_misread(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    k, v = (_raw(t) if 0 in t.stride() and t.numel() else t for t in (k, v))
    return q, k, v, m


@checked_internal
def _gqa_decode_tiled(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    if q.shape[-2] == 1:  # the decode path expands the KV heads tiled
        k, v = kv_heads(k, v, q.shape[-3], tiled=True)
    return q, k, v, m


@checked_internal
def _gqa_mask_per_kv_head(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    h, g = q.shape[-3], k.shape[-3]
    if m is not None and h != g and m.dim() >= 3 and m.shape[-3] == h:
        m = m[..., [i // (h // g) for i in range(h)], :, :]
    return q, k, v, m


@checked_internal
def _heads_folded_by_reshape(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    if k.dim() >= 4:
        n, g, Tk = math.prod(k.shape[:-3]), k.shape[-3], k.shape[-2]
        # (batch, head) meant, (head, batch) read
        k, v = (t.reshape(g, n, Tk, t.shape[-1]).transpose(0, 1).reshape(t.shape) for t in (k, v))
    return q, k, v, m


@checked_internal
def _decode_drops_last_key(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    if q.shape[-2] == 1 and k.shape[-2] > 1:
        k, v = k[..., :-1, :], v[..., :-1, :]
        if m is not None and m.shape[-1] > 1:
            m = m[..., :-1]
    return q, k, v, m


@checked_internal
def _index_wraps_16bit(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    def gather(t: Tensor) -> Tensor:
        rows = t.numel() // max(t.shape[-1], 1)
        if rows == 0:
            return t
        index = torch.arange(rows, device=t.device).to(torch.int16).to(torch.int64) % rows
        return t.reshape(rows, t.shape[-1])[index].reshape(t.shape)

    return q, gather(k), gather(v), m


@checked_internal
def _long_tail_block_dropped(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    Tk = k.shape[-2]
    keep = Tk - Tk % 128
    if Tk > 2048 and keep < Tk:  # the long-context path tiles keys by 128, tail lost
        k, v = k[..., :keep, :], v[..., :keep, :]
        if m is not None and m.shape[-1] > 1:
            m = m[..., :keep]
    return q, k, v, m


@checked_internal
def _with_grad_hook(
    t: Float[Tensor, "*shape"], hook: Callable[[Tensor], Tensor]
) -> Float[Tensor, "*shape"]:
    if not t.requires_grad:
        return t
    t = t.view_as(t)
    t.register_hook(hook)  # type: ignore[no-untyped-call]
    return t


@checked_internal
def _grad_tail_block_dropped(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    tail = k.shape[-2] - k.shape[-2] % 16

    def drop(g: Tensor) -> Tensor:
        g = g.clone()
        g[..., tail:, :] = 0
        return g

    return q, _with_grad_hook(k, drop), _with_grad_hook(v, drop), m


@checked_internal
def _grad_query_unscaled(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    scale = F.default_scale(q.shape[-1]) if s is None else s
    return _with_grad_hook(q, lambda g: g / scale if scale else g), k, v, m


def _top_left_only(*args: Any, causal_alignment: str = "top_left") -> Tensor:
    """The reference, with the causal alignment it was asked for dropped."""
    out: Tensor = F.scaled_dot_product_attention(*args)
    return out


def _single_key_shortcut(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, *args: Any
) -> Tensor:
    """With one key, V for every query, the mask ignored; otherwise a correct kernel."""
    if key.shape[-2] == 1:
        _, v = kv_heads(key, value, query.shape[-3])
        return v.expand(*query.shape[:-1], value.shape[-1]).clone()
    out = materialised(query, key, value, attn_mask, *args)
    assert isinstance(out, Tensor)
    return out


MUTANTS: tuple[Mutant, ...] = (
    Mutant("empty_row_nan", 1, "a query with no visible key returns NaN (softmax of a "
           "row of -inf)", {"zero_empty_rows": False}),
    Mutant("empty_row_uniform", 2, "masks filled with a finite -1e9: a query with no "
           "visible key averages V", {"fill": -1e9}),
    Mutant("masked_nan_leaks", 3, "claims NaN in masked-out K/V is contained, but "
           "``P @ V`` gives 0 * NaN", capabilities=Capabilities(masked_nan="contained")),
    Mutant("causal_bottom_right", 4, "``is_causal`` aligned bottom-right while claiming "
           "torch's top-left", {"causal_alignment": "bottom_right"}),
    Mutant("causal_alignment_ignored", 4, "declares both alignments but always aligns "
           "top-left", kernel=_top_left_only, capabilities=REFERENCE_LIKE),
    Mutant("causal_excludes_self", 5, "the causal diagonal is off by one: a query does "
           "not see its own key", {"diagonal": -1}),
    Mutant("causal_leaks_next", 5, "the causal diagonal is off by one: a query sees the "
           "next token", {"diagonal": 1}),
    Mutant("strides_ignored", 6, "transposed, sliced or offset inputs read as if "
           "contiguous from offset 0", prepare=_strides_ignored),
    Mutant("broadcast_misread", 7, "stride-0 (broadcast) K/V read as if every sample had "
           "its own storage", prepare=_broadcast_misread),
    Mutant("no_max_subtraction", 8, "``exp`` of raw scores in the input dtype, no max "
           "subtracted: overflow", {"subtract_max": False}),
    Mutant("gqa_tiled", 9, "GQA heads tiled (head i reads KV head i % g) instead of "
           "interleaved", {"tiled_gqa": True}),
    Mutant("gqa_decode_tiled", 10, "GQA with a single query (the decode path) maps heads "
           "tiled", prepare=_gqa_decode_tiled),
    Mutant("gqa_mask_per_kv_head", 10, "GQA with a per-head mask: query head i gets the "
           "mask of head i // group", prepare=_gqa_mask_per_kv_head),
    Mutant("grad_tail_block_dropped", 11, "the backward drops dK and dV of the last "
           "partial tile of 16 keys", kernel=reference,
           prepare=_grad_tail_block_dropped, capabilities=REFERENCE_LIKE),
    Mutant("grad_query_unscaled", 11, "the backward forgets the softmax scale in dQ",
           kernel=reference, prepare=_grad_query_unscaled, capabilities=REFERENCE_LIKE),
    Mutant("tail_block_dropped", 12, "tiles of 16 keys; the last partial tile is never "
           "visited", {"drop_tail": True}, kernel=blocked),
    Mutant("online_softmax_no_rescale", 13, "online softmax over tiles of 8 keys that "
           "never rescales the accumulator", {"block": 8, "rescale": False},
           kernel=blocked),
    Mutant("scale_by_d", 14, "the default scale is 1/d instead of 1/sqrt(d)",
           {"scale_rule": lambda d: 1 / d if d else 1.0}),
    Mutant("scale_ignored", 14, "an explicit ``scale`` is ignored; 1/sqrt(d) is always "
           "used", {"ignore_scale": True}),
    Mutant("softmax_over_queries", 15, "the softmax normalises over queries (dim -2) "
           "instead of keys", {"softmax_dim": -2}),
    Mutant("mask_inverted", 16, "boolean mask polarity inverted (True read as "
           "\"hide\")", {"invert_mask": True}),
    Mutant("float_mask_as_bool", 16, "a float (additive) mask is read as a boolean one "
           "(nonzero = visible)", {"float_mask_as_bool": True}),
    Mutant("heads_folded_by_reshape", 17, "K and V folded (head, batch) by a reshape "
           "where (batch, head) was meant", prepare=_heads_folded_by_reshape),
    Mutant("decode_drops_last_key", 18, "the one-query (decode) path reads one key too "
           "few (cache length - 1)", prepare=_decode_drops_last_key),
    Mutant("dropout_at_zero", 19, "dropout is applied (p = 0.05) even when "
           "``dropout_p == 0``", {"dropout_floor": 0.05}),
    Mutant("single_key_shortcut", 20, "with one key, returns V for every query, ignoring "
           "the mask", kernel=_single_key_shortcut),
    Mutant("zero_head_dim_nan", 20, "Dqk = 0 gives scale 1/sqrt(0) = inf, and 0 * inf = "
           "NaN scores", {"scale_rule": lambda d: 1 / math.sqrt(d) if d else math.inf}),
    Mutant("index_wraps_16bit", 21, "key rows addressed by a 16-bit flat index that "
           "wraps past 32767 rows (32-bit offset overflow, scaled down to show on a "
           "CPU)", prepare=_index_wraps_16bit),
    Mutant("long_tail_block_dropped", 32, "past 2048 keys, the last partial block of 128 "
           "keys is dropped (a long-context path; size-gated)",
           prepare=_long_tail_block_dropped),
    Mutant("minus_inf_as_5e4", 33, "hidden keys filled with a finite -5e4 for minus "
           "infinity: wrong once visible scores fall below it (value-gated)", {"fill": -5e4}),
)  # fmt: skip


FAMILY = ApiFamily(
    name="sdpa",
    summary="torch's scaled_dot_product_attention, (*batch, h, T, D), with the variants "
    "as keyword extensions",
    signature="fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, "
    "scale=None, enable_gqa=False, *, window=None, softcap=0.0, alibi_slopes=None, "
    "sinks=None, return_lse=False)",
    positional=3,
    keywords=("attn_mask", "dropout_p", "is_causal", "scale"),
    defaults=SDPA_DEFAULTS,
    build=_sdpa_build,
    read=_sdpa_read,
    to_layout=_same,
    from_layout=_same_back,
    native_causal=_sdpa_native_causal,
    error_hint=_sdpa_error_hint,
    builtins=_builtins,
    mutants=MUTANTS,
    mutant_fn=_mutant_fn,
    bench_backends=(
        "reference",
        "torch-sdpa-math",
        "torch-sdpa",
        "torch-sdpa-flash",
        "torch-sdpa-efficient",
        "torch-sdpa-cudnn",
        "torch-flex",
    ),
)
