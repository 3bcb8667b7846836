"""The workers' clean parent: a forkserver that has imported torch and attnref.

Torch-free on purpose: ``attnref audit`` starts it first thing (`start`), so that it
imports torch while the judge's own process does, on another core, instead of after.
`attnref.conformance.worker` forks every worker from it (a clean process, never a fork
of the judge).
"""

import multiprocessing
from typing import Any

__all__ = ["context", "start"]

#: what the forkserver imports before it forks a worker: first what makes it end with
#: the judge (on Linux), then what the workers need
PRELOAD = ["attnref._forkserver_init", "attnref.conformance.backends"]


def context() -> Any:
    """The forkserver context (its preload set), or spawn where there is none."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def start() -> None:
    """Start the forkserver now, in the background of whatever this process does next
    (it returns at once; the forkserver imports on its own)."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        from multiprocessing import forkserver

        context()
        forkserver.ensure_running()
