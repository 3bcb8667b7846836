"""Run a backend over audit cases; never let the backend crash or hang the audit."""

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from attnref.conformance.backends import Backend
from attnref.conformance.cases import Case, Inputs, build, fixed_grid
from attnref.conformance.oracle import compare, error_floor, reference
from attnref.conformance.report import AuditReport, CaseResult
from attnref.masks import causal_mask

__all__ = ["DEFAULT_DTYPES", "audit", "backend_call", "best_device"]

DEFAULT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def best_device() -> str:
    """``"cuda"`` when a GPU is present, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_call(backend: Backend, inputs: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments to call ``backend`` with for ``inputs``.

    A causal alignment the backend does not compute itself (or causal combined with a
    mask, where it cannot take both) reaches it as an explicit boolean mask, so that every
    case runs on every backend.
    """
    caps = backend.capabilities
    mask = inputs.attn_mask
    kwargs: dict[str, Any] = {"dropout_p": 0.0, "is_causal": False, "scale": inputs.scale}
    if inputs.enable_gqa:
        kwargs["enable_gqa"] = True
    if inputs.causal is not None:
        native = inputs.causal in caps.causal_alignments and (mask is None or caps.causal_with_mask)
        if native:
            kwargs["is_causal"] = True
            if inputs.causal != "top_left":
                kwargs["causal_alignment"] = inputs.causal
        else:
            Tq, Tk = inputs.query.shape[-2], inputs.key.shape[-2]
            visible = causal_mask(Tq, Tk, inputs.causal, device=inputs.query.device)
            if mask is None:
                mask = visible
            elif mask.dtype == torch.bool:
                mask = mask & visible
            else:
                mask = mask.masked_fill(~visible, float("-inf"))
    kwargs["attn_mask"] = mask
    return (inputs.query, inputs.key, inputs.value), kwargs


def skip_reason(backend: Backend, case: Case, inputs: Inputs, dtype: torch.dtype) -> str | None:
    """Why ``backend`` declares it does not support this case, or ``None``."""
    caps = backend.capabilities
    if dtype not in caps.dtypes:
        return f"dtype {dtype} not declared"
    _, kwargs = backend_call(backend, inputs)
    mask = kwargs["attn_mask"]
    if mask is not None and mask.dtype == torch.bool and not caps.bool_mask:
        return "boolean masks not declared"
    if mask is not None and mask.is_floating_point() and not caps.float_mask:
        return "float masks not declared"
    if inputs.enable_gqa and not caps.gqa:
        return "GQA not declared"
    if case.nan_in_masked and caps.masked_nan != "contained":
        return "declares that NaN in masked K/V may propagate"
    return None


def _call_with_timeout(fn: Callable[[], Any], timeout: float) -> tuple[Any, BaseException | None]:
    """Run ``fn`` in a daemon thread; a call still running after ``timeout`` is abandoned."""
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # the backend's failure is data for the report
            error.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return None, TimeoutError(f"no answer within {timeout:g} s")
    return (result[0] if result else None), (error[0] if error else None)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def run_case(
    backend: Backend, case: Case, dtype: torch.dtype, device: str, timeout: float
) -> CaseResult:
    """Audit ``backend`` on one case in one dtype."""
    inputs = build(case, dtype, device)
    reason = skip_reason(backend, case, inputs, dtype)
    if reason is not None:
        return CaseResult(case, dtype, "skip", message=reason)
    oracle = reference(inputs.to(torch.float64))
    same_dtype = reference(inputs)
    args, kwargs = backend_call(backend, inputs)
    start = time.perf_counter()
    out, error = _call_with_timeout(lambda: backend(*args, **kwargs), timeout)
    seconds = time.perf_counter() - start
    if error is not None:
        return CaseResult(case, dtype, "fail", message=_one_line(error), seconds=seconds)
    c = compare(out, oracle, same_dtype, dtype, error_floor(inputs))
    return CaseResult(
        case,
        dtype,
        "pass" if c.ok else "fail",
        max_err=c.max_err,
        mean_err=c.mean_err,
        max_bound=c.max_bound,
        mean_bound=c.mean_bound,
        message=c.message,
        seconds=seconds,
    )


def audit(
    backend: Backend,
    *,
    device: str | None = None,
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    cases: Sequence[Case] | None = None,
    timeout: float = 60.0,
    progress: bool = True,
) -> AuditReport:
    """Audit ``backend`` against the float64 oracle over ``cases`` (default: the fixed grid).

    Every case runs in every dtype; unsupported ones are skipped and counted; an exception,
    a hang past ``timeout`` seconds, a wrong shape or dtype, NaN where the oracle is finite,
    or an error beyond the bound is a failure. The audit itself never raises because of
    the backend.
    """
    device = device or best_device()
    grid = list(fixed_grid() if cases is None else cases)
    report = AuditReport.start(backend.name, device, [str(d) for d in dtypes])
    unavailable = backend.available(device)
    work = [(c, d) for d in dtypes for c in grid]
    for case, dtype in tqdm(work, desc=f"audit {backend.name}", disable=not progress, leave=False):
        if unavailable is not None:
            report.results.append(CaseResult(case, dtype, "skip", message=unavailable))
            continue
        report.results.append(run_case(backend, case, dtype, device, timeout))
    report.finish()
    return report
