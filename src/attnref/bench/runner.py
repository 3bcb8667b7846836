"""Running every backend on every case, never raising for what a backend does."""

import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from tqdm import tqdm

from attnref._checking import checking_enabled, set_checking
from attnref.bench.cases import BenchCase, bench_inputs, case_bytes, case_flops
from attnref.bench.verified import JOBS, CleanLoop, measure
from attnref.conformance.backends import Backend, BackendError
from attnref.conformance.calls import backend_call, skip_reason
from attnref.conformance.family import family_of
from attnref.conformance.verdicts import Failure, Skip
from attnref.conformance.worker import Executor, InProcess, start_executor

#: "ok" (timed, outputs verified, clocks agree), "skipped" (declared, refused, out of
#: memory), "error" (the backend raised), "wrong" (an output checked against the oracle
#: was wrong: no rate is given) or "flagged" (the worker's clock disagrees with the
#: judge's, or the rate is above the device's peak: no rate is given)
BenchStatus = Literal["ok", "skipped", "error", "wrong", "flagged"]

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
    #: seconds this row took in all (prepare, timed and dry batches, checks), and of
    #: them the oracle's checks of the sampled outputs: the cost of verification
    wall_s: float | None = None
    verify_s: float | None = None

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
            wall_s=None if self.wall_s is None else round(self.wall_s, 4),
            verify_s=None if self.verify_s is None else round(self.verify_s, 4),
        )
        return out


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    name = getattr(e, "type_name", type(e).__name__)
    return f"{name}: {text}"[:300]


def _verify(
    backend: Backend, case: BenchCase, seed: int, raw: Any, what: str, draw: int
) -> str | None:
    """Why the output ``raw`` of the call on seed ``seed``'s values is wrong, or None: on
    `SAMPLE_ROWS` query rows drawn from ``draw`` (every row of a shorter case), each
    against the float64 oracle at the cost of one row."""
    from attnref.conformance.calls import check_output
    from attnref.conformance.checks import SAMPLE_ROWS, sample_rows
    from attnref.conformance.family import family_of
    from attnref.conformance.oracle import close, expect

    inputs = bench_inputs(case, seed)
    Tq = inputs.query.shape[-2]
    rows = sample_rows(Tq, draw).to(inputs.query.device) if Tq > SAMPLE_ROWS else None
    try:
        out, _ = family_of(backend).read(raw, inputs, False)
        shape = (*inputs.query.shape[:-1], inputs.value.shape[-1])
        got = check_output(out, shape, inputs).to(torch.float64)
        native = family_of(backend).native_causal(backend.capabilities, inputs)
        policy = backend.capabilities.for_dtype(inputs.query.dtype).empty_row
        exp = expect(inputs, policy, native, rows)
        close(got, exp.value, *exp.bounds(), "output", exp.known)
    except Failure as f:
        return f"{what}: {f}"
    return None


def run_case(
    backend: Backend,
    case: BenchCase,
    *,
    executor: Executor | None = None,
    warmup: int = 2,
    runs: int = 10,
    rotate: int = 3,
    peak_tflops: float | None = None,
    memory: bool = True,
    timeout: float = 600.0,
    seed: int = 0,
    clean: CleanLoop | None = None,
    peak_gbps: float | None = None,
) -> BenchResult:
    """Time ``backend`` on ``case`` in its worker (``executor``; default: in this
    process) and check its outputs; never raises for what the backend does.

    The inputs change before every call (``rotate`` is kept for compatibility: every
    call now has values of its own). The first call's output and every timed call's are
    checked against the float64 oracle, each on a sample of its rows drawn after all
    came back: a wrong one makes the row ``wrong``. The time is the judge's: its clock's
    batch less a dry run in a clean worker (``clean``: one of its own by default); the
    worker's per-call times shape the distribution, and a worker whose clock disagrees is
    flagged, as is a rate above the roofline: the declared or measured matmul peak
    (``peak_tflops``), or moving the case's fewest bytes (`case_bytes`) faster than the
    measured memory bandwidth (``peak_gbps``; `attnref.bench.verified.measure`).
    """
    from attnref.conformance.calls import availability

    flops = case_flops(case)
    executor = executor or InProcess(backend)
    reason = availability(backend, case.device, timeout, executor)
    if reason is not None:
        return BenchResult(backend.name, case, "skipped", flops, note=reason)
    try:
        first = bench_inputs(case, seed)
    except torch.OutOfMemoryError as e:
        return BenchResult(backend.name, case, "skipped", flops, note=_first_line(e))
    declared = skip_reason(backend, first, backend_call(backend, first)[1])
    del first  # not held while the backend runs: a large case's inputs
    if declared is not None:
        return BenchResult(backend.name, case, "skipped", flops, note=declared)
    m = measure(
        backend,
        executor,
        asdict(case),
        lambda seed, raw, what, draw: _verify(backend, case, seed, raw, what, draw),
        device=case.device,
        warmup=warmup,
        runs=runs,
        memory=memory,
        timeout=timeout,
        seed=seed,
        clean=clean,
    )
    if m.times is None:  # skipped, an error, or wrong: no time to give
        status: BenchStatus = m.status  # type: ignore[assignment]
        return BenchResult(backend.name, case, status, flops, runs=runs, note=m.note)
    median = statistics.median(m.times)
    tflops = flops / median / 1e12 if median > 0 else math.inf
    status, note = m.status, m.note  # type: ignore[assignment]
    if status == "ok" and peak_tflops and tflops > peak_tflops:
        status, note = (
            "flagged",
            f"{tflops:.3g} TFLOP/s is above the device's peak of {peak_tflops:.3g}",
        )
    gbps = case_bytes(case) / median / 1e9 if median > 0 else math.inf
    if status == "ok" and peak_gbps and gbps > peak_gbps:
        status, note = (
            "flagged",
            f"{gbps:.3g} GB/s (Q, K and V read, the output written, once each) is above "
            f"the device's measured bandwidth of {peak_gbps:.3g} GB/s",
        )
    ok = status == "ok"
    extra = family_of(backend).bench_note
    if ok and extra is not None:  # what the family measures besides (the backend's word)
        try:
            said = extra(executor, *backend_call(backend, bench_inputs(case, seed)), timeout)
        except (Failure, Skip) as e:
            said = f"({str(e)[:100]})"
        note = f"{note}; {said}" if said else note
    return BenchResult(
        backend.name,
        case,
        status,
        flops,
        median_s=median,
        tflops=tflops if ok else None,
        peak_fraction=tflops / peak_tflops if ok and peak_tflops else None,
        peak_mem_bytes=m.peak,
        runs=runs,
        note=note,
        wall_s=m.wall_s,
        verify_s=m.verify_s,
    )


