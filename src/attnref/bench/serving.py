"""``attnref bench --api NAME`` for a family with a serving workload: tokens per second.

The family says what one call of a `ServingCase` shape is (`ApiFamily.workload`: its
arguments, label and tokens; flash-kvcache's is one decoding step against a contiguous
or shuffled paged cache, flash-varlen's one packed causal prefill); the rate is the
workload's tokens over the median call.

Each backend runs in its supervised worker and is timed and verified as the dense bench
is (`attnref.bench.verified`): new values before every timed call, the time the
judge's clock saw less clean dry runs, every output checked whole against attnref's
reference in float64; shape checking is off while it runs. A backend that is
absent, or not declared for the dtype, gets a ``skipped`` row; one that raises, an
``error`` row. Rows are written as CSV and JSON.
"""

import csv
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from attnref._checking import checking_enabled, set_checking
from attnref.bench.cases import serving_call, workload_of
from attnref.conformance.backends import Backend
from attnref.conformance.families import FAMILIES
from attnref.conformance.workloads import ServingCase
from attnref.devices import DTYPES

__all__ = [
    "SERVING_BACKENDS",
    "ServingCase",
    "ServingResult",
    "format_serving",
    "run_serving",
    "serving_call",
    "serving_cli",
    "workload_of",
    "write_serving",
]

#: the backends each serving family's benchmark runs by default (absent ones skipped)
SERVING_BACKENDS: dict[str, tuple[str, ...]] = {
    name: family.bench_backends for name, family in FAMILIES.items() if family.workload
}


@dataclass
class ServingResult:
    """One row: a backend on a case."""

    backend: str
    case: ServingCase
    #: as the dense bench's (`attnref.bench.runner.BenchStatus`)
    status: Literal["ok", "skipped", "error", "wrong", "flagged"]
    median_s: float | None = None
    tokens_per_s: float | None = None
    runs: int = 0
    note: str = ""
    #: the workload's bytes over the median (`Workload.bytes`), or None
    gb_per_s: float | None = None

    def row(self) -> dict[str, Any]:
        out = asdict(self.case)
        out.update(
            backend=self.backend,
            status=self.status,
            median_ms=None if self.median_s is None else round(self.median_s * 1e3, 6),
            tokens_per_s=None if self.tokens_per_s is None else round(self.tokens_per_s, 3),
            runs=self.runs,
            note=self.note,
            gb_per_s=None if self.gb_per_s is None else round(self.gb_per_s, 3),
        )
        return out


def _skip(backend: Backend, case: ServingCase) -> str | None:
    caps = backend.capabilities
    if backend.api != case.api:
        return f"a backend of the {backend.api!r} family, not {case.api!r}"
    reason = backend.available(case.device)
    if reason is not None:
        return reason
    if DTYPES[case.dtype] not in caps.dtypes:
        return f"dtype {case.dtype} not declared"
    if case.page and not caps.paged:
        return "a paged cache not declared"
    if case.page % caps.page_multiple:
        return f"page size {case.page}: the declared sizes are multiples of {caps.page_multiple}"
    return workload_of(case).refused(caps)


