"""Audit reports: a verdict per (property, dtype), a terminal table, a versioned JSON document.

JSON schema (``schema_version`` 13; 3 added ``api``, 4 ``trusted``, 5 ``checked``,
``cause`` and ``findings``, 6 ``world_size``, 7 the coverage: ``judged``, ``thin``,
``floor``, ``min_judged``, ``startup_seconds`` and ``not_tested``, 8 ``also``, 9
``sandbox``, 10 ``judges`` and ``judge_notes``, 11 a result's ``cut`` and a finding's
``output``, 12 ``interpreted`` and a result's ``case_seconds``, 13 ``shard``,
``planned``, ``examples``, a result's ``coverage`` and a finding's ``errors``, 14
``options``)::

    {
      "schema_version": 14,
      "attnref_version": str, "torch_version": str,
      "backend": str, "api": an API family ("sdpa", "flash", ...), "device": str,
      "dtypes": [str], "world_size": int | null (the processes each call ran on),
      "profile": "quick" | "ci" | "thorough", "seed": int,
      "capabilities": {field of Capabilities: value},
      "started": ISO-8601 str, "stopped_early": bool,
      "seconds": float,            # wall time so far (a partial write's too), start-up included
      "startup_seconds": float,    # of which the command's start-up, before the audit
      "trusted": bool,             # the backend ran in the judge's process (--in-process)
      "judges": int,               # judge processes that shared the searches (--jobs)
      "judge_notes": [str],        # a helper judge that stopped, and its search's fate
      "sandbox": {                 # what confined the backend's worker (docs/untrusted.md)
        "enforced": {part: how}, "missing": {part: why},  # the platform's doing
        "allowed": {part: why}     # what the family needs open (sockets, for ranks)
      },
      "interpreted": null | {      # the kernel ran through an interpreter on the CPU
        "interpreter": "triton" | "pallas", "version": str,
        "not_judged": str,         # what running interpreted cannot show
        "patched": str,            # what attnref changed in the interpreter (Triton's bf16)
        "dtypes_out": {dtype: why},  # left out: the interpreter's own check failed there
        "checked": {dtype: float},   # its check's error in each dtype
        "sizes": str,              # the tiles and cost bound the cases were fitted to
        "launch": str,             # its launch cost model, calibrated on it (launch.py)
        "autotuned": [{"kernel": str, "configs": int, "first": str, "pruned": bool}]
                                   # @triton.autotune's kernels: each call runs the first
                                   # configuration its prune_configs_by keeps (the worker's
                                   # word)
      },
      "shard": null | [K, N],      # shard K of N of one audit (--shard; attnref merge)
      "planned": int,              # the (property, dtype) searches it set out to run
      "examples": int,             # cases drawn per search (the profile's)
      "options": {name: str},      # what it ran with: timeout, deadline, budget, ...
      "incomplete": null | str,    # why the audit did not finish (then "ok" is false)
      "summary": {"passed": int, "failed": int, "skipped": int,  # (property, dtype) verdicts
                  "thin": int,     # passes judged on fewer cases than the floor
                  "checks": int,   # cases drawn, shrinking included
                  "judged": int,   # of which judged; the rest skipped or refused:
                  "cases_skipped": int, "cases_refused": int,
                  "floor": int,    # the fewest judged cases a pass may have and not be thin
                  "min_judged": int | null,  # --min-judged: then a thin pass is not OK
                  "ok": bool},
      "not_tested": [str],         # what the declaration leaves untested, and why
      "findings": [                # the failures grouped by cause, most frequent first
        {"cause": str, "count": int, "results": ["property [dtype]"], "message": str}
      ],
      "results": [
        {"property": str, "dtype": str, "status": "pass" | "fail" | "skip",
         "checks": int,            # cases drawn and tried, shrinking included
         "checked": int,           # of which judged (checks - skipped - refused)
         "skipped": int,           # of which outside the backend's declaration
         "refused": int,           # of which refused with an error declared as a refusal
         "thin": bool,             # a pass judged on fewer cases than the floor
         "cut": bool,              # its search ended when its budget ran out
         "seconds": float,
         "case_seconds": [float],  # each drawn case's time, in order, shrinking included
         "coverage": {feature: {value: int}},  # the judged cases' features (the HTML plots)
         "message": str,           # the failure's one-line summary, or why it was skipped
         "failure": null | {
            "case": {Case fields},  # the shrunk, minimal failing case
            "message": str,
            "cause": str,           # what it is grouped under (``findings``)
            "got": float | null,    # the backend's value at ``where``
            "expected": float | null,  # the oracle's (for a law too, not the other call)
            "where": [int] | null,
            "reproducer": str,      # a runnable Python snippet
            "output": str,          # the last 4 KiB the backend wrote to stdout/stderr
            "needs": [str],         # the shrunk case's features it fails only with
            "errors": null | {      # where its values were wrong (the HTML heatmap)
              "map": [[float | null]], "bound": float, "rows": str, "columns": str,
              "shape": [int], "pooled": [int, int], "worst": [int, int] | null,
              "column_labels": [int] | null   # a long case's sampled query rows
            }
         },
         "also": null | {...}       # a second finding, as "failure": a precision miss
                                    # met while the search went on to a semantic failure
         }
      ]
    }
"""

