"""Audit cases: a declarative description of one SDPA call, and how to build its inputs.

A `Case` is plain data (shapes, flags, a seed), so a failure can be printed as a
reproducer and a case list can be stored in a report. `build` turns it into
tensors on a device in a dtype.
"""

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, get_args

import torch
from jaxtyping import Bool, Float, Float32, Float64
from torch import Tensor

from attnref._checking import checked_internal
from attnref.masks import Alignment, Window, causal_mask, check_window, sliding_window_mask

__all__ = [
    "Alibi",
    "Case",
    "Inputs",
    "Layout",
    "Logits",
    "MaskKind",
    "Poison",
    "build",
    "fixed_grid",
    "long_grid",
    "shape_values",
    "variant_grid",
]

#: every mask kind `build` knows, simplest first (see `Case`)
MaskKind = Literal[
    "none", "bool", "padding", "columns", "bool_full", "float", "empty_rows", "float_empty_rows"
]
#: how the tensors are laid out in memory (see `Case`)
Layout = Literal["contiguous", "transposed", "sliced", "broadcast", "broadcast_heads"]
#: what is planted in K and V at keys no query sees (see `Case`)
Poison = Literal["none", "garbage", "nan", "inf"]
#: ALiBi slopes: none, one per head ``(h,)``, or one per sample and head ``(*batch, h)``
Alibi = Literal["none", "heads", "batch_heads"]
#: how the scores of a case are shaped beyond ``amp * randn`` (see `Case`, class 33)
Logits = Literal["randn", "far", "peaked", "moving", "outliers"]


