"""The float64 oracle and the pass/fail rule.

The oracle is the reference computed in float64 from the case's inputs (already rounded
to the case's dtype, then upcast). A backend's output passes when

    max|out - oracle|  <= max(floor, FUDGE * max|reference_same_dtype - oracle|)
    mean|out - oracle| <= max(floor, FUDGE * mean|reference_same_dtype - oracle|)

with ``floor = max(atol[dtype], (eps * kappa + 2 u) * max|V|)`` (`error_floor`), and it
has no NaN or inf where the oracle is finite. Gradients follow the same rule with
``GRAD_FUDGE`` and a floor set by the size of the terms each gradient entry sums
(`expect_grads`). Constants and the reasoning behind the floors: `attnref.tolerances`.

Rows of a query with no visible key hold what the backend's declared policy says for
what hid the keys (`empty_row_causes`): zeros, NaN, the mean of V, or attention over
the keys the mask hid ("unmasked", a finite fill added to the scores).
"""

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from jaxtyping import Bool, Float, Float64, Int
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked, checked_internal
from attnref.conformance.cases import Inputs
from attnref.conformance.declarations import Cause, EmptyLse, EmptyRow, EmptyRows
from attnref.conformance.verdicts import Failure
from attnref.masks import causal_block, causal_mask, causal_offset, window_block
from attnref.tolerances import (
    FUDGE,
    GRAD_FUDGE,
    attention_atol,
    score_condition,
    score_eps,
    score_rounding,
    tolerance,
)

__all__ = [
    "Expected",
    "at_rows",
    "close",
    "empty_row_causes",
    "error_floor",
    "expect",
    "expect_grads",
    "expect_lse",
    "expect_sink_grad",
    "one_key_off",
    "policy_rows",
    "reference",
    "reference_lse",
]


def _variants(inputs: Inputs) -> dict[str, Any]:
    """The keyword arguments of the reference for the variants ``inputs`` turn on."""
    return {
        "causal_alignment": inputs.alignment,
        "window": inputs.window,
        "softcap": inputs.softcap,
        "alibi_slopes": inputs.alibi_slopes,
        "sinks": inputs.sinks,
    }


def _reference(inputs: Inputs, **extra: Any) -> Any:
    return F.scaled_dot_product_attention(
        inputs.query,
        inputs.key,
        inputs.value,
        inputs.attn_mask,
        is_causal=inputs.causal is not None,
        scale=inputs.scale,
        enable_gqa=inputs.enable_gqa,
        **_variants(inputs),
        **extra,
    )


@checked
def reference(inputs: Inputs) -> Float[Tensor, "*batch h Tq Dv"]:
    """The reference's output for ``inputs``, in their dtype (float64 inputs: the oracle)."""
    out: Tensor = _reference(inputs)
    return out


@checked
def reference_lse(inputs: Inputs) -> Float[Tensor, "*batch h Tq"]:
    """The reference's log-sum-exp for ``inputs`` (float32; float64 for float64 inputs)."""
    lse: Tensor = _reference(inputs, return_lse=True)[1]
    return lse


def _bias_bound(inputs: Inputs) -> float:
    """The largest ALiBi bias ``m * |i + off - j|``: rounding it moves a score too."""
    if inputs.alibi_slopes is None:
        return 0.0
    Tq, Tk = inputs.query.shape[-2], inputs.key.shape[-2]
    return float(inputs.alibi_slopes.abs().max()) * (Tq + Tk)


def error_floor(inputs: Inputs, rows: Inputs | None = None) -> float:
    """``max(atol[dtype], (eps * kappa + 2 u) * max|V|)`` over the visible query-key pairs:
    the error no correct backend can avoid (see `attnref.tolerances.attention_atol`),
    with the ALiBi bias counted in ``kappa``. A softcap only shrinks score errors.
    ``rows``: the floor of these rows only (`at_rows`: a sample of ``inputs``' rows)."""
    part = inputs if rows is None else rows
    floor = attention_atol(part.query, part.key, part.value, part.scale, visible=part.visible())
    bias = _bias_bound(inputs)
    if bias and inputs.value.numel():
        v = torch.nan_to_num(inputs.value.detach().to(torch.float64), nan=0.0, posinf=0.0)
        floor += score_eps(inputs.query.dtype) * bias * float(v.abs().max())
    return floor


@dataclass(frozen=True)
class Expected:
    """What a correct backend returns for some inputs, and how far it may stray.

    ``value`` is float64 (NaN where the declared policy expects NaN); ``ref_err`` is the
    reference's own error in the case's dtype, elementwise; ``fudge`` and ``floor`` turn
    it into bounds.
    """

    value: Tensor
    ref_err: Tensor
    floor: float
    fudge: float = FUDGE
    #: the part of ``floor`` added for a rounding the backend makes of inputs it derives
    #: itself (rotary: `attnref.conformance.serving_checks`), 0 when none was
    derived: float = 0.0
    #: broadcastable to ``value`` (``(Tq, 1)`` for a long case's sampled rows, `expect`'s
    #: ``rows``; ``value``'s shape where a declaration leaves some rows undefined): the
    #: entries the oracle holds a backend to; ``value`` and ``ref_err`` are 0 in the
    #: others, which no comparison reads. None: every entry
    known: Tensor | None = None
    #: an output's: the smallest error that is a wrong function rather than a precision
    #: loss (`semantic_error`), which `close` tells apart with it; None (an LSE, a
    #: gradient): 5% of the expected values' size
    semantic: float | None = None

    def sel(self, sel: Tensor | None = None) -> Tensor | None:
        """``sel`` (broadcastable to the output) narrowed to the rows the oracle knows."""
        if self.known is None:
            return sel
        return self.known if sel is None else sel & self.known

    def judged(self) -> Tensor:
        """``value`` with NaN (nothing to hold a backend to) in the rows not known."""
        return self.value if self.known is None else self.value.where(self.known, math.nan)

    def bounds(self, sel: Tensor | None = None) -> tuple[float, float]:
        """The (max, mean) error bounds over the selected elements (all by default)
        that `close` judges: those whose expected value is finite. An entry expected
        NaN or infinite (an empty row's LSE, a NaN policy) is held to its policy, not
        to a size, and averaging its zero error into the mean bound would hold the
        other entries to less than their own reference error."""
        sel = self.sel(sel)
        value, ref_err = self.value, self.ref_err
        narrow = _narrowing(sel, value.shape)
        if narrow is not None:  # a long case's sampled rows: read those alone
            axis, idx = narrow
            value, ref_err = value.index_select(axis, idx), ref_err.index_select(axis, idx)
            assert sel is not None
            sel = _take(sel, axis, idx)
        judged = torch.isfinite(value)
        if sel is not None:
            judged = judged & sel.expand_as(value)
        judged = judged.expand_as(ref_err)
        n = int(judged.sum())
        if n == 0:
            return self.floor, self.floor
        err = torch.where(judged, ref_err, 0.0)  # >= 0: the unjudged add nothing
        return (
            max(self.floor, self.fudge * float(err.max())),
            max(self.floor, self.fudge * float(err.sum()) / n),
        )