import builtins
import datetime
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from attnref.conformance.cases import Case
from attnref.conformance.declarations import DEFAULT_API, Capabilities, not_tested
from attnref.conformance.findings import group
from attnref.devices import dtype_name

__all__ = [
    "FLOOR_SHARE",
    "SCHEMA_VERSION",
    "AuditReport",
    "Finding",
    "PropertyResult",
    "Status",
    "cell_text",
    "interpreted_lines",
    "is_thin",
    "reproducer",
]

SCHEMA_VERSION = 14

#: a pass judged on fewer than this share of the profile's examples (per property and
#: dtype) is thin, unless ``--min-judged`` sets the floor
FLOOR_SHARE = 0.2

#: the verdict on one (property, dtype)
Status = Literal["pass", "fail", "skip"]


def _num(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


@dataclass(frozen=True)
class Finding:
    """A failure shrunk to a minimal case, and a snippet that reproduces it."""

    case: Case
    message: str
    got: float | None
    expected: float | None
    where: tuple[int, ...] | None
    reproducer: str
    #: what it is grouped under in the report (`attnref.conformance.verdicts.cause_of`)
    cause: str = ""
    #: the last of what the backend wrote to its stdout and stderr when it was found
    #: (`Supervised.output_tail`; printed with ``-v`` only)
    output: str = ""
    #: the features of the shrunk case it fails only with (`attnref.conformance.needs`):
    #: findings that need different ones are different findings
    needs: tuple[str, ...] = ()
    #: where the values were wrong (`attnref.conformance.oracle.error_map`): the
    #: heatmap of the HTML report; None where the check had no tensor to show
    errors: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case.to_dict(),
            "message": self.message,
            "cause": self.cause or self.message,
            "got": _num(self.got),
            "expected": _num(self.expected),
            "where": None if self.where is None else list(self.where),
            "reproducer": self.reproducer,
            "output": self.output,
            "needs": list(self.needs),
            "errors": self.errors,
        }


