"""What an audit's judged cases covered, feature by feature (the HTML report's coverage
plots, docs/reports.md): for each (property, dtype), how many judged cases had each query
length, key length, head-dim pair, batch x heads, mask, causal alignment, variant set,
layout and kind of values. Lengths and batch x heads go in power-of-two bins.
"""

import math

from attnref.conformance.cases import Case

__all__ = ["FEATURES", "add", "features"]

#: the features counted, in the order the report shows them
FEATURES = ("Tq", "Tk", "Dqk/Dv", "batch x heads", "mask", "causal", "variants", "layout", "values")


def _bin(n: int) -> str:
    """``n`` in a power-of-two bin: ``0``, ``1``, ``2-3``, ``4-7``, ..."""
    if n <= 1:
        return str(max(n, 0))
    low = 1 << (n.bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def features(case: Case) -> dict[str, str]:
    """The features of one case (a cache's longest row of keys, a pack's longest
    sequence)."""
    queries, keys = case.Tq, case.Tk
    if case.cached:
        keys = max(n + case.new for n in case.cached)
    if case.seqlens:
        queries = max(q for q, _ in case.seqlens)
        keys = max(k for _, k in case.seqlens)
    rows = max(1, len(case.cached) or len(case.seqlens))
    return {
        "Tq": _bin(queries),
        "Tk": _bin(keys),
        "Dqk/Dv": f"{case.Dh}/{case.Dv}",
        "batch x heads": _bin(math.prod(case.batch) * case.h * rows),
        "mask": case.mask,
        "causal": case.causal or "none",
        "variants": "+".join(case.variants) or "none",
        "layout": case.layout,
        "values": case.logits + (f" fp8 {case.fp8}" if case.fp8 else ""),
    }


def add(coverage: dict[str, dict[str, int]], case: Case) -> None:
    """Count ``case`` in ``coverage``."""
    for name, value in features(case).items():
        counts = coverage.setdefault(name, {})
        counts[value] = counts.get(value, 0) + 1