def _narrowing(
    sel: Tensor | None, shape: tuple[int, ...] | torch.Size
) -> tuple[int, Tensor] | None:
    """Where ``sel`` (broadcastable to ``shape``) leaves most slices of the query axis
    unselected (a long case's sampled rows: `Expected.known`), that axis (``-2`` for an
    output, ``-1`` for a log-sum-exp) and the indices of the slices it selects some entry
    of; None where narrowing saves little. A comparison made on those slices alone reads
    what one made on the whole would, at the cost of the sample."""
    if sel is None:
        return None
    best: tuple[int, Tensor, int] | None = None
    for axis in (-2, -1):
        if sel.dim() < -axis or len(shape) < -axis:
            continue
        if shape[axis] < 4 or sel.shape[axis] != shape[axis]:
            continue
        others = tuple(d for d in range(sel.dim()) if d != sel.dim() + axis)
        keep = sel.any(dim=others) if others else sel
        n = int(keep.sum())
        if 2 * n <= shape[axis] and (best is None or n < best[2]):
            best = (axis, keep, n)
    if best is None:
        return None
    return best[0], best[1].nonzero().flatten()


def _take(t: Tensor, axis: int, idx: Tensor) -> Tensor:
    """``t`` at the slices ``idx`` of ``axis``, where it is not broadcast along it."""
    if t.dim() < -axis or t.shape[axis] == 1:
        return t
    return t.index_select(axis, idx)


@checked
def empty_rows(inputs: Inputs) -> Bool[Tensor, "*batch h Tq 1"]:
    """Queries that see no key (through the mask and the causal diagonal)."""
    return ~inputs.visible().any(dim=-1, keepdim=True)


@checked
def empty_row_causes(
    inputs: Inputs, native_causal: bool, rows: Int[Tensor, " n"] | None = None
) -> dict[Cause, Bool[Tensor, "*batch h Tr 1"]]:
    """The queries that see no key, by cause (`attnref.conformance.EmptyRows`).

    ``native_causal``: the backend applies the causal diagonal itself; otherwise the
    diagonal reaches it folded into the mask (a boolean one when there is no mask), and
    its empty rows are the mask's. A sliding window is always applied by the backend
    itself, and counts as ``causal``. Otherwise a row that the mask alone empties is the
    mask's, and one that the diagonal empties, alone or with the mask, is ``causal``:
    the backend's own causal masking finished hiding it (x-transformers' ``Attend``, for
    one, zeroes the rows its mask empties and averages V in the others). ``rows``: those
    query rows only (``Tr`` of them), at the cost of those rows.
    """
    mask = inputs.attn_mask

    def empty(x: Inputs) -> Tensor:
        seen = x.visible() if rows is None else _visible_rows(x, rows)
        return ~seen.any(dim=-1, keepdim=True)

    kind: Cause = "float_mask" if mask is not None and mask.is_floating_point() else "bool_mask"
    hidden = empty(inputs)
    none = torch.zeros_like(hidden)
    if inputs.window is None and (inputs.causal is None or not native_causal):
        return {kind: hidden, "causal": none}
    # a window is always the backend's own (it never reaches it folded into a mask)
    by_mask = empty(replace(inputs, window=None, causal=None if native_causal else inputs.causal))
    return {kind: by_mask, "causal": hidden & ~by_mask}


@checked_internal
def _cause_rows(
    inputs: Inputs,
    empty_row: EmptyRow | EmptyRows,
    native_causal: bool,
    rows: Int[Tensor, " n"] | None = None,
) -> list[tuple[Cause, EmptyRow, Bool[Tensor, "*batch h Tr 1"]]]:
    """``(cause, declared policy, rows)`` for each cause that empties some row (of
    ``rows``, if given)."""
    policy = empty_row if isinstance(empty_row, EmptyRows) else EmptyRows(*(empty_row,) * 3)
    return [
        (cause, policy.for_call(cause, inputs.attn_mask), sel)
        for cause, sel in empty_row_causes(inputs, native_causal, rows).items()
        if bool(sel.any())
    ]


@checked
def policy_rows(
    inputs: Inputs, empty_row: EmptyRow | EmptyRows = "zero", native_causal: bool = False
) -> dict[EmptyRow, Bool[Tensor, "*batch h Tq 1"]]:
    """``(*batch, h, Tq, 1)`` booleans: the queries that see no key, by the policy that
    the declaration gives them (policies no row falls under are left out)."""
    rows: dict[EmptyRow, Bool[Tensor, "*batch h Tq 1"]] = {}
    for _, p, sel in _cause_rows(inputs, empty_row, native_causal):
        rows[p] = rows[p] | sel if p in rows else sel
    return rows


