"""Audit profiles: how hard Hypothesis searches, and how large the cases it draws may be.

``quick`` audits a correct backend in about two minutes on two CPU cores (README's main
job; it drew only small cases, and took under one, before the long and wide ones);
``ci`` searches about five times harder and draws larger cases (a few minutes);
``thorough`` is for nightly runs and for GPUs, where large index arithmetic is cheap.

Every profile draws three sizes of case (docs/testing.md, "Shapes and values"): small
ones, long ones (keys and queries at each side of the tile and split boundaries where
production kernels change path, up to 4097 keys and 2049 queries at ``quick``) and wide
ones (grids of more than 64, 128 and 1024 batch-heads). A long case is judged on a
sample of its rows (`attnref.conformance.checks.Context.rows`), so its cost to the judge
does not grow with it.
"""

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from attnref.conformance.launch import CALL_BUDGET

if TYPE_CHECKING:
    from attnref.conformance.launch import Launch

__all__ = ["PROFILES", "Profile", "fitted", "get_profile"]

#: head dims production kernels are built for (and small odd ones, where masks of dims
#: and scales go wrong)
_DIMS = (8, 1, 2, 3, 4, 5, 16, 32, 64, 80, 96, 128, 160, 192, 256)
#: ``(Dqk, Dv)`` pairs of real models: DeepSeek's 192/128 prefill and 576/512 MLA decode
_PAIRS = ((192, 128), (576, 512))


def _around(*sizes: int) -> tuple[int, ...]:
    """Each size, one less and one more: both sides of a tile or split boundary."""
    return tuple(n + d for n in sizes for d in (-1, 0, 1))


@dataclass(frozen=True)
class Profile:
    """Search effort and size limits of one audit profile."""

    name: str
    #: random examples Hypothesis draws for each (property, dtype); a property's explicit
    #: examples run after them when they found nothing
    examples: int
    #: longest sequence drawn for ordinary cases (tail lengths may be longer)
    max_len: int
    #: lengths just off common tile sizes, drawn often (class 12)
    tail_lengths: tuple[int, ...]
    #: head dims drawn (those a backend declares), and ``(Dqk, Dv)`` pairs models use
    head_dims: tuple[int, ...]
    dim_pairs: tuple[tuple[int, int], ...]
    #: most KV heads and largest GQA group drawn
    max_kv_heads: int
    #: largest batch dimension drawn
    max_batch: int
    #: a case's score matrix (batch * h * Tq * Tk) is kept under this many elements
    max_scores: int
    #: flattened key rows (batch * g * Tk) in the large-index property (class 21)
    large_rows: int
    #: seconds a property may spend shrinking a failure before it settles for what it has
    shrink_seconds: float
    #: key lengths of the long cases (class 32): each side of tile and split boundaries
    long_keys: tuple[int, ...] = ()
    #: query lengths of the long cases (prefill); decode (1 to 3 queries) is drawn too
    long_queries: tuple[int, ...] = ()
    #: batch * heads of the wide cases: grids past 64, 128 and 1024 programs
    programs: tuple[int, ...] = (65, 129, 1025)
    #: a long or wide case's work, ``batch * h * Tq * Tk * (Dh + Dv)``, stays under this.
    #: The lengths are what a long case tests: at 2**30 its head dims were kept too
    #: (1024 queries of 576/512 in float64), and the kernel's calls took 6 to 8 s of the
    #: quick audit; at 2**28, 4 to 5 s, every planted size-gated kernel still caught
    max_work: int = 2**28
    #: and its score matrix under this many elements (what the judge's masks cost)
    max_long_scores: int = 5 * 2**19
    #: and, with a mask of its own per query and key (every kind but ``columns`` and
    #: ``padding``), its scores under this many: such a mask is made, sent to the
    #: backend and read by the judge in full, whatever the row sample
    max_mask_scores: int = 2**19
    #: and K and V as the query heads read them, ``batch * h * Tk * (Dh + Dv)``: head dim
    #: 256 at 4097 keys, 576/512 at 2049 (at quick)
    max_kv: int = 5 * 2**19
    #: the work of a long case for the gradient property (whose oracle is not sampled:
    #: the float64 backward of the whole case)
    max_grad_work: int = 2**24
    #: the work of a wide case (whose oracle is not sampled: a bug of the grid may be in
    #: one program of 1025), and its scores under a quarter of it. What a wide case tests
    #: is the number of programs, not their size: each is small. At 2**24 the wide
    #: cases, one draw in twelve, cost the quick audit 10 of its 61 s (measured with
    #: only small cases drawn, then small and wide)
    max_wide_work: int = 2**22
    #: ``kvcache_far_pages``: the element offset (a page index times its stride) past
    #: which the pages of its paged cases lie (flashinfer#3130: zeros past 2**32; a
    #: 32-bit signed offset wraps past 2**31). Each such case holds K and V caches of
    #: more than this many elements, and runs only where memory allows it
    far_pages: int = 2**31 + 2**20
    #: an interpreted kernel's seconds a call (`attnref.conformance.launch.Launch.fit`):
    #: each case is cut until its predicted call fits. At 8 s, FlashAttention's Triton
    #: forward's quick audit took 961 s, 58% of it in the 109 cases (of 1,654) past 4 s;
    #: at 1 s a case still reaches every tile boundary (one batch row and KV head: 4
    #: query tiles by 5 key tiles, 0.4 s), its GQA group kept
    call_budget: float = CALL_BUDGET
    #: fitted to a kernel's tiles and cost bound (`fitted`): the properties' fixed
    #: cases past its bound (production sizes: 4097 keys, 1028 programs) are not run
    fitted: bool = False
    #: the kernel's launch cost model, calibrated at the audit's start where it runs
    #: interpreted (`attnref.conformance.launch`): each case is cut to its per-call
    #: budget and waits ten times its prediction or more
    launch: "Launch | None" = None

    def within(self, batch_heads: int, case_work: int) -> bool:
        """Whether a fixed case of ``batch_heads`` programs' worth of batch and heads
        and ``case_work`` fits a fitted profile (any case fits one that is not)."""
        if not self.fitted:
            return True
        return case_work <= self.max_work and batch_heads <= max(self.programs)


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "quick",
            examples=25,
            max_len=40,
            tail_lengths=(31, 33, 63, 65, 127, 129, 255, 257),
            head_dims=_DIMS,
            dim_pairs=_PAIRS,
            long_keys=_around(128, 256, 512, 1024, 2048, 4096),
            long_queries=_around(128, 256, 512, 1024, 2048),
            max_kv_heads=3,
            max_batch=3,
            max_scores=70_000,
            large_rows=70_000,
            shrink_seconds=5.0,
            call_budget=1.0,
        ),
        Profile(
            "ci",
            examples=60,
            max_len=96,
            tail_lengths=(31, 33, 63, 65, 127, 129, 255, 257),
            head_dims=_DIMS,
            dim_pairs=_PAIRS,
            long_keys=_around(128, 256, 512, 1024, 2048, 4096, 8192),
            long_queries=_around(128, 256, 512, 1024, 2048, 4096),
            max_kv_heads=4,
            max_batch=4,
            max_scores=200_000,
            large_rows=140_000,
            shrink_seconds=60.0,
            max_work=2**31,
            max_long_scores=2**23,
            max_mask_scores=2**21,
            max_kv=2**25,
            max_grad_work=2**26,
            max_wide_work=2**24,
        ),
        Profile(
            "thorough",
            examples=400,
            max_len=300,
            tail_lengths=(31, 33, 63, 65, 127, 129, 239, 255, 257, 511, 799, 1023, 1025),
            head_dims=_DIMS,
            dim_pairs=_PAIRS,
            long_keys=_around(128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
            long_queries=_around(128, 256, 512, 1024, 2048, 4096, 8192),
            max_kv_heads=8,
            max_batch=6,
            max_scores=2_000_000,
            large_rows=1_100_000,
            shrink_seconds=300.0,
            max_work=2**33,
            max_long_scores=2**25,
            max_mask_scores=2**23,
            max_kv=2**27,
            max_grad_work=2**28,
            max_wide_work=2**26,
        ),
    )
}


