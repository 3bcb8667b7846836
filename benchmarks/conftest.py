"""Benchmark configuration: checking off, and median ratios printed side by side.

Benchmarks are not tests: they live outside ``testpaths`` and run with
``python -m pytest benchmarks`` (or ``nox -s bench``). Within one group, every
benchmark's median is divided by the group's baseline (the benchmark whose name ends in
``[baseline]`` or contains ``torch``), measured in the same run.
"""

from collections.abc import Iterator
from typing import Any

import pytest

from attnref import set_checking


@pytest.fixture(autouse=True)
def _checking_off() -> Iterator[None]:
    """Benchmarks measure the math, not the runtime checker (unless they turn it on)."""
    set_checking(False)
    yield
    set_checking(True)


def _median(bench: Any) -> float:
    stats = getattr(bench.stats, "stats", bench.stats)
    return float(stats.median)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    session = getattr(terminalreporter.config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    groups: dict[str, list[Any]] = {}
    for bench in session.benchmarks:
        groups.setdefault(bench.group or "", []).append(bench)
    tr = terminalreporter
    tr.section("median ratios, measured side by side in this run")
    for group, benches in groups.items():
        base = next((b for b in benches if "baseline" in b.name), None)
        base = base or next((b for b in benches if "torch" in b.name), benches[0])
        tr.write_line(f"{group}  (baseline: {base.name}, median {_median(base) * 1e6:.1f} us)")
        for b in benches:
            extra = "  ".join(f"{k}={v}" for k, v in sorted(b.extra_info.items()))
            tr.write_line(
                f"    {b.name:<52} median {_median(b) * 1e6:>12.1f} us  "
                f"x{_median(b) / _median(base):6.2f}  {extra}"
            )
