"""The context-parallel family: references pass, class-30 bugs fail, misbehaving ranks are
named and leave nothing behind (gloo, on this machine's CPU, four ranks)."""

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from attnref.conformance import PROFILES, BackendError, audit
from attnref.conformance.families import FAMILIES, MUTANTS
from attnref.conformance.families.context_parallel import (
    Launch,
    RankGroup,
    _worker_env,
    free_port,
    launched,
)
from attnref.conformance.verdicts import one_line
from attnref.conformance.worker import BackendDied, Raised, RemoteError, start_executor
from tests.hostile.marks import pids_named

CP = ("cp_agreement", "cp_gradients", "cp_world_size")
QUICK = PROFILES["quick"]
ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize(
    "name",
    [
        # all three in the slow tier: the default tier fails an unseen class-30 kernel at
        # world size 4, through the same ranks and properties
        pytest.param("ring-reference", marks=pytest.mark.slow),
        pytest.param("allgather-reference", marks=pytest.mark.slow),
        pytest.param("alltoall-reference", marks=pytest.mark.slow),
    ],
)
def test_the_references_pass_the_family_properties(name: str) -> None:
    report = audit(name, properties=CP, dtypes=(torch.float32,), progress=False, world_size=4)
    assert report.ok, report.format_table()
    assert report.world_size == 4
    assert report.api == "context-parallel"
    # the ranks meet over TCP; without CUDA (no NCCL) no UNIX socket is theirs to open
    if not torch.cuda.is_available() and "seccomp" in str(report.sandbox.get("enforced")):
        assert "unix sockets" in report.sandbox["enforced"], report.sandbox
        assert "TCP sockets" in report.sandbox["allowed"]["network"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ring-reference", "allgather-reference", "alltoall-reference"])
def test_the_references_pass_in_half_precision_and_float64(name: str) -> None:
    """float64 and bfloat16 (float16 too took 211 s of the slow tier for the three; its
    bounds are the dense audits' own, which torch's SDPA passes in every dtype)."""
    dtypes = (torch.float64, torch.bfloat16)
    report = audit(name, properties=(*CP, "forward", "variants", "lse"), dtypes=dtypes,
                   progress=False, world_size=4)  # fmt: skip
    assert report.ok, report.format_table()


@pytest.mark.slow
def test_the_ring_reference_passes_the_whole_audit_at_world_size_3() -> None:
    report = audit("ring-reference", dtypes=(torch.float32,), progress=False, world_size=3)
    assert report.ok, report.format_table()


CLASS_30 = [m for m in MUTANTS.values() if m.api == "context-parallel"]


def test_there_are_class_30_mutants_for_each_bug_the_issue_names() -> None:
    assert len(CLASS_30) >= 6
    assert {m.bug_class for m in CLASS_30} == {30}


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in CLASS_30])
def test_each_class_30_mutant_fails_the_family_properties(name: str) -> None:
    report = audit(MUTANTS[name].backend(), properties=CP, dtypes=(torch.float32,),
                   progress=False, world_size=4, fail_fast=True)  # fmt: skip
    assert not report.ok, report.format_table()


@pytest.mark.parametrize(
    "name", ["zigzag_equal_chunks", pytest.param("ulysses_heads_mixed", marks=pytest.mark.slow)]
)
def test_kernels_it_has_not_seen_with_a_class_30_bug_fail(name: str) -> None:
    report = audit(f"tests.planted_cp:{name}", api="context-parallel", properties=CP[:1],
                   dtypes=(torch.float32,), progress=False, world_size=4)  # fmt: skip
    assert not report.ok, report.format_table()
    (failed,) = [r for r in report.results if r.status == "fail"]
    assert failed.finding is not None
    assert "world_size=4" in failed.finding.reproducer


def _pids(output: str) -> set[str]:
    """The names the ranks gave the threads they ran in (`tests.planted_cp`)."""
    return set(re.findall(r"PLANTED_CP_MARK (\w+)", output))


