"""The checks behind the properties: what each one calls and how it judges the result.

Two kinds (see docs/conformance.md):

- **agreement**: the backend's output (or gradient) matches the float64 oracle (`forward`,
  `gradient`);
- **laws**: a relation between two calls of the backend itself (`key_permutation`,
  `causality`, `value_affine`, `decode`, ...). The oracle only sets the tolerance: the
  two calls may differ by at most the sum of their error bounds, plus the exact change
  the transformation makes to the float64 answer when rounding the transformed inputs
  moves it (``delta``); `law` is that rule, for every family's laws.

A check takes a `Context` and a `Case`; it raises `Failure` (with a one-line message) or
`Skip`, and returns on success. `attnref.conformance.properties` pairs each check with the
cases it runs on.
"""

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked, checked_internal
from attnref.conformance.calls import (
    arguments,
    call,
    call_lse,
    invoke,
    note_failed_call,
    note_reading,
)
from attnref.conformance.cases import Case, Inputs, build
from attnref.conformance.declarations import Backend, Capabilities, EmptyRow
from attnref.conformance.family import ApiFamily, family_of
from attnref.conformance.oracle import (
    LAW_CALLS,
    Expected,
    close,
    empty_row_causes,
    empty_rows,
    expect,
    expect_grads,
    expect_lse,
    expect_sink_grad,
    one_key_off,
    policy_rows,
)
from attnref.conformance.verdicts import Failure, Skip
from attnref.conformance.worker import Executor, Job
from attnref.masks import Alignment, additive_mask, causal_offset

__all__ = [
    "Check",
    "Context",
    "agree_grads",
    "batch",
    "causality",
    "decode",
    "dropout_zero",
    "forward",
    "gqa",
    "gradient",
    "key_permutation",
    "law",
    "lse",
    "mask_kinds",
    "masked_keys",
    "merge",
    "rng",
    "row_independence",
    "shift_invariance",
    "sink_law",
    "softcap_bound",
    "value_affine",
    "window_keys",
    "window_none",
]


