"""Audit every torch SDPA kernel, forced, in float16 and bfloat16, on the best device.

The GPU half of the conformance issue: run on a machine with CUDA (it needs nothing but
this repository and an environment with torch, so it runs without network), it writes
one JSON report per backend and a summary table to ``--out`` (default
``docs/gpu-audit``). On a CPU it runs the same code at the same sizes, with the kernels
that do not exist there skipped, which is how CI keeps this path working.

    python tools/gpu_audit.py                      # quick profile, best device
    python tools/gpu_audit.py --profile ci --out docs/gpu-audit
"""

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from attnref import set_checking
from attnref.conformance import BackendError, audit
from attnref.conformance.options import OptionError, add_audit_options, audit_settings
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
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_audit_options(parser.add_argument)
    parser.add_argument("--out", default="docs/gpu-audit")
    parser.add_argument("--backend", action="append", help="default: every torch kernel")
    args = parser.parse_args(argv)
    try:
        settings = audit_settings(lambda dest: getattr(args, dest))
    except OptionError as e:
        parser.error(str(e))
    device = settings.device
    if settings.dtypes is None:  # the dtypes the fused GPU kernels exist for
        settings = replace(settings, dtypes=(torch.float16, torch.bfloat16))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    set_checking(False)  # the reference's shape checks are not what is audited here
    dtypes = ", ".join(dtype_name(d) for d in settings.dtypes or ())
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    lines = [
        f"# torch SDPA kernels audited on {name}",
        "",
        f"`python tools/gpu_audit.py --profile {args.profile} --seed {args.seed}`, "
        f"torch {torch.__version__}, {dtypes}. A cell is passed / failed / skipped "
        "properties; reports and reproducers are the JSON files beside this one.",
        "",
        "| backend | passed | failed | skipped | seconds | failing properties |",
        "|---|---|---|---|---|---|",
    ]
    failed_any = False
    for spec in args.backend or BACKENDS:
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
        failing = ", ".join(sorted(report.failed_properties())) or "-"
        # a kernel that does not exist here is all skips: not a failure of this run
        failed_any |= report.count("fail") > 0 or bool(report.incomplete)
        lines.append(
            f"| `{spec}` | {report.count('pass')} | {report.count('fail')} | "
            f"{report.count('skip')} | {time.perf_counter() - t0:.0f} | {failing} |"
        )
        print(lines[-1], flush=True)
        # after every backend: a run cut short by a time limit keeps what it measured
        (out / "README.md").write_text("\n".join(lines) + "\n")
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
