"""The judge's share of an audit: wall time against the backend's own time.

    python tools/audit_split.py [--src PATH] [-- audit options]

Runs ``attnref audit --backend timed_sdpa:sdpa`` (torch's SDPA, timing its own calls in
its worker: `tools/timed_sdpa.py`) with one torch thread, and prints the wall time, the
CPU time of the judges and forkservers (`getrusage` of the children: the sandboxed
workers' does not come back through their PID namespaces), the time the audit reports,
the backend's calls and their time summed over every worker, and the ratio of the rest
(the judges' own work: drawing, the oracle, the round trips) to the backend's. The audit
runs with its default judges (``--jobs``: 2 on 2 cores); ``-- --jobs 1`` for one.
``--src`` runs another checkout's ``src`` (a baseline) with the same backend, so that
two versions can be timed side by side, alternating.
"""

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent


def split(src: str | None, extra: list[str], keep: str | None = None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        path = [str(TOOLS)] + ([src] if src else [])
        env = {
            **os.environ,
            "ATTNREF_TIMED_SDPA": "1",
            "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, "-m", "attnref", "audit", "--backend", "timed_sdpa:sdpa"]
        cmd += ["--json", report, "--no-progress", *extra]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        # the CPU time of the audit's processes (judge, forkserver, workers: each reaped
        # by its parent), steadier than the wall time on a shared machine
        cpu = sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime"))
        # each worker's last running total (a worker restarted after a timeout is another)
        totals: dict[str, tuple[int, float]] = {}
        for tag, n, s in re.findall(r"TIMED_SDPA (\w+) (\d+) ([\d.]+)\n", done.stdout):
            totals[tag] = (int(n), float(s))
        calls = float(sum(n for n, _ in totals.values()))
        backend = sum(s for _, s in totals.values())
        data = json.loads(Path(report).read_text()) if os.path.exists(report) else {}
        if keep and data:
            Path(keep).write_text(json.dumps(data, indent=1))
    reported = float(data.get("seconds", 0.0))
    return {
        "exit": done.returncode,
        "wall": wall,
        "cpu": cpu,
        "reported": reported,
        "calls": calls,
        "backend": backend,
        "judge_share": (wall - backend) / backend if backend else float("nan"),
        "cases": float(sum(r.get("checks", 0) for r in data.get("results", []))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", help="another checkout's src folder (a baseline)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--keep", help="write the audit's JSON report here")
    parser.add_argument("audit", nargs="*", help="options for attnref audit, after --")
    args = parser.parse_args()
    for _ in range(args.runs):
        row = split(args.src, args.audit, args.keep)
        print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
