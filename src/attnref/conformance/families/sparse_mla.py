"""The ``sparse-mla`` family: FlashMLA's ``flash_mla_sparse_fwd``, DeepSeek's token-level
sparse attention (DSA) over latent rows (docs/sparse.md).

``fn(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None) -> (out,
max_logits, lse)``: ``q (Tq, h, D)`` against ``kv (Tk, 1, D)``, one key/value head whose
values are its first ``d_v`` dims; query ``i`` attends the rows ``indices[i, 0]`` names
(int32, ``(Tq, 1, topk)``), an index below 0 or at ``Tk`` or past it ignored; ``out (Tq,
h, d_v)``, ``max_logits`` and ``lse`` ``(Tq, h)`` in float32, natural log, a query with
no valid index giving 0, ``-inf`` and ``+inf`` (`attnref.sparse`).

A dense case runs as a sparse call: the batch's queries one after another, its keys
likewise, each query's indices the keys it sees (mask, causal diagonal, window), ``-1``
after them. The family's own properties draw what only indices have: invalid entries
(``-1``, past the rows) among the valid ones, duplicates, shuffled lists, queries with no
valid index, counts at tile boundaries; ``kv`` is a view into a buffer with a NaN row
before it and after it (a kernel that reads index ``-1`` or ``Tk`` reads NaN), and every
row no query selects holds NaN.

What kernels differ in is declared: `Capabilities.invalid_indices` (which invalid forms
it ignores), `Capabilities.duplicates` (``"counted"`` as many times as listed, or
``"refused"``: never drawn), `Capabilities.max_logits` (returned), `Capabilities.
topk_multiple` (the lengths of ``indices``' last dim it takes), `Capabilities.
topk_length` (it takes per-query counts).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from hypothesis import strategies as st
from jaxtyping import Float, Int
from torch import Tensor

from attnref._checking import checked_internal
from attnref.conformance.calls import invoke, note_reading
from attnref.conformance.cases import Case, Inputs, shape_values
from attnref.conformance.checks import Context, law, rng
from attnref.conformance.declarations import Backend, Capabilities
from attnref.conformance.families.flash import declared, flash_back, flash_layout
from attnref.conformance.families.flash_kvcache import per_row
from attnref.conformance.families.mla import tied
from attnref.conformance.family import ApiFamily, Arguments, variant_kwargs
from attnref.conformance.mutants import Mutant
from attnref.conformance.oracle import close, expect_lse
from attnref.conformance.profiles import Profile
from attnref.conformance.properties import Property
from attnref.conformance.serving_checks import agree, guard, judge, with_lses
from attnref.conformance.strategies import case_strategy
from attnref.conformance.verdicts import Failure, Skip
from attnref.conformance.worker import Job
from attnref.sparse import attend_rows, chunk_queries, score_stats, sparse_mla_attention

__all__ = [
    "FAMILY",
    "FLASH_MLA_SPARSE",
    "SparseCall",
    "build_sparse",
    "sink_declared",
    "sink_kwargs",
    "sink_logits",
    "sparse_form",
    "sparse_reference",
    "sparse_sdpa",
    "with_sinks",
]

NAME = "sparse-mla"
#: the key block FlashMLA's sparse kernels step through the top-k list by (``B_TOPK``),
#: where cases put counts when a kernel declares no tile of its own
TOPK_BLOCK = 64

#: what FlashMLA documents for its sparse prefill: bfloat16, latent rows of 576 dims
#: with V their first 512, one KV head, top-k lists a multiple of 64 long, invalid
#: indices -1 or past the rows, duplicates counted, max_logits and the LSE (+inf for a
#: query with no valid index). Masks, the causal diagonal and windows reach it as indices.
FLASH_MLA_SPARSE = Capabilities(
    family=NAME,
    dtypes=(torch.bfloat16,),
    float_mask=False,
    causal_alignments=("top_left", "bottom_right"),
    gradients=False,
    dropout=False,
    zero_head_dim=False,
    head_dims=(576, 512),
    latent_values=True,
    window=True,
    lse=True,
    empty_lse="+inf",
    max_logits=True,
    topk_multiple=TOPK_BLOCK,
    # its kernels never read a row no valid entry names: NaN there must never matter
    masked_nan="contained",
)


def sparse_caps(caps: Capabilities) -> Capabilities:
    """``caps`` as a backend of this family declares them: latent values, no float
    masks, no gradients; masks, both causal alignments and windows (they are indices)."""
    return replace(
        caps,
        family=NAME,
        float_mask=False,
        causal_alignments=("top_left", "bottom_right"),
        gradients=False,
        dropout=False,
        zero_head_dim=False,
        latent_values=True,
        window=True,
        softcap=False,
        alibi=False,
        sinks=False,
        lse=True,
        empty_lse="+inf",
        max_logits=True,
    )


# ----------------------------------------------------------------- the convention


@dataclass(frozen=True)
class SparseCall:
    """One sparse call: its tensors, and the dense inputs each query amounts to
    (``rows``: query ``i`` ``(h, 1, D)`` against the rows it selects, ``(1, n, D)`` in
    the order listed, duplicates included, V their first ``d_v`` dims)."""

    rows: tuple[Inputs, ...]
    q: Tensor  # (Tq, h, D)
    kv: Tensor  # (Tk, 1, D), a view into a buffer with NaN rows around it
    indices: Tensor  # (Tq, 1, topk) int32
    d_v: int
    sm_scale: float
    topk_length: Tensor | None = None  # (Tq,) int32
    attn_sink: Tensor | None = None  # (h,) float32, as each of ``rows`` carries it

    @property
    def first(self) -> Inputs:
        return self.rows[0]


def _scale(inputs: Inputs) -> float:
    """The scale a sparse call passes (``sm_scale`` has no default)."""
    return inputs.query.shape[-1] ** -0.5 if inputs.scale is None else inputs.scale


def sink_declared(caps: Capabilities) -> str | None:
    """Why a call with sink logits cannot be made (``attn_sink`` not declared), or None."""
    return None if caps.attn_sink else "a sink logit per head (attn_sink) not declared"


@checked_internal
def sink_kwargs(
    caps: Capabilities, sinks: Float[Tensor, " h"] | None
) -> dict[str, Float[Tensor, " h"]]:
    """The keyword a call with ``sinks`` passes (``attn_sink``, both sparse families'
    name); none without them.

    Raises:
        Skip: ``attn_sink`` not declared.
    """
    if sinks is None:
        return {}
    if (reason := sink_declared(caps)) is not None:
        raise Skip(reason)
    return {"attn_sink": sinks}


def sparse_arguments(caps: Capabilities, call: SparseCall, overrides: dict[str, Any]) -> Arguments:
    """``flash_mla_sparse_fwd``'s call for ``call``."""
    topk = call.indices.shape[-1]
    if caps.topk_multiple > 1 and topk % caps.topk_multiple:
        raise Skip(f"top-k {topk}: the declared lengths are multiples of {caps.topk_multiple}")
    kwargs: dict[str, Any] = {"d_v": call.d_v}
    if call.topk_length is not None:
        if not caps.topk_length:
            raise Skip("per-query counts (topk_length) not declared")
        kwargs["topk_length"] = call.topk_length
    kwargs.update(sink_kwargs(caps, call.attn_sink))
    kwargs.update(overrides)
    return (call.q, call.kv, call.indices, call.sm_scale), kwargs


