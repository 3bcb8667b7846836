"""A backend whose first call in a worker is torch's SDPA and whose every later call
sleeps 30 s first: the test that a property's budget holds within a case (a call still
running when the budget passes is stopped, not waited for)."""

import time
from typing import Any

from torch import Tensor

from tests.torch_sdpa import sdpa

_calls = [0]


def after_the_first(*args: Any, **kwargs: Any) -> Tensor:
    _calls[0] += 1
    if _calls[0] > 1:
        time.sleep(30)
    return sdpa(*args, **kwargs)