@dataclass(frozen=True)
class Case:
    """One SDPA call: ``(*batch, h, Tq, Dh)`` queries against ``(*batch, g, Tk, Dh)`` keys.

    ``mask``: ``none``; ``bool`` (random, broadcast over heads); ``bool_full`` (one per
    head); ``float`` (random offsets with some ``-inf``); ``padding`` (``(B, 1, 1, Tk)``
    from random lengths); ``columns`` (random keys hidden from every query of a sample);
    ``empty_rows`` (random, with some queries seeing nothing); ``float_empty_rows`` (the
    same as a float mask: random offsets, ``-inf`` where a key is hidden).
    ``causal``: ``None``, ``"top_left"`` or ``"bottom_right"``. ``layout``:
    ``contiguous``, ``transposed`` (query stored ``Dh``-major), ``sliced`` (key and value
    cut from a wider tensor, with a storage offset), ``broadcast`` (key and value
    expanded over the first dimension, stride 0) or ``broadcast_heads`` (expanded over
    the KV heads). ``poison``: ``none``, or ``garbage`` (large
    finite values), ``nan`` or ``inf`` planted in K and V at keys that no query of the
    sample sees (through the mask, the causal diagonal or the window).

    The variants (docs/variants.md): ``window`` ``(left, right)`` or ``None``;
    ``softcap`` (0: off); ``alibi`` slopes (FlashAttention's geometric ones, times a
    random factor per sample for ``batch_heads``); ``sinks`` (one random logit per query
    head). Window and ALiBi place query ``i`` at ``i`` under a ``top_left`` causal case,
    and at ``Tk - Tq + i`` otherwise (bottom-right, the flash convention).

    Values where kernels break and references do not (class 33; docs/testing.md):
    ``logits`` ``randn`` (``amp * randn`` queries and keys); ``far`` (every score of a
    row moved by about ``level``, e.g. ``-1e5``: past a finite stand-in for minus
    infinity, or below a running max started at 0); ``peaked`` (one key per KV head,
    far from the last ones, dominates every row by about ``level``); ``moving`` (scores
    ramp by ``level`` along the keys, so a row's maximum moves from one key block to
    the next: split-KV merges must rescale; a ramp of ``2e4`` or more puts hidden keys
    past the visible ones by more than a finite fill added to their scores, -1e4 or
    -5e4, where a mask hides the later keys); ``outliers`` (two channels of Q and K
    ``level`` times larger, as LLM activations have). ``v_offset``: V's mean, with a
    spread over channels (0: ``randn``), so that an output near zero is wrong.
    """

    name: str
    batch: tuple[int, ...] = (2,)
    h: int = 3
    g: int = 3
    Tq: int = 17
    Tk: int = 17
    Dh: int = 8
    Dv: int = 8
    mask: MaskKind = "none"
    causal: Alignment | None = None
    layout: Layout = "contiguous"
    amp: float = 1.0  # queries and keys are amp * randn: large amp makes the softmax peaky
    scale: float | None = None
    poison: Poison = "none"  # what to plant in K and V at keys no query sees
    seed: int = 0
    window: Window | None = None
    softcap: float = 0.0
    alibi: Alibi = "none"
    sinks: bool = False
    #: the one sink logit of every head (None: one random logit per head)
    sink: float | None = None
    # packed sequences (the flash-varlen family, docs/varlen.md): ``(Tq, Tk)`` of each
    # sequence, and how many padding tokens of garbage follow the pack
    seqlens: tuple[tuple[int, int], ...] = ()
    pad: int = 0
    # a KV cache (the flash-kvcache family, docs/kvcache.md): the tokens already cached
    # in each batch row, how many new ones are appended (0: none), the page size (0: a
    # contiguous cache), the rotary dims (0: none) and layout, num_splits, and whether
    # physical pages (or cache rows, through cache_batch_idx) are shuffled
    cached: tuple[int, ...] = ()
    new: int = 0
    page: int = 0
    rotary: int = 0
    interleaved: bool = True
    splits: int = 0
    shuffle: bool = False
    shift: int = 0  # every position moved by this much (the first ones garbage)
    logits: Logits = "randn"
    level: float = 0.0  # the size of what ``logits`` does (scores, or a channel factor)
    v_offset: float = 0.0  # V's mean (over channels, with a spread)
    #: multi-head latent attention (the ``mla`` family): V is K's leading ``Dv`` dims
    latent: bool = False
    #: an FP8 cache (flash-kvcache): q, K and V stored in this format ("e4m3fn",
    #: "e5m2"; "": none) with per-KV-head descales
    fp8: str = ""
    #: what a family's own cases add, as (name, value) pairs (context-parallel: the world
    #: size and the sharding); read with `Case.option`
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        """The value of family option ``name`` (`options`), or ``default``."""
        return dict(self.options).get(name, default)

    def __post_init__(self) -> None:
        for name, kind in (
            ("mask", MaskKind),
            ("causal", Alignment),
            ("layout", Layout),
            ("poison", Poison),
            ("alibi", Alibi),
            ("logits", Logits),
        ):
            allowed: tuple[object, ...] = get_args(kind) + ((None,) if name == "causal" else ())
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"Case.{name} must be one of {', '.join(map(repr, allowed))}, "
                    f"got {getattr(self, name)!r}"
                )

        if self.window is not None:
            check_window(self.window)
        if not self.softcap >= 0:
            raise ValueError(f"Case.softcap must be >= 0 (0: off), got {self.softcap!r}")
        for name in ("pad", "new", "page", "rotary", "splits", "shift"):
            if getattr(self, name) < 0:
                raise ValueError(f"Case.{name} must be >= 0, got {getattr(self, name)!r}")
        for n, lengths in enumerate(self.seqlens):
            if len(lengths) != 2 or min(lengths) < 0:
                raise ValueError(
                    f"Case.seqlens[{n}] must be (Tq, Tk), two lengths >= 0, got {lengths!r}"
                )
        if any(n < 0 for n in self.cached):
            raise ValueError(f"Case.cached must hold lengths >= 0, got {self.cached!r}")
        if self.seqlens and self.cached:
            raise ValueError("a case is a pack (seqlens) or a cache (cached), not both")
        if self.fp8 not in ("", "e4m3fn", "e5m2"):
            raise ValueError(f"Case.fp8 must be '', 'e4m3fn' or 'e5m2', got {self.fp8!r}")
        if self.latent and self.Dv > self.Dh:
            raise ValueError(
                f"Case.latent: V is K's leading Dv dims, so Dv must be at most Dh = "
                f"{self.Dh}, got {self.Dv}"
            )
        if self.rotary % 2 or self.rotary > self.Dh:
            raise ValueError(
                f"Case.rotary must be even and at most Dh = {self.Dh}, got {self.rotary}"
            )

    @property
    def variants(self) -> tuple[str, ...]:
        """The variants this case turns on (docs/variants.md)."""
        on = (
            ("window", self.window is not None),
            ("softcap", self.softcap > 0),
            ("alibi", self.alibi != "none"),
            ("sinks", self.sinks),
        )
        return tuple(name for name, is_on in on if is_on)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Inputs:
    """A case made concrete: the arguments of an SDPA call."""

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None
    causal: Alignment | None
    scale: float | None
    window: Window | None = None
    softcap: float = 0.0
    alibi_slopes: Tensor | None = None  # (h,) or (*batch, h), float32
    sinks: Tensor | None = None  # (h,), float32

    @property
    def enable_gqa(self) -> bool:
        return bool(self.query.shape[-3] != self.key.shape[-3])

    @property
    def alignment(self) -> Alignment:
        """Where query ``i`` sits for the causal diagonal, the window and ALiBi."""
        return self.causal or "bottom_right"

    @property
    def variants(self) -> tuple[str, ...]:
        on = (
            ("window", self.window is not None),
            ("softcap", self.softcap > 0),
            ("alibi", self.alibi_slopes is not None),
            ("sinks", self.sinks is not None),
        )
        return tuple(name for name, is_on in on if is_on)

    def visible(self) -> Tensor:
        """``(*batch, h, Tq, Tk)`` booleans: which keys each query sees (mask, causal
        diagonal and window)."""
        return _visible(self.query, self.key, self.attn_mask, self.causal, self.window)

    def to(self, dtype: torch.dtype) -> "Inputs":
        """The same inputs upcast (or cast) to ``dtype``; masks keep their kind."""
        mask = self.attn_mask
        if mask is not None and mask.is_floating_point():
            mask = mask.to(dtype)
        return replace(
            self,
            query=self.query.to(dtype),
            key=self.key.to(dtype),
            value=self.value.to(dtype),
            attn_mask=mask,
        )


