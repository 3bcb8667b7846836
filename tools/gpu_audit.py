"""Audit every torch SDPA kernel, forced, in float16 and bfloat16, on the best device.

The GPU half of the conformance issue: run on a machine with CUDA (it needs nothing but
this repository and an environment with torch, so it runs without network), it writes
one JSON report per backend and a summary table to ``--out`` (default
``docs/gpu-audit``). On a CPU it runs the same code at the same sizes, with the kernels
that do not exist there skipped, which is how CI keeps this path working.

    python tools/gpu_audit.py                      # quick profile, best device
    python tools/gpu_audit.py --profile ci --out docs/gpu-audit
    python tools/gpu_audit.py --jobs 8 --deadline 200   # eight audits at once

``--jobs N`` runs up to N audits at once, each in a process of its own (a lent GPU
machine has many cores and one device: the audits' verdicts do not depend on time, so
they may share it). A backend that is not installed, or does not run on the device, is
listed as unavailable with the reason its audit gave: an audit that checked nothing
vouches for nothing, and the table says so rather than counting it passed.
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from attnref import set_checking
from attnref.conformance import BackendError, audit
from attnref.conformance.options import OptionError, add_audit_options, audit_settings
from attnref.conformance.report import AuditReport
from attnref.devices import dtype_name

BACKENDS = (
    "torch-sdpa",
    "torch-sdpa-math",
    "torch-sdpa-flash",
    "torch-sdpa-efficient",
    "torch-sdpa-cudnn",
    "torch-flex",
    "reference",
    # the flash convention: FlashAttention 2 itself where its wheel is installed (skipped
    # with the reason otherwise), and compiled FlexAttention with every variant
    "flash-attn",
    "flash-flex",
    # packed sequences and KV caches: FlashAttention's own entry points where installed,
    # FlexAttention's document masking, compiled, and on gathered caches
    "flash-attn-varlen",
    "flash-attn-kvcache",
    "varlen-flex",
    "kvcache-flex",
    # multi-head latent attention (FlashMLA's call): FlashMLA where installed, and torch's
    # SDPA on the gathered latent rows
    "flash-mla",
    "mla-sdpa",
    # DeepSeek's sparse attention (FlashMLA's sparse prefill and FP8 decode) where
    # flash_mla is installed, and torch's SDPA on the gathered rows
    "flash-mla-sparse",
    "sparse-mla-sdpa",
    "flash-mla-sparse-fp8",
    "sparse-mla-fp8-sdpa",
)

#: options of this tool that a child audit gets from its parent, not from the command
_OWN = ("--backend", "--jobs", "--out", "--row-file")


def _row(spec: str, report: AuditReport, seconds: float) -> str:
    if report.count("pass") == 0 and report.count("fail") == 0 and not report.incomplete:
        reasons = sorted({r.message.split(";")[0] for r in report.results if r.message})
        why = reasons[0][:100] if reasons else "every property skipped"
        failing = f"unavailable here: {why}"
    else:
        failing = ", ".join(sorted(report.failed_properties())) or "-"
        if report.incomplete:
            failing += f" (incomplete: {report.incomplete})"[:140]
    return (
        f"| `{spec}` | {report.count('pass')} | {report.count('fail')} | "
        f"{report.count('skip')} | {seconds:.0f} | {failing} |"
    )


def _child_args(argv: list[str]) -> list[str]:
    """``argv`` less this tool's own options (both ``--opt value`` and ``--opt=value``)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _OWN:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return kept