def get_profile(name: str) -> Profile:
    """The profile called ``name``; a clear error for an unknown one."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}: use one of {', '.join(PROFILES)}") from None


def fitted(
    profile: Profile,
    *,
    tile_queries: int = 0,
    tile_keys: int = 0,
    kv_splits: int = 0,
    max_call_work: int = 0,
) -> Profile:
    """``profile`` with its sizes fitted to a kernel's tiles and cost bound
    (`attnref.conformance.declarations.Capabilities.tile_keys` and the rest): what an
    interpreted kernel is audited at, where a production length costs minutes a call.

    The long cases' lengths are one below, at and one above each tile boundary (one,
    two and three query tiles; one to four key tiles) and each split boundary (as many
    keys as splits, where a split may be empty, and one and two key tiles a split), and
    the short lengths drawn often are those around one and two tiles. Every case's work
    (``batch * h * Tq * Tk * (Dh + Dv)``), scores and K/V stay within ``max_call_work``
    (0: the profile's own bound); wide grids stop at 129 batch-heads, small cases at two
    batch rows and two KV heads, and the large-index cases hold ``max_call_work / 1024``
    key rows. A tile not declared is taken as the
    other one, or 16.
    """
    work = min(profile.max_work, max_call_work) if max_call_work else profile.max_work
    bk = tile_keys or tile_queries or 16
    bq = tile_queries or bk
    keys = [bk * m for m in (1, 2, 3, 4)]
    if kv_splits > 1:
        keys += [kv_splits, kv_splits * bk, 2 * kv_splits * bk]
    queries = [bq * m for m in (1, 2, 3)]
    return replace(
        profile,
        tail_lengths=tuple(sorted({n for n in _around(bq, bk, 2 * bk) if n > 0})),
        long_keys=tuple(sorted({n for n in _around(*keys) if n > 0})),
        long_queries=tuple(sorted({n for n in _around(*queries) if n > 0})),
        max_work=work,
        max_scores=min(profile.max_scores, max(256, work // 256)),
        max_long_scores=min(profile.max_long_scores, work // 2),
        max_mask_scores=min(profile.max_mask_scores, work // 2),
        max_kv=min(profile.max_kv, work),
        max_grad_work=min(profile.max_grad_work, work),
        max_wide_work=min(profile.max_wide_work, work),
        large_rows=min(profile.large_rows, max(64, work // 1024)),
        # an interpreted program costs milliseconds: a grid of 1025 batch-heads took
        # seconds a call, and grids that large are a launch's matter, not the logic's
        programs=tuple(n for n in profile.programs if n <= 129) or profile.programs[:1],
        # and the small cases' batch and KV heads: a split-KV decode kernel launches a
        # program a batch row, head and split, and a small case of 9 batch rows and 12
        # heads (1,296 programs) took 36 s a call
        max_batch=min(profile.max_batch, 2),
        max_kv_heads=min(profile.max_kv_heads, 2),
        fitted=True,
    )
