"""Calling a backend safely: its arguments, its declared limits, a timeout, a verdict on its output.

Nothing a backend does (raise, hang, return a list, the wrong shape, dtype or device)
escapes as an exception other than `Failure` (the backend is wrong) or `Skip` (the
backend declared it does not support the call). Every call of backend code goes through
`invoke`, as a `Job` for an executor (`attnref.conformance.worker`): the forward calls of
`call`, and the gradient property's forward and backward.
"""

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from attnref._checking import checked, checked_internal
from attnref.conformance.cases import Inputs
from attnref.conformance.declarations import DEFAULT_API, Backend, Capabilities
from attnref.conformance.family import family_of, get_family
from attnref.conformance.verdicts import Failure, Skip, one_line, shorten
from attnref.conformance.worker import (
    BackendDied,
    Executor,
    InProcess,
    InternalError,
    Job,
    LateWrite,
    Meanwhile,
    ModifiedInputs,
    Probe,
    Raised,
    Unaccepted,
)

__all__ = [
    "TIMED_OUT",
    "arguments",
    "availability",
    "backend_call",
    "call",
    "call_lse",
    "check_lse",
    "invoke",
    "native_causal",
    "note_failed_call",
    "note_reading",
    "skip_reason",
]

#: how the message of a call that never answered begins
TIMED_OUT = "TimeoutError: "


def native_causal(caps: Capabilities, inputs: Inputs, api: str = DEFAULT_API) -> bool:
    """Whether a backend of API family ``api`` applies the causal diagonal of ``inputs``
    itself, rather than receiving it folded into a boolean mask."""
    return get_family(api).native_causal(caps, inputs)