def _alive(name: str) -> bool:
    """Whether a process with a thread called ``name`` still runs (a zombie is gone)."""
    for pid in pids_named(name):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
                return True
    return False


def _audit_cli(spec: str, tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    env = {**os.environ, "ATTNREF_BACKEND_OUTPUT": "show"}  # the ranks print their names
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "attnref", "audit", "--api", "context-parallel",
         "--world-size", "4", "--backend", spec, "--dtype", "float32", "--no-progress",
         "--property", "cp_agreement", "--property", "cp_world_size", "--json", str(out),
         *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    return done.returncode, json.loads(out.read_text()), done.stdout + done.stderr


@pytest.mark.parametrize(
    ("spec", "rank", "what", "extra"),
    [
        pytest.param("tests.planted_cp:raises_on_rank_2", 2, "planted: rank 2 gave up", (),
                     marks=pytest.mark.slow),
        pytest.param("tests.planted_cp:dies_on_rank_1", 1, "killed by SIGKILL", (),
                     marks=pytest.mark.slow),
        pytest.param("tests.planted_cp:hangs_on_rank_3", 3, "no answer within",
                     ("--timeout", "6"), marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_a_rank_that_raises_dies_or_hangs_is_named_and_nothing_is_left(
    spec: str, rank: int, what: str, extra: tuple[str, ...], tmp_path: Path
) -> None:
    code, report, output = _audit_cli(spec, tmp_path, *extra)
    assert code == 1, output
    failures = [r for r in report["results"] if r["status"] == "fail"]
    assert failures, output
    assert any(f"rank {rank}" in r["message"] and what in r["message"] for r in failures), output
    assert report["summary"]["checks"] > 1
    pids = _pids(output)
    assert len(pids) >= 4
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "a rank's process outlived the audit"


@pytest.mark.slow  # two audits of two ranks: 11 s (tests/test_sandbox.py has the mechanism)
def test_a_rank_cannot_reach_a_forkserver_s_socket() -> None:
    """A context-parallel worker keeps its sockets (its ranks meet over TCP), but the
    forkservers' sockets (one forks, for whoever connects, a process outside any
    sandbox) lie in the judge's temporary folder, which the worker's mount namespace
    covers: no connection is made, where with no sandbox one is (the control). The judge
    here has a temporary folder of its own: the control must not reach the forkservers
    of the tests beside it (a connection that sends nothing crashes one)."""
    root = tempfile.mkdtemp(prefix="cp-", dir="/tmp")
    try:
        cmd = [sys.executable, "-m", "attnref", "audit", "--api", "context-parallel",
               "--world-size", "2", "--backend", "tests.planted_cp:reaches_forkserver",
               "--dtype", "float32", "--no-progress", "--property", "cp_agreement"]  # fmt: skip
        seen, outputs = {}, {}
        for off in ("", "1"):
            env = {**os.environ, "TMPDIR": root, "ATTNREF_NO_SANDBOX": off,
                   "ATTNREF_BACKEND_OUTPUT": "show"}  # fmt: skip
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=600, check=False)  # fmt: skip
            output = done.stdout + done.stderr
            # (the control's connection, which sends nothing, crashes its forkserver)
            assert done.returncode == 0 or off, output
            seen[off] = set(re.findall(r"PLANTED_CP_FORKSERVER (done|none)", output))
            outputs[off] = output
        if "shared memory" not in outputs[""].splitlines()[0]:
            pytest.skip("no namespaces here: the folder cannot be covered")
        assert seen[""] == {"none"}, outputs[""]
        assert "done" in seen["1"], outputs["1"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_family_refuses_what_it_cannot_run() -> None:
    with pytest.raises(BackendError, match="one process per rank"):
        start_executor("ring-reference", "context-parallel", isolate=False)
    with pytest.raises(BackendError, match="runs each call on one process"):
        start_executor("reference", None, world_size=2)
    assert FAMILIES["context-parallel"].world_size == 4


def test_the_family_is_listed_from_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    from attnref.cli import main

    assert main(["audit", "--list-families"]) == 0
    assert "context-parallel" in capsys.readouterr().out
    assert replace(QUICK).name == "quick"


# ------------------------------------------------------------------ under torchrun


def _torchrun(spec: str, tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    """``torchrun --nproc-per-node 4 -m attnref audit ...``: rank 0 judges, the others
    host their ranks' workers."""
    env = {**os.environ, "ATTNREF_BACKEND_OUTPUT": "show"}  # the ranks print their names
    out = tmp_path / "report.json"
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "attnref", "audit",
         "--api", "context-parallel", "--backend", spec, "--dtype", "float32",
         "--no-progress", "--property", "cp_agreement", "--property", "cp_world_size",
         "--json", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    report = json.loads(out.read_text()) if out.exists() else {}
    return done.returncode, report, done.stdout + done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "ok", "what"),
    [
        ("ring-reference", True, ""),
        ("tests.planted_cp:zigzag_equal_chunks", False, "max error"),
        ("tests.planted_cp:dies_on_rank_1", False, "rank 1: the backend's process was killed"),
    ],
)
def test_under_torchrun_rank_0_judges_and_the_others_host_their_workers(
    spec: str, ok: bool, what: str, tmp_path: Path
) -> None:
    code, report, output = _torchrun(spec, tmp_path)
    assert report, output
    assert report["world_size"] == 4
    assert (code == 0) is ok, output
    failures = [r for r in report["results"] if r["status"] == "fail"]
    assert (not failures) is ok, output
    assert (not failures) or any(what in r["message"] for r in failures), output
    pids = _pids(output)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "a rank's process outlived the audit"


def test_torchrun_s_variables_are_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ATTNREF_JUDGE_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert launched() is None
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert launched() == Launch(2, 4, 2, "10.0.0.1")
    monkeypatch.setenv("ATTNREF_JUDGE_ADDR", "10.0.0.7")
    assert launched() == Launch(2, 4, 2, "10.0.0.7")
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(BackendError, match=r"RANK=4 must be in \[0, WORLD_SIZE=4\)"):
        launched()
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(BackendError, match="must be integers"):
        launched()
    # a worker does not see torchrun's variables, and sees its rank's GPU only
    env = _worker_env(2)
    assert env["MASTER_PORT"] is None
    assert env["TORCHELASTIC_USE_AGENT_STORE"] is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert _worker_env(2)["CUDA_VISIBLE_DEVICES"] == "6"


def test_the_failure_that_names_a_group_s_culprit_is_chosen_by_kind() -> None:
    """A rank that died is the cause before one that raised an error of its own, before
    one that hung, before one whose group failed it (it waited on the culprit)."""
    waited = Raised(RemoteError("DistBackendError", "gloo: connection closed by peer"))
    own = Raised(RemoteError("ValueError", "planted"))
    died = BackendDied("killed by SIGKILL")
    hung = TimeoutError("no answer within 6 s")
    cause = RankGroup._cause({0: waited, 2: own, 3: hung})
    assert isinstance(cause, Raised)
    assert str(cause.error) == "rank 2: planted (then ranks 0, 3)"
    cause = RankGroup._cause({0: waited, 1: died, 2: own})
    assert isinstance(cause, BackendDied)
    assert str(cause) == "rank 1: killed by SIGKILL (then ranks 0, 2)"
    cause = RankGroup._cause({1: waited, 3: hung})
    assert isinstance(cause, TimeoutError)
    assert str(cause) == "rank 3: no answer within 6 s (then rank 1)"
    cause = RankGroup._cause({2: waited})
    assert isinstance(cause, Raised)
    assert "rank 2: gloo" in str(cause.error)
    # a library's bare assert keeps its source line once the rank is named
    trace = 'Traceback:\n  File "/x/ring.py", line 87, in forward\n    assert k.shape == v.shape\n'
    bare = Raised(RemoteError("AssertionError", "", trace))
    cause = RankGroup._cause({0: bare, 1: waited})
    assert isinstance(cause, Raised)
    assert one_line(cause.error) == (
        "AssertionError: rank 0: with no message, raised at ring.py, line 87: "
        "assert k.shape == v.shape (then rank 1)"
    )


def test_torch_s_own_context_parallel_is_skipped_with_the_reason_off_cuda() -> None:
    report = audit("torch-context-parallel", properties=("forward",), dtypes=(torch.float32,),
                   progress=False, world_size=2)  # fmt: skip
    (result,) = report.results
    assert result.status == "skip", report.format_table()
    assert "flash, memory-efficient and cuDNN kernels, which run on CUDA" in result.message


@pytest.mark.slow  # 8 s; the default tier holds the calls inside the declarations (below)
def test_a_kernel_that_takes_only_the_full_group_is_audited_inside_it() -> None:
    """cp_full_group: every call on the group of every rank started (no subgroup, which
    hung such a library until gloo's timeout); the world-size law compares the two
    shardings there. Undeclared, its raise on a subgroup call is a failure."""
    from attnref.conformance.backends import resolve_backend

    backend = resolve_backend("tests.planted_cp:full_group_only", api="context-parallel")
    kwargs: dict[str, Any] = {"dtypes": (torch.float32,), "progress": False, "world_size": 2}
    report = audit(backend, properties=CP, **kwargs)
    assert report.ok, report.format_table()
    assert all(r.status == "pass" for r in report.results), report.format_table()
    plain = replace(backend, capabilities=replace(backend.capabilities, cp_full_group=False))
    report = audit(plain, properties=CP, **kwargs)
    assert not report.ok, report.format_table()


@pytest.mark.parametrize(
    ("spec", "limit"),
    [
        # a ring library of contiguous shards only: it raises on a zigzag call
        pytest.param(
            "tests.planted_cp:contiguous_only", {"cp_shardings": ("contiguous",)},
            marks=pytest.mark.slow,  # 8 s
        ),
        # all-gather attention that places zigzag chunks at multiples of T // 2W: right
        # exactly where the chunks are equal
        pytest.param(
            "tests.planted_cp:zigzag_equal_chunks", {"cp_equal_shards": True},
            marks=pytest.mark.slow,  # 8 s
        ),
    ],
)  # fmt: skip
def test_a_kernel_of_one_sharding_or_equal_chunks_is_audited_inside_it(
    spec: str, limit: dict[str, Any]
) -> None:
    """Declared, every property of the family judges it inside the limit, and the report
    says what is left untested; undeclared, the same kernel fails."""
    from attnref.conformance.backends import resolve_backend

    backend = resolve_backend(spec, api="context-parallel")
    declared = replace(backend, capabilities=replace(backend.capabilities, **limit))
    kwargs: dict[str, Any] = {"dtypes": (torch.float32,), "progress": False, "world_size": 4}
    props = ("cp_agreement", "cp_world_size", "causality")
    report = audit(declared, properties=props, **kwargs)
    assert report.ok, report.format_table()
    assert all(r.status == "pass" and r.judged >= 10 for r in report.results), report.format_table()
    assert ("zigzag shards" if "cp_shardings" in limit else "unequal lengths") in (
        report.format_table()
    )
    default: dict[str, Any] = {"cp_shardings": ("contiguous", "zigzag"), "cp_equal_shards": False}
    plain = replace(backend, capabilities=replace(backend.capabilities, **default))
    assert not audit(plain, properties=props, **kwargs).ok


def test_calls_outside_the_sharding_declarations_are_not_made() -> None:
    """A case that names a sharding not declared runs in one declared; a length no world
    size cuts into equal chunks is skipped with the reason; the world size is the largest
    that cuts it evenly."""
    from attnref.conformance.backends import resolve_backend
    from attnref.conformance.cases import Case
    from attnref.conformance.declarations import Capabilities
    from attnref.conformance.families.context_parallel import CONTEXT_PARALLEL, fitted_world
    from attnref.conformance.runner import check_case

    equal = replace(CONTEXT_PARALLEL, cp_equal_shards=True)
    assert fitted_world(equal, 12, 4, "zigzag") == 3  # 6 chunks of 2; 8 do not cut 12
    assert fitted_world(equal, 10, 4, "contiguous") == 2
    assert fitted_world(equal, 7, 4, "zigzag") is None
    assert fitted_world(replace(equal, cp_full_group=True), 12, 4, "zigzag") is None
    assert fitted_world(CONTEXT_PARALLEL, 7, 4, "zigzag") == 4
    with pytest.raises(ValueError, match="cp_shardings must name one or both"):
        Capabilities(cp_shardings=("striped",))
    options = (("world", 2), ("sharding", "zigzag"))
    odd = Case("x", batch=(1,), h=2, g=2, Tq=7, Tk=7, options=options)
    backend = resolve_backend("tests.planted_cp:zigzag_equal_chunks", api="context-parallel")
    declared = replace(backend, capabilities=replace(backend.capabilities, cp_equal_shards=True,
                                                     cp_shardings=("zigzag",)))  # fmt: skip
    verdict = check_case("cp_agreement", declared, odd, torch.float32, world_size=2)
    assert verdict.startswith("skip: T = 7 cuts into no equal zigzag chunks"), verdict


# ------------------------------------------------------------------ the bench


@pytest.mark.slow  # three backends, two ranks each, ten timed calls: about 40 s
def test_the_bench_times_on_the_judges_clock_and_verifies_every_call() -> None:
    """The context-parallel bench goes through the bench's one timing path: fresh values
    per call, the judge's clock less a clean dry run on as many ranks, every output put
    back together and verified. A rank clock ten times slow is flagged; a kernel wrong
    on one call in ten is wrong; the ring reference is ok, with its bytes sent."""
    from attnref.bench.cases import BenchCase
    from attnref.bench.runner import run_benchmarks

    specs = ["ring-reference", "tests.planted_cp:slow_clock", "tests.planted_cp:wrong_one_in_ten"]
    # calls of several ms whose inputs and outputs are small beside the work
    case = BenchCase(B=1, h=4, Tq=1024, Tk=1024, Dh=64, causal="top_left")
    results = run_benchmarks(specs, [case], api="context-parallel", world_size=2, runs=10,
                             warmup=1, memory=False, progress=False)  # fmt: skip
    status = {r.backend: r for r in results}
    ok = status["ring-reference"]
    assert ok.status == "ok", ok.note
    assert "verified: the first call and all 10 timed calls" in ok.note
    assert "sent/rank" in ok.note
    assert status["tests.planted_cp:slow_clock"].status == "flagged", status
    assert status["tests.planted_cp:wrong_one_in_ten"].status == "wrong", status


@pytest.mark.slow  # an audit of two ranks, started twice: 6 s
def test_a_port_taken_before_the_group_meets_is_not_the_backend_s_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store's port is found free, then the ranks bind it a moment later: another
    process may take it between the two (a CI run lost one so). The group
    meets again on a new port; the backend is not blamed for EADDRINUSE."""
    from attnref.conformance.families import context_parallel as cp

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [int(taken.getsockname()[1])]
    monkeypatch.setattr(
        cp, "free_port", lambda host="127.0.0.1": ports.pop() if ports else free_port(host)
    )
    try:
        report = audit("ring-reference", properties=("cp_world_size",), dtypes=(torch.float32,),
                       progress=False, world_size=2)  # fmt: skip
    finally:
        taken.close()
    assert not ports  # the taken port was handed out
    assert report.ok, report.format_table()
