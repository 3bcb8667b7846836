"""Audit profiles: how hard Hypothesis searches, and how large the cases it draws may be.

``quick`` audits a correct backend in well under a minute on two CPU cores (README's main
job); ``ci`` searches about five times harder and draws larger cases (a few minutes);
``thorough`` is for nightly runs and for GPUs, where large index arithmetic is cheap.
"""

from dataclasses import dataclass

__all__ = ["PROFILES", "Profile", "get_profile"]


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


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "quick",
            examples=25,
            max_len=40,
            tail_lengths=(31, 33, 63, 65, 127, 129, 255, 257),
            max_kv_heads=3,
            max_batch=3,
            max_scores=70_000,
            large_rows=70_000,
            shrink_seconds=5.0,
        ),
        Profile(
            "ci",
            examples=60,
            max_len=96,
            tail_lengths=(31, 33, 63, 65, 127, 129, 255, 257),
            max_kv_heads=4,
            max_batch=4,
            max_scores=200_000,
            large_rows=140_000,
            shrink_seconds=60.0,
        ),
        Profile(
            "thorough",
            examples=400,
            max_len=300,
            tail_lengths=(31, 33, 63, 65, 127, 129, 239, 255, 257, 511, 799, 1023, 1025),
            max_kv_heads=8,
            max_batch=6,
            max_scores=2_000_000,
            large_rows=1_100_000,
            shrink_seconds=300.0,
        ),
    )
}


def get_profile(name: str) -> Profile:
    """The profile called ``name``; a clear error for an unknown one."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}: use one of {', '.join(PROFILES)}") from None
