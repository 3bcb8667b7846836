"""Running every backend on every case, never raising for what a backend does."""

import functools
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from tqdm import tqdm

from attnref._checking import checking_enabled, set_checking
from attnref.bench.cases import BenchCase, bench_inputs, case_flops
from attnref.bench.timing import peak_bytes, time_calls
from attnref.conformance.backends import Backend
from attnref.conformance.calls import backend_call, skip_reason

#: "ok", "skipped" (declared, refused, out of memory) or "error" (the backend raised)
BenchStatus = Literal["ok", "skipped", "error"]

__all__ = ["BenchResult", "BenchStatus", "environment", "run_benchmarks", "run_case"]


@dataclass
class BenchResult:
    """One row: a backend on a case."""

    backend: str
    case: BenchCase
    status: BenchStatus
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
        sets = [bench_inputs(case, seed) for seed in range(max(rotate, 1))]
    except torch.OutOfMemoryError as e:
        return BenchResult(backend.name, case, "skipped", flops, note=_first_line(e))
    args_kwargs = [backend_call(backend, inputs) for inputs in sets]
    declared = skip_reason(backend, sets[0], args_kwargs[0][1])
    if declared is not None:
        return BenchResult(backend.name, case, "skipped", flops, note=declared)
    calls = [functools.partial(backend, *a, **k) for a, k in args_kwargs]
    try:
        with torch.inference_mode():
            times = time_calls(calls, warmup=warmup, runs=runs, device=case.device)
            peak = peak_bytes(calls[0], case.device) if memory else None
    except Exception as e:  # a refusal, an unsupported shape, out of memory: reported
        refused = any(r in str(e) for r in backend.capabilities.refuses)
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        status: BenchStatus = "skipped" if refused or oom else "error"
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
