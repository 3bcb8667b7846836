"""Searches shared among judge processes (`attnref.conformance.judges`, ``--jobs``): the
same verdict, nothing lost when a helper dies, nothing left when the audit ends."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnref.conformance import audit
from attnref.conformance.judges import Judges, Setup
from attnref.conformance.profiles import get_profile
from attnref.conformance.runner import run_property

ROOT = Path(__file__).resolve().parents[1]
PROPS = ["forward", "masked_keys", "causality", "gqa"]


def _verdicts(report: object) -> list[tuple[str, str, str, int, int, str]]:
    return [
        (r.property, str(r.dtype), r.status, r.checks, r.skipped, r.message)
        for r in report.results  # type: ignore[attr-defined]
    ]


@pytest.mark.slow  # two audits, one with two judges: 10 s
def test_two_judges_give_the_verdict_one_gives() -> None:
    """Every search is seeded alone: shared between two judges (in whatever order they
    finish), the results are those of one judge, in the same order, passes, failures
    and their shrunk cases included (a mutant that fails some of these properties)."""
    backend = "mutant.causal_excludes_self"
    kwargs = {"properties": PROPS, "dtypes": [torch.float32, torch.float64], "progress": False}
    one = audit(backend, **kwargs, jobs=1)  # type: ignore[arg-type]
    two = audit(backend, **kwargs, jobs=2)  # type: ignore[arg-type]
    assert (one.judges, two.judges) == (1, 2)
    assert _verdicts(two) == _verdicts(one)
    assert [r.finding and r.finding.case for r in two.results] == [
        r.finding and r.finding.case for r in one.results
    ]
    assert {r.status for r in two.results} == {"pass", "fail"}
    assert two.ok is one.ok is False
    assert not two.judge_notes


def test_a_search_a_dead_helper_took_is_run_by_the_audit() -> None:
    """A helper killed in the middle of a search (out of memory, say) gives it back: the
    audit's own process takes it next, and the report will say so. The helper's worker
    (hung in its call) goes with it."""
    setup = Setup(
        spec="tests.hostile.sleeps:kernel",
        api=None,
        work=(("forward", torch.float32), ("forward", torch.float64)),
        device="cpu",
        profile=get_profile("quick"),
        seed=0,
        timeout=600.0,
        threads=1,
        memory_limit=None,
        require_sandbox=False,
        budget=None,
        deadline=None,
    )
    judges = Judges(1, setup, run_property)
    try:
        ((process, _conn, now),) = judges._helpers
        deadline = time.monotonic() + 120
        while now[0] is None and time.monotonic() < deadline:
            assert judges.results(block=True) == []  # its "take"; the call hangs
        assert now[0] is not None, "the helper never took a search"
        taken = now[0]
        mine = judges.take()
        assert mine == 1 - taken  # the other one
        os.kill(process.pid, signal.SIGKILL)
        while judges.busy():
            assert judges.results(block=True) == []
        assert judges.take() == taken  # given back
        assert judges.take() is None
        (note,) = judges.failures
        assert "ended" in note
        assert "ran it again" in note
    finally:
        judges.close()


@pytest.mark.slow  # an audit in a fresh process with two judges: 12 s
def test_the_cli_shares_the_searches_and_says_so(tmp_path: Path) -> None:
    """``attnref audit --jobs 2``: the report records two judges; ``--jobs 0`` and a bad
    ``ATTNREF_JOBS`` are refused with the value named."""
    report = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "attnref", "audit", "--backend", "torch-sdpa-math",
           "--property", "forward", "--property", "gqa", "--dtype", "float32",
           "--no-progress", "--json", str(report)]  # fmt: skip
    done = subprocess.run([*cmd, "--jobs", "2"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(report.read_text())
    assert data["judges"] == 2
    assert data["judge_notes"] == []
    assert [r["status"] for r in data["results"]] == ["pass", "pass"]
    bad = subprocess.run([*cmd, "--jobs", "0"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2
    assert "--jobs must be >= 1, got 0" in bad.stderr
    env = {**os.environ, "ATTNREF_JOBS": "two"}
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    assert bad.returncode == 2
    assert "ATTNREF_JOBS must be a whole number, got 'two'" in bad.stderr


def test_jobs_below_one_is_an_error() -> None:
    with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
        audit("torch-sdpa-math", properties=["forward"], jobs=0, progress=False)


def test_jobs_asked_for_where_searches_cannot_be_shared_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--in-process`` (or a family that runs a call on several processes) keeps every
    search in one judge; ``--jobs 2`` asked for explicitly says so in the report."""
    from attnref.cli import main

    report = tmp_path / "r.json"
    args = ["audit", "--in-process", "--property", "forward", "--dtype", "float32",
            "--dtype", "float64", "--no-progress", "--json", str(report)]  # fmt: skip
    assert main([*args, "--jobs", "2"]) == 0
    data = json.loads(report.read_text())
    assert data["judges"] == 1
    (note,) = data["judge_notes"]
    assert note.startswith("2 judges were asked for; one judged every search")
    monkeypatch.delenv("ATTNREF_JOBS")  # the CLI's own default (2 on 2 cores)
    assert main(args) == 0  # a default asks for nothing: no note
    assert json.loads(report.read_text())["judge_notes"] == []


