"""A saved report read back, shards of one audit merged, and the report as JUnit XML
(docs/reports.md).

- `load_report`: a JSON report (``--json``) as an `AuditReport` again, findings and
  reproducers included, so that ``attnref report`` and ``attnref merge`` can write what
  ``attnref audit`` writes.
- `merge_reports`: the shards of one audit (``--shard K/N``) as the report one process
  would have written. Each (property, dtype) search is seeded by the audit's seed, the
  property and the dtype alone (`runner.property_seed`), so which shard ran it does not
  change its verdict; shard ``K`` runs the searches ``K - 1, K - 1 + N, ...`` of the
  audit's list, and the merge puts each back in its place. Reports of different
  backends, API families, declarations, versions, profiles, seeds, dtypes or devices,
  and a shard missing, repeated or of another ``N``, are refused with the reason.
- `junit_xml`: one ``testcase`` per (property, dtype); a failure carries the finding's
  message and its reproducer, a skip its reason; it validates against the JUnit schema
  Jenkins' xUnit plugin reads (``junit-10.xsd``), which GitLab, Buildkite and GitHub's
  test reporters read too.
"""

import json
import math
import xml.etree.ElementTree as ET
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from attnref.conformance.cases import Case
from attnref.conformance.declarations import (
    Backend,
    Capabilities,
    declaration,
    from_declaration,
)
from attnref.conformance.report import SCHEMA_VERSION, AuditReport, Finding, PropertyResult
from attnref.devices import DTYPES, dtype_name

__all__ = ["READABLE", "MergeError", "junit_xml", "load_report", "merge_reports", "shard_of"]

#: the report schemas this version reads: 13 is 14 without ``options``
READABLE = (13, SCHEMA_VERSION)


class MergeError(ValueError):
    """Reports that are not the shards of one audit, with the reason."""


def _case(data: dict[str, Any]) -> Case:
    """A case as `Case.to_dict` wrote it (tuples come back from JSON as lists)."""

    def tupled(x: Any) -> Any:
        return tuple(tupled(v) for v in x) if isinstance(x, list) else x

    names = {f.name for f in fields(Case)}
    return Case(**{k: tupled(v) for k, v in data.items() if k in names})


def _finding(data: dict[str, Any] | None) -> Finding | None:
    if data is None:
        return None
    where = data.get("where")
    return Finding(
        case=_case(data["case"]),
        message=data["message"],
        got=math.nan if data.get("got") is None else data["got"],
        expected=math.nan if data.get("expected") is None else data["expected"],
        where=None if where is None else tuple(where),
        reproducer=data.get("reproducer", ""),
        cause=data.get("cause", ""),
        output=data.get("output", ""),
        needs=tuple(data.get("needs", ())),
        errors=data.get("errors"),
    )


def _capabilities(data: dict[str, Any], api: str) -> Capabilities:
    """The declaration a report records, through the judge's own check of declarations.
    A field the report lacks (written by an attnref before the field was added) reads as
    its default: what that attnref audited without it (a field it does not know still
    fails: a report of a later attnref)."""
    defaults = declaration(Backend("report", _no_code, "", Capabilities()))["capabilities"]
    caps = {**defaults, **data}
    caps["sink_values"] = [repr(float(v)) for v in caps.get("sink_values", ())]
    backend = from_declaration({"name": "report", "description": "", "api": api,
                                "probe": False, "needs": None, "spec": "report",
                                "capabilities": caps})  # fmt: skip
    return backend.capabilities


