"""How a test finds, from outside, the processes a sandboxed backend runs in.

In its PID namespace, with a ``/proc`` of its own, a worker knows only its namespace's
process ids, which mean nothing outside. So it names the thread it runs in (``prctl``'s
``PR_SET_NAME``, 15 bytes at most) and says the name; the test looks for that name in
the machine's ``/proc`` (`pids_named`) and walks up from there (`ancestors`).
"""

import contextlib
import ctypes
import secrets
from pathlib import Path

_PR_SET_NAME = 15


def mark(name: str) -> str:
    """Name the calling thread ``name`` (cut to 15 bytes); the name as set."""
    name = name[:15]
    ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode(), 0, 0, 0)
    return name


def pids_named(name: str) -> set[int]:
    """The machine's ids of the processes one of whose threads is called ``name``."""
    found = set()
    for task in Path("/proc").glob("[0-9]*/task/[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if task.read_text().strip() == name:
                found.add(int(task.parts[2]))
    return found


def ancestors(pid: int, stop: int, most: int = 4) -> list[int]:
    """``pid`` and its parents, up to ``most`` of them, ending before ``stop`` or init."""
    chain = [pid]
    while len(chain) < most:
        try:
            status = Path(f"/proc/{chain[-1]}/status").read_text()
        except OSError:
            break
        parent = int(next(x for x in status.splitlines() if x.startswith("PPid:")).split()[1])
        if parent <= 1 or parent == stop:
            break
        chain.append(parent)
    return chain


def unique(prefix: str) -> str:
    """A name no other process has: ``prefix`` (6 bytes at most) and 8 random hex digits
    (a process id inside a PID namespace repeats across workers)."""
    return f"{prefix[:6]}{secrets.token_hex(4)}"
