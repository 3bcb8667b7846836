"""The sandbox of the backend's worker (issue 29, `attnref._sandbox`, docs/untrusted.md).

The system calls are tested in a fresh interpreter that enters the sandbox and tries
each way out; the audit is tested end to end with `tests.hostile.escapes`, whose
backends write outside their scratch folder, detach a grandchild that rewrites the
report, connect to a loopback port and signal the judge.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from attnref import _sandbox

ROOT = Path(__file__).resolve().parents[1]
ABI = _sandbox.landlock_abi()
needs_landlock = pytest.mark.skipif(
    ABI < 6, reason=f"Landlock ABI {ABI}: the full sandbox needs 6 (Linux 6.12 or later)"
)


def _offered() -> set[str]:
    """The parts this platform cannot enforce, as a fresh process entering the sandbox
    finds (a lifetime without user namespaces, say): what a report may list as missing."""
    with tempfile.TemporaryDirectory() as scratch:
        enforced = _inside("", Path(scratch))["enforced"]
    assert isinstance(enforced, dict)
    return set(enforced["missing"])


def _inside(code: str, scratch: Path, network: bool = False, policy: str = "") -> dict[str, object]:
    """Run ``code`` in a fresh interpreter inside the sandbox (``policy``: the Python of
    the policy, else a plain one); what it prints as JSON."""
    policy = policy or f"_sandbox.Policy(network={network})"
    prog = (
        textwrap.dedent(
            f"""
        import json, os, socket, sys
        from attnref import _sandbox
        enforced = _sandbox.enter({str(scratch)!r}, {policy})
        out = {{"enforced": enforced.message()}}
        """
        )
        + textwrap.dedent(code)
        + "\nprint(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, timeout=60,
        cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _try(expr: str) -> str:
    return textwrap.dedent(
        f"""
        try:
            {expr}
            ok = "done"
        except OSError as e:
            ok = e.errno
        """
    )


@needs_landlock
def test_the_worker_writes_only_in_its_scratch_folder(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    outside = tmp_path / "outside.txt"
    site = Path(sysconfig.get_paths()["purelib"]) / "attnref-sandbox-test.pth"
    code = ""
    for name, path in [("scratch", scratch / "a"), ("outside", outside), ("site", site),
                       ("home", "~/x"), ("devnull", "/dev/null")]:  # fmt: skip
        code += _try(f"open(os.path.expanduser({str(path)!r}), 'w').write('x')")
        code += f"out[{name!r}] = ok\n"
    code += _try("os.mkdir(os.path.join(os.environ['TMPDIR'], 'd'))") + "out['tmpdir'] = ok\n"
    try:
        out = _inside(code, scratch)
    finally:
        site.unlink(missing_ok=True)
    assert out["scratch"] == "done"
    assert out["home"] == "done"
    assert out["tmpdir"] == "done"
    assert out["devnull"] == "done"
    assert out["outside"] == 13
    assert out["site"] == 13
    assert not outside.exists()


@needs_landlock
def test_the_worker_opens_no_socket_and_signals_no_one_outside(tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    code = _try(f"socket.create_connection(('127.0.0.1', {port}), 2)") + "out['tcp'] = ok\n"
    code += _try("socket.socket(socket.AF_UNIX)") + "out['unix'] = ok\n"
    code += _try("socket.socket(socket.AF_INET, socket.SOCK_DGRAM)") + "out['udp'] = ok\n"
    code += _try(f"os.kill({os.getpid()}, 0)") + "out['signal'] = ok\n"
    code += _try("os.setsid()") + "out['setsid'] = ok\n"
    code += _try("os.setpgid(0, 0)") + "out['setpgid'] = ok\n"
    # x86-64's x32 ABI: socket(AF_INET, SOCK_STREAM) by its number with the x32 bit, which
    # a filter that checks the architecture only would let through (an unfiltered kernel
    # makes the socket, or has no x32: ENOSYS)
    code += textwrap.dedent(
        """
        import ctypes, platform
        libc = ctypes.CDLL(None, use_errno=True)
        if platform.machine() == "x86_64":
            r = libc.syscall(0x40000000 | 41, 2, 1, 0)
            out["x32"] = ctypes.get_errno() if r < 0 else "done"
        """
    )
    with listener:
        out = _inside(code, tmp_path)
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert out["tcp"] == out["unix"] == out["udp"] == 1  # EPERM
    assert out["signal"] in (1, 3)  # EPERM, or ESRCH from a PID namespace of its own
    assert out["setsid"] == out["setpgid"] == 1
    assert out.get("x32", 1) == 1  # EPERM: refused by the filter, not missing (ENOSYS)
    enforced = out["enforced"]
    assert isinstance(enforced, dict)
    # what the attacks above need is enforced; a lifetime only where the kernel allows
    assert set(enforced["missing"]) <= {"lifetime"}, enforced


@needs_landlock
def test_a_network_policy_leaves_sockets_open_and_still_confines_files(tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    code = _try(f"socket.create_connection(('127.0.0.1', {port}), 2)") + "out['tcp'] = ok\n"
    code += _try(f"open({str(tmp_path / 'outside')!r}, 'w')") + "out['file'] = ok\n"
    (tmp_path / "scratch").mkdir()
    with listener:
        out = _inside(code, tmp_path / "scratch", network=True)
    assert out["tcp"] == "done"
    assert out["file"] == 13


@needs_landlock
@pytest.mark.parametrize("unix", [False, True])
def test_a_tcp_only_policy_refuses_unix_sockets(tmp_path: Path, unix: bool) -> None:
    """Context-parallel workers on a host without CUDA (no NCCL, whose UNIX sockets they
    would need) may open TCP sockets but no UNIX socket: a pathname socket anywhere on
    the machine (a forkserver's outside the judge's temporary folder, a local service's)
    is then out of reach, which Landlock cannot refuse before ABI 8. With ``unix`` (a
    GPU host, the control) the connection is made."""
    root = Path(tempfile.mkdtemp(prefix="u-", dir="/tmp"))  # a socket path is short
    path = str(root / "service")
    listener = socket.socket(socket.AF_UNIX)
    tcp = socket.create_server(("127.0.0.1", 0))
    try:
        listener.bind(path)
        listener.listen(1)
        code = _try(f"socket.socket(socket.AF_UNIX).connect({path!r})") + "out['unix'] = ok\n"
        code += _try("socket.socketpair()") + "out['pair'] = ok\n"
        code += _try(f"socket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), 2)")
        code += "out['tcp'] = ok\n"
        code += _try("socket.socket(socket.AF_INET6)") + "out['tcp6'] = ok\n"
        (tmp_path / "scratch").mkdir()
        policy = f"_sandbox.Policy(network=True, unix={unix})"
        out = _inside(code, tmp_path / "scratch", policy=policy)
    finally:
        listener.close()
        tcp.close()
        shutil.rmtree(root, ignore_errors=True)
    enforced = out["enforced"]
    assert isinstance(enforced, dict)
    assert out["tcp"] == out["tcp6"] == out["pair"] == "done"
    if unix:
        assert out["unix"] == "done"
        assert "unix sockets" not in enforced["enforced"]
    else:
        assert out["unix"] == 1  # EPERM: the socket is never made
        assert "unix sockets" in enforced["enforced"], enforced
        assert _sandbox.Policy(network=True, unix=False).allowed() == {
            "network": "TCP sockets allowed: this family's processes talk over them"
        }


@needs_landlock
def test_shared_memory_is_the_workers_own(tmp_path: Path) -> None:
    """POSIX semaphores and shared memory (multiprocessing's locks, inductor's compile
    pool) work in the worker, in a /dev/shm of its own that the machine's never sees:
    Landlock alone would refuse them (the machine's /dev/shm is not the scratch folder)."""
    name = f"attnref-test-{os.getpid()}-{time.monotonic_ns()}"
    code = "import multiprocessing\n" + _try("multiprocessing.Lock()") + "out['lock'] = ok\n"
    code += _try(f"open('/dev/shm/{name}', 'w').write('x')") + "out['file'] = ok\n"
    code += "out['own'] = sorted(os.listdir('/dev/shm'))\n"
    out = _inside(code, tmp_path)
    enforced = out["enforced"]
    assert isinstance(enforced, dict)
    if "shared memory" not in enforced["enforced"]:
        pytest.skip(f"no mount namespace here: {enforced['missing']}")
    assert out["lock"] == out["file"] == "done"
    assert out["own"] == [name]  # none of the machine's, and only what it wrote
    assert not Path("/dev/shm", name).exists()


@needs_landlock
def test_a_driver_may_name_the_workers_threads_and_no_other_process(tmp_path: Path) -> None:
    """CUDA's cuInit names the threads it starts by writing ``/proc/self/task/<tid>/comm``
    (glibc's ``pthread_setname_np`` for another thread) and fails with error 304 where it
    cannot: every CUDA audit on an H200 did, in a sandbox that let it write nothing in
    ``/proc`` (and in a PID namespace whose thread ids ``/proc`` did not show). The worker
    may write its own ``/proc/<pid>`` (its threads' names, ``clear_refs`` for the bench's
    memory), no other process's."""
    code = textwrap.dedent(
        """
        import ctypes, threading
        libc = ctypes.CDLL(None)
        started, stop = threading.Event(), threading.Event()
        def wait():
            started.set()
            stop.wait()
        t = threading.Thread(target=wait, daemon=True)
        t.start()
        started.wait()
        out["named"] = libc.pthread_setname_np(ctypes.c_ulong(t.ident), b"cuda-EvtHandlr")
        with open(f"/proc/self/task/{t.native_id}/comm") as f:
            out["name"] = f.read().strip()
        stop.set()
        t.join()
        """
    )
    code += _try("open('/proc/self/clear_refs', 'w').write('5')") + "out['clear_refs'] = ok\n"
    code += _try(f"open('/proc/{os.getpid()}/comm', 'w').write('x')") + "out['judge'] = ok\n"
    code += _try("open('/proc/1/comm', 'w').write('x')") + "out['first'] = ok\n"
    out = _inside(code, tmp_path)
    assert out["named"] == 0
    assert out["name"] == "cuda-EvtHandlr"
    assert out["clear_refs"] == "done"
    # the test's own process: not in the worker's /proc (its PID namespace's), or refused
    assert out["judge"] in (2, 13)  # ENOENT, EACCES
    assert out["first"] == 13  # the namespace's reaper, or the machine's init


@needs_landlock
@pytest.mark.parametrize("hide", [True, False])
def test_a_worker_with_sockets_cannot_reach_a_forkserver_s(hide: bool) -> None:
    """A family whose workers may open sockets (context-parallel) must still not reach
    a forkserver's socket, its judge's or another judge's: a forkserver forks, for
    whoever connects, a process outside any sandbox (and crashes on a connection that
    sends nothing). The judge's temporary folder, where they listen, is covered in the
    worker's mount namespace by an empty one (``hidden``), but for the worker's scratch
    folder inside it, which stays its own and the judge's, and the user's installation
    (``kept``: a virtual environment there), which the worker still imports from.
    Uncovered (the control), the connection is made."""
    root = Path(tempfile.mkdtemp(prefix="j-", dir="/tmp"))  # a socket path is short
    (root / "pymp-x").mkdir()
    scratch = root / "attnref-worker-x"
    scratch.mkdir()
    (root / "venv").mkdir()
    (root / "venv" / "users_module.py").write_text("VALUE = 7\n")
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(str(root / "pymp-x" / "listener"))
        listener.listen(1)
        code = _try(f"socket.socket(socket.AF_UNIX).connect({str(root / 'pymp-x' / 'listener')!r})")
        code += "out['connect'] = ok\n"
        code += _try(f"open({str(scratch / 'made')!r}, 'w').write('x')") + "out['scratch'] = ok\n"
        code += f"sys.path.insert(0, {str(root / 'venv')!r})\n"
        code += "import users_module\nout['import'] = users_module.VALUE\n"
        hidden = (str(root),) if hide else ()
        kept = (str(root / "venv"),)
        policy = f"_sandbox.Policy(network=True, hidden={hidden!r}, kept={kept!r})"
        out = _inside(code, scratch, policy=policy)
        enforced = out["enforced"]
        assert isinstance(enforced, dict)
        if "shared memory" not in enforced["enforced"]:
            pytest.skip(f"no mount namespace here: {enforced['missing']}")
        assert out["connect"] == (2 if hide else "done")  # ENOENT: nothing in the folder
        assert ("forkservers" in enforced["enforced"]) is hide  # the record says so
        assert "forkservers" not in enforced["missing"]
        assert out["scratch"] == "done"
        assert (scratch / "made").read_text() == "x"  # the scratch folder is the judge's
        assert out["import"] == 7  # the user's installation is not hidden
    finally:
        listener.close()
        shutil.rmtree(root, ignore_errors=True)


def test_the_user_s_installation_under_the_temporary_folder_is_kept(tmp_path: Path) -> None:
    """What a covered temporary folder keeps (`executors._kept`): the Python prefix, the
    folders on ``sys.path`` and the working folder, where they lie inside it; where the
    working folder is the temporary folder itself, its entries but for sockets, folders
    holding one and workers' scratch folders."""
    from attnref.conformance import executors

    prefix = os.path.realpath(sys.prefix)
    kept = executors._kept((os.path.dirname(prefix),))
    assert any(os.path.commonpath([k, prefix]) == k for k in kept)
    assert os.path.dirname(prefix) not in kept
    (tmp_path / "code").mkdir()
    (tmp_path / "pymp-1").mkdir()
    (tmp_path / "attnref-worker-1").mkdir()
    (tmp_path / "holds").mkdir()
    if len(str(tmp_path / "holds" / "l")) > 100:
        pytest.skip(f"{tmp_path} is too long a folder for a socket's path")
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(str(tmp_path / "holds" / "l"))
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            kept = executors._kept((str(tmp_path),))
        finally:
            os.chdir(cwd)
    finally:
        listener.close()
    names = {os.path.basename(k) for k in kept if os.path.dirname(k) == str(tmp_path)}
    assert "code" in names
    assert not names & {"pymp-1", "attnref-worker-1", "holds"}


@pytest.mark.slow  # a venv built under a temporary folder: 8 s
@needs_landlock
def test_a_judge_whose_temporary_folder_holds_the_venv_still_imports(tmp_path: Path) -> None:
    """A clone and its virtual environment under ``$TMPDIR`` (CI runners, containers,
    quick tries): a worker that may open sockets (context-parallel's) has the judge's
    temporary folder covered, yet still imports what the judge had not imported (the
    backend's module, torch's lazily loaded ones) from the installation there."""
    folder = os.path.dirname(os.path.realpath(sys.prefix))  # holds the venv, as under TMPDIR
    if len(folder) > 60:
        pytest.skip(f"{folder} is too long a TMPDIR for a forkserver's socket path")
    code = textwrap.dedent(
        """
        import json
        import attnref.conformance.backends  # the families, as the audit installs them
        from attnref.conformance.executors import Supervised
        ex = Supervised("tests.lazy_sdpa:sdpa", network=True)
        print(json.dumps(ex.sandbox["enforced"]))
        ex.close()
        """
    )
    env = {**os.environ, "TMPDIR": folder}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        cwd=ROOT, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    enforced = json.loads(done.stdout.strip().splitlines()[-1])
    if "shared memory" not in enforced:
        pytest.skip("no mount namespace here: nothing is covered")
    assert "forkservers" in enforced  # the folder was covered, and the import still worked


def test_what_a_platform_does_not_enforce_is_listed_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_sandbox, "landlock_abi", lambda: 0)

    def no_seccomp(network: bool, processes: bool = True, unix: bool = True) -> None:
        raise OSError(38, "no seccomp here")

    monkeypatch.setattr(_sandbox, "_seccomp", no_seccomp)
    env, bytecode = dict(os.environ), sys.dont_write_bytecode
    try:
        done = _sandbox.enter(str(tmp_path), contain=False)
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.dont_write_bytecode = bytecode
        tempfile.tempdir = None
    assert set(done.missing) >= {"files", "signals", "network", "processes"}
    assert not done.enforced


def _escape(
    backend: str, tmp_path: Path, jobs: int = 1
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Audit ``tests.hostile.escapes:<backend>`` (forward, float32; and float64 with
    ``jobs`` judges) in a fresh judge with a temporary folder of its own, aimed at
    targets under ``tmp_path``, the working folder, site-packages and attnref's package;
    the process and its targets."""
    # short: the judge's forkserver puts its socket there (108 bytes at most)
    tmp = Path(tempfile.mkdtemp(prefix="ah-", dir="/tmp"))
    report = tmp_path / "report.json"
    import attnref

    targets: dict[str, Any] = {
        "files": [
            str(Path(sysconfig.get_paths()["purelib"]) / "attnref-hostile-test.pth"),
            str(tmp_path / "next-to-the-report.txt"),
            str(ROOT / "hostile-test-wrote-here.txt"),
            str(Path(attnref.__file__).parent / "hostile_test.py"),
        ],
        "report": str(report),
        "marker": f"attnref-hostile-{os.getpid()}-{time.monotonic_ns()}",
    }
    listener = socket.create_server(("127.0.0.1", 0))
    targets["port"] = listener.getsockname()[1]
    env = {**os.environ, "TMPDIR": str(tmp), "ATTNREF_TEST_TARGETS": json.dumps(targets)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = (
        f"export ATTNREF_TEST_JUDGE=$$; exec {sys.executable} -m attnref audit --backend "
        f"tests.hostile.escapes:{backend} --property forward --dtype float32 --no-progress "
        f"--timeout 20 --json {report} --jobs {jobs}" + (" --dtype float64" if jobs > 1 else "")
    )
    try:
        with listener:
            proc = subprocess.run(["sh", "-c", command], env=env, cwd=ROOT, capture_output=True,
                                  text=True, timeout=300, check=False)  # fmt: skip
            listener.settimeout(0.1)
            try:
                listener.accept()
                targets["connected"] = True
            except TimeoutError:
                targets["connected"] = False
        time.sleep(3)  # a grandchild still alive has rewritten the report by now
        targets["left"] = [str(p) for p in tmp.iterdir()]
        targets["alive"] = _alive(str(targets["marker"]))
        targets["wrote"] = [p for p in targets["files"] if Path(p).exists()]
    finally:
        for p in targets["files"]:
            Path(p).unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return proc, targets


def _alive(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _judged_truly(proc: subprocess.CompletedProcess[str], targets: dict[str, Any]) -> None:
    """Exit 1, a true report (failed, not forged), a first line that says what confined
    the worker."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("sandbox: "), proc.stdout
    data = json.loads(Path(str(targets["report"])).read_text())
    assert "forged" not in data
    assert data["summary"]["ok"] is False
    assert data["sandbox"]["enforced"], data["sandbox"]
    # the report lists missing only what the platform cannot enforce, and never the parts
    # these attacks meet (a detached grandchild without a PID namespace stays in the
    # worker's process group: setsid is refused, and the judge kills the group)
    missing = set(data["sandbox"]["missing"])
    assert missing <= _offered() & {"lifetime"}, data["sandbox"]


@needs_landlock
@pytest.mark.parametrize("jobs", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_backend_that_tries_every_way_out_is_judged_and_leaves_nothing(
    tmp_path: Path, jobs: int
) -> None:
    """With ``--jobs 2`` too: the helper judge's worker is confined as the first one is,
    and its attacks aim at the audit's own process (the signal) as well."""
    proc, t = _escape("everything", tmp_path, jobs)
    _judged_truly(proc, t)
    assert json.loads(Path(str(t["report"])).read_text())["judges"] == jobs
    assert t["wrote"] == [], "the backend wrote outside its scratch folder"
    assert t["left"] == [], "the worker's scratch folder outlived the audit"
    assert t["connected"] is False, "the backend connected to a loopback port"
    assert t["alive"] == [], "a grandchild of the backend outlived the audit"


@pytest.mark.slow  # one audit in a fresh judge per pattern: about 8 s each
@needs_landlock
@pytest.mark.parametrize("backend", ["writes_outside", "detaches", "connects", "signals_judge"])
def test_each_way_out_is_closed(backend: str, tmp_path: Path) -> None:
    proc, t = _escape(backend, tmp_path)
    _judged_truly(proc, t)
    assert (t["wrote"], t["left"], t["connected"], t["alive"]) == ([], [], False, [])


@pytest.mark.slow  # two audits in fresh judges
@needs_landlock
def test_the_next_audit_after_a_write_attempt_still_fails_a_wrong_backend(tmp_path: Path) -> None:
    (tmp_path / "first").mkdir()
    proc, t = _escape("writes_outside", tmp_path / "first")
    _judged_truly(proc, t)
    report = tmp_path / "next.json"
    nxt = subprocess.run(
        [sys.executable, "-m", "attnref", "audit", "--backend", "tests.hostile:returns_zeros",
         "--property", "forward", "--dtype", "float32", "--no-progress", "--json", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert nxt.returncode == 1, nxt.stdout + nxt.stderr


def test_require_sandbox_refuses_an_unconfined_worker(capsys: pytest.CaptureFixture[str]) -> None:
    from attnref.cli import main

    code = main(["audit", "--backend", "reference", "--property", "forward", "--dtype",
                 "float32", "--in-process", "--require-sandbox", "--no-progress"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "--require-sandbox: the backend's worker is not wholly confined" in err


@pytest.mark.slow  # audits in fresh processes: 8 s
def test_switched_off_the_sandbox_is_reported_missing_and_refused_when_required(
    tmp_path: Path,
) -> None:
    """``ATTNREF_NO_SANDBOX=1`` (a way around a platform where the sandbox breaks a
    kernel): the audit runs, its first line and report say nothing was enforced, and
    ``--require-sandbox`` refuses it."""
    env = {**os.environ, _sandbox.NO_SANDBOX: "1"}
    report = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "attnref", "audit", "--property", "forward", "--dtype",
           "float32", "--no-progress", "--json", str(report)]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("sandbox: NOT ENFORCED: all (switched off"), done.stdout
    assert "all" in json.loads(report.read_text())["sandbox"]["missing"]
    refused = subprocess.run([*cmd, "--require-sandbox"], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "not wholly confined: all: switched off" in refused.stderr


def test_parts_switched_off_by_name_are_listed_missing_and_the_rest_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ATTNREF_NO_SANDBOX=files,lifetime``: a way around a platform where one part
    breaks a kernel. Those parts are missing (switched off), the others still hold."""
    monkeypatch.setenv(_sandbox.NO_SANDBOX, "files, lifetime")
    code = _try(f"open({str(tmp_path / 'outside')!r}, 'w')") + "out['file'] = ok\n"
    code += _try("socket.socket(socket.AF_UNIX)") + "out['unix'] = ok\n"
    (tmp_path / "scratch").mkdir()
    out = _inside(code, tmp_path / "scratch", policy="_sandbox.Policy.from_environment()")
    assert out["file"] == "done"  # files switched off
    assert out["unix"] == 1  # the network still refused
    enforced = out["enforced"]
    assert isinstance(enforced, dict)
    off = "switched off (ATTNREF_NO_SANDBOX=lifetime,files)"
    assert enforced["missing"] == {"lifetime": off, "files": off}
    assert {"processes", "network", "signals"} <= set(enforced["enforced"])


@pytest.mark.parametrize("value", ["file", "files,bogus", ","])
def test_a_bad_no_sandbox_value_is_named(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_sandbox.NO_SANDBOX, value)
    with pytest.raises(ValueError, match=r"it must be 1 .* or some of lifetime, processes"):
        _sandbox.Policy.from_environment()


@needs_landlock
def test_the_probe_finds_the_part_a_driver_needs_switched_off() -> None:
    """tools/sandbox_probe.py: work that opens a socket (as a driver might) runs once the
    network part is off, and the probe says so; work that needs nothing runs whole."""
    probe = [sys.executable, str(ROOT / "tools" / "sandbox_probe.py"), "--device", "cpu"]
    work = ["--work", "import socket; socket.socket()"]
    needs_socket = subprocess.run([*probe, *work], capture_output=True, text=True,
                                  timeout=120, check=True)  # fmt: skip
    assert needs_socket.stdout.strip() == "network", needs_socket.stderr
    assert "the whole sandbox: FAILS: PermissionError" in needs_socket.stderr
    plain = subprocess.run([*probe, "--work", "x = 1"], capture_output=True, text=True,
                           timeout=120, check=True)  # fmt: skip
    assert plain.stdout.strip() == "", plain.stderr