@checked_internal
def _randn(
    shape: tuple[int, ...], gen: torch.Generator, amp: float = 1.0
) -> Float32[Tensor, "*shape"]:
    if math.frexp(amp)[0] == 0.5:  # a power of two: drawn scaled, in one pass, the same
        return torch.empty(shape).normal_(0.0, amp, generator=gen)  # numbers (a test holds it)
    return amp * torch.randn(shape, generator=gen)


def build(case: Case, dtype: torch.dtype, device: str | torch.device = "cpu") -> Inputs:
    """Make the tensors of ``case``, drawn in float32 from its seed, then cast to ``dtype``
    (in float64 with the mantissa's low bits filled from the seed: `_past_float32`)."""
    gen = torch.Generator().manual_seed(case.seed)
    B = case.batch
    q_shape = (*B, case.h, case.Tq, case.Dh)
    k_shape = (*B, case.g, case.Tk, case.Dh)
    v_shape = (*B, case.g, case.Tk, case.Dv)
    if case.layout == "transposed":
        q = _randn((*B, case.h, case.Dh, case.Tq), gen, case.amp).transpose(-1, -2)
    else:
        q = _randn(q_shape, gen, case.amp)
    if case.layout == "broadcast":  # stride 0 over the first dimension
        k = _randn((1, *k_shape[1:]), gen, case.amp).expand(k_shape)
        v = _randn((1, *v_shape[1:]), gen).expand(v_shape)
    elif case.layout == "broadcast_heads":  # stride 0 over the KV heads
        k = _randn((*B, 1, *k_shape[-2:]), gen, case.amp).expand(k_shape)
        v = _randn((*B, 1, *v_shape[-2:]), gen).expand(v_shape)
    else:
        k = _randn(k_shape, gen, case.amp)
        v = _randn(v_shape, gen)
    if case.logits != "randn" or case.v_offset:
        q, k, v = shape_values(case, dtype, q, k, v)
    mask = _make_mask(case, gen)
    if case.poison != "none":
        if case.layout.startswith("broadcast"):
            raise ValueError(f"case {case.name}: poison needs K and V of their own per sample")
        # its own generator: what is drawn after it (ALiBi's slopes per sample, the sink
        # logits) must be the same with the poison as without (masked_keys compares them)
        poison_gen = torch.Generator().manual_seed(case.seed + 104729)
        k, v = _plant(case, q, k, v, mask, poison_gen)
    if dtype == torch.float64:  # float64's mantissa, not float32 numbers (below)
        fill = torch.Generator().manual_seed(case.seed + 15485863)
        q, k, v = (_past_float32(t, fill) for t in (q, k, v))
        if mask is not None and mask.is_floating_point():
            mask = _past_float32(mask, fill)
    if case.latent:  # MLA: the values are the latent rows' leading dims
        v = k[..., : case.Dv]
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    if case.layout == "sliced":  # a view with a storage offset and a non-unit row stride
        k = torch.cat([torch.zeros_like(k[..., :1]), k, k], dim=-1)[..., 1 : case.Dh + 1]
        v = torch.cat([torch.zeros_like(v[..., :1]), v, v], dim=-1)[..., 1 : case.Dv + 1]
    if case.layout == "broadcast":  # .to() may have materialised the expansion
        k = k[:1].expand(k_shape)
        v = v[:1].expand(v_shape)
    if case.layout == "broadcast_heads":
        k = k[..., :1, :, :].expand(k_shape)
        v = v[..., :1, :, :].expand(v_shape)
    if mask is not None:
        mask = mask.to(device=device, dtype=dtype if mask.is_floating_point() else torch.bool)
    slopes = sinks = None
    if case.alibi != "none":
        # FlashAttention's geometric slopes 2^(-8 (i + 1) / h), times a factor per sample
        heads = torch.arange(1, case.h + 1, dtype=torch.float32)
        slopes = torch.exp2(-8.0 * heads / case.h)
        if case.alibi == "batch_heads":
            slopes = slopes * (0.5 + torch.rand((*B, 1), generator=gen))
    if case.sinks:
        sinks = 2 * torch.randn(case.h, generator=gen)
        if case.sink is not None:
            sinks = torch.full((case.h,), case.sink)
    return Inputs(
        q,
        k,
        v,
        mask,
        case.causal,
        case.scale,
        case.window,
        case.softcap,
        None if slopes is None else slopes.to(device),
        None if sinks is None else sinks.to(device),
    )


