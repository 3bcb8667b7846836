"""A cost model of a kernel's launch, calibrated on the kernel itself (docs/interpreted.md).

An interpreted kernel's call costs what its programs do, not what its math does: a
program a query tile, head, batch row and KV split, each stepping over its keys a tile
at a time, each step milliseconds of the interpreter's work whatever the tile holds. A
bound on ``batch * h * Tq * Tk * (Dh + Dv)`` let through 65 sequences of one token on
16 KV splits (1,040 programs of almost no math: 64 s a call, past a 60 s timeout, and
the kernel was blamed), and an explicit 4096 x 4096 case 512 times past it.

`calibrate` times a few calls of known shapes at the audit's start (one program, four
programs, one program over eight key tiles) and fits the seconds of a call as

    fixed + per_program * programs + per_step * steps

(`Launch.predict`). Every case the audit runs, drawn or explicit, is then cut until its
prediction fits `Launch.budget` (`Launch.fit`: fewer batch rows, heads, queries, keys),
and its call waits at least ten times its prediction (`Launch.timeout`), so that a call
is never failed for a time its size explains. A call that still times out is reported
with its prediction.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from attnref.conformance.cases import Case

__all__ = ["CALL_BUDGET", "Launch", "calibrate", "launch_shape"]

#: the seconds one call of an interpreted kernel may be predicted to take: a case past
#: it is cut (the cookbook's kernels: a case's median 0.13 s, the slowest 10 s). A
#: profile may cut shorter (`attnref.conformance.profiles.Profile.call_budget`: quick's 1 s)
CALL_BUDGET = 8.0
#: a call waits at least this many times its prediction
PATIENCE = 10.0


def launch_shape(case: Case, tile_queries: int, tile_keys: int, splits: int) -> tuple[int, int]:
    """The programs one call of ``case`` launches and the key tiles they step over in
    all: a program a query tile, head, sequence (a batch row, a packed sequence, a cached
    row) and KV split, each over its split's keys a tile at a time (at least one step)."""
    tq, tk, s = max(1, tile_queries), max(1, tile_keys), max(1, splits)
    if case.seqlens:
        rows = [(q, k) for q, k in case.seqlens]
    elif case.cached:
        rows = [(case.Tq, c + case.new) for c in case.cached]
    else:
        rows = [(case.Tq, case.Tk)] * math.prod(case.batch)
    programs = steps = 0
    for q, k in rows:
        tiles = math.ceil(max(1, q) / tq) * s * case.h
        programs += tiles
        steps += tiles * max(1, math.ceil(math.ceil(k / s) / tk))
    return programs, steps


@dataclass(frozen=True)
class Launch:
    """A kernel's launch and what its parts cost, in seconds (`calibrate`)."""

    tile_queries: int
    tile_keys: int
    splits: int
    fixed: float
    per_program: float
    per_step: float
    budget: float = CALL_BUDGET

    def shape(self, case: Case) -> tuple[int, int]:
        return launch_shape(case, self.tile_queries, self.tile_keys, self.splits)

    def predict(self, case: Case) -> float:
        """The seconds one call of ``case`` should take."""
        programs, steps = self.shape(case)
        return self.fixed + self.per_program * programs + self.per_step * steps

    def timeout(self, case: Case, timeout: float) -> float:
        """What a call of ``case`` waits: ``timeout``, or `PATIENCE` times its prediction
        where that is longer."""
        return max(timeout, PATIENCE * self.predict(case))

    def fit(self, case: Case) -> Case:
        """``case`` cut until its prediction fits the budget: one batch row, then the
        heads of one KV head (its group kept), then half the queries, then half the keys,
        then half the packed sequences or cached rows, as long as one of them helps."""
        for _ in range(64):
            if self.predict(case) <= self.budget:
                return case
            smaller = _smaller(case, self.tile_queries, self.tile_keys)
            if smaller is None:
                return case
            case = smaller
        return case

    def said(self) -> str:
        """The model, as the report says it."""
        return (
            f"launch model: {self.fixed * 1e3:.3g} ms a call + {self.per_program * 1e3:.3g} ms "
            f"a program + {self.per_step * 1e3:.3g} ms a key tile a program "
            f"(tiles {self.tile_queries} x {self.tile_keys}, {self.splits} splits), "
            f"calibrated on the kernel; each case cut to a predicted {self.budget:g} s a "
            f"call, each call waiting {PATIENCE:g} times its prediction or more"
        )


def _smaller(case: Case, tile_queries: int, tile_keys: int) -> Case | None:
    """One step down in ``case``'s launch, or None where nothing is left to cut."""
    try:
        if math.prod(case.batch) > 1 and not case.cached and not case.seqlens:
            return replace(case, batch=(1,) * len(case.batch))
        if case.g > 1:
            return replace(case, h=case.h // case.g, g=1)
        if case.seqlens and len(case.seqlens) > 1:
            return replace(case, seqlens=case.seqlens[: len(case.seqlens) // 2])
        if case.cached and len(case.cached) > 1:
            half = len(case.cached) // 2
            return replace(case, batch=(half,), cached=case.cached[:half])
        if case.Tq > max(1, tile_queries) and not case.seqlens:
            Tq = max(1, case.Tq // 2)
            return replace(case, Tq=Tq, Tk=Tq if case.Tq == case.Tk else case.Tk)
        if case.Tk > max(1, tile_keys) and not case.seqlens and not case.cached:
            Tk = max(1, case.Tk // 2)
            return replace(case, Tk=Tk, Tq=Tk if case.Tq == case.Tk else case.Tq)
        if case.h > 1:
            return replace(case, h=max(1, case.h // 2), g=1)
    except (ValueError, TypeError):  # a size another field needs
        return None
    return None


def calibrate(
    time_call: Callable[[Case], float | None],
    tile_queries: int,
    tile_keys: int,
    splits: int,
    base: Case,
) -> Launch | None:
    """The launch model of a kernel, from ``time_call``'s seconds for one call of each of
    three shapes made from ``base`` (one query tile, one key tile): one head; four; one
    head over eight key tiles (each the fastest of two calls, after one call that warms
    the kernel up). None where a call could not be timed (``time_call`` returned None:
    refused, or it failed)."""
    tq, tk = max(1, tile_queries), max(1, tile_keys)
    one = replace(base, batch=(1,), h=1, g=1, Tq=tq, Tk=tk * max(1, splits))
    shapes = [one, replace(one, h=4, g=4), replace(one, Tk=one.Tk * 8)]
    if time_call(one) is None:  # the kernel's first call: compiled, cached, warmed
        return None
    seconds: list[float] = []
    for case in shapes:
        times = [time_call(case), time_call(case)]
        if None in times:
            return None
        seconds.append(min(t for t in times if t is not None))
    (p1, s1), (p2, s2), (_, s3) = (launch_shape(c, tq, tk, splits) for c in shapes)
    # t = fixed + a * programs + b * steps, three shapes: b from the longer keys, a from
    # the wider grid, fixed from the first; each at least 0 (a noisy timing may say less)
    b = max(0.0, (seconds[2] - seconds[0]) / max(1, s3 - s1))
    a = max(0.0, (seconds[1] - seconds[0] - b * (s2 - s1)) / max(1, p2 - p1))
    fixed = max(0.0, seconds[0] - a * p1 - b * s1)
    return Launch(tq, tk, max(1, splits), fixed, a, b)
