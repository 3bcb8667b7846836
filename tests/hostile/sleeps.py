"""A backend whose every call sleeps for an hour, after naming its thread and printing
the name (``MARK ...``): the test of what outlives a judge that is killed finds the
worker by that name in the machine's ``/proc`` (`tests.hostile.marks`). It cannot write
its ids to a file (its sandbox forbids it), and the ids it could print are its PID
namespace's."""

import time
from typing import Any

from torch import Tensor

from tests.hostile.marks import mark, unique


def kernel(*args: Any, **kwargs: Any) -> Tensor:
    print("MARK", mark(unique("sleeps")), flush=True)
    time.sleep(3600)
    raise AssertionError("unreachable")