POISONS = ("none", "garbage", "nan", "inf")


@checked_internal
def _past_float32(x: Float[Tensor, "*shape"], gen: torch.Generator) -> Float64[Tensor, "*shape"]:
    """``x`` (float32 numbers) in float64 with its low 29 mantissa bits filled: each value
    moved by a random share of half its float32 spacing, so that it is no float32 number,
    and rounding it to float32 gives back ``x``. An adapter that rounds float64 inputs to
    float32 (a port bug met in OpenVINO, ONNX Runtime and Keras) then fails ``forward``
    in float64, where float32 numbers would have crossed it exactly. Non-finite values
    (poison) stay as they are, and so does the layout (a transposed view stays one)."""
    wide = x.double()
    nudge = (torch.rand(x.shape, generator=gen, dtype=torch.float64) - 0.5) * 2.0**-24
    return wide.add_(torch.where(torch.isfinite(wide), wide * nudge, 0.0))


@checked_internal
def shape_values(
    case: Case,
    dtype: torch.dtype,
    q: Float32[Tensor, "*batch h Tq Dh"],
    k: Float32[Tensor, "*batch g Tk Dh"],
    v: Float32[Tensor, "*batch g Tk Dv"],
) -> tuple[
    Float32[Tensor, "*batch h Tq Dh"],
    Float32[Tensor, "*batch g Tk Dh"],
    Float32[Tensor, "*batch g Tk Dv"],
]:
    """Q, K and V with ``case.logits`` and ``case.v_offset`` applied (see `Case`).

    The scores are moved along one random unit direction ``u``: ``q += b u``, ``k += a_j
    u`` adds ``scale * b * a_j`` to score ``(i, j)`` (plus cross terms that are the same
    along a row, or of the size of the noise). Its own generator (from the seed), so
    that the ``randn`` values of every other case stay as they were. In float16 the
    factors are capped so that every input stays finite (`_LARGEST`)."""
    gen = torch.Generator().manual_seed(case.seed + 7919)
    Dh, Tk = q.shape[-1], k.shape[-2]
    scale = case.scale if case.scale is not None else (Dh**-0.5 if Dh else 1.0)
    big = _LARGEST.get(dtype, math.inf)
    if Dh and case.logits != "randn" and case.level:
        u = torch.randn(Dh, generator=gen)
        u = u / u.norm()
        if case.logits == "outliers":
            boost = torch.ones(Dh)
            boost[torch.randperm(Dh, generator=gen)[:2]] = min(abs(case.level), big / 8)
            q, k = q * boost, k * boost
        else:
            # b for the queries, a_j for the keys: scale * b * a_j is the planted score;
            # Q's own part along u goes, or a_j (q . u) would move whole rows as far
            b = 1.0 if case.level > 0 or case.logits == "peaked" else -1.0
            q = q - (q @ u)[..., None] * u
            level = abs(case.level)
            a = torch.zeros(Tk)
            if case.logits == "far":
                a[:] = level / abs(scale * b)
            elif case.logits == "peaked" and Tk:
                a[int(torch.randint(0, max(1, Tk // 3), (), generator=gen))] = level / abs(scale)
            elif case.logits == "moving":
                a = torch.linspace(0.0, level / abs(scale), Tk)
            a = a.clamp(max=big / 2)
            q = q + b * u
            k = k + a[:, None] * u
    if case.v_offset:
        spread = 1 + 0.5 * torch.randn(v.shape[-1], generator=gen)
        v = v + case.v_offset * spread
    if case.layout == "transposed":  # stored Dh-major again
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    return q, k, v


#: the largest input `shape_values` plants in a dtype whose range is narrow
_LARGEST = {torch.float16: 3.0e4}


@checked_internal
def _visible(
    q: Float[Tensor, "*batch h Tq Dh"],
    k: Float[Tensor, "*batch g Tk Dh"],
    mask: Bool[Tensor, "*#mbatch #Tq #Tk"] | Float[Tensor, "*#mbatch #Tq #Tk"] | None,
    causal: Alignment | None,
    window: Window | None = None,
) -> Bool[Tensor, "*batch h Tq Tk"]:
    Tq, Tk = q.shape[-2], k.shape[-2]
    shape = (*q.shape[:-1], Tk)
    seen = torch.ones(shape, dtype=torch.bool, device=q.device)
    if mask is not None:
        seen = seen & (mask if mask.dtype == torch.bool else mask > float("-inf"))
    if causal is not None:
        seen = seen & causal_mask(Tq, Tk, causal, device=q.device)
    if window is not None:
        seen = seen & sliding_window_mask(Tq, Tk, window, causal or "bottom_right", q.device)
    return seen


@checked_internal
def _plant(
    case: Case,
    q: Float32[Tensor, "*batch h Tq Dh"],
    k: Float32[Tensor, "*batch g Tk Dh"],
    v: Float32[Tensor, "*batch g Tk Dv"],
    mask: Bool[Tensor, "*#mbatch #Tq #Tk"] | Float32[Tensor, "*#mbatch #Tq #Tk"] | None,
    gen: torch.Generator,
) -> tuple[Float32[Tensor, "*batch g Tk Dh"], Float32[Tensor, "*batch g Tk Dv"]]:
    """Plant ``case.poison`` in K and V at the keys no query of a sample sees."""
    if case.poison not in POISONS:
        raise ValueError(f"case {case.name}: unknown poison {case.poison!r}")
    hidden = ~_visible(q, k, mask, case.causal, case.window).any(dim=-2).any(dim=-2)  # (*batch, Tk)
    hidden = hidden.unsqueeze(-2).unsqueeze(-1)  # (*batch, 1, Tk, 1): hidden from all heads
    k, v = k.contiguous(), v.contiguous()  # a broadcast K/V is written per sample
    if case.poison == "garbage":
        bad_k = 100 * torch.randn(k.shape, generator=gen)
        bad_v = 100 * torch.randn(v.shape, generator=gen)
    else:
        fill = float("nan") if case.poison == "nan" else float("inf")
        bad_k, bad_v = torch.full_like(k, fill), torch.full_like(v, -fill)
    return torch.where(hidden, bad_k, k), torch.where(hidden, bad_v, v)


@checked_internal
def _make_mask(
    case: Case, gen: torch.Generator
) -> Bool[Tensor, "*#mbatch #Tq #Tk"] | Float32[Tensor, "*#mbatch #Tq #Tk"] | None:
    B, Tq, Tk = case.batch, case.Tq, case.Tk
    if case.mask == "none":
        return None
    if case.mask == "bool":
        return torch.rand((*B, 1, Tq, Tk), generator=gen) < 0.7
    if case.mask == "bool_full":
        return torch.rand((*B, case.h, Tq, Tk), generator=gen) < 0.6
    if case.mask in ("empty_rows", "float_empty_rows"):
        mask = torch.rand((*B, 1, Tq, Tk), generator=gen) < 0.6
        mask[..., ::3, :] = False  # every third query sees no key
        if case.mask == "empty_rows":
            return mask
        return torch.randn(mask.shape, generator=gen).masked_fill(~mask, float("-inf"))
    if case.mask == "float":
        offsets = torch.randn((*B, 1, Tq, Tk), generator=gen)
        return offsets.masked_fill(torch.rand(offsets.shape, generator=gen) < 0.3, float("-inf"))
    if case.mask == "columns":
        return (torch.rand((*B, 1, 1, Tk), generator=gen) < 0.6).expand(*B, 1, Tq, Tk)
    if case.mask == "padding":
        lens = torch.randint(1, Tk + 1, B, generator=gen)
        lens.view(-1)[0] = max(1, Tk // 2)  # at least one sample really padded
        return (torch.arange(Tk) < lens.unsqueeze(-1)).reshape(*B, 1, 1, Tk)
    raise ValueError(f"case {case.name}: unknown mask kind {case.mask!r}")


def fixed_grid() -> list[Case]:
    """The fixed grid of the first audit: every semantic switch and layout at least once.

    Lengths are odd or prime (and 127/129 around a power of two) so that tail tiles of
    block-based kernels are exercised; every case has a distinct seed.
    """
    cases = [
        Case("basic"),
        Case("tq_ne_tk", Tq=5, Tk=13),
        Case("decode_tq1", Tq=1, Tk=31),
        Case("single_key", Tq=7, Tk=1),
        Case("dv_ne_dh", Dh=16, Dv=5),
        Case("tail_127", batch=(1,), h=2, g=2, Tq=127, Tk=127, Dh=64, Dv=64),
        Case("tail_129", batch=(1,), h=2, g=2, Tq=129, Tk=129, Dh=64, Dv=64),
        Case("bool_mask", mask="bool"),
        Case("bool_mask_per_head", mask="bool_full", Tq=11, Tk=19),
        Case("float_mask", mask="float", Tq=9, Tk=23),
        Case("padding", mask="padding", batch=(3,), Tk=29),
        Case("empty_rows", mask="empty_rows", Tq=10, Tk=13),
        Case("causal", causal="top_left"),
        Case("causal_tq_lt_tk", causal="top_left", Tq=5, Tk=13),
        Case("causal_tq_gt_tk", causal="top_left", Tq=13, Tk=5),
        Case("causal_bottom_right", causal="bottom_right", Tq=5, Tk=13),
        Case("causal_bottom_right_empty_rows", causal="bottom_right", Tq=13, Tk=5),
        Case("causal_and_padding", causal="top_left", mask="padding", batch=(3,)),
        Case("gqa", h=6, g=2, Tq=11, Tk=13),
        Case("mqa", h=4, g=1, Tq=7, Tk=19),
        Case("gqa_masked", h=6, g=3, mask="bool", Tq=9, Tk=15),
        Case("gqa_decode", h=8, g=2, Tq=1, Tk=37),
        Case("gqa_causal", h=4, g=2, causal="top_left"),
        Case("transposed_query", layout="transposed"),
        Case("sliced_kv", layout="sliced", mask="bool"),
        Case("broadcast_kv", layout="broadcast", batch=(3,)),
        Case("hot", amp=6.0, Dh=32, Dv=32),
        Case("hot_causal", amp=6.0, causal="top_left", Tq=31, Tk=31),
        Case("explicit_scale", scale=0.37),
        Case("no_batch_dims", batch=(), Tq=6, Tk=10),
        Case("two_batch_dims", batch=(2, 3), h=2, g=2, Tq=5, Tk=7),
        Case("nan_in_padding", mask="padding", batch=(3,), poison="nan"),
        Case("float_empty_rows", mask="float_empty_rows", Tq=10, Tk=13),
    ]
    return [replace(c, seed=i) for i, c in enumerate(cases)]


def long_grid() -> list[Case]:
    """Fixed cases at the sizes and values production kernels break on (classes 32 and
    33), run after the search when it found nothing: a causal prefill past 1024 rows
    against more keys, decode against 4097 keys, rows past 2048 against fewer keys,
    decode with GQA groups of 8, a split-KV row
    whose maximum moves, head dims 256, 192/128 and 576/512, a grid of 1028 programs,
    scores far below a finite minus infinity (with a mask and without), hidden keys'
    scores far above the visible ones', a dominant key, a flat row over 4097 keys of a V
    far from zero (its unnormalised sums pass float16's range)."""
    one = (1,)
    cases = [
        Case("long_prefill_causal", batch=one, h=1, g=1, Tq=1025, Tk=2049, Dh=64, Dv=64,
             causal="top_left"),
        Case("long_decode", batch=one, h=2, g=1, Tq=1, Tk=4097, Dh=128, Dv=128),
        Case("rows_past_2048", batch=one, h=1, g=1, Tq=2049, Tk=513, Dh=64, Dv=64,
             causal="top_left"),
        Case("group_8_decode", batch=one, h=16, g=2, Tq=3, Tk=1025, Dh=128, Dv=128),
        Case("split_kv_moving_max", batch=one, h=2, g=2, Tq=3, Tk=4096, Dh=64, Dv=64,
             logits="moving", level=30.0),
        Case("head_dim_256", batch=one, h=2, g=2, Tq=65, Tk=257, Dh=256, Dv=256, mask="bool"),
        Case("dims_192_128", batch=one, h=2, g=2, Tq=33, Tk=513, Dh=192, Dv=128,
             causal="bottom_right"),
        Case("dims_576_512", batch=one, h=2, g=1, Tq=2, Tk=1025, Dh=576, Dv=512),
        Case("grid_1028", batch=(257,), h=4, g=4, Tq=5, Tk=7, Dh=8, Dv=8),
        Case("far_below_masked", batch=one, h=2, g=2, Tq=33, Tk=257, mask="bool", logits="far",
             level=-1e5, v_offset=3.0),
        Case("far_below", batch=one, h=2, g=2, Tq=17, Tk=300, logits="far", level=-6e4),
        Case("hidden_far_above", batch=(3,), h=2, g=2, Tq=9, Tk=129, mask="padding",
             logits="moving", level=1e5),
        Case("dominant_key", batch=one, h=2, g=2, Tq=17, Tk=513, causal="bottom_right",
             logits="peaked", level=40.0, v_offset=-20.0),
        Case("flat_over_4097_keys", batch=one, h=1, g=1, Tq=3, Tk=4097, Dh=64, Dv=64,
             amp=0.25, v_offset=-20.0),
    ]  # fmt: skip
    return [replace(c, seed=200 + i) for i, c in enumerate(cases)]


def variant_grid(caps: Any, *, lse: bool = False) -> list[Case]:
    """Fixed cases for the variants ``caps`` declares (a `Capabilities`): where each
    class-22-25 bug shows, run after the search. ``lse``: the cases for the LSE
    (causal ones, where a later split of the keys is empty for early queries)."""
    cases: list[Case] = []
    if getattr(caps, "window", False):
        cases += [
            Case("window_causal", Tq=13, Tk=13, causal="bottom_right", window=(3, 0)),
            Case("window_decode", batch=(1,), Tq=1, Tk=29, window=(4, 0)),
            Case("window_prefill", Tq=7, Tk=19, window=(2, 3)),
            Case("window_causal_wide", Tq=9, Tk=21, causal="bottom_right", window=(5, -1)),
        ]
    if getattr(caps, "softcap", False):
        cases += [Case("softcap_hot", amp=6.0, Dh=32, Dv=32, softcap=5.0)]
    if getattr(caps, "alibi", False):
        cases += [
            Case("alibi_prefill", Tq=5, Tk=17, alibi="heads"),
            Case("alibi_causal", Tq=11, Tk=11, causal="bottom_right", alibi="batch_heads"),
        ]
    if getattr(caps, "sinks", False):
        cases += [
            Case("sinks", Tq=9, Tk=14, sinks=True),
            Case("sinks_causal", Tq=12, Tk=12, causal="bottom_right", sinks=True),
        ]
        if getattr(caps, "window", False):
            cases += [
                Case("sinks_window_decode", batch=(1,), Tq=2, Tk=24, window=(3, 0), sinks=True)
            ]
    if lse:  # queries with no visible key too: through the diagonal, and a mask
        cases = [
            Case("lse_plain", Tq=9, Tk=14),
            Case("lse_causal", Tq=12, Tk=12, causal="bottom_right"),
            Case("lse_causal_empty_rows", Tq=11, Tk=4, causal="bottom_right"),
            Case("lse_masked_empty_rows", Tq=10, Tk=13, mask="empty_rows"),
            *cases,
        ]
    return [replace(c, seed=100 + i) for i, c in enumerate(cases)]
