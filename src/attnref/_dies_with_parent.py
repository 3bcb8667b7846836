"""Processes that end with their parent: the workers' forkserver, with the judge that
started it (`attnref._forkserver_init`), and each worker, with the forkserver
(`attnref.conformance.worker`). However the judge ends (an exception, SIGTERM, SIGKILL),
no forkserver or worker of its outlives it.
"""

import ctypes
import os
import signal
import sys

#: prctl(2)'s option: the signal this process gets when its parent ends
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have this process killed when its parent ends (Linux; elsewhere nothing); if the
    parent ended before the request took, end now."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        os._exit(1)