#: the finite fill whose rounding bounds a row under the "unmasked" policy (diffusers')
UNMASKED_FILL = -1e4


def _unhidden(
    inputs: Inputs, cause: Cause, native_causal: bool, keep_mask: bool = False
) -> tuple[Inputs, Inputs]:
    """``inputs`` as a backend with a finite fill *added* to hidden scores computes a row
    that ``cause`` empties: every hidden key of the row shifted alike, so none hidden.
    Returns them without the hiding (the exact answer) and with `UNMASKED_FILL` added
    instead (whose rounding in the dtype bounds the error). The mask goes (a float mask
    keeps its finite entries); the causal diagonal goes too when it emptied the row or
    reached the backend folded into the mask, and a window when it emptied the row.
    ``keep_mask``: the mask stays as it is (its hidden keys hidden), and only the causal
    diagonal is opened (the ``diagonal`` policy)."""
    mask = inputs.attn_mask
    T = (inputs.query.shape[-2], inputs.key.shape[-2])
    if keep_mask:
        if inputs.causal is None:  # nothing to open: the row is the mask's
            return inputs, inputs
        diagonal = ~causal_mask(*T, inputs.causal, device=inputs.query.device)
        opened = replace(inputs, causal=None)
        base = torch.zeros(T, dtype=torch.float32, device=diagonal.device)
        if mask is not None:
            base = (
                base.masked_fill(~mask, -math.inf)
                if mask.dtype == torch.bool
                else base + mask.to(torch.float32)
            )
        shifted = base.masked_fill(diagonal & torch.isfinite(base), UNMASKED_FILL)
        return opened, replace(opened, attn_mask=shifted.to(inputs.query.dtype))
    hidden = torch.zeros(T, dtype=torch.bool, device=inputs.query.device)
    if mask is not None:
        hidden = (~mask if mask.dtype == torch.bool else torch.isinf(mask)) | hidden
        mask = None if mask.dtype == torch.bool else mask.masked_fill(torch.isinf(mask), 0.0)
    folded = inputs.causal is not None and (cause == "causal" or not native_causal)
    causal = None if folded else inputs.causal
    window = None if cause == "causal" else inputs.window
    if folded:
        hidden = hidden | ~causal_mask(*T, inputs.causal, device=hidden.device)  # type: ignore[arg-type]
    opened = replace(inputs, attn_mask=mask, causal=causal, window=window)
    base = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    if mask is not None:
        base = base + mask.to(torch.float32)
    fill = base.masked_fill(hidden, UNMASKED_FILL).to(inputs.query.dtype)
    return opened, replace(opened, attn_mask=fill)


@checked
def at_rows(inputs: Inputs, rows: Int[Tensor, " n"]) -> Inputs:
    """Query rows ``rows`` (indices into ``Tq``) of ``inputs`` as inputs of their own,
    with the same answer row for row: what places a query (the causal diagonal, the
    window, ALiBi) is folded, with the mask, into a float64 mask of those rows (``-inf``
    where a key is hidden, the ALiBi bias and the float mask's finite offsets
    elsewhere). What a sampled oracle computes (`expect`): ``len(rows) * Tk`` scores,
    not ``Tq * Tk``."""
    q = inputs.query
    Tq, Tk = q.shape[-2], inputs.key.shape[-2]
    seen = _visible_rows(inputs, rows)  # (*batch, h, n, Tk)
    bias = torch.zeros(seen.shape, dtype=torch.float64, device=q.device)
    mask = inputs.attn_mask
    if mask is not None and mask.is_floating_point():
        part = mask[..., rows, :] if mask.shape[-2] == Tq and Tq > 1 else mask
        bias = bias + torch.nan_to_num(part.to(torch.float64), neginf=0.0)
    if inputs.alibi_slopes is not None:
        at = rows.to(torch.float64) + causal_offset(Tq, Tk, inputs.alignment)
        cols = torch.arange(Tk, dtype=torch.float64, device=q.device)
        distance = (at[:, None] - cols).abs()  # (n, Tk)
        bias = bias - inputs.alibi_slopes.to(torch.float64)[..., None, None] * distance
    return replace(
        inputs,
        query=q[..., rows, :],
        attn_mask=bias.masked_fill(~seen, -math.inf),
        causal=None,
        window=None,
        alibi_slopes=None,
    )


@checked_internal
def _visible_rows(inputs: Inputs, rows: Int[Tensor, " n"]) -> Bool[Tensor, "*batch h n Tk"]:
    """Which keys the queries ``rows`` see: `Inputs.visible` of those rows only."""
    Tq, Tk = inputs.query.shape[-2], inputs.key.shape[-2]
    device = inputs.query.device
    seen = torch.ones(len(rows), Tk, dtype=torch.bool, device=device)  # (n, Tk)
    offset = causal_offset(Tq, Tk, inputs.alignment)
    if inputs.causal is not None:
        seen = seen & causal_block(Tq, 0, Tk, offset, device, rows)
    if inputs.window is not None:
        seen = seen & window_block(Tq, 0, Tk, offset, inputs.window, device, rows)
    mask = inputs.attn_mask
    if mask is not None:
        part = mask[..., rows, :] if mask.shape[-2] == Tq and Tq > 1 else mask
        seen = seen & (part if part.dtype == torch.bool else part > -math.inf)
    shape = (*inputs.query.shape[:-2], len(rows), Tk)
    return seen.expand(shape)


