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
            "Search for inputs on which a backend breaks a property of attention "
            "(agreement with the float64 oracle, gradients, masking, causality, "
            "GQA, layouts, odd lengths, half precision, ...), shrink every failure to a "
            "minimal case and print a reproducer. Exit code 0 only if nothing failed."
        ),
    )
    a.add_argument(
        "--backend",
        default="torch-sdpa",
        help="a built-in name or mutant.NAME (see --list-backends), or module:function "
        "(default: torch-sdpa)",
    )
    a.add_argument(
        "--profile",
        default="quick",
        choices=["quick", "ci", "thorough"],
        help="how hard to search: quick (< 1 min), ci (< 5 min), thorough (nightly)",
    )
    a.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    a.add_argument(
        "--dtype",
        action="append",
        choices=sorted(DTYPES),
        help="dtype to audit, repeatable (default: every dtype the backend declares)",
    )
    a.add_argument(
        "--property",
        action="append",
        metavar="ID",
        help="audit only this property, repeatable (see --list-properties)",
    )
    a.add_argument("--seed", type=int, default=0, help="seed of the search (default: 0)")
    a.add_argument("--json", metavar="PATH", help="also write the JSON report (and reproducers)")
    a.add_argument("--timeout", type=float, default=60.0, help="seconds allowed per call")
    a.add_argument("--fail-fast", action="store_true", help="stop at the first failing property")
    a.add_argument("--no-grad", action="store_true", help="leave out the gradient property")
    a.add_argument(
        "--list-backends", action="store_true", help="list built-in backends and mutants"
    )
    a.add_argument(
        "--list-properties", action="store_true", help="list the properties and what they target"
    )
    a.add_argument(
        "--no-progress", action="store_true", help="no progress bar (none when not a terminal)"
    )
    a.add_argument(
        "--verbose", "-v", action="store_true", help="tracebacks, skip reasons, all reproducers"
    )
    return parser


def _list_backends() -> None:
    from attnref.conformance import BUILTIN_BACKENDS
    from attnref.conformance.mutants import MUTANTS

    for name, b in BUILTIN_BACKENDS.items():
        print(f"{name:<32} {b.description}")
    print()
    for name, m in MUTANTS.items():
        print(f"{'mutant.' + name:<32} class {m.bug_class:>2}: {m.summary}")


def _list_properties() -> None:
    from attnref.conformance import PROPERTIES

    for p in PROPERTIES.values():
        classes = ",".join(str(c) for c in p.classes)
        print(f"{p.id:<18} classes {classes:<22} {p.summary}")


def _audit(args: argparse.Namespace) -> int:
    from attnref.conformance import PROPERTIES, BackendError, audit, resolve_backend

    if args.list_backends:
        _list_backends()
        return 0
    if args.list_properties:
        _list_properties()
        return 0
    if os.getcwd() not in sys.path:  # `module:function` may name a file in this folder
        sys.path.insert(0, os.getcwd())
    try:
        backend = resolve_backend(args.backend)
    except BackendError as e:
        print(f"attnref audit: {e}", file=sys.stderr)
        return 2
    unknown = [p for p in args.property or [] if p not in PROPERTIES]
    if unknown:
        print(
            f"attnref audit: unknown property {unknown[0]!r}: see --list-properties",
            file=sys.stderr,
        )
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
    report = audit(
        backend,
        profile=args.profile,
        device=device,
        dtypes=[DTYPES[d] for d in args.dtype] if args.dtype else None,
        seed=args.seed,
        properties=args.property,
        timeout=args.timeout,
        fail_fast=args.fail_fast,
        gradients=not args.no_grad,
        progress=not args.no_progress and sys.stderr.isatty(),
    )
    print(report.format_table(verbose=args.verbose))
    if args.json:
        written = report.write_json(args.json)
        print(f"report written to {args.json}")
        if len(written) > 1:
            print(f"reproducers written to {written[1].parent}/")
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
