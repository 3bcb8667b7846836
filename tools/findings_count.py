"""How many findings a whole quick audit of each planted bug gives (docs/conformance.md).

One bug should be one finding, two where it shows in rows that see keys and in rows
that see none. Run from the repository root::

    python tools/findings_count.py --out /tmp/reports mutant.empty_row_uniform ...
    python tools/findings_count.py --out /tmp/reports --family sdpa   # every sdpa mutant
    python tools/findings_count.py --regroup /tmp/reports             # saved reports again

Each audit's report is saved under ``--out``, so that a change to the grouping alone is
measured again with ``--regroup`` (no audit runs). A spec is ``mutant.NAME`` or
``module:function`` with ``--api``. Prints one line a backend: its findings, its failed
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
    if not specs or args.out is None:
        parser.error("name the backends (or --family) and --out")
    args.out.mkdir(parents=True, exist_ok=True)
    set_checking(False)  # thousands of reference calls; the shapes are the suite's own
    for spec in specs:
        name = spec.removeprefix("mutant.")
        api = MUTANTS[name].api if spec.startswith("mutant.") else args.api
        start = time.perf_counter()
        report = audit(spec, api=api, progress=False)
        report.write_json(args.out / f"{name.replace(':', '-')}.json")
        show(name, report, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
