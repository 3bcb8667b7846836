"""The inputs of the packed and paged families: packs and caches, built from cases.

A `Pack` (the ``flash-varlen`` family) is several sequences of their own lengths; a
`CacheCall` (the ``flash-kvcache`` family) is a batch of rows decoding against a KV
cache, contiguous or paged. Both keep, next to the tensors a backend is called with,
the dense `Inputs` each sequence or row amounts to: the oracle judges every sequence and
row exactly as it judges a dense call, so one semantics serves every family.

A case becomes a pack when it has ``seqlens`` and a cache when it has ``cached``
(`attnref.conformance.cases.Case`); any dense case also becomes a pack of its samples
(`dense_pack`) and a cache holding its keys (`dense_cache`), which is how every dense
property runs in these families.
"""

import math
from dataclasses import dataclass, replace

import torch
from jaxtyping import Float, Float32, Shaped
from torch import Tensor

from attnref._checking import checked, checked_internal
from attnref.conformance.cases import Case, Inputs, build
from attnref.kvcache import cache_slots, valid_keys
from attnref.rotary import rotary, rotary_tables

__all__ = [
    "CacheCall",
    "Pack",
    "build_cache",
    "build_pack",
    "dense_cache",
    "dense_pack",
    "descales",
    "quantize",
]

#: what fills unused cache slots and padding tokens: large, so that reading one shows
GARBAGE = 100.0


@dataclass(frozen=True)
class Pack:
    """Sequences packed end to end, then ``pad`` tokens of garbage.

    ``seqs`` are the dense inputs of each sequence (``(h, Tq, D)``, no batch dims),
    sharing scale, causality and variants; ``alibi_slopes`` is ``(h,)`` when they share
    their slopes, ``(N, h)`` otherwise.
    """

    seqs: tuple[Inputs, ...]
    pad_q: Tensor  # (pad, h, Dh)
    pad_k: Tensor  # (pad, g, Dh)
    pad_v: Tensor  # (pad, g, Dv)
    alibi_slopes: Tensor | None = None

    @property
    def first(self) -> Inputs:
        return self.seqs[0]

    def cu_seqlens(self, which: str) -> Tensor:
        """int32 ``(N + 1,)`` cumulative lengths of the queries (``"q"``) or keys."""
        lengths = [s.query.shape[-2] if which == "q" else s.key.shape[-2] for s in self.seqs]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32, device=self.first.query.device)

    def max_seqlen(self, which: str) -> int:
        return max(s.query.shape[-2] if which == "q" else s.key.shape[-2] for s in self.seqs)

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        """``q (total_q, h, Dh)``, ``k (total_k, g, Dh)``, ``v (total_k, g, Dv)``."""
        q = torch.cat([*(s.query.transpose(0, 1) for s in self.seqs), self.pad_q])
        k = torch.cat([*(s.key.transpose(0, 1) for s in self.seqs), self.pad_k])
        v = torch.cat([*(s.value.transpose(0, 1) for s in self.seqs), self.pad_v])
        return q, k, v

    def permuted(self, order: list[int]) -> "Pack":
        """The same sequences in the order ``order``."""
        slopes = self.alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[order]
        return replace(self, seqs=tuple(self.seqs[i] for i in order), alibi_slopes=slopes)


def _garbage(shape: tuple[int, ...], gen: torch.Generator, like: Tensor) -> Tensor:
    return (GARBAGE * torch.randn(shape, generator=gen)).to(dtype=like.dtype, device=like.device)