@dataclass(frozen=True)
class Context:
    """Everything a check needs besides its case: the backend, dtype, device, timeout."""

    backend: Backend
    dtype: torch.dtype
    device: str
    timeout: float = 60.0
    #: where backend code runs (None: a thread of this process)
    executor: Executor | None = None
    # the oracle of the inputs a check is working on, by identity: a law compares two
    # calls against the oracles of both, and several laws reuse one base call
    _oracles: dict[int, tuple[Inputs, Expected]] = field(
        default_factory=dict, repr=False, compare=False
    )
    #: the answers a family's own check judged that are not an `Inputs`' oracle (a
    #: recurrent state): each a dict naming the call it judged (`answer`)
    _answers: list[dict[str, Any]] = field(default_factory=list, repr=False, compare=False)
    # the log-sum-exp oracles a check computed, by identity (for `oracles`)
    _lses: dict[int, tuple[Inputs, Expected]] = field(
        default_factory=dict, repr=False, compare=False
    )
    #: judge a long case on a sample of its rows (`rows`); False (what a reproducer
    #: does) compares every row
    sample: bool = True
    #: mixed into the sample's generator: the audit's own secret, so that a backend
    #: cannot know which of its rows are judged (a reproducer judges every row)
    secret: int = 0
    # the rows of the current case that are judged: (Tq, rows), or None for every row
    _sampled: list[tuple[int, Tensor]] = field(default_factory=list, repr=False, compare=False)

    @functools.cached_property
    def family(self) -> ApiFamily:
        """The backend's API family, resolved once for the checks that use this context."""
        return family_of(self.backend)

    @functools.cached_property
    def caps(self) -> Capabilities:
        """The backend's declaration as it holds in this dtype (`Capabilities.for_dtype`)."""
        return self.backend.capabilities.for_dtype(self.dtype)

    def native(self, inputs: Inputs) -> bool:
        """Whether the backend applies the causal diagonal of ``inputs`` itself."""
        return self.family.native_causal(self.caps, inputs)

    def build(self, case: Case) -> Inputs:
        self._oracles.clear()  # a new case: the oracles of the last one are not needed
        self._lses.clear()
        inputs = build(case, self.dtype, self.device)
        self._sampled.clear()
        if self.sample and sampled(inputs):
            Tq = inputs.query.shape[-2]
            self._sampled.append((Tq, sample_rows(Tq, case.seed * 7919 + self.secret)))
        return inputs

    def rows(self, inputs: Inputs) -> Int[Tensor, " n"] | None:
        """The query rows of ``inputs`` the oracle judges: a sample of a long case's rows
        (the same for every call of a check with its number of queries), None for all.
        Output rows are judged on those alone, whatever the call; a law compares two
        calls there too."""
        for Tq, rows in self._sampled:
            if inputs.query.shape[-2] == Tq:
                return rows
        return None

    def run(self, inputs: Inputs, *, oracle: bool = True, **overrides: Any) -> Tensor:
        """The backend's output for ``inputs``. ``oracle``: the check will judge this call
        against the oracle of ``inputs``, which is then computed while the backend runs
        (in its worker, on another core) and kept for `expect`."""
        meanwhile = self.prefetch(inputs) if oracle else None
        return call(self.backend, inputs, self.timeout, self.executor, meanwhile, **overrides)

    def run_lse(self, inputs: Inputs, **overrides: Any) -> tuple[Tensor, Tensor]:
        """The backend's output and log-sum-exp (`Skip` unless it declares the LSE)."""
        out, lse = call_lse(
            self.backend,
            inputs,
            self.timeout,
            self.executor,
            meanwhile=self.prefetch(inputs),
            **overrides,
        )
        assert lse is not None
        return out, lse

    def prefetch(self, inputs: Inputs) -> Callable[[], None]:
        """`expect` of ``inputs``, to run while the backend computes. It never raises: an
        oracle that fails is not kept, and fails again where the check asks for it."""

        def compute() -> None:
            with contextlib.suppress(Exception):
                self.expect(inputs)

        return compute

    def expect(self, inputs: Inputs) -> Expected:
        """The oracle of ``inputs``, computed once per check."""
        hit = self._oracles.get(id(inputs))
        if hit is None or hit[0] is not inputs:
            rows = self.rows(inputs)
            hit = (inputs, expect(inputs, self.caps.empty_row, self.native(inputs), rows))
            self._oracles[id(inputs)] = hit
        return hit[1]

    def expect_lse(self, inputs: Inputs) -> Expected:
        """The oracle's log-sum-exp of ``inputs``, on the rows `rows` judges."""
        exp = expect_lse(
            inputs, self.caps.empty_lse, self.rows(inputs), with_sink=self.caps.lse_with_sink
        )
        self.keep_lse(inputs, exp)
        return exp

    def keep_lse(self, inputs: Inputs, expected: Expected) -> None:
        """Keep ``expected`` as the log-sum-exp oracle a check judged the call on
        ``inputs`` against (for `oracles`, where a family computes its own)."""
        self._lses[id(inputs)] = (inputs, expected)

    def oracles(self) -> list[dict[str, Any]]:
        """The oracles this check computed on its last case, as plain tensors and
        numbers: each one's inputs, its float64 output (NaN where the declared policy
        gives NaN) and its (max, mean) bounds (what `check_case` saves)."""
        found = []
        for inputs, exp in self._oracles.values():
            found.append(
                {
                    "inputs": {
                        name: getattr(inputs, name)
                        for name in ("query", "key", "value", "attn_mask", "alibi_slopes", "sinks")
                    }
                    | {
                        "causal": inputs.causal,
                        "scale": inputs.scale,
                        "window": inputs.window,
                        "softcap": inputs.softcap,
                    },
                    "output": exp.value,
                    "known": exp.known,
                    "bound": exp.bounds(),
                }
                | self._located(inputs)
            )
        return found

    def _located(self, inputs: Inputs) -> dict[str, Any]:
        """Where the backend's answer to ``inputs`` lies in what its call returned, and
        the oracle's log-sum-exp, for `oracles`: ``call``, the index of the recorded call
        (`attnref.conformance.runner.Recording`), ``where`` and ``lse_where``, the flat
        index of each element among the tensors it returned (in order, depth first),
        ``problem``, what is wrong with an output that could not be read (its type or
        shape), and ``lse``, ``lse_known``, ``lse_bound``; empty where none was noted."""
        found: dict[str, Any] = {}
        readings = getattr(self.executor, "readings", {})
        hit = readings.get(id(inputs))
        if hit is not None and hit[0] is inputs:
            found |= {"call": hit[1], "where": hit[2], "lse_where": hit[3], "problem": hit[4]}
        lse = self._lses.get(id(inputs))
        if lse is not None and lse[0] is inputs:
            found |= {"lse": lse[1].value, "lse_known": lse[1].known, "lse_bound": lse[1].bounds()}
        return found

    def answer(self, **record: Any) -> None:
        """Keep what a family's own check judged the backend's last call against (its
        float64 values and bounds, by name), for `check_case`'s ``save``: ``call`` is
        that call's index among those the executor recorded (None where it records
        none)."""
        calls = getattr(self.executor, "calls", None)
        self._answers.append({"call": None if calls is None else len(calls) - 1, **record})

    def answers(self) -> list[dict[str, Any]]:
        """What `answer` kept."""
        return list(self._answers)

    def answer_part(
        self,
        what: str,
        read: Callable[[object], object],
        expected: Tensor,
        bound: tuple[float, float],
        known: Tensor | None = None,
    ) -> None:
        """Keep a part of the last call's result that a family's own check judges (a
        cache it appended to, ``max_logits``), for `check_case`'s ``save``: ``read``
        picks it from the result as the family reads it, ``expected`` its float64
        values (NaN where NaN is due), ``bound`` the (max, mean) error it may have;
        repro.py judges it as an output. Nothing is kept outside a recording."""
        locate = getattr(self.executor, "locate", None)
        found = None if locate is None else locate(read)
        if found is None:
            return
        call, where = found
        if tuple(where.shape) != tuple(expected.shape):
            return
        self._answers.append({"call": call, "what": what, "where": where,
                              "expected": expected.detach().to(torch.float64).cpu(),
                              "known": known, "bound": bound})  # fmt: skip

    def keep(self, inputs: Inputs, expected: Expected) -> None:
        """Make ``expected`` the oracle of ``inputs`` for the rest of the check (a
        family's check that widens the bound of a call, e.g. for a rotation it rounds)."""
        self._oracles[id(inputs)] = (inputs, expected)

    def empty(self, inputs: Inputs, policy: EmptyRow) -> Tensor:
        """``(*batch, h, Tq, 1)``: the queries with no visible key that the declaration
        gives ``policy`` (zero, nan, uniform), for the call ``inputs`` make."""
        rows = policy_rows(inputs, self.caps.empty_row, self.native(inputs))
        return rows[policy] if policy in rows else torch.zeros_like(empty_rows(inputs))

    def agree(self, inputs: Inputs, what: str = "output", **overrides: Any) -> Tensor:
        """Call the backend on ``inputs`` (its keywords ``overrides`` replaced) and fail
        unless it matches the oracle."""
        out = self.run(inputs, **overrides)
        exp = self.expect(inputs)
        with self.naming_the_row(inputs):
            try:
                close(
                    out.to(torch.float64),
                    exp.value,
                    *exp.bounds(),
                    what,
                    exp.known,
                    semantic=exp.semantic,
                )
            except Failure as f:
                where = f.where
                if f.kind != "error" or where is None or len(where) != out.dim():
                    raise
                off = one_key_off(inputs, out[where[:-1]], where[:-1], exp.bounds()[0])
                raise (f.reworded(f"{f}; {off}") if off else f) from None
        return out

    def row(self, inputs: Inputs, where: tuple[int, ...], nan: bool = False) -> str:
        """What the oracle says of the output row at index ``where``: how many keys its
        query sees or, for one that sees none, what hid them and the declared policy.
        ``nan``: the backend's value there is NaN (a hint that a NaN spread from a row
        beside it is given only then, and only in the dtype of the bug it names)."""
        index = where[:-1]
        visible = inputs.visible()[index]
        query = f"query {where[-2]}"
        if bool(visible.any()):
            seen = f"{query} sees {int(visible.sum())} of {visible.numel()} keys"
            return seen + self._spread(inputs, where, nan)
        causes = empty_row_causes(inputs, self.native(inputs))
        cause = next(c for c, rows in causes.items() if bool(rows[index].any()))
        policy = self.caps.empty_rows.for_call(cause, inputs.attn_mask)
        if inputs.key.shape[-2] == 0:
            return f"{query} sees no key (there are none; declared policy {policy!r})"
        why = self._hidden_by(inputs, index)
        return f"{query} sees no key ({why}; declared policy {policy!r} for {_CAUSES[cause]})"

    def _hidden_by(self, inputs: Inputs, index: tuple[int, ...]) -> str:
        """What hid the keys of the row at ``index`` (which sees none): each of the mask,
        the causal diagonal and the window that hides some of them (a row a window
        emptied was said to be hidden by "the causal diagonal the backend applies")."""
        mask = inputs.attn_mask
        parts = []
        for name, alone in (
            ("-inf in the float mask" if mask is not None and mask.is_floating_point()
             else "the mask", replace(inputs, causal=None, window=None)),
            ("the causal diagonal" + (" the backend applies" if self.native(inputs)
             else " (passed folded into the mask)"), replace(inputs, attn_mask=None, window=None)),
            ("the sliding window", replace(inputs, attn_mask=None, causal=None)),
        ):  # fmt: skip
            if not bool(alone.visible()[index].all()):
                parts.append(name)
        return " and ".join(parts) + (" hide them" if len(parts) > 1 else " hides them")

    def _spread(self, inputs: Inputs, where: tuple[int, ...], nan: bool) -> str:
        """For a row that sees keys: a row nearby that sees none, whose NaN may have
        spread to it, as `naming_the_row` adds it to a failure. A neighbouring query of
        the same head (a matmul that spreads a NaN row of its left operand to the next
        rows: oneDNN's bfloat16 matmul on CPUs with AMX, oneDNN#5717), or a head at the
        same query position (a projection that mixes heads, before or after attention)."""
        seen = inputs.visible()
        i, Tq = where[-2], seen.shape[-2]
        rows = seen[where[:-2]].any(dim=-1)  # (Tq,): which queries of this head see a key
        near = [j for j in (i - 1, i + 1, i - 2, i + 2) if 0 <= j < Tq and not bool(rows[j])]
        # only what that bug makes: a NaN (not an inf, not garbage) in bfloat16
        if nan and near and inputs.query.dtype == torch.bfloat16:
            return (
                f"; query {near[0]} of the same head sees no key: a matmul that spreads "
                "a NaN row of P to its neighbours (oneDNN's bfloat16 matmul on some CPUs, "
                "oneDNN#5717) makes this row NaN too"
            )
        if len(where) < 3:  # (h, Tq, Dv) at least: unbatched outputs have heads too
            return ""
        index: tuple[int | slice, ...] = (*where[:-3], slice(None), where[-2])
        heads = seen[index]  # (h, Tk)
        empty = [int(i) for i in (~heads.any(dim=-1)).nonzero().flatten()]
        if not empty:
            return ""
        return (
            f"; head {empty[0]} at the same position sees no key: if the backend mixes "
            "heads (a projection), a NaN or value of that row spreads to the others"
        )

    @contextlib.contextmanager
    def naming_the_row(self, inputs: Inputs) -> Iterator[None]:
        """Add `row`'s account of the failing output row to a `Failure` raised inside."""
        try:
            yield
        except Failure as f:
            if f.where is None or len(f.where) not in (inputs.query.dim() - 1, inputs.query.dim()):
                raise
            try:
                where = f.where if len(f.where) == inputs.query.dim() else (*f.where, 0)
                nan = f.kind == "nan" and f.got is not None and math.isnan(f.got)
                row = self.row(inputs, where, nan)
            except (IndexError, StopIteration):  # an index the inputs do not explain
                raise f from None
            raise f.reworded(f"{f}; {row}") from None


