"""Benchmark attention backends at the same shapes: time, TFLOP/s, peak memory, a plot.

``attnref bench`` and ``python -m attnref.bench`` are the same command. The backends are
the conformance suite's registry (`attnref.conformance.BUILTIN_BACKENDS`, or any
``module:function``): one list of backends in the project.

Method:

- A `BenchCase` is one shape: ``(B, h, Tq, Dh)`` queries against ``(B, g, Tk, Dh)``
  keys and values, a dtype, a device, a causal alignment or none, and a mask kind
  (``none``, or ``padding``: key lengths spread evenly from ``Tk`` down to ``Tk / 2``
  across the batch, as a ``(B, 1, 1, Tk)`` boolean mask).
- FLOPs count the work the mask leaves: ``4 * h * Dh`` per visible (query, key) pair
  (two matmuls, a multiply and an add each), so ``4 * B * h * Tq * Tk * Dh`` without a
  mask, and the exact count of visible pairs under a causal mask of either alignment
  and under padding (`visible_pairs`). The same count for every backend, whatever it
  computes internally.
- Timing: ``warmup`` calls, then ``runs`` timed calls, each on the next of a few input
  sets in rotation (so no run reads inputs the previous run left in the cache), with
  CUDA events and a synchronisation on a GPU and ``perf_counter`` on the CPU. The median
  is reported.
- Peak memory: on a GPU, the CUDA allocator's peak during one call above what was
  allocated before it; on the CPU, the process's peak resident size during one call
  above its resident size before it (Linux: ``/proc/self/clear_refs`` resets the
  high-water mark and freed heap is trimmed first; elsewhere ``ru_maxrss``, coarser).
- TFLOP/s are divided by a peak (``--peak-tflops``, or ``--measure-peak``: the device's
  measured matmul rate in the benchmark's dtype) for the fraction of peak.

A backend that cannot run a case (not declared for the dtype or device, a kernel that
refuses the shape, out of memory) gets a row with ``status`` ``skipped`` or ``error``
and the reason; the run goes on.
"""

import argparse
import contextlib
import csv
import ctypes
import functools
import gc
import json
import math
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from attnref._checking import checking_enabled, set_checking
from attnref.conformance.backends import Backend, BackendError, resolve_backend
from attnref.conformance.calls import backend_call, skip_reason
from attnref.conformance.cases import Inputs
from attnref.masks import causal_offset, check_alignment, valid_lens_to_mask

__all__ = [
    "DTYPES",
    "BenchCase",
    "BenchResult",
    "case_flops",
    "main",
    "measure_matmul_peak",
    "padding_lengths",
    "plot_results",
    "run_benchmarks",
    "sweep_cases",
    "visible_pairs",
    "write_results",
]

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
MASKS = ("none", "padding")

#: backends run by default: every built-in one (those absent here are skipped, not failed)
DEFAULT_BACKENDS = (
    "reference",
    "torch-sdpa-math",
    "torch-sdpa",
    "torch-sdpa-flash",
    "torch-sdpa-efficient",
    "torch-sdpa-cudnn",
    "torch-flex",
)