def build_pack(case: Case, dtype: torch.dtype, device: str | torch.device = "cpu") -> Pack:
    """The pack ``case.seqlens`` describes: sequence ``n`` is the dense case with its
    lengths and a seed of its own; ``case.pad`` garbage tokens follow."""
    if not case.seqlens:
        raise ValueError(f"case {case.name}: a pack needs seqlens")
    seqs = []
    for n, (Lq, Lk) in enumerate(case.seqlens):
        one = replace(case, batch=(), Tq=Lq, Tk=Lk, seqlens=(), pad=0, seed=case.seed * 7919 + n)
        seqs.append(build(one, dtype, device))
    sinks = seqs[0].sinks
    seqs = [replace(s, sinks=sinks) for s in seqs]  # one sink per head, for the whole call
    slopes: Tensor | None = None
    if case.alibi == "heads":
        slopes = seqs[0].alibi_slopes
    elif case.alibi == "batch_heads":
        slopes = torch.stack([s.alibi_slopes for s in seqs if s.alibi_slopes is not None])
    gen = torch.Generator().manual_seed(case.seed * 31 + 5)
    q = seqs[0].query
    return Pack(
        tuple(seqs),
        _garbage((case.pad, case.h, case.Dh), gen, q),
        _garbage((case.pad, case.g, case.Dh), gen, q),
        _garbage((case.pad, case.g, case.Dv), gen, q),
        slopes,
    )


