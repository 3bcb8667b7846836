"""A backend whose every call sleeps for an hour, after writing its process's id to the
file ``ATTNREF_TEST_PIDS`` names: the test of what outlives a judge that is killed."""

import os
import time
from typing import Any

from torch import Tensor


def kernel(*args: Any, **kwargs: Any) -> Tensor:
    with open(os.environ["ATTNREF_TEST_PIDS"], "a") as f:
        f.write(f"{os.getpid()} {os.getppid()}\n")
    time.sleep(3600)
    raise AssertionError("unreachable")