@dataclass
class PropertyResult:
    """The verdict on one property in one dtype."""

    property: str
    dtype: torch.dtype
    status: Status
    checks: int = 0
    skipped: int = 0
    refused: int = 0
    seconds: float = 0.0
    message: str = ""
    finding: Finding | None = None
    #: a pass judged on fewer cases than the audit's floor (`AuditReport.floor`)
    thin: bool = False
    #: a failure's second finding, of the other kind: the first precision miss (an
    #: error over the bound, under 5% of the values' spread) met on another case while
    #: the search went on to the semantic failure it reports (`finding`), not shrunk
    also: Finding | None = None
    #: the search ended because its budget (``--property-budget``) ran out, not because
    #: it drew every case it would: what it judged is held to the whole floor
    cut: bool = False
    #: each drawn case's seconds, in the order drawn (shrinking included)
    case_seconds: list[float] = field(default_factory=list)
    #: what the judged cases covered (`attnref.conformance.coverage`): each feature's
    #: values and how many cases had each
    coverage: dict[str, dict[str, int]] = field(default_factory=dict)

    @builtins.property  # (``property`` is a field's name here)
    def judged(self) -> int:
        """The drawn cases that were judged: neither skipped (outside the declaration)
        nor refused (with an error declared as a refusal)."""
        return self.checks - self.skipped - self.refused

    def to_dict(self) -> dict[str, Any]:
        return {
            "property": self.property,
            "dtype": dtype_name(self.dtype),
            "status": self.status,
            "checks": self.checks,
            "checked": self.judged,
            "skipped": self.skipped,
            "refused": self.refused,
            "thin": self.thin,
            "cut": self.cut,
            "seconds": round(self.seconds, 4),
            "case_seconds": [round(t, 4) for t in self.case_seconds],
            "coverage": self.coverage,
            "message": self.message,
            "failure": None if self.finding is None else self.finding.to_dict(),
            "also": None if self.also is None else self.also.to_dict(),
        }


def is_thin(result: PropertyResult, floor: int, examples: int) -> bool:
    """Whether ``result`` passed on fewer judged cases than ``floor``. A property whose
    cases ran out before the profile's ``examples`` (one explicit case, say) needs only
    as many as it drew; one whose search a budget cut short (`PropertyResult.cut`) needs
    the whole floor: thin is thin however the search ended. A pass that judged nothing
    is always thin."""
    ran_out = result.checks < examples and not result.cut
    need = min(floor, result.checks) if ran_out else floor
    return result.status == "pass" and result.judged < max(1, need)


def reproducer(
    backend: str,
    pid: str,
    case: Case,
    dtype: torch.dtype,
    device: str,
    message: str,
    api: str = DEFAULT_API,
    world_size: int | None = None,
) -> str:
    """A runnable Python snippet that rebuilds the failing case and checks it again.

    It prints the verdict and exits 1 while the failure reproduces, 0 once it no longer
    does: ``git bisect run python REPRODUCER`` can use it. A ``module:function`` backend
    imports from the folder the audit was started in (the worker puts its working
    folder first on ``sys.path``), so the snippet moves there first, from wherever it
    is run.
    """
    dt = dtype_name(dtype)
    api_arg = "" if api == DEFAULT_API else f", api={api!r}"
    if world_size is not None:
        api_arg += f", world_size={world_size}"
    imports, where = "import sys\n", ""
    if ":" in backend:
        imports = "import os\nimport sys\n"
        where = (
            "# the backend's module imports from the folder the audit ran in\n"
            f"os.chdir({os.getcwd()!r})\n"
        )
    return (
        f"# attnref: property {pid!r} failed for backend {backend!r} ({dt}, {device})\n"
        f"# {message}\n"
        "# --save DIR also writes the inputs each call got and the oracle's answer there\n"
        f"{imports}"
        "\n"
        "import torch\n"
        "\n"
        "from attnref.conformance import Case, check_case\n"
        "\n"
        f"{where}"
        f"case = {case!r}\n"
        'save = sys.argv[sys.argv.index("--save") + 1] if "--save" in sys.argv else None\n'
        "# the backend is imported and run in a supervised worker (isolate=False: here)\n"
        f"verdict = check_case({pid!r}, {backend!r}, case, torch.{dt}, {device!r}{api_arg}, "
        "save=save)\n"
        "print(verdict)\n"
        'sys.exit(1 if verdict.startswith("FAIL") else 0)\n'
    )


def _versions() -> tuple[str, str]:
    from attnref import __version__

    return __version__, torch.__version__


