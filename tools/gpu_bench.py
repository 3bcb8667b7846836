"""The GPU sweep of issue 5: every attention backend against torch's SDPA kernels.

bf16 and fp16, causal and not, sequence 512 to 16384 at 16k tokens per batch, head dim
64 and 128 at a model width of 2048 (FlashAttention's benchmark shapes), every backend:
the reference, torch SDPA with MATH, FLASH, EFFICIENT and CUDNN forced, and compiled
FlexAttention. The denominator of the fraction of peak is the device's fastest measured
matmul rate (bf16 on a GPU; `attnref.bench.timing.measure_device_peak`). It writes
``bench.csv``, ``bench.json``, ``bench.png`` and a ``README.md`` table to ``--out``
(default ``docs/gpu-bench``), after every row, so a run cut short still leaves its rows.

It needs nothing but this repository and an environment with torch (the GPU machine has
no network): ``python tools/gpu_bench.py`` or ``nox -s bench_gpu``. ``--tiny`` runs the
same code at toy sizes, on the CPU in the tests.

``--references FILE``: published figures to draw beside the measurements, for scale: a
JSON list of ``{"label", "dtype", "causal", "Dh", "seq": [...], "tflops": [...],
"source"}``; only figures whose source states the same dtype, mask and head dim belong
there.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from attnref.bench import (
    BenchResult,
    environment,
    format_table,
    measure_bandwidth,
    measure_device_peak,
    plot_results,
    run_benchmarks,
    sweep_cases,
    write_results,
)
from attnref.conformance import resolve_backend

BACKENDS = (
    "reference",
    "torch-sdpa-math",
    "torch-sdpa-flash",
    "torch-sdpa-efficient",
    "torch-sdpa-cudnn",
    "torch-flex",
)


def _summary(results: list[BenchResult], meta: dict[str, Any]) -> str:
    peak = meta.get("peak_tflops")
    lines = [
        f"# GPU sweep on {meta['environment'].get('gpu', meta['device'])}",
        "",
        f"`{meta['command']}`, torch {meta['environment']['torch']}. Medians of "
        f"{meta['runs']} timed calls after {meta['warmup']} warm-up calls, CUDA events, "
        "inputs rotated; FLOPs for the visible pairs only. Fraction of peak against the "
        + (f"{meta['peak_source']} rate, {peak:.0f} TFLOP/s." if peak else "(no peak).")
        + " The plot is `bench.png`; every row is in `bench.csv` / `bench.json`.",
        "",
        "| backend | dtype | causal | Dh | T | B x h | ms | TFLOP/s | of peak | peak MiB | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.case
        ms = "" if r.median_s is None else f"{r.median_s * 1e3:.3f}"
        tf = "" if r.tflops is None else f"{r.tflops:.1f}"
        fr = "" if r.peak_fraction is None else f"{r.peak_fraction:.0%}"
        mem = "" if r.peak_mem_bytes is None else f"{r.peak_mem_bytes / 2**20:.0f}"
        note = "" if r.status == "ok" else f"{r.status}: {r.note}"[:80]
        lines.append(
            f"| {r.backend} | {c.dtype} | {c.causal or '-'} | {c.Dh} | {c.Tk} | "
            f"{c.B} x {c.h} | {ms} | {tf} | {fr} | {mem} | {note} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/gpu-bench")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting rows")
    parser.add_argument("--backend", action="append", help="default: every backend")
    parser.add_argument("--references", help="JSON file of published figures to draw")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (CPU tests)")
    parser.add_argument("--seq", type=int, nargs="+", help="default: 512 to 16384")
    parser.add_argument("--dtype", nargs="+", choices=["bfloat16", "float16"])
    parser.add_argument("--head-dim", type=int, nargs="+", help="default: 64 128")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device is present (use --device cpu --tiny)", file=sys.stderr)
        return 2
    out = Path(args.out)
    backends = [resolve_backend(b) for b in args.backend or BACKENDS]
    tiny = args.tiny
    cases = sweep_cases(
        seqs=args.seq or ([16, 32] if tiny else [512, 1024, 2048, 4096, 8192, 16384]),
        dtypes=args.dtype or ["bfloat16", "float16"],
        head_dims=args.head_dim or ([8, 16] if tiny else [64, 128]),
        causal=[None, "top_left"],
        device=args.device,
        tokens=64 if tiny else 16384,
        hidden=32 if tiny else 2048,
    )
    # the cases go by sequence length inside (dtype, Dh, causal): long sequences last,
    # so a spent budget costs the longest (and most reference-heavy) rows first
    cases.sort(key=lambda c: (c.Tk, c.dtype, c.Dh, c.causal or ""))
    peak, peak_dtype = measure_device_peak(args.device, n=256 if tiny else 8192)
    gbps = measure_bandwidth(args.device, mib=16 if tiny else 1024)
    print(f"measured matmul peak: {peak:.2f} TFLOP/s ({peak_dtype})", flush=True)
    meta = {
        "device": args.device,
        "environment": environment(args.device),
        "peak_tflops": peak,
        "peak_gbps": gbps,
        "peak_source": f"measured {peak_dtype} matmul, and a copy's bandwidth",
        "warmup": args.warmup,
        "runs": args.runs,
        "command": "python tools/gpu_bench.py " + " ".join(argv or sys.argv[1:]),
    }
    references = json.loads(Path(args.references).read_text()) if args.references else []
    if references:
        meta["references"] = references

    def save(results: list[BenchResult]) -> None:
        write_results(results, out, meta=meta)
        (out / "README.md").write_text(_summary(results, meta))

    results = run_benchmarks(
        backends,
        cases,
        warmup=args.warmup,
        runs=args.runs,
        peak_tflops=peak,
        peak_gbps=gbps,
        budget_s=args.budget_s,
        on_result=save,
    )
    save(results)
    plot_results(
        results,
        out / "bench.png",
        title=f"{meta['environment'].get('gpu', args.device)}: attention TFLOP/s",
        references=references,
    )
    print(format_table(results))
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
