"""The ``sparse-mla-fp8`` family: FlashMLA's sparse decode, ``flash_mla_with_kvcache(...,
is_fp8_kvcache=True, indices=...)``, over the packed FP8 latent cache (docs/sparse.md).

``fn(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata=None,
num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
attn_sink=None, topk_length=None) -> (out, lse)``: ``q (B, Tq, h, 576)`` in bfloat16
against ``k_cache (blocks, page, 1, 656)``, each token's latent row packed in 656 bytes
(`attnref.sparse.pack_fp8_sparse`: 512 e4m3 values, 4 float32 tile scales, 64 bfloat16
rope dims; or, declared ``sparse_caches=(..., "MODEL1")``, ``q (B, Tq, h, 512)`` against
FlashMLA's ``MODEL1_FP8Sparse`` pages, ``(blocks, page, 1, 584)``,
`attnref.sparse.pack_fp8_model1`, V the whole row); ``indices (B, Tq, topk)`` hold
``block * page + offset`` (``-1``: invalid), so ``block_table`` and ``cache_seqlens``
are ``None``; ``out (B, Tq, h, 512)`` in bfloat16 and ``lse (B, h, Tq)`` in float32,
natural log, ``+inf`` for a query with no valid index (deepseek-ai/FlashMLA
``flash_mla/flash_mla_interface.py``, ``tests/ref.py``, ``tests/quant.py``).

A dense case cannot be such a call (its keys would be quantized, its oracle another):
this family is audited by its own properties. The audit quantizes the cache as
DeepSeek's code does, byte for byte, and the oracle dequantizes it exactly: each
property's rows are the dequantized rows in float64. Its cases spread the tiles' sizes
(so each tile's scale differs), fill every slot no index names with NaN bytes (and the
page before the cache, which index ``-1`` read as a slot reaches), shuffle the physical
pages, and half the time lay the pages out with FlashMLA's tests' padded stride.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from attnref._checking import checked_internal
from attnref.conformance.calls import invoke, note_reading
from attnref.conformance.cases import Case, Inputs
from attnref.conformance.checks import Context
from attnref.conformance.declarations import Backend, Capabilities
from attnref.conformance.families.flash import (
    declared,
    flash_back,
    flash_layout,
    flash_native_causal,
)
from attnref.conformance.families.flash_kvcache import fp8_expected, fp8_lse_expected, per_row
from attnref.conformance.families.mla import _flash_mla, _invoke
from attnref.conformance.families.sparse_mla import (
    FAR_ROWS,
    SINKS,
    TOPK_BLOCK,
    _counts,
    _sdpa_attend,
    sink_declared,
    sink_kwargs,
    sparse_form,
    with_sinks,
)
from attnref.conformance.family import ApiFamily, Arguments
from attnref.conformance.mutants import Mutant
from attnref.conformance.oracle import close
from attnref.conformance.profiles import Profile
from attnref.conformance.properties import Property
from attnref.conformance.serving_checks import guard, judge, with_lses
from attnref.conformance.strategies import case_strategy
from attnref.conformance.verdicts import Skip
from attnref.conformance.worker import Job
from attnref.sparse import (
    FP8_SPARSE_BYTES,
    MODEL1_BYTES,
    MODEL1_NOPE,
    MODEL1_TILES,
    MODEL1_VALUE_BYTES,
    NOPE,
    ROPE,
    attend_rows,
    pack_fp8_model1,
    pack_fp8_sparse,
    sparse_mla_decode,
    unpack_fp8_cache,
    unpack_fp8_sparse,
)

__all__ = ["FAMILY", "FLASH_MLA_SPARSE_FP8", "SparseFp8Call", "build_sparse_fp8", "fp8_sparse_form"]

NAME = "sparse-mla-fp8"
D, DV = NOPE + ROPE, NOPE
#: each packed cache: a row's dims, its quantized dims and tiles, and V's dims (V32: the
#: first 512 of 576; MODEL1: the whole 512-dim row, as DeepSeek-V4 uses it)
_CACHES = {
    "V32": (D, NOPE, 4, DV),
    "MODEL1": (MODEL1_NOPE + ROPE, MODEL1_NOPE, MODEL1_TILES, MODEL1_NOPE + ROPE),
}

#: what FlashMLA documents for its sparse FP8 decode: bfloat16 queries of 576 dims, the
#: 656-byte cache, V the first 512 dims (or 512 dims, the MODEL1 cache), pages of 64,
#: top-k lists a multiple of 64, -1 invalid, the LSE (+inf for a query with no valid index)
FLASH_MLA_SPARSE_FP8 = Capabilities(
    family=NAME,
    dtypes=(torch.bfloat16,),
    bool_mask=False,
    float_mask=False,
    causal_alignments=("bottom_right",),
    causal_with_mask=False,
    gradients=False,
    dropout=False,
    zero_head_dim=False,
    head_dims=(D, DV),
    latent_values=True,
    lse=True,
    empty_lse="+inf",
    paged=True,
    page_multiple=64,
    invalid_indices=("-1",),
    topk_multiple=TOPK_BLOCK,
    sparse_caches=("V32", "MODEL1"),
    masked_nan="contained",  # its kernels never read a slot no valid index names
)


@dataclass(frozen=True)
class SparseFp8Call:
    """One sparse FP8 decode call: its tensors, and the dense rows each query amounts to
    (``rows[b * Tq + i]``: query ``i`` of batch row ``b`` against the dequantized rows
    it selects, float64, V their first 512 dims)."""

    rows: tuple[Inputs, ...]
    q: Tensor  # (B, Tq, h, 576) bfloat16 (512 for MODEL1)
    k_cache: Tensor  # (blocks, page, 1, 656) float8_e4m3fn (584 for MODEL1)
    indices: Tensor  # (B, Tq, topk) int32
    softmax_scale: float | None
    topk_length: Tensor | None = None  # (B,) int32
    cache: str = "V32"  # the packed layout (`Capabilities.sparse_caches`)
    attn_sink: Tensor | None = None  # (h,) float32, as each of ``rows`` carries it


def fp8_arguments(caps: Capabilities, call: SparseFp8Call) -> Arguments:
    """``flash_mla_with_kvcache``'s sparse FP8 call for ``call``."""
    topk = call.indices.shape[-1]
    if caps.topk_multiple > 1 and topk % caps.topk_multiple:
        raise Skip(f"top-k {topk}: the declared lengths are multiples of {caps.topk_multiple}")
    page = call.k_cache.shape[1]
    if caps.page_multiple > 1 and page % caps.page_multiple:
        raise Skip(f"page size {page}: the declared sizes are multiples of {caps.page_multiple}")
    kwargs: dict[str, Any] = {
        "softmax_scale": call.softmax_scale,
        "is_fp8_kvcache": True,
        "indices": call.indices,
    }
    if call.topk_length is not None:
        if not caps.topk_length:
            raise Skip("per-row counts (topk_length) not declared")
        kwargs["topk_length"] = call.topk_length
    kwargs.update(sink_kwargs(caps, call.attn_sink))
    return (call.q, call.k_cache, None, None, _CACHES[call.cache][3]), kwargs


