"""What a shrunk failing case needs: the features it cannot lose and still fail.

A cause is what a shrunk case isolates. One kernel can ignore ``softmax_scale`` and get
the causal alignment wrong when Tq != Tk: both show as wrong values, and grouped by their
message alone they were one finding (IPEX's varlen attention, 32 failures, one shrunk
case). So each shrunk case is checked again with each of its features
(`attnref.conformance.findings.FEATURES`) taken away, one at a time: a feature it passes
without is what the failure needs, and the finding's trigger
(`attnref.conformance.findings.group`).

Only a re-run that passes says a feature is needed, and it is run twice: a backend that
returns garbage (uninitialised memory) passes or fails by chance, and one lucky pass
would name a feature the bug does not need. A re-run that is skipped (the property
cannot do without the feature) or fails of another cause says nothing of the bug. Plain
``is_causal`` is a feature too, so that a trigger of two (causal with a mask) shows as
both.
"""

from attnref.conformance.cases import Case
from attnref.conformance.findings import FEATURES, IMPLIED
from attnref.conformance.properties import Context, Property
from attnref.conformance.strategies import inside
from attnref.conformance.verdicts import Failure

__all__ = ["needs"]


def needs(prop: Property, ctx: Context, case: Case, failure: Failure) -> tuple[str, ...]:
    """The features of ``case`` (its shrunk failing case) that ``failure`` needs: each
    taken away in turn, the case checked again; a feature is needed where the check then
    passes, twice. Only a failure of values (wrong, NaN, a policy) is checked again: an
    exception's message names its cause, and a crash or a hang may not repeat alone."""
    if failure.fatal or failure.kind not in ("error", "nan", "policy"):
        return ()
    found = []
    for name, has, without in FEATURES:
        if not has(case):
            continue
        other = without(case)
        if ctx.caps.narrow():  # still inside the declaration (sinks on every call, ...)
            other = inside(other, ctx.caps)
        if other == case:
            continue  # the declaration does not let it go: nothing learnt
        if _passes(prop, ctx, other) and _passes(prop, ctx, other):
            found.append(name)
    return _without_implied(found)


def _without_implied(found: list[str]) -> tuple[str, ...]:
    """``found`` less the names another in it implies (causal, beside causal with Tq !=
    Tk)."""
    implied = {IMPLIED[n] for n in found if n in IMPLIED}
    return tuple(n for n in found if n not in implied)


def _passes(prop: Property, ctx: Context, case: Case) -> bool:
    """Whether ``prop`` passes on ``case``: a skip or a failure of any kind is not a
    pass."""
    try:
        prop.check(ctx, case)
    except Exception:  # a Failure, a Skip, or a case the property cannot take
        return False
    return True