@dataclass
class AuditReport:
    """Everything an audit found."""

    backend: str
    device: str
    dtypes: list[str]
    profile: str
    seed: int
    capabilities: Capabilities
    started: str
    results: list[PropertyResult] = field(default_factory=list)
    seconds: float = 0.0
    stopped_early: bool = False
    api: str = DEFAULT_API  # the backend's calling convention (an installed API family)
    #: why the audit did not finish ("" when it did): a deadline, an interrupt
    incomplete: str = ""
    #: the backend ran in the judge's own process (``--in-process``): the verdict trusts it
    trusted: bool = False
    #: what confined the backend's worker (`attnref.conformance.worker.Supervised.sandbox`)
    sandbox: dict[str, dict[str, str]] = field(default_factory=dict)
    #: the processes each call ran on, for a family that spreads one over several
    world_size: int | None = None
    #: a pass judged on fewer cases than this is thin (`mark_thin`): the profile's
    #: `FLOOR_SHARE` of its examples, or ``min_judged``
    floor: int = 1
    #: ``--min-judged``: the floor the user asked for, and a thin pass then is not OK
    min_judged: int | None = None
    #: the cases Hypothesis draws per property and dtype (the profile's ``examples``)
    examples: int = 0
    #: seconds of start-up counted in ``seconds`` (the command's, before the audit)
    startup: float = 0.0
    #: the (property, dtype) pairs the audit set out to judge
    planned: int = 0
    #: judge processes that shared the searches (`attnref.conformance.judges`)
    judges: int = 1
    #: a helper judge that stopped before its share was done, and what became of it
    judge_notes: list[str] = field(default_factory=list)
    #: the kernel ran through an interpreter (`attnref.interpreted.prepare`'s record,
    #: with the sizes the cases were fitted to): {} when it ran natively
    interpreted: dict[str, Any] = field(default_factory=dict)
    #: ``(K, N)``: this report is shard K of N of one audit (``--shard K/N``), whose
    #: shards `attnref.conformance.exports.merge_reports` puts together
    shard: tuple[int, int] | None = None
    #: the attnref and torch versions it was written with (a loaded report keeps its own)
    versions: tuple[str, str] = field(default_factory=_versions)
    #: the options the audit ran with, as a reader names them (timeout, deadline, budget,
    #: ...: what the profile and seed do not say)
    options: dict[str, str] = field(default_factory=dict)
    _t0: float = 0.0

    @classmethod
    def start(
        cls,
        backend: str,
        device: str,
        dtypes: list[str],
        profile: str,
        seed: int,
        capabilities: Capabilities,
        api: str = DEFAULT_API,
        startup: float = 0.0,
    ) -> "AuditReport":
        """A report whose clock starts now, or ``startup`` seconds ago (the command's
        start-up before it: the interpreter, torch, the worker importing the backend)."""
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        return cls(
            backend,
            device,
            [dtype_name(d) for d in dtypes],
            profile,
            seed,
            capabilities,
            now,
            api=api,
            startup=startup,
            _t0=time.perf_counter() - startup,
        )

    def finish(self) -> None:
        """Set ``seconds`` to the time so far (again at each partial write)."""
        self.seconds = time.perf_counter() - self._t0

    def count(self, status: Status) -> int:
        return sum(r.status == status for r in self.results)

    def mark_thin(self, result: PropertyResult) -> PropertyResult:
        """Mark ``result`` thin (`is_thin`) under this audit's floor."""
        result.thin = is_thin(result, self.floor, self.examples)
        return result

    def thin(self) -> list[PropertyResult]:
        return [r for r in self.results if r.thin]

    def thin_fails(self) -> str:
        """Why the thin passes make the audit not OK, or "": with ``min_judged``, any
        thin pass; otherwise thin passes that are most of the passes (the audit vouches
        for little), or a thin pass whose search a budget cut (the audit did not search
        where it meant to)."""
        thin = self.thin()
        if not thin:
            return ""
        n, passes = len(thin), self.count("pass")
        what = (
            f"{n} of {passes} {'pass' if passes == 1 else 'passes'} judged on fewer than "
            f"{self.floor} cases"
        )
        if self.min_judged is not None:
            return f"{what}, --min-judged"
        cut = [r for r in thin if r.cut]
        if cut:
            return (
                f"{what}; the budget (--property-budget) cut the search of {len(cut)}: a "
                "larger budget, or none, searches them whole"
            )
        if 2 * n > passes:
            return (
                f"{what}, most of the audit: the declaration or the sizes leave few cases "
                "to judge (-v lists what was skipped)"
            )
        return ""

    @property
    def ok(self) -> bool:
        """True when the audit finished, checked something, and nothing failed (an audit
        whose every property was skipped vouches for nothing: a backend that calls itself
        unavailable, or refuses every call, does not pass), and its thin passes do not
        make it thin (`thin_fails`)."""
        return (
            self.count("fail") == 0
            and self.count("pass") > 0
            and not self.incomplete
            and not self.thin_fails()
        )

    def verdict(self) -> str:
        """``OK``, ``FAILED``, ``INCOMPLETE`` (stopped, by a deadline or an interrupt,
        with nothing failed), ``THIN`` (`thin_fails`) or ``NOTHING CHECKED`` (every
        property skipped)."""
        if self.ok:
            return "OK"
        if self.count("fail"):
            return "FAILED"
        if self.incomplete:
            return f"INCOMPLETE (not OK: {self.incomplete}; nothing failed before it)"
        if not self.count("pass"):
            return "NOTHING CHECKED (not OK: every property was skipped)"
        return f"THIN (not OK: {self.thin_fails()})"

    def coverage(self) -> dict[str, int]:
        """Cases drawn, judged, skipped and refused, over every result."""
        return {
            "checks": sum(r.checks for r in self.results),
            "judged": sum(r.judged for r in self.results),
            "cases_skipped": sum(r.skipped for r in self.results),
            "cases_refused": sum(r.refused for r in self.results),
        }

    def findings(self) -> list[tuple[str, list[PropertyResult]]]:
        """The failures as findings, one per cause (`attnref.conformance.findings.group`):
        each its title and its results, the first the one whose shrunk case is the
        finding's smallest trigger, the rest its variations; most results first."""
        return group(self.results, self.capabilities)

    def failed_properties(self) -> set[str]:
        """The ids of the properties that failed in at least one dtype."""
        return {r.property for r in self.results if r.status == "fail"}

    def to_dict(self) -> dict[str, Any]:
        caps = {
            k: [dtype_name(x) for x in v] if k == "dtypes" else v
            for k, v in asdict(self.capabilities).items()
        }
        return {
            "schema_version": SCHEMA_VERSION,
            "attnref_version": self.versions[0],
            "torch_version": self.versions[1],
            "backend": self.backend,
            "api": self.api,
            "device": self.device,
            "dtypes": self.dtypes,
            "profile": self.profile,
            "seed": self.seed,
            "capabilities": caps,
            "started": self.started,
            "seconds": round(self.seconds, 3),
            "startup_seconds": round(self.startup, 3),
            "stopped_early": self.stopped_early,
            "trusted": self.trusted,
            "sandbox": self.sandbox,
            "world_size": self.world_size,
            "judges": self.judges,
            "judge_notes": self.judge_notes,
            "interpreted": self.interpreted or None,
            "shard": None if self.shard is None else list(self.shard),
            "planned": self.planned,
            "examples": self.examples,
            "options": self.options,
            "incomplete": self.incomplete or None,
            "summary": {
                "passed": self.count("pass"),
                "failed": self.count("fail"),
                "skipped": self.count("skip"),
                "thin": len(self.thin()),
                **self.coverage(),
                "floor": self.floor,
                "min_judged": self.min_judged,
                "ok": self.ok,
            },
            "findings": [
                {
                    "cause": cause,
                    "count": len(rs),
                    "results": [f"{r.property} [{dtype_name(r.dtype)}]" for r in rs],
                    "message": rs[0].message,
                }
                for cause, rs in self.findings()
            ],
            "not_tested": not_tested(self.capabilities),
            "results": [r.to_dict() for r in self.results],
        }

    def write_json(self, path: str | Path) -> list[Path]:
        """Write the report to ``path``, and each reproducer beside it.

        Reproducers go to ``<path without suffix>.reproducers/<property>-<dtype>.py``;
        those of an earlier report at ``path`` are removed first, so that the folder
        holds this run's only. Returns the files written.
        """
        path = Path(path)
        folder = path.with_suffix(".reproducers")
        if folder.is_dir():  # an earlier run's: a report never stands beside another's
            for old in folder.glob("*.py"):
                old.unlink()
        _write_atomically(path, json.dumps(self.to_dict(), indent=2) + "\n")
        written = [path]
        findings = [r for r in self.results if r.finding is not None]
        if not findings and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        if findings:
            folder.mkdir(exist_ok=True)
            for r in findings:
                assert r.finding is not None
                out = folder / f"{r.property}-{dtype_name(r.dtype)}.py"
                _write_atomically(out, r.finding.reproducer)
                written.append(out)
        return written

    def grid(self) -> tuple[list[str], dict[tuple[str, str], PropertyResult]]:
        """The properties in audit order, and each (property, dtype name)'s result."""
        names: list[str] = []
        cells: dict[tuple[str, str], PropertyResult] = {}
        for r in self.results:
            if r.property not in names:
                names.append(r.property)
            cells[(r.property, dtype_name(r.dtype))] = r
        return names, cells

    def format_table(self, *, verbose: bool = False) -> str:
        """One row per property, one column per dtype, then each failure and its reproducer."""
        names, cells = self.grid()
        width = max([len("property"), *map(len, names)])
        cw = max([10, *(len(cell_text(r)) for r in cells.values())])
        header = f"{'property':<{width}}  " + "  ".join(f"{d:>{cw}}" for d in self.dtypes)
        lines = [
            f"attnref audit: backend {self.backend} on {self.device}, profile {self.profile}, "
            f"seed {self.seed}, torch {self.versions[1]}",
        ]
        lines += interpreted_lines(self.interpreted)
        lines += [header, "-" * len(header)]
        for name in names:
            row = [f"{name:<{width}}"]
            row += [f"{cell_text(cells.get((name, d))):>{cw}}" for d in self.dtypes]
            lines.append("  ".join(row))
        if any(r.status == "pass" and (r.skipped or r.refused) for r in self.results):
            lines.append(
                "(ok N sK rJ: N drawn cases judged, K skipped as outside what the backend "
                "declares, J refused with an error it declares: -v lists why)"
            )
        thin = self.thin()
        if thin:
            fails = " (--min-judged: not OK)" if self.min_judged is not None else ""
            lines.append(
                f"(thin N: a pass judged on fewer than {self.floor} of the cases it drew"
                f"{fails}: {len(thin)} of them)"
            )
        groups = self.findings()
        if groups:
            lines += ["", "findings (failures grouped by cause, each shrunk to a minimal case):"]
            for n, (cause, rs) in enumerate(groups, 1):
                where = ", ".join(f"{r.property} [{dtype_name(r.dtype)}]" for r in rs)
                count = f"{len(rs)} failures" if len(rs) > 1 else "1 failure"
                lines.append(f"  {n}. {cause}: {count}: {where}")
                for i, r in enumerate(rs if verbose else rs[:1]):
                    lines.append(f"     {r.property} [{dtype_name(r.dtype)}]: {r.message}")
                    if r.finding is not None and (verbose or i == 0):
                        lines += ["       " + x for x in r.finding.reproducer.rstrip().splitlines()]
                    if r.also is not None and (verbose or i == 0):
                        lines.append(f"       also met on another case: {r.also.cause}")
                    if r.finding is not None and r.finding.output and verbose:
                        lines.append("       the backend's last output (stdout and stderr):")
                        lines += ["       | " + x for x in r.finding.output.rstrip().splitlines()]
        skips = [r for r in self.results if r.status == "skip" or r.skipped or r.refused]
        if skips and verbose:
            lines += ["", "skipped:"]
            lines += [f"  {r.property} [{dtype_name(r.dtype)}]: {_skip_note(r)}" for r in skips]
        untested = not_tested(self.capabilities)
        if untested:
            lines += ["", "not tested, as declared:"] + [f"  - {u}" for u in untested]
        if self.stopped_early:
            lines += ["", "stopped at the first failure (--fail-fast)"]
        if self.incomplete:
            lines += ["", f"INCOMPLETE: {self.incomplete}"]
        if self.judge_notes:
            lines += [""] + [f"note: {n}" for n in self.judge_notes]
        if self.trusted:
            lines += [
                "",
                "TRUSTED: the backend ran in the judge's own process (--in-process); a "
                "backend that attacks the harness could have forged this verdict",
            ]
        cov = self.coverage()
        unjudged = [
            f"{n} {what}"
            for n, what in ((cov["cases_skipped"], "skipped"), (cov["cases_refused"], "refused"))
            if n
        ]
        judged = f"{cov['judged']} cases judged" + (
            f" ({', '.join(unjudged)} of {cov['checks']} drawn)" if unjudged else ""
        )
        thin_part = f", {len(thin)} thin" if thin else ""
        lines += [
            "",
            f"{self.count('pass')} passed{thin_part}, {self.count('fail')} failed, "
            f"{self.count('skip')} skipped; {judged} in {self.seconds:.1f} s"
            + (f" ({self.startup:.1f} s of it start-up)" if self.startup >= 0.05 else "")
            + ": "
            + self.verdict(),
        ]
        return "\n".join(lines)


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``: a
    reader sees the old file or the new one, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _skip_note(r: PropertyResult) -> str:
    """What the verbose list of skips says of ``r``: its message, unless that is a
    failure's (then how many of its drawn cases were skipped and refused)."""
    if r.status != "fail":
        return r.message
    return f"{r.skipped} drawn cases skipped (outside the declaration), {r.refused} refused"


