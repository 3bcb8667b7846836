"""What the checks of packed and paged calls share: judging per-part results.

A family whose call answers for several dense inputs at once (each sequence of a pack,
each batch row of a decode call, `attnref.conformance.serving`) judges each part as the
dense inputs it amounts to, against the same oracle and with the same bounds as a dense
call (`Context.expect`); its laws compare two calls with `attnref.conformance.checks.law`.
The families' own checks are in their modules (`attnref.conformance.families`).
"""

from dataclasses import replace

import torch
from jaxtyping import Float
from torch import Tensor

from attnref._checking import checked_internal
from attnref.conformance.calls import check_lse, check_output, skip_reason
from attnref.conformance.cases import Inputs
from attnref.conformance.checks import Context
from attnref.conformance.oracle import Expected, close, expect_lse
from attnref.conformance.verdicts import Skip
from attnref.tolerances import score_condition

__all__ = ["Results", "agree", "expect_rotated", "guard", "judge", "rotation_slack", "with_lses"]

Results = tuple[list[Tensor], list[Tensor] | None]


@checked_internal
def judge(
    outs: list[object], lses: list[object] | None, like: tuple[Inputs, ...]
) -> tuple[list[Float[Tensor, "..."]], list[Float[Tensor, "..."]] | None]:
    """Each part checked for type, shape, dtype and device, as a dense output is."""
    checked = [
        check_output(o, (*x.query.shape[:-1], x.value.shape[-1]), x).detach()
        for o, x in zip(outs, like, strict=True)
    ]
    if lses is None:
        return checked, None
    return checked, [check_lse(lse, x) for lse, x in zip(lses, like, strict=True)]


def with_lses(
    parts: tuple[list[object], list[object] | None],
) -> tuple[list[object], list[object | None]]:
    """A reader's (outputs, LSEs or None) as outputs and an LSE or None for each: what
    `attnref.conformance.calls.note_reading` pairs with the parts' inputs."""
    outs, lses = parts
    return outs, list(lses) if lses is not None else [None] * len(outs)


def guard(ctx: Context, first: Inputs, kwargs: dict[str, object]) -> None:
    """`Skip` if the backend declares it does not take this call."""
    reason = skip_reason(ctx.backend, first, kwargs)
    if reason is not None:
        raise Skip(reason)


def rotation_slack(x: Inputs, output: bool = True) -> float:
    """What rounding the rotated queries and keys may move a score by: a relative ``u``
    in each moves it by ``2 u kappa`` (over the query-key pairs that are seen; garbage a
    window hides never counts). The LSE moves by as much; with ``output``, the softmax
    passes it on to an output scaled by ``max|V|`` of the keys seen."""
    if x.query.dtype == torch.float64 or x.key.numel() == 0 or x.query.numel() == 0:
        return 0.0
    u = torch.finfo(x.query.dtype).eps / 2
    visible = x.visible()  # (h, Tq, Tk)
    seen = visible.any(dim=-2).any(dim=0)  # (Tk,)
    if not bool(seen.any()):
        return 0.0
    score = 2 * u * score_condition(x.query, x.key, x.scale, visible)
    if not output:
        return score
    v = float(x.value[..., seen, :].double().abs().max()) if x.value.shape[-1] else 0.0
    return score * max(v, 1.0)


def expect_rotated(ctx: Context, x: Inputs, rotated: bool) -> Expected:
    """``x``'s oracle; for rotated inputs with the rounding of the rotation added, and
    kept as ``x``'s oracle for the rest of the check (a law on ``x`` uses it too)."""
    exp = ctx.expect(x)
    if not rotated or exp.derived:
        return exp
    slack = rotation_slack(x)
    exp = replace(exp, floor=exp.floor + slack, derived=slack)
    ctx.keep(x, exp)
    return exp


@checked_internal
def agree(
    ctx: Context,
    outs: list[Float[Tensor, "..."]],
    lses: list[Float[Tensor, "..."]] | None,
    like: tuple[Inputs, ...],
    what: str,
    rotated: bool = False,
) -> None:
    """Every part against its oracle: the output, and the LSE when there is one."""
    for n, (out, x) in enumerate(zip(outs, like, strict=True)):
        Tq, Tk = x.query.shape[-2], x.key.shape[-2]
        label = f"{what} {n} (Tq = {Tq}, Tk = {Tk})"
        exp = expect_rotated(ctx, x, rotated)
        with ctx.naming_the_row(x):
            close(
                out.to(torch.float64),
                exp.value,
                *exp.bounds(),
                f"{label}: output",
                semantic=exp.semantic,
            )
        if lses is not None:
            el = expect_lse(x, ctx.caps.empty_lse, with_sink=ctx.caps.lse_with_sink)
            if rotated:
                el = replace(el, floor=el.floor + rotation_slack(x, output=False))
            ctx.keep_lse(x, el)
            close(lses[n].to(torch.float64), el.value, *el.bounds(), f"{label}: log-sum-exp")
