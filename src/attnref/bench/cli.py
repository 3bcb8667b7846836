"""``attnref bench`` and ``python -m attnref.bench``: options, validation, the run."""

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from attnref.bench.cases import MASKS, sweep_cases
from attnref.bench.output import format_table, plot_results, write_results
from attnref.bench.runner import environment, run_benchmarks
from attnref.bench.serving import serving_cli
from attnref.bench.timing import measure_bandwidth, measure_device_peak
from attnref.conformance.backends import BackendError, resolve_backend
from attnref.conformance.families import FAMILIES, get_family
from attnref.devices import DTYPES
from attnref.masks import Alignment

__all__ = ["DEFAULT_BACKENDS", "add_arguments", "main", "run_cli"]

#: backends run by default: the sdpa family's bench entry, every built-in one (those
#: absent here are skipped, not failed)
DEFAULT_BACKENDS = get_family("sdpa").bench_backends


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``attnref bench`` (shared with ``python -m attnref.bench``)."""
    p.add_argument(
        "--backends",
        nargs="+",
        metavar="NAME",
        help="built-in names (attnref audit --list-backends) or module:function "
        f"(default: {' '.join(DEFAULT_BACKENDS)})",
    )
    p.add_argument(
        "--seq",
        nargs="+",
        type=int,
        metavar="T",
        help="sequence lengths, Tq = Tk (default: 128 256 512 on cpu, 512 .. 16384 on cuda)",
    )
    p.add_argument(
        "--dtype",
        nargs="+",
        choices=sorted(DTYPES),
        help="dtypes (default: float32 on cpu, bfloat16 on cuda)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if present")
    p.add_argument(
        "--causal",
        action="store_true",
        help="causal attention (top-left, torch's is_causal; see --alignment)",
    )
    p.add_argument(
        "--both",
        action="store_true",
        help="run every case both without and with the causal mask",
    )
    p.add_argument(
        "--alignment",
        choices=["top_left", "bottom_right"],
        default="top_left",
        help="causal alignment (the same when Tq = Tk; see --queries)",
    )
    p.add_argument(
        "--queries",
        type=int,
        metavar="TQ",
        help="a fixed number of queries against --seq keys (1: a decoding step); "
        "default: as many as keys",
    )
    p.add_argument("--mask", choices=MASKS, default="none", help="key padding mask or none")
    p.add_argument("--head-dim", nargs="+", type=int, default=[64], metavar="DH")
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--tokens",
        type=int,
        help="tokens per batch: B = tokens // seq (default: 2048 on cpu, 16384 on cuda)",
    )
    size.add_argument("--batch", type=int, help="a fixed batch size instead of --tokens")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument(
        "--hidden", type=int, help="model width: h = hidden // Dh (default: 512 cpu, 2048 cuda)"
    )
    heads.add_argument("--heads", type=int, help="a fixed number of query heads")
    p.add_argument("--kv-heads", type=int, help="key/value heads (GQA); default: as many as h")
    p.add_argument("--runs", type=int, default=10, help="timed calls per case (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default: 2)")
    peak = p.add_mutually_exclusive_group()
    peak.add_argument("--peak-tflops", type=float, help="the device's peak, for the fraction")
    peak.add_argument(
        "--measure-peak",
        action="store_true",
        help="measure the device's matmul peak and memory bandwidth, and flag a rate above "
        "either (the roofline)",
    )
    p.add_argument("--no-memory", action="store_true", help="do not measure peak memory")
    p.add_argument("--out", default="attnref-bench", metavar="DIR", help="default: ./attnref-bench")
    p.add_argument("--no-plot", action="store_true", help="no PNG (matplotlib not needed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--api",
        choices=[name for name, f in FAMILIES.items() if f.bench_backends],
        default="sdpa",
        help="sdpa: dense attention (TFLOP/s); flash-kvcache: one decoding step per call "
        "against --seq cached tokens (decode tokens/s, per --page-size); flash-varlen: a "
        "packed causal prefill of --batch sequences of --seq down to --seq/2 tokens "
        "(tokens/s); context-parallel: one causal call sharded over --world-size ranks "
        "(time, bytes sent and peak memory per rank). Default: sdpa",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="W",
        help="processes one call runs on, for a family that spreads it over several "
        "(context-parallel: the ranks; default: the family's)",
    )
    p.add_argument(
        "--page-size",
        nargs="+",
        type=int,
        metavar="P",
        help="flash-kvcache: page sizes, 0 for a contiguous cache (default: 0 16)",
    )


def _fail(message: str) -> int:
    print(f"attnref bench: {message}", file=sys.stderr)
    return 2


def run_cli(args: argparse.Namespace) -> int:
    """Run ``attnref bench`` with parsed ``args``; returns the exit code (0: every row
    ran or was skipped for a declared reason; 1: some backend raised; 2: bad usage)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda asked for, but no CUDA device is present")
    gpu = device == "cuda"
    seqs = args.seq or ([512, 1024, 2048, 4096, 8192, 16384] if gpu else [128, 256, 512])
    dtypes = args.dtype or (["bfloat16"] if gpu else ["float32"])
    for name, values in (("--seq", seqs), ("--head-dim", args.head_dim)):
        if any(v < 1 for v in values):
            return _fail(f"{name} values must be >= 1, got {values}")
    for name in ("runs", "tokens", "batch", "hidden", "heads", "kv_heads", "queries"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return _fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0:
        return _fail(f"--warmup must be >= 0, got {args.warmup}")
    family = get_family(args.api)
    if family.workload is not None:  # a serving workload: decode or packed prefill
        return serving_cli(args.api, args, device, seqs, dtypes)
    # one call spread over several processes (context-parallel): causal, B = 1, h = 8 by
    # default, as its users shard a long sequence
    spread = family.world_size > 1
    if spread and "RANK" in os.environ:
        return _fail(f"the {args.api} bench starts its processes itself; run it without a "
                     "launcher (torchrun), with --world-size W")  # fmt: skip
    from attnref.conformance.worker import start_forkserver

    start_forkserver()  # the workers' clean parent starts while the cases are made
    # resolved in each backend's worker only (the trust boundary), with the current
    # folder importable there, as the audit does
    backends: list[str] = list(args.backends or family.bench_backends)
    for spec in backends:  # a name is looked up here; module:function only in a worker
        if ":" not in spec:
            try:
                resolve_backend(spec)
            except BackendError as e:
                return _fail(str(e))
    causal: list[Alignment | None] = (
        [None, args.alignment] if args.both else [args.alignment if args.causal or spread else None]
    )
    try:
        cases = sweep_cases(
            seqs=seqs,
            dtypes=dtypes,
            head_dims=args.head_dim,
            causal=causal,
            device=device,
            tokens=None if args.batch or spread else (args.tokens or (16384 if gpu else 2048)),
            batch=args.batch or (1 if spread else None),
            hidden=None if args.heads or spread else (args.hidden or (2048 if gpu else 512)),
            heads=args.heads or (8 if spread else None),
            kv_heads=args.kv_heads,
            mask=args.mask,
            queries=args.queries,
        )
    except ValueError as e:
        return _fail(str(e))
    peak, gbps = args.peak_tflops, None
    if args.measure_peak:
        peak, peak_dtype = measure_device_peak(device, n=8192 if gpu else 1024)
        gbps = measure_bandwidth(device, mib=256 if gpu else 64)
        print(f"measured matmul peak on {device}: {peak:.2f} TFLOP/s ({peak_dtype}); "
              f"memory bandwidth: {gbps:.1f} GB/s")  # fmt: skip
    results = run_benchmarks(
        backends,
        cases,
        warmup=args.warmup,
        runs=args.runs,
        peak_tflops=peak,
        peak_gbps=gbps,
        memory=not args.no_memory,
        progress=False if args.no_progress else None,
        api=args.api,
        world_size=args.world_size,
    )
    print(format_table(results))
    meta = {
        "device": device,
        "environment": environment(device),
        "peak_tflops": peak,
        "peak_gbps": gbps,
        "peak_source": (
            f"measured {peak_dtype} matmul" if args.measure_peak else ("given" if peak else None)
        ),
        "warmup": args.warmup,
        "runs": args.runs,
        "command": " ".join(sys.argv),
    }
    written = write_results(results, args.out, meta=meta)
    if not args.no_plot:
        try:
            written.append(
                plot_results(
                    results, Path(args.out) / "bench.png", title=f"attnref bench, {device}"
                )
            )
        except ImportError as e:
            print(f"no plot: {e}", file=sys.stderr)
    print("written: " + ", ".join(str(p) for p in written))
    return 1 if any(r.status in ("error", "wrong", "flagged") for r in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m attnref.bench``: the same as ``attnref bench``."""
    parser = argparse.ArgumentParser(
        prog="python -m attnref.bench",
        description="Benchmark attention backends at the same shapes: time, TFLOP/s, memory.",
    )
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))