@checked
def expect(
    inputs: Inputs,
    empty_row: EmptyRow | EmptyRows = "zero",
    native_causal: bool = False,
    rows: Int[Tensor, " n"] | None = None,
) -> Expected:
    """The oracle for ``inputs`` under the declared empty-row policy, with its bounds.

    ``native_causal``: whether the backend is called with ``is_causal`` (which decides
    the cause of a causally empty row, see `empty_row_causes`). ``rows``: compute only
    these query rows (`at_rows`), each at the cost of one row; the others are unknown
    (`Expected.known`).
    """
    target = inputs if rows is None else at_rows(inputs, rows)
    oracle = reference(target.to(torch.float64))
    if inputs.query.dtype == torch.float64:  # the reference in the dtype is the oracle
        ref_err = torch.zeros_like(oracle)
    else:
        ref_err = (reference(target).to(torch.float64) - oracle).abs()
    # what follows applies the declared policy to rows with no visible key
    free: Tensor | None = None  # the rows a declaration leaves undefined: not judged
    for cause, name, empty in _cause_rows(inputs, empty_row, native_causal, rows):
        if name == "zero":
            continue  # the reference's own policy
        if name == "undefined":
            free = empty if free is None else free | empty
            continue
        if name == "nan":
            # a softmax of -inf scores: NaN, but beside a sink, which then takes all the
            # weight and carries no value (0), as attnref's own reference
            policy = _sunk(inputs, torch.full_like(oracle, math.nan))
        elif name == "uniform":  # the mean of every V
            v = F.expand_kv_heads(inputs.value.to(torch.float64), inputs.query.shape[-3])
            # every key's score is the same finite fill, far below a sink's logit: all
            # the weight goes to the sink (MLX), as under the NaN policy
            policy = _sunk(inputs, v.mean(dim=-2, keepdim=True).expand_as(oracle))
            # what rounding the mean to the output's dtype costs: 5.671875 lies between
            # two bfloat16 values, so no output meets a bound without it
            rounded = (policy.to(inputs.query.dtype).to(torch.float64) - policy).abs()
            ref_err = torch.where(empty, rounded, ref_err)
        else:  # "unmasked": attention over the keys the mask hid; "diagonal": over those
            # the diagonal alone hid, the mask's kept hidden; "diagonal_replaced": their
            # plain mean (every score of theirs the same fill: a query of zeros)
            on_diagonal = name in ("diagonal", "diagonal_replaced")
            opened, filled = _unhidden(inputs, cause, native_causal, on_diagonal)
            if name == "diagonal_replaced":
                opened = filled = replace(opened, query=torch.zeros_like(opened.query))
            if rows is not None:
                opened, filled = at_rows(opened, rows), at_rows(filled, rows)
            policy = reference(opened.to(torch.float64))
            fill_err = (reference(filled).to(torch.float64) - policy).abs()
            ref_err = torch.where(empty, fill_err, ref_err)
            if on_diagonal:  # where the mask hides every key: a softmax of -inf
                nothing = ~opened.visible().any(dim=-1, keepdim=True)
                policy = policy.masked_fill(nothing, math.nan)
        oracle = torch.where(empty, policy, oracle)
        if name == "nan":
            ref_err = ref_err.masked_fill(empty, 0.0)
    ref_err = torch.nan_to_num(ref_err, nan=0.0)
    floor = error_floor(inputs, None if rows is None else target)
    size = float(torch.nan_to_num(oracle, nan=0.0).abs().max()) if oracle.numel() else 0.0
    semantic = semantic_error(values_spread(target), size, inputs.query.dtype)
    known = None if free is None else ~free.expand_as(oracle)
    found = Expected(oracle, ref_err, floor, semantic=semantic, known=known)
    if rows is None:
        return found
    return _spread_rows(found, rows, inputs.query.shape[-2], -2)


def _sunk(inputs: Inputs, policy: Tensor) -> Tensor:
    """``policy`` (an empty row's output) with 0 in the heads that have a sink: a row
    whose keys are all hidden gives all its weight to the sink, which carries no value;
    a sink of ``-inf`` is no sink."""
    if inputs.sinks is None:
        return policy
    sunk = torch.isfinite(inputs.sinks.to(policy.device))[:, None, None]  # (h, 1, 1)
    return policy.masked_fill(sunk, 0.0)