def run_benchmarks(
    backends: Sequence[Backend | str],
    cases: Sequence[BenchCase],
    *,
    api: str | None = None,
    isolate: bool = True,
    warmup: int = 2,
    runs: int = 10,
    rotate: int = 3,
    peak_tflops: float | None = None,
    memory: bool = True,
    progress: bool | None = None,
    peak_gbps: float | None = None,
    budget_s: float | None = None,
    on_result: Callable[[list[BenchResult]], None] | None = None,
    world_size: int | None = None,
) -> list[BenchResult]:
    """Every backend on every case, with a progress bar (``None``: on a terminal only).

    Each backend (a `Backend`, or a spec only its worker resolves, ``api`` its family)
    runs in a supervised worker behind the trust boundary (``isolate=False``: in this
    process, trusted), started once and stopped at the end. Runtime shape checking is off
    while it runs (the reference's checker would add a fixed cost per call), in the
    judge and the workers, and restored after. Once ``budget_s`` seconds have passed, the
    remaining rows are ``skipped`` ("time budget spent") rather than run; ``on_result``
    gets the rows so far after each one (to save them as they come). ``world_size``: the
    processes of a family that spreads each call over several (context-parallel: its
    ranks); its executor puts their shares back together, and the bench times and
    verifies the whole call as one."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    results: list[BenchResult] = []
    was_checking = checking_enabled()
    set_checking(False)
    workers: list[tuple[Backend | str, Executor | str]] = []
    cleans: dict[str, CleanLoop] = {}  # per family, the dry loops: no backend code there
    threads = torch.get_num_threads()  # the workers time with this process's
    for b in backends:
        try:
            worker = start_executor(
                b if isolate else _local(b, api),
                api,
                isolate=isolate,
                threads=threads,
                world_size=world_size,
                jobs=JOBS,
            )
            workers.append((b, worker))
        except BackendError as e:
            workers.append((b, str(e)))
    bar = tqdm(
        total=len(backends) * len(cases),
        desc="bench",
        disable=None if progress is None else not progress,
    )
    try:
        for case in cases:
            for spec, executor in workers:
                name = spec if isinstance(spec, str) else spec.name
                bar.set_postfix_str(f"{name} {case.label}")
                if isinstance(executor, str):  # it could not be resolved
                    result = BenchResult(name, case, "error", case_flops(case), note=executor)
                elif deadline is not None and time.monotonic() > deadline:
                    note = f"time budget spent ({budget_s:g} s)"
                    result = BenchResult(name, case, "skipped", case_flops(case), note=note)
                else:
                    backend = executor.backend
                    clean = cleans.setdefault(
                        backend.api,
                        CleanLoop(isolate=isolate, threads=threads, api=backend.api,
                                  world_size=getattr(executor, "world_size", None)),
                    )  # fmt: skip
                    result = run_case(
                        backend,
                        case,
                        executor=executor,
                        warmup=warmup,
                        runs=runs,
                        rotate=rotate,
                        peak_tflops=peak_tflops,
                        memory=memory,
                        clean=clean,
                        peak_gbps=peak_gbps,
                    )
                results.append(result)
                if on_result is not None:
                    on_result(results)
                bar.update()
    finally:
        bar.close()
        for _, executor in workers:
            if not isinstance(executor, str):
                executor.close()
        for clean in cleans.values():
            clean.close()
        set_checking(was_checking)
    return results


def _local(backend: Backend | str, api: str | None) -> Backend:
    from attnref.conformance.backends import load_backend

    return load_backend(backend, api) if isinstance(backend, str) else backend


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
