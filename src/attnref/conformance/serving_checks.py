"""The checks only packed and paged calls can have (the flash-varlen and flash-kvcache
families; docs/varlen.md, docs/kvcache.md).

Each sequence of a pack and each batch row of a decode call is judged as the dense
inputs it amounts to (`attnref.conformance.serving`), against the same oracle and with
the same bounds as a dense call (`Context.expect`); the laws compare two calls of the
backend with `attnref.conformance.checks._law`.
"""

import math
from dataclasses import replace

import torch
from torch import Tensor

from attnref.conformance.calls import check_lse, check_output, invoke, skip_reason
from attnref.conformance.cases import Case, Inputs
from attnref.conformance.checks import Context, _gen, _law
from attnref.conformance.families import cache_arguments, pack_arguments, read_cache, read_pack
from attnref.conformance.oracle import Expected, close, expect_lse
from attnref.conformance.serving import GARBAGE, CacheCall, Pack, build_cache, build_pack
from attnref.conformance.verdicts import Failure, Skip
from attnref.conformance.worker import Job
from attnref.rotary import halves_from_interleaved
from attnref.tolerances import score_condition

__all__ = [
    "kvcache",
    "kvcache_decode",
    "kvcache_pages",
    "kvcache_splits",
    "rotary_layouts",
    "rotary_shift",
    "varlen",
    "varlen_alone",
    "varlen_padding",
    "varlen_permutation",
]

Results = tuple[list[Tensor], list[Tensor] | None]


def _judge(outs: list[object], lses: list[object] | None, like: tuple[Inputs, ...]) -> Results:
    """Each part checked for type, shape, dtype and device, as a dense output is."""
    checked = [
        check_output(o, (*x.query.shape[:-1], x.value.shape[-1]), x).detach()
        for o, x in zip(outs, like, strict=True)
    ]
    if lses is None:
        return checked, None
    return checked, [check_lse(lse, x) for lse, x in zip(lses, like, strict=True)]


def _guard(ctx: Context, first: Inputs, kwargs: dict[str, object]) -> None:
    reason = skip_reason(ctx.backend, first, kwargs)
    if reason is not None:
        raise Skip(reason)


def _require(ctx: Context, api: str) -> None:
    if ctx.backend.api != api:
        raise Skip(f"a property of the {api!r} family")


def _call_pack(ctx: Context, pack: Pack, lse: bool = False) -> Results:
    """The backend's output (and LSE) for each sequence of ``pack``."""
    _require(ctx, "flash-varlen")
    if lse and not ctx.caps.lse:
        raise Skip("the log-sum-exp not declared")
    args, kwargs = pack_arguments(ctx.caps, pack, lse)
    _guard(ctx, pack.first, kwargs)
    raw = invoke(ctx.backend, Job(args, kwargs), ctx.timeout, ctx.executor)
    outs, lses = read_pack(raw, pack, lse)
    return _judge(outs, lses, pack.seqs)


def _call_cache(
    ctx: Context, call: CacheCall, lse: bool = False
) -> tuple[list[Tensor], list[Tensor] | None, tuple[Tensor, Tensor]]:
    """The backend's output (and LSE) for each row of ``call``, and the cache as it left
    it (the call gets copies: ``call`` itself is never written)."""
    _require(ctx, "flash-kvcache")
    if lse and not ctx.caps.lse:
        raise Skip("the log-sum-exp not declared")
    call = replace(call, k_cache=call.k_cache.clone(), v_cache=call.v_cache.clone())
    args, kwargs = cache_arguments(ctx.caps, call, lse)
    _guard(ctx, call.first, kwargs)
    appends = call.k_new is not None
    job = Job(args, kwargs, writable=(1, 2) if appends else ())
    raw = invoke(ctx.backend, job, ctx.timeout, ctx.executor)
    caches = (call.k_cache, call.v_cache)
    if appends:
        raw, caches = raw
    outs, lses = read_cache(raw, call, lse)
    checked, checked_lses = _judge(outs, lses, call.rows)
    return checked, checked_lses, caches


def _rotation_slack(x: Inputs, output: bool = True) -> float:
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


def _expect(ctx: Context, x: Inputs, rotated: bool) -> Expected:
    """``x``'s oracle; for rotated inputs with the rounding of the rotation added, and
    kept as ``x``'s oracle for the rest of the check (a law on ``x`` uses it too)."""
    exp = ctx.expect(x)
    if not rotated or exp.derived:
        return exp
    slack = _rotation_slack(x)
    exp = replace(exp, floor=exp.floor + slack, derived=slack)
    ctx._oracles[id(x)] = (x, exp)
    return exp