def backend_call(
    backend: Backend, inputs: Inputs, lse: bool = False, **overrides: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments to call ``backend`` with for ``inputs``, as its API family spells
    them (``overrides`` replace keywords); ``lse``: ask for the log-sum-exp too.

    Raises:
        Skip: the family cannot express the call, or the backend does not declare a
            variant it needs.
    """
    return family_of(backend).call(backend, inputs, lse, **overrides)


def skip_reason(backend: Backend, inputs: Inputs, kwargs: dict[str, Any]) -> str | None:
    """Why ``backend`` declares it does not support this call, or ``None``."""
    caps = backend.capabilities
    dtype = inputs.query.dtype
    if dtype not in caps.dtypes:
        return f"dtype {dtype} not declared"
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.dtype == torch.bool and not caps.bool_mask:
        return "boolean masks not declared"
    if mask is not None and mask.is_floating_point() and not caps.float_mask:
        return "float masks not declared"
    # GQA is fewer key heads than query heads, whatever a family's signature calls it
    # (torch's enable_gqa; the flash families' K of g heads): a flash kernel declaring
    # none was given a fixed GQA case, and failed it
    heads_differ = inputs.key.dim() >= 3 and inputs.key.shape[-3] != inputs.query.shape[-3]
    if (kwargs.get("enable_gqa") or heads_differ) and not caps.gqa:
        return "GQA not declared"
    if inputs.query.shape[-1] == 0 and not caps.zero_head_dim:
        return "head dim 0 not declared"
    Dh, Dv = inputs.query.shape[-1], inputs.value.shape[-1]
    if caps.max_head_dim is not None and max(Dh, Dv) > caps.max_head_dim:
        return f"head dim {max(Dh, Dv)} above the declared {caps.max_head_dim}"
    if Dv != Dh and not caps.distinct_value_dim:
        return "Dv != Dqk not declared"
    if caps.head_dims and not {Dh, Dv} <= set(caps.head_dims):
        dims = ", ".join(map(str, caps.head_dims))
        odd = Dh if Dh not in caps.head_dims else Dv
        return f"head dim {odd}: the declared head dims are {dims}"
    m = caps.head_dim_multiple
    if Dh % m or Dv % m:
        return f"head dims {Dh} and {Dv}: multiples of {m} declared"
    Tq, Tk = inputs.query.shape[-2], inputs.key.shape[-2]
    if caps.single_query and Tq > 1:
        return f"Tq = {Tq}: one query a sequence declared"
    if not caps.empty_sequences and Tk == 0:
        return "no key: sequences with keys only declared"
    mq, mk = caps.length_multiples
    if Tq % mq or Tk % mk:
        return f"Tq = {Tq}, Tk = {Tk}: multiples of {mq} and {mk} declared"
    if caps.self_attention_only and Tq != Tk:
        return f"Tq = {Tq} != Tk = {Tk}: self-attention only declared"
    if caps.queries_at_most_keys and Tq > Tk:
        return f"Tq = {Tq} > Tk = {Tk}: queries at most keys declared"
    if caps.causal_only and not native_causal(caps, inputs, backend.api):
        return "a call that is not causal: causal only declared"
    if not caps.explicit_scale and inputs.scale is not None:
        return f"an explicit scale ({inputs.scale:g}): only the default scale declared"
    if caps.window_required and inputs.window is None:
        return "a call without a sliding window: a window on every call declared"
    if caps.sinks_required and (inputs.sinks is None or inputs.sinks.numel() == 0):
        return "a call without sink logits: sinks on every call declared"
    return _sink_reason(caps, inputs.sinks)


@checked_internal
def _sink_reason(caps: Capabilities, sinks: Float[Tensor, " h"] | None) -> str | None:
    """Why sink logits ``sinks`` are outside the declaration (shared, declared values)."""
    if sinks is None or sinks.numel() == 0:
        return None
    values = sinks.detach().double().cpu()
    if caps.sink_shared and bool((values != values[0]).any()):
        return "a sink logit per head: one sink shared by every head declared"
    if caps.sink_values:
        allowed = torch.tensor(caps.sink_values, dtype=torch.float64)
        outside = [float(v) for v in values if not bool((allowed == v).any())]
        if outside:
            declared = ", ".join(f"{v:g}" for v in caps.sink_values)
            return f"sink logit {outside[0]:g}: the declared sink logits are {declared}"
    return None


def raise_for_error(backend: Backend, error: BaseException, job: object = None) -> None:
    """Turn what the backend raised into `Skip` (a declared refusal) or `Failure`;
    ``job``: the call it raised on, for the declaration that would have kept it out."""
    if isinstance(error, ModifiedInputs | LateWrite | Unaccepted):
        raise Failure(str(error))
    if any(pattern in str(error) for pattern in backend.capabilities.refuses):
        raise Skip(f"refused: {one_line(error)}", refused=True)
    said = one_line(error)
    raise Failure(said + _declaration_hint(backend, job, said))


def _declaration_hint(backend: Backend, job: object, error: str) -> str:
    """What to declare if the call ``job`` is one the backend does not take (its
    family's `ApiFamily.error_hint`, given the error it raised)."""
    if not isinstance(job, Job):
        return ""
    return family_of(backend).error_hint(backend.capabilities, job.kwargs, error)


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
    backend: Backend, inputs: Inputs, lse: bool = False, **overrides: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`backend_call`'s arguments, or `Skip` if the call is outside the declaration."""
    if lse and not backend.capabilities.lse:
        raise Skip("the log-sum-exp not declared")
    args, kwargs = backend_call(backend, inputs, lse, **overrides)
    reason = skip_reason(backend, inputs, kwargs)
    if reason is not None:
        raise Skip(reason)
    return args, kwargs


def invoke(
    backend: Backend,
    job: Job | Probe | Any,
    timeout: float,
    executor: Executor | None = None,
    meanwhile: Meanwhile = None,
) -> Any:
    """What ``job`` returns, run by ``executor`` (default: in this process): the one way
    backend code is called. Whatever the backend does becomes `Skip` or `Failure`.
    ``meanwhile``: the judge's own work, done while the backend computes (`Executor.run`).

    Raises:
        Skip: it refused the call with an error the backend declares as a refusal.
        Failure: it raised anything else, modified its inputs, wrote its output after it
            returned, returned an object the audit does not accept, ended or crashed its
            process, or hung past ``timeout`` seconds (fatal: the search stops); or
            attnref's own code failed in the worker (the message says it is attnref's).
    """
    executor = executor or InProcess(backend)
    try:
        return executor.run(job, timeout, meanwhile)
    except Raised as e:
        raise_for_error(backend, e.error, job)
    except BackendDied as e:
        # the library's own last words ("free(): invalid pointer", an assert's line)
        # say more than the signal: they belong in the finding, not the JSON alone
        last = last_line(getattr(executor, "output_tail", str)())
        said = f"; its last line: {last!r}" if last else ""
        raise Failure(f"{e}{said}", kind="died") from None
    except TimeoutError as e:
        raise Failure(f"{TIMED_OUT}{e}", fatal=True) from None
    except InternalError as e:
        raise Failure(str(e).splitlines()[0], fatal=True) from None


def last_line(output: str) -> str:
    """The last line with something on it of what a backend printed, at most 200
    characters (cut at a word), or ""."""
    lines = [x.strip() for x in output.splitlines() if x.strip()]
    return shorten(lines[-1]) if lines else ""


def digest(job: object) -> str:
    """A digest of the values (not the buffers) of a job's V (its third argument, in
    every family): every output row is a weighted mean of V's rows, so two calls on the
    same V may rightly give one output whatever else differs (one key: the output is V
    whatever Q and K are), and two on different V (random values) may not."""
    h = hashlib.blake2b(digest_size=16)
    stack: list[object] = [tuple(getattr(job, "args", ())[2:3])]
    while stack:
        x = stack.pop()
        if isinstance(x, Tensor):
            t = torch.empty(x.shape, dtype=x.dtype).copy_(x.detach())  # standard strides
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, tuple | list):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x[k] for k in sorted(x, key=str))
        else:
            h.update(repr(x).encode())
    return h.hexdigest()