def _in_parallel(
    specs: list[str], argv: list[str], out: Path, jobs: int, header: list[str]
) -> bool:
    """Audit each spec in a process of its own, ``jobs`` at a time, and rewrite the
    table (``header`` and a row per spec) as each ends: a session cut short by its time
    limit (SIGTERM) keeps the rows of those that ended, and names those it cut off.
    Returns whether any failed (a failure, an incomplete audit, or no report)."""
    rows_dir, logs = out / ".rows", out / "logs"
    rows_dir.mkdir(parents=True, exist_ok=True)
    logs.mkdir(exist_ok=True)
    base = [sys.executable, __file__, *_child_args(argv), "--out", str(out)]
    waiting = list(specs)
    running: dict[str, subprocess.Popen[bytes]] = {}
    rows: dict[str, str] = {}
    started: dict[str, float] = {}
    failed = False

    def table(pending: str) -> None:
        body = [rows.get(s, f"| `{s}` | - | - | - | - | {pending} |") for s in specs]
        (out / "README.md").write_text("\n".join([*header, *body]) + "\n")

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                spec = waiting.pop(0)
                row_file = rows_dir / f"{spec}.md"
                row_file.unlink(missing_ok=True)
                cmd = [*base, "--backend", spec, "--row-file", str(row_file)]
                with (logs / f"{spec}.log").open("w") as log:  # the child holds a copy
                    running[spec] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
                started[spec] = time.perf_counter()
            time.sleep(0.5)
            for spec, proc in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[spec]
                failed |= proc.returncode != 0
                row_file = rows_dir / f"{spec}.md"
                if row_file.exists():
                    rows[spec] = row_file.read_text().strip()
                else:  # it died before its report: the last line of its log says why
                    log_text = (logs / f"{spec}.log").read_text().strip()
                    tail = (log_text.splitlines() or [""])[-1]
                    rows[spec] = (
                        f"| `{spec}` | - | - | - | {time.perf_counter() - started[spec]:.0f} "
                        f"| no report (exit {proc.returncode}): {tail[:100]} |"
                    )
                print(rows[spec], flush=True)
                table("still running")
    finally:
        for spec, proc in running.items():
            proc.kill()
            seconds = time.perf_counter() - started[spec]
            cut = f"| `{spec}` | - | - | - | {seconds:.0f} | cut off by the time limit: no report |"
            rows.setdefault(spec, cut)
        table("not started: the time limit came first")
    return failed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_audit_options(parser.add_argument)
    parser.add_argument("--out", default="docs/gpu-audit")
    parser.add_argument("--backend", action="append", help="default: every torch kernel")
    parser.add_argument("--jobs", type=int, default=1, help="audits at once (default: 1)")
    parser.add_argument("--row-file", help=argparse.SUPPRESS)  # a child's table row
    args = parser.parse_args(argv)
    try:
        settings = audit_settings(lambda dest: getattr(args, dest))
    except OptionError as e:
        parser.error(str(e))
    if args.jobs < 1:
        parser.error(f"--jobs must be 1 or more, not {args.jobs}")
    device = settings.device
    if settings.dtypes is None:  # the dtypes the fused GPU kernels exist for
        settings = replace(settings, dtypes=(torch.float16, torch.bfloat16))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    set_checking(False)  # the reference's shape checks are not what is audited here
    specs = list(args.backend or BACKENDS)
    dtypes = ", ".join(dtype_name(d) for d in settings.dtypes or ())
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    at_once = (
        f" {min(args.jobs, len(specs))} audits ran at once on this device and its "
        f"{_cores()} cores, so a row's seconds are not a single audit's cost."
        if args.jobs > 1 and len(specs) > 1
        else ""
    )
    lines = [
        f"# torch SDPA kernels audited on {name}",
        "",
        f"`python tools/gpu_audit.py {' '.join(argv)}`, torch {torch.__version__}, "
        f"profile {args.profile}, seed {args.seed}, {dtypes}. A cell is passed / failed / "
        f"skipped properties; reports and reproducers are the JSON files beside this "
        f"one.{at_once}",
        "",
        "| backend | passed | failed | skipped | seconds | failing properties |",
        "|---|---|---|---|---|---|",
    ]
    if args.jobs > 1 and len(specs) > 1 and args.row_file is None:
        return 1 if _in_parallel(specs, argv, out, args.jobs, lines) else 0
    failed_any = False
    for spec in specs:
        t0 = time.perf_counter()
        try:  # a spec is resolved in the audit's worker only (the trust boundary)
            report = audit(
                spec, api=settings.api, **settings.audit_kwargs(), progress=sys.stderr.isatty()
            )
        except BackendError as e:
            print(f"{spec}: {e}", file=sys.stderr)
            failed_any = True
            continue
        report.write_json(out / f"{spec}.json")
        # a kernel that does not exist here is all skips: not a failure of this run
        failed_any |= report.count("fail") > 0 or bool(report.incomplete)
        lines.append(_row(spec, report, time.perf_counter() - t0))
        print(lines[-1], flush=True)
        if args.row_file is not None:
            Path(args.row_file).write_text(lines[-1] + "\n")
        else:  # after every backend: a run cut short keeps what it measured
            (out / "README.md").write_text("\n".join(lines) + "\n")
    return 1 if failed_any else 0


def _cores() -> int:
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
