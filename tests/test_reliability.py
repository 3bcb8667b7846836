"""The audit never passes a broken backend, whatever the backend does to its process.

Each backend of the catalogue (`tests.planted`) is audited from the command line on one
or two properties with a short timeout: the audit must end, exit 1, write its report,
and name the fault.
"""

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attnref.cli import main
from attnref.conformance import PROFILES, PROPERTIES, Capabilities, audit, resolve_backend
from attnref.conformance.backends import Backend
from attnref.conformance.wire import decode, encode
from attnref.conformance.worker import Job

pytestmark = pytest.mark.usefixtures("unchecked")

CATALOGUE = [
    ("exits_0", "forward", "ended its process with exit code 0"),
    ("exits_3", "forward", "ended its process with exit code 3"),
    ("segfaults", "forward", "killed by SIGSEGV"),
    ("aborts", "forward", "killed by SIGABRT"),
    # the library's own last line, in the finding (it was in the JSON's output only)
    ("aborts", "forward", "its last line: 'kernel.cpp:42: assert failed (head_dim <= 256)'"),
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


@pytest.mark.parametrize(
    ("name", "prop", "message"), CATALOGUE, ids=[f"{c[0]}-{i}" for i, c in enumerate(CATALOGUE)]
)
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
    backend = resolve_backend(f"tests.planted_serving:{name}", api=api)
    own = [
        p
        for p, prop in PROPERTIES.items()
        if prop.families == (api,) and prop.why_not(backend.capabilities) is None
    ]
    # kvcache_far_pages past 2**17 elements: 2**31 needs more memory than a CPU machine has
    small = replace(PROFILES["quick"], far_pages=2**17)
    report = audit(backend, properties=own, dtypes=(torch.float32,), device="cpu",
                   progress=False, profile=small)  # fmt: skip
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
        Capabilities(causal_with_mask=False),
        spec="torch-sdpa",  # what its worker resolves
    )
    report = audit(backend, dtypes=(torch.float32,), device="cpu", progress=False, deadline=0.5)
    assert report.incomplete == "the deadline of 0.5 s passed"
    assert not report.ok
    assert report.count("fail") == 0
    assert len(report.results) < len(PROPERTIES)
    assert "INCOMPLETE: the deadline of 0.5 s passed" in report.format_table()


def test_under_a_deadline_a_family_s_own_properties_are_not_left_for_last() -> None:
    """In the registry's order a family's own properties come after every dense one: a
    deadline reached among those left them all unrun. With a deadline or a budget they
    take turns with the rest, after ``forward``."""
    from attnref.conformance.runner import family_first

    chosen = [p for p in PROPERTIES.values() if p.applies_to("flash-varlen")]
    assert chosen[0].id == "forward"
    assert not chosen[1].families
    ordered = family_first(chosen)
    assert sorted(p.id for p in ordered) == sorted(p.id for p in chosen)
    assert [p.id for p in ordered[:4]] == ["forward", "varlen", chosen[1].id, "varlen_alone"]
    report = audit("varlen-reference", dtypes=(torch.float32,),
                   device="cpu", progress=False, property_budget=0.01,
                   properties=["forward", "masked_keys", "varlen"])  # fmt: skip
    assert [r.property for r in report.results][:2] == ["forward", "varlen"]


@pytest.mark.slow  # 20-32 s on a loaded machine: the default tier ran 240 s of its 180
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


# ------------------------------------------------- the judge's work while a call runs


def _sdpa_job() -> Job:
    q = torch.randn(1, 2, 5, 8)
    return Job((q, q.clone(), q.clone()), {})


def test_the_judge_works_while_the_worker_computes_and_the_deadline_counts_from_the_send() -> None:
    """`Executor.run`'s ``meanwhile`` runs after the job is sent: a reply that came while
    it ran is read at once, and the timeout counts from the send, not from its end."""
    from attnref.conformance.worker import start_executor

    worker = start_executor("torch-sdpa")
    try:
        ran: list[float] = []

        def judge() -> None:
            time.sleep(1.0)
            ran.append(1.0)

        job = _sdpa_job()
        out = worker.run(job, 0.5, judge)
        assert ran == [1.0]  # longer than the timeout, yet the answer that came is taken
        assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(*job.args))
    finally:
        worker.close()
    hanging = start_executor("tests.planted:hangs")
    try:
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            hanging.run(_sdpa_job(), 1.0, lambda: time.sleep(0.6))
        assert time.perf_counter() - t0 < 1.5  # 1 s from the send, not 0.6 + 1
    finally:
        hanging.close()


