"""Checks aimed at backends that attack the judge rather than compute attention (class 31).

- `fresh_values`: outputs follow values, not addresses. One series of calls in one
  worker: the same buffers with new values written in place, the same values in new
  buffers, calls interleaved and repeated. A cache keyed on ``data_ptr()``, on the shape
  or on the call count replays an earlier output, and the message says so.
- `settled_output`: the output is judged as it stood when the call returned (the worker
  snapshots it then), and read again a moment later; a backend still writing it
  afterwards (a background thread, a side stream) fails, its thread named.

BUG_CLASSES.md's table "Gaming the judge" lists the patterns; docs/untrusted.md pairs
each with its defence and its test.
"""

from dataclasses import replace
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from attnref._checking import checked_internal
from attnref.conformance.calls import (
    arguments,
    check_output,
    digest,
    invoke,
    note_reading,
    raise_for_error,
)
from attnref.conformance.cases import Case, Inputs, build
from attnref.conformance.checks import Context
from attnref.conformance.oracle import close
from attnref.conformance.verdicts import Failure, Skip
from attnref.conformance.worker import InternalError, Job, Raised, Series, series_outcomes

__all__ = ["SERIES", "fresh_values", "settled_output"]

#: the calls of `fresh_values`: (which value set, whose buffers, what the call is)
SERIES: tuple[tuple[int, int | None, str], ...] = (
    (0, None, "the first inputs, in new buffers"),
    (1, 0, "new values written in place into call 1's buffers"),
    (0, None, "call 1's values again, in new buffers"),
    (1, None, "call 2's values, in new buffers"),
    (0, 0, "call 1's values written back in place, after other calls"),
    (0, 0, "the same call repeated, nothing changed"),
)


#: an output with fewer distinct values is not taken as evidence of a replay
_DISTINCT = 4
#: how many right outputs of earlier cases an executor keeps (`fresh_values`)
_KEPT = 64


@checked_internal
def _distinct(t: Float[Tensor, "*shape"]) -> int:
    """How many distinct values ``t`` holds."""
    flat = t.flatten().sort().values
    return int((flat.diff() != 0).sum()) + 1 if flat.numel() else 0


def _output(ctx: Context, raw: Any, inputs: Inputs, job: Job | None = None) -> Tensor:
    if isinstance(raw, Raised):
        raise_for_error(ctx.backend, raw.error, job)
    if isinstance(raw, InternalError):
        raise Failure(str(raw).splitlines()[0])
    out, _ = ctx.family.read(raw, inputs, False)
    expected_shape = (*inputs.query.shape[:-1], inputs.value.shape[-1])
    return check_output(out, expected_shape, inputs).detach().to(torch.float64)


def _agrees(ctx: Context, out: Tensor, inputs: Inputs) -> Failure | None:
    exp = ctx.expect(inputs)
    try:
        close(out, exp.value, *exp.bounds(), "output", exp.known, semantic=exp.semantic)
    except Failure as f:
        return f
    return None


@checked_internal
def _only_empty_rows_wrong(ctx: Context, out: Float[Tensor, "..."], inputs: Inputs) -> bool:
    """Whether ``out`` agrees with the oracle on every row that sees a key, so that only
    rows that see none are wrong. A kernel that read an invalid index as row 0 gave an
    empty row ``V[0]``, and an earlier case's right output, for a V that differed only in
    rows no query saw, was the same bytes: "returned an earlier call's result" named
    a replay for a policy bug."""
    if inputs.key.shape[-2] == 0 or out.shape != ctx.expect(inputs).value.shape:
        return False
    seen = inputs.visible().any(-1)  # (*batch, h, Tq)
    if bool(seen.all()) or seen.shape != out.shape[:-1]:
        return False
    want = ctx.expect(inputs).value
    kept = torch.where(seen[..., None], out.to(want.dtype), want)
    return _agrees(ctx, kept, inputs) is None


