"""Command line: ``attnref audit`` (``python -m attnref audit`` works too)."""

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

import torch

from attnref import __version__

__all__ = ["main"]

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnref",
        description="Reference attention and a conformance suite for attention backends.",
    )
    parser.add_argument("--version", action="version", version=f"attnref {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser(
        "audit",
        help="audit an attention backend against the float64 reference",
        description=(
            "Compare a backend with the float64 reference over a fixed grid of cases "
            "(masks, causal alignments, GQA, layouts, odd lengths, half precision). "
            "Exit code 0 only if nothing failed."
        ),
    )
    a.add_argument(
        "--backend",
        default="torch-sdpa",
        help="a built-in name (see --list-backends) or module:function (default: torch-sdpa)",
    )
    a.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    a.add_argument(
        "--dtype",
        action="append",
        choices=sorted(DTYPES),
        help="dtype to audit, repeatable (default: float32, float16, bfloat16)",
    )
    a.add_argument("--json", metavar="PATH", help="also write the JSON report to PATH")
    a.add_argument("--timeout", type=float, default=60.0, help="seconds allowed per case")
    a.add_argument("--list-backends", action="store_true", help="list built-in backends")
    a.add_argument(
        "--no-progress", action="store_true", help="no progress bar (none when not a terminal)"
    )
    a.add_argument("--verbose", "-v", action="store_true", help="tracebacks and skip reasons")
    return parser


def _audit(args: argparse.Namespace) -> int:
    from attnref.conformance import BUILTIN_BACKENDS, BackendError, audit, resolve_backend
    from attnref.conformance.runner import DEFAULT_DTYPES

    if args.list_backends:
        for name, b in BUILTIN_BACKENDS.items():
            print(f"{name:<20} {b.description}")
        return 0
    if os.getcwd() not in sys.path:  # `module:function` may name a file in this folder
        sys.path.insert(0, os.getcwd())
    try:
        backend = resolve_backend(args.backend)
    except BackendError as e:
        print(f"attnref audit: {e}", file=sys.stderr)
        return 2
    device = args.device
    if device is not None and device not in ("cpu", "cuda"):
        print(f"attnref audit: unknown device {device!r}: use cpu or cuda", file=sys.stderr)
        return 2
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "attnref audit: --device cuda asked for, but no CUDA device is present", file=sys.stderr
        )
        return 2
    dtypes = [DTYPES[d] for d in args.dtype] if args.dtype else list(DEFAULT_DTYPES)
    report = audit(
        backend,
        device=device,
        dtypes=dtypes,
        timeout=args.timeout,
        progress=not args.no_progress and sys.stderr.isatty(),
    )
    print(report.format_table(verbose=args.verbose))
    if args.json:
        report.write_json(args.json)
        print(f"report written to {args.json}")
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnref`` command; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "audit":
            return _audit(args)
    except Exception as e:  # an internal error: one line unless --verbose
        if getattr(args, "verbose", False):
            traceback.print_exc()
        else:
            print(
                f"attnref: internal error: {type(e).__name__}: {e} "
                "(run with --verbose for the traceback)",
                file=sys.stderr,
            )
        return 3
    return 2


if __name__ == "__main__":
    sys.exit(main())