def _no_code(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a report's backend is its record: no code of it runs")


def load_report(source: str | Path | dict[str, Any]) -> AuditReport:
    """A JSON report (a path, or the parsed document) as an `AuditReport`.

    Raises:
        ValueError: a document that is not an attnref report of this schema.
    """
    data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
    if not isinstance(data, dict) or "schema_version" not in data:
        raise ValueError("not an attnref report (no schema_version)")
    if data["schema_version"] not in READABLE:
        raise ValueError(
            f"a report of schema {data['schema_version']}: this attnref reads "
            f"{' and '.join(map(str, READABLE))} (write it again with this version)"
        )
    report = AuditReport(
        backend=data["backend"],
        device=data["device"],
        dtypes=list(data["dtypes"]),
        profile=data["profile"],
        seed=data["seed"],
        capabilities=_capabilities(data["capabilities"], data["api"]),
        started=data["started"],
        seconds=data["seconds"],
        stopped_early=data["stopped_early"],
        api=data["api"],
        incomplete=data.get("incomplete") or "",
        trusted=data["trusted"],
        sandbox=data.get("sandbox") or {},
        world_size=data.get("world_size"),
        floor=data["summary"]["floor"],
        min_judged=data["summary"]["min_judged"],
        startup=data.get("startup_seconds", 0.0),
        judges=data.get("judges", 1),
        judge_notes=list(data.get("judge_notes", [])),
        interpreted=data.get("interpreted") or {},
        shard=None if data.get("shard") is None else (data["shard"][0], data["shard"][1]),
        planned=data.get("planned", len(data["results"])),
        examples=data.get("examples", 0),
        options=dict(data.get("options") or {}),
    )
    report.versions = (data["attnref_version"], data["torch_version"])
    for r in data["results"]:
        report.results.append(
            PropertyResult(
                property=r["property"],
                dtype=DTYPES[r["dtype"]],
                status=r["status"],
                checks=r["checks"],
                skipped=r["skipped"],
                refused=r["refused"],
                seconds=r["seconds"],
                message=r["message"],
                finding=_finding(r.get("failure")),
                thin=r["thin"],
                also=_finding(r.get("also")),
                cut=r.get("cut", False),
                case_seconds=list(r.get("case_seconds", [])),
                coverage=dict(r.get("coverage") or {}),
            )
        )
    return report


def shard_of(text: str) -> tuple[int, int]:
    """``"K/N"`` as ``(K, N)``: shard ``K`` of ``N``, ``1 <= K <= N``.

    Raises:
        ValueError: anything else, named.
    """
    k, sep, n = text.partition("/")
    if not sep or not k.strip().isdigit() or not n.strip().isdigit():
        raise ValueError(f"a shard is K/N (shard K of N, 1 <= K <= N), got {text!r}")
    shard = (int(k), int(n))
    if not 1 <= shard[0] <= shard[1]:
        raise ValueError(f"a shard is K/N with 1 <= K <= N, got {text!r}")
    return shard


#: what the shards of one audit share, as the refusal names it
_SAME = {
    "backend": "backend",
    "api": "API family",
    "versions": "attnref and torch versions",
    "profile": "profile",
    "seed": "seed",
    "device": "device",
    "dtypes": "dtypes",
    "capabilities": "declaration",
    "examples": "examples per search",
    "floor": "floor",
    "min_judged": "--min-judged",
}


def _identity(report: AuditReport, key: str) -> object:
    if key == "capabilities":
        return report.to_dict()["capabilities"]
    return getattr(report, key)


def merge_reports(reports: list[AuditReport], names: list[str] | None = None) -> AuditReport:
    """The shards of one audit (``--shard K/N``) as one report (module docstring).

    Raises:
        MergeError: reports that are not every shard of one audit, exactly once.
    """
    names = names or [f"report {i + 1}" for i in range(len(reports))]
    if not reports:
        raise MergeError("no report to merge")
    first = reports[0]
    for report, name in zip(reports[1:], names[1:], strict=True):
        for key, what in _SAME.items():
            a, b = _identity(first, key), _identity(report, key)
            if a != b:
                raise MergeError(
                    f"{name} is not a shard of the audit {names[0]} is: its {what} differs "
                    f"({str(b)[:120]} against {str(a)[:120]})"
                )
    unsharded = [n for n, r in zip(names, reports, strict=True) if r.shard is None]
    if unsharded:
        raise MergeError(f"{', '.join(unsharded)}: not a shard (written without --shard K/N)")
    counts = {r.shard[1] for r in reports if r.shard is not None}
    if len(counts) > 1:
        raise MergeError(f"shards of different N: {sorted(counts)}")
    (n,) = counts
    seen: dict[int, str] = {}
    for report, name in zip(reports, names, strict=True):
        assert report.shard is not None
        k = report.shard[0]
        if k in seen:
            raise MergeError(f"shard {k}/{n} given twice: {seen[k]} and {name}")
        seen[k] = name
    missing = [f"{k}/{n}" for k in range(1, n + 1) if k not in seen]
    if missing:
        raise MergeError(f"shard {', '.join(missing)} missing (every shard of {n} is needed)")
    by_k = {r.shard[0]: r for r in reports if r.shard is not None}
    merged = replace(
        first,
        results=[],
        shard=None,
        seconds=sum(r.seconds for r in reports),
        startup=sum(r.startup for r in reports),
        stopped_early=any(r.stopped_early for r in reports),
        incomplete="; ".join(
            f"shard {k}/{n}: {by_k[k].incomplete}" for k in sorted(by_k) if by_k[k].incomplete
        ),
        judges=sum(r.judges for r in reports),
        judge_notes=[f"shard {k}/{n}: {x}" for k in sorted(by_k) for x in by_k[k].judge_notes],
        planned=sum(r.planned for r in reports),
    )
    merged.versions = first.versions
    # shard k ran the searches k - 1, k - 1 + n, ...: deal them back in turn
    queues = {k: list(by_k[k].results) for k in by_k}
    index = 0
    while any(queues.values()):
        k = index % n + 1
        if not queues[k]:
            break  # a shard that stopped early: the rest of the order is not known
        merged.results.append(queues[k].pop(0))
        index += 1
    for k in sorted(queues):  # what a stopped shard left after the gap, in its order
        merged.results.extend(queues[k])
    return merged


# ------------------------------------------------------------------------ JUnit XML


def _xml_text(text: str) -> str:
    """``text`` with the characters XML 1.0 cannot hold replaced (a backend's message
    may carry any byte)."""
    return "".join(
        c if c in "\t\n\r" or (" " <= c <= "\ud7ff") or ("\ue000" <= c <= "\ufffd") else "?"
        for c in text
    )


def junit_xml(report: AuditReport) -> str:
    """The report as JUnit XML: one ``testsuite`` (the backend), one ``testcase`` per
    (property, dtype) with its time; a failure's ``failure`` element holds its cause as
    ``type``, its message, and the message and reproducer as text; a skip's ``skipped``
    its reason; a thin pass a ``system-out`` saying so. The suite's ``properties`` name
    the profile, seed, API family, device, versions and verdict."""
    suites = ET.Element("testsuites", name="attnref audit")
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=f"attnref.{report.api}.{report.backend}",
        tests=str(len(report.results)),
        failures=str(report.count("fail")),
        errors="0",
        skipped=str(report.count("skip")),
        time=f"{report.seconds:.3f}",
        timestamp=report.started,
    )
    props = ET.SubElement(suite, "properties")
    attnref_version, torch_version = report.versions
    for name, value in (
        ("backend", report.backend),
        ("api", report.api),
        ("device", report.device),
        ("profile", report.profile),
        ("seed", str(report.seed)),
        ("attnref", attnref_version),
        ("torch", torch_version),
        ("verdict", report.verdict()),
    ):
        ET.SubElement(props, "property", name=name, value=_xml_text(value))
    for r in report.results:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"attnref.{report.api}.{r.property}",
            name=f"{r.property}[{dtype_name(r.dtype)}]",
            time=f"{r.seconds:.3f}",
        )
        if r.status == "fail":
            finding = r.finding
            cause = finding.cause if finding is not None and finding.cause else r.message
            failure = ET.SubElement(
                case, "failure", type=_xml_text(cause[:200]), message=_xml_text(r.message[:2000])
            )
            text = r.message
            if finding is not None:
                text += "\n\n" + finding.reproducer
            failure.text = _xml_text(text)
        elif r.status == "skip":
            ET.SubElement(case, "skipped", message=_xml_text(r.message[:2000] or "skipped"))
        elif r.thin:
            out = ET.SubElement(case, "system-out")
            out.text = f"thin: judged on {r.judged} cases, fewer than the floor {report.floor}"
    ET.indent(suites)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    )


def write_junit(report: AuditReport, path: str | Path) -> Path:
    """Write `junit_xml` to ``path``."""
    path = Path(path)
    path.write_text(junit_xml(report))
    return path