def interpreted_lines(interpreted: dict[str, Any]) -> list[str]:
    """What the report says first of a kernel that ran through an interpreter
    (`AuditReport.interpreted`): which, what that does not judge, the dtypes left out
    and the sizes fitted; nothing for a kernel that ran natively."""
    if not interpreted:
        return []
    name = interpreted.get("interpreter", "?")
    lines = [
        f"interpreted: {name} {interpreted.get('version', '')}".rstrip()
        + f"; {interpreted.get('not_judged', '')}"
    ]
    if interpreted.get("patched"):
        lines.append(f"  interpreter patched: {interpreted['patched']}")
    for dtype, why in (interpreted.get("dtypes_out") or {}).items():
        lines.append(f"  {dtype} left out: {why}")
    if interpreted.get("sizes"):
        lines.append(f"  sizes: {interpreted['sizes']}")
    if interpreted.get("launch"):
        lines.append(f"  {interpreted['launch']}")
    for tuned in interpreted.get("autotuned") or ():
        which = "the first its prune_configs_by keeps" if tuned["pruned"] else "the first"
        first = ", ".join(x for x in tuned["first"].split(", ") if not x.endswith(": None"))
        lines.append(
            f"  autotuned: {tuned['kernel']}, {tuned['configs']} configurations: each call "
            f"runs {which} (the first listed: {first})"
        )
    return lines