def test_work_that_fails_meanwhile_ends_the_worker_so_no_reply_is_left_behind() -> None:
    """A reply left unread in the pipe would answer the next job: the worker is ended
    and the next job starts a fresh one, whose answer is its own."""
    from attnref.conformance.worker import start_executor

    worker = start_executor("torch-sdpa")
    try:

        def fails() -> None:
            raise KeyError("the judge's own bug")

        with pytest.raises(KeyError):
            worker.run(_sdpa_job(), 5.0, fails)
        job = _sdpa_job()
        out = worker.run(job, 5.0)
        assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(*job.args))
    finally:
        worker.close()


def test_an_oracle_that_fails_while_the_backend_runs_fails_where_the_check_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`Context.run` computes the oracle while the backend runs and keeps it; an oracle
    that raises there is not kept (and the call is not lost): `expect` raises it."""
    from attnref.conformance import Case, checks
    from attnref.conformance.worker import start_executor

    worker = start_executor("torch-sdpa")
    try:
        ctx = checks.Context(worker.backend, torch.float32, "cpu", 10.0, worker)
        inputs = ctx.build(Case("forward", batch=(2,), h=2, g=2, Tq=3, Tk=4, Dh=8, Dv=8))
        ctx.run(inputs)
        assert id(inputs) in ctx._oracles  # computed while the backend ran
        ctx._oracles.clear()

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("the oracle is broken")

        with monkeypatch.context() as m:
            m.setattr(checks, "expect", broken)
            out = ctx.run(inputs)
            assert id(inputs) not in ctx._oracles
            with pytest.raises(RuntimeError, match="the oracle is broken"):
                ctx.expect(inputs)
        assert torch.equal(ctx.expect(inputs).value, ctx.expect(inputs).value)
        assert out.shape == (2, 2, 3, 8)
    finally:
        worker.close()


def test_large_jobs_cross_in_a_sealed_file_the_worker_cannot_write() -> None:
    """A job whose tensors hold `SHARED_FROM` bytes or more sends them in a sealed memory
    file: each tensor arrives whole, in its layout, on a 64-byte boundary; the file
    refuses writes (and writable shared mappings), and the worker's copy-on-write pages
    change only its own view."""
    import mmap
    import os

    from attnref.conformance.wire import SHARED, SHARED_FROM, can_share, encode_shared, map_shared

    if not can_share():
        pytest.skip("no sealed memory files on this platform")
    big = torch.randn(SHARED_FROM // 4 + 3)
    t = torch.arange(15, dtype=torch.float16).reshape(3, 5).t()
    tree = {"q": big, "t": t, "n": 3}
    small = {"q": torch.randn(8)}
    assert encode_shared(small) == (encode(small), None)  # small: through the pipe
    message, fd = encode_shared(tree)
    assert fd is not None
    try:
        assert message.startswith(SHARED)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 64, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
        back = decode(message[len(SHARED) :], shared=map_shared(os.dup(fd)))
        assert torch.equal(back["q"], big)
        assert torch.equal(back["t"], t)
        assert back["t"].stride() == (1, 5)
        assert back["n"] == 3
        assert all(back[k].data_ptr() % 64 == 0 for k in ("q", "t"))
        back["q"].mul_(2)  # the worker's own pages
        again = decode(message[len(SHARED) :], shared=map_shared(os.dup(fd)))
        assert torch.equal(again["q"], big)
    finally:
        os.close(fd)


@pytest.mark.parametrize("large", [False, True])
def test_each_tensor_a_worker_gets_lies_between_guard_bytes(large: bool) -> None:
    """Through the pipe or in a sealed file, each tensor the worker decodes has `GUARD`
    bytes of `GUARD_BYTE` on each side of its storage, its own to write: a write just
    past the end (or before the start) of one is seen, and names that side; the
    tensor's values are whole."""
    import ctypes

    from attnref.conformance.wire import (
        GUARD,
        SHARED,
        SHARED_FROM,
        broken_guards,
        can_share,
        encode_shared,
        map_shared,
    )

    if large and not can_share():
        pytest.skip("no sealed memory files on this platform")
    q = torch.randn(SHARED_FROM // 4 + 3 if large else 7)
    k = torch.arange(15, dtype=torch.float16)
    message, fd = encode_shared({"q": q, "k": k})
    assert (fd is not None) == large
    guards: dict[int, int] = {}
    if fd is None:
        back = decode(message, guards=guards)
    else:
        back = decode(message[len(SHARED) :], shared=map_shared(fd), guards=guards)
    assert torch.equal(back["q"], q)
    assert torch.equal(back["k"], k)
    at = {name: back[name].untyped_storage().data_ptr() for name in ("q", "k")}
    assert sorted(guards.values()) == sorted((k.nbytes, q.nbytes))
    assert all(broken_guards(guards, a) is None for a in at.values())
    ctypes.memset(at["k"] + k.nbytes + GUARD - 1, 0, 1)  # the last guard byte after k
    assert broken_guards(guards, at["k"]) == "after its end"
    ctypes.memset(at["q"] - 1, 0, 1)
    assert broken_guards(guards, at["q"]) == "before its start"
    assert torch.equal(back["q"], q)
    assert torch.equal(back["k"], k)
    assert broken_guards(guards, 12345) is None  # not a guarded storage


def test_a_workers_reused_memory_file_is_sealed_against_it_and_carries_each_job() -> None:
    """An executor's `Arena` carries job after job in one file (a new, larger one when a
    job outgrows it): each decodes to its own tensors, and the worker's descriptor can
    neither write the file, map it writable and shared, nor change its size."""
    import mmap
    import os

    from attnref.conformance.wire import (
        SHARED,
        SHARED_FROM,
        Arena,
        can_share,
        encode_shared,
        map_shared,
    )

    if not can_share():
        pytest.skip("no sealed memory files on this platform")
    arena = Arena()
    try:
        for n in (SHARED_FROM // 4, SHARED_FROM, 3 * SHARED_FROM, SHARED_FROM // 4 + 1):
            tree = {"q": torch.randn(n), "k": torch.arange(7.0)}
            message, fd = encode_shared(tree, arena)
            assert fd is not None
            assert message.startswith(SHARED)
            if arena.off:
                os.close(fd)
                pytest.skip("no F_SEAL_FUTURE_WRITE here: one-off files instead")
            try:
                with pytest.raises(PermissionError):
                    os.pwrite(fd, b"x", 0)
                with pytest.raises(PermissionError):
                    os.write(fd, b"x")
                with pytest.raises(PermissionError):
                    mmap.mmap(fd, 64, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
                for size in (64, 2**34):
                    with pytest.raises(PermissionError):
                        os.ftruncate(fd, size)
                back = decode(message[len(SHARED) :], shared=map_shared(os.dup(fd)))
                assert torch.equal(back["q"], tree["q"])
                assert torch.equal(back["k"], tree["k"])
                back["q"].mul_(2)  # the worker's own pages: the next job is unaffected
            finally:
                os.close(fd)
    finally:
        arena.close()


@pytest.mark.slow  # 20-32 s on a loaded machine: the default tier ran 240 s of its 180
def test_a_kernel_that_writes_its_large_inputs_is_still_caught() -> None:
    """Through a sealed file, an input the kernel changes in place changes in the
    worker's copy-on-write pages, which the worker's input check reads (the worker's
    side, run here: every audit's long cases cross this way through a real worker)."""
    from attnref.conformance.wire import SHARED, SHARED_FROM, can_share, encode_shared, map_shared
    from attnref.conformance.worker import handle, read_reply

    if not can_share():
        pytest.skip("no sealed memory files on this platform")
    q = torch.randn(1, 2, SHARED_FROM // 32, 8)
    message, fd = encode_shared(Job((q, q.clone(), q.clone()), {}).message())
    assert fd is not None
    job = decode(message[len(SHARED) :], shared=map_shared(fd))
    with pytest.raises(Exception, match="modified its inputs: query"):
        read_reply(handle(resolve_backend("tests.planted:scales_query_in_place"), job))


def test_the_input_check_sees_one_changed_element_in_every_layout_and_alignment() -> None:
    """The worker compares an input's bytes before and after a call as words, reading a
    contiguous input in place: a change of one element is seen whatever the input's
    offset, size-1 strides or byte count."""
    from attnref.conformance.sandboxed import _fingerprint, _same

    base = torch.arange(2 * 3 * 5 * 7, dtype=torch.float16).reshape(2, 3, 5, 7)
    views = {
        "contiguous": base.clone(),
        "offset by one element": base.clone().reshape(-1)[1:].reshape(209, 1),
        "odd byte count": base.clone()[:1, :1, :1, :3],
        "size-1 dim with stride 2": base.clone().reshape(-1)[:2].as_strided((1, 2), (2, 1)),
        "transposed": base.clone().transpose(-1, -2),
        "bool": (base.clone() > 100)[:, 1],
        "float64 sliced": base.double()[:, :, 1:],
    }
    for name, t in views.items():
        before = _fingerprint(t)
        assert _same(_fingerprint(t, copy=False), before), name
        flat = t.reshape(-1) if t.is_contiguous() else None
        target = t[(0,) * t.dim()] if flat is None else flat[-1:]
        target.logical_not_() if t.dtype == torch.bool else target.add_(1)
        assert not _same(_fingerprint(t, copy=False), before), name
