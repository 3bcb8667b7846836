"""Hypothesis strategies that draw audit `Case`s within a profile's limits.

A case is plain data (shapes, flags and a seed for the values), so Hypothesis draws and
shrinks the *structure* of a failing call: the shrunk case is small, simple and printable.
Every choice lists its simplest option first (no mask, not causal, contiguous, amplitude
1), because that is where Hypothesis shrinks to.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal, TypeVar, get_args

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
    "work",
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


def _product(dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


#: a small case's work, ``batch * h * Tq * Tk * (Dh + Dv)``, stays under this many times
#: the profile's ``max_scores``: the most a small case of head dim 128 does. Wider dims
#: (up to 576/512) test the kernel's path for that dim, not a larger problem; at their
#: full scores they were a third of the quick audit's small cases and half their cost
SMALL_WORK_PER_SCORE = 256


def _fits(case: Case, profile: Profile) -> Case:
    """Shrink the batch, then the heads, until the score matrix fits the profile, and a
    case of wide head dims its work (`SMALL_WORK_PER_SCORE`): then its queries, keeping
    its keys, where tiles and splits are (both, in a square case)."""
    max_work = profile.max_scores * SMALL_WORK_PER_SCORE
    while True:
        batch = _product(case.batch)
        scores = batch * case.h * case.Tq * case.Tk
        if scores <= profile.max_scores and work(case) <= max_work:
            return case
        if batch > 1:
            case = replace(case, batch=tuple(1 for _ in case.batch))
        elif case.h > 1:
            case = replace(case, h=case.h // case.g, g=1) if case.g > 1 else replace(case, h=1)
        elif scores <= profile.max_scores and case.Tq == case.Tk > 1:  # stays square
            n = max(1, math.isqrt(max_work // max(1, case.Dh + case.Dv)))
            case = replace(case, Tq=min(n, case.Tq - 1), Tk=min(n, case.Tk - 1))
        elif scores <= profile.max_scores and case.Tq > 1:
            Tq = max(1, max_work // (case.Tk * max(1, case.Dh + case.Dv)))
            case = replace(case, Tq=min(Tq, case.Tq - 1))
        elif scores <= profile.max_scores:
            return replace(case, Tk=max(1, max_work // max(1, case.Dh + case.Dv)))
        else:
            return replace(case, Tq=min(case.Tq, 64), Tk=min(case.Tk, 64))


def work(case: Case) -> int:
    """What one call of ``case`` costs a kernel: ``batch * h * Tq * Tk * (Dh + Dv)``."""
    return _product(case.batch) * case.h * case.Tq * case.Tk * max(1, case.Dh + case.Dv)


def _fits_work(
    case: Case,
    max_work: int,
    max_scores: int,
    max_kv: int,
    wide: bool = False,
    keep_queries: bool = False,
) -> Case:
    """A long or wide case within ``max_work``, ``max_scores`` and ``max_kv`` (K and V
    as every query head reads them, ``batch * h * Tk * (Dh + Dv)``: what a decode step
    costs): a long case keeps its lengths as long as it can (one sample, one head),
    then has fewer queries (a long prefill becomes a shorter one, then decode), then
    fewer keys, each roughly halved, so that it stays near a boundary; with
    ``keep_queries``, fewer keys first (rows past the last row tile, against a shorter
    context). A ``wide`` case keeps its programs: its lengths and dims are cut first."""

    def sizes(c: Case) -> tuple[bool, bool]:
        batch = _product(c.batch)
        kv = batch * c.h * c.Tk * (c.Dh + c.Dv)
        return work(c) > max_work or batch * c.h * c.Tq * c.Tk > max_scores, kv > max_kv

    while any(too_big := sizes(case)):
        small = replace(
            case, Tq=min(case.Tq, 16), Tk=min(case.Tk, 16), Dh=min(case.Dh, 64), Dv=min(case.Dv, 64)
        )
        if wide and small != case:  # keep the programs
            case = small
        elif not wide and _product(case.batch) > 1:  # keep the lengths
            case = replace(case, batch=tuple((b + 1) // 2 for b in case.batch))
        elif not wide and case.h > 1:
            case = replace(case, h=case.h // case.g, g=1) if case.g > 1 else replace(case, h=1)
        elif too_big[0] and keep_queries and case.Tk > 3:
            case = replace(case, Tk=(case.Tk + 1) // 2)
        elif too_big[0] and case.Tq > 3:
            case = replace(case, Tq=(case.Tq + 1) // 2)
        elif _product(case.batch) > 1:
            case = replace(case, batch=tuple((b + 1) // 2 for b in case.batch))
        elif case.h > 1:
            case = replace(case, h=case.h // case.g, g=1) if case.g > 1 else replace(case, h=1)
        elif case.Tk > 1:
            case = replace(case, Tk=(case.Tk + 1) // 2)
        else:
            return case
    return case


#: how large a drawn case is: small (most), long (lengths past tile and split
#: boundaries), wide (grids past 64, 128 and 1024 batch-heads); small first, where
#: Hypothesis shrinks to
Size = Literal["small", "long", "wide"]
_SIZES: tuple[Size, ...] = ("small",) * 9 + ("long",) * 2 + ("wide",)


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
    name: str,
    profile: Profile,
    caps: Capabilities,
    *,
    max_work: int | None = None,
    sizes: Sequence[Size] = _SIZES,
    **fields: Any,
) -> st.SearchStrategy[Case]:
    """Cases named ``name``; each field of `Case` may be pinned by a value or a strategy.

    Unpinned fields are drawn over the whole space the profile allows: small, long and
    wide cases (``sizes``; long and wide ones within ``max_work``, default the
    profile's), zero to two batch dimensions, GQA groups (when declared), every mask
    kind the backend accepts, both causal alignments (those declared, for a backend
    that takes no mask), every layout, hot inputs, explicit scales, the values of class
    33 (``logits``, ``v_offset``); head dims (and ``(Dqk, Dv)`` pairs) within the
    declared limit. ``variants`` (a dict of variant fields, or a strategy of one:
    `variant_fields`) is off unless pinned. The strategies are built once, here, and
    drawn from in each case.
    """
    unknown = set(fields) - set(Case.__dataclass_fields__) - {"variants", "group"}
    if unknown:
        raise TypeError(f"case_strategy got unknown fields: {', '.join(sorted(unknown))}")
    budget = profile.max_work if max_work is None else max_work

    def pinned(field: str, default: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        value = fields.get(field, default)
        return value if isinstance(value, st.SearchStrategy) else st.just(value)

    # a backend that takes no mask can only be given the alignments it declares
    alignments: tuple[str | None, ...] = (None, "top_left", "bottom_right")
    if not caps.bool_mask:
        alignments = (None, *caps.causal_alignments)
    limit = caps.max_head_dim
    dim_list = [d for d in profile.head_dims if limit is None or d <= limit]
    pairs = [
        p
        for p in profile.dim_pairs
        if caps.distinct_value_dim and (limit is None or max(p) <= limit)
    ]
    dims = st.sampled_from(dim_list)
    same = dims.map(lambda d: (d, d))
    dh_dv = st.one_of(
        same, same, same, same, st.tuples(dims, dims), *([st.sampled_from(pairs)] if pairs else [])
    )
    small_batch = st.one_of(
        st.tuples(st.integers(1, profile.max_batch)),
        st.just(()),
        st.tuples(st.integers(1, profile.max_batch), st.integers(1, 3)),
    )
    strategies: dict[str, st.SearchStrategy[Any]] = {
        "size": st.sampled_from(tuple(sizes)),
        "batch": pinned("batch", small_batch),
        "g": pinned("g", st.integers(1, profile.max_kv_heads)),
        "group": pinned("group", st.one_of(st.just(1), GROUPS) if caps.gqa else st.just(1)),
        "Tq": pinned("Tq", lengths(profile)),
        "Tk": pinned("Tk", lengths(profile)),
        # the longest lengths weighted up: Hypothesis leans to a list's first entries
        "long_Tq": pinned(
            "Tq", st.one_of(st.sampled_from((1, 2, 3)), *_longest(profile.long_queries))
        ),
        "long_Tk": pinned("Tk", st.one_of(*_longest(profile.long_keys or profile.tail_lengths))),
        "square": st.sampled_from((True, False)),
        "keep_queries": st.sampled_from((False, False, False, True)),
        "last_Tq": pinned("Tq", st.sampled_from(profile.long_queries[-3:] or (1,))),
        "programs": st.sampled_from(profile.programs),
        "dims": dh_dv,
        **{f: pinned(f, st.nothing()) for f in ("Dh", "Dv") if f in fields},
        # no mask twice as often: it is the case where kernels take their fast paths
        "mask": pinned("mask", st.sampled_from(("none", *masks_for(caps)))),
        "causal": pinned("causal", st.sampled_from(alignments)),
        "layout": pinned("layout", st.sampled_from(("contiguous", *LAYOUTS))),
        "amp": pinned("amp", st.sampled_from((1.0, 0.25, 2.0, 4.0, 8.0))),
        "scale": pinned("scale", st.sampled_from((None, None, 0.37, 1.0, 2.5))),
        "poison": pinned("poison", st.just("none")),
        "seed": pinned("seed", st.integers(0, 2**16)),
        "variants": pinned("variants", st.just({})),
        "values": st.tuples(pinned("logits", _LOGITS), pinned("v_offset", _V_OFFSETS)),
    }
    # drawn by one composite made at import: Hypothesis reads a composite's source each
    # time one is made, which cost 7 ms a property
    return _draw_case(name, profile, caps, budget, fields, strategies)


@st.composite
def _draw_case(
    draw: st.DrawFn,
    name: str,
    profile: Profile,
    caps: Capabilities,
    budget: int,
    fields: dict[str, Any],
    strategies: dict[str, st.SearchStrategy[Any]],
) -> Case:
    """One case of `case_strategy` (its arguments, its strategies built there)."""
    level = fields.get("level")
    kind: Size = draw(strategies["size"])
    skip = _NOT_DRAWN[kind]
    got = {n: draw(strategy) for n, strategy in strategies.items() if n not in skip}
    batch: tuple[int, ...] = tuple(got["batch"])
    g, group = got["g"], got["group"]
    keep_queries = kind == "long" and got["keep_queries"] and "Tk" not in fields
    if kind == "long":
        Tq, Tk = got["long_Tq"], got["long_Tk"]
        if keep_queries:  # rows past the last row tile, where no square case fits
            Tq = got["last_Tq"]
        elif got["square"] and Tq > 3 and "Tk" not in fields:
            Tk = Tq  # a long prefill: self-attention, where causal kernels split rows
        if "batch" not in fields:
            batch = (1,) if batch else ()
        if "g" not in fields:
            g = min(g, 2)
    else:
        Tq, Tk = got["Tq"], got["Tk"]
    if kind == "wide":
        programs = got["programs"]
        if "batch" not in fields:
            batch = (-(-programs // (g * group)),)
        elif "g" not in fields:
            g = max(1, -(-programs // (_product(batch) * group)))
    Dh, Dv = got["dims"]
    if "Dh" in got:  # pinned: Dv is Dh, or the other dim drawn
        Dv = got["Dh"] if Dh == Dv else Dv
        Dh = got["Dh"]
    Dv = got.get("Dv", Dv)
    if not caps.distinct_value_dim:
        Dv = Dh
    layout, poison = got["layout"], got["poison"]
    if poison != "none" and layout.startswith("broadcast"):
        layout = "contiguous"
    logits, v_offset = got["values"]
    value_level = level if level is not None else _LEVELS[logits]
    if isinstance(value_level, st.SearchStrategy):
        value_level = draw(value_level)
    case = Case(
        name,
        batch=batch,
        h=g * group,
        g=g,
        Tq=Tq,
        Tk=Tk,
        Dh=Dh,
        Dv=Dv,
        mask=got["mask"],
        causal=got["causal"],
        layout=layout,
        amp=got["amp"],
        scale=got["scale"],
        poison=poison,
        seed=got["seed"],
        logits=logits,
        level=value_level if logits != "randn" else 0.0,
        v_offset=v_offset,
        **got["variants"],
    )
    if kind == "small":
        return _fits(case, profile)
    if kind == "wide":  # the grid is what matters: its programs stay small
        narrow = min(budget, profile.max_wide_work)
        return _fits_work(case, narrow, narrow // 4, profile.max_kv, wide=True)
    scores = profile.max_long_scores
    if case.mask not in _NARROW_MASKS:
        scores = min(scores, profile.max_mask_scores)
    return _fits_work(case, budget, scores, profile.max_kv, keep_queries=keep_queries)


#: mask kinds made of a row or a column, broadcast (cheap at any length)
_NARROW_MASKS = ("none", "columns", "padding")


def _longest(lengths: tuple[int, ...]) -> tuple[st.SearchStrategy[int], ...]:
    """Every length, and (three times as often) the longest six: past the last split
    and tile boundaries, where the bugs of class 32 live."""
    top = st.sampled_from(lengths[-6:])
    return (st.sampled_from(lengths), top, top, top)


#: GQA groups (query heads per KV head): the small ones, and the sizes past them that
#: kernels dispatch on (FlashInfer's decode templates take 1, 2, 3, 4 and 8 and later
#: 6; Qwen2-7B's group is 7, Llama-3.1-405B's 16), drawn a third of the time
_SMALL_GROUPS = st.sampled_from((2, 3, 4))
GROUPS = st.one_of(_SMALL_GROUPS, _SMALL_GROUPS, st.sampled_from((5, 6, 7, 8, 16)))

#: the strategies a case of each size does not draw from
_NOT_DRAWN: dict[str, frozenset[str]] = {
    "small": frozenset(
        {"size", "long_Tq", "long_Tk", "square", "keep_queries", "last_Tq", "programs"}
    ),
    "long": frozenset({"size", "Tq", "Tk", "programs"}),
    "wide": frozenset({"size", "long_Tq", "long_Tk", "square", "keep_queries", "last_Tq"}),
}
#: the values of class 33, ``randn`` first (where Hypothesis shrinks to)
_LOGITS = st.sampled_from(("randn",) * 6 + ("far", "peaked", "moving", "outliers"))
#: the size of each (`Case.level`): scores far past a finite minus infinity (-5e4,
#: -1e4) on either side, a dominant key, a ramp along the keys (past a finite fill
#: added to hidden keys' scores, at 2e4 and 1e5), outlier channels
_LEVELS: dict[str, st.SearchStrategy[float] | float] = {
    "randn": 0.0,
    "far": st.sampled_from((-1e5, -6e4, -2e4, -1e3, 1e3, 3e4, 1e5)),
    "peaked": st.sampled_from((12.0, 40.0)),
    "moving": st.sampled_from((30.0, -30.0, 200.0, 2e4, 1e5)),
    "outliers": st.sampled_from((8.0, 30.0)),
}
#: V's mean: zero (randn), or far enough that an output near zero is wrong
_V_OFFSETS = st.sampled_from((0.0, 0.0, 0.0, 3.0, -20.0))


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
    return case_strategy(name, profile, caps, sizes=("small",), **pins)


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
    profile's longest (and, one case in six, a first row against a long cache: the
    profile's long key lengths), 0 to 4 new tokens, the cache full or with room to
    spare, contiguous or paged (shuffled or in order), rotary in both layouts, split-KV."""

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
        if "cached" not in fields and profile.long_keys and draw(st.integers(0, 5)) == 5:
            # one in six: the first row decodes against a long cache (class 32), each
            # side of a split or tile boundary, its K and V (as the query heads read
            # them) within max_kv; 0 shrinks to a short cache
            long = draw(st.one_of(*_longest(profile.long_keys)))
            rest = sum(cached[1:]) + new * rows
            while long > 1 and (long + rest) * case.h * (case.Dh + case.Dv) > profile.max_kv:
                long = (long + 1) // 2
            cached = (long, *cached[1:])
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


def inside(
    case: Case,
    caps: Capabilities,
    pick: Callable[[Sequence[Any]], Any] = _first,
    chunks: int = 1,
) -> Case:
    """``case`` moved inside what a narrow backend declares (`Capabilities.narrow`):
    self-attention (``Tq = Tk``: the keys' length is kept), no more queries than keys,
    causal at a declared alignment (and no mask, where it cannot take both), the
    default scale, a window and sinks where every call must have them, one shared or
    declared sink, a length that cuts into ``chunks`` equal chunks where only such are
    taken (`Capabilities.cp_equal_shards`: ``2W`` for ``W`` ranks). ``pick`` chooses
    among options (a draw; default: the first)."""
    uncut = case.Tk % chunks if chunks > 1 and not case.seqlens and not case.cached else 0
    if caps.cp_equal_shards and uncut:
        T = max(chunks, case.Tk - uncut)
        case = replace(case, Tq=T if case.Tq == case.Tk else min(case.Tq, T), Tk=T)
    if caps.self_attention_only:
        if case.seqlens:
            case = replace(case, seqlens=tuple((tk, tk) for _, tk in case.seqlens))
        elif not case.cached and case.Tq != case.Tk:
            case = replace(case, Tq=case.Tk)
    if caps.queries_at_most_keys:
        if case.seqlens:
            case = replace(case, seqlens=tuple((min(tq, tk), tk) for tq, tk in case.seqlens))
        elif case.cached:  # each row's: its cached keys and the new ones, per row
            short = max(0, case.Tq - case.new)
            case = replace(case, cached=tuple(max(c, short) for c in case.cached))
        elif case.Tq > case.Tk:
            case = replace(case, Tq=case.Tk)
    if caps.causal_only and case.causal not in caps.causal_alignments:
        case = replace(case, causal=pick(caps.causal_alignments))
    takes_masks = caps.causal_with_mask and (caps.bool_mask or caps.float_mask)
    if caps.causal_only and not takes_masks and case.mask != "none":
        case = replace(case, mask="none", poison="none")
    if not caps.explicit_scale and case.scale is not None:
        case = replace(case, scale=None)
    if caps.window_required and case.window is None:
        case = replace(case, window=pick(_REQUIRED_WINDOWS))
    if caps.causal_windows_only and case.window is not None and case.window[1] != 0:
        case = replace(case, window=(case.window[0], 0))
    if caps.sinks_required and not case.sinks:
        case = replace(case, sinks=True)
    top = caps.max_head_dim
    if top is not None and max(case.Dh, case.Dv) > top:  # an explicit production size
        Dh, Dv = min(case.Dh, top), min(case.Dv, top)
        case = replace(case, Dh=Dh, Dv=Dv, rotary=min(case.rotary, Dh - Dh % 2))
    if not caps.distinct_value_dim and case.Dv != case.Dh and not case.latent:
        case = replace(case, Dv=case.Dh)
    m = caps.head_dim_multiple
    if m > 1 and (case.Dh % m or case.Dv % m):
        Dh, Dv = (-(-d // m) * m for d in (case.Dh, case.Dv))
        if caps.max_head_dim is not None:
            top = caps.max_head_dim // m * m
            Dh, Dv = min(Dh, top), min(Dv, top)
        case = replace(case, Dh=Dh, Dv=Dv, rotary=min(case.rotary, Dh - Dh % 2))
    if caps.single_query:
        if case.cached:
            case = replace(case, Tq=1, new=min(case.new, 1))
        elif case.seqlens:
            case = replace(case, seqlens=tuple((min(tq, 1), tk) for tq, tk in case.seqlens))
        else:
            case = replace(case, Tq=min(case.Tq, 1))
    if not caps.empty_sequences:
        if case.cached and not case.new:
            case = replace(case, cached=tuple(max(c, 1) for c in case.cached))
        elif case.seqlens:
            case = replace(case, seqlens=tuple((tq, max(tk, 1)) for tq, tk in case.seqlens))
        elif not case.cached:
            case = replace(case, Tk=max(case.Tk, 1))
    mq, mk = caps.length_multiples
    if (mq, mk) != (1, 1) and not case.seqlens and not case.cached:
        Tq, Tk = (-(-t // b) * b for t, b in ((case.Tq, mq), (case.Tk, mk)))
        case = replace(case, Tq=Tq, Tk=Tk)
    if caps.head_dims and case.Dh not in caps.head_dims:
        Dh = pick(caps.head_dims)
        case = replace(case, Dh=Dh, rotary=min(case.rotary, Dh - Dh % 2))
    if caps.head_dims and case.Dv not in caps.head_dims:
        case = replace(case, Dv=case.Dh if not caps.distinct_value_dim else pick(caps.head_dims))
    if caps.latent_values:
        case = _latent(case, caps)
    if case.sinks and (caps.sink_values or caps.sink_shared):
        case = replace(case, sink=pick(caps.sink_values or _SHARED_SINKS))
    return case


def _latent(case: Case, caps: Capabilities) -> Case:
    """``case`` as multi-head latent attention takes it (`Capabilities.latent_values`):
    one key/value head, V the keys' leading ``Dv`` dims (``Dv <= Dqk``; with declared
    head dims, the keys take the largest and the values the next below it)."""
    Dh, Dv = max(case.Dh, case.Dv), min(case.Dh, case.Dv)
    if caps.head_dims:
        Dh = max(caps.head_dims)
        Dv = max((d for d in caps.head_dims if d < Dh), default=Dh)
    if not caps.distinct_value_dim:
        Dv = Dh
    return replace(
        case, g=1, Dh=Dh, Dv=Dv, latent=True, rotary=min(case.rotary, Dh - Dh % 2), v_offset=0.0
    )


def narrowed(
    cases: st.SearchStrategy[Case], caps: Capabilities, profile: Profile, chunks: int = 1
) -> st.SearchStrategy[Case]:
    """A property's cases drawn inside a narrow declaration (`inside`), still within the
    profile's size; a declaration that is not narrow gets ``cases`` as they are, so that
    it is audited on the same cases as ever."""
    if not caps.narrow():
        return cases

    @st.composite
    def draw(draw: st.DrawFn) -> Case:
        case = draw(cases)
        moved = inside(case, caps, lambda options: draw(st.sampled_from(options)), chunks)
        if moved == case:
            return case
        # fitted to the profile, a length may need its equal chunks again
        return inside(_fits(moved, profile), caps, chunks=chunks)

    return draw()
