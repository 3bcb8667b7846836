"""Bug reports of the planted kernels (issue 57, docs/reports.md): each finding's folder,
its repro.py run once on the kernel (it must exit 1) and once with the family's correct
kernel swapped in (exit 0), all in one subprocess where repro.py cannot import attnref.

The planted kernels of tests/ are built on attnref's reference (a switch in a copy of
it), so their own modules import attnref; repro.py itself must not: an import of attnref
made from repro.py's code raises there, wherever it hides. A kernel module that imports
no attnref (tests/plain_kernels.py, tests/planted_linear.py) is run with attnref wholly
unimportable by the tests of tests/test_reports.py."""

import ast
import atexit
import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnref.conformance.bugreports import write_bug_reports
from attnref.conformance.report import AuditReport

ROOT = Path(__file__).resolve().parents[1]

#: a server of repro.py runs: each line of its input a JSON list of (folder, backend)
#: pairs, each answered by one line, "RUNS " and a JSON list of (folder, backend, exit
#: code, what it printed); an import of attnref from repro.py's own frames refused
DRIVER = r"""
import contextlib, io, json, os, runpy, sys, traceback

class NoAttnrefFromRepro:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "attnref":
            return None
        frame = sys._getframe(1)  # the importer: the first frame outside importlib
        while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
            frame = frame.f_back
        if frame is not None and os.path.basename(frame.f_code.co_filename) == "repro.py":
            raise ImportError("repro.py imported attnref: " + name)
        return None

sys.meta_path.insert(0, NoAttnrefFromRepro())
answer = sys.stdout
for line in sys.stdin:
    runs = []
    for folder, backend in json.loads(line):
        os.chdir(folder)
        sys.argv = ["repro.py"] + (["--backend", backend] if backend else [])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            try:
                runpy.run_path("repro.py", run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code
            except BaseException:
                traceback.print_exc()
                code = "raised"
        runs.append([folder, backend, code, printed.getvalue()[-3000:]])
    answer.write("RUNS " + json.dumps(runs) + "\n")
    answer.flush()
"""


class ReproRunner:
    """One Python process that runs repro.py scripts on demand (`DRIVER`), started once
    per test process: torch and the kernels' modules are imported once, not per test."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
        return subprocess.Popen([sys.executable, "-c", DRIVER], env=env, cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)  # fmt: skip

    def run(self, runs: list[tuple[Path, str]]) -> list[tuple[str, str, object, str]]:
        """Each ``(folder, backend)``'s repro.py run (``backend`` "": its own), its exit
        code and what it printed."""
        if self.process is None or self.process.poll() is not None:
            self.process = self._start()
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        job = json.dumps([[str(folder), backend] for folder, backend in runs])
        self.process.stdin.write(job + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line.startswith("RUNS "):  # it died (a kernel crashed it): start another
            self.process = None
            raise AssertionError(f"the repro.py runner ended: {line!r}")
        return [tuple(run) for run in json.loads(line[5:])]

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            for pipe in (self.process.stdin, self.process.stdout):
                if pipe is not None:
                    pipe.close()
            self.process = None


_RUNNER = ReproRunner()
atexit.register(_RUNNER.close)


def run_repros(runs: list[tuple[Path, str]]) -> list[tuple[str, str, object, str]]:
    """`ReproRunner.run` on this test process's runner."""
    return _RUNNER.run(runs)


def reports_reproduce(
    request: pytest.FixtureRequest, report: AuditReport, reference: str, folder: Path
) -> list[Path]:
    """In the slow tier (a test marked slow; the default tier's are not: each report runs
    its finding again, and its repro.py twice, in a subprocess), `assert_reports_reproduce`."""
    if request.node.get_closest_marker("slow") is None:
        return []
    return assert_reports_reproduce(report, reference, folder)


def assert_reports_reproduce(
    report: AuditReport,
    reference: str,
    folder: Path,
    *,
    timeout: float = 60.0,
    printed: list[str] | None = None,
) -> list[Path]:
    """Write ``report``'s bug reports under ``folder`` (a call given ``timeout`` seconds);
    each repro.py must exit 1 on the audited kernel and 0 with ``reference``
    (``module:function``) swapped in. The folders written (``printed`` gets what each
    script printed on the kernel)."""
    written = write_bug_reports(report, folder, timeout=timeout)
    assert written, report.format_table()
    for where in written:  # and none that a module imported first could hide
        tree = ast.parse((where / "repro.py").read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}  # fmt: skip
        imported |= {node.module or "" for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom)}  # fmt: skip
        assert not {m for m in imported if m.split(".")[0] == "attnref"}, where
    runs = [(where, "") for where in written] + [(where, reference) for where in written]
    ran = run_repros(runs)
    wrong = [
        f"{Path(where).name} {backend or 'its own kernel'}: exit {code}\n{said}"
        for where, backend, code, said in ran
        if code != (0 if backend else 1)
    ]
    assert not wrong, "\n".join(wrong)
    if printed is not None:
        printed += [str(said) for _, backend, _, said in ran if not backend]
    return written
