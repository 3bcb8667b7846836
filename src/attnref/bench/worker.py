"""The bench's jobs, run in the backend's worker (`attnref.conformance.worker`).

Its jobs, each one round trip, so that the judge's wall clock measures each:

- ``bench_prepare``: build the case's inputs and the backend's arguments (kept in the
  worker), run the warm-up calls, measure one call's peak memory; returns the first
  call's output, to be checked against the oracle.
- ``bench_time``: ``runs`` timed calls. Before each, the inputs are rewritten in place
  with the values of a new seed (outside the clock), so that a replayed output is wrong,
  not fast. Each call is timed from a device-wide synchronize to a device-wide
  synchronize (work on a side stream is counted); each output is snapshotted outside the
  clock and sent back, so the judge may check any of them.
- ``bench_dry_prepare`` and ``bench_dry``: the same loop without the call, run in a
  clean worker that runs no code of the backend's (`attnref.bench.verified.CleanLoop`):
  what the rewriting, snapshotting and sending cost, which the judge takes from its
  batch time to find what the calls took on its own clock. The first job carries the
  backend's declaration (to build the same arguments) and its first output (to
  snapshot the same objects), and runs the loop once, untimed, as the backend's warm-up
  calls run; the second, the loop, is as small a message as ``bench_time``.
"""

import time
from dataclasses import dataclass
from typing import Any

import torch

from attnref.bench.cases import BenchCase, bench_inputs
from attnref.bench.timing import peak_bytes
from attnref.conformance.backends import Backend, from_declaration
from attnref.conformance.calls import backend_call
from attnref.conformance.family import family_of
from attnref.conformance.worker import HANDLERS, error_reply, invoke_backend, rewrite, snapshot

__all__ = ["BenchJob"]


@dataclass
class BenchJob:
    """One of the bench's jobs: ``kind`` ``prepare``, ``time``, ``dry_prepare`` or
    ``dry`` (the module docstring)."""

    kind: str
    case: dict[str, Any]
    seed: int
    runs: int = 0
    warmup: int = 0
    memory: bool = False
    #: a dry job's: the backend's declaration and its first output
    declared: dict[str, Any] | None = None
    output: Any = None

    def message(self) -> dict[str, Any]:
        return {
            "job": f"bench_{self.kind}",
            "case": self.case,
            "seed": self.seed,
            "runs": self.runs,
            "warmup": self.warmup,
            "memory": self.memory,
            "declared": self.declared,
            "output": self.output,
        }


#: the prepared case of this worker: its arguments
_STATE: dict[str, Any] = {}


class _BackendRaised(Exception):  # noqa: N818 (a wrapper)
    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _call(backend: Backend, args: Any, kwargs: Any) -> Any:
    try:
        return invoke_backend(backend, args, kwargs)  # as its family calls it (a group)
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
    a serving case's (it names its ``api``). A case with a ``"_share"`` (one process's
    share of a call spread over several, `ApiFamily.share`) gives that share's."""
    case = dict(case)
    share = case.pop("_share", None)
    if "api" in case:  # the family's workload for the shape
        from attnref.bench.cases import serving_call
        from attnref.conformance.workloads import ServingCase

        return serving_call(ServingCase(**case), seed)
    args, kwargs = backend_call(backend, bench_inputs(BenchCase(**case), seed))
    if share is not None:
        cut = family_of(backend).share
        if cut is None:
            raise ValueError(f"the {backend.api!r} family spreads no call over processes")
        args, kwargs = cut(args, kwargs, share)
    return args, kwargs


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
    return {"status": "ok", "value": {"output": first, "peak": peak}}


def _loop(
    backend: Backend, case: dict[str, Any], seed: int, runs: int, args: Any, kwargs: Any,
    output: Any = None,
) -> Any:  # fmt: skip
    """``runs`` rounds of: rewrite the arguments with a new seed's values, synchronize,
    call the backend (or, given an ``output``, do nothing: a dry run), synchronize,
    snapshot the output. The per-call times are this process's word: the judge scales
    them to its own clock (`attnref.bench.verified.measure`)."""
    device = str(case["device"])
    times: list[float] = []
    outputs: list[Any] = []
    with torch.inference_mode():
        for i in range(runs):
            rewrite((args, kwargs), _arguments(backend, case, seed + i))
            _sync(device)
            t0 = time.perf_counter()
            out = _call(backend, args, kwargs) if output is None else output
            _sync(device)
            times.append(time.perf_counter() - t0)
            outputs.append(snapshot(out))
    return {"status": "ok", "value": {"times": times, "outputs": outputs}}


def _time(backend: Backend, job: dict[str, Any]) -> Any:
    return _loop(backend, _STATE["case"], int(job["seed"]), int(job["runs"]), _STATE["args"],
                 _STATE["kwargs"])  # fmt: skip


def _dry_prepare(backend: Backend, job: dict[str, Any]) -> Any:
    """In a clean worker: the arguments the backend's declaration makes, and its first
    output (snapshotted each round of a dry loop); one untimed round, to warm up."""
    case = dict(job["case"])
    declared = from_declaration(job["declared"])
    args, kwargs = _arguments(declared, case, int(job["seed"]))
    output = job["output"]
    if output is None:
        raise ValueError("a dry run needs the backend's first output")
    _STATE.clear()
    _STATE.update(case=case, args=args, kwargs=kwargs, declared=declared, output=output)
    _loop(declared, case, int(job["seed"]), 1, args, kwargs, output)
    return {"status": "ok", "value": None}


def _dry(backend: Backend, job: dict[str, Any]) -> Any:
    """The timed loop without the backend, as `_dry_prepare` set it up; its outputs are
    sent back as the timed batch's are, for the judge's clock counts that too."""
    return _loop(_STATE["declared"], _STATE["case"], int(job["seed"]), int(job["runs"]),
                 _STATE["args"], _STATE["kwargs"], _STATE["output"])  # fmt: skip


HANDLERS["bench_prepare"] = _blaming_the_backend(_prepare)
HANDLERS["bench_time"] = _blaming_the_backend(_time)
HANDLERS["bench_dry_prepare"] = _dry_prepare
HANDLERS["bench_dry"] = _dry