def _dense_call(caps: Capabilities, inputs: Inputs) -> SparseCall:
    """A dense latent case as one sparse call: the batch's queries and keys one sample
    after another, each query's indices the keys it sees (in order), then ``-1``. Its
    ``rows`` are empty: the dense case's own oracle judges it."""
    if inputs.attn_mask is not None and inputs.attn_mask.is_floating_point():
        raise Skip("a float mask: a sparse call selects keys, it does not add to scores")
    variant_kwargs(caps, inputs)  # Skip: softcap, ALiBi and sinks are not indices
    if inputs.key.shape[-3] != 1:
        raise Skip(f"{inputs.key.shape[-3]} key/value heads: the sparse-mla convention has one")
    if not tied(inputs):
        raise Skip("values that are not the keys' leading dims: sparse-mla's V is K's")
    visible = inputs.visible()  # (*batch, h, Tq, Tk)
    if bool((visible != visible[..., :1, :, :]).any()):
        raise Skip("a mask per head: a sparse call's indices are shared by every head")
    q = flash_layout(inputs.query, inputs)  # (B, Tq, h, D)
    k = flash_layout(inputs.key, inputs)  # (B, Tk, 1, D)
    B, Tq, h, D = q.shape
    Tk = k.shape[1]
    seen = visible.reshape(B, -1, Tq, Tk)[:, 0].cpu()  # (B, Tq, Tk)
    m = max(caps.topk_multiple, 1)
    topk = max(-(-Tk // m) * m, m)
    # each query's visible keys first, in ascending order (a stable sort of "hidden")
    order = torch.sort((~seen).to(torch.uint8), dim=-1, stable=True).indices  # (B, Tq, Tk)
    listed = torch.arange(Tk) < seen.sum(-1, keepdim=True)  # (B, Tq, Tk)
    offset = (torch.arange(B) * Tk)[:, None, None]
    indices = torch.full((B, Tq, topk), -1, dtype=torch.int32)
    indices[..., :Tk] = torch.where(listed, order + offset, -1).to(torch.int32)
    return SparseCall(
        (),
        q.reshape(B * Tq, h, D),
        k.reshape(B * Tk, 1, D),
        indices.reshape(B * Tq, 1, topk).to(q.device),
        inputs.value.shape[-1],
        _scale(inputs),
    )


def _sparse_build(
    caps: Capabilities, inputs: Inputs, lse: bool, overrides: dict[str, Any]
) -> Arguments:
    return sparse_arguments(caps, _dense_call(caps, inputs), overrides)


def triple(out: object) -> tuple[object, object, object]:
    """``out`` as (output, max_logits, lse): `Failure` if it is not a triple."""
    if not isinstance(out, tuple | list) or len(out) != 3:
        raise Failure(
            f"flash_mla_sparse_fwd returns (out, max_logits, lse), returned "
            f"{type(out).__name__}{f' of {len(out)}' if isinstance(out, tuple | list) else ''}"
        )
    return out[0], out[1], out[2]


def read_sparse(
    out: object, call: SparseCall, lse: bool
) -> tuple[list[object], list[object] | None, object]:
    """Each query's output ``(h, 1, d_v)`` and LSE ``(h, 1)`` (when ``lse``), and the
    call's ``max_logits`` as returned."""
    first, peak, lse_out = triple(out)
    Tq, h = call.q.shape[:2]
    if isinstance(first, Tensor) and tuple(first.shape) == (Tq, h, call.d_v):
        first = first[:, None]  # (Tq, 1, h, d_v): each query a row of one
    if isinstance(lse_out, Tensor) and tuple(lse_out.shape) == (Tq, h):
        lse_out = lse_out[..., None]  # (Tq, h, 1)
    outs, lses = per_row(first, lse_out, (Tq, 1, h, call.d_v), lse)
    return outs, lses, peak


def _sparse_read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    first, _, lse_out = triple(out)
    B = math.prod(inputs.query.shape[:-3])
    h, Tq = inputs.query.shape[-3:-1]
    Dv = inputs.value.shape[-1]
    if isinstance(first, Tensor):
        if tuple(first.shape) != (B * Tq, h, Dv):
            raise Failure(f"returned shape {tuple(first.shape)}, expected {(B * Tq, h, Dv)}")
        first = flash_back(first.reshape(B, Tq, h, Dv), inputs.query[..., :Dv])
    if not lse:
        return first, None
    if isinstance(lse_out, Tensor):
        if tuple(lse_out.shape) != (B * Tq, h):
            raise Failure(
                f"returned a log-sum-exp of shape {tuple(lse_out.shape)}, expected {(B * Tq, h)}"
            )
        lse_out = lse_out.reshape(B, Tq, h).transpose(1, 2).reshape(inputs.query.shape[:-1])
    return first, lse_out


def _native_causal(caps: Capabilities, inputs: Inputs) -> bool:
    return True  # any diagonal is indices


# ------------------------------------------------ the adapter from a dense callable


def sparse_form(
    attend: Callable[..., Any], name: str, *, bugs: frozenset[str] = frozenset()
) -> Callable[..., Any]:
    """``attend(q (n, h, D), rows (n, k, D), valid (n, k), scale, d_v) -> (out, max_logits,
    lse)`` (each query against its own gathered rows) with ``flash_mla_sparse_fwd``'s
    signature: the rows gathered through the indices, invalid ones masked.

    ``bugs`` plants class-36 bugs, for the mutants: ``invalid_as_zero`` (an invalid index
    read as row 0, not ignored), ``past_end_wraps`` (an index at ``Tk`` or past it taken
    modulo ``Tk``), ``tail_block_dropped`` (the entries past the last full block of 64
    ignored), ``duplicates_once`` (an index listed twice counted once), ``lse_base2``
    (the LSE in base 2), ``max_logits_unscaled`` (``max_logits`` of ``q k^T`` before
    the scale), ``topk_length_ignored`` (every entry read, whatever the counts),
    ``sink_ignored`` (``attn_sink`` not applied), ``sink_in_lse`` (the LSE returned with
    the sink counted in it).
    """

    @checked_internal
    def sparse(
        q: Float[Tensor, "Tq h D"],
        kv: Float[Tensor, "Tk 1 D"],
        indices: Int[Tensor, "Tq 1 topk"],
        sm_scale: float,
        d_v: int = 512,
        attn_sink: Float[Tensor, " h"] | None = None,
        topk_length: Int[Tensor, " Tq"] | None = None,
    ) -> tuple[Float[Tensor, "Tq h {d_v}"], Float[Tensor, "Tq h"], Float[Tensor, "Tq h"]]:
        Tk, topk = kv.shape[0], indices.shape[-1]
        idx = indices[:, 0].long()  # (Tq, topk)
        valid = idx >= 0
        if "past_end_wraps" in bugs:
            idx = torch.where(valid, idx % max(Tk, 1), idx)
        valid &= idx < Tk
        if "invalid_as_zero" in bugs:
            valid = torch.ones_like(valid)
        if topk_length is not None and "topk_length_ignored" not in bugs:
            valid &= torch.arange(topk, device=idx.device) < topk_length[:, None].long()
        if "tail_block_dropped" in bugs:
            valid &= torch.arange(topk, device=idx.device) < topk // TOPK_BLOCK * TOPK_BLOCK
        if "duplicates_once" in bugs:  # a later copy of an index already listed is dropped
            earlier = (idx[:, :, None] == idx[:, None, :]) & valid[:, None, :]
            valid &= ~earlier.tril(diagonal=-1).any(-1)
        # a chunk of queries at a time: each gathers its own rows, (chunk, topk, D)
        n = chunk_queries(topk * kv.shape[-1])
        parts = [
            attend(q[s : s + n], kv[:, 0][idx[s : s + n].clamp(0, max(Tk - 1, 0))],
                   valid[s : s + n], sm_scale, d_v)
            for s in range(0, max(q.shape[0], 1), n)
        ]  # fmt: skip
        out, peak, lse = (torch.cat(x) for x in zip(*parts, strict=True))
        if "lse_base2" in bugs:
            lse = lse / math.log(2)
        if "max_logits_unscaled" in bugs:
            peak = peak / sm_scale
        if attn_sink is not None and "sink_ignored" not in bugs:
            sink = attn_sink.to(lse.dtype)
            out = out * torch.sigmoid(lse - sink)[..., None].nan_to_num(0.0)
            if "sink_in_lse" in bugs:
                lse = torch.where(torch.isposinf(lse), lse, torch.logaddexp(lse, sink))
        return out.to(q.dtype), peak, lse

    sparse.__name__ = sparse.__qualname__ = name
    sparse.__doc__ = f"{attend.__doc__ or ''}\n\nIn flash_mla_sparse_fwd's convention."
    return sparse


@checked_internal
def _sdpa_attend(
    q: Float[Tensor, "n h D"],
    rows: Float[Tensor, "n k D"],
    valid: Tensor,
    scale: float,
    d_v: int,
) -> tuple[Float[Tensor, "n h {d_v}"], Float[Tensor, "n h"], Float[Tensor, "n h"]]:
    """torch's SDPA on each query's gathered rows (one key/value head shared by every
    query head, invalid rows masked); ``max_logits`` and the LSE from the scores in
    float32. The heads of a query are SDPA's queries against its one KV head: no copy
    of the rows per head."""
    rows = torch.where(valid[..., None], rows, 0.0)
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, None], rows[:, None], rows[:, None, :, :d_v], attn_mask=valid[:, None, None],
        scale=scale,
    )[:, 0]  # fmt: skip
    _, peak, lse = score_stats(q, rows, valid, scale)
    return torch.where(torch.isposinf(lse)[..., None], 0.0, out.nan_to_num()), peak, lse