def _agree(
    ctx: Context,
    outs: list[Tensor],
    lses: list[Tensor] | None,
    like: tuple[Inputs, ...],
    what: str,
    rotated: bool = False,
) -> None:
    """Every part against its oracle: the output, and the LSE when there is one."""
    for n, (out, x) in enumerate(zip(outs, like, strict=True)):
        Tq, Tk = x.query.shape[-2], x.key.shape[-2]
        label = f"{what} {n} (Tq = {Tq}, Tk = {Tk})"
        exp = _expect(ctx, x, rotated)
        with ctx.naming_the_row(x):
            close(out.to(torch.float64), exp.value, *exp.bounds(), f"{label}: output")
        if lses is not None:
            el = expect_lse(x, ctx.caps.empty_lse)
            if rotated:
                el = replace(el, floor=el.floor + _rotation_slack(x, output=False))
            close(lses[n].to(torch.float64), el.value, *el.bounds(), f"{label}: log-sum-exp")


# -------------------------------------------------------------------------- packs


def varlen(ctx: Context, case: Case) -> None:
    """Each sequence of the pack agrees with the oracle of it alone, output and LSE."""
    pack = build_pack(case, ctx.dtype, ctx.device)
    outs, lses = _call_pack(ctx, pack, lse=ctx.caps.lse)
    _agree(ctx, outs, lses, pack.seqs, "sequence")


def _alone(pack: Pack, n: int) -> Pack:
    slopes = pack.alibi_slopes
    if slopes is not None and slopes.dim() == 2:
        slopes = slopes[n : n + 1]
    return replace(
        pack, seqs=(pack.seqs[n],), pad_q=pack.pad_q[:0], pad_k=pack.pad_k[:0],
        pad_v=pack.pad_v[:0], alibi_slopes=slopes,
    )  # fmt: skip


def _picks(case: Case, n: int) -> list[int]:
    return sorted({0, n - 1, int(torch.randint(0, n, (), generator=_gen(case, 3)))})


def varlen_alone(ctx: Context, case: Case) -> None:
    """A sequence gives the same output in the pack as in a pack of its own."""
    pack = build_pack(case, ctx.dtype, ctx.device)
    full, _ = _call_pack(ctx, pack)
    for n in _picks(case, len(pack.seqs)):
        alone, _ = _call_pack(ctx, _alone(pack, n))
        x = pack.seqs[n]
        _law(ctx, alone[0], x, full[n], x, f"sequence {n} of {len(pack.seqs)} alone")


def varlen_permutation(ctx: Context, case: Case) -> None:
    """Permuting the sequences of a pack permutes their outputs."""
    pack = build_pack(case, ctx.dtype, ctx.device)
    N = len(pack.seqs)
    order = torch.randperm(N, generator=_gen(case, 4)).tolist()
    if order == list(range(N)):
        order = order[::-1]
    full, _ = _call_pack(ctx, pack)
    moved, _ = _call_pack(ctx, pack.permuted(order))
    for i, n in enumerate(order):
        x = pack.seqs[n]
        _law(ctx, moved[i], x, full[n], x, f"sequence {n} moved to place {i} (order {order})")