def _no_dense(
    caps: Capabilities, inputs: Inputs, lse: bool, overrides: dict[str, Any]
) -> Arguments:
    raise Skip("a sparse FP8 decode call quantizes its cache: audited by its own properties")


def _no_read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    raise AssertionError("no dense case is built for the sparse-mla-fp8 family")


# ------------------------------------------------ the adapter from a prefill callable


def _dequantize(k_cache: Tensor, bugs: frozenset[str]) -> Tensor:
    """The packed cache (either layout) as float32 rows (exact); ``bugs`` read a V32 one
    wrong: ``tile_shifted`` (tile ``t`` scaled by tile ``t + 1``'s scale),
    ``rope_as_fp8`` (the rope dims read as e4m3 bytes), ``scale_bytes_swapped`` (each
    scale's bytes read in reverse)."""
    rows = unpack_fp8_cache(k_cache)
    if not bugs & {"tile_shifted", "rope_as_fp8", "scale_bytes_swapped"}:
        return rows.float()
    if k_cache.shape[-1] != FP8_SPARSE_BYTES:
        raise ValueError("this kernel reads the 656-byte V32 cache only")
    raw = k_cache.contiguous().view(torch.uint8)
    nope = raw[..., :NOPE].contiguous().view(torch.float8_e4m3fn).double()
    scale_bytes = raw[..., NOPE : NOPE + 16].contiguous()
    if "scale_bytes_swapped" in bugs:
        scale_bytes = scale_bytes.reshape(*scale_bytes.shape[:-1], 4, 4).flip(-1).flatten(-2)
    scales = scale_bytes.contiguous().view(torch.float32).double()
    if "tile_shifted" in bugs:
        scales = scales.roll(-1, dims=-1)
    tiles = nope.reshape(*nope.shape[:-1], 4, NOPE // 4) * scales[..., None]
    rope = rows[..., NOPE:]
    if "rope_as_fp8" in bugs:
        rope = (
            raw[..., NOPE + 16 : NOPE + 16 + ROPE].contiguous().view(torch.float8_e4m3fn).double()
        )
    return torch.cat([tiles.flatten(-2), rope], dim=-1).float()


def fp8_sparse_form(
    prefill: Callable[..., Any], name: str, *, to: torch.dtype = torch.float32,
    bugs: frozenset[str] = frozenset(),
) -> Callable[..., Any]:  # fmt: skip
    """``prefill`` (``flash_mla_sparse_fwd``'s signature) with ``flash_mla_with_kvcache``'s
    sparse FP8 one: the cache dequantized to ``to`` (`_dequantize`, with ``bugs``), the
    batch's queries one after another, each batch row's count given to its queries."""

    @checked_internal
    def decode(
        q: Float[Tensor, "B Tq h D"],
        k_cache: Shaped[Tensor, "blocks page 1 bytes"],
        block_table: Int[Tensor, "B pages"] | None,
        cache_seqlens: Int[Tensor, " B"] | None,
        head_dim_v: int,
        tile_scheduler_metadata: object = None,
        num_splits: object = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        is_fp8_kvcache: bool = False,
        indices: Int[Tensor, "B Tq topk"] | None = None,
        attn_sink: Float[Tensor, " h"] | None = None,
        topk_length: Int[Tensor, " B"] | None = None,
    ) -> tuple[Float[Tensor, "B Tq h {head_dim_v}"], Float[Tensor, "B h Tq"]]:
        if indices is None or not is_fp8_kvcache:
            raise ValueError("this kernel takes sparse FP8 calls only: indices and is_fp8_kvcache")
        if causal:
            raise ValueError("causal must be False with indices (FlashMLA's rule)")
        B, Tq, h, Dq = q.shape
        if "invalid_as_zero" in bugs:
            indices = indices.clamp_min(0)
        rows = _dequantize(k_cache, bugs).to(to).reshape(-1, 1, Dq)
        counts = None if topk_length is None else topk_length.repeat_interleave(Tq)
        scale = Dq**-0.5 if softmax_scale is None else softmax_scale
        out, _, lse = prefill(q.reshape(B * Tq, h, Dq).to(to), rows,
                              indices.reshape(B * Tq, 1, -1), scale, head_dim_v,
                              attn_sink, counts)  # fmt: skip
        return (
            out.reshape(B, Tq, h, head_dim_v).to(q.dtype),
            lse.float().reshape(B, Tq, h).transpose(1, 2),
        )

    decode.__name__ = decode.__qualname__ = name
    decode.__doc__ = (
        f"{prefill.__doc__ or ''}\n\nIn flash_mla_with_kvcache's sparse FP8 convention."
    )
    return decode


@checked_internal
def _reference(
    q: Float[Tensor, "B Tq h D"],
    k_cache: Shaped[Tensor, "blocks page 1 bytes"],
    block_table: Int[Tensor, "B pages"] | None,
    cache_seqlens: Int[Tensor, " B"] | None,
    head_dim_v: int,
    tile_scheduler_metadata: object = None,
    num_splits: object = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Int[Tensor, "B Tq topk"] | None = None,
    attn_sink: Float[Tensor, " h"] | None = None,
    topk_length: Int[Tensor, " B"] | None = None,
) -> tuple[Float[Tensor, "B Tq h {head_dim_v}"], Float[Tensor, "B h Tq"]]:
    """attnref's `attnref.sparse.sparse_mla_decode` on the cache dequantized exactly, in
    float32."""
    if indices is None or not is_fp8_kvcache:
        raise ValueError("this kernel takes sparse FP8 calls only: indices and is_fp8_kvcache")
    rows = unpack_fp8_cache(k_cache).float()
    out, lse = sparse_mla_decode(q.float(), rows, indices, head_dim_v, softmax_scale,
                                 attn_sink, topk_length)  # fmt: skip
    return out.to(q.dtype), lse.float()


_OURS = replace(
    FLASH_MLA_SPARSE_FP8, topk_multiple=1, page_multiple=1, topk_length=True, attn_sink=True
)
fp8_reference = declared(_reference, _OURS)
fp8_sdpa = declared(
    fp8_sparse_form(sparse_form(_sdpa_attend, "sdpa"), "fp8_sdpa", to=torch.bfloat16), _OURS
)


def _builtins() -> list[Backend]:
    return [
        Backend("sparse-mla-fp8-reference", fp8_reference,
                "attnref's sparse_mla_decode on the cache dequantized exactly", _OURS, api=NAME),
        Backend("sparse-mla-fp8-sdpa", fp8_sdpa,
                "torch SDPA on each query's gathered rows, dequantized to bfloat16", _OURS,
                api=NAME),
        Backend("flash-mla-sparse-fp8", _flash_mla,
                "FlashMLA's flash_mla_with_kvcache with indices (skipped where flash_mla is "
                "absent)", replace(FLASH_MLA_SPARSE_FP8, devices=("cuda",)), api=NAME,
                needs="flash_mla"),
    ]  # fmt: skip


# ---------------------------------------------------------------- the cases

#: a batch row's distinct token values: past as many tokens (the far case's 131,149),
#: each token takes one of them at random (drawing, packing and unpacking every token
#: took 25 s of the case's 30)
_DISTINCT = 2**14

#: each tile's size (a factor on its values), for ``case.option("tiles")``
_SPREAD = (2.0**-6, 2.0**-1, 2.0**2, 2.0**6)


def build_sparse_fp8(case: Case, device: str | torch.device, caps: Capabilities) -> SparseFp8Call:
    """The call ``case`` describes: ``len(case.cached)`` batch rows of ``case.cached[b]``
    tokens in shuffled pages of ``case.page`` slots (``page + 1`` apart with
    ``option("padded")``, FlashMLA's tests' layout), ``case.Tq`` queries a row of
    ``case.h`` heads, each selecting its count (`sparse_mla._counts`) of its row's
    tokens, ``-1`` after them (shuffled with ``option("order")``). Each tile's values
    times a factor (``option("tiles")``: ``equal``, ``spread``, ``random``) so that the
    scales differ; every slot no token holds, and the page before the cache, is NaN
    bytes. ``option("cache")`` names the layout (``V32``, or ``MODEL1``: 512-dim rows,
    `attnref.sparse.pack_fp8_model1`, whose pages have their own padded stride)."""
    gen = torch.Generator().manual_seed(case.seed)
    B, Tq, h, page = len(case.cached), case.Tq, case.h, case.page or 64
    layout = str(case.option("cache", "V32"))
    width, nope, n_tiles, dv = _CACHES[layout]
    q = (case.amp * torch.randn((B, Tq, h, width), generator=gen)).to(torch.bfloat16)
    tiles = case.option("tiles", "equal")
    factor = torch.ones(width, dtype=torch.float64)
    spread: tuple[float, ...] = (1.0,) * n_tiles
    if tiles == "spread":  # each size once, then again
        spread = tuple(_SPREAD[t % len(_SPREAD)] for t in range(n_tiles))
    if tiles == "random":
        spread = tuple(2.0 ** int(torch.randint(-6, 7, (), generator=gen)) for _ in spread)
    factor[:nope] = torch.tensor(spread, dtype=torch.float64).repeat_interleave(nope // n_tiles)
    factor[nope:] = 2.0 ** int(torch.randint(-2, 3, (), generator=gen))
    pages = [max(1, -(-n // page)) for n in case.cached]
    blocks = sum(pages) + 1  # one page no row uses
    order = (torch.randperm(blocks, generator=gen) + 1).tolist()  # page 0 is NaN, never used
    padded = bool(case.option("padded")) and layout == "V32"
    # 255: NaN as e4m3, float32 and bfloat16 bytes, where the declaration says NaN there
    # never reaches the output; else 60, finite in each (1.5, 0.0115, 0.0115)
    fill = 255 if caps.masked_nan == "contained" else 60
    buffer = torch.full((blocks + 2, page + padded, 1, FP8_SPARSE_BYTES), fill, dtype=torch.uint8)
    cache_bytes = buffer[1:, :page]  # (blocks + 1, page, 1, 656): a NaN page before it
    slots: list[Tensor] = []  # each batch row's tokens' slots
    values: list[Tensor] = []  # and their exact values, as the cache holds them (float64)
    cursor = 0
    for b, n in enumerate(case.cached):
        own = torch.tensor(order[cursor : cursor + pages[b]], dtype=torch.long)
        cursor += pages[b]
        t = torch.arange(n)
        slots.append(own[t // page] * page + t % page if n else t)
        pool, pick = min(n, _DISTINCT), None
        rows = (case.amp * torch.randn((pool, width), generator=gen, dtype=torch.float64)) * factor
        if n > pool:  # past _DISTINCT tokens, each a row of the pool's
            pick = torch.randint(pool, (n,), generator=gen)
        if layout == "MODEL1" or not n:
            values.append(rows if pick is None else rows[pick])
            continue
        packed = pack_fp8_sparse(rows).view(torch.uint8)  # each row alone: pool, then pick
        exact = unpack_fp8_sparse(packed)
        if pick is not None:
            packed, exact = packed[pick], exact[pick]
        values.append(exact)
        if padded:
            cache_bytes[slots[b] // page, slots[b] % page, 0] = packed
        else:
            cache_bytes.reshape(-1, FP8_SPARSE_BYTES)[slots[b]] = packed  # a view: contiguous
    if layout == "MODEL1":
        pairs = zip(slots, values, strict=True)
        latent = {int(s): r for where, rows in pairs for s, r in zip(where, rows, strict=True)}
        k_cache = _model1_cache(latent, blocks + 1, page, width)
        deq = unpack_fp8_cache(k_cache).reshape(-1, width)  # exact, float64
        values = [deq[where] for where in slots]
    else:
        k_cache = cache_bytes.view(torch.float8_e4m3fn)
    topk = int(case.option("topk", max([*case.cached, 1])))
    indices = torch.full((B, Tq, topk), -1, dtype=torch.long)
    counted = bool(case.option("topk_length"))
    rows_out = []
    count_of_row = []
    for b in range(B):
        counts = _counts(
            replace(case, Tq=Tq), topk, len(slots[b]), gen, caps.tile_keys or TOPK_BLOCK
        )
        if counted:  # one count a batch row (FlashMLA's topk_length is (B,))
            counts = [counts[0]] * Tq
            count_of_row.append(counts[0])
        for i, n in enumerate(counts):
            if case.option("duplicates") and n and len(slots[b]):
                local = torch.randint(len(slots[b]), (n,), generator=gen)
                if n > 1:
                    local[-1] = local[0]
            else:
                local = torch.randperm(len(slots[b]), generator=gen)[:n]
            sel = slots[b][local]
            entries = torch.cat([sel, torch.full((topk - n,), -1, dtype=torch.long)])
            if counted and topk > n and len(slots[b]):  # past the count: real tokens
                entries[n:] = slots[b][torch.randint(len(slots[b]), (topk - n,), generator=gen)]
            elif case.option("order") == "shuffled":
                entries = entries[torch.randperm(topk, generator=gen)]
            indices[b, i] = entries
            rows_out.append((b, i, values[b][local]))
    out_rows = tuple(
        Inputs(q[b, i].double()[:, None], sel[None], sel[None, :, :dv], None, None, case.scale)
        for b, i, sel in rows_out
    )
    lengths = torch.tensor(count_of_row, dtype=torch.int32, device=device) if counted else None
    scale = q.shape[-1] ** -0.5 if case.scale is None else case.scale
    out_rows, sinks = with_sinks(case, out_rows, scale)  # near each head's LSEs
    return SparseFp8Call(
        out_rows,
        q.to(device),
        k_cache.to(device),
        indices.to(torch.int32).to(device),
        case.scale,
        lengths,
        layout,
        None if sinks is None else sinks.to(device),
    )


def _model1_cache(latent: dict[int, Tensor], blocks: int, page: int, width: int) -> Tensor:
    """``latent`` (slot: row) packed as `attnref.sparse.pack_fp8_model1` does, ``blocks``
    pages after a page of NaN bytes; every slot no row fills (its 576 value bytes and 8
    scale bytes, where the page keeps them) is NaN bytes too."""
    rows = torch.zeros((blocks + 1, page, width), dtype=torch.float64)
    for slot, row in latent.items():
        rows[1 + slot // page, slot % page] = row
    packed = pack_fp8_model1(rows)  # (blocks + 1, page, 1, 584) over pages of their own
    size = page * MODEL1_BYTES
    raw = packed.view(torch.uint8)
    pages = torch.as_strided(raw, (blocks + 1, size), (raw.stride(0), 1), raw.storage_offset())
    for slot in range(-page, blocks * page):  # the NaN page first
        if slot not in latent:
            p, t = 1 + slot // page, slot % page
            pages[p, t * MODEL1_VALUE_BYTES : (t + 1) * MODEL1_VALUE_BYTES] = 255
            at = page * MODEL1_VALUE_BYTES + 8 * t
            pages[p, at : at + 8] = 255
    return packed[1:]


def _call(ctx: Context, call: SparseFp8Call) -> tuple[list[Tensor], list[Tensor] | None]:
    """The backend's output and LSE for each query of ``call``, its oracle's bounds
    those of the dequantized rows (`flash_kvcache.fp8_expected`)."""
    args, kwargs = fp8_arguments(ctx.caps, call)
    like = tuple(x.to(torch.bfloat16) for x in call.rows)
    guard(ctx, like[0], kwargs)
    raw = invoke(ctx.backend, Job(args, kwargs), ctx.timeout, ctx.executor)
    lse = ctx.caps.lse
    note_reading(
        ctx.executor, raw, lambda r: zip(call.rows, *with_lses(_read(r, call, lse)), strict=True)
    )
    outs, lses = _read(raw, call, lse)
    return judge(outs, lses, like)


def _read(raw: object, call: SparseFp8Call, lse: bool) -> tuple[list[object], list[object] | None]:
    """The output (and LSE) of each query of ``call``, ``(h, 1, Dv)`` and ``(h, 1)``."""
    B, Tq, h = call.q.shape[:3]
    if not isinstance(raw, tuple | list) or len(raw) != 2:
        from attnref.conformance.verdicts import Failure

        raise Failure(f"flash_mla_with_kvcache returns (out, lse), returned {type(raw).__name__}")
    first, lse_out = raw
    outs, lses = per_row(first, lse_out, (B, Tq, h, _CACHES[call.cache][3]), lse)
    # each batch row's (h, Tq, Dv) cut into its queries' (h, 1, Dv)
    outs = [o[:, i : i + 1] if isinstance(o, Tensor) else o for o in outs for i in range(Tq)]
    if lses is not None:
        lses = [x[:, i : i + 1] if isinstance(x, Tensor) else x for x in lses for i in range(Tq)]
    return outs, lses


def _sparse_fp8(ctx: Context, case: Case) -> None:
    """Each query of a sparse FP8 decode call agrees with the oracle of the rows it
    selects, dequantized exactly: output and LSE."""
    if ctx.dtype != torch.bfloat16:
        raise Skip("a sparse FP8 call takes bfloat16 queries: audited in the bfloat16 run")
    call = build_sparse_fp8(case, ctx.device, ctx.caps)
    outs, lses = _call(ctx, call)
    for n, (out, x) in enumerate(zip(outs, call.rows, strict=True)):
        b, i = divmod(n, case.Tq)
        label = f"batch row {b}, query {i} (of {x.key.shape[-2]} rows)"
        exp = fp8_expected(ctx, x, "e4m3fn")
        ctx.keep(x, exp)  # x's oracle, as the other FP8 families keep theirs
        with ctx.naming_the_row(x):
            close(out.to(torch.float64), exp.value, *exp.bounds(), f"{label}: output",
                  semantic=exp.semantic)  # fmt: skip
        if lses is not None:
            el = fp8_lse_expected(x, ctx.caps.empty_lse)
            ctx.keep_lse(x, el)
            close(lses[n].to(torch.float64), el.value, *el.bounds(), f"{label}: log-sum-exp")


def _fp8_cases(
    name: str, **pins: Any
) -> Callable[[Profile, Capabilities], st.SearchStrategy[Case]]:
    """Sparse FP8 decode calls: 1 or 2 batch rows of 1 to 200 tokens, 1 or 2 queries a
    row of 1, 3 or 16 heads, pages of the declared multiple (or 16, 64), top-k lists
    around the block of 64; the options: ``topk``, ``valid``, ``tiles``, ``padded``,
    ``duplicates`` (where counted), ``order``, ``topk_length`` (where taken), ``cache``
    (among the layouts declared)."""

    def cases(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
        m = c.page_multiple
        fields: dict[str, Any] = {
            "batch": (),
            "mask": "none",
            "layout": "contiguous",
            "causal": None,
            "g": 1,
            "group": st.sampled_from((3, 1, 16)),
            "Tq": st.integers(1, 2),
            "Tk": 1,
            "scale": st.sampled_from((None, 0.37, 192**-0.5)),
        }
        base = case_strategy(name, p, c, sizes=("small",), **fields)
        t = max(c.topk_multiple, 1)
        tile = c.tile_keys or TOPK_BLOCK

        @st.composite
        def draw(draw: st.DrawFn) -> Case:
            case = draw(base)
            cached = tuple(draw(st.lists(st.integers(1, 200), min_size=1, max_size=2)))
            page = draw(st.sampled_from((m, 2 * m) if m > 1 else (16, 64, 5)))
            near = [x for b in (tile, 2 * tile) for x in (b - 1, b, b + 1)]
            topk = draw(st.one_of(st.integers(1, 2 * max(cached) + 2), st.sampled_from(near)))
            valid = pins.get("valid", st.sampled_from(("random", "all", "tile", "empty")))
            opts = {
                "topk": max(-(-topk // t) * t, t),
                "valid": draw(valid),
                "tiles": draw(pins.get("tiles", st.sampled_from(("spread", "random", "equal")))),
                "padded": draw(st.booleans()),
                "duplicates": c.duplicates == "counted" and draw(st.booleans()),
                "order": draw(st.sampled_from(("sorted", "shuffled"))),
                "topk_length": c.topk_length and draw(st.booleans()),
                "cache": draw(st.sampled_from(c.sparse_caches)),
            }  # fmt: skip
            if "sink" in pins:  # only where pinned: the other properties' draws stay as they were
                opts["sink"] = draw(pins["sink"])
            return _sized(case, cached=cached, page=page, latent=True,
                          options=tuple(opts.items()))  # fmt: skip

        return draw()

    return cases


def _fp8_examples(p: Profile, c: Capabilities) -> list[Case]:
    """DeepSeek-V3.2's sizes, which the drawn cases stay far below: top-k lists of 2048
    over caches of several thousand tokens, 16 and 128 query heads (TP 8 and 1), its
    model scale, pages of 64, the tiles of random sizes."""
    page = c.page_multiple if c.page_multiple > 1 else 64
    yarn = 192**-0.5 * (0.1 * math.log(40) + 1) ** 2
    opts = (("topk", 2048), ("tiles", "random"), ("padded", True), ("order", "shuffled"))
    base = [
        Case("sparse_fp8_model", h=16, Tq=1, cached=(4100, 70), page=page, scale=yarn,
             options=(*opts, ("valid", "random"))),
        Case("sparse_fp8_heads", h=128, Tq=2, cached=(2500,), page=page, scale=yarn,
             options=(*opts, ("valid", "all"))),
        # rows past 2**16 (DeepSeek's 131,072 tokens and a partial page): a kernel that
        # keeps its row indices in 16 bits passes every case above
        Case("sparse_fp8_far_rows", h=16, Tq=1, cached=(FAR_ROWS,), page=page, scale=yarn,
             options=(*opts[1:], ("topk", 256), ("valid", "all"))),
    ]  # fmt: skip
    if "MODEL1" in c.sparse_caches:  # DeepSeek-V4 Flash's: 64 heads, top-k 512
        model1 = (("topk", 512), ("tiles", "random"), ("order", "shuffled"),
                  ("valid", "random"), ("cache", "MODEL1"))  # fmt: skip
        base.append(Case("sparse_fp8_model1", h=64, Tq=2, cached=(3000, 40), page=page,
                         scale=512**-0.5, options=model1))  # fmt: skip
    return [_sized(x, g=1, latent=True, seed=600 + i) for i, x in enumerate(base)]


def _fp8_sink_examples(p: Profile, c: Capabilities) -> list[Case]:
    """`_fp8_examples`' production sizes (DeepSeek-V3.2's and V4's: up to 128 heads and
    top-k 2048), each with a sink per head."""
    return [replace(x, name="sparse_fp8_sink" + x.name.removeprefix("sparse_fp8"),
                    options=(*x.options, ("sink", "near")))
            for x in _fp8_examples(p, c) if x.name != "sparse_fp8_far_rows"]  # fmt: skip


def _sized(case: Case, **changes: Any) -> Case:
    """``case`` with ``changes`` and the head dims of the cache its options name
    (``cache``, ``V32`` when absent), in one step (a case checks its dims as made)."""
    options = dict(changes.get("options", case.options))
    width, _, _, dv = _CACHES[str(options.get("cache", "V32"))]
    return replace(case, Dh=width, Dv=dv, **changes)


PROPERTIES: tuple[Property, ...] = (
    Property(
        "sparse_fp8",
        "each query of a sparse FP8 decode call (the 656-byte or MODEL1 cache, packed as "
        "DeepSeek's code does) agrees with the oracle of the rows it selects, dequantized exactly: "
        "output and LSE; unused slots and the page before the cache are NaN",
        (34, 36, 27, 32),
        _fp8_cases("sparse_fp8"),
        _sparse_fp8,
        examples=_fp8_examples,
        families=(NAME,),
    ),
    Property(
        "sparse_fp8_tiles",
        "the tiles of a row far apart in size (scales from 2**-13 to 2**-2) and the rope "
        "dims in bfloat16: each tile's scale reaches only its values (128, or 64 in MODEL1)",
        (34, 36),
        _fp8_cases("sparse_fp8_tiles", tiles=st.just("spread"), valid=st.just("all")),
        _sparse_fp8,
        families=(NAME,),
    ),
    Property(
        "sparse_fp8_sink",
        "with a sink logit per head (attn_sink), each query of a sparse FP8 decode call is "
        "its rows' output times sigmoid(lse - sink); a sink of -inf changes nothing; the LSE "
        "stays the keys' own",
        (24, 36),
        _fp8_cases("sparse_fp8_sink", sink=SINKS),
        _sparse_fp8,
        requires=sink_declared,
        examples=_fp8_sink_examples,
        families=(NAME,),
    ),
)


def _mutant_fn(self: Mutant) -> Callable[..., Any]:
    """A bug in how the packed cache or the indices are read: the reference's attention
    over gathered rows behind a buggy `fp8_sparse_form`."""
    bugs = frozenset(self.switches)
    # the sink's bugs are the prefill form's; the cache's and the indices' this form's
    inner = sparse_form(attend_rows, "rows", bugs=bugs & {"sink_ignored", "sink_in_lse"})
    fn = fp8_sparse_form(inner, self.name, bugs=bugs)
    fn.__doc__ = f"Class {self.bug_class}: {self.summary}"
    fn.capabilities = self.capabilities  # type: ignore[attr-defined]
    return fn


#: the mutants read the V32 cache (their bugs are in its bytes)
_V32_ONLY = replace(_OURS, sparse_caches=("V32",))
_LIKE: dict[str, Any] = {"api": NAME, "capabilities": _V32_ONLY}

MUTANTS: tuple[Mutant, ...] = (
    Mutant("sparse_fp8_tile_shifted", 34, "a packed row's tile t dequantized with tile "
           "t + 1's scale", {"tile_shifted": True}, **_LIKE),
    Mutant("sparse_fp8_rope_as_fp8", 36, "the packed row's bfloat16 rope dims read as "
           "e4m3 bytes", {"rope_as_fp8": True}, **_LIKE),
    Mutant("sparse_fp8_scale_bytes_swapped", 34, "each float32 tile scale read with its "
           "bytes reversed", {"scale_bytes_swapped": True}, **_LIKE),
    Mutant("sparse_fp8_invalid_as_zero", 36, "index -1 read as slot 0 of the cache",
           {"invalid_as_zero": True}, **_LIKE),
    Mutant("sparse_fp8_sink_ignored", 24, "the sink logits (attn_sink) taken and never "
           "applied", {"sink_ignored": True}, **_LIKE),
)  # fmt: skip


FAMILY = ApiFamily(
    name=NAME,
    alignments=("bottom_right",),
    summary="FlashMLA's flash_mla_with_kvcache with indices: DeepSeek's sparse decode over "
    "the 656-byte FP8 latent cache (512 e4m3 values, 4 float32 tile scales, 64 bfloat16 "
    "rope dims) or V4's 584-byte MODEL1 pages, each query the slots its top-k indices name",
    signature="fn(q, k_cache, block_table, cache_seqlens, head_dim_v, "
    "tile_scheduler_metadata=None, num_splits=None, softmax_scale=None, causal=False, "
    "is_fp8_kvcache=False, indices=None, attn_sink=None, topk_length=None) -> (out, lse)",
    positional=5,
    keywords=("softmax_scale", "is_fp8_kvcache", "indices"),
    defaults=FLASH_MLA_SPARSE_FP8,
    build=_no_dense,
    read=_no_read,
    to_layout=flash_layout,
    from_layout=flash_back,
    native_causal=flash_native_causal,
    dropout=False,
    indexed=True,
    dense=False,
    invoke=_invoke,
    builtins=_builtins,
    properties=PROPERTIES,
    mutants=MUTANTS,
    mutant_fn=_mutant_fn,
)
