"""Audit reports: per-case results, a terminal table and a versioned JSON document.

JSON schema (``schema_version`` 1)::

    {
      "schema_version": 1,
      "attnref_version": str, "torch_version": str,
      "backend": str, "device": str, "dtypes": [str],
      "started": ISO-8601 str, "seconds": float,
      "summary": {"passed": int, "failed": int, "skipped": int, "ok": bool},
      "results": [
        {"case": {Case fields}, "dtype": str, "status": "pass" | "fail" | "skip",
         "max_err": float | null, "mean_err": float | null,
         "max_bound": float | null, "mean_bound": float | null,
         "message": str, "seconds": float}
      ]
    }
"""

import datetime
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnref.conformance.cases import Case

__all__ = ["SCHEMA_VERSION", "AuditReport", "CaseResult"]

SCHEMA_VERSION = 1


@dataclass
class CaseResult:
    """The verdict on one case in one dtype."""

    case: Case
    dtype: torch.dtype
    status: str  # "pass" | "fail" | "skip"
    max_err: float = math.nan
    mean_err: float = math.nan
    max_bound: float = math.nan
    mean_bound: float = math.nan
    message: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {
            "case": self.case.to_dict(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "status": self.status,
            "max_err": num(self.max_err),
            "mean_err": num(self.mean_err),
            "max_bound": num(self.max_bound),
            "mean_bound": num(self.mean_bound),
            "message": self.message,
            "seconds": self.seconds,
        }


@dataclass
class AuditReport:
    """Everything an audit found."""

    backend: str
    device: str
    dtypes: list[str]
    started: str
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0
    _t0: float = 0.0

    @classmethod
    def start(cls, backend: str, device: str, dtypes: list[str]) -> "AuditReport":
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        return cls(
            backend,
            device,
            [d.removeprefix("torch.") for d in dtypes],
            now,
            _t0=time.perf_counter(),
        )

    def finish(self) -> None:
        self.seconds = time.perf_counter() - self._t0

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return self.count("fail") == 0

    def to_dict(self) -> dict[str, Any]:
        from attnref import __version__

        return {
            "schema_version": SCHEMA_VERSION,
            "attnref_version": __version__,
            "torch_version": torch.__version__,
            "backend": self.backend,
            "device": self.device,
            "dtypes": self.dtypes,
            "started": self.started,
            "seconds": round(self.seconds, 3),
            "summary": {
                "passed": self.count("pass"),
                "failed": self.count("fail"),
                "skipped": self.count("skip"),
                "ok": self.ok,
            },
            "results": [r.to_dict() for r in self.results],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def format_table(self, *, verbose: bool = False) -> str:
        """A terminal table: one row per case, one column per dtype, then the failures."""
        dtypes = self.dtypes
        names: list[str] = []
        cells: dict[tuple[str, str], CaseResult] = {}
        for r in self.results:
            if r.case.name not in names:
                names.append(r.case.name)
            cells[(r.case.name, str(r.dtype).removeprefix("torch."))] = r
        width = max([len("case"), *map(len, names)])
        header = f"{'case':<{width}}  " + "  ".join(f"{d:>16}" for d in dtypes)
        lines = [
            f"attnref audit: backend {self.backend} on {self.device}, torch {torch.__version__}",
            header,
            "-" * len(header),
        ]
        for name in names:
            row = [f"{name:<{width}}"]
            for d in dtypes:
                row.append(f"{_cell(cells.get((name, d))):>16}")
            lines.append("  ".join(row))
        failures = [r for r in self.results if r.status == "fail"]
        skips = [r for r in self.results if r.status == "skip"]
        if failures:
            lines += ["", "failures:"]
            lines += [f"  {r.case.name} [{_dt(r)}]: {r.message}" for r in failures]
        if skips and verbose:
            lines += ["", "skipped:"]
            lines += [f"  {r.case.name} [{_dt(r)}]: {r.message}" for r in skips]
        lines += [
            "",
            f"{self.count('pass')} passed, {self.count('fail')} failed, "
            f"{self.count('skip')} skipped in {self.seconds:.1f} s: "
            + ("OK" if self.ok else "FAILED"),
        ]
        return "\n".join(lines)


def _dt(r: CaseResult) -> str:
    return str(r.dtype).removeprefix("torch.")


def _cell(r: CaseResult | None) -> str:
    if r is None:
        return ""
    if r.status == "skip":
        return "skip"
    if r.status == "fail" and math.isnan(r.max_err):
        return "FAIL"
    mark = "ok" if r.status == "pass" else "FAIL"
    return f"{mark} {r.max_err:.1e}"