def varlen_padding(ctx: Context, case: Case) -> None:
    """Padding tokens after the pack never matter: other garbage (NaN where the
    backend contains it), and more of it, changes no sequence's output."""
    pack = build_pack(case, ctx.dtype, ctx.device)
    full, _ = _call_pack(ctx, pack)
    extra = pack.pad_q.shape[0] + 3
    fill = math.nan if ctx.caps.masked_nan == "contained" else -GARBAGE

    def junk(t: Tensor) -> Tensor:
        return torch.full((extra, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)

    padded = replace(pack, pad_q=junk(pack.pad_q), pad_k=junk(pack.pad_k), pad_v=junk(pack.pad_v))
    other, _ = _call_pack(ctx, padded)
    for n, x in enumerate(pack.seqs):
        _law(ctx, other[n], x, full[n], x, f"sequence {n} with {extra} other padding tokens")


# ------------------------------------------------------------------------- caches


def _check_append(call: CacheCall, after: tuple[Tensor, Tensor]) -> None:
    """The append wrote the new keys (rotated) and values at exactly the new slots, and
    left every other byte of the cache as it was."""
    assert call.k_after is not None
    assert call.v_after is not None
    assert call.written is not None
    for name, got, want in (
        ("k_cache", after[0], call.k_after),
        ("v_cache", after[1], call.v_after),
    ):
        if not isinstance(got, Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            raise Failure(f"{name} came back as something other than the cache it was")
        same = (got == want) | (torch.isnan(got) & torch.isnan(want))
        outside = ~same & ~call.written[..., None, None]
        if bool(outside.any()):
            r, s = (int(i) for i in outside.nonzero()[0][:2])
            raise Failure(
                f"{name}: the call changed {int(outside.any(-1).any(-1).sum())} slots outside "
                f"the append; first at [{r}, {s}] (page or row {r}, slot {s})",
                where=(r, s),
            )
        inside = call.written[..., None, None].expand_as(got)
        if name == "v_cache" or call.rotary_cos is None:
            wrong = ~same & inside
        else:  # rotated in float32 and rounded: one rounding apart at most
            eps = torch.finfo(got.dtype).eps
            scale = want.double().abs() + float(call.k_new.double().abs().max())  # type: ignore[union-attr]
            wrong = ((got.double() - want.double()).abs() > eps * scale) & inside
        if bool(wrong.any()):
            r, s = (int(i) for i in wrong.nonzero()[0][:2])
            g, w = float(got[r, s].flatten()[0]), float(want[r, s].flatten()[0])
            raise Failure(
                f"{name}: the appended slot [{r}, {s}] holds the wrong values "
                f"(first element {g:.6g}, expected {w:.6g})",
                got=g,
                expected=w,
                where=(r, s),
            )


def kvcache(ctx: Context, case: Case) -> None:
    """Each row agrees with the oracle of its valid keys (output and LSE); the append
    writes exactly the new slots."""
    call = build_cache(case, ctx.dtype, ctx.device)
    outs, lses, after = _call_cache(ctx, call, lse=ctx.caps.lse)
    _agree(ctx, outs, lses, call.rows, "row", rotated=call.rotary_cos is not None)
    if call.k_new is not None:
        _check_append(call, after)


def _rows_law(
    ctx: Context, got: list[Tensor], base: list[Tensor], call: CacheCall, what: str
) -> None:
    for b, x in enumerate(call.rows):
        _law(ctx, got[b], x, base[b], x, f"row {b}: {what}")


def kvcache_pages(ctx: Context, case: Case) -> None:
    """Permuting the physical pages (and the block table with them), with other garbage
    in the pages no row uses, changes nothing."""
    call = build_cache(case, ctx.dtype, ctx.device)
    if call.block_table is None:
        raise Skip("a contiguous cache has no pages")
    base, _, _ = _call_cache(ctx, call)
    blocks = call.k_cache.shape[0]
    perm = torch.randperm(blocks, generator=_gen(case, 5))
    if bool((perm == torch.arange(blocks)).all()):
        perm = perm.flip(0)
    gen = _gen(case, 6)

    def move(t: Tensor) -> Tensor:
        out = torch.empty_like(t)
        out[perm.to(t.device)] = t
        return out

    k_cache, v_cache = move(call.k_cache), move(call.v_cache)
    table = perm.to(call.block_table.device)[call.block_table.long()].to(torch.int32)
    used = torch.zeros(blocks, dtype=torch.bool)
    for b, n in enumerate(call.cache_seqlens.tolist()):
        total = n + (0 if call.k_new is None else call.k_new.shape[1])
        used[table[b, : -(-total // k_cache.shape[1])].long().cpu()] = True
    free = (~used).nonzero().flatten().to(k_cache.device)
    k_cache[free] = (GARBAGE * torch.randn(k_cache[free].shape, generator=gen)).to(k_cache.dtype)
    v_cache[free] = (GARBAGE * torch.randn(v_cache[free].shape, generator=gen)).to(v_cache.dtype)
    moved, _, _ = _call_cache(
        ctx, replace(call, k_cache=k_cache, v_cache=v_cache, block_table=table)
    )
    _rows_law(ctx, moved, base, call, "physical pages permuted")


def kvcache_splits(ctx: Context, case: Case) -> None:
    """``num_splits`` (split-KV) changes nothing: the declared splits against one."""
    call = build_cache(case, ctx.dtype, ctx.device)
    one, _, _ = _call_cache(ctx, replace(call, num_splits=1))
    for splits in sorted({2, max(2, case.splits), 5}):
        split, _, _ = _call_cache(ctx, replace(call, num_splits=splits))
        _rows_law(ctx, split, one, call, f"num_splits = {splits} against 1")


def kvcache_decode(ctx: Context, case: Case) -> None:
    """Decoding one token at a time from an empty cache, each step appending its key,
    equals one causal prefill of all of them; and leaves the same cache."""
    if case.causal is None:
        raise Skip("decoding is causal")
    T = case.Tq
    empty = replace(case, cached=(0,) * len(case.cached), new=T, shift=0)
    prefill = build_cache(empty, ctx.dtype, ctx.device)
    full, _, (k_full, v_full) = _call_cache(ctx, prefill)
    k_cache, v_cache = prefill.k_cache, prefill.v_cache
    B = len(case.cached)
    assert prefill.k_new is not None
    assert prefill.v_new is not None
    for t in range(T):
        rows = tuple(
            replace(
                x, query=x.query[:, t : t + 1], key=x.key[:, : t + 1], value=x.value[:, : t + 1]
            )
            for x in prefill.rows
        )
        step = replace(
            prefill,
            rows=rows,
            q=prefill.q[:, t : t + 1],
            k_new=prefill.k_new[:, t : t + 1],
            v_new=prefill.v_new[:, t : t + 1],
            k_cache=k_cache,
            v_cache=v_cache,
            cache_seqlens=torch.full((B,), t, dtype=torch.int32, device=prefill.q.device),
        )
        outs, _, (k_cache, v_cache) = _call_cache(ctx, step)
        for b in range(B):
            _law(
                ctx,
                outs[b],
                rows[b],
                full[b],
                prefill.rows[b],
                f"row {b}: token {t} decoded after {t} appended tokens",
                transform=lambda o, t=t: o[:, t : t + 1],  # type: ignore[misc]
            )
    for name, got, want in (("k_cache", k_cache, k_full), ("v_cache", v_cache, v_full)):
        same = (got == want) | (torch.isnan(got) & torch.isnan(want))
        if not bool(same.all()):
            r, s = (int(i) for i in (~same).nonzero()[0][:2])
            raise Failure(
                f"{name}: {T} one-token appends left slot [{r}, {s}] unlike one prefill of "
                f"{T} tokens"
            )


def rotary_layouts(ctx: Context, case: Case) -> None:
    """The interleaved layout equals the halves layout after the fixed permutation of
    the rotary dims, applied to queries, new keys and cached keys alike."""
    if not case.rotary:
        raise Skip("no rotary dims")
    call = build_cache(replace(case, interleaved=True), ctx.dtype, ctx.device)
    p = halves_from_interleaved(case.rotary, case.Dh).to(call.q.device)

    def perm(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[..., p]

    other = replace(
        call,
        q=call.q[..., p],
        k_cache=call.k_cache[..., p],
        k_new=perm(call.k_new),
        interleaved=False,
        rows=tuple(replace(x, query=x.query[..., p], key=x.key[..., p]) for x in call.rows),
        k_after=perm(call.k_after),
    )
    base, _, _ = _call_cache(ctx, call)
    got, _, _ = _call_cache(ctx, other)
    _rows_law(ctx, got, base, call, "the halves layout on permuted dims against interleaved")


def rotary_shift(ctx: Context, case: Case) -> None:
    """Rotary scores depend on relative positions only: every position moved by
    ``shift`` (the cached keys stored rotated at their new positions, the first
    ``shift`` slots garbage that the window hides) changes no output."""
    if not case.rotary or case.window is None or case.causal is None or not case.new:
        raise Skip("needs rotary, a causal window and new tokens")
    shift = case.shift or 5
    base_call = build_cache(replace(case, shift=0), ctx.dtype, ctx.device)
    moved_call = build_cache(replace(case, shift=shift), ctx.dtype, ctx.device)
    base, _, _ = _call_cache(ctx, base_call)
    moved, _, _ = _call_cache(ctx, moved_call)
    for b, (x, y) in enumerate(zip(base_call.rows, moved_call.rows, strict=True)):
        _expect(ctx, x, rotated=True)  # each call rounds its own rotation
        _expect(ctx, y, rotated=True)
        _law(ctx, moved[b], y, base[b], x, f"row {b}: every position moved by {shift}")
