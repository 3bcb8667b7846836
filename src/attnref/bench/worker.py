"""The bench's jobs, run in the backend's worker (`attnref.conformance.worker`).

Three jobs per case, each one round trip, so that the judge's wall clock measures each:

- ``bench_prepare``: build the case's inputs and the backend's arguments (kept in the
  worker), run the warm-up calls, measure one call's peak memory; returns the first
  call's output, to be checked against the oracle.
- ``bench_time``: ``runs`` timed calls. Before each, the inputs are rewritten in place
  with the values of a new seed (outside the clock), so that a replayed output is wrong,
  not fast. Each call is timed from a device-wide synchronize to a device-wide
  synchronize (work on a side stream is counted); each output is snapshotted outside the
  clock and sent back, so the judge may check any of them.
- ``bench_dry``: the same loop without the call: what the rewriting, snapshotting and
  sending cost, for the judge to cross-check the worker's clock against its own.
"""

import time
from dataclasses import dataclass
from typing import Any

import torch

from attnref.bench.cases import BenchCase, bench_inputs
from attnref.bench.timing import peak_bytes
from attnref.conformance.backends import Backend
from attnref.conformance.calls import backend_call
from attnref.conformance.worker import HANDLERS, error_reply, rewrite, snapshot

__all__ = ["BenchJob"]


@dataclass
class BenchJob:
    """One of the bench's jobs: ``kind`` ``prepare``, ``time`` or ``dry``."""

    kind: str
    case: dict[str, Any]
    seed: int
    runs: int = 0
    warmup: int = 0
    memory: bool = False

    def message(self) -> dict[str, Any]:
        return {
            "job": f"bench_{self.kind}",
            "case": self.case,
            "seed": self.seed,
            "runs": self.runs,
            "warmup": self.warmup,
            "memory": self.memory,
        }


#: the prepared case of this worker: its arguments and last output
_STATE: dict[str, Any] = {}


class _BackendRaised(Exception):  # noqa: N818 (a wrapper)
    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _call(backend: Backend, args: Any, kwargs: Any) -> Any:
    try:
        return backend(*args, **kwargs)
    except BaseException as e:  # the backend's, not attnref's
        raise _BackendRaised(e) from None


def _blaming_the_backend(handler: Any) -> Any:
    def run(backend: Backend, job: dict[str, Any]) -> Any:
        try:
            return handler(backend, job)
        except _BackendRaised as e:
            return error_reply("raised", e.error)

    return run


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()  # every stream of the device, not the current one only


def _arguments(backend: Backend, case: dict[str, Any], seed: int) -> tuple[Any, Any]:
    """The call's arguments for seed ``seed``: a dense case's in the backend's family, or
    a serving case's (it names its ``api``)."""
    if "api" in case:
        from attnref.bench.serving import ServingCase, serving_call

        return serving_call(ServingCase(**case), seed)
    return backend_call(backend, bench_inputs(BenchCase(**case), seed))


def _prepare(backend: Backend, job: dict[str, Any]) -> Any:
    case = dict(job["case"])
    device = str(case["device"])
    args, kwargs = _arguments(backend, case, int(job["seed"]))
    _STATE.clear()
    _STATE.update(case=case, args=args, kwargs=kwargs)
    with torch.inference_mode():
        first = snapshot(_call(backend, args, kwargs))
        for i in range(int(job["warmup"])):
            rewrite((args, kwargs), _arguments(backend, case, int(job["seed"]) + 1 + i))
            _call(backend, args, kwargs)
        memory = job["memory"]
        peak = peak_bytes(lambda: _call(backend, args, kwargs), device) if memory else None
    _sync(device)
    _STATE["last"] = first
    return {"status": "ok", "value": {"output": first, "peak": peak}}


def _loop(backend: Backend, job: dict[str, Any], call: bool) -> Any:
    start = time.perf_counter()
    case: dict[str, Any] = _STATE["case"]
    device = str(case["device"])
    args, kwargs = _STATE["args"], _STATE["kwargs"]
    times: list[float] = []
    outputs: list[Any] = []
    with torch.inference_mode():
        for i in range(int(job["runs"])):
            rewrite((args, kwargs), _arguments(backend, case, int(job["seed"]) + i))
            _sync(device)
            t0 = time.perf_counter()
            out = _call(backend, args, kwargs) if call else _STATE["last"]
            _sync(device)
            times.append(time.perf_counter() - t0)
            outputs.append(snapshot(out))
    if call and outputs:
        _STATE["last"] = outputs[-1]
    return {
        "status": "ok",
        "value": {"times": times, "outputs": outputs, "loop": time.perf_counter() - start},
    }


HANDLERS["bench_prepare"] = _blaming_the_backend(_prepare)
HANDLERS["bench_time"] = _blaming_the_backend(lambda backend, job: _loop(backend, job, True))
HANDLERS["bench_dry"] = _blaming_the_backend(lambda backend, job: _loop(backend, job, False))
