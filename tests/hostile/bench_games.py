"""Backends that game the bench from inside their own process (issue 29): each does the
work honestly (torch's SDPA) but for the one thing it games.

- `rewrites_timing`: replaces the worker's ``bench_time`` handler with one that reports
  every call's time divided by ten, and its ``bench_dry`` handler with one that sleeps
  as long as the calls took, so that a harness that takes the dry run from the backend's
  own process would see clocks that agree.
- `wrong_one_in_ten`: returns garbage on every tenth call (never the first), so that a
  bench that verifies a sample of the timed outputs misses it most of the time.
"""

import time
from typing import Any

import torch
from torch import Tensor

from attnref.conformance.worker import HANDLERS
from tests.torch_sdpa import sdpa

_slept = [0.0]


def _install() -> None:
    import attnref.bench.worker  # noqa: F401 (registers the handlers replaced here)

    timed, dry = HANDLERS["bench_time"], HANDLERS["bench_dry"]

    def fast_time(backend: Any, job: dict[str, Any]) -> Any:
        reply = timed(backend, job)
        if isinstance(reply, dict) and reply.get("status") == "ok":
            times = reply["value"]["times"]
            _slept[0] = sum(times) * 0.9
            reply["value"]["times"] = [t / 10 for t in times]
        return reply

    def slow_dry(backend: Any, job: dict[str, Any]) -> Any:
        time.sleep(_slept[0])
        return dry(backend, job)

    HANDLERS["bench_time"] = fast_time
    HANDLERS["bench_dry"] = slow_dry


_installed: list[bool] = []


def rewrites_timing(*args: Any, **kwargs: Any) -> Tensor:
    if not _installed:
        _installed.append(True)
        _install()
    return sdpa(*args, **kwargs)


_calls = [0]


def wrong_one_in_ten(*args: Any, **kwargs: Any) -> Tensor:
    _calls[0] += 1
    out = sdpa(*args, **kwargs)
    if _calls[0] % 10 == 0:
        return torch.full_like(out, 3.0)
    return out
