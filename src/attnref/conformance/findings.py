"""Failures grouped into findings: one bug, one finding.

A finding is one cause: its symptom on the failing rows (wrong values, NaN, a policy
broken, a precision loss, an exception, a crash, a hang), the smallest trigger the
shrinker found (the features its shrunk case needs, `attnref.conformance.needs`), and
every failing (property, dtype) that shows the same symptom on a case the trigger
explains, as its variations. Grouped by the failing case alone, one bug came out as many
findings: ExecuTorch's "a mask with ``is_causal``" as 18, one dropped tail block as 12,
one "a query with no visible key gives NaN" as 5.

The rules, in the order `group` applies them:

- The symptom is the failure's cause (`attnref.conformance.verdicts.cause_of`) without
  the rows it names: a failure whose message names no row (a law's, a gradient's, an
  attack check's) joins one that names them. Rows that see no key stay apart from rows
  that see keys, where both are named.
- A trigger explains a failure when the failure's case has every feature the trigger
  needs. A failure joins the finding with the same symptom whose trigger explains it,
  the most specific one first; rows that see no key are one finding whatever emptied
  them (a mask, the causal diagonal, a window).
- Triggers are compared as the backend got the call: a causal diagonal it does not
  compute itself reached it as a mask (`as_called`), and a trigger that holds another
  is that one's variation (`_absorbed`).
- A precision loss in one dtype joins a finding of wrong values in a property that
  failed so in another dtype: the same bug, seen through a coarser rounding.
- The precision miss a search met on its way to a semantic failure
  (`PropertyResult.also`) is part of that search's finding, not a finding of its own.
"""

import builtins
import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Generic, Protocol, TypeVar, overload

from attnref.conformance.cases import Case
from attnref.conformance.declarations import Capabilities
from attnref.conformance.verdicts import cause_key, shorten

__all__ = [
    "FEATURES",
    "IMPLIED",
    "as_called",
    "features_of",
    "group",
    "implied",
    "symptom_of",
]


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
    ("causal", lambda c: c.causal is not None, lambda c: replace(c, causal=None)),
    ("causal with Tq != Tk", _unequal, _equal),
    ("a mask", lambda c: c.mask != "none", lambda c: replace(c, mask="none", poison="none")),
    ("a window", lambda c: c.window is not None, lambda c: replace(c, window=None)),
    ("softcap", lambda c: c.softcap > 0, lambda c: replace(c, softcap=0.0)),
    ("ALiBi", lambda c: c.alibi != "none", lambda c: replace(c, alibi="none")),
    ("sinks", lambda c: c.sinks, lambda c: replace(c, sinks=False, sink=None)),
    ("GQA", lambda c: c.g != c.h and not c.latent, lambda c: replace(c, g=c.h)),
    ("Dv != Dqk", lambda c: c.Dv != c.Dh and not c.latent, lambda c: replace(c, Dv=c.Dh)),
)


#: what the name of a second feature makes redundant in a list of needs
IMPLIED = {"causal with Tq != Tk": "causal"}


def implied(needs: tuple[str, ...]) -> frozenset[str]:
    """``needs`` with what each implies (causal with Tq != Tk: causal), for comparing
    triggers: a list of needs leaves out what another of its names implies."""
    return frozenset(needs) | {IMPLIED[n] for n in needs if n in IMPLIED}


def features_of(case: Case) -> frozenset[str]:
    """The names of the `FEATURES` that ``case`` has: what a trigger found on another
    case must be among for this case's failure to be explained by it."""
    return frozenset(name for name, has, _ in FEATURES if has(case))


#: how `cause_of` names the failing rows
_ROWS = re.compile(r" in rows that see (no key(?: \(declared policy '\w+'\))?|keys)")
#: the key of every failure in rows that see no key, whatever its symptom
NO_KEY = "in rows that see no key"
#: how `cause_of` names a precision loss
PRECISION = "precision loss"


def symptom_of(cause: str) -> tuple[str, str]:
    """``cause`` as (its symptom without the rows, which rows: ``"no key"``, ``"keys"``
    or ``""`` where it names none)."""
    found = _ROWS.search(cause)
    if found is None:
        return cause, ""
    rows = "no key" if found.group(1).startswith("no key") else "keys"
    return cause[: found.start()] + cause[found.end() :], rows


class _Found(Protocol):
    """What grouping reads of a finding (`attnref.conformance.report.Finding`)."""

    @builtins.property
    def cause(self) -> str: ...
    @builtins.property
    def needs(self) -> tuple[str, ...]: ...
    @builtins.property
    def case(self) -> Case: ...