# --------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class BenchCase:
    """One benchmark shape, run on every backend alike.

    Raises:
        ValueError: a non-positive size, ``g`` not dividing ``h``, an unknown mask kind,
            dtype or alignment.
    """

    B: int
    h: int
    Tq: int
    Tk: int
    Dh: int
    dtype: str = "float32"
    device: str = "cpu"
    g: int | None = None  # key/value heads; None = h
    causal: str | None = None  # None, "top_left" or "bottom_right"
    mask: str = "none"  # "none" or "padding"

    def __post_init__(self) -> None:
        for name in ("B", "h", "Tq", "Tk", "Dh"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.g is not None and (self.g < 1 or self.h % self.g):
            raise ValueError(f"h ({self.h}) must be divisible by g ({self.g})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if self.causal is not None:
            check_alignment(self.causal)

    @property
    def kv_heads(self) -> int:
        return self.h if self.g is None else self.g

    @property
    def label(self) -> str:
        causal = f" causal={self.causal}" if self.causal else ""
        mask = f" mask={self.mask}" if self.mask != "none" else ""
        gqa = f" g={self.g}" if self.g not in (None, self.h) else ""
        return (
            f"B={self.B} h={self.h}{gqa} Tq={self.Tq} Tk={self.Tk} Dh={self.Dh} "
            f"{self.dtype}{causal}{mask}"
        )


def padding_lengths(B: int, Tk: int) -> list[int]:
    """Key lengths of the ``padding`` mask: spread evenly from ``Tk`` down to ``ceil(Tk / 2)``."""
    if B == 1:
        return [Tk]
    low = math.ceil(Tk / 2)
    return [Tk - round((Tk - low) * b / (B - 1)) for b in range(B)]


def visible_pairs(
    Tq: int, Tk: int, causal: str | None = None, key_lengths: Sequence[int] | None = None
) -> int:
    """The number of (query, key) pairs a mask leaves visible, summed over the batch.

    ``causal``: query ``i`` sees key ``j`` iff ``j <= i`` (``top_left``, torch's
    ``is_causal``) or ``j <= i + Tk - Tq`` (``bottom_right``); ``key_lengths``: one
    sample per entry, whose keys from that length on are padding. Without either it is
    ``Tq * Tk`` (one sample).
    """
    per_row = (
        torch.full((Tq,), Tk, dtype=torch.int64)
        if causal is None
        else (torch.arange(Tq) + causal_offset(Tq, Tk, causal) + 1).clamp(0, Tk)
    )  # keys query i may see, before padding
    lengths = [Tk] if key_lengths is None else list(key_lengths)
    return sum(int(per_row.clamp(max=length).sum()) for length in lengths)


def case_flops(case: BenchCase) -> int:
    """Forward FLOPs for the mask applied: ``4 * h * Dh`` per visible pair."""
    lengths = padding_lengths(case.B, case.Tk) if case.mask == "padding" else [case.Tk] * case.B
    return 4 * case.h * case.Dh * visible_pairs(case.Tq, case.Tk, case.causal, lengths)


def sweep_cases(
    *,
    seqs: Sequence[int],
    dtypes: Sequence[str],
    head_dims: Sequence[int],
    causal: Sequence[str | None],
    device: str,
    tokens: int | None = None,
    batch: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    mask: str = "none",
    queries: int | None = None,
) -> list[BenchCase]:
    """Every combination: ``Tk = seq`` keys, and ``Tq = seq`` queries (self-attention)
    or ``Tq = queries`` (``queries=1``: one decoding step against a cache of ``seq``).

    The batch is ``batch``, or ``tokens // seq`` (at least 1) for a fixed number of
    tokens per batch; the heads are ``heads``, or ``hidden // Dh`` for a fixed model
    width (FlashAttention's benchmarks use 16k tokens and a width of 2048).
    """
    if (tokens is None) == (batch is None):
        raise ValueError("give exactly one of tokens and batch")
    if (hidden is None) == (heads is None):
        raise ValueError("give exactly one of hidden and heads")
    cases = []
    for dtype in dtypes:
        for Dh in head_dims:
            h = heads if heads is not None else max((hidden or 0) // Dh, 1)
            for c in causal:
                for seq in seqs:
                    B = batch if batch is not None else max((tokens or 0) // seq, 1)
                    cases.append(
                        BenchCase(
                            B=B,
                            h=h,
                            g=kv_heads,
                            Tq=seq if queries is None else queries,
                            Tk=seq,
                            Dh=Dh,
                            dtype=dtype,
                            device=device,
                            causal=c,
                            mask=mask,
                        )
                    )
    return cases


def _inputs(case: BenchCase, seed: int) -> Inputs:
    gen = torch.Generator(device=case.device).manual_seed(seed)
    dtype = DTYPES[case.dtype]

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen, device=case.device, dtype=dtype)

    g = case.kv_heads
    mask = None
    if case.mask == "padding":
        lengths = torch.tensor(padding_lengths(case.B, case.Tk), device=case.device)
        mask = valid_lens_to_mask(lengths, 1, case.Tk).unsqueeze(1)  # (B, 1, 1, Tk)
    return Inputs(
        query=randn(case.B, case.h, case.Tq, case.Dh),
        key=randn(case.B, g, case.Tk, case.Dh),
        value=randn(case.B, g, case.Tk, case.Dh),
        attn_mask=mask,
        causal=case.causal,  # type: ignore[arg-type]
        scale=None,
    )


# ------------------------------------------------------------------------------- timing


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_calls(
    calls: Sequence[Callable[[], Any]], *, warmup: int, runs: int, device: str
) -> list[float]:
    """Seconds of each of ``runs`` calls, rotating through ``calls``, after ``warmup``."""
    for i in range(warmup):
        calls[i % len(calls)]()
    _sync(device)
    times = []
    for i in range(runs):
        call = calls[i % len(calls)]
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return times


def _proc_status(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _trim_heap() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _peak_bytes(call: Callable[[], Any], device: str) -> int | None:
    """Memory one call adds at its peak (see the module docstring for the method)."""
    if device == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()
        call()
        _sync(device)
        return max(torch.cuda.max_memory_allocated() - allocated, 0)
    _trim_heap()
    before: int | None = _proc_status("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    except OSError:
        before = None
    if before is None:  # not Linux: the process's lifetime peak, in kilobytes or bytes
        scale = 1 if sys.platform == "darwin" else 1024
        start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        call()
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale - start, 0)
    call()
    peak = _proc_status("VmHWM")
    return None if peak is None else max(peak - before, 0)


def measure_matmul_peak(dtype: str, device: str, *, n: int = 8192, runs: int = 10) -> float:
    """The device's measured matmul rate in TFLOP/s: the median of ``runs`` ``n x n``
    matmuls in ``dtype`` (the denominator of the fraction of peak)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen, device=device, dtype=DTYPES[dtype]) for _ in range(2))
    times = _time_calls([lambda: a @ b], warmup=3, runs=runs, device=device)
    return 2 * n**3 / statistics.median(times) / 1e12


# ------------------------------------------------------------------------------ running


@dataclass
class BenchResult:
    """One row: a backend on a case."""

    backend: str
    case: BenchCase
    status: str  # "ok", "skipped" (declared or refused) or "error"
    flops: int
    median_s: float | None = None
    tflops: float | None = None
    peak_fraction: float | None = None
    peak_mem_bytes: int | None = None
    runs: int = 0
    note: str = ""

    def row(self) -> dict[str, Any]:
        """A flat dict for CSV and JSON."""
        out = asdict(self.case)
        out.update(
            backend=self.backend,
            status=self.status,
            flops=self.flops,
            median_ms=None if self.median_s is None else round(self.median_s * 1e3, 6),
            tflops=None if self.tflops is None else round(self.tflops, 6),
            peak_fraction=None if self.peak_fraction is None else round(self.peak_fraction, 6),
            peak_mem_mib=None
            if self.peak_mem_bytes is None
            else round(self.peak_mem_bytes / 2**20, 3),
            runs=self.runs,
            note=self.note,
        )
        return out


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}"[:300]


def run_case(
    backend: Backend,
    case: BenchCase,
    *,
    warmup: int = 2,
    runs: int = 10,
    rotate: int = 3,
    peak_tflops: float | None = None,
    memory: bool = True,
) -> BenchResult:
    """Time ``backend`` on ``case``; never raises for what the backend does."""
    flops = case_flops(case)
    reason = backend.available(case.device)
    if reason is not None:
        return BenchResult(backend.name, case, "skipped", flops, note=reason)
    try:
        sets = [_inputs(case, seed) for seed in range(max(rotate, 1))]
    except torch.OutOfMemoryError as e:
        return BenchResult(backend.name, case, "skipped", flops, note=_first_line(e))
    args_kwargs = [backend_call(backend, inputs) for inputs in sets]
    declared = skip_reason(backend, sets[0], args_kwargs[0][1])
    if declared is not None:
        return BenchResult(backend.name, case, "skipped", flops, note=declared)
    calls = [functools.partial(backend, *a, **k) for a, k in args_kwargs]
    try:
        with torch.inference_mode():
            times = _time_calls(calls, warmup=warmup, runs=runs, device=case.device)
            peak = _peak_bytes(calls[0], case.device) if memory else None
    except Exception as e:  # a refusal, an unsupported shape, out of memory: reported
        refused = any(r in str(e) for r in backend.capabilities.refuses)
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        status = "skipped" if refused or oom else "error"
        return BenchResult(backend.name, case, status, flops, note=_first_line(e))
    finally:
        del sets, args_kwargs, calls
        if case.device == "cuda":
            torch.cuda.empty_cache()
    median = statistics.median(times)
    tflops = flops / median / 1e12
    return BenchResult(
        backend.name,
        case,
        "ok",
        flops,
        median_s=median,
        tflops=tflops,
        peak_fraction=None if not peak_tflops else tflops / peak_tflops,
        peak_mem_bytes=peak,
        runs=runs,
    )


def run_benchmarks(
    backends: Sequence[Backend],
    cases: Sequence[BenchCase],
    *,
    warmup: int = 2,
    runs: int = 10,
    rotate: int = 3,
    peak_tflops: float | None = None,
    memory: bool = True,
    progress: bool | None = None,
    budget_s: float | None = None,
    on_result: Callable[[list[BenchResult]], None] | None = None,
) -> list[BenchResult]:
    """Every backend on every case, with a progress bar (``None``: on a terminal only).

    Runtime shape checking is off while it runs (the reference's checker would add a
    fixed cost per call), and restored after. Once ``budget_s`` seconds have passed, the
    remaining rows are ``skipped`` ("time budget spent") rather than run; ``on_result``
    gets the rows so far after each one (to save them as they come)."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    results: list[BenchResult] = []
    was_checking = checking_enabled()
    set_checking(False)
    bar = tqdm(
        total=len(backends) * len(cases),
        desc="bench",
        disable=None if progress is None else not progress,
    )
    try:
        for case in cases:
            for backend in backends:
                bar.set_postfix_str(f"{backend.name} {case.label}")
                if deadline is not None and time.monotonic() > deadline:
                    note = f"time budget spent ({budget_s:g} s)"
                    result = BenchResult(backend.name, case, "skipped", case_flops(case), note=note)
                else:
                    result = run_case(
                        backend,
                        case,
                        warmup=warmup,
                        runs=runs,
                        rotate=rotate,
                        peak_tflops=peak_tflops,
                        memory=memory,
                    )
                results.append(result)
                if on_result is not None:
                    on_result(results)
                bar.update()
    finally:
        bar.close()
        set_checking(was_checking)
    return results


# ------------------------------------------------------------------------------ output


def environment(device: str) -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
    }
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def write_results(
    results: Sequence[BenchResult], out_dir: str | Path, *, meta: dict[str, Any]
) -> list[Path]:
    """``bench.csv`` and ``bench.json`` (rows and ``meta``) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.row() for r in results]
    csv_path = out / "bench.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["backend"])
        writer.writeheader()
        writer.writerows(rows)
    json_path = out / "bench.json"
    json_path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    return [csv_path, json_path]


def plot_results(
    results: Sequence[BenchResult],
    path: str | Path,
    *,
    title: str = "",
    references: Sequence[dict[str, Any]] = (),
) -> Path:
    """TFLOP/s against sequence length, one line per backend, one panel per
    (dtype, causal, mask, Dh). ``references``: published figures drawn as dashed lines
    (``{"label", "dtype", "causal", "Dh", "seq", "tflops"}``), for scale.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'attnref[viz]'``).
    """
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("the plot needs matplotlib: pip install 'attnref[viz]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "ok"]
    panels: dict[tuple[str, str, str, int], list[BenchResult]] = {}
    for r in ok:
        key = (r.case.dtype, r.case.causal or "none", r.case.mask, r.case.Dh)
        panels.setdefault(key, []).append(r)
    keys = sorted(panels) or [("", "", "", 0)]
    cols = min(len(keys), 4)
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False, constrained_layout=True
    )
    for ax, key in zip(axes.flat, keys, strict=False):
        by_backend: dict[str, list[BenchResult]] = {}
        for r in panels.get(key, []):
            by_backend.setdefault(r.backend, []).append(r)
        for name, rs in sorted(by_backend.items()):
            rs.sort(key=lambda r: r.case.Tk)
            ax.plot([r.case.Tk for r in rs], [r.tflops for r in rs], marker="o", label=name)
        dtype, causal, mask, Dh = key
        for ref in references:
            if (ref["dtype"], ref["causal"], ref["Dh"]) == (dtype, causal != "none", Dh):
                ax.plot(ref["seq"], ref["tflops"], linestyle="--", marker="x", label=ref["label"])
        ax.set_xscale("log", base=2)
        seqs = sorted({r.case.Tk for r in panels.get(key, [])})
        ax.set_xticks(seqs, [str(t) for t in seqs], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        causal_text = "non-causal" if causal == "none" else f"causal ({causal})"
        mask_text = "" if mask in ("none", "") else f", {mask}"
        ax.set_title(f"{dtype}, {causal_text}{mask_text}, Dh={Dh}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def format_table(results: Sequence[BenchResult]) -> str:
    """A plain-text table of the results, one line per row."""
    lines = [
        f"{'backend':<22} {'case':<52} {'median ms':>10} {'TFLOP/s':>9} {'of peak':>8} "
        f"{'peak MiB':>9}  note"
    ]
    for r in results:
        med = "" if r.median_s is None else f"{r.median_s * 1e3:.3f}"
        tf = "" if r.tflops is None else f"{r.tflops:.4f}"
        frac = "" if r.peak_fraction is None else f"{r.peak_fraction:.1%}"
        mem = "" if r.peak_mem_bytes is None else f"{r.peak_mem_bytes / 2**20:.1f}"
        note = r.note if r.status == "ok" else f"{r.status}: {r.note}"
        note = note if len(note) <= 90 else note[:87] + "..."
        lines.append(
            f"{r.backend:<22} {r.case.label:<52} {med:>10} {tf:>9} {frac:>8} {mem:>9}  {note}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------- CLI


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
        help="measure the device's matmul peak in the first dtype and use it",
    )
    p.add_argument("--no-memory", action="store_true", help="do not measure peak memory")
    p.add_argument("--out", default="attnref-bench", metavar="DIR", help="default: ./attnref-bench")
    p.add_argument("--no-plot", action="store_true", help="no PNG (matplotlib not needed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


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
    backends = []
    for spec in args.backends or DEFAULT_BACKENDS:
        try:
            backends.append(resolve_backend(spec))
        except BackendError as e:
            return _fail(str(e))
    causal: list[str | None] = (
        [None, args.alignment] if args.both else [args.alignment if args.causal else None]
    )
    try:
        cases = sweep_cases(
            seqs=seqs,
            dtypes=dtypes,
            head_dims=args.head_dim,
            causal=causal,
            device=device,
            tokens=None if args.batch else (args.tokens or (16384 if gpu else 2048)),
            batch=args.batch,
            hidden=None if args.heads else (args.hidden or (2048 if gpu else 512)),
            heads=args.heads,
            kv_heads=args.kv_heads,
            mask=args.mask,
            queries=args.queries,
        )
    except ValueError as e:
        return _fail(str(e))
    peak = args.peak_tflops
    if args.measure_peak:
        peak = measure_matmul_peak(dtypes[0], device, n=8192 if gpu else 1024)
        print(f"measured {dtypes[0]} matmul peak on {device}: {peak:.2f} TFLOP/s")
    results = run_benchmarks(
        backends,
        cases,
        warmup=args.warmup,
        runs=args.runs,
        peak_tflops=peak,
        memory=not args.no_memory,
        progress=False if args.no_progress else None,
    )
    print(format_table(results))
    meta = {
        "device": device,
        "environment": environment(device),
        "peak_tflops": peak,
        "peak_source": "measured matmul" if args.measure_peak else ("given" if peak else None),
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
    return 1 if any(r.status == "error" for r in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m attnref.bench``: the same as ``attnref bench``."""
    parser = argparse.ArgumentParser(
        prog="python -m attnref.bench", description=__doc__.split("\n\n")[0]
    )
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