def sandbox_line(sandbox: dict[str, dict[str, str]]) -> str:
    """One line on what confined a backend's worker (`AuditReport.sandbox`): the parts
    enforced, or NOT ENFORCED and why, and what the family leaves open."""
    enforced = ", ".join(sandbox.get("enforced") or {}) or "nothing"
    missing = sandbox.get("missing") or {}
    allowed = sandbox.get("allowed") or {}
    if missing:
        line = "sandbox: NOT ENFORCED: " + "; ".join(f"{k} ({v})" for k, v in missing.items())
        line += f"; enforced: {enforced}"
    else:
        line = f"sandbox: {enforced} enforced"
    if allowed:
        line += "; open: " + "; ".join(f"{k} ({v})" for k, v in allowed.items())
    return line


def cell_text(r: PropertyResult | None) -> str:
    """A (property, dtype)'s cell as the terminal and the HTML grid show it: ``FAIL``,
    ``skip``, or ``ok N`` / ``thin N`` (cases judged) with ``sK`` skipped and ``rJ``
    refused."""
    if r is None:
        return "-"
    if r.status == "skip":
        return "skip"
    if r.status == "fail":
        return "FAIL"
    cell = f"{'thin' if r.thin else 'ok'} {r.judged}"
    if r.skipped:  # some drawn cases were outside the declaration
        cell += f" s{r.skipped}"
    if r.refused:  # some were refused as declared
        cell += f" r{r.refused}"
    return cell