Check = Callable[[Context, Case], None]

#: a case whose oracle would cost more than this (``batch * h * Tq * Tk * (Dh + Dv)``)
#: and that has more than `SAMPLE_ROWS` queries is judged on a sample of its rows
JUDGE_WORK = 2**21
#: how many query rows a long case is judged on
SAMPLE_ROWS = 32


def sampled(inputs: Inputs) -> bool:
    """Whether the oracle of ``inputs`` is computed on a sample of its rows."""
    q, v = inputs.query, inputs.value
    Tq, Tk = q.shape[-2], inputs.key.shape[-2]
    work = q.numel() // max(1, q.shape[-1]) * Tk * (q.shape[-1] + v.shape[-1])
    return Tq > SAMPLE_ROWS and work > JUDGE_WORK


@checked
def sample_rows(Tq: int, seed: int) -> Int[Tensor, " n"]:
    """`SAMPLE_ROWS` sorted query rows of ``Tq``: the first two and last two (where a
    tile starts and a tail ends), each side of a boundary of 64 rows, and the rest at
    random; drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed % 2**63)
    rows = {0, 1, Tq - 2, Tq - 1}
    edge = 64 * int(torch.randint(1, max(2, Tq // 64), (), generator=gen))
    rows |= {r for r in (edge - 1, edge, edge + 1) if r < Tq}
    rest = torch.randperm(Tq, generator=gen).tolist()
    while len(rows) < SAMPLE_ROWS:
        rows.add(rest.pop())
    return torch.tensor(sorted(rows))


#: how a row's keys were hidden, by `attnref.conformance.oracle.empty_row_causes`
_CAUSES = {
    "bool_mask": "rows a boolean mask empties",
    "float_mask": "rows -inf in a float mask empties",
    "causal": "rows its own causal masking empties",
}


def rng(case: Case, salt: int) -> torch.Generator:
    """A generator for a check's own random choices, fixed by the case's seed (``salt``
    tells a check's choices apart)."""
    return torch.Generator().manual_seed(case.seed * 1009 + salt)


def _with(inputs: Inputs, **tensors: Tensor | None) -> Inputs:
    return replace(inputs, **tensors)  # type: ignore[arg-type]


@checked_internal
def law(
    ctx: Context,
    got: Float[Tensor, "*shape"],
    got_inputs: Inputs,
    base: Float[Tensor, "*base"],
    base_inputs: Inputs,
    what: str,
    *,
    transform: Callable[[Float[Tensor, "..."]], Float[Tensor, "..."]] = lambda x: x,
    factor: float = 1.0,
    sel: Bool[Tensor, "*#shape"] | None = None,
    base_sel: Bool[Tensor, "*#base"] | None = None,
    base_finite: Bool[Tensor, "*#base"] | None = None,
    names: tuple[str, str] = LAW_CALLS,
) -> None:
    """Fail unless ``got ~ transform(base)`` within both calls' bounds on ``sel``.

    ``base_sel``: the rows of ``base`` whose bounds count, where ``transform`` changes
    the shape (default: ``sel``). ``base_finite``: the rows of ``base`` that must be
    finite where the oracle is (default: all; a base call whose other rows hold a
    policy the declaration does not give, such as a sink of -inf's empty rows).
    ``names``: how messages name the two calls, ``got``'s first.

    ``factor`` is how much ``transform`` scales an error; ``delta`` covers the change in
    the exact answer that rounding the transformed inputs makes. First, each call must be
    finite wherever its own oracle is: NaN is not equal to itself, so two NaN outputs
    never make a law hold, and the message names the call that went wrong.
    """
    eg, eb = ctx.expect(got_inputs), ctx.expect(base_inputs)
    judged = eb.judged()
    if base_finite is not None:
        judged = judged.where(base_finite, math.nan)
    with ctx.naming_the_row(base_inputs):
        _finite_where_the_oracle_is(base, judged, f"{what}: {names[1]}")
    # a long case's rows the oracles know (`Context.rows`), as the transform moves them
    sel = eg.sel(sel)
    if eb.known is not None:
        marker = torch.zeros_like(eb.value).where(eb.known, math.nan)
        moved = torch.isfinite(transform(marker))
        sel = moved if sel is None else sel & moved
    oracle = eg.value if sel is None else torch.where(sel, eg.value, torch.nan)  # sel only
    with ctx.naming_the_row(got_inputs):
        _finite_where_the_oracle_is(got, oracle, f"{what}: {names[0]}")
    want = transform(base.to(torch.float64))
    exact = transform(eb.value)
    diff = (eg.value - exact).abs()
    usable = torch.isfinite(diff) if sel is None else torch.isfinite(diff) & sel.expand_as(diff)
    delta = float(torch.where(usable, diff, 0.0).max()) if diff.numel() else 0.0  # diff >= 0
    gmax, gmean = eg.bounds(sel)
    bmax, bmean = eb.bounds(sel if base_sel is None else base_sel)
    try:
        with ctx.naming_the_row(got_inputs):
            close(
                got.to(torch.float64),
                want,
                gmax + abs(factor) * bmax + delta,
                gmean + abs(factor) * bmean + delta,
                what,
                sel,
                law=eg.value,
                semantic=eg.semantic,
                names=names,
            )
    except Failure as failed:
        # two calls disagree: the one the oracle does not side with is judged against
        # its own oracle first, so that the wrong call is the finding, not the law
        calls = [
            (base, eb, base_sel, base_finite, base_inputs, names[1]),
            (got, eg, sel, None, got_inputs, names[0]),
        ]
        if f"sides with {names[1]}" in str(failed):
            calls.reverse()
        for out, exp, rows, finite, inputs, which in calls:
            keep = rows if finite is None else finite if rows is None else rows & finite
            try:
                with ctx.naming_the_row(inputs):
                    close(out.to(torch.float64), exp.value, *exp.bounds(keep),
                          f"{what}: {which}", exp.sel(keep), semantic=exp.semantic)  # fmt: skip
            except Failure as blamed:  # that call's own failure, and the law's after it
                law_said = str(failed).removeprefix(f"{what}: ")
                raise blamed.reworded(f"{blamed}; the law: {law_said}") from None
        raise


@checked_internal
def _finite_where_the_oracle_is(
    out: Float[Tensor, "*shape"], oracle: Float[Tensor, "*shape"], what: str
) -> None:
    bad = ~torch.isfinite(out) & torch.isfinite(oracle)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise Failure(
            f"{what} returned {int(bad.sum())} NaN/inf values where the oracle is finite; "
            f"first at {where}: got {float(out[where])}, the oracle says "
            f"{float(oracle[where]):.6g}",
            got=float(out[where]),
            expected=float(oracle[where]),
            where=where,
            kind="nan",
        )


@checked_internal
def _rows(sel: Bool[Tensor, "*rows"]) -> Bool[Tensor, "*rows 1"]:
    """``(..., Tq)`` row selection as a ``(..., Tq, 1)`` mask over an output."""
    return sel.unsqueeze(-1)


# ------------------------------------------------------------------------ agreement


def forward(ctx: Context, case: Case) -> None:
    ctx.agree(ctx.build(case))


def gradient(ctx: Context, case: Case) -> None:
    agree_grads(ctx, case, ctx.build(case))


def agree_grads(ctx: Context, case: Case, inputs: Inputs, **overrides: Any) -> None:
    """dQ, dK, dV (and dSinks) of the backend's call on ``inputs`` (its keywords
    ``overrides`` replaced) against the oracle's, for a random upstream gradient."""
    policies: tuple[EmptyRow, ...] = (
        "nan", "uniform", "unmasked", "diagonal", "diagonal_replaced", "undefined"
    )  # fmt: skip
    for policy in policies:
        if bool(ctx.empty(inputs, policy).any()):
            raise Skip(f"gradients of rows with no visible key under policy {policy!r}")
    d_out = torch.randn(
        (*inputs.query.shape[:-1], inputs.value.shape[-1]), generator=rng(case, 1)
    ).to(device=inputs.query.device, dtype=inputs.query.dtype)
    args, kwargs = arguments(ctx.backend, inputs, **overrides)  # the job makes Q, K, V leaves
    family = ctx.family
    job = Job(args, kwargs, family.to_layout(d_out, inputs))
    # the oracle's gradients are computed while the backend's run (as `Context.run` does
    # for outputs); one that fails is computed again below, where it raises
    done: list[tuple[Expected, Expected, Expected]] = []

    def meanwhile() -> None:
        with contextlib.suppress(Exception):
            done.append(expect_grads(inputs, d_out))

    leaves = (inputs.query, inputs.key, inputs.value)
    sinks_judged = inputs.sinks is not None and ctx.caps.sink_gradients
    shapes = [tuple(a.shape) for a in args[:3]]
    if sinks_judged:
        assert inputs.sinks is not None
        shapes.append(tuple(inputs.sinks.shape))

    def well_formed() -> None:  # where a correct call's gradients lie, for a bug report
        note_failed_call(ctx.executor, lambda: tuple(torch.zeros(s) for s in shapes),
                         lambda r: [])  # fmt: skip

    sink_exp = expect_sink_grad(inputs, d_out) if sinks_judged else None

    def answer(expected: tuple[Expected, ...]) -> None:
        _answer_grads(ctx, leaves, expected)
        if sink_exp is not None:
            ctx.answer_part("dSinks", lambda r: cast(Any, r)[3], sink_exp.value,
                            sink_exp.bounds())  # fmt: skip

    try:
        grads = invoke(ctx.backend, job, ctx.timeout, ctx.executor, meanwhile)
    except Failure:
        well_formed()
        answer(done[0] if done else expect_grads(inputs, d_out))
        raise
    given = list(grads) if isinstance(grads, tuple | list) else []
    pairs = zip(given, shapes, strict=False)
    if len(given) < len(shapes) or any(
        not isinstance(g, Tensor) or tuple(g.shape) != s for g, s in pairs
    ):  # a gradient missing or misshapen: it fails below
        well_formed()
    else:
        note_reading(ctx.executor, grads, lambda r: [])
    expected = done[0] if done else expect_grads(inputs, d_out)
    answer(expected)
    for name, g, arg, leaf, exp in zip(
        ("dQ", "dK", "dV"), grads[:3], args[:3], leaves, expected, strict=True
    ):
        if g is None:
            raise Failure(f"{name} is None: the output does not depend on it")
        if tuple(g.shape) != tuple(arg.shape):
            raise Failure(f"{name} has shape {tuple(g.shape)}, expected {tuple(arg.shape)}")
        back = family.from_layout(g.detach(), leaf)
        close(back.to(torch.float64), exp.value, *exp.bounds(), name)
    if inputs.sinks is not None and sink_exp is not None:
        d_sinks = grads[3] if len(grads) > 3 else None
        if d_sinks is None:
            raise Failure("dSinks is None: the output does not depend on the sink logits")
        if tuple(d_sinks.shape) != tuple(inputs.sinks.shape):
            shape = tuple(inputs.sinks.shape)
            raise Failure(f"dSinks has shape {tuple(d_sinks.shape)}, expected {shape}")
        close(d_sinks.detach().to(torch.float64), sink_exp.value, *sink_exp.bounds(), "dSinks")


def _answer_grads(
    ctx: Context, leaves: tuple[Tensor, Tensor, Tensor], expected: tuple[Expected, ...]
) -> None:
    """dQ, dK, dV as a bug report's repro.py reads them from a gradient call's result
    (`Context.answer_part`)."""
    for k, (name, leaf, exp) in enumerate(zip(("dQ", "dK", "dV"), leaves, expected, strict=True)):

        def grad(r: Any, k: int = k, leaf: Tensor = leaf) -> object:
            return ctx.family.from_layout(r[k], leaf)

        ctx.answer_part(name, grad, exp.value, exp.bounds())


# ------------------------------------------------------------------------------ laws


def masked_keys(ctx: Context, case: Case) -> None:
    """Rows that see a key must not change; a row that sees none holds its policy's value,
    and under the "uniform" and "unmasked" policies that reads the hidden keys, poisoned
    ones included, so those rows are left out (they are the empty-row property's
    business)."""
    dirty_inputs = ctx.build(case)
    clean_inputs = ctx.build(replace(case, poison="none"))
    clean = ctx.run(clean_inputs)
    dirty = ctx.run(dirty_inputs, oracle=False)  # judged against the clean call's oracle
    # rows whose policy reads the hidden keys: the mean of every V, or attention over them
    reads = ctx.empty(clean_inputs, "uniform") | ctx.empty(clean_inputs, "unmasked")
    reads = reads | ctx.empty(clean_inputs, "diagonal")
    reads = reads | ctx.empty(clean_inputs, "diagonal_replaced")
    sel = ~reads if bool(reads.any()) else None
    law(
        ctx,
        dirty,
        clean_inputs,
        clean,
        clean_inputs,
        f"output with {case.poison} at hidden keys",
        sel=sel,
    )


def key_permutation(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    Tk = inputs.key.shape[-2]
    perm = torch.randperm(Tk, generator=rng(case, 2)).to(inputs.key.device)
    mask = inputs.attn_mask
    if mask is not None and mask.shape[-1] == Tk:
        mask = mask[..., perm]
    permuted = _with(inputs, key=inputs.key[..., perm, :], value=inputs.value[..., perm, :])
    permuted = _with(permuted, attn_mask=mask)
    law(ctx, ctx.run(permuted), permuted, ctx.run(inputs), inputs, "output with keys permuted")


def row_independence(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    gen = rng(case, 3)
    q = inputs.query
    changed = torch.rand(q.shape[-2], generator=gen) < 0.5
    fresh = case.amp * torch.randn(q.shape, generator=gen)
    new_q = torch.where(changed.unsqueeze(-1), fresh, q.detach().cpu().float())
    other = _with(inputs, query=new_q.to(device=q.device, dtype=q.dtype))
    keep = _rows(~changed.to(q.device))
    law(ctx, ctx.run(other), other, ctx.run(inputs), inputs, "unchanged queries", sel=keep)


def _unseen_keys(
    ctx: Context, inputs: Inputs, start: int, stop: int, gen: torch.Generator, what: str
) -> None:
    """Fresh K and V at keys ``start:stop`` leave every row that sees none of them as
    it was (the causal diagonal, a window, a mask)."""
    key, value = (_fresh_keys(t, start, stop, gen) for t in (inputs.key, inputs.value))
    changed = _with(inputs, key=key, value=value)
    blind = ~inputs.visible()[..., start:stop].any(dim=-1)  # rows that see none of them
    law(ctx, ctx.run(changed), changed, ctx.run(inputs), inputs, what, sel=_rows(blind))


@checked_internal
def _fresh_keys(
    t: Float[Tensor, "*batch g Tk D"], start: int, stop: int, gen: torch.Generator
) -> Float[Tensor, "*batch g Tk D"]:
    """A contiguous copy of K or V ``t`` with new values at keys ``start:stop`` alone."""
    out = t.clone(memory_format=torch.contiguous_format)
    block = (*t.shape[:-2], stop - start, t.shape[-1])
    out[..., start:stop, :] = torch.randn(block, generator=gen).to(t)
    return out


#: the most cuts one `causality` check makes (one copy of the inputs each, in one call)
MAX_CUTS = 16
#: and the copies' scores (``batch * h * Tq * Tk`` each) stay under this, at least one
CUT_SCORES = 2**16


def causality(ctx: Context, case: Case) -> None:
    """Keys past a row's last visible key never change its output, at every cut.

    For each cut ``c`` just past some row's last visible key (the causal diagonal, a
    window, a mask), a copy of the inputs whose keys from ``c`` on are all fresh; the
    copies are stacked along the first batch dim (a new one for unbatched inputs) and
    sent in one call, and each row that sees none of its copy's fresh keys must equal
    the call on the original inputs. A leak of even one key past the diagonal changes
    the leaking row in the copy cut just past it, whichever row leaks. (One random cut
    per case found a diagonal off by one only when it fell there: one chance in 4098
    for a query decoded against 4097 keys.) A long case takes as many cuts as its
    scores allow, at least one, drawn among them.
    """
    inputs = ctx.build(case)
    gen = rng(case, 4)
    Tk = inputs.key.shape[-2]
    seen = inputs.visible()  # (*batch, h, Tq, Tk)
    keys = torch.arange(Tk, device=seen.device)
    last = torch.where(seen, keys, -1).amax(dim=-1)  # each row's last visible key
    cuts = sorted({int(e) + 1 for e in torch.unique(last).tolist() if 0 <= e < Tk - 1})
    if not cuts:
        return  # every row sees the last key (decode, bottom-right): no key is past any
    room = max(1, min(MAX_CUTS, CUT_SCORES // max(1, seen.numel())))
    if len(cuts) > room:
        pick = torch.randperm(len(cuts), generator=gen)[:room]
        cuts = sorted(cuts[int(i)] for i in pick)

    copies, rep = _copies(
        inputs,
        [_fresh_keys(inputs.key, c, Tk, gen) for c in cuts],
        [_fresh_keys(inputs.value, c, Tk, gen) for c in cuts],
    )
    blind = [~seen[..., c:].any(dim=-1) for c in cuts]  # rows that see no key from c on
    sel = torch.cat(blind) if inputs.query.dim() > 3 else torch.stack(blind)
    any_cut = torch.stack(blind).any(dim=0)
    law(
        ctx,
        ctx.run(copies),
        copies,
        ctx.run(inputs),
        inputs,
        f"rows that see no key from the cut on, every key from it on fresh (one copy per "
        f"cut along the first batch dim, cuts {', '.join(map(str, cuts))})",
        transform=rep,
        sel=_rows(sel),
        base_sel=_rows(any_cut),
    )


@checked_internal
def _copies(
    inputs: Inputs,
    keys: list[Float[Tensor, "*batch g Tk Dh"]],
    values: list[Float[Tensor, "*batch g Tk Dv"]],
) -> tuple[Inputs, Callable[[Tensor], Tensor]]:
    """``inputs`` repeated once per entry of ``keys`` and ``values`` (each copy's own K
    and V) along the first batch dim, or a new one for unbatched inputs; and the map
    that repeats an output of ``inputs`` the same way."""
    m, batched = len(keys), inputs.query.dim() > 3

    def rep(t: Tensor) -> Tensor:
        if batched:
            return t.repeat(m, *([1] * (t.dim() - 1)))
        return t.unsqueeze(0).repeat(m, *([1] * t.dim()))

    q, mask, slopes = inputs.query, inputs.attn_mask, inputs.alibi_slopes
    if mask is not None and batched and mask.dim() == q.dim() and mask.shape[0] > 1:
        mask = rep(mask)  # a mask of each sample's own; others broadcast over the copies
    if slopes is not None and batched and slopes.dim() > 1:  # (*batch, h)
        slopes = rep(slopes)
    stack = torch.cat if batched else torch.stack
    copies = replace(
        inputs,
        query=rep(q),
        key=stack(keys),
        value=stack(values),
        attn_mask=mask,
        alibi_slopes=slopes,
    )
    return copies, rep


def shift_invariance(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    q = inputs.query
    Tq, Tk = q.shape[-2], inputs.key.shape[-2]
    # a float mask on a half-integer grid, so that adding integers below 128 is exact in
    # every dtype: the two calls then have exactly the same answer
    mask = inputs.attn_mask
    base = torch.zeros(Tq, Tk) if mask is None else (mask.cpu().float() * 2).round() / 2
    shift = torch.randint(-100, 101, (Tq, 1), generator=rng(case, 5)).float()
    plain = _with(inputs, attn_mask=base.to(device=q.device, dtype=q.dtype))
    shifted = _with(inputs, attn_mask=(base + shift).to(device=q.device, dtype=q.dtype))
    law(ctx, ctx.run(shifted), shifted, ctx.run(plain), plain, "output with row scores shifted")


def value_affine(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    gen = rng(case, 6)
    a = float(torch.tensor([-2.0, 0.5, 3.0, -0.75])[torch.randint(0, 4, (), generator=gen)])
    b = float(torch.randn((), generator=gen)) * 3
    v = inputs.value
    moved = _with(inputs, value=(a * v.to(torch.float64) + b).to(v.dtype))
    seen = _rows(~empty_rows(inputs).squeeze(-1))  # rows with no key hold the policy's value
    law(
        ctx,
        ctx.run(moved),
        moved,
        ctx.run(inputs),
        inputs,
        f"out(q, k, {a:g} v + {b:.3g})",
        transform=lambda out: a * out + b,
        factor=a,
        sel=seen,
    )


def decode(ctx: Context, case: Case) -> None:
    """Each query alone, against the keys it sees causally (a KV cache), with no mask.

    A step is a plain call (one query sees all its keys); to a backend that takes only
    causal calls and computes the bottom-right alignment, it is that call, causal
    bottom-right (the one query is then aligned with the last key: the same function),
    as a decode step through such a kernel is."""
    inputs = ctx.build(case)
    step_causal: Alignment | None = None
    if ctx.caps.causal_only and "bottom_right" in ctx.caps.causal_alignments:
        step_causal = "bottom_right"
    assert inputs.causal is not None
    full = ctx.run(inputs)
    q, k, v, mask = inputs.query, inputs.key, inputs.value, inputs.attn_mask
    Tq, Tk = q.shape[-2], k.shape[-2]
    offset = causal_offset(Tq, Tk, inputs.causal)
    pick = int(torch.randint(0, Tq, (), generator=rng(case, 7)))
    judged = ctx.rows(inputs)  # a long case's: one of the rows the oracle judges
    if judged is not None:
        pick = int(judged[pick % len(judged)])
    rows = sorted({0, Tq - 1, pick})
    mq, mk = ctx.caps.length_multiples
    if mk > 1:  # a kernel that takes key lengths of multiples of mk: the rows that see such
        fits = [i for i in range(Tq) if min(Tk, i + offset + 1) % mk == 0]
        rows = sorted({fits[0], fits[-1], fits[pick % len(fits)]}) if fits else []
        if not rows:
            raise Skip(f"no query sees a multiple of {mk} keys (length_multiples)")
    for i in rows:
        n = min(Tk, i + offset + 1)
        if n <= 0:
            continue  # this query sees nothing: the empty-row property's business
        row_mask = None if mask is None else mask[..., i if mask.shape[-2] > 1 else 0, None, :n]
        # one query, repeated to a multiple of mq where the kernel takes only such: rows
        # are independent, and the last copy (aligned bottom-right, it sees all n keys)
        # is the one row
        one = q[..., i : i + 1, :]
        step = Inputs(
            one.expand(*one.shape[:-2], mq, one.shape[-1]).contiguous() if mq > 1 else one,
            k[..., :n, :],
            v[..., :n, :],
            None if row_mask is None else row_mask.expand(*row_mask.shape[:-2], mq, n),
            step_causal,
            inputs.scale,
            softcap=inputs.softcap,  # a row's own: softcap and sinks apply step by step
            sinks=inputs.sinks,
        )
        law(
            ctx,
            ctx.run(step)[..., mq - 1 :, :],
            replace(step, query=one, attn_mask=row_mask, causal=step_causal),
            full,
            inputs,
            f"query {i} decoded alone against {n} keys",
            transform=lambda out, i=i: out[..., i : i + 1, :],  # type: ignore[misc]
        )


def gqa(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    h = inputs.query.shape[-3]
    expanded = _with(
        inputs, key=F.expand_kv_heads(inputs.key, h), value=F.expand_kv_heads(inputs.value, h)
    )
    names = ("the call with grouped KV heads", "the call with the KV heads expanded")
    law(ctx, ctx.run(inputs), inputs, ctx.run(expanded), expanded, "GQA against expanded heads",
        names=names)  # fmt: skip


def batch(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    full = ctx.run(inputs)
    B = inputs.query.shape[0]
    for b in sorted({0, B - 1}):

        def one(t: Tensor, b: int = b) -> Tensor:
            return t if t.dim() < 4 or t.shape[0] == 1 else t[b : b + 1]

        slopes = inputs.alibi_slopes
        if slopes is not None and slopes.dim() > 1:  # (*batch, h): the sample's own
            slopes = slopes[b : b + 1]
        alone = replace(  # its variants kept (a window a backend needs on every call)
            inputs,
            query=one(inputs.query),
            key=one(inputs.key),
            value=one(inputs.value),
            attn_mask=None if inputs.attn_mask is None else one(inputs.attn_mask),
            alibi_slopes=slopes,
        )
        law(
            ctx,
            ctx.run(alone),
            alone,
            full,
            inputs,
            f"sample {b} alone",
            transform=lambda out, b=b: out[b : b + 1],  # type: ignore[misc]
        )


def dropout_zero(ctx: Context, case: Case) -> None:
    if not ctx.family.dropout:
        raise Skip(f"the {ctx.backend.api} convention takes no dropout_p")
    inputs = ctx.build(case)
    first = ctx.agree(inputs, "first call with dropout_p=0")
    again = ctx.run(inputs, dropout_p=0.0)
    law(ctx, again, inputs, first, inputs, "second call with dropout_p=0")


def mask_kinds(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    mask = inputs.attn_mask
    assert mask is not None
    assert mask.dtype == torch.bool
    as_float = _with(inputs, attn_mask=additive_mask(mask, inputs.query.dtype))
    # a backend may declare a different result for an empty row under each kind of mask
    policies = ctx.caps.empty_rows
    differ = policies.bool_mask != policies.float_mask
    sel = _rows(~empty_rows(inputs).squeeze(-1)) if differ else None
    law(
        ctx,
        ctx.run(as_float),
        as_float,
        ctx.run(inputs),
        inputs,
        "float mask against bool mask",
        sel=sel,
    )


# ------------------------------------------------------------------------ variants


def window_keys(ctx: Context, case: Case) -> None:
    """Keys outside a query's window never change its row, whatever they hold."""
    inputs = ctx.build(case)
    gen = rng(case, 8)
    Tk = inputs.key.shape[-2]
    start = int(torch.randint(0, Tk, (), generator=gen))
    stop = int(torch.randint(start + 1, Tk + 1, (), generator=gen))
    what = f"rows whose window leaves out keys {start}..{stop - 1}, with those keys changed"
    _unseen_keys(ctx, inputs, start, stop, gen, what)


def window_none(ctx: Context, case: Case) -> None:
    """``(-1, -1)`` is no window, and so is the tightest window that covers every key."""
    inputs = ctx.build(case)
    Tq, Tk = inputs.query.shape[-2], inputs.key.shape[-2]
    offset = causal_offset(Tq, Tk, inputs.alignment)
    # the last query's window reaches key 0, the first query's the last key: exactly
    cover = (max(0, Tq - 1 + offset), max(0, Tk - 1 - offset))
    windows: tuple[tuple[int, int], ...] = ((-1, -1), cover)
    if ctx.caps.causal_windows_only:  # (left, 0) only: against a causal call, the same
        if inputs.causal is None:
            raise Skip("a window that ends at the query equals no window on causal calls only")
        windows = ((-1, 0), (cover[0], 0))
    base = ctx.run(inputs)
    for window in windows:
        other = replace(inputs, window=window)
        law(ctx, ctx.run(other), other, base, inputs, f"window {window} against no window")


def softcap_bound(ctx: Context, case: Case) -> None:
    """Under softcap ``c`` every effective score lies in ``(-c, c)``, so a weight of a
    query that sees ``n`` keys lies in ``(exp(-2c) / n, exp(2c) / n)``. The weights are
    read through the output, with the identity for V."""
    inputs = ctx.build(case)
    c = inputs.softcap
    v = inputs.value
    Tk = v.shape[-2]
    # V = I reads the weights, its columns Dv at a time (where the declaration takes no
    # Dv = Tk, the case has its own Dv: several calls)
    width = v.shape[-1]
    if width == 0:
        raise Skip("a value dim of 0 reads no weights through V")
    eye = torch.eye(Tk, dtype=v.dtype, device=v.device)
    probes = []
    for start in range(0, Tk, width):
        block = eye[:, start : start + width]
        block = torch.nn.functional.pad(block, (0, width - block.shape[-1]))
        probes.append(_with(inputs, value=block.expand(*v.shape[:-1], width)))
    parts = []
    for probe in probes:
        out = ctx.run(probe).to(torch.float64)
        with ctx.naming_the_row(probe):
            # judged(): NaN in the rows a sampled oracle does not know (its value is 0)
            _finite_where_the_oracle_is(out, ctx.expect(probe).judged(), "the weights (V = I)")
        parts.append(out)
    weights = torch.cat(parts, dim=-1)[..., :Tk]  # (*batch, h, Tq, Tk): w_ij
    seen = inputs.visible()
    eps = torch.finfo(v.dtype).eps
    # first, what is judged must be softcap: a hidden key with weight is a mask not
    # applied, whatever the scores, and the bound below would blame the cap for it
    exact = ctx.expect(probes[0])
    hidden = ~seen & (weights.abs() > exact.bounds()[0] + eps) & inputs.visible().any(-1, True)
    if bool(hidden.any()):
        where = tuple(int(i) for i in hidden.nonzero()[0])
        w = float(weights[where])
        probe = probes[where[-1] // width]
        why = _why_hidden(ctx, probe, where)
        hider = "the mask"  # a mask, or the diagonal passed in one
        if why in ("the causal diagonal hides it", "the window hides it"):
            hider = why.removesuffix(" hides it")
        # the culprit: the same call without softcap and with zero queries (every score
        # 0, so a key left unhidden has a weight near 1/Tk, however far the scores
        # were) tells a mask never applied from one that softcap's path drops
        zero_q = replace(probe, query=torch.zeros_like(probe.query), softcap=0.0)
        plain = ctx.run(zero_q, oracle=False).to(torch.float64)
        w0 = float(plain[(*where[:-1], where[-1] % width)])
        culprit = (
            f"{hider} is not applied, with or without softcap (weight {w0:.4g} without it)"
            if abs(w0) > exact.bounds()[0] + eps
            else f"{hider} is not applied under softcap (weight {w0:.4g} without it)"
        )
        raise Failure(
            f"softcap {c:g}: key {where[-1]} is hidden from query {where[-2]} "
            f"({why}) but has weight {w:.4g}: {culprit}; {int(hidden.sum())} hidden "
            f"(query, key) pairs have weight; first at {where}",
            got=w,
            expected=0.0,
            where=where,
        )
    n = seen.sum(dim=-1, keepdim=True).clamp(min=1).to(torch.float64)
    rel = 4 * eps + 4 * max(ctx.expect(p).floor for p in probes)  # w's rounding, the scores
    lo = math.exp(-2 * c) / n * (1 - rel)
    hi = math.exp(2 * c) / n * (1 + rel) + eps
    bad = seen & ~((weights >= lo) & (weights <= hi))
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        w = float(weights[where])
        count = int(n[where[:-1]].item())
        raise Failure(
            f"softcap {c:g}: weight {w:.4g} of key {where[-1]} for a query that sees "
            f"{count} keys lies outside ({math.exp(-2 * c) / count:.4g}, "
            f"{math.exp(2 * c) / count:.4g}): some effective score is outside (-c, c); "
            f"first at {where}",
            got=w,
            expected=math.exp(2 * c) / count,
            where=where,
        )


def _why_hidden(ctx: Context, inputs: Inputs, where: tuple[int, ...]) -> str:
    """What hides key ``where[-1]`` from query ``where[-2]``: the mask, the causal
    diagonal, the window."""
    mask = inputs.attn_mask
    if mask is not None:
        entry = mask.expand(*inputs.query.shape[:-1], inputs.key.shape[-2])[where]
        if (not bool(entry)) if entry.dtype == torch.bool else bool(torch.isinf(entry)):
            kind = "boolean" if mask.dtype == torch.bool else "float"
            return f"a {kind} mask hides it"
    if inputs.causal is not None:
        if not ctx.native(inputs):
            return "the causal diagonal, passed to the backend as a boolean mask, hides it"
        return "the causal diagonal hides it"
    return "the window hides it"


def sink_law(ctx: Context, case: Case) -> None:
    """``out(sinks) = out(no sinks) * sigmoid(lse - sigma)``, and a sink of ``-inf`` is
    no sink. The factor comes from the oracle's LSE, exactly: the law relates two calls
    of the backend. To a backend that takes sinks on every call (``sinks_required``),
    no sink is a sink of ``-inf``."""
    inputs = ctx.build(case)
    assert inputs.sinks is not None
    sinks = inputs.sinks
    takes_minus_inf = not ctx.caps.sink_values or -math.inf in ctx.caps.sink_values
    if ctx.caps.sinks_required and not takes_minus_inf:
        raise Skip("no call without a sink: sinks on every call, and -inf not among them")
    no_sink = torch.full_like(sinks, -math.inf) if ctx.caps.sinks_required else None
    plain = replace(inputs, sinks=no_sink)
    base = ctx.run(plain)
    lse = expect_lse(plain.to(torch.float64), rows=ctx.rows(plain)).value  # (*batch, h, Tq)
    factor = torch.sigmoid(lse - sinks.to(torch.float64)[:, None]).unsqueeze(-1)
    seen = _rows(~empty_rows(inputs).squeeze(-1))  # rows with no key: the policy's value
    law(
        ctx,
        ctx.run(inputs),
        inputs,
        base,
        plain,
        "output with sinks against out * sigmoid(lse - sink)",
        transform=lambda out: out * factor,
        sel=seen,
        # a sink of -inf (no sink, to a backend that takes one on every call) leaves a
        # row that sees no key to a policy the declaration, made for its sinks, does
        # not give: the empty-row property judges those rows
        base_finite=seen if ctx.caps.sinks_required else None,
    )
    if not takes_minus_inf or ctx.caps.sinks_required:
        return  # a sink of -inf is not among those declared, or was the base call
    none = replace(inputs, sinks=torch.full_like(sinks, -math.inf))
    law(ctx, ctx.run(none), none, base, plain, "a sink of -inf against no sink")


def lse(ctx: Context, case: Case) -> None:
    """The log-sum-exp agrees with the oracle's (natural log, over the visible keys, the
    sink not in it), with the declared value for a query with no visible key; and the
    output returned with it agrees too."""
    inputs = ctx.build(case)
    out, got = ctx.run_lse(inputs)
    exp = ctx.expect(inputs)
    with ctx.naming_the_row(inputs):
        what = "output returned with the LSE"
        close(
            out.to(torch.float64), exp.value, *exp.bounds(), what, exp.known, semantic=exp.semantic
        )
    want = ctx.expect_lse(inputs)
    got64 = got.to(torch.float64)
    finite = torch.isfinite(want.value)
    wrong = ~finite & (got64 != want.value)
    if bool(wrong.any()):
        where = tuple(int(i) for i in wrong.nonzero()[0])
        raise Failure(
            f"log-sum-exp: {int(wrong.sum())} queries with no visible key hold "
            f"{float(got64[where])}, the declared policy is {ctx.caps.empty_lse}; first at "
            f"{where}",
            got=float(got64[where]),
            expected=float(want.value[where]),
            where=where,
        )
    with ctx.naming_the_row(inputs):
        close(got64, want.value, *want.bounds(finite), "log-sum-exp", sel=want.sel(finite))


def merge(ctx: Context, case: Case) -> None:
    """Attention over a random split of the keys into two parts (either may be empty,
    for a row or for all), merged by `attnref.functional.merge_attention` from each
    part's output and LSE, equals attention over all of them; a sink counts once, after
    the merge."""
    inputs = ctx.build(case)
    gen = rng(case, 9)
    k = inputs.key
    Tk = k.shape[-2]
    share = float(torch.rand((), generator=gen))
    block = ctx.caps.length_multiples[1]  # a part's keys: whole blocks where declared
    first = (torch.rand(-(-Tk // block), generator=gen) < share).repeat_interleave(block)[:Tk]
    dv = inputs.value.shape[-1]
    shape = (*inputs.query.shape[:-1], dv)
    merged = torch.zeros(shape, dtype=torch.float64, device=k.device)
    merged_lse = torch.full(shape[:-1], -math.inf, dtype=torch.float64, device=k.device)
    bound_max = bound_mean = 0.0
    for part in (first, ~first):
        keep = part.nonzero().squeeze(-1).to(k.device)
        if keep.numel() == 0:
            continue  # an empty part: output 0, LSE -inf, nothing to call
        mask = inputs.attn_mask
        if mask is not None and mask.shape[-1] == Tk:
            mask = mask[..., keep]
        sub = replace(
            inputs,
            key=k[..., keep, :],
            value=inputs.value[..., keep, :],
            attn_mask=mask,
            sinks=None,
        )
        out, got = ctx.run_lse(sub)
        got64 = got.to(torch.float64)
        if ctx.caps.empty_lse == "+inf":
            got64 = got64.masked_fill(torch.isposinf(got64), -math.inf)
        if bool(torch.isnan(got64).any()) or bool(torch.isposinf(got64).any()):
            raise Failure(
                f"the log-sum-exp over {keep.numel()} of the {Tk} keys holds NaN/inf values "
                "(+inf, or NaN, where a finite value or -inf is expected)"
            )
        merged, merged_lse = F.merge_attention(merged, merged_lse, out.to(torch.float64), got64)
        e = ctx.expect(sub)
        el = ctx.expect_lse(sub)
        pmax, pmean = e.bounds()
        lmax, lmean = el.bounds(torch.isfinite(el.value))
        vmax = float(sub.value.abs().max()) if sub.value.numel() else 0.0
        bound_max += pmax + 2 * lmax * vmax
        bound_mean += pmean + 2 * lmean * vmax
    if inputs.sinks is not None:
        merged = F.apply_sinks(merged, merged_lse, inputs.sinks)
    full = ctx.expect(inputs)
    fmax, fmean = full.bounds()
    seen = full.sel(_rows(~empty_rows(inputs).squeeze(-1)))
    with ctx.naming_the_row(inputs):
        close(
            merged,
            full.value,
            bound_max + fmax,
            bound_mean + fmean,
            f"two parts of {int(first.sum())} and {int((~first).sum())} keys, merged",
            sel=seen,
            semantic=full.semantic,
        )