def _flat(inputs: Inputs) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Query, key, value with the batch dims flattened into one, and ALiBi slopes."""
    q, k, v = inputs.query, inputs.key, inputs.value
    B = math.prod(q.shape[:-3])
    slopes = inputs.alibi_slopes
    if slopes is not None and slopes.dim() > 1:
        slopes = slopes.reshape(B, slopes.shape[-1])
    return (
        q.reshape(B, *q.shape[-3:]),
        k.reshape(B, *k.shape[-3:]),
        v.reshape(B, *v.shape[-3:]),
        slopes,
    )


def _rows(inputs: Inputs) -> list[Inputs]:
    """Each sample of dense ``inputs`` (batch dims flattened) as inputs of its own."""
    q, k, v, slopes = _flat(inputs)
    return [
        replace(
            inputs,
            query=q[b],
            key=k[b],
            value=v[b],
            alibi_slopes=slopes[b] if slopes is not None and slopes.dim() > 1 else slopes,
        )
        for b in range(q.shape[0])
    ]


def dense_pack(inputs: Inputs) -> Pack:
    """The samples of dense ``inputs`` as a pack of equal-length sequences, no padding."""
    q, k, v, slopes = _flat(inputs)
    h, g, Dh, Dv = q.shape[-3], k.shape[-3], q.shape[-1], v.shape[-1]
    return Pack(
        tuple(_rows(inputs)),
        q.new_zeros((0, h, Dh)),
        k.new_zeros((0, g, Dh)),
        v.new_zeros((0, g, Dv)),
        slopes,
    )


@dataclass(frozen=True)
class CacheCall:
    """One call of a decode kernel: the tensors it takes, the cache it must leave, and
    the dense inputs each batch row amounts to (``rows``: the queries rotated as the
    rule says, and the valid keys as attended, the new ones rotated and appended)."""

    rows: tuple[Inputs, ...]
    q: Tensor  # (B, Tq, h, Dh)
    k_cache: Tensor  # (B_cache, T_cache, g, Dh) or (num_blocks, page_size, g, Dh)
    v_cache: Tensor
    cache_seqlens: Tensor  # (B,) int32
    k_new: Tensor | None = None  # (B, T_new, g, Dh)
    v_new: Tensor | None = None
    block_table: Tensor | None = None  # (B, max_blocks) int32
    cache_batch_idx: Tensor | None = None  # (B,) int32
    rotary_cos: Tensor | None = None  # (T_ro, R / 2)
    rotary_sin: Tensor | None = None
    interleaved: bool = True
    num_splits: int = 0
    alibi_slopes: Tensor | None = None
    #: the cache as the call must leave it (the new slots written), and which slots
    #: the append writes (``(rows, slots)`` booleans)
    k_after: Tensor | None = None
    v_after: Tensor | None = None
    written: Tensor | None = None
    #: an FP8 call: q, K and V stored in FP8 and FlashAttention 3's descales, float32
    #: ``(B, g)``, one per row and KV head (the rows hold the dequantized values, exact
    #: in float64)
    q_descale: Tensor | None = None
    k_descale: Tensor | None = None
    v_descale: Tensor | None = None

    @property
    def first(self) -> Inputs:
        return self.rows[0]


def _cast(t: Tensor, like: Tensor) -> Tensor:
    return t.to(dtype=like.dtype, device=like.device)


@checked_internal
def _garbage_cache(
    shape: tuple[int, ...], first: int, junk: torch.Generator, like: Shaped[Tensor, ""]
) -> Float[Tensor, "blocks ..."]:
    """A cache of ``shape`` full of garbage, but for its first ``first`` pages (or rows),
    which hold NaN: garbage is drawn for the pages after them only (a float32 draw of
    the whole would cost twice a half-precision cache of several GiB)."""
    if not first:
        return _cast(GARBAGE * torch.randn(shape, generator=junk), like)
    cache = torch.full(shape, math.nan, dtype=like.dtype, device=like.device)
    rest = (shape[0] - first, *shape[1:])
    cache[first:] = _cast(GARBAGE * torch.randn(rest, generator=junk), like)
    return cache


def build_cache(case: Case, dtype: torch.dtype, device: str | torch.device = "cpu") -> CacheCall:
    """The decode call ``case.cached`` describes (`attnref.conformance.cases.Case`):
    every slot of the cache holds garbage except each row's cached tokens, which are
    stored as a model stores them (rotated at their positions, when rotary is on).

    ``case.shift`` moves every position by that much: the first ``shift`` positions of
    each row are then garbage, counted in ``cache_seqlens`` (only a window can hide
    them). The tokens themselves are drawn from the seed alone, whatever the shift and
    the cache's shape; the garbage from a generator of its own.

    A paged case's option ``first_page`` (`Case.option`) puts every page the rows use
    at that physical index and after (a page index times its stride past 2**31
    elements, flashinfer#3130); the pages before it hold NaN, which no row reads. Without
    new tokens the cache as it must be left is the cache itself (no copy of a cache of
    several GiB).
    """
    if not case.cached:
        raise ValueError(f"case {case.name}: a cache needs cached lengths")
    gen = torch.Generator().manual_seed(case.seed)  # the tokens
    junk = torch.Generator().manual_seed(case.seed + 7919)  # the garbage, the layout
    B, Tq, T_new, h, g = len(case.cached), case.Tq, case.new, case.h, case.g
    Dh, Dv, shift = case.Dh, case.Dv, case.shift
    lengths = [shift + n for n in case.cached]  # cache_seqlens
    need = max(n + T_new for n in lengths)
    span = need + case.pad  # logical positions each row has room for
    first = int(case.option("first_page", 0))
    if case.page:
        per_row = max(1, -(-span // case.page))
        blocks = B * per_row + 1  # one page no row uses
        order = torch.randperm(blocks, generator=junk) if case.shuffle else torch.arange(blocks)
        order = order + first
        block_table: Tensor | None = order[: B * per_row].reshape(B, per_row).to(torch.int32)
        shape: tuple[int, int] = (first + blocks, case.page)
        batch_idx = None
    else:
        block_table = None
        rows_n = B + (1 if case.shuffle else 0)
        shape = (rows_n, max(span, 1))
        batch_idx = (
            torch.randperm(rows_n, generator=junk)[:B].to(torch.int32) if case.shuffle else None
        )
    proto = torch.empty((), dtype=dtype, device=device)
    k_cache = _garbage_cache((*shape, g, Dh), first, junk, proto)
    v_cache = _garbage_cache((*shape, g, Dv), first, junk, proto)
    q = _cast(case.amp * torch.randn((B, Tq, h, Dh), generator=gen), proto)
    k_new = _cast(case.amp * torch.randn((B, T_new, g, Dh), generator=gen), proto)
    v_new = _cast(torch.randn((B, T_new, g, Dv), generator=gen), proto)
    cos = sin = None
    if case.rotary:
        cos64, sin64 = rotary_tables(need + Tq + 1, case.rotary, dtype=torch.float64)
        cos, sin = _cast(cos64, proto), _cast(sin64, proto)

    def turn(x: Tensor, positions: Tensor) -> Tensor:
        """``x (T, heads, D)`` rotated at ``positions`` exactly, then rounded."""
        if cos is None or sin is None:
            return x
        c, s = cos.double()[positions].unsqueeze(-2), sin.double()[positions].unsqueeze(-2)
        return rotary(x.double(), c, s, interleaved=case.interleaved).to(dtype)

    def rows_of(b: int) -> int:
        return b if batch_idx is None else int(batch_idx[b])

    for b, n in enumerate(case.cached):
        pk = _cast(case.amp * torch.randn((n, g, Dh), generator=gen), proto)
        pv = _cast(torch.randn((n, g, Dv), generator=gen), proto)
        pk = turn(pk, torch.arange(shift, shift + n))
        slots = cache_slots(b, range(shift, shift + n), block_table, case.page, rows_of(b))
        for t, (r, s) in enumerate(slots):
            k_cache[r, s], v_cache[r, s] = pk[t], pv[t]
    slopes = None
    if case.alibi != "none":
        heads = torch.arange(1, h + 1, dtype=torch.float32)
        slopes = torch.exp2(-8.0 * heads / h)
        if case.alibi == "batch_heads":
            slopes = slopes * (0.5 + torch.rand((B, 1), generator=gen))
        slopes = slopes.to(device)
    sinks = None
    if case.sinks:  # one logit a query head, from a generator of its own (as `build`'s)
        sinks = 2 * torch.randn(h, generator=torch.Generator().manual_seed(case.seed + 31337))
        if case.sink is not None:
            sinks = torch.full((h,), case.sink)
        sinks = sinks.to(device)

    moving = case.causal is not None or case.window is not None
    k_after, v_after = (k_cache.clone(), v_cache.clone()) if T_new else (k_cache, v_cache)
    written = torch.zeros(shape, dtype=torch.bool, device=device)
    rows = []
    for b, n in enumerate(lengths):
        new_k = turn(k_new[b], torch.arange(n, n + T_new))
        slots = cache_slots(b, range(n, n + T_new), block_table, case.page, rows_of(b))
        for t, (r, s) in enumerate(slots):
            k_after[r, s], v_after[r, s] = new_k[t], v_new[b, t]
            written[r, s] = True
        positions = torch.arange(n, n + Tq) if moving else torch.full((Tq,), n)
        # the keys attended: what the cache holds once the append is done, in order
        keys = valid_keys(k_after, b, n + T_new, block_table, rows_of(b))
        values = valid_keys(v_after, b, n + T_new, block_table, rows_of(b))
        rows.append(
            Inputs(
                turn(q[b], positions).transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                None,
                case.causal,
                case.scale,
                case.window,
                case.softcap,
                None if slopes is None else (slopes[b] if slopes.dim() == 2 else slopes),
                sinks,
            )
        )
    return CacheCall(
        tuple(rows),
        q,
        k_cache,
        v_cache,
        torch.tensor(lengths, dtype=torch.int32, device=device),
        k_new if T_new else None,
        v_new if T_new else None,
        None if block_table is None else block_table.to(device),
        None if batch_idx is None else batch_idx.to(device),
        cos,
        sin,
        case.interleaved,
        case.splits,
        slopes,
        k_after,
        v_after,
        written,
    )


#: unused slots after the keys of a dense case's cache
DENSE_SLACK = 3


def dense_cache(inputs: Inputs) -> CacheCall:
    """Dense ``inputs`` as a decode call: a contiguous cache holding every key (and
    ``DENSE_SLACK`` slots of garbage after them), nothing appended."""
    q, k, v, slopes = _flat(inputs)
    B, Tk = q.shape[0], k.shape[-2]
    gen = torch.Generator().manual_seed(Tk * 131 + B)
    k_cache = torch.cat(
        [k.transpose(1, 2), _garbage((B, DENSE_SLACK, *k.shape[1:2], k.shape[-1]), gen, k)], dim=1
    )
    v_cache = torch.cat(
        [v.transpose(1, 2), _garbage((B, DENSE_SLACK, *v.shape[1:2], v.shape[-1]), gen, v)], dim=1
    )
    return CacheCall(
        tuple(_rows(inputs)),
        q.transpose(1, 2),
        k_cache,
        v_cache,
        torch.full((B,), Tk, dtype=torch.int32, device=q.device),
        alibi_slopes=slopes,
    )


@checked_internal
def descales(B: int, g: int, gen: torch.Generator) -> Float32[Tensor, "{B} {g}"]:
    """``(B, g)`` float32 scales from 1/8 to 8, none within a factor of sqrt(2) of 1:
    a scale of 1 hides the bugs of class 34."""
    e = torch.rand((B, g), generator=gen) * 6 - 3  # log2 of the scale
    e = torch.where(e.abs() < 0.5, e.sign() * 0.5 + e, e)
    return torch.exp2(e).to(torch.float32)


#: the share of FP8 cache calls whose scales are calibrated (`_calibrated`)
CALIBRATED = 0.5


@checked
def saturated(x: Float[Tensor, "*shape"], fp8: torch.dtype) -> Shaped[Tensor, "*shape"]:
    """``x`` in ``fp8``, clamped to its largest value first (as vLLM's and DeepSeek's
    quantizers do): torch's cast is not saturating (past the largest, e4m3fn gives NaN
    and e5m2 inf). NaN stays NaN (garbage in unused slots)."""
    top = torch.finfo(fp8).max
    return x.clamp(-top, top).to(fp8)


@checked
def calibrated_scale(
    amax: Float[Tensor, "*shape"], fp8: torch.dtype, factor: Float[Tensor, "*#shape"]
) -> Float32[Tensor, "*shape"]:
    """A calibrated descale: ``amax / max(fp8) * factor`` (vLLM's and FlashAttention 3's
    callers take amax / 448 for e4m3fn), so that stored values reach the format's
    largest, and past it where ``factor < 1`` (they saturate there, as the cast does).
    Never 0 (a row of zeros)."""
    top = torch.finfo(fp8).max
    return (amax.double().clamp(min=2.0**-20) / top * factor).to(torch.float32)


@checked_internal
def _calibrated(
    call: CacheCall, fp8: torch.dtype, gen: torch.Generator
) -> tuple[Float32[Tensor, "B g"], Float32[Tensor, "B g"], Float32[Tensor, "B g"]]:
    """``(B, g)`` descales of q, K and V from each (sample, KV head)'s own amax over the
    values the call stores (the cached keys each sample attends, its new ones, its
    queries), times 0.8 to 1: the stored values span the format up to its largest
    (448 for e4m3fn, 57344 for e5m2), so a kernel built for another variant (AMD's
    e4m3fnuz saturates at 240) is seen. Scales of 1/8 to 8 (`descales`) keep values of a
    few units, below 32."""
    B, _, h, D = call.q.shape
    g = call.k_cache.shape[2]
    amax = torch.zeros(3, B, g, dtype=torch.float64)
    for b, n in enumerate(int(x) for x in call.cache_seqlens.tolist()):
        r = b if call.cache_batch_idx is None else int(call.cache_batch_idx[b])
        for i, cache, new in ((1, call.k_cache, call.k_new), (2, call.v_cache, call.v_new)):
            stored = valid_keys(cache, b, n, call.block_table, r)  # (n, g, D)
            if new is not None:
                stored = torch.cat([stored, new[b]])
            if stored.numel():
                amax[i, b] = stored.double().abs().amax(dim=(0, 2)).cpu()
        group = call.q[b].double().abs().reshape(call.q.shape[1], g, h // g, D)
        amax[0, b] = group.amax(dim=(0, 2, 3)).cpu()
    factor = 0.8 + 0.2 * torch.rand((3, B, g), generator=gen, dtype=torch.float64)
    scales = calibrated_scale(amax, fp8, factor).to(call.q.device)
    return scales[0], scales[1], scales[2]


def quantize(call: CacheCall, fmt: str, seed: int) -> CacheCall:
    """``call`` (built in float64, no rotary) with q, K and V stored in FP8 ``fmt`` and
    FlashAttention 3's descales (of 1/8 to 8, or calibrated from the values' amax half
    of the time: `_calibrated`): each row's values divided by its KV head's scale, then
    rounded to FP8 (saturating); its dense inputs rebuilt from the stored values times
    the scales, exact in float64. New keys and values (an append) are stored so too,
    with their row's scales, and the cache the call must leave holds their FP8 bytes at
    the new slots. Slots no row uses hold the garbage rounded as it is."""
    from attnref.conformance.declarations import FP8_FORMATS

    if call.rotary_cos is not None:
        raise ValueError("an FP8 cache call has no rotary")
    fp8 = FP8_FORMATS[fmt]
    B, _, h, _ = call.q.shape
    g = call.k_cache.shape[2]
    gen = torch.Generator().manual_seed(seed * 31 + 17)
    dq, dk, dv = (descales(B, g, gen).to(call.q.device) for _ in range(3))
    if bool(torch.rand((), generator=gen) < CALIBRATED):
        dq, dk, dv = _calibrated(call, fp8, gen)
    per_head = dq.repeat_interleave(h // g, dim=1)  # (B, h): each query head's KV head's
    q8 = saturated(call.q / per_head[:, None, :, None], fp8)
    k8, v8 = saturated(call.k_cache, fp8), saturated(call.v_cache, fp8)
    T_new = 0 if call.k_new is None else call.k_new.shape[1]
    k_new8 = v_new8 = None
    if call.k_new is not None and call.v_new is not None:
        k_new8 = saturated(call.k_new / dk[:, None, :, None], fp8)  # (B, T_new, g, Dh)
        v_new8 = saturated(call.v_new / dv[:, None, :, None], fp8)
    page = call.k_cache.shape[1]

    def where(b: int, positions: range) -> tuple[Tensor, Tensor]:
        r = b if call.cache_batch_idx is None else int(call.cache_batch_idx[b])
        slots = cache_slots(b, positions, call.block_table, page, r)
        rows_ = torch.tensor([s[0] for s in slots], dtype=torch.long, device=call.q.device)
        return rows_, torch.tensor([s[1] for s in slots], dtype=torch.long, device=call.q.device)

    cached = [int(n) for n in call.cache_seqlens.tolist()]
    for b, n in enumerate(cached):  # the cached keys, stored with their row's scales
        idx_r, idx_s = where(b, range(n))
        k8[idx_r, idx_s] = saturated(call.k_cache[idx_r, idx_s] / dk[b][:, None], fp8)
        v8[idx_r, idx_s] = saturated(call.v_cache[idx_r, idx_s] / dv[b][:, None], fp8)
    # the cache as the call must leave it: with the new tokens' FP8 bytes, if any
    k_after, v_after = (k8.clone(), v8.clone()) if T_new else (k8, v8)
    rows = []
    for b, (n, x) in enumerate(zip(cached, call.rows, strict=True)):
        if x.key.shape[-2] != n + T_new:
            raise ValueError("an FP8 cache call attends every key its cache holds (no shift)")
        if k_new8 is not None and v_new8 is not None:  # the append: the FP8 bytes given
            idx_r, idx_s = where(b, range(n, n + T_new))
            k_after[idx_r, idx_s], v_after[idx_r, idx_s] = k_new8[b], v_new8[b]
        idx_r, idx_s = where(b, range(n + T_new))  # every key the row attends, in order
        keys = k_after[idx_r, idx_s].double() * dk[b][:, None].double()  # (n, g, Dh)
        values = v_after[idx_r, idx_s].double() * dv[b][:, None].double()
        query = q8[b].double() * per_head[b][None, :, None].double()  # (Tq, h, Dh)
        rows.append(
            replace(x, query=query.transpose(0, 1), key=keys.transpose(0, 1),
                    value=values.transpose(0, 1))
        )  # fmt: skip
    return replace(
        call, rows=tuple(rows), q=q8, k_cache=k8, v_cache=v8, k_new=k_new8, v_new=v_new8,
        k_after=k_after if T_new else None, v_after=v_after if T_new else None,
        written=call.written if T_new else None,
        q_descale=dq, k_descale=dk, v_descale=dv,
    )  # fmt: skip
