"""Calling a backend safely: its arguments, its declared limits, a timeout, a verdict on its output.

Nothing a backend does (raise, hang, return a list, the wrong shape, dtype or device)
escapes as an exception other than `Failure` (the backend is wrong) or `Skip` (the
backend declared it does not support the call). Every call of backend code goes through
`invoke`, as a `Job` for an executor (`attnref.conformance.worker`): the forward calls of
`call`, and the gradient property's forward and backward.
"""

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from attnref._checking import checked
from attnref.conformance.backends import Backend, Capabilities
from attnref.conformance.cases import Inputs
from attnref.conformance.verdicts import Failure, Skip, one_line
from attnref.conformance.worker import BackendDied, Executor, InProcess, Job, ModifiedInputs, Raised
from attnref.masks import causal_mask

__all__ = [
    "TIMED_OUT",
    "arguments",
    "backend_call",
    "call",
    "invoke",
    "native_causal",
    "skip_reason",
]

#: how the message of a call that never answered begins
TIMED_OUT = "TimeoutError: "


def native_causal(caps: Capabilities, inputs: Inputs) -> bool:
    """Whether the backend applies the causal diagonal of ``inputs`` itself (``is_causal``),
    rather than receiving it folded into a boolean mask."""
    return inputs.causal is not None and (
        inputs.causal in caps.causal_alignments
        and (inputs.attn_mask is None or caps.causal_with_mask)
    )


def backend_call(
    backend: Backend, inputs: Inputs, **overrides: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments to call ``backend`` with for ``inputs`` (``overrides`` replace keywords).

    A causal alignment the backend does not compute itself (or causal combined with a
    mask, where it cannot take both) reaches it as an explicit boolean mask, so that every
    case runs on every backend.
    """
    mask = inputs.attn_mask
    kwargs: dict[str, Any] = {"dropout_p": 0.0, "is_causal": False, "scale": inputs.scale}
    if inputs.enable_gqa:
        kwargs["enable_gqa"] = True
    if inputs.causal is not None:
        if native_causal(backend.capabilities, inputs):
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
    kwargs.update(overrides)
    return (inputs.query, inputs.key, inputs.value), kwargs


def skip_reason(backend: Backend, inputs: Inputs, kwargs: dict[str, Any]) -> str | None:
    """Why ``backend`` declares it does not support this call, or ``None``."""
    caps = backend.capabilities
    dtype = inputs.query.dtype
    if dtype not in caps.dtypes:
        return f"dtype {dtype} not declared"
    mask = kwargs["attn_mask"]
    if mask is not None and mask.dtype == torch.bool and not caps.bool_mask:
        return "boolean masks not declared"
    if mask is not None and mask.is_floating_point() and not caps.float_mask:
        return "float masks not declared"
    if kwargs.get("enable_gqa") and not caps.gqa:
        return "GQA not declared"
    if inputs.query.shape[-1] == 0 and not caps.zero_head_dim:
        return "head dim 0 not declared"
    return None


def raise_for_error(backend: Backend, error: BaseException) -> None:
    """Turn what the backend raised into `Skip` (a declared refusal) or `Failure`."""
    if isinstance(error, ModifiedInputs):
        raise Failure(str(error))
    if any(pattern in str(error) for pattern in backend.capabilities.refuses):
        raise Skip(f"refused: {one_line(error)}", refused=True)
    raise Failure(one_line(error))


@checked
def check_output(
    out: object, expected_shape: tuple[int, ...], inputs: Inputs
) -> Float[Tensor, "*shape"]:
    """``out`` if it is a tensor of the expected shape, dtype and device, else `Failure`."""
    if not isinstance(out, Tensor):
        raise Failure(f"returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != expected_shape:
        raise Failure(f"returned shape {tuple(out.shape)}, expected {expected_shape}")
    if out.dtype != inputs.query.dtype:
        raise Failure(f"returned dtype {out.dtype}, expected {inputs.query.dtype}")
    if out.device != inputs.query.device:
        raise Failure(f"returned a tensor on {out.device}, expected {inputs.query.device}")
    return out


def arguments(
    backend: Backend, inputs: Inputs, **overrides: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`backend_call`'s arguments, or `Skip` if the call is outside the declaration."""
    args, kwargs = backend_call(backend, inputs, **overrides)
    reason = skip_reason(backend, inputs, kwargs)
    if reason is not None:
        raise Skip(reason)
    return args, kwargs


def invoke(backend: Backend, job: Job, timeout: float, executor: Executor | None = None) -> Any:
    """What ``job`` (backend code) returns, run by ``executor`` (default: in this process);
    whatever the backend does becomes `Skip` or `Failure`.

    Raises:
        Skip: it refused the call with an error the backend declares as a refusal.
        Failure: it raised anything else, modified its inputs, ended or crashed its
            process, or hung past ``timeout`` seconds (fatal: the search stops).
    """
    executor = executor or InProcess(backend)
    try:
        return executor.run(job, timeout)
    except Raised as e:
        raise_for_error(backend, e.error)
    except BackendDied as e:
        raise Failure(str(e)) from None
    except TimeoutError as e:
        raise Failure(f"{TIMED_OUT}{e}", fatal=True) from None


@checked
def call(
    backend: Backend,
    inputs: Inputs,
    timeout: float,
    executor: Executor | None = None,
    **overrides: Any,
) -> Float[Tensor, "*batch h Tq Dv"]:
    """The backend's output for ``inputs``, checked for type, shape, dtype and device.

    Raises:
        Skip: the call is outside what the backend declares, or it refused as declared.
        Failure: it raised, hung past ``timeout`` seconds, crashed, modified its inputs,
            or returned something wrong.
    """
    args, kwargs = arguments(backend, inputs, **overrides)
    out = invoke(backend, Job(args, kwargs), timeout, executor)
    expected_shape = (*inputs.query.shape[:-1], inputs.value.shape[-1])
    return check_output(out, expected_shape, inputs).detach()