def _verify(case: ServingCase, seed: int, raw: Any, what: str, draw: int = 0) -> str | None:
    """Why ``raw``, the output of the call on seed ``seed``'s values, is wrong, or None:
    it must match attnref's reference in float64 within 16 times the reference's own
    error in the case's dtype (at least that dtype's epsilon), times max |V|. Every row
    (a serving call's queries are few: ``draw`` is not needed)."""
    from attnref.conformance.backends import BUILTIN_BACKENDS

    reference = BUILTIN_BACKENDS[workload_of(case).oracle]

    def f64(x: Any) -> Any:
        return x.to(torch.float64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    workload = workload_of(case)
    args, kwargs = serving_call(case, seed)
    exact = workload.output(reference(*map(f64, args), **{k: f64(v) for k, v in kwargs.items()}))
    args, kwargs = serving_call(case, seed)  # the reference appends to the cache
    rounded = workload.output(reference(*args, **kwargs))
    raw = workload.output(raw)
    assert isinstance(exact, torch.Tensor)
    assert isinstance(rounded, torch.Tensor)
    if type(raw) is not torch.Tensor:
        return f"{what}: returned {type(raw).__name__}, not a tensor"
    if raw.shape != exact.shape or raw.dtype != DTYPES[case.dtype]:
        return f"{what}: returned {tuple(raw.shape)} {raw.dtype}, expected {tuple(exact.shape)}"
    got = raw.to(device=exact.device, dtype=torch.float64)
    if not bool(torch.isfinite(got).all()):
        return f"{what}: NaN/inf values where the reference is finite"
    own = float((rounded.to(torch.float64) - exact).abs().max()) if exact.numel() else 0.0
    values = workload.values(args)
    assert isinstance(values, torch.Tensor)
    scale = max(1.0, float(values.abs().max()))
    bound = 16 * max(own, torch.finfo(DTYPES[case.dtype]).eps) * scale
    error = float((got - exact).abs().max()) if exact.numel() else 0.0
    if error > bound:
        return f"{what}: max error {error:.3g} against attnref's reference (bound {bound:.3g})"
    return None


def _verify_for(case: ServingCase) -> Any:
    return lambda seed, raw, what, draw: _verify(case, seed, raw, what, draw)


def run_serving(
    backends: Sequence[Backend | str],
    cases: Sequence[ServingCase],
    *,
    warmup: int = 2,
    runs: int = 10,
    rotate: int = 2,
    progress: bool | None = None,
    isolate: bool = True,
    timeout: float = 600.0,
) -> list[ServingResult]:
    """Every backend on every case, each in its supervised worker (``isolate=False``: in
    this process, trusted), timed and verified as the dense bench is
    (`attnref.bench.verified.measure`); never raises for what a backend does. A spec is
    resolved in the worker only, in the family of the first case. ``rotate`` is kept for
    compatibility: every call now has values of its own."""
    from attnref.bench.verified import JOBS, CleanLoop
    from attnref.conformance.backends import BackendError, load_backend
    from attnref.conformance.worker import Executor, InProcess, Supervised

    results = []
    was_checking = checking_enabled()
    set_checking(False)
    api = cases[0].api if cases else None
    workers: list[tuple[str, Executor | str]] = []
    clean = CleanLoop(isolate=isolate)  # the dry loops: no backend code runs there
    for b in backends:
        name = b if isinstance(b, str) else b.name
        try:
            threads = torch.get_num_threads()
            if isolate:
                worker: Executor = Supervised(b, api, threads=threads, jobs=JOBS)
            else:  # trusted; the bench's jobs register in this process when measured
                worker = InProcess(load_backend(b, api) if isinstance(b, str) else b)
            workers.append((name, worker))
        except BackendError as e:
            workers.append((name, str(e)))
    bar = tqdm(
        total=len(backends) * len(cases),
        desc="bench",
        disable=None if progress is None else not progress,
    )
    try:
        for case in cases:
            for name, executor in workers:
                bar.set_postfix_str(f"{name} {workload_of(case).label}")
                if isinstance(executor, str):
                    results.append(ServingResult(name, case, "error", note=executor))
                else:
                    results.append(_run_one(executor, case, warmup, runs, timeout, clean))
                bar.update()
    finally:
        bar.close()
        for _, executor in workers:
            if not isinstance(executor, str):
                executor.close()
        clean.close()
        set_checking(was_checking)
    return results


def _run_one(
    executor: Any, case: ServingCase, warmup: int, runs: int, timeout: float, clean: Any = None
) -> ServingResult:
    from attnref.bench.verified import measure
    from attnref.conformance.calls import availability

    backend: Backend = executor.backend
    reason = availability(backend, case.device, timeout, executor) or _skip(backend, case)
    if reason is not None:
        return ServingResult(backend.name, case, "skipped", note=reason)
    m = measure(
        backend,
        executor,
        asdict(case),
        _verify_for(case),
        device=case.device,
        warmup=warmup,
        runs=runs,
        memory=False,
        timeout=timeout,
        clean=clean,
    )
    if m.times is None or m.status != "ok":
        status: Any = m.status
        median = None if m.times is None else statistics.median(m.times)
        return ServingResult(backend.name, case, status, median, None, runs, m.note)
    median = statistics.median(m.times)
    work = workload_of(case)
    note, rate = m.note, None
    if work.bytes:
        rate = work.bytes / median / 1e9
        note = f"{rate:,.1f} GB/s of cache read; {note}"
    return ServingResult(backend.name, case, "ok", median, work.tokens / median, runs, note, rate)


def format_serving(results: Sequence[ServingResult]) -> str:
    """The terminal table."""
    lines = [f"{'backend':<22} {'case':<58} {'median':>10} {'tokens/s':>12}  note"]
    for r in results:
        med = "-" if r.median_s is None else f"{r.median_s * 1e3:.3f} ms"
        rate = "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}"
        lines.append(
            f"{r.backend:<22} {workload_of(r.case).label:<58} {med:>10} {rate:>12}  {r.note}"
        )
    return "\n".join(lines)


def write_serving(
    results: Sequence[ServingResult], out: str | Path, meta: dict[str, Any]
) -> list[Path]:
    """``serving.csv`` and ``serving.json`` (rows and ``meta``) in ``out``."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [r.row() for r in results]
    csv_path, json_path = folder / "serving.csv", folder / "serving.json"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["backend"])
        writer.writeheader()
        writer.writerows(rows)
    json_path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    return [csv_path, json_path]


def serving_cli(api: str, args: Any, device: str, seqs: list[int], dtypes: list[str]) -> int:
    """``attnref bench --api NAME`` for a family with a serving workload
    (`ApiFamily.workload`: flash-kvcache, flash-varlen); the exit code."""
    from attnref.bench.runner import environment
    from attnref.conformance.backends import BackendError, resolve_backend
    from attnref.conformance.worker import start_forkserver

    def _fail(message: str) -> int:
        print(f"attnref bench: {message}", file=sys.stderr)
        return 2

    family_pages = FAMILIES[api].serving_pages
    pages = args.page_size if args.page_size is not None else list(family_pages)
    if any(p < 0 for p in pages):
        return _fail(f"--page-size values must be >= 0 (0: contiguous), got {pages}")
    if family_pages == (0,):  # a workload without pages
        pages = [0]

    start_forkserver()
    backends: list[str] = list(args.backends or SERVING_BACKENDS[api])
    for spec in backends:  # a name is looked up here; module:function only in a worker
        if ":" not in spec:
            try:
                b = resolve_backend(spec, api)
            except BackendError as e:
                return _fail(str(e))
            if b.api != api:
                return _fail(f"{b.name} is a backend of the {b.api!r} family, not {api!r}")
    Dh = args.head_dim[0]
    h = args.heads or max(1, (args.hidden or 512) // Dh)
    g = args.kv_heads or h
    try:
        cases = [
            ServingCase(api, args.batch or 8, h, g, Dh, seq, page, dtype, device)
            for dtype in dtypes
            for seq in seqs
            for page in pages
        ]
    except ValueError as e:
        return _fail(str(e))
    results = run_serving(
        backends,
        cases,
        warmup=args.warmup,
        runs=args.runs,
        progress=False if args.no_progress else None,
    )
    print(format_serving(results))
    meta = {
        "device": device,
        "environment": environment(device),
        "warmup": args.warmup,
        "runs": args.runs,
        "command": " ".join(sys.argv),
    }
    written = write_serving(results, args.out, meta)
    print("written: " + ", ".join(str(p) for p in written))
    return 1 if any(r.status in ("error", "wrong", "flagged") for r in results) else 0
