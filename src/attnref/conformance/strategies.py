"""Hypothesis strategies that draw audit `Case`s within a profile's limits.

A case is plain data (shapes, flags and a seed for the values), so Hypothesis draws and
shrinks the *structure* of a failing call: the shrunk case is small, simple and printable.
Every choice lists its simplest option first (no mask, not causal, contiguous, amplitude
1), because that is where Hypothesis shrinks to.
"""

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar, get_args

from hypothesis import strategies as st

from attnref.conformance.cases import Case, Layout, MaskKind
from attnref.conformance.declarations import Capabilities
from attnref.conformance.profiles import Profile

__all__ = [
    "FLOAT_MASKS",
    "LAYOUTS",
    "MASKS",
    "cache_strategy",
    "case_strategy",
    "inside",
    "lengths",
    "masks_for",
    "narrowed",
    "pack_strategy",
    "variant_fields",
    "windows",
]

#: every mask kind `build` knows, simplest first
MASKS: tuple[MaskKind, ...] = get_args(MaskKind)
#: the mask kinds `build` makes as float masks (the others are boolean)
FLOAT_MASKS: tuple[MaskKind, ...] = ("float", "float_empty_rows")
#: non-contiguous layouts `build` knows (class 6 and 7)
LAYOUTS: tuple[Layout, ...] = get_args(Layout)[1:]
#: small primes and odd lengths: none is a multiple of a common tile size
_ODD = (1, 2, 3, 5, 7, 11, 13, 17, 23, 31)


def lengths(profile: Profile) -> st.SearchStrategy[int]:
    """Sequence lengths: small odd and prime ones, any length up to the profile's limit,
    and lengths just off a power of two (class 12)."""
    return st.one_of(
        st.sampled_from(_ODD),
        st.integers(1, profile.max_len),
        st.sampled_from(profile.tail_lengths),
    )


def _head_dims() -> st.SearchStrategy[int]:
    return st.sampled_from((8, 1, 2, 3, 4, 5, 16, 32, 64, 80, 128))


