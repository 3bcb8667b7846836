"""The proofs that the tests and properties can fail, run in the slow tier so CI keeps them."""

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from attnref.conformance import PROFILES, audit
from attnref.conformance.families import MATRIX_PROPERTIES, MUTANTS
from attnref.devices import DTYPES

ROOT = Path(__file__).resolve().parents[1]
SHORT = {"f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16"}

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("unchecked")]
#: tools/kill_matrix.py's profile: kvcache_far_pages past 2**17 elements, as a CPU can hold;
#: here with half a second of shrinking, not five (a kill is a kill, shrunk or not: 60
#: properties' searches shrank for minutes of CI's time)
MATRIX_PROFILE = replace(PROFILES["quick"], far_pages=2**17, shrink_seconds=0.5)


def _kill_matrix() -> dict[str, dict[str, list[str]]]:
    """docs/kill-matrix.md as {property: {mutant: [dtypes it failed in]}}."""
    lines = (ROOT / "docs" / "kill-matrix.md").read_text().splitlines()
    header = next(x for x in lines if x.startswith("| mutant |"))
    columns = [c.strip().strip("`") for c in header.strip("|").split("|")][2:]
    kills: dict[str, dict[str, list[str]]] = {p: {} for p in columns}
    for line in lines:
        m = re.match(r"^\| `(\w+)` \|", line)
        if m:
            cells = [c.strip() for c in line.strip("|").split("|")][2:]
            for pid, cell in zip(columns, cells, strict=True):
                if cell not in (".", "n/a"):
                    kills[pid][m.group(1)] = [SHORT[d] for d in cell.split()]
    return kills


def test_every_property_test_can_fail() -> None:
    """tools/property_mutations.py plants one bug per property test in a scratch copy;
    every planted bug must make its tests fail."""
    proc = subprocess.run(
        [sys.executable, "tools/property_mutations.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "every mutation caught" in proc.stdout
    assert "NOT CAUGHT" not in proc.stdout


@pytest.mark.parametrize("pid", MATRIX_PROPERTIES)
def test_each_property_kills_what_the_kill_matrix_says(pid: str) -> None:
    """The kill matrix claims every property kills at least one mutant; check it live,
    so the claim cannot go stale while the document stays. The cells a search finds can
    move with the Hypothesis version (a marginal kill, such as float64 overflow, may come
    and go), so the property must kill one of its listed (mutant, dtype) cells, tried in
    the matrix's order."""
    kills = _kill_matrix()[pid]
    assert kills, f"docs/kill-matrix.md lists no mutant caught by {pid}"
    cells = [(name, dtype) for name, dtypes in kills.items() for dtype in dtypes][:6]
    for name, dtype in cells:
        report = audit(
            MUTANTS[name].backend(),
            properties=[pid],
            dtypes=[DTYPES[dtype]],
            device="cpu",
            progress=False,
            profile=MATRIX_PROFILE,
        )
        if not report.ok:
            return
    tried = [f"{name} in {dtype}" for name, dtype in cells]
    pytest.fail(f"{pid} catches none of the kills the matrix lists: tried {', '.join(tried)}")


def test_torch_s_cpu_backward_at_head_dim_160_is_within_the_gradient_bound() -> None:
    """tools/gradient_head_dim.py: the shape of thorough seed 2's finding (7 queries, 511
    keys, D = 160, float32). torch's CPU backward recomputes P from dot products of 160
    terms; the bound's score rounding grows with D, and every gradient is within it."""
    sys.path.insert(0, str(ROOT))
    try:
        from tools.gradient_head_dim import one
    finally:
        sys.path.remove(str(ROOT))
    for seed in (0, 3, 6):
        now = next(row for row in one(seed, 160) if row[0] == "now")
        assert now[3] == [], (seed, now)
