"""Backends that write on their worker's own pipe to the judge: the connection is in
their process (found among its objects), so they can send a frame of their own where
the reply should be. The judge reads every frame with a deadline and a size limit."""

import gc
import multiprocessing.connection
import os
import struct
import time
from typing import Any

from torch import Tensor


def _pipe() -> int:
    """The worker's end of its pipe to the judge."""
    conns = [o for o in gc.get_objects() if isinstance(o, multiprocessing.connection.Connection)]
    return conns[0].fileno()


def stalls_mid_frame(*args: Any, **kwargs: Any) -> Tensor:
    """Announces a reply of 4096 bytes, sends 10, and never sends the rest."""
    os.write(_pipe(), struct.pack("!i", 4096) + b"0123456789")
    time.sleep(3600)
    raise AssertionError("unreachable")


def announces_huge_frame(*args: Any, **kwargs: Any) -> Tensor:
    """Announces a reply of 2**40 bytes (a 1 TiB allocation, were it trusted)."""
    os.write(_pipe(), struct.pack("!i", -1) + struct.pack("!Q", 2**40))
    time.sleep(3600)
    raise AssertionError("unreachable")