def availability(
    backend: Backend, device: str, timeout: float, executor: Executor | None = None
) -> str | None:
    """``None`` if ``backend`` can run on ``device``, else why not: asked of its worker,
    its package and a probe call; then its declaration."""
    try:
        answer = invoke(backend, Probe(device), timeout, executor)
    except Skip as e:
        return f"{backend.name} could not be probed on {device}: {e}"
    except Failure:  # it crashed or raised: the audit's cases will say so
        return None
    if answer is not None:
        return str(answer)[:300]
    return backend.available(device)


@checked
def call(
    backend: Backend,
    inputs: Inputs,
    timeout: float,
    executor: Executor | None = None,
    meanwhile: Meanwhile = None,
    **overrides: Any,
) -> Float[Tensor, "*batch h Tq Dv"]:
    """The backend's output for ``inputs``, checked for type, shape, dtype and device.

    Raises:
        Skip: the call is outside what the backend declares, or it refused as declared.
        Failure: it raised, hung past ``timeout`` seconds, crashed, modified its inputs,
            or returned something wrong.
    """
    out, _ = call_lse(
        backend, inputs, timeout, executor, lse=False, meanwhile=meanwhile, **overrides
    )
    return out


@checked
def call_lse(
    backend: Backend,
    inputs: Inputs,
    timeout: float,
    executor: Executor | None = None,
    *,
    lse: bool = True,
    meanwhile: Meanwhile = None,
    **overrides: Any,
) -> tuple[Float[Tensor, "*batch h Tq Dv"], Float[Tensor, "*batch h Tq"] | None]:
    """The backend's output and (with ``lse``) its log-sum-exp, in the audit's layouts
    ``(*batch, h, Tq, Dv)`` and ``(*batch, h, Tq)``, each checked.

    Raises:
        Skip: as `call`, or the log-sum-exp is not declared.
        Failure: as `call`, or the log-sum-exp is missing, of the wrong shape or not
            floating point.
    """
    family = family_of(backend)
    args, kwargs = arguments(backend, inputs, lse, **overrides)
    expected_shape = (*inputs.query.shape[:-1], inputs.value.shape[-1])

    def well_formed(malformed: str | None = None) -> None:
        # where a well-formed answer would lie, and its dtype, for a bug report's
        # repro.py to read the answer of a function swapped in for this one (its fix, a
        # reference), and to tell the backend's own answer malformed (``malformed``:
        # what was wrong with the answer it returned)
        note_failed_call(
            executor,
            lambda: family.to_layout(torch.zeros(expected_shape, dtype=torch.float64), inputs),
            lambda r: [(inputs, family.read(r, inputs, False)[0], None)],
            dtype=inputs.query.dtype,
            malformed=malformed,
        )

    try:
        raw = invoke(backend, Job(args, kwargs), timeout, executor, meanwhile)
    except Failure:
        well_formed()
        raise
    note_reading(executor, raw, lambda r: [(inputs, *family.read(r, inputs, lse))])
    try:
        out, lse_out = family.read(raw, inputs, lse)
        checked_out = check_output(out, expected_shape, inputs).detach()
    except Failure as f:  # not a tensor, a wrong shape, dtype or device
        well_formed(str(f))
        raise
    if not lse:
        return checked_out, None
    return checked_out, check_lse(lse_out, inputs)