def fresh_values(ctx: Context, case: Case) -> None:
    """Every call of `SERIES` must give the output of its own values.

    A wrong output is called a replay only with evidence: it is the right output for
    the other value set, or exactly the output an earlier call gave for another V *and
    that was right for it* (this series', or an earlier case's, kept in the executor's
    ``history``; every output row is a mean of V's rows, so calls on one V may rightly
    agree). A deterministic but wrong backend gives equal outputs for
    inputs that share what it reads (Hypothesis replays a seed while shrinking), and
    that is reported as the wrong values it is."""
    sets = [ctx.build(case), build(replace(case, seed=case.seed + 7919), ctx.dtype, ctx.device)]
    calls = [Job(*arguments(ctx.backend, sets[which])) for which, _, _ in SERIES]
    series = Series(tuple(calls), tuple(into for _, into, _ in SERIES))
    history: list[tuple[Tensor, str]] = getattr(ctx.executor, "history", [])
    earlier_right = list(history)  # right outputs of earlier cases, with their digests
    oracles = [ctx.prefetch(inputs) for inputs in sets]  # both, while the series runs

    def meanwhile() -> None:
        for oracle in oracles:
            oracle()

    replies = series_outcomes(
        invoke(
            ctx.backend,
            series,
            ctx.timeout * len(calls),
            ctx.executor,
            meanwhile,
        ),
        len(calls),
    )
    # every call is judged first, and each right output kept as evidence, before any
    # failure is reported: a later call's right output may be what a later case replays
    outs: list[tuple[Tensor | None, bool]] = []
    verdicts: list[Failure | Skip | None] = []
    digests: dict[int, str] = {}  # one per value set: its calls share V's values

    def v_digest(i: int) -> str:
        which = SERIES[i][0]
        if which not in digests:
            digests[which] = digest(calls[i])
        return digests[which]

    for i, ((which, _, _), raw) in enumerate(zip(SERIES, replies, strict=True)):
        inputs = sets[which]
        try:
            out = _output(ctx, raw, inputs, calls[i])
        except (Failure, Skip) as e:  # not an output at all: reported in its turn
            outs.append((None, False))
            verdicts.append(e)
            continue
        failure = _agrees(ctx, out, inputs)
        outs.append((out, failure is None))
        verdicts.append(failure)
        if failure is None:
            history.append((out, v_digest(i)))  # a right output: evidence
    for i, ((which, _, what), verdict) in enumerate(zip(SERIES, verdicts, strict=True)):
        if verdict is None:
            continue
        wrong = outs[i][0]
        if wrong is None or isinstance(verdict, Skip):
            raise verdict
        out, failure = wrong, verdict
        inputs = sets[which]

        # where a bug report's repro.py reads this call's output (each call of the
        # series recorded as one of its own)
        def read(r: object, x: Inputs = inputs) -> list[tuple[Inputs, object, None]]:
            return [(x, ctx.family.read(r, x, False)[0], None)]

        note_reading(ctx.executor, replies[i], read, series_call=i)
        own = v_digest(i)
        if (
            not bool(torch.isfinite(out).all())
            or _distinct(out) < _DISTINCT
            or _only_empty_rows_wrong(ctx, out, inputs)
        ):
            # NaN equals nothing, and an output of a few values (zeros, one policy's
            # value everywhere) may equal another call's by itself: no replay to name;
            # nor where only rows that see no key are wrong (a policy, or keys read
            # where none are seen: a replay is wrong where keys are seen too)
            raise failure.reworded(f"call {i + 1} of {len(calls)} ({what}): {failure}")
        for j, (earlier, right) in enumerate(outs[:i]):
            other = sets[SERIES[j][0]]
            if (
                earlier is not None
                and SERIES[j][0] != which
                and ((right and torch.equal(earlier, out)) or _agrees(ctx, out, other) is None)
            ):
                raise Failure(
                    f"the backend returned an earlier call's result: call {i + 1} ({what}) "
                    f"returned the output of call {j + 1}'s values, not of its own; outputs "
                    "must follow values, not buffer addresses, shapes or call counts"
                )
        for earlier, key in earlier_right:
            same = earlier.shape == out.shape and key != own  # not a call on these values
            if same and torch.equal(earlier.to(torch.float64), out):
                raise Failure(
                    f"the backend returned an earlier call's result: call {i + 1} ({what}) "
                    "returned exactly the output an earlier call gave, rightly, for another V; "
                    "outputs must follow values, not buffer addresses, shapes or call counts"
                )
        raise failure.reworded(f"call {i + 1} of {len(calls)} ({what}): {failure}")
    del history[: max(0, len(history) - _KEPT)]


def settled_output(ctx: Context, case: Case) -> None:
    """The output as it stood at the return agrees with the oracle, and has not changed
    a moment later (`Job.recheck`)."""
    inputs = ctx.build(case)
    args, kwargs = arguments(ctx.backend, inputs)
    job = Job(args, kwargs, recheck=0.2)
    raw = invoke(ctx.backend, job, ctx.timeout + 1.0, ctx.executor, ctx.prefetch(inputs))
    out = _output(ctx, raw, inputs, job)
    failure = _agrees(ctx, out, inputs)
    if failure is not None:
        raise failure.reworded(f"the output as it stood when the call returned: {failure}")