# ------------------------------------------------------------------ the builtins

_OURS = replace(
    sparse_caps(Capabilities(family=NAME)),
    topk_length=True,
    attn_sink=True,
    invalid_indices=("-1", "past_end"),
    masked_nan="contained",
)


@checked_internal
def _reference(
    q: Float[Tensor, "Tq h D"],
    kv: Float[Tensor, "Tk 1 D"],
    indices: Int[Tensor, "Tq 1 topk"],
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Float[Tensor, " h"] | None = None,
    topk_length: Int[Tensor, " Tq"] | None = None,
) -> tuple[Float[Tensor, "Tq h {d_v}"], Float[Tensor, "Tq h"], Float[Tensor, "Tq h"]]:
    """attnref's `attnref.sparse.sparse_mla_attention`."""
    return sparse_mla_attention(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)


#: attnref's reference and torch's SDPA over the gathered rows in FlashMLA's sparse
#: convention: ``attnref audit --api sparse-mla --backend
#: attnref.conformance.families.sparse_mla:sparse_sdpa`` audits one as a user's kernel
sparse_reference = declared(_reference, _OURS)
sparse_sdpa = declared(sparse_form(_sdpa_attend, "sparse_sdpa"), _OURS)


def _flash_mla_sparse(*args: Any, **kwargs: Any) -> Any:
    """FlashMLA's ``flash_mla_sparse_fwd`` (the ``flash_mla`` package, Hopper or
    Blackwell GPUs)."""
    from flash_mla import flash_mla_sparse_fwd

    return flash_mla_sparse_fwd(*args, **kwargs)