class _Result(Protocol):
    """What grouping reads of a result (`attnref.conformance.report.PropertyResult`)."""

    @builtins.property  # (``property`` is a field's name here)
    def property(self) -> str: ...
    @builtins.property
    def dtype(self) -> object: ...
    @builtins.property
    def status(self) -> str: ...
    @builtins.property
    def message(self) -> str: ...
    @builtins.property
    def finding(self) -> _Found | None: ...


R = TypeVar("R", bound=_Result)


@dataclass
class _Group(Generic[R]):
    key: str
    rows: str
    #: the trigger its first member found (none for rows that see no key: what emptied
    #: them is a variation)
    needs: tuple[str, ...]
    members: list[R] = field(default_factory=list)
    #: its members' symptoms (`cause_key`): a `NO_KEY` group's hold several
    kinds: set[str] = field(default_factory=set)

    def explains(self, rows: str, features: frozenset[str]) -> bool:
        if rows and self.rows and rows != self.rows:
            return False
        return self.rows == "no key" or implied(self.needs) <= features


def _cause(result: _Result) -> str:
    f = result.finding
    return f.cause if f is not None and f.cause else result.message


def group(results: list[R], caps: Capabilities | None = None) -> list[tuple[str, list[R]]]:
    """The failing ``results`` as findings: (title, members), the member that made the
    finding first (its smallest trigger), most members first, then in audit order.
    ``caps``: the backend's declaration, by which a causal diagonal it does not compute
    itself reaches it as a mask (`as_called`)."""
    failed = [r for r in results if r.status == "fail"]
    order = {id(r): i for i, r in enumerate(failed)}

    def needs_of(r: _Result) -> tuple[str, ...]:
        if r.finding is None:
            return ()
        return as_called(r.finding.needs, r.finding.case, caps)

    def present(case: Case) -> frozenset[str]:  # its features as the backend got them
        found = features_of(case)
        found = found | {"a mask"} if not _native(case, caps) else found
        return _indexed(found, caps)

    def rank(r: R) -> tuple[int, int, int]:
        # named rows first (their trigger is known), then the most specific trigger
        _, rows = symptom_of(_cause(r))
        return (rows == "", -len(needs_of(r)), order[id(r)])

    groups: list[_Group[R]] = []
    for r in sorted(failed, key=rank):
        cause = _cause(r)
        symptom, rows = symptom_of(cause)
        # rows that see no key are one decision of the kernel's, whatever it put there
        # (NaN in some, wrong finite values in others: one planted kernel, two findings)
        key = NO_KEY if rows == "no key" else cause_key(symptom)
        needs = needs_of(r)
        features = frozenset() if r.finding is None else present(r.finding.case)
        kind = cause_key(symptom)
        same = [
            g
            for g in groups
            if (g.key == key or (not rows and g.key == NO_KEY and kind in g.kinds))
            and g.explains(rows, features)
        ]
        if not same and key.startswith(PRECISION):
            # the same property wrong in another dtype: that bug, rounded more coarsely
            same = [g for g in groups if _is_wrong(g.key) and _has(g, r.property)]
        if same:
            best = max(same, key=lambda g: len(g.needs))
            if not _has(best, r.property, r.dtype):
                best.members.append(r)
            best.kinds.add(kind)
            if not best.rows:
                best.rows = rows
            continue
        groups.append(_Group(key, rows, () if rows == "no key" else needs, [r], {kind}))
    groups = _absorbed(_precision_joined(groups))
    found = []
    for g in groups:  # the head first (the smallest trigger), the variations in audit order
        named = [
            m
            for m in g.members
            if set(g.needs) <= set(needs_of(m)) and symptom_of(_cause(m))[1] == g.rows
        ]
        head = min(named or g.members, key=lambda m: (len(needs_of(m)), _size(m), order[id(m)]))
        rest = sorted((m for m in g.members if m is not head), key=lambda m: order[id(m)])
        need = needs_of(head)
        title = _cause(head) + (f" (its smallest trigger needs {', '.join(need)})" if need else "")
        found.append((shorten(title), [head, *rest]))
    found.sort(key=lambda item: (-len(item[1]), order[id(item[1][0])]))
    return found


def _absorbed(groups: list[_Group[R]]) -> list[_Group[R]]:
    """``groups`` with each whose trigger holds another's (a mask with causal Tq != Tk
    beside causal alone) merged into that one: the larger trigger is a variation of the
    smaller. An empty trigger holds in every case: a bug that shows on a case with none
    of the features (strides ignored, no max subtracted) is the one bug its re-runs
    without a feature happened to pass on elsewhere."""
    kept: list[_Group[R]] = []
    for g in sorted(groups, key=lambda g: len(implied(g.needs))):
        into = [
            k
            for k in kept
            if k.key == g.key
            and implied(k.needs) < implied(g.needs)
            and (not g.rows or not k.rows or g.rows == k.rows)
        ]
        if into:
            best = max(into, key=lambda k: len(k.needs))
            best.members += [m for m in g.members if not _has(best, m.property, m.dtype)]
        else:
            kept.append(g)
    return kept


