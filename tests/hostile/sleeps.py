"""A backend whose every call sleeps for an hour, after printing (``PIDS ...``) the host's
ids of its process and its ancestors up to the forkserver: the test of what outlives a
judge that is killed. It cannot write them to a file: its sandbox forbids it; and its
own ``os.getpid()`` is its id in a PID namespace of its own, so it reads ``/proc``,
which shows the host's ids."""

import os
import time
from pathlib import Path
from typing import Any

from torch import Tensor


def _chain() -> list[int]:
    pid = int(os.readlink("/proc/self"))
    chain = [pid]
    while len(chain) < 4:
        try:
            status = Path(f"/proc/{chain[-1]}/status").read_text()
        except OSError:
            break
        parent = int(next(x for x in status.splitlines() if x.startswith("PPid:")).split()[1])
        if parent <= 1:
            break
        chain.append(parent)
    return chain


def kernel(*args: Any, **kwargs: Any) -> Tensor:
    print("PIDS", *_chain(), flush=True)
    time.sleep(3600)
    raise AssertionError("unreachable")