def _builtins() -> list[Backend]:
    return [
        Backend("sparse-mla-reference", sparse_reference,
                "attnref's sparse_mla_attention (dense attention over the selected rows)",
                _OURS, api=NAME),
        Backend("sparse-mla-sdpa", sparse_sdpa,
                "torch SDPA on each query's gathered rows (its heads the queries, invalid masked)",
                _OURS, api=NAME),
        Backend("flash-mla-sparse", _flash_mla_sparse,
                "FlashMLA's flash_mla_sparse_fwd (skipped where flash_mla is absent)",
                replace(FLASH_MLA_SPARSE, devices=("cuda",)), api=NAME, needs="flash_mla"),
    ]  # fmt: skip


# ---------------------------------------------------------------- the cases


def _counts(case: Case, topk: int, Tk: int, gen: torch.Generator, block: int) -> list[int]:
    """How many valid entries each query's list holds (``case.option("valid")``):
    ``all`` (every entry), ``random``, ``tile`` (one below, at and one above a multiple
    of ``block``), ``empty`` (some queries none at all); at most ``Tk`` without
    duplicates."""
    most = topk if case.option("duplicates") else min(topk, Tk)
    kind = case.option("valid", "random")
    counts = []
    for i in range(case.Tq):
        if kind == "all":
            n = most
        elif kind == "tile":
            edges = [m * block + d for m in range(1, most // block + 2) for d in (-1, 0, 1)]
            edges = [e for e in edges if 0 < e <= most] or [most]
            n = edges[int(torch.randint(len(edges), (), generator=gen))]
        else:
            n = int(torch.randint(most + 1, (), generator=gen))
        if kind == "empty" and i % 2 == 0:
            n = 0
        counts.append(n if Tk else 0)
    return counts


def _filler(case: Case, shape: tuple[int, ...]) -> Tensor:
    """Finite values for the rows no valid entry names, drawn apart from the case's own
    (its seed's stream unchanged): large enough that a row read as a token shows."""
    gen = torch.Generator().manual_seed(case.seed * 31 + 7)
    return 8.0 * torch.randn(shape, generator=gen) + 4.0


def build_sparse(
    case: Case, dtype: torch.dtype, device: str | torch.device, caps: Capabilities
) -> SparseCall:
    """The call ``case`` describes: ``case.Tq`` queries of ``case.h`` heads, ``case.Tk``
    latent rows of ``case.Dh`` dims (the values their first ``case.Dv``), top-k lists
    ``case.option("topk")`` long. Each query selects its valid count (`_counts`) of rows
    (with repeats, ``duplicates``); the other entries hold invalid sentinels of the kinds
    ``case.option("sentinels")`` names (``-1``, ``past_end``: ``Tk`` and past), or, with
    ``topk_length``, rows the count excludes; ``order`` ``sorted`` lists the valid
    entries first, ``shuffled`` mixes them; ``sink`` draws a sink logit per head
    (`sink_logits`). Every row no query selects, and one row before and after the call's
    ``kv`` in its buffer, hold NaN where ``caps.masked_nan`` is ``contained`` (else finite
    values of their own, `_filler`)."""
    gen = torch.Generator().manual_seed(case.seed)
    Tq, Tk, h, D, Dv = case.Tq, case.Tk, case.h, case.Dh, case.Dv
    topk = int(case.option("topk", max(Tk, 1)))
    proto = torch.empty((), dtype=dtype, device=device)
    q32 = case.amp * torch.randn((Tq, h, D), generator=gen)
    k32 = case.amp * torch.randn((Tk, 1, D), generator=gen)
    # class 33's values (``case.logits``: far, peaked, moving scores, outlier channels),
    # as the dense families plant them; V is K's leading dims, so no ``v_offset``
    q32, k32, _ = shape_values(case, dtype, q32.transpose(0, 1), k32.transpose(0, 1),
                                k32.transpose(0, 1)[..., :Dv])  # fmt: skip
    q = q32.transpose(0, 1).to(proto)
    # what rows no valid entry names hold: NaN where the declaration says NaN there never
    # reaches the output; else finite values of their own (an implementation that
    # materialises P @ V over gathered rows, weight 0 times NaN, is not wrong for it)
    filler = _filler(case, (Tk + 2, 1, D)) if caps.masked_nan == "propagates" else None
    buffer = torch.full((Tk + 2, 1, D), math.nan, dtype=dtype, device=device)
    if filler is not None:
        buffer.copy_(filler)
    buffer[1 : Tk + 1] = k32.transpose(0, 1).to(proto)
    block = caps.tile_keys or TOPK_BLOCK
    counts = _counts(case, topk, Tk, gen, block)
    sentinels = case.option("sentinels", ("-1",))
    counted = bool(case.option("topk_length"))
    indices = torch.empty((Tq, topk), dtype=torch.int64)
    chosen: list[Tensor] = []
    for i, n in enumerate(counts):
        if case.option("duplicates") and n:
            sel = torch.randint(Tk, (n,), generator=gen)
            if n > 1:
                sel[-1] = sel[0]  # at least one repeat
        else:
            sel = torch.randperm(Tk, generator=gen)[:n]
        junk = []
        for j in range(topk - n):
            kind = sentinels[j % len(sentinels)]
            junk.append(-1 - j % 3 if kind == "-1" else Tk + j % 3)
        entries = torch.cat([sel, torch.tensor(junk, dtype=torch.int64)])
        if case.option("order") == "shuffled" and not counted:
            entries = entries[torch.randperm(topk, generator=gen)]
        indices[i] = entries
        chosen.append(sel)
    kv = buffer[1 : Tk + 1]
    used = torch.zeros(Tk, dtype=torch.bool)
    for sel in chosen:
        used[sel] = True
    unused = (~used).to(device)  # no query reads them
    if filler is None:
        kv[unused] = math.nan
    else:
        kv.copy_(torch.where(unused[:, None, None], filler[1 : Tk + 1].to(kv), kv))
    lengths = None
    if counted:  # past each count: valid-looking indices of NaN rows, or of chosen rows
        lengths = torch.tensor(counts, dtype=torch.int32, device=device)
        spare = (~used).nonzero().flatten()
        for i, n in enumerate(counts):
            pool = spare if len(spare) else torch.arange(Tk)
            if len(pool) and topk > n:
                pick = torch.randint(len(pool), (topk - n,), generator=gen)
                indices[i, n:] = pool[pick]
    rows = tuple(
        Inputs(q[i][:, None], kv[sel.to(device), 0][None], kv[sel.to(device), 0][None, :, :Dv],
               None, None, case.scale)
        for i, sel in enumerate(chosen)
    )  # fmt: skip
    sm_scale = D**-0.5 if case.scale is None else case.scale
    rows, sinks = with_sinks(case, rows, sm_scale)
    return SparseCall(
        rows,
        q,
        kv,
        indices[:, None].to(torch.int32).to(device),
        Dv,
        sm_scale,
        lengths,
        None if sinks is None else sinks.to(device),
    )


@checked_internal
def with_sinks(
    case: Case, rows: tuple[Inputs, ...], sm_scale: float
) -> tuple[tuple[Inputs, ...], Float[Tensor, " h"] | None]:
    """``rows`` each with the sink logits ``case.option("sink")`` asks for (`sink_logits`),
    and those logits (on the CPU); ``rows`` as they are and None where it asks for none."""
    if not case.option("sink"):
        return rows, None
    sinks = sink_logits(case, rows, sm_scale)
    return tuple(replace(x, sinks=sinks.to(x.query.device)) for x in rows), sinks


@checked_internal
def sink_logits(case: Case, rows: tuple[Inputs, ...], sm_scale: float) -> Float[Tensor, " h"]:
    """A sink logit per head ``(h,)``, float32, near the head's log-sum-exps (their
    median over the queries, plus a normal draw of spread 1.5), so that the output's
    factor ``sigmoid(lse - sink)`` lies well inside (0, 1) and a sink applied to the
    wrong head, in base 2, counted in the LSE or not at all is far off. With
    ``sink="some_none"`` one head's is ``-inf``: no sink, which changes nothing."""
    gen = rng(case, 13)
    h = rows[0].query.shape[0] if rows else case.h
    lses: list[Tensor] = []
    for x in rows:
        if x.key.shape[-2]:
            s = sm_scale * x.query.double() @ x.key.double().transpose(-1, -2)  # (h, 1, n)
            lses.append(torch.logsumexp(s, dim=-1)[:, 0].cpu())
    centre = torch.stack(lses).median(0).values if lses else torch.zeros(h, dtype=torch.float64)
    sinks = (centre + 1.5 * torch.randn(h, generator=gen, dtype=torch.float64)).float()
    if case.option("sink") == "some_none":
        sinks[int(torch.randint(h, (), generator=gen))] = -math.inf
    return sinks


def _call(
    ctx: Context, call: SparseCall, lse: bool = True
) -> tuple[list[Tensor], list[Tensor] | None, object]:
    """The backend's output (and LSE) for each query of ``call``, and its max_logits."""
    args, kwargs = sparse_arguments(ctx.caps, call, {})
    guard(ctx, call.first, kwargs)
    raw = invoke(ctx.backend, Job(args, kwargs), ctx.timeout, ctx.executor)
    note_reading(ctx.executor, raw, lambda r: zip(
        call.rows, *with_lses(read_sparse(r, call, lse and ctx.caps.lse)[:2]), strict=True
    ))  # fmt: skip
    outs, lses, peak = read_sparse(raw, call, lse and ctx.caps.lse)
    got, got_lse = judge(outs, lses, call.rows)
    return got, got_lse, peak


def _check_max_logits(ctx: Context, peak: object, call: SparseCall) -> None:
    """``max_logits`` against the largest scaled score of each query's rows (``-inf``
    for a query with none), within its LSE's bound (a score's error moves both alike)."""
    Tq, h = call.q.shape[:2]
    if not isinstance(peak, Tensor) or tuple(peak.shape) != (Tq, h):
        shape = tuple(peak.shape) if isinstance(peak, Tensor) else type(peak).__name__
        raise Failure(f"returned max_logits of {shape}, expected a tensor of {(Tq, h)} (Tq, h)")
    if not peak.is_floating_point():
        raise Failure(f"returned max_logits of dtype {peak.dtype}, expected a float dtype")
    for i, x in enumerate(call.rows):
        got = peak[i].detach().to(torch.float64).cpu()
        if x.key.shape[-2] == 0:
            if not bool(torch.isneginf(got).all()):
                raise Failure(
                    f"query {i} has no valid index: max_logits {got.tolist()}, expected -inf",
                    kind="error",
                )
            continue
        scale = _scale(x)
        exact = (scale * x.query.double() @ x.key.double().transpose(-1, -2)).amax(-1)[:, 0]
        el = expect_lse(x, ctx.caps.empty_lse)

        def peak_of(r: object, i: int = i) -> object:
            return cast(Any, triple(r)[1])[i]

        ctx.answer_part(f"max_logits of query {i}", peak_of, exact, el.bounds())
        close(got, exact.cpu(), *el.bounds(), f"query {i} (of {x.key.shape[-2]} rows): max_logits")


def _sparse(ctx: Context, case: Case) -> None:
    """Each query agrees with the oracle of the rows it selects: output, LSE and
    max_logits; invalid entries, rows no query selects and the rows around ``kv`` hold
    NaN or point past it, and never matter."""
    call = build_sparse(case, ctx.dtype, ctx.device, ctx.caps)
    outs, lses, peak = _call(ctx, call)
    agree(ctx, outs, lses, call.rows, "query")
    if ctx.caps.max_logits:
        _check_max_logits(ctx, peak, call)


def _sparse_order(ctx: Context, case: Case) -> None:
    """The order of a query's entries never matters: each list permuted (its count kept,
    with ``topk_length``, by permuting only the counted entries)."""
    call = build_sparse(case, ctx.dtype, ctx.device, ctx.caps)
    base, _, _ = _call(ctx, call, lse=False)
    gen = rng(case, 11)
    indices = call.indices.clone()
    for i in range(indices.shape[0]):
        n = indices.shape[-1] if call.topk_length is None else int(call.topk_length[i])
        indices[i, 0, :n] = indices[i, 0, :n][torch.randperm(n, generator=gen).to(indices.device)]
    moved, _, _ = _call(ctx, replace(call, indices=indices), lse=False)
    for i, x in enumerate(call.rows):  # the oracle does not depend on the rows' order
        law(ctx, moved[i], x, base[i], x, f"query {i}: its entries permuted")


def _sparse_cases(
    name: str, **pins: Any
) -> Callable[[Profile, Capabilities], st.SearchStrategy[Case]]:
    """Sparse calls: 1 to 8 queries of 1, 3 or 16 heads, 1 to 160 rows, top-k lists up
    to twice the rows (a multiple of the declared one), explicit scales often; the
    options: ``topk``, ``valid`` counts, invalid ``sentinels`` (among those declared),
    ``duplicates`` (where counted), ``order`` and ``topk_length`` (where taken); the
    values of class 33 (``logits``) as the dense cases draw them."""

    def cases(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
        fields: dict[str, Any] = {
            "batch": (),
            "mask": "none",
            "layout": "contiguous",
            "causal": None,
            "g": 1,
            "group": st.sampled_from((3, 1, 16)),
            "Tq": st.integers(1, 8),
            "Tk": st.integers(1, 160),
            "scale": st.sampled_from((None, 0.37, 192**-0.5, 1.0)),
            "v_offset": 0.0,
        }
        fields.update({k: v for k, v in pins.items() if k in Case.__dataclass_fields__})
        base = case_strategy(name, p, c, sizes=("small",), **fields)
        m = max(c.topk_multiple, 1)
        forms = tuple(f for f in ("-1", "past_end") if f in c.invalid_indices) or ("-1",)

        @st.composite
        def draw(draw: st.DrawFn) -> Case:
            case = draw(base)
            Tk = case.Tk
            tile = c.tile_keys or TOPK_BLOCK
            near = [t for b in (tile, 2 * tile) for t in (b - 1, b, b + 1)]
            topk = draw(st.one_of(st.integers(1, 2 * Tk + 2), st.sampled_from(near)))
            topk = max(-(-topk // m) * m, m)
            valid = pins.get("valid", st.sampled_from(("random", "all", "tile", "empty")))
            repeats = pins.get("duplicates", st.booleans())
            opts = {
                "topk": topk,
                "valid": draw(valid),
                "sentinels": draw(st.sampled_from((forms, forms[:1], forms[-1:]))),
                "duplicates": c.duplicates == "counted" and draw(repeats),
                "order": draw(pins.get("order", st.sampled_from(("sorted", "shuffled")))),
                "topk_length": c.topk_length and draw(pins.get("topk_length", st.booleans())),
            }
            if "sink" in pins:  # only where pinned: the other properties' draws stay as they were
                opts["sink"] = draw(pins["sink"])
            return replace(case, options=tuple(opts.items()))

        return draw()

    return cases


#: the rows of the far case: DeepSeek's 131,072 tokens and a partial block past them
FAR_ROWS = 2**17 + 77


def _sparse_examples(p: Profile, c: Capabilities) -> list[Case]:
    """Where class 36 shows: a query with no valid index beside ones with many, the
    last partial block of a long list, past-the-end and ``-1`` entries mixed, repeats;
    and rows past 2**16 (DeepSeek's models index 131,072 tokens: a kernel that keeps its
    indices in 16 bits passed every drawn case, at most 160 rows)."""
    m = max(c.topk_multiple, 1)
    tile = c.tile_keys or TOPK_BLOCK

    def up(n: int) -> int:
        return max(-(-n // m) * m, m)

    both = tuple(f for f in ("-1", "past_end") if f in c.invalid_indices) or ("-1",)
    base = [
        Case("sparse_empty_query", h=3, Tq=3, Tk=40,
             options=(("topk", up(48)), ("valid", "empty"), ("sentinels", both))),
        Case("sparse_partial_block", h=16, Tq=2, Tk=2 * tile + 9, scale=0.37,
             options=(("topk", up(2 * tile + 7)), ("valid", "all"), ("sentinels", both))),
        Case("sparse_repeats", h=3, Tq=4, Tk=20,
             options=(("topk", up(24)), ("valid", "random"), ("duplicates",
                      c.duplicates == "counted"), ("order", "shuffled"), ("sentinels", both))),
        Case("sparse_far_rows", h=3, Tq=2, Tk=FAR_ROWS,
             options=(("topk", up(64)), ("valid", "all"), ("sentinels", both))),
    ]  # fmt: skip
    return [replace(x, g=1, Dh=40, Dv=32, latent=True, seed=500 + i) for i, x in enumerate(base)]


def _sink_examples(p: Profile, c: Capabilities) -> list[Case]:
    """A sink beside a query with no valid index (its output stays 0, its LSE +inf), and
    one over a long list with a partial last block."""
    m = max(c.topk_multiple, 1)
    tile = c.tile_keys or TOPK_BLOCK
    both = tuple(f for f in ("-1", "past_end") if f in c.invalid_indices) or ("-1",)
    base = [
        Case("sparse_sink_empty", h=3, Tq=4, Tk=30,
             options=(("topk", max(-(-32 // m) * m, m)), ("valid", "empty"),
                      ("sentinels", both), ("sink", "some_none"))),
        Case("sparse_sink_long", h=16, Tq=2, Tk=2 * tile + 5, scale=0.37,
             options=(("topk", max(-(-(2 * tile + 5) // m) * m, m)), ("valid", "all"),
                      ("sentinels", both), ("sink", "near"))),
    ]  # fmt: skip
    return [replace(x, g=1, Dh=40, Dv=32, latent=True, seed=600 + i) for i, x in enumerate(base)]


#: the sink options a sink property draws: every head's near its LSEs, or one head's -inf
SINKS = st.sampled_from(("near", "some_none"))

PROPERTIES: tuple[Property, ...] = (
    Property(
        "sparse_mla",
        "each query of a sparse call agrees with the oracle of the rows it selects "
        "(output, LSE, max_logits); invalid entries, unselected rows and the rows around "
        "kv hold NaN or point past it",
        (36, 27, 12),
        _sparse_cases("sparse_mla"),
        _sparse,
        examples=_sparse_examples,
        families=(NAME,),
    ),
    Property(
        "sparse_tiles",
        "valid counts one below, at and one above the top-k block (64, or the declared "
        "tile): the last partial block counts",
        (36, 12),
        _sparse_cases("sparse_tiles", valid=st.just("tile")),
        _sparse,
        families=(NAME,),
    ),
    Property(
        "sparse_empty",
        "a query whose entries are all invalid gives 0, an LSE of +inf and max_logits of "
        "-inf, and leaves the others as they are",
        (36, 35),
        _sparse_cases("sparse_empty", valid=st.just("empty")),
        _sparse,
        families=(NAME,),
    ),
    Property(
        "sparse_order",
        "the order of a query's entries never matters",
        (36,),
        _sparse_cases("sparse_order", order=st.just("sorted")),
        _sparse_order,
        families=(NAME,),
    ),
    Property(
        "sparse_sink",
        "a sink logit per head (attn_sink) scales each query's output by sigmoid(lse - "
        "sink), a sink of -inf changes nothing, the LSE and max_logits stay the keys' own",
        (24, 36),
        _sparse_cases("sparse_sink", sink=SINKS),
        _sparse,
        requires=sink_declared,
        examples=_sink_examples,
        families=(NAME,),
    ),
)


# ------------------------------------------------------------------- the mutants


def _mutant_fn(self: Mutant) -> Callable[..., Any]:
    """A bug in how indices are read or results given back: the reference's attention
    over gathered rows behind a buggy `sparse_form`."""
    fn = sparse_form(attend_rows, self.name, bugs=frozenset(self.switches))
    fn.__doc__ = f"Class {self.bug_class}: {self.summary}"
    fn.capabilities = self.capabilities  # type: ignore[attr-defined]
    return fn


_LIKE: dict[str, Any] = {"api": NAME, "capabilities": _OURS}

MUTANTS: tuple[Mutant, ...] = (
    Mutant("sparse_invalid_as_zero", 36, "an invalid index (-1, or past the rows) read as "
           "row 0 instead of ignored", {"invalid_as_zero": True}, **_LIKE),
    Mutant("sparse_past_end_wraps", 36, "an index at Tk or past it taken modulo Tk (read "
           "as a row) instead of ignored", {"past_end_wraps": True}, **_LIKE),
    Mutant("sparse_tail_block_dropped", 12, "the entries past the last full block of 64 "
           "in a top-k list ignored", {"tail_block_dropped": True}, **_LIKE),
    Mutant("sparse_duplicates_once", 36, "an index listed twice counted once",
           {"duplicates_once": True}, **_LIKE),
    Mutant("sparse_lse_base2", 35, "the LSE returned in base 2 where the natural log is "
           "the convention", {"lse_base2": True}, **_LIKE),
    Mutant("sparse_max_logits_unscaled", 35, "max_logits of q k^T before sm_scale",
           {"max_logits_unscaled": True}, **_LIKE),
    Mutant("sparse_topk_length_ignored", 36, "per-query counts (topk_length) ignored: "
           "every entry read", {"topk_length_ignored": True}, **_LIKE),
    Mutant("sparse_sink_ignored", 24, "the sink logits (attn_sink) taken and never applied",
           {"sink_ignored": True}, **_LIKE),
    Mutant("sparse_sink_in_lse", 24, "the LSE returned with the sink counted in it "
           "(logaddexp(lse, sink)), where FlashMLA's leaves it the keys' own",
           {"sink_in_lse": True}, **_LIKE),
)  # fmt: skip


FAMILY = ApiFamily(
    name=NAME,
    alignments=("top_left", "bottom_right"),
    summary="FlashMLA's flash_mla_sparse_fwd: DeepSeek's token-level sparse attention over "
    "latent rows, each query the rows its top-k indices name, one KV head, V the rows' "
    "first d_v dims",
    signature="fn(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None) "
    "-> (out, max_logits, lse)",
    positional=4,
    keywords=("d_v",),
    defaults=FLASH_MLA_SPARSE,
    build=_sparse_build,
    read=_sparse_read,
    to_layout=flash_layout,
    from_layout=flash_back,
    native_causal=_native_causal,
    dropout=False,
    indexed=True,
    builtins=_builtins,
    properties=PROPERTIES,
    mutants=MUTANTS,
    mutant_fn=_mutant_fn,
)