@checked
def one_key_off(
    inputs: Inputs, got: Float[Tensor, " Dv"], index: tuple[int, ...], bound: float
) -> str:
    """What a wrong output row at ``index`` (``(*batch, h, query)``) is, where it is the
    oracle over one key more or one fewer than its query sees: the key next to either
    end of what it sees taken in, or either end left out (a causal diagonal or a window
    off by one, class 5 and 22). ``got``: the backend's row, ``bound`` the error it may
    have. "" where no such key set matches, or the row has ALiBi or sinks (not modelled
    here)."""
    if inputs.alibi_slopes is not None or inputs.sinks is not None:
        return ""
    seen = inputs.visible()[index]  # (Tk,)
    if not bool(seen.any()):
        return ""
    h, g = inputs.query.shape[-3], inputs.key.shape[-3]
    kv = (*index[:-2], index[-2] // (h // g))
    # the row alone, as one query of one head against its head's keys (float64)
    row = replace(
        inputs.to(torch.float64),
        query=inputs.query[index][None, None, None].to(torch.float64),
        key=inputs.key[kv][None, None].to(torch.float64),
        value=inputs.value[kv][None, None].to(torch.float64),
        causal=None,
        window=None,
    )
    mask = inputs.attn_mask
    added = None  # a float mask's entries of the row, which still add to its scores
    if mask is not None and mask.is_floating_point():
        shape = (*inputs.query.shape[:-1], inputs.key.shape[-2])
        added = mask.to(torch.float64).expand(shape)[index]
    at = seen.nonzero().flatten()
    first, last = int(at[0]), int(at[-1])
    query = f"query {index[-1]}"
    tries = [
        (last + 1, True, f"{query} attends key {last + 1}, which it must not see"),
        (first - 1, True, f"{query} attends key {first - 1}, which it must not see"),
        (last, False, f"{query} leaves out key {last}, which it sees"),
        (first, False, f"{query} leaves out key {first}, which it sees"),
    ]
    got = got.to(torch.float64)
    for j, taken, text in tries:
        if not 0 <= j < seen.numel() or bool(seen[j]) == taken:
            continue
        keys = seen.clone()
        keys[j] = taken
        if added is None:
            keyset: Tensor = keys
        else:  # a key taken in is scored as it is, its -inf (if any) set aside
            keyset = torch.where(keys, torch.where(torch.isinf(added), 0.0, added), -math.inf)
        want = reference(replace(row, attn_mask=keyset[None]))[0, 0, 0]  # 0 for no key
        if float((want - got).abs().max()) <= bound:
            return text + " (its output is the oracle's over that key set)"
    return ""


#: the largest error a precision loss makes, in multiples of the bound it broke: the bound
#: is the reference's own rounding error in the case's dtype (times the fudge) and a
#: floor, so an error past this many of it is not what that dtype's rounding makes (a
#: float64 error of 1e-3, 10**7 times its bound, is a wrong function however small
#: beside the values' spread; so is a key too many among 65 in float32)
PRECISION_TIMES = 100

#: a precision loss, in ulps of the output's size in the case's dtype: what rounding
#: makes of values far from zero, whatever their spread
PRECISION_ULPS = 4


def semantic_error(spread: float, size: float, dtype: torch.dtype) -> float | None:
    """The smallest error of an output that is a wrong function (`Failure.small` below
    it): 5% of the ``spread`` of the values its rows average (a wrong weight or a wrong
    key moves it by a share of that), but never below `PRECISION_ULPS` ulps of the
    output's ``size`` in ``dtype`` (bfloat16 rounds an output of 36 by 0.125). None
    where no query sees a key (no spread to measure against)."""
    if spread <= 0:
        return None
    return max(0.05 * spread, PRECISION_ULPS * torch.finfo(dtype).eps * size)


def values_spread(inputs: Inputs) -> float:
    """max - min of V, per value dim, over the keys that some query of ``inputs`` sees,
    the largest over dims and heads (finite values only): how far apart the values an
    output row averages lie. An error of a few percent of it is a wrong weight or a wrong
    key, whatever the values' offset; the output's own size is not (V shifted by -20
    makes an output of 36, and a key too many an error of 1.5% of it). 0 where no query
    sees a key."""
    h, g = inputs.query.shape[-3], inputs.key.shape[-3]
    v = inputs.value.to(torch.float64)  # (*batch, g, Tk, Dv)
    seen = inputs.visible().any(dim=-2)  # (*batch, h, Tk)
    seen = seen.expand(*v.shape[:-3], h, v.shape[-2])
    # (*batch, g, Tk): query head i reads key/value head i // (h / g)
    seen = seen.reshape(*v.shape[:-3], g, h // g, v.shape[-2]).any(dim=-2)
    keep = (seen.unsqueeze(-1) & torch.isfinite(v)).expand_as(v)
    if not bool(keep.any()):
        return 0.0
    high = v.masked_fill(~keep, -math.inf).amax(dim=-2)
    low = v.masked_fill(~keep, math.inf).amin(dim=-2)
    spread = torch.where(torch.isfinite(high) & torch.isfinite(low), high - low, 0.0)
    return float(spread.max())


@checked_internal
def _spread_rows(sampled: Expected, rows: Int[Tensor, " n"], Tq: int, axis: int) -> Expected:
    """A sampled oracle laid out as a whole one: its rows in place along ``axis`` (the
    query axis), zeros elsewhere, and `Expected.known` saying which rows are known."""
    shape = list(sampled.value.shape)
    shape[axis] = Tq
    rows = rows.to(sampled.value.device)  # drawn on the CPU; the oracle may be on a GPU
    full = sampled.value.new_zeros(shape).index_copy_(axis, rows, sampled.value)
    err = sampled.ref_err.new_zeros(shape).index_copy_(axis, rows, sampled.ref_err)
    known = torch.zeros(Tq, dtype=torch.bool, device=full.device)
    known[rows] = True
    row_known = known if axis == -1 else known[:, None]
    if sampled.known is not None:  # entries of the sampled rows left unjudged (undefined)
        inner = sampled.known.expand_as(sampled.value)
        row_known = full.new_zeros(shape, dtype=torch.bool).index_copy_(axis, rows, inner)
    return replace(sampled, value=full, ref_err=err, known=row_known)


@checked
def expect_lse(
    inputs: Inputs,
    empty_lse: EmptyLse = "-inf",
    rows: Int[Tensor, " n"] | None = None,
    with_sink: bool = False,
) -> Expected:
    """The oracle's log-sum-exp (``(*batch, h, Tq)``, float64) under the declared policy
    for a row with no visible key (``-inf``, or FlashAttention 2's ``+inf``).

    The floor: a score error of ``eps_s * kappa`` moves the LSE by at most as much, and
    storing it in float32 rounds it by ``eps32 * |lse|``; at least the atol of the dtype
    the LSE is computed in (float32, or float64 for float64 inputs), not the inputs'
    (an LSE taken relative to a row's max differs by that max only). ``rows``: only
    these query rows (`at_rows`), as for `expect`. ``with_sink``: the backend's LSE counts
    its sink (`Capabilities.lse_with_sink`: ``logaddexp(lse, sink)``, the sink's logit
    itself in a row with no visible key).
    """
    whole = inputs
    if rows is not None:
        inputs = at_rows(inputs, rows)
    oracle = reference_lse(inputs.to(torch.float64))
    same = reference_lse(inputs).to(torch.float64)
    if with_sink and inputs.sinks is not None:
        sink = inputs.sinks.to(torch.float64).unsqueeze(-1)  # (h, 1)
        oracle, same = torch.logaddexp(oracle, sink), torch.logaddexp(same, sink)
    finite = torch.isfinite(oracle)
    ref_err = torch.where(finite, (same - oracle).abs(), 0.0)
    ref_err = torch.nan_to_num(ref_err, nan=0.0)
    if empty_lse == "+inf":
        oracle = oracle.masked_fill(~finite, math.inf)
    kappa = score_condition(inputs.query, inputs.key, inputs.scale, inputs.visible())
    ldtype = torch.float64 if inputs.query.dtype == torch.float64 else torch.float32
    stored = torch.finfo(ldtype)
    biggest = float(oracle[finite].abs().max()) if bool(finite.any()) else 0.0
    eps = score_eps(inputs.query.dtype)
    rounding = score_rounding(inputs.query.dtype, inputs.query.shape[-1])
    computed = 2 * (rounding * kappa + eps * _bias_bound(whole) + stored.eps * biggest)
    floor = max(tolerance(ldtype).atol, computed)
    if rows is None:
        return Expected(oracle, ref_err, floor)
    return _spread_rows(Expected(oracle, ref_err, floor), rows, whole.query.shape[-2], -1)


@checked_internal
def _grads(
    inputs: Inputs, d_out: Float[Tensor, "*batch h Tq Dv"]
) -> tuple[
    Float[Tensor, "*batch h Tq Dh"],
    Float[Tensor, "*batch g Tk Dh"],
    Float[Tensor, "*batch g Tk Dv"],
]:
    q, k, v = (t.detach().requires_grad_(True) for t in (inputs.query, inputs.key, inputs.value))
    leaves = replace(inputs, query=q, key=k, value=v)
    dq, dk, dv = torch.autograd.grad(reference(leaves), (q, k, v), d_out)
    return dq, dk, dv


@checked
def expect_sink_grad(inputs: Inputs, d_out: Float[Tensor, "*batch h Tq Dv"]) -> Expected:
    """The oracle's gradient of the sink logits ``(h,)`` for the upstream gradient
    ``d_out``, with its bound.

    ``d sigma_h = -sum_{b, i} sigmoid(sigma_h - lse_i) <dO_i, O_i>``: the floor is
    ``(eps + 2 eps_s kappa)`` times the sum of the absolute values of those terms, as
    for dQ, dK and dV (`expect_grads`), plus a rounding of the terms in the sinks' dtype
    (float32 even for float64 inputs: the gradient is stored, and may be summed, there).
    """
    assert inputs.sinks is not None

    def grad(x: Inputs) -> Tensor:
        assert x.sinks is not None
        # float32 sink logits (float64 for the oracle), as the backend receives them
        dtype = torch.promote_types(x.query.dtype, torch.float32)
        sinks = x.sinks.detach().to(dtype).requires_grad_(True)
        out = reference(replace(x, sinks=sinks))
        (d,) = torch.autograd.grad(out, (sinks,), d_out.to(x.query.dtype))
        return d.to(torch.float64)

    inputs64 = inputs.to(torch.float64)
    oracle, same = grad(inputs64), grad(inputs)
    out, lse = _reference(inputs64, return_lse=True)
    sink_w = torch.sigmoid(inputs64.sinks.to(torch.float64)[:, None] - lse)  # type: ignore[union-attr]
    sink_w = torch.nan_to_num(sink_w.masked_fill(torch.isneginf(lse), 0.0))
    dots = (d_out.to(torch.float64).abs() * out.abs()).sum(dim=-1)  # (*batch, h, Tq)
    terms = (sink_w * dots).reshape(-1, *dots.shape[-2:]).sum(dim=(0, 2))  # (h,)
    dtype = inputs.query.dtype
    kappa = score_condition(inputs.query, inputs.key, inputs.scale, inputs.visible())
    rel = torch.finfo(dtype).eps + 2 * score_rounding(dtype, inputs.query.shape[-1]) * kappa
    computed = rel * float(terms.max()) if terms.numel() else 0.0
    # the gradient is stored in the sinks' own dtype (float32), and may be summed there
    # from parts (per sample, per packed sequence, per block): a rounding of each term
    biggest = max(float(oracle.abs().max()), float(terms.max())) if terms.numel() else 0.0
    stored = torch.finfo(inputs.sinks.dtype).eps * biggest
    floor = max(tolerance(dtype).atol, computed + stored)
    return Expected(oracle, (same - oracle).abs(), floor, GRAD_FUDGE)


@checked_internal
def _gradient_terms(
    inputs: Inputs, d_out: Float64[Tensor, "*batch h Tq Dv"]
) -> tuple[float, float, float]:
    """The largest sum of absolute terms in each of dQ, dK, dV (float64 inputs).

    ``dV = P^T dO``, ``dQ = scale * dS K``, ``dK = scale * dS^T Q`` with ``dS = P * (dP -
    D)``, ``dP = dO V^T`` and ``D = rowsum(dO * O)``. Rounding ``P``, ``dS`` or the stored
    output ``O`` to the inputs' dtype (FlashAttention's backward, and torch's CPU kernel,
    compute ``D`` from the rounded output) moves an entry by up to about ``eps`` times
    the sum of the absolute values of its terms.
    """
    q, k, v = inputs.query, inputs.key, inputs.value
    h = q.shape[-3]
    out, p = _reference(inputs, return_weights=True)
    p = torch.nan_to_num(p)
    ke, ve = F.expand_kv_heads(k, h), F.expand_kv_heads(v, h)
    # |dS| <= P * (|dO| |V|^T + rowsum(|dO| |O|)): every term of dP and of D
    d_s = p * (d_out.abs() @ ve.abs().transpose(-2, -1) + (d_out * out).abs().sum(-1, True))
    scale = abs(F.default_scale(q.shape[-1]) if inputs.scale is None else inputs.scale)
    terms_dq = scale * d_s @ ke.abs()
    terms_dk = scale * d_s.transpose(-2, -1) @ q.abs()
    terms_dv = p.transpose(-2, -1) @ d_out.abs()

    def biggest(t: Tensor) -> float:
        t = torch.nan_to_num(t, nan=0.0, posinf=0.0)
        return float(t.max()) if t.numel() else 0.0

    return biggest(terms_dq), biggest(terms_dk), biggest(terms_dv)


@checked
def expect_grads(
    inputs: Inputs, d_out: Float[Tensor, "*batch h Tq Dv"]
) -> tuple[Expected, Expected, Expected]:
    """The oracle's dQ, dK, dV for the upstream gradient ``d_out``, with their bounds.

    The floor of each is ``max(atol[dtype], (eps[dtype] + 2 * eps_s * kappa) * T)`` where
    ``T`` is the largest sum of absolute terms of an entry (`_gradient_terms`): a
    backward that rounds the probabilities, ``dS`` and the output once to the inputs'
    dtype is correct, and so is one whose scores are off by ``eps_s * kappa`` as in the
    forward floor. For dK and dV, ``T`` is per head, times the GQA group size.
    """
    inputs64, d_out64 = inputs.to(torch.float64), d_out.to(torch.float64)
    oracle = _grads(inputs64, d_out64)
    same = _grads(inputs, d_out)
    dtype = inputs.query.dtype
    # one rounding to the dtype, plus what a score error of eps * kappa does to P (twice
    # that, relatively: the error of a weight and of its row's normaliser)
    kappa = score_condition(inputs.query, inputs.key, inputs.scale, inputs.visible())
    rel = torch.finfo(dtype).eps + 2 * score_rounding(dtype, inputs.query.shape[-1]) * kappa
    group = inputs.query.shape[-3] // inputs.key.shape[-3]
    terms = _gradient_terms(inputs64, d_out64)
    out = []
    for o, s, t, n in zip(oracle, same, terms, (1, group, group), strict=True):
        err = torch.nan_to_num((s.to(torch.float64) - o).abs(), nan=0.0)
        floor = max(tolerance(dtype).atol, rel * t * n)
        out.append(Expected(o, err, floor, GRAD_FUDGE))
    return out[0], out[1], out[2]


#: the most rows and columns a finding's error map keeps (larger maps are max-pooled)
MAP_ROWS, MAP_COLUMNS = 64, 256


@checked_internal
def error_map(
    err: Float[Tensor, "*shape"],
    bound: float,
    where: tuple[int, ...] | None = None,
    narrow: tuple[int, Int[Tensor, " n"]] | None = None,
) -> dict[str, Any]:
    """What the report's heatmap shows of a failed comparison: ``err`` (the absolute
    error where judged, ``inf`` where a value is NaN or infinite and should not be) as
    rows against columns, an output's ``(..., Tq, Dv)`` reduced over ``Dv`` (its worst
    channel) to ``(batch * heads, Tq)`` (a one-query output's kept as ``(batch * heads,
    Dv)``: its channels), an LSE's ``(..., Tq)`` to ``(batch * heads,
    Tq)``; max-pooled down to `MAP_ROWS` x `MAP_COLUMNS`; with the bound, and the worst
    value's row and column. ``narrow``: the compared tensors were a long case's sampled
    rows (``(axis, indices)``): the columns are labelled with the queries they are."""
    e = err.detach().to(torch.float64).cpu()
    labels = None
    if narrow is not None and narrow[0] % err.dim() == (err.dim() - 2 if err.dim() >= 3 else 0):
        labels = [int(i) for i in narrow[1].tolist()]
    e = torch.nan_to_num(e, nan=math.inf)
    columns = "queries"
    if e.dim() >= 3 and e.shape[-2] == 1 and e.shape[-1] > 1 and labels is None:
        # one query: its channels are what there is to see (a map of one column was a
        # single cell per head)
        e = e.squeeze(-2)
        columns = "value channels (the one query)"
        point = None if where is None or len(where) != err.dim() else (*where[:-2], where[-1])
    elif e.dim() >= 3:
        e = e.amax(-1)  # the worst channel of each query
        point = None if where is None or len(where) != err.dim() else where[:-1]
    else:
        point = where
        if e.dim() == 1:
            columns = "positions"
    grid = e.reshape(-1, e.shape[-1]) if e.dim() >= 1 and e.numel() else e.reshape(1, 1)
    rows, cols = grid.shape
    rp, cp = -(-rows // MAP_ROWS), -(-cols // MAP_COLUMNS)
    if rp > 1 or cp > 1:
        pad = torch.full((rp * -(-rows // rp), cp * -(-cols // cp)), 0.0, dtype=grid.dtype)
        pad[:rows, :cols] = grid
        grid = pad.reshape(pad.shape[0] // rp, rp, pad.shape[1] // cp, cp).amax(dim=(1, 3))
    at = None
    if point is not None and e.dim() >= 1 and len(point) == e.dim():
        flat_row = 0
        for i, n in zip(point[:-1], e.shape[:-1], strict=True):
            flat_row = flat_row * n + i
        at = [flat_row // rp, point[-1] // cp]
    if labels is not None and e.dim() >= 1 and len(labels) == e.shape[-1]:
        labels = labels[::cp]
    else:
        labels = None
    return {
        "map": [[x if math.isfinite(x) else None for x in row] for row in grid.tolist()],
        "bound": bound,
        "rows": "batch x heads" if e.dim() >= 2 else "",
        "columns": columns,
        "shape": list(err.shape),
        "pooled": [rp, cp],
        "worst": at,
        "column_labels": labels,
    }


#: a law's two calls as its messages name them: the changed inputs' call, then the
#: call it is compared with
LAW_CALLS = ("the call on the changed inputs", "the call on the original inputs")


def shown_apart(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` printed with 6 significant digits, or as many more as it takes to
    tell them apart (a float64 message read "got 0.703969, expected 0.703969")."""
    for digits in range(6, 18):
        x, y = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if x != y or a == b:
            return x, y
    return repr(a), repr(b)


@checked
def close(
    got: Float64[Tensor, "*shape"],
    want: Float64[Tensor, "*shape"],
    max_bound: float,
    mean_bound: float,
    what: str,
    sel: Bool[Tensor, "*#shape"] | None = None,
    *,
    law: Float64[Tensor, "*shape"] | None = None,
    semantic: float | None = None,
    names: tuple[str, str] = LAW_CALLS,
) -> None:
    """Raise `Failure` unless ``got`` is within the bounds of ``want`` where ``sel`` holds.

    NaN in ``want`` means the declared policy expects a non-finite value there; NaN or
    inf in ``got`` where ``want`` is finite is always a failure, whatever the bounds.

    ``law``: ``want`` is not the oracle but another call of the backend (a law), and
    ``law`` is the oracle of ``got``'s call. The message then names the two calls, says
    which the oracle sides with, and calls neither "expected"; the failure's
    ``expected`` is the oracle's value. ``names``: the two calls, ``got``'s first.

    ``semantic``: for an output, the smallest error that is a wrong function
    (`Expected.semantic`: from the spread of the values its rows average, not the
    output's size, which a V far from zero inflates); a smaller one is a precision loss
    (`Failure.small`, where also within `PRECISION_TIMES` the bound). Without it (an
    LSE, a gradient): 5% of the expected values' size,
    at least 1, a law's taken from its oracle (``law``), never from the other call,
    which may be garbage.
    """
    narrow = _narrowing(sel, got.shape)
    if narrow is not None:  # judge the selected query rows alone, name them as they were
        axis, idx = narrow
        got, want = got.index_select(axis, idx), want.index_select(axis, idx)
        law = None if law is None else law.index_select(axis, idx)
        assert sel is not None
        sel = _take(sel, axis, idx)
    sel = torch.ones_like(got, dtype=torch.bool) if sel is None else sel.expand_as(got)
    want_nan = ~torch.isfinite(want) & sel
    got_bad = ~torch.isfinite(got) & sel

    def whole(where: tuple[int, ...]) -> tuple[int, ...]:
        """An index of the narrowed tensors as an index of the tensors given."""
        if narrow is None:
            return where
        axis, idx = narrow
        at = list(where)
        at[axis] = int(idx[at[axis]])
        return tuple(at)

    def at(mask: Tensor) -> tuple[int, ...]:
        return tuple(int(i) for i in mask.nonzero()[0])

    def values(where: tuple[int, ...]) -> tuple[str, float]:
        """The two values at ``where`` as the message names them, and the failure's
        expected value (the oracle's, for a law)."""
        g, w = float(got[where]), float(want[where])
        gs, ws = shown_apart(g, w)
        if law is None:
            return f"got {gs}, expected {ws}", w
        truth = float(law[where])
        side = ""
        if math.isfinite(truth):
            dg, dw = abs(g - truth), abs(w - truth)
            dg, dw = (math.inf if math.isnan(x) else x for x in (dg, dw))
            if dg != dw:
                side = f" (the oracle sides with {names[0] if dg < dw else names[1]})"
        gs, ts = shown_apart(g, truth)
        return (
            f"{names[0]} gave {gs}, {names[1]} "
            f"{ws} (as the law carries it over), the oracle {ts}{side}",
            truth,
        )

    wrong = got_bad & ~want_nan
    if wrong.any():
        where = at(wrong)
        text, expected = values(where)
        shown = torch.where(wrong, math.inf, torch.where(sel & ~want_nan, (got - want).abs(), 0.0))
        failure = Failure(
            f"{what}: {int(wrong.sum())} NaN/inf values where a finite value is expected; "
            f"first at {whole(where)}: {text}",
            got=float(got[where]),
            expected=expected,
            where=whole(where),
            kind="nan",
        )
        failure.errors_from = lambda: error_map(shown, max_bound, where, narrow)
        raise failure
    missing = want_nan & ~got_bad
    if missing.any():
        where = at(missing)
        raise Failure(
            f"{what}: {int(missing.sum())} finite values where the declared policy gives NaN; "
            f"first at {whole(where)}: got {float(got[where]):.6g}",
            got=float(got[where]),
            expected=math.nan,
            where=whole(where),
            kind="policy",
        )
    judged = sel & ~want_nan
    n = int(judged.sum())
    if n == 0:
        return
    err = torch.where(judged, (got - want).abs(), 0.0)
    max_err, mean_err = float(err.max()), float(err.sum()) / n
    if max_err <= max_bound and mean_err <= mean_bound:
        return
    where = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    text, expected = values(where)
    kind = "difference" if law is not None else "error"
    if semantic is None:
        size = float(torch.where(judged, (want if law is None else law).abs(), 0.0).max())
        semantic = 0.05 * max(1.0, size)
    failure = Failure(
        f"{what}: max {kind} {max_err:.3g} (bound {max_bound:.3g}), mean {kind} "
        f"{mean_err:.3g} (bound {mean_bound:.3g}); worst at {whole(where)}: {text}",
        got=float(got[where]),
        expected=expected,
        where=whole(where),
        kind="error",
        small=max_err < semantic and max_err < PRECISION_TIMES * max_bound,
    )
    failure.errors_from = lambda: error_map(err, max_bound, where, narrow)
    raise failure
