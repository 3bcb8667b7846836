"""What a shrunk failing case needs: the features it cannot lose and still fail.

A cause is what a shrunk case isolates. One kernel can ignore ``softmax_scale`` and get
the causal alignment wrong when Tq != Tk: both show as wrong values, and grouped by their
message alone they were one finding (IPEX's varlen attention, 32 failures, one shrunk
case). So each shrunk case is checked again with each of its features taken away, one
at a time: a feature it fails without is not what the failure needs; one it passes
without (or that the property cannot do without) is. Findings whose cases need different
features are different findings (`attnref.conformance.report.AuditReport.findings`).
"""

from collections.abc import Callable
from dataclasses import replace

from attnref.conformance.cases import Case
from attnref.conformance.properties import Context, Property
from attnref.conformance.strategies import inside
from attnref.conformance.verdicts import Failure, cause_key, cause_of

__all__ = ["FEATURES", "needs"]


def _unequal(case: Case) -> bool:
    if case.causal is None:
        return False
    if case.seqlens:
        return any(tq != tk for tq, tk in case.seqlens)
    return not case.cached and case.Tq != case.Tk


def _equal(case: Case) -> Case:
    if case.seqlens:
        return replace(case, seqlens=tuple((tk, tk) for _, tk in case.seqlens))
    return replace(case, Tq=case.Tk)


#: (what a case needs, whether it has it, the case without it): the features a shrunk
#: case is checked without
FEATURES: tuple[tuple[str, Callable[[Case], bool], Callable[[Case], Case]], ...] = (
    ("an explicit scale", lambda c: c.scale is not None, lambda c: replace(c, scale=None)),
    ("causal with Tq != Tk", _unequal, _equal),
    ("a mask", lambda c: c.mask != "none", lambda c: replace(c, mask="none", poison="none")),
    ("a window", lambda c: c.window is not None, lambda c: replace(c, window=None)),
    ("softcap", lambda c: c.softcap > 0, lambda c: replace(c, softcap=0.0)),
    ("ALiBi", lambda c: c.alibi != "none", lambda c: replace(c, alibi="none")),
    ("sinks", lambda c: c.sinks, lambda c: replace(c, sinks=False, sink=None)),
    ("GQA", lambda c: c.g != c.h and not c.latent, lambda c: replace(c, g=c.h)),
    ("Dv != Dqk", lambda c: c.Dv != c.Dh and not c.latent, lambda c: replace(c, Dv=c.Dh)),
)


def needs(
    prop: Property, ctx: Context, case: Case, failure: Failure, dtype: str
) -> tuple[str, ...]:
    """The features of ``case`` (its shrunk failing case) that ``failure`` needs: each
    taken away in turn, the case checked again; a feature is needed where the check then
    passes, is skipped (the property cannot do without it), or fails of another cause.
    Only a failure of values (wrong, NaN, a policy) is checked again: an exception's
    message names its cause, and a crash or a hang may not repeat alone."""
    if failure.fatal or failure.kind not in ("error", "nan", "policy"):
        return ()
    key = cause_key(cause_of(failure, dtype))
    found = []
    for name, has, without in FEATURES:
        if not has(case):
            continue
        other = without(case)
        if ctx.caps.narrow():  # still inside the declaration (sinks on every call, ...)
            other = inside(other, ctx.caps)
        if other == case:
            found.append(name)  # the declaration does not let it go
            continue
        try:
            prop.check(ctx, other)
        except Failure as f:
            if cause_key(cause_of(f, dtype)) == key:
                continue  # it fails the same without it: not what it needs
        except Exception:  # skipped, or a case the property cannot take: needed
            pass
        found.append(name)
    return tuple(found)