#: how a call's result is read into the audit's layouts: (inputs, output, log-sum-exp or
#: None) for each part of the call that the check judges against the oracle of ``inputs``
Reader = Callable[[object], Iterable[tuple[Inputs, object, object | None]]]


def note_reading(
    executor: Executor | None, raw: object, read: Reader, series_call: int | None = None
) -> None:
    """Tell an executor that records its calls (`attnref.conformance.runner.Recording`,
    behind ``check_case``'s ``save``) how the result ``raw`` of its last call is read:
    where each judged output and log-sum-exp lies in what the backend returned. A bug
    report's repro.py reads the backend's answer there, with no attnref to read it.
    ``series_call``: ``raw`` is that call's of the last `Series`, not the last call's."""
    note = getattr(executor, "reading", None)
    if note is not None:
        note(raw, read, False, series_call)


def note_failed_call(
    executor: Executor | None,
    make: Callable[[], object],
    read: Reader,
    dtype: torch.dtype | None = None,
    malformed: str | None = None,
) -> None:
    """`note_reading` for a last call that raised, crashed, changed its inputs or
    returned a malformed result: ``make()`` builds the result a correct call would have
    returned (its layout, not its values), made only where the executor records (nothing
    noted where it cannot be); ``dtype``: the dtype a correct call returns its output in;
    ``malformed``: what was wrong with the result the call returned."""
    note = getattr(executor, "reading", None)
    if note is None:
        return
    try:
        raw = make()
    except Exception:
        return
    note(raw, read, True, dtype=dtype, malformed=malformed)


@checked
def check_lse(lse: object, inputs: Inputs) -> Float[Tensor, "*batch h Tq"]:
    """``lse`` if it is a floating-point tensor of shape ``(*batch, h, Tq)`` on the
    inputs' device, else `Failure`."""
    expected = tuple(inputs.query.shape[:-1])
    if not isinstance(lse, Tensor):
        raise Failure(f"returned a log-sum-exp that is a {type(lse).__name__}, not a tensor")
    if tuple(lse.shape) != expected:
        raise Failure(f"returned a log-sum-exp of shape {tuple(lse.shape)}, expected {expected}")
    if not lse.is_floating_point():
        raise Failure(f"returned a log-sum-exp of dtype {lse.dtype}, not floating point")
    if lse.device != inputs.query.device:
        raise Failure(f"returned a log-sum-exp on {lse.device}, expected {inputs.query.device}")
    return lse.detach()