def _fits(case: Case, profile: Profile) -> Case:
    """Shrink the batch, then the heads, until the score matrix fits the profile."""
    while True:
        batch = 1
        for b in case.batch:
            batch *= b
        if batch * case.h * case.Tq * case.Tk <= profile.max_scores:
            return case
        if batch > 1:
            case = replace(case, batch=tuple(1 for _ in case.batch))
        elif case.h > 1:
            case = replace(case, h=case.h // case.g, g=1) if case.g > 1 else replace(case, h=1)
        else:
            return replace(case, Tq=min(case.Tq, 64), Tk=min(case.Tk, 64))


def windows() -> st.SearchStrategy[tuple[int, int]]:
    """Sliding windows ``(left, right)``: small sides (where off-by-one bugs show),
    unbounded ones (``-1``), and the causal window ``(w, 0)``."""
    side = st.sampled_from((0, 1, 2, 3, 5, 8, 13, -1))
    return st.one_of(st.tuples(side, st.just(0)), st.tuples(side, side))


def variant_fields(
    caps: Capabilities, *, positional: bool = True, only: str | None = None
) -> st.SearchStrategy[dict[str, Any]]:
    """Values for `Case`'s variant fields among those ``caps`` declare: each on or off,
    several at once unless the backend declares they may not be combined, at least one
    on. ``positional=False`` leaves out the window and ALiBi; ``only`` pins one on."""
    choices: dict[str, st.SearchStrategy[Any]] = {}
    if caps.window and positional:
        choices["window"] = windows()
    if caps.softcap:
        choices["softcap"] = st.sampled_from((1.0, 0.5, 5.0, 30.0))
    if caps.alibi and positional:
        choices["alibi"] = st.sampled_from(("heads", "batch_heads"))
    if caps.sinks:
        choices["sinks"] = st.just(True)
    off = {"window": None, "softcap": 0.0, "alibi": "none", "sinks": False}

    @st.composite
    def draw(draw: st.DrawFn) -> dict[str, Any]:
        names = sorted(choices)
        if only is not None:
            picked = [only]
        elif caps.combined_variants and names:
            picked = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
        else:
            picked = [draw(st.sampled_from(names))] if names else []
        return {n: (draw(choices[n]) if n in picked else off[n]) for n in off}

    return draw()


def masks_for(caps: Capabilities, kinds: tuple[str, ...] = MASKS) -> tuple[str, ...]:
    """The mask kinds of ``kinds`` that a backend with ``caps`` accepts."""
    ok = []
    for kind in kinds:
        if kind in FLOAT_MASKS and not caps.float_mask:
            continue
        if kind not in ("none", *FLOAT_MASKS) and not caps.bool_mask:
            continue
        ok.append(kind)
    return tuple(ok) or ("none",)


def case_strategy(
    name: str, profile: Profile, caps: Capabilities, **fields: Any
) -> st.SearchStrategy[Case]:
    """Cases named ``name``; each field of `Case` may be pinned by a value or a strategy.

    Unpinned fields are drawn over the whole space the profile allows: zero to two batch
    dimensions, GQA groups (when declared), every mask kind the backend accepts, both
    causal alignments (those declared, for a backend that takes no mask), every layout,
    hot inputs and explicit scales; head dims within the declared limit. ``variants``
    (a dict of variant fields, or a strategy of one: `variant_fields`) is off unless
    pinned.
    """

    def pick(draw: st.DrawFn, field: str, default: st.SearchStrategy[Any]) -> Any:
        value = fields.get(field, default)
        return draw(value) if isinstance(value, st.SearchStrategy) else value

    # a backend that takes no mask can only be given the alignments it declares
    alignments: tuple[str | None, ...] = (None, "top_left", "bottom_right")
    if not caps.bool_mask:
        alignments = (None, *caps.causal_alignments)

    @st.composite
    def draw_case(draw: st.DrawFn) -> Case:
        batch = pick(
            draw,
            "batch",
            st.one_of(
                st.tuples(st.integers(1, profile.max_batch)),
                st.just(()),
                st.tuples(st.integers(1, profile.max_batch), st.integers(1, 3)),
            ),
        )
        g = pick(draw, "g", st.integers(1, profile.max_kv_heads))
        group = pick(draw, "group", st.sampled_from((1, 2, 3, 4)) if caps.gqa else st.just(1))
        Tq = pick(draw, "Tq", lengths(profile))
        Tk = pick(draw, "Tk", lengths(profile))
        dims = _head_dims()
        limit = caps.max_head_dim
        if limit is not None:
            dims = dims.filter(lambda d: bool(d <= limit))
        Dh = pick(draw, "Dh", dims)
        Dv = pick(draw, "Dv", st.one_of(st.just(Dh), dims))
        if not caps.distinct_value_dim:
            Dv = Dh
        # no mask twice as often: it is the case where kernels take their fast paths
        mask = pick(draw, "mask", st.sampled_from(("none", *masks_for(caps))))
        causal = pick(draw, "causal", st.sampled_from(alignments))
        layout = pick(draw, "layout", st.sampled_from(("contiguous", *LAYOUTS)))
        amp = pick(draw, "amp", st.sampled_from((1.0, 0.25, 2.0, 4.0, 8.0)))
        scale = pick(draw, "scale", st.sampled_from((None, None, 0.37, 1.0, 2.5)))
        poison = pick(draw, "poison", st.just("none"))
        if poison != "none" and layout.startswith("broadcast"):
            layout = "contiguous"
        seed = pick(draw, "seed", st.integers(0, 2**16))
        variants = pick(draw, "variants", st.just({}))
        case = Case(
            name,
            batch=tuple(batch),
            h=g * group,
            g=g,
            Tq=Tq,
            Tk=Tk,
            Dh=Dh,
            Dv=Dv,
            mask=mask,
            causal=causal,
            layout=layout,
            amp=amp,
            scale=scale,
            poison=poison,
            seed=seed,
            **variants,
        )
        return _fits(case, profile)

    return draw_case()


# ------------------------------------------------------------- packs and caches

#: pack lengths: empty and one-token sequences, small primes (class 26)
_PACK_LENGTHS = (0, 1, 2, 3, 5, 7, 13)


def _pack_lengths(profile: Profile) -> st.SearchStrategy[tuple[tuple[int, int], ...]]:
    """``(Tq, Tk)`` of 1 to 6 sequences: zeros, ones and primes, equal lengths (self
    attention) or not, sometimes one long sequence among short ones."""
    short = st.sampled_from(_PACK_LENGTHS)
    long = st.sampled_from((profile.max_len, 31, 33, profile.tail_lengths[1]))
    one = st.one_of(short.map(lambda n: (n, n)), st.tuples(short, short))

    @st.composite
    def draw(draw: st.DrawFn) -> tuple[tuple[int, int], ...]:
        seqs = draw(st.lists(one, min_size=1, max_size=6))
        if draw(st.booleans()):
            n = draw(long)
            at = draw(st.integers(0, len(seqs)))
            seqs.insert(at, (n, n) if draw(st.booleans()) else (draw(short), n))
        return tuple(seqs)

    return draw()


def _serving_base(
    name: str, profile: Profile, caps: Capabilities, fields: dict[str, Any]
) -> st.SearchStrategy[Case]:
    """The dense fields of a pack or cache case: heads, dims, scale, amplitude, seed,
    causal (none or bottom-right) and the declared variants (off by default)."""
    pins = {
        "batch": (),
        "mask": "none",
        "layout": "contiguous",
        "causal": st.sampled_from((None, "bottom_right")),
        "Tq": 1,
        "Tk": 1,
        **{k: v for k, v in fields.items() if k in Case.__dataclass_fields__ or k == "variants"},
    }
    return case_strategy(name, profile, caps, **pins)


def pack_strategy(
    name: str, profile: Profile, caps: Capabilities, **fields: Any
) -> st.SearchStrategy[Case]:
    """Pack cases (`Case.seqlens`), fields pinned as in `case_strategy`."""

    @st.composite
    def draw(draw: st.DrawFn) -> Case:
        case = draw(_serving_base(name, profile, caps, fields))
        seqlens = draw(fields.get("seqlens", _pack_lengths(profile)))
        pad = draw(fields.get("pad", st.sampled_from((0, 1, 3))))
        return replace(case, seqlens=seqlens, pad=pad)

    return draw()


def _page_sizes(caps: Capabilities) -> st.SearchStrategy[int]:
    """0 (contiguous) or the page sizes a backend declares."""
    if not caps.paged:
        return st.just(0)
    m = caps.page_multiple
    pages = (m, 2 * m) if m > 1 else (4, 1, 5, 16)
    return st.one_of(st.just(0), st.sampled_from(pages))


def cache_strategy(
    name: str, profile: Profile, caps: Capabilities, **fields: Any
) -> st.SearchStrategy[Case]:
    """Decode cases (`Case.cached`): 1 to 3 rows with cached lengths from empty to the
    profile's longest, 0 to 4 new tokens, the cache full or with room to spare,
    contiguous or paged (shuffled or in order), rotary in both layouts, split-KV."""

    @st.composite
    def draw(draw: st.DrawFn) -> Case:
        case = draw(_serving_base(name, profile, caps, fields))

        def pick(field: str, default: st.SearchStrategy[Any]) -> Any:
            value = fields.get(field, default)
            return draw(value) if isinstance(value, st.SearchStrategy) else value

        rows = pick("rows", st.integers(1, 3))
        cached_len = st.one_of(st.sampled_from((0, 1, 3, 7, 16)), st.integers(0, profile.max_len))
        cached = pick("cached", st.tuples(*(cached_len,) * rows))
        new = pick("new", st.sampled_from((0, 1, 2, 4)))
        Tq = pick("Tq", st.just(new) if new else st.sampled_from((1, 2, 3)))
        even = case.Dh - case.Dh % 2
        rotary = 0
        if caps.rotary and even:
            rotary = pick(
                "rotary", st.sampled_from(sorted({0, even, max(2, even // 2 - even // 2 % 2), 2}))
            )
            rotary = min(rotary, even)
        return replace(
            case,
            Tq=max(Tq, 1),
            cached=tuple(cached),
            new=new,
            page=pick("page", _page_sizes(caps)),
            pad=pick("pad", st.sampled_from((0, 1, 5))),
            rotary=rotary,
            interleaved=pick("interleaved", st.booleans()),
            splits=pick("splits", st.sampled_from((0, 1, 2, 3))),
            shuffle=pick("shuffle", st.booleans()),
        )

    return draw()


# ------------------------------------------------------------ narrow declarations

#: sink logits drawn for a backend that shares one sink across heads (any value)
_SHARED_SINKS = (0.0, -1.0, 1.5, 3.0)
#: windows given to a case without one for a backend that needs one on every call
_REQUIRED_WINDOWS = ((3, 0), (1, 1), (5, 2), (2, 0), (8, 3), (13, 0))
_T = TypeVar("_T")


def _first(options: Sequence[_T]) -> _T:
    return options[0]


def inside(case: Case, caps: Capabilities, pick: Callable[[Sequence[Any]], Any] = _first) -> Case:
    """``case`` moved inside what a narrow backend declares (`Capabilities.narrow`):
    self-attention (``Tq = Tk``: the keys' length is kept), causal at a declared
    alignment (and no mask, where it cannot take both), the default scale, one shared or
    declared sink. ``pick`` chooses among options (a draw; default: the first)."""
    if caps.self_attention_only:
        if case.seqlens:
            case = replace(case, seqlens=tuple((tk, tk) for _, tk in case.seqlens))
        elif not case.cached and case.Tq != case.Tk:
            case = replace(case, Tq=case.Tk)
    if caps.causal_only and case.causal not in caps.causal_alignments:
        case = replace(case, causal=pick(caps.causal_alignments))
    if caps.causal_only and not caps.causal_with_mask and case.mask != "none":
        case = replace(case, mask="none", poison="none")
    if not caps.explicit_scale and case.scale is not None:
        case = replace(case, scale=None)
    if caps.window_required and case.window is None:
        case = replace(case, window=pick(_REQUIRED_WINDOWS))
    if caps.head_dims and case.Dh not in caps.head_dims:
        Dh = pick(caps.head_dims)
        case = replace(case, Dh=Dh, rotary=min(case.rotary, Dh - Dh % 2))
    if caps.head_dims and case.Dv not in caps.head_dims:
        case = replace(case, Dv=case.Dh if not caps.distinct_value_dim else pick(caps.head_dims))
    if case.sinks and (caps.sink_values or caps.sink_shared):
        case = replace(case, sink=pick(caps.sink_values or _SHARED_SINKS))
    return case


def narrowed(
    cases: st.SearchStrategy[Case], caps: Capabilities, profile: Profile
) -> st.SearchStrategy[Case]:
    """A property's cases drawn inside a narrow declaration (`inside`), still within the
    profile's size; a declaration that is not narrow gets ``cases`` as they are, so that
    it is audited on the same cases as ever."""
    if not caps.narrow():
        return cases

    @st.composite
    def draw(draw: st.DrawFn) -> Case:
        case = draw(cases)
        moved = inside(case, caps, lambda options: draw(st.sampled_from(options)))
        return moved if moved == case else _fits(moved, profile)

    return draw()
