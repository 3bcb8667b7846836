"""Backends that reach past their worker (issue 29, docs/untrusted.md): each returns zeros
(a wrong answer the audit must fail) and, on its first call, tries one way out of the
sandbox. Where to aim comes from ``ATTNREF_TEST_TARGETS`` (JSON), which the test sets:

- ``files``: paths to write (site-packages, next to the report, the working folder,
  attnref's own package); what each writes is a harmless comment line;
- ``report``: the ``--json`` report, which a detached grandchild rewrites as passing
  once the audit has ended (``marker``: a word in its command line, to find it by);
- ``port``: a loopback port to connect to;
- ``judge``: the judge's process id, to send SIGTERM (or ``ATTNREF_TEST_JUDGE``).

`everything` tries them all at once.
"""

import contextlib
import json
import os
import signal
import socket
import tempfile
from collections.abc import Callable
from typing import Any

from torch import Tensor

FORGED = json.dumps({"summary": {"ok": True, "passed": 1, "failed": 0}, "forged": True})


def _targets() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(os.environ.get("ATTNREF_TEST_TARGETS", "{}"))
    return loaded


def _write_files() -> None:
    for path in _targets().get("files", []):
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write("# written by tests.hostile.escapes\n")
    mine = os.path.join(tempfile.gettempdir(), "mine.txt")  # its scratch: allowed, removed
    with contextlib.suppress(OSError), open(mine, "w") as f:
        f.write("scratch\n")


def _detach() -> None:
    t = _targets()
    if "report" not in t:
        return
    script = f"sleep 2; printf '%s' '{FORGED}' > '{t['report']}'"
    if os.fork() == 0:  # a child that starts a grandchild in a session of its own
        with contextlib.suppress(OSError):
            os.setsid()
        if os.fork() == 0:
            with contextlib.suppress(OSError):
                os.setsid()
            os.execv("/bin/sh", ["/bin/sh", "-c", script, t.get("marker", "x")])
        os._exit(0)


def _connect() -> None:
    port = _targets().get("port")
    if port is None:
        return
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 2) as s:
        s.sendall(b"escaped")


def _signal() -> None:
    judge = _targets().get("judge") or os.environ.get("ATTNREF_TEST_JUDGE")
    if judge is not None:
        with contextlib.suppress(OSError):
            os.kill(int(judge), signal.SIGTERM)


def _kernel(*attacks: Callable[[], None]) -> Callable[..., Tensor]:
    """A kernel that returns zeros, after trying ``attacks`` on its first call."""
    tried: list[bool] = []

    def kernel(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not tried:
            tried.append(True)
            for attack in attacks:
                attack()
        return q.new_zeros((*q.shape[:-1], v.shape[-1]))

    return kernel


writes_outside = _kernel(_write_files)
detaches = _kernel(_detach)
connects = _kernel(_connect)
signals_judge = _kernel(_signal)
everything = _kernel(_write_files, _connect, _signal, _detach)
