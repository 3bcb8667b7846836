"""Returns zeros and, from a thread, keeps overwriting the audit's JSON report with a
forged passing one (the path read from the judge's command line, found through /proc;
where the worker's /proc is its PID namespace's, and shows no judge, the path the test
tells it in ``ATTNREF_TEST_REPORT``, as an attacker who guessed it).
The sandbox refuses the write; before it, the judge's final write came after the worker
was stopped."""

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from torch import Tensor

FORGED = {"summary": {"passed": 1, "failed": 0, "ok": True}, "forged": True}


def _report_path() -> Path | None:
    if os.environ.get("ATTNREF_TEST_REPORT"):
        return Path(os.environ["ATTNREF_TEST_REPORT"])
    pid = int(os.readlink("/proc/self"))
    for _ in range(4):  # the worker, the forkserver, the judge
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return None
        if b"--json" in argv:
            return Path(argv[argv.index(b"--json") + 1].decode())
        pid = int(next(x for x in status.splitlines() if x.startswith("PPid:")).split()[1])
    return None


def _forge() -> None:
    path = _report_path()
    while path is not None:
        with contextlib.suppress(OSError):
            path.write_text(json.dumps(FORGED))
        time.sleep(0.005)


threading.Thread(target=_forge, name="report-forger", daemon=True).start()


def kernel(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    return q.new_zeros((*q.shape[:-1], v.shape[-1]))
