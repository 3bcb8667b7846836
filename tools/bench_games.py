"""Does a backend that rewrites its worker's timing figures get a row ``ok``? Times torch's
SDPA, an honest backend of a module (`tests.torch_sdpa:sdpa`) and
`tests.hostile.bench_games:rewrites_timing` (reports a tenth of its times) on five
sizes, several rounds, and prints each row's status and rate: the hostile backend must
be ``flagged`` on every row, the honest ones ``ok`` (docs/benchmarks.md quotes a run).

    python tools/bench_games.py [--rounds 3]
"""

import argparse
import time

import torch

from attnref.bench.cases import BenchCase
from attnref.bench.runner import run_benchmarks

SIZES = [(1, 128), (1, 512), (8, 256), (1, 1024), (4, 512)]
SPECS = ["torch-sdpa", "tests.torch_sdpa:sdpa", "tests.hostile.bench_games:rewrites_timing"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    torch.set_num_threads(1)
    cases = [BenchCase(B=b, h=4, Tq=t, Tk=t, Dh=64) for b, t in SIZES]
    started = time.perf_counter()
    wrong = 0
    for round_ in range(rounds):
        for r in run_benchmarks(SPECS, cases, runs=10, warmup=1, memory=False, progress=False):
            c = r.case
            hostile = r.backend.endswith("rewrites_timing")
            wrong += (r.status == "ok") == hostile
            rate = f"{r.tflops:.3f}" if r.tflops is not None else "-"
            print(f"{round_} {r.backend:45} B={c.B} T={c.Tq:<5} {r.status:8} {rate:>6} "
                  f"{(r.note or '')[:70]}", flush=True)  # fmt: skip
    print(f"{wrong} rows misjudged; {time.perf_counter() - started:.0f} s")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
