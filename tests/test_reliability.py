"""The audit never passes a broken backend, whatever the backend does to its process.

Each backend of the catalogue (`tests.planted`) is audited from the command line on one
or two properties with a short timeout: the audit must end, exit 1, write its report,
and name the fault.
"""

import json
from pathlib import Path

import pytest
import torch

from attnref.cli import main
from attnref.conformance import PROPERTIES, Capabilities, audit, resolve_backend
from attnref.conformance.backends import Backend

pytestmark = pytest.mark.usefixtures("unchecked")

CATALOGUE = [
    ("exits_0", "forward", "ended its process with exit code 0"),
    ("exits_3", "forward", "ended its process with exit code 3"),
    ("segfaults", "forward", "killed by SIGSEGV"),
    ("aborts", "forward", "killed by SIGABRT"),
    ("hangs", "forward", "TimeoutError: no answer within 1 s"),
    ("busy_loop", "forward", "TimeoutError: no answer within 1 s"),
    ("returns_nan", "forward", "NaN/inf values where a finite value is expected"),
    ("returns_inf", "forward", "NaN/inf values where a finite value is expected"),
    ("scales_query_in_place", "forward", "the backend modified its inputs: query"),
    ("detached", "gradient", "the output does not require grad"),
    ("wrong_shape", "forward", "returned shape"),
    ("wrong_dtype", "forward", "returned dtype torch.float64, expected torch.float32"),
    ("not_a_tensor", "forward", "returned list, not a tensor"),
    ("allocates_without_bound", "forward", "RuntimeError"),
    ("calls_sys_exit", "forward", "SystemExit: 0"),
    ("raises_keyboard_interrupt", "forward", "KeyboardInterrupt"),
]


@pytest.mark.parametrize(("name", "prop", "message"), CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_every_hostile_backend_fails_with_a_report_naming_its_fault(
    name: str, prop: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "report.json"
    code = main(
        [
            "audit",
            "--backend",
            f"tests.planted:{name}",
            "--property",
            prop,
            "--dtype",
            "float32",
            "--timeout",
            "1",
            "--memory-limit",
            "8",
            "--no-progress",
            "--json",
            str(path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1, out
    data = json.loads(path.read_text())
    assert data["summary"]["ok"] is False
    (result,) = data["results"]
    assert result["status"] == "fail"
    assert message in result["message"], result["message"]
    assert message in out
    reproducer = tmp_path / "report.reproducers" / f"{prop}-float32.py"
    assert reproducer.exists()


def test_an_all_nan_backend_fails_every_property() -> None:
    """Laws compare the backend with itself: NaN must never equal NaN there."""
    report = audit(
        resolve_backend("tests.planted:returns_nan_everywhere"),
        dtypes=(torch.float32,),
        device="cpu",
        progress=False,
    )
    assert {r.property for r in report.results} == {
        p for p, prop in PROPERTIES.items() if prop.applies_to("sdpa")
    }
    for r in report.results:
        assert r.status == "fail", (r.property, r.status, r.message)
        assert "NaN/inf" in r.message or "does not require grad" in r.message, r.message


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "api"), [("nan_varlen", "flash-varlen"), ("nan_kvcache", "flash-kvcache")]
)
def test_an_all_nan_packed_or_paged_backend_fails_its_familys_properties(
    name: str, api: str
) -> None:
    own = [p for p, prop in PROPERTIES.items() if prop.families == (api,)]
    backend = resolve_backend(f"tests.planted_serving:{name}", api=api)
    report = audit(backend, properties=own, dtypes=(torch.float32,), device="cpu",
                   progress=False)  # fmt: skip
    assert own
    for r in report.results:
        assert r.status == "fail", (r.property, r.status, r.message)
        assert "NaN/inf" in r.message, r.message


def test_a_law_names_the_call_that_went_wrong() -> None:
    nan = resolve_backend("tests.planted:returns_nan")
    report = audit(nan, properties=["value_affine"], dtypes=(torch.float32,), device="cpu",
                   progress=False)  # fmt: skip
    (r,) = report.results
    assert "the call on the original inputs returned" in r.message
    assert "where the oracle is finite" in r.message


def test_in_process_runs_the_backend_here_and_still_reports() -> None:
    report = audit(
        resolve_backend("tests.planted:raises"),
        properties=["forward"],
        dtypes=(torch.float32,),
        device="cpu",
        progress=False,
        isolate=False,
    )
    assert "RuntimeError: kernel launch failed" in report.results[0].message


def test_after_a_timeout_later_waits_are_shorter(capsys: pytest.CaptureFixture[str]) -> None:
    report = audit(
        resolve_backend("tests.planted:hangs"),
        properties=["forward", "decode", "gqa"],
        dtypes=(torch.float32,),
        device="cpu",
        progress=False,
        timeout=3.0,
    )
    assert [r.status for r in report.results] == ["fail", "fail", "fail"]
    assert "no answer within 3 s" in report.results[0].message
    assert "no answer within 1 s" in report.results[1].message
    assert report.seconds < 3 + 1 + 1 + 5


def test_a_deadline_ends_the_audit_incomplete_and_not_ok() -> None:
    backend = Backend(
        "sdpa",
        torch.nn.functional.scaled_dot_product_attention,
        "",
        Capabilities(),
        spec="torch-sdpa",  # what its worker resolves
    )
    report = audit(backend, dtypes=(torch.float32,), device="cpu", progress=False, deadline=0.5)
    assert report.incomplete == "the deadline of 0.5 s passed"
    assert not report.ok
    assert report.count("fail") == 0
    assert len(report.results) < len(PROPERTIES)
    assert "INCOMPLETE: the deadline of 0.5 s passed" in report.format_table()


def test_a_reproducer_exits_1_while_the_failure_reproduces(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "r.json"
    assert main(["audit", "--backend", "tests.planted:segfaults", "--property", "forward",
                 "--dtype", "float32", "--no-progress", "--json", str(path)]) == 1  # fmt: skip
    reproducer = tmp_path / "r.reproducers" / "forward-float32.py"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(reproducer)], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("FAIL: the backend's process was killed by SIGSEGV")


def test_the_json_report_is_written_after_every_property_marked_incomplete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash of attnref itself in the middle leaves a valid report that says it is partial."""
    import attnref.conformance.report as report_module

    path = tmp_path / "r.json"
    calls = []
    original = report_module.AuditReport.write_json

    def write_then_crash(self: report_module.AuditReport, p: str | Path) -> list[Path]:
        out = original(self, p)
        calls.append(p)
        if len(calls) == 2:
            raise RuntimeError("attnref crashed")
        return out

    monkeypatch.setattr(report_module.AuditReport, "write_json", write_then_crash)
    args = ["audit", "--property", "forward", "--property", "decode", "--property", "gqa",
            "--dtype", "float32", "--no-progress", "--json", str(path)]  # fmt: skip
    assert main(args) == 3  # attnref's own error
    data = json.loads(path.read_text())
    assert len(data["results"]) == 2
    assert data["incomplete"] == "the audit had not finished when this was written"
    assert data["summary"]["ok"] is False