def test_helpers_that_cannot_start_leave_the_audit_to_one_judge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Helper judges only make an audit faster: where none can start (no process, no
    pipe), the audit's own process judges every search, and the report says why."""
    import attnref.conformance.judges as judges

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("no more processes")

    monkeypatch.setattr(judges.Judges, "_start", refuse)
    report = audit("torch-sdpa-math", properties=["forward", "gqa"], dtypes=[torch.float32],
                   jobs=2, progress=False)  # fmt: skip
    assert report.judges == 1
    assert [r.status for r in report.results] == ["pass", "pass"]
    (note,) = report.judge_notes
    assert "helper judges could not start (OSError: no more processes)" in note


@pytest.mark.slow  # waits out a timeout in each judge: 7 s
def test_every_judge_shortens_its_wait_after_its_first_timeout() -> None:
    """After a judge's first timeout it waits at most ten times the slowest answer (at
    least 1 s) for each later call, the audit's own process and a helper alike: with a
    backend that never answers, each judge waits the whole timeout once."""
    names = ["forward", "masked_keys", "causality", "gqa", "decode", "tails"]
    report = audit("tests.planted:hangs", properties=names, dtypes=[torch.float32],
                   timeout=2.0, progress=False, jobs=2)  # fmt: skip
    assert report.judges == 2
    messages = [r.message for r in report.results]
    assert len(messages) == len(names)
    assert all(r.status == "fail" for r in report.results)
    waited = [m for m in messages if "no answer within 2 s" in m]
    assert 1 <= len(waited) <= 2, messages  # one per judge, at most
    assert all("no answer within 2 s" in m or "no answer within 1 s" in m for m in messages)


def test_a_stop_delivered_where_python_ignores_exceptions_still_ends_the_helper() -> None:
    """The audit stops its helpers with SIGTERM. Python runs a signal handler wherever
    the main thread happens to be, in a gc callback among them, where an exception the
    handler raises is printed ("Exception ignored in ...") and dropped: the helper would
    go on, and a clean FAILED run would show a traceback. The handler is called here
    inside a gc callback: the process ends there, silently."""
    code = (
        "import gc, signal\n"
        "from attnref.conformance import judges\n"
        "def callback(phase, info):\n"
        "    if phase == 'start':\n"
        "        judges._terminate(signal.SIGTERM, None)\n"
        "gc.callbacks.append(callback)\n"
        "gc.collect()\n"
        "gc.callbacks.remove(callback)\n"
        "print('still running')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert "still running" not in done.stdout
    assert done.stderr == ""
    assert done.returncode == 0
