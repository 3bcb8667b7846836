"""At import, slows ``time.perf_counter`` (and ``time.monotonic``) tenfold in its own
process: a harness that times with the backend's clocks reports it ten times faster.
Its kernel is correct."""

import time
from typing import Any

from torch import Tensor

from tests.torch_sdpa import sdpa

_real_perf, _real_mono = time.perf_counter, time.monotonic
_start_perf, _start_mono = _real_perf(), _real_mono()
time.perf_counter = lambda: _start_perf + (_real_perf() - _start_perf) / 10
time.monotonic = lambda: _start_mono + (_real_mono() - _start_mono) / 10


def kernel(*args: Any, **kwargs: Any) -> Tensor:
    return sdpa(*args, **kwargs)
