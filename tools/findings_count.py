"""How many findings a whole quick audit of each planted bug gives (docs/conformance.md).

One bug should be one finding, two where it shows in rows that see keys and in rows
that see none. Run from the repository root::

    python tools/findings_count.py --out /tmp/reports mutant.empty_row_uniform ...
    python tools/findings_count.py --out /tmp/reports --family sdpa   # every sdpa mutant
    python tools/findings_count.py --regroup /tmp/reports             # saved reports again
    python tools/findings_count.py --planted --out /tmp/reports --keep tests/data/findings

Each audit's report is saved under ``--out``, so that a change to the grouping alone is
measured again with ``--regroup`` (no audit runs). A spec is ``mutant.NAME`` or
``module:function`` with ``--api``; ``--planted`` adds every planted kernel of
``tests/planted_*.py`` with its family, and ``--keep`` writes each audit's failures where
``tests/test_findings.py`` groups them again (about an hour on 2 cores for all 59). Prints
one line a backend: its findings, its failed
searches and the audit's seconds; ``-v`` lists each finding's title.
"""

import argparse
import sys
import time
import warnings
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", help="mutant.NAME or module:function")
    parser.add_argument("--out", type=Path, help="folder for the reports")
    parser.add_argument("--family", help="every mutant of this API family")
    parser.add_argument("--api", help="the API family of module:function specs")
    parser.add_argument("--regroup", type=Path, help="count the findings of saved reports")
    parser.add_argument(
        "--keep",
        type=Path,
        help="also write each report's failures, gzipped, here (tests/data/findings: "
        "what tests/test_findings.py groups again)",
    )
    parser.add_argument(
        "--planted", action="store_true", help="every planted kernel of tests/planted_*.py"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    from attnref import set_checking
    from attnref.conformance import audit
    from attnref.conformance.exports import load_report
    from attnref.conformance.families import MUTANTS

    def show(name: str, report: object, seconds: float) -> None:
        found = report.findings()  # type: ignore[attr-defined]
        failed = report.count("fail")  # type: ignore[attr-defined]
        print(f"{name}: {len(found)} findings, {failed} failed searches, {seconds:.0f} s")
        if args.verbose:
            for title, members in found:
                print(f"    {len(members):3d}  {title}")

    if args.regroup is not None:
        for path in sorted(args.regroup.glob("*.json")):
            report = load_report(path)
            show(path.stem, report, report.seconds)
        return 0
    specs = list(args.specs)
    if args.family:
        specs += [f"mutant.{n}" for n, m in MUTANTS.items() if m.api == args.family]
    apis: dict[str, str] = {}
    if args.planted:
        apis = planted()
        specs += list(apis)
    if not specs or args.out is None:
        parser.error("name the backends (or --family) and --out")
    args.out.mkdir(parents=True, exist_ok=True)
    set_checking(False)  # thousands of reference calls; the shapes are the suite's own
    for spec in specs:
        name = spec.removeprefix("mutant.").removeprefix("tests.")
        api = MUTANTS[name].api if spec.startswith("mutant.") else apis.get(spec, args.api)
        start = time.perf_counter()
        report = audit(spec, api=api, progress=False)
        path = args.out / f"{name.replace(':', '-')}.json"
        report.write_json(path)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            keep(path, args.keep / f"{path.stem}.json.gz")
        show(name, report, time.perf_counter() - start)
    return 0


def keep(report: Path, to: Path) -> None:
    """``report``'s document with only what grouping reads (its failed results, without
    their per-case times, coverage, error maps, logs and reproducers), gzipped at ``to``:
    a few kB a report."""
    import gzip
    import json

    data = json.loads(report.read_text())
    data["planned"] = data.get("planned", len(data["results"]))
    per_case = ("errors", "output", "reproducer")  # a finding's map, log and script
    data["results"] = [
        {
            k: ({x: y for x, y in v.items() if x not in per_case} if isinstance(v, dict) else v)
            for k, v in r.items()
            if k not in ("case_seconds", "coverage")
        }
        for r in data["results"]
        if r["status"] == "fail"
    ]
    for whole in ("findings", "not_tested"):
        data.pop(whole, None)
    to.write_bytes(gzip.compress(json.dumps(data, sort_keys=True).encode(), mtime=0))


def planted() -> dict[str, str]:
    """Every planted kernel with one bug in tests/planted_*.py, with its API family."""
    from tests import (
        planted_flash,
        planted_fp8,
        planted_mla,
        planted_mla_fp8,
        planted_serving,
        planted_sizes,
        planted_sparse,
    )

    specs = {f"tests.planted_flash:{n}": "flash" for n in planted_flash.UNSEEN}
    specs |= {f"tests.planted_fp8:{n}": "flash-kvcache" for n in planted_fp8.UNSEEN}
    specs |= {f"tests.planted_mla:{n}": "mla" for n in planted_mla.UNSEEN}
    specs |= {f"tests.planted_mla_fp8:{n}": "mla" for n in planted_mla_fp8.UNSEEN}
    specs |= {f"tests.planted_serving:{n}": a for n, (a, _) in planted_serving.UNSEEN.items()}
    specs |= {f"tests.planted_sizes:{n}": "sdpa" for n in planted_sizes.PLANTED}
    specs |= {f"tests.planted_sparse:{n}": a for n, a in planted_sparse.UNSEEN.items()}
    return specs


if __name__ == "__main__":
    sys.exit(main())