def _precision_joined(groups: list[_Group[R]]) -> list[_Group[R]]:
    """``groups`` with each precision loss merged into a wrong-values group whose trigger
    is its own, or empty: a kernel that scales by the wrong head dim where Dv != Dqk is
    off by a rounding's size in some bfloat16 cases and far off elsewhere, one bug (it
    came out as two findings, both needing Dv != Dqk); one that accumulates in half
    precision past 512 keys is wrong with no feature needed, and off by a rounding's
    size in other dtypes and cases (it came out as five)."""
    wrong = [g for g in groups if _is_wrong(g.key)]
    kept = []
    for g in groups:
        into = [
            w
            for w in wrong
            if g.key.startswith(PRECISION)
            # its own trigger; or none, where a property shows both (a bug that shows
            # without any feature, at a rounding's size in some cases: the precision
            # losses' triggers are then re-runs that passed by chance)
            and (
                (g.needs and implied(w.needs) == implied(g.needs))
                or (not w.needs and any(_has(w, m.property) for m in g.members))
            )
            and (not g.rows or not w.rows or g.rows == w.rows)
        ]
        if into:
            into[0].members += [m for m in g.members if not _has(into[0], m.property, m.dtype)]
        else:
            kept.append(g)
    return kept


def _native(case: Case, caps: Capabilities | None) -> bool:
    """Whether the backend computes ``case``'s causal diagonal itself (else the audit
    passes it folded into a boolean mask: `Capabilities.causal_alignments`,
    ``causal_with_mask``, ``causal_square_only``)."""
    if case.causal is None or caps is None:
        return True
    if case.causal not in caps.causal_alignments:
        return False
    if case.mask != "none" and not caps.causal_with_mask:
        return False
    return not (caps.causal_square_only and case.Tq != case.Tk)


def as_called(needs: tuple[str, ...], case: Case, caps: Capabilities | None) -> tuple[str, ...]:
    """``needs`` as the backend was called: where it does not compute the case's causal
    diagonal itself, the diagonal reached it as a mask, and "causal" is "a mask" (an
    inverted mask needed "causal" in one case and "a mask" in another: one trigger)."""
    if _native(case, caps) or not ({"causal", "causal with Tq != Tk"} & set(needs)):
        return tuple(_indexed(needs, caps))
    kept = [n for n in needs if n not in ("causal", "causal with Tq != Tk")]
    return tuple(_indexed(("a mask", *kept), caps))


#: the features a key hidden from a query amounts to in an indexed family (one whose
#: `attnref.conformance.family.Convention.indexed` is set: its kernels get masks, the
#: causal diagonal and windows as the indices they leave out)
HIDING = ("causal", "causal with Tq != Tk", "a mask", "a window")
#: what they reach such a kernel as
LEFT_OUT = "keys left out of the indices"


@overload
def _indexed(needs: frozenset[str], caps: Capabilities | None) -> frozenset[str]: ...
@overload
def _indexed(needs: tuple[str, ...], caps: Capabilities | None) -> tuple[str, ...]: ...
def _indexed(
    needs: frozenset[str] | tuple[str, ...], caps: Capabilities | None
) -> frozenset[str] | tuple[str, ...]:
    """``needs`` as a kernel of an indexed family gets them: a mask, the causal diagonal
    and a window are each keys left out of its indices (a planted kernel that read an
    invalid entry as row 0 needed "a mask" in one case, "causal" in the next: one bug)."""
    if caps is None or not set(HIDING) & set(needs) or not _is_indexed(caps.family):
        return needs
    kept = [LEFT_OUT if n in HIDING else n for n in needs]
    if isinstance(needs, frozenset):
        return frozenset(kept)
    return tuple(dict.fromkeys(kept))


def _is_indexed(name: str) -> bool:
    """Whether the family called ``name`` names the keys of each query by indices (an
    unknown name: not). The families are installed here, not imported at the top: the
    engine imports no family, and a report read back from JSON is grouped with none
    installed yet."""
    importlib.import_module("attnref.conformance.backends")  # installs the families
    from attnref.conformance.family import FAMILIES

    family = FAMILIES.get(name)
    return family is not None and family.indexed


def _size(r: _Result) -> int:
    """How big ``r``'s shrunk case is (queries x keys x heads x batch): the smaller of
    two triggers is the one a reader takes in first."""
    if r.finding is None:
        return 0
    c = r.finding.case
    return math.prod(c.batch) * c.h * c.Tq * c.Tk


def _is_wrong(key: str) -> bool:
    return key.startswith("wrong values")


def _has(g: _Group[R], prop: str, dtype: object = None) -> bool:
    return any(m.property == prop and (dtype is None or m.dtype == dtype) for m in g.members)
