"""The ``mla`` family: FlashMLA's ``flash_mla_with_kvcache``, multi-head latent attention
decode over a paged cache of latent rows (docs/mla.md).

``fn(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata=None,
num_splits=None, softmax_scale=None, causal=False) -> (out, lse)``: ``q (B, Tq, h, D)``
against ``k_cache (blocks, page, 1, D)``, one key/value head whose **values are its keys'
first** ``head_dim_v`` **dims**; token ``t`` of sequence ``b`` at
``k_cache[block_table[b, t // page], t % page]``; bottom-right causal; ``out (B, Tq, h,
head_dim_v)`` and the LSE ``(B, h, Tq)`` in float32, natural log, ``+inf`` for a query
that sees no key (deepseek-ai/FlashMLA ``flash_mla/flash_mla_interface.py``). A backend
that declares ``fp8`` is also called with q and the cache in FP8 and ``descale_q``,
``descale_k`` (float32, ``(1,)``, per tensor), returning bfloat16: vLLM's FlashMLA FP8
path (``vllm/attention/ops/flashmla.py``, from FlashMLA PR #54).

Everything of the family is here: the convention (a dense case runs as a call on a paged
cache holding its keys: the engine draws its cases with one key/value head and V tied to
K, `Capabilities.latent_values`), `LatentCall` and `build_latent` (the cases of its own
properties: several sequences, NaN in every slot no sequence uses, the block table
padded with FlashMLA's huge id), `latent_form` (a flash-convention function driven row
by row, with the switches of the class-35 mutants), the preset (`FLASH_MLA`), the
built-in backends, the properties only this call can have, the mutants and the bench's
decode workload.
"""

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st
from jaxtyping import Float, Float32, Int, Shaped
from torch import Tensor

from attnref._checking import checked_internal
from attnref.conformance.calls import invoke, note_reading
from attnref.conformance.cases import Case, Inputs
from attnref.conformance.checks import Context, law, rng
from attnref.conformance.declarations import FP8_FORMATS, Backend, Capabilities
from attnref.conformance.families.flash import (
    declared,
    dense_read,
    empty_part,
    flash_back,
    flash_checks,
    flash_layout,
    flash_naive,
    flash_native_causal,
)
from attnref.conformance.families.flash_kvcache import (
    fp8_expected,
    fp8_lse_expected,
    needs_fp8,
    per_row,
    powers,
)
from attnref.conformance.families.sdpa import REFERENCE_CAPS
from attnref.conformance.family import ApiFamily, Arguments, pair, variant_kwargs
from attnref.conformance.mutants import Mutant
from attnref.conformance.oracle import close
from attnref.conformance.profiles import Profile
from attnref.conformance.properties import Property, needs_lse
from attnref.conformance.serving import CALIBRATED, calibrated_scale, descales, saturated
from attnref.conformance.serving_checks import agree, guard, judge, with_lses
from attnref.conformance.strategies import cache_strategy
from attnref.conformance.verdicts import Failure, Skip
from attnref.conformance.worker import Job
from attnref.conformance.workloads import ServingCase, Workload
from attnref.devices import DTYPES
from attnref.kvcache import valid_keys
from attnref.mla import mla_kvcache_attention

__all__ = [
    "FAMILY",
    "FLASH_MLA",
    "HUGE_BLOCK",
    "LatentCall",
    "build_latent",
    "latent_form",
    "mla_naive",
    "mla_reference",
    "mla_sdpa",
]

NAME = "mla"
#: what FlashMLA's tests pad a block table with past a sequence's last page: a page id
#: no cache has, which a kernel must never read
HUGE_BLOCK = 2_147_480_000

#: what FlashMLA documents for its dense decode: bf16 and fp16, q and the cache of 576
#: dims with V their first 512, one KV head, pages of 64, bottom-right causal, the LSE
#: (+inf for a query that sees no key), no masks, no variants, no backward
FLASH_MLA = Capabilities(
    family=NAME,
    dtypes=(torch.bfloat16, torch.float16),
    bool_mask=False,
    float_mask=False,
    causal_alignments=("bottom_right",),
    causal_with_mask=False,
    gradients=False,
    dropout=False,
    zero_head_dim=False,
    head_dims=(576, 512),
    latent_values=True,
    lse=True,
    empty_lse="+inf",
    paged=True,
    page_multiple=64,
)


def mla_caps(caps: Capabilities) -> Capabilities:
    """``caps`` as a backend of this family declares them: no masks, bottom-right,
    latent values, the LSE (+inf when empty), paged, no variants, no backward."""
    return replace(
        caps,
        family=NAME,
        bool_mask=False,
        float_mask=False,
        causal_alignments=("bottom_right",),
        causal_with_mask=False,
        gradients=False,
        dropout=False,
        zero_head_dim=False,
        latent_values=True,
        window=False,
        softcap=False,
        alibi=False,
        sinks=False,
        lse=True,
        empty_lse="+inf",
        paged=True,
    )


# ----------------------------------------------------------------- the convention


@dataclass(frozen=True)
class LatentCall:
    """One call of an MLA decode kernel: the tensors it takes and the dense inputs each
    sequence amounts to (``rows``: queries ``(h, Tq, D)`` against its valid latent rows
    ``(1, n, D)``, the values their first ``head_dim_v`` dims)."""

    rows: tuple[Inputs, ...]
    q: Tensor  # (B, Tq, h, D)
    k_cache: Tensor  # (blocks, page, 1, D)
    block_table: Tensor  # (B, pages) int32
    cache_seqlens: Tensor  # (B,) int32
    head_dim_v: int
    #: an FP8 call's per-tensor descales (float32, ``(1,)``): q and the latent cache
    descale_q: Tensor | None = None
    descale_k: Tensor | None = None

    @property
    def first(self) -> Inputs:
        return self.rows[0]


def tied(inputs: Inputs) -> bool:
    """Whether ``inputs`` are latent: one key/value head, V the keys' leading dims."""
    k, v = inputs.key, inputs.value
    if k.shape[-3] != 1 or v.shape[-1] > k.shape[-1]:
        return False
    lead = k[..., : v.shape[-1]]
    return bool(((lead == v) | (torch.isnan(lead) & torch.isnan(v))).all())


def _latent_checks(inputs: Inputs) -> None:
    flash_checks(inputs)
    if inputs.key.shape[-3] != 1:
        raise Skip(f"{inputs.key.shape[-3]} key/value heads: the mla convention has one")
    if not tied(inputs):
        raise Skip("values that are not the keys' leading dims: the mla convention's V is K's")


@checked_internal
def _paged(
    keys: list[Float[Tensor, "_n D"]], page: int, gen: torch.Generator, pad: int = 0
) -> tuple[Float[Tensor, "blocks {page} 1 D"], Int[Tensor, "B pages"]]:
    """``keys`` (one tensor of latent rows per sequence) in a paged cache of ``page``
    slots, physical pages shuffled by ``gen``, one page no sequence uses; every slot no
    sequence uses holds NaN, and the block table past a sequence's last page (and
    ``pad`` more columns) holds `HUGE_BLOCK`."""
    used = [max(1, -(-k.shape[0] // page)) for k in keys]
    width = max(used) + pad
    blocks = sum(used) + 1
    order = torch.randperm(blocks, generator=gen)
    like = keys[0]
    cache = torch.full((blocks, page, 1, like.shape[-1]), math.nan, dtype=like.dtype)
    cache = cache.to(like.device)
    table = torch.full((len(keys), width), HUGE_BLOCK, dtype=torch.int32)
    cursor = 0
    for b, (k, n_pages) in enumerate(zip(keys, used, strict=True)):
        pages = order[cursor : cursor + n_pages]
        table[b, :n_pages] = pages.to(torch.int32)
        cursor += n_pages
        rows = torch.full((n_pages * page, k.shape[-1]), math.nan, dtype=k.dtype, device=k.device)
        rows[: k.shape[0]] = k
        cache[pages.to(cache.device)] = rows.view(n_pages, page, 1, -1)
    return cache, table.to(like.device)


def dense_latent(inputs: Inputs, page: int) -> LatentCall:
    """Dense latent ``inputs`` as an MLA call: each sample's keys in pages of ``page``
    slots (shuffled, NaN where no key is), one sequence a sample."""
    q = flash_layout(inputs.query, inputs)  # (B, Tq, h, D)
    k = flash_layout(inputs.key, inputs)  # (B, Tk, 1, D)
    B, Tk = q.shape[0], k.shape[1]
    gen = torch.Generator().manual_seed(Tk * 131 + B)
    cache, table = _paged([k[b, :, 0] for b in range(B)], page, gen)
    Dv = inputs.value.shape[-1]
    rows = tuple(
        replace(inputs, query=q[b].transpose(0, 1), key=k[b].transpose(0, 1),
                value=k[b].transpose(0, 1)[..., :Dv], alibi_slopes=None)
        for b in range(B)
    )  # fmt: skip
    lengths = torch.full((B,), Tk, dtype=torch.int32, device=q.device)
    return LatentCall(rows, q, cache, table, lengths, Dv)


def latent_arguments(caps: Capabilities, call: LatentCall, overrides: dict[str, Any]) -> Arguments:
    """``flash_mla_with_kvcache``'s call for ``call``: FlashMLA's scheduler arguments
    (``tile_scheduler_metadata``, ``num_splits``) are left to the backend."""
    for row in call.rows:
        flash_checks(row)
    variant_kwargs(caps, call.first)  # Skip: this family takes no variant
    page = call.k_cache.shape[1]
    if caps.page_multiple > 1 and page % caps.page_multiple:
        raise Skip(f"page size {page}: the declared sizes are multiples of {caps.page_multiple}")
    kwargs: dict[str, Any] = {
        "softmax_scale": call.first.scale,
        "causal": call.first.causal is not None,
    }
    if call.descale_q is not None:
        fmt = next(n for n, d in FP8_FORMATS.items() if d == call.q.dtype)
        if fmt not in caps.fp8:
            raise Skip(f"an FP8 ({fmt}) latent cache not declared")
        kwargs["descale_q"], kwargs["descale_k"] = call.descale_q, call.descale_k
    kwargs.update(overrides)
    args = (call.q, call.k_cache, call.block_table, call.cache_seqlens, call.head_dim_v)
    return args, kwargs


def _invoke(backend: Backend, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One call, in the worker: a function whose ``tile_scheduler_metadata`` has no
    default (FlashMLA's own signature) is given ``None`` for it, which a port that
    schedules its own work takes; a function without the parameter is not given it."""
    try:
        params = inspect.signature(backend.fn).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    meta = params.get("tile_scheduler_metadata")
    if meta is not None and meta.default is meta.empty and len(args) < 6:
        kwargs = {"tile_scheduler_metadata": None, **kwargs}
    return backend(*args, **kwargs)


def _page_for(caps: Capabilities) -> int:
    """The page size a dense case's cache is laid out in."""
    return caps.page_multiple if caps.page_multiple > 1 else 16


def _mla_build(
    caps: Capabilities, inputs: Inputs, lse: bool, overrides: dict[str, Any]
) -> Arguments:
    _latent_checks(inputs)
    return latent_arguments(caps, dense_latent(inputs, _page_for(caps)), overrides)


def read_latent(
    out: object, call: LatentCall, lse: bool
) -> tuple[list[object], list[object] | None]:
    """The output (and LSE) of each sequence of ``call``, as ``(h, Tq, Dv)`` and ``(h,
    Tq)``: the call returns ``(out, lse)`` whether or not it is asked for."""
    first, lse_out = pair(out, "flash_mla_with_kvcache returns (out, lse)")
    return per_row(first, lse_out, (*call.q.shape[:3], call.head_dim_v), lse)


def _mla_read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    first, lse_out = pair(out, "flash_mla_with_kvcache returns (out, lse)")
    B = math.prod(inputs.query.shape[:-3])
    shape = (B, inputs.query.shape[-2], inputs.query.shape[-3], inputs.value.shape[-1])
    return dense_read(out, inputs, lse, per_row(first, lse_out, shape, lse))


# ------------------------------------------------ the adapter from a flash callable


def latent_form(
    flash: Callable[..., Any], name: str, *, bugs: frozenset[str] = frozenset()
) -> Callable[..., Any]:
    """``flash`` (``flash_attn_func``'s signature) with ``flash_mla_with_kvcache``'s: the
    valid latent rows of each sequence gathered through the block table, V their first
    ``head_dim_v`` dims, one call of ``flash`` per sequence; the LSE of a query that sees
    no key made ``+inf``, in float32.

    ``bugs`` plants class-35 (and paged) bugs, for the mutants: ``default_scale`` (the
    kernel's ``D ** -0.5`` whatever the caller passes), ``values_from_tail`` (V read as
    the cache's last ``head_dim_v`` dims), ``lse_base2`` (the LSE in base 2, as
    FlashInfer returns it by default), ``empty_nan`` (a sequence with no cached token,
    a chunk with no keys, comes out NaN), ``tail_counted`` (the whole last page
    attended), ``causal_top_left`` (several queries a sequence, causal from the top
    left), ``page_offset_16bit`` (a page's element offset kept in 16 bits).
    """

    @checked_internal
    def mla(
        q: Float[Tensor, "B Tq h D"],
        k_cache: Float[Tensor, "blocks page 1 D"],
        block_table: Int[Tensor, "B pages"],
        cache_seqlens: Int[Tensor, " B"],
        head_dim_v: int,
        tile_scheduler_metadata: object = None,
        num_splits: object = None,
        softmax_scale: float | None = None,
        causal: bool = False,
    ) -> tuple[Float[Tensor, "B Tq h {head_dim_v}"], Float[Tensor, "B h Tq"]]:
        Tq, h, D = q.shape[1:]
        page = k_cache.shape[1]
        table = block_table
        if "page_offset_16bit" in bugs:
            stride = k_cache[0].numel()
            live = table.long().clamp(max=k_cache.shape[0] - 1)
            table = (live * stride % 2**16 // stride).to(table.dtype)
        scale = D**-0.5 if softmax_scale is None or "default_scale" in bugs else softmax_scale
        outs, lses = [], []
        for b, n in enumerate(cache_seqlens.tolist()):
            span = -(-n // page) * page if "tail_counted" in bugs else n
            keys = valid_keys(k_cache, b, span, table, b)  # (n, 1, D)
            values = (
                keys[..., -head_dim_v:] if "values_from_tail" in bugs else keys[..., :head_dim_v]
            )
            if keys.shape[0] == 0:
                out, lse = empty_part(q, h, head_dim_v, Tq)
                if "empty_nan" in bugs:
                    out = torch.full_like(out, math.nan)
            else:
                kwargs: dict[str, Any] = {"softmax_scale": scale, "causal": causal}
                qb = q[b][None]
                if causal and "causal_top_left" in bugs and Tq > 1:
                    # the diagonal measured from the first key: query j sees keys <= j
                    seen = min(keys.shape[0], Tq)
                    parts = [
                        flash(qb[:, j : j + 1], keys[None, : j + 1], values[None, : j + 1],
                              softmax_scale=scale, return_attn_probs=True)
                        for j in range(seen)
                    ] + [
                        flash(qb[:, j : j + 1], keys[None], values[None], softmax_scale=scale,
                              return_attn_probs=True)
                        for j in range(seen, Tq)
                    ]  # fmt: skip
                    out = torch.cat([p[0][0] for p in parts], dim=0)
                    lse = torch.cat([p[1][0] for p in parts], dim=-1)
                else:
                    result = flash(qb, keys[None], values[None], return_attn_probs=True, **kwargs)
                    out, lse = result[0][0], result[1][0]
            lse = lse.double() if q.dtype == torch.float64 else lse.float()
            lse = torch.where(torch.isneginf(lse), math.inf, lse)
            if "lse_base2" in bugs:
                lse = lse / math.log(2)
            outs.append(out)
            lses.append(lse)
        return torch.stack(outs), torch.stack(lses)

    mla.__name__ = mla.__qualname__ = name
    mla.__doc__ = f"{flash.__doc__ or ''}\n\nIn flash_mla_with_kvcache's convention."
    return mla


def fp8_latent(
    fn: Callable[..., Any],
    name: str,
    *,
    to: torch.dtype = torch.float32,
    bugs: frozenset[str] = frozenset(),
) -> Callable[..., Any]:
    """``fn`` (``flash_mla_with_kvcache``'s signature) that also takes q and the latent
    cache in FP8 with per-tensor descales, as vLLM's FlashMLA FP8 path does
    (``descale_q``, ``descale_k``: float32 of shape ``(1,)``; FlashMLA PR #54): both
    dequantized to ``to`` (the stored value times its scale, rounded once), ``fn``
    called on them, the output returned in bfloat16 and the LSE in float32. V is the
    cache's leading dims, so ``descale_k`` dequantizes the values too. Without FP8
    inputs, ``fn`` itself.

    ``bugs`` plants class-34 bugs, for the mutants: ``v_undescaled`` (``descale_k``
    applied to the scores only: V read as stored), ``q_descale_dropped``,
    ``k_descale_twice``.
    """

    @checked_internal
    def mla(
        q: Shaped[Tensor, "B Tq h D"],
        k_cache: Shaped[Tensor, "blocks page 1 D"],
        block_table: Int[Tensor, "B pages"],
        cache_seqlens: Int[Tensor, " B"],
        head_dim_v: int,
        tile_scheduler_metadata: object = None,
        num_splits: object = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        descale_q: Float[Tensor, "1"] | None = None,
        descale_k: Float[Tensor, "1"] | None = None,
    ) -> Any:
        rest = (block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits)
        if q.dtype not in FP8_FORMATS.values():
            return fn(q, k_cache, *rest, softmax_scale=softmax_scale, causal=causal)
        one = torch.ones(1, dtype=torch.float32, device=q.device)
        dq = one if descale_q is None or "q_descale_dropped" in bugs else descale_q.float()
        dk = one if descale_k is None else descale_k.float()
        if "k_descale_twice" in bugs:
            dk = dk * dk
        out, lse = fn((q.float() * dq).to(to), (k_cache.float() * dk).to(to), *rest,
                      softmax_scale=softmax_scale, causal=causal)  # fmt: skip
        if "v_undescaled" in bugs:  # P V with V as stored: the output is linear in V
            out = out.float() / dk
        return out.to(torch.bfloat16), lse.float()

    mla.__name__ = mla.__qualname__ = name
    mla.__doc__ = f"{fn.__doc__ or ''}\n\nWith FP8 latent caches (per-tensor descales)."
    return mla


# ------------------------------------------------------------------ the builtins


@checked_internal
def _sdpa_row(
    q: Float[Tensor, "Tq h D"], keys: Float[Tensor, "n 1 D"], Dv: int, scale: float, causal: bool
) -> tuple[Float[Tensor, "Tq h {Dv}"], Float[Tensor, "h Tq"]]:
    """One sequence through torch's SDPA (one key/value head, GQA), and its LSE from
    the scores in float32."""
    Tq, n = q.shape[0], keys.shape[0]
    qh = q.transpose(0, 1)[None]  # (1, h, Tq, D)
    kh = keys.transpose(0, 1)[None]  # (1, 1, n, D)
    mask = None
    seen = torch.ones((Tq, n), dtype=torch.bool, device=q.device)
    if causal:
        seen = torch.ones_like(seen).tril(diagonal=n - Tq)  # bottom-right
        mask = seen
    empty = ~seen.any(-1)  # (Tq,)
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, kh[..., :Dv], attn_mask=mask, scale=scale, enable_gqa=True
    )[0]  # (h, Tq, Dv)
    out = torch.where(empty[None, :, None], 0.0, out.nan_to_num()).to(q.dtype)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = (qh.to(wide) @ kh.to(wide).transpose(-1, -2))[0] * scale  # (h, Tq, n)
    lse = scores.masked_fill(~seen, -math.inf).logsumexp(-1)
    lse = torch.where(empty[None], math.inf, lse)
    return out.transpose(0, 1), lse


@checked_internal
def _mla_sdpa(
    q: Float[Tensor, "B Tq h D"],
    k_cache: Float[Tensor, "blocks page 1 D"],
    block_table: Int[Tensor, "B pages"],
    cache_seqlens: Int[Tensor, " B"],
    head_dim_v: int,
    tile_scheduler_metadata: object = None,
    num_splits: object = None,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> tuple[Float[Tensor, "B Tq h {head_dim_v}"], Float[Tensor, "B h Tq"]]:
    """torch's SDPA on each sequence's gathered latent rows: one key/value head shared by
    every query head (``enable_gqa``), V the rows' first ``head_dim_v`` dims; the LSE from
    the scores in float32."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    outs, lses = [], []
    for b, n in enumerate(cache_seqlens.tolist()):
        keys = valid_keys(k_cache, b, n, block_table, b)
        out, lse = _sdpa_row(q[b], keys, head_dim_v, scale, causal)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


_OURS = replace(mla_caps(REFERENCE_CAPS), fp8=tuple(FP8_FORMATS))
#: attnref's reference, torch's SDPA and the naive kernel in FlashMLA's convention, with
#: their declarations: ``attnref audit --api mla --backend
#: attnref.conformance.families.mla:mla_sdpa`` audits one as a user's kernel. Each takes
#: FP8 latent caches too: the reference and the naive kernel dequantize to float32, and
#: torch's SDPA to bfloat16 (dequantize-then-attend in the output dtype, vLLM's way)
mla_reference = declared(fp8_latent(mla_kvcache_attention, "mla_reference"), _OURS)
mla_sdpa = declared(fp8_latent(_mla_sdpa, "mla_sdpa", to=torch.bfloat16), _OURS)
mla_naive = declared(fp8_latent(latent_form(flash_naive, "mla_naive"), "mla_naive"), _OURS)


def _flash_mla(*args: Any, **kwargs: Any) -> Any:
    """FlashMLA's ``flash_mla_with_kvcache`` (the ``flash_mla`` package, Hopper GPUs): its
    scheduler metadata made for each call."""
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    if len(args) < 6 and kwargs.get("tile_scheduler_metadata") is None:
        kwargs["tile_scheduler_metadata"] = get_mla_metadata()[0]
    kwargs.pop("num_splits", None)  # FlashMLA schedules its own splits
    return flash_mla_with_kvcache(*args, **kwargs)


def _builtins() -> list[Backend]:
    return [
        Backend("mla-reference", mla_reference,
                "attnref's mla_kvcache_attention (the KV-cache reference, V the cache)",
                _OURS, api=NAME),
        Backend("mla-sdpa", mla_sdpa,
                "torch SDPA on each sequence's gathered latent rows (one KV head, GQA)",
                _OURS, api=NAME),
        Backend("mla-naive", mla_naive, "the naive kernel on each sequence's latent rows",
                _OURS, api=NAME),
        Backend("flash-mla", _flash_mla,
                "FlashMLA's flash_mla_with_kvcache (skipped where flash_mla is absent)",
                replace(FLASH_MLA, devices=("cuda",)), api=NAME, needs="flash_mla"),
    ]  # fmt: skip


# ---------------------------------------------------------------- the cases


def build_latent(case: Case, dtype: torch.dtype, device: str | torch.device = "cpu") -> LatentCall:
    """The call ``case`` describes: ``case.cached`` tokens in each sequence, ``case.Tq``
    queries each, ``case.h`` query heads, latent rows of ``case.Dh`` dims whose first
    ``case.Dv`` are the values, in pages of ``case.page`` slots (shuffled), NaN in every
    slot no sequence uses, the block table padded with `HUGE_BLOCK` (``case.pad`` more
    columns of it). The tokens are drawn from the seed alone, whatever the layout."""
    if not case.cached:
        raise ValueError(f"case {case.name}: an MLA call needs cached lengths")
    if case.Dv > case.Dh:
        raise Skip(f"Dv = {case.Dv} > Dqk = {case.Dh}: an MLA call's V is its keys' leading dims")
    gen = torch.Generator().manual_seed(case.seed)
    junk = torch.Generator().manual_seed(case.seed + 7919)
    B, Tq, h, D, Dv = len(case.cached), case.Tq, case.h, case.Dh, case.Dv
    proto = torch.empty((), dtype=dtype, device=device)
    q = (case.amp * torch.randn((B, Tq, h, D), generator=gen)).to(proto)
    keys = [(case.amp * torch.randn((n, D), generator=gen)).to(proto) for n in case.cached]
    cache, table = _paged(keys, case.page or 64, junk, case.pad)
    rows = tuple(
        Inputs(q[b].transpose(0, 1), k[None], k[None, :, :Dv], None, case.causal, case.scale)
        for b, k in enumerate(keys)
    )
    lengths = torch.tensor(case.cached, dtype=torch.int32, device=device)
    return LatentCall(rows, q, cache, table, lengths, Dv)


def _call(
    ctx: Context, call: LatentCall, lse: bool = True
) -> tuple[list[Tensor], list[Tensor] | None]:
    """The backend's output (and LSE) for each sequence of ``call``."""
    args, kwargs = latent_arguments(ctx.caps, call, {})
    guard(ctx, call.first, kwargs)
    raw = invoke(ctx.backend, Job(args, kwargs), ctx.timeout, ctx.executor)
    note_reading(
        ctx.executor,
        raw,
        lambda r: zip(call.rows, *with_lses(read_latent(r, call, lse)), strict=True),
    )
    outs, lses = read_latent(raw, call, lse)
    return judge(outs, lses, call.rows)


def _default_scale(
    ctx: Context, outs: list[Tensor], lses: list[Tensor] | None, call: LatentCall
) -> str:
    """Whether results that failed (outputs, and LSEs where the kernel returns them)
    match the kernel's default scale, ``D ** -0.5``, in place of the caller's: the scale
    trap (class 35). Its LSE shows it where its output cannot (one key)."""
    first = call.first
    if first.scale is None:
        return ""
    D = first.query.shape[-1]

    def matches(rows: tuple[Inputs, ...]) -> bool:
        try:
            agree(ctx, outs, lses, rows, "sequence")
        except Failure:
            return False
        return True

    if matches(call.rows):
        return ""  # the results are right: what failed is not the scale
    if not matches(tuple(replace(x, scale=None) for x in call.rows)):
        return ""
    what = "outputs" if lses is None else "outputs and log-sum-exps"
    return (f"the {what} match the kernel's default scale {D} ** -0.5 = {D**-0.5:.6g}, "
            f"not the softmax_scale passed ({first.scale:.6g}): the scale trap")  # fmt: skip


def _mla(ctx: Context, case: Case) -> None:
    """Each sequence agrees with the oracle of its valid latent rows (output and LSE):
    NaN in every slot no sequence uses, the block table padded with a huge id, physical
    pages shuffled; an explicit scale is honoured (the kernel's default named when it
    was used instead). The LSE only where the backend declares it (`Capabilities.lse`:
    SGLang's MLA decode returns none)."""
    call = build_latent(case, ctx.dtype, ctx.device)
    outs, lses = _call(ctx, call, lse=ctx.caps.lse)
    try:
        agree(ctx, outs, lses, call.rows, "sequence")
    except Failure as failure:
        trap = _default_scale(ctx, outs, lses, call)
        if trap:
            raise Failure(
                f"{failure}; {trap}", got=failure.got, expected=failure.expected,
                where=failure.where, kind=failure.kind,
            ) from None  # fmt: skip
        raise


def _mla_pages(ctx: Context, case: Case) -> None:
    """Permuting the physical pages (and the block table with them) changes nothing."""
    call = build_latent(case, ctx.dtype, ctx.device)
    base, _ = _call(ctx, call, lse=False)
    blocks = call.k_cache.shape[0]
    perm = torch.randperm(blocks, generator=rng(case, 5))
    if bool((perm == torch.arange(blocks)).all()):
        perm = perm.flip(0)
    perm = perm.to(call.k_cache.device)
    cache = torch.empty_like(call.k_cache)
    cache[perm] = call.k_cache
    live = call.block_table != HUGE_BLOCK
    table = torch.where(live, perm[call.block_table.long().clamp(max=blocks - 1)].int(),
                        call.block_table)  # fmt: skip
    moved, _ = _call(ctx, replace(call, k_cache=cache, block_table=table), lse=False)
    for b, x in enumerate(call.rows):
        law(ctx, moved[b], x, base[b], x, f"sequence {b}: physical pages permuted")


def _mla_batch(ctx: Context, case: Case) -> None:
    """A sequence's result does not depend on the others of its batch (a kernel splits
    the keys by the whole batch's work): each sequence alone, and the batch in reverse
    order, against the batch."""
    call = build_latent(case, ctx.dtype, ctx.device)
    base, _ = _call(ctx, call, lse=False)
    B = len(call.rows)
    for b in range(B):
        one = replace(call, rows=(call.rows[b],), q=call.q[b : b + 1],
                      block_table=call.block_table[b : b + 1],
                      cache_seqlens=call.cache_seqlens[b : b + 1])  # fmt: skip
        alone, _ = _call(ctx, one, lse=False)
        law(ctx, alone[0], call.rows[b], base[b], call.rows[b], f"sequence {b} alone")
    if B > 1:
        order = list(reversed(range(B)))
        back = replace(call, rows=tuple(call.rows[i] for i in order), q=call.q.flip(0),
                       block_table=call.block_table.flip(0),
                       cache_seqlens=call.cache_seqlens.flip(0))  # fmt: skip
        rev, _ = _call(ctx, back, lse=False)
        for j, b in enumerate(order):
            law(
                ctx,
                rev[j],
                call.rows[b],
                base[b],
                call.rows[b],
                f"sequence {b} of the batch reversed",
            )


def _mla_decode(ctx: Context, case: Case) -> None:
    """Several queries a sequence at once, causal (multi-token decode, speculative),
    equal each query decoded alone against the cache as it was at its step: query ``j``
    of ``Tq`` against the first ``n - Tq + j + 1`` tokens."""
    if case.causal is None or case.Tq < 2:
        raise Skip("needs causal calls of several queries")
    call = build_latent(case, ctx.dtype, ctx.device)
    full, _ = _call(ctx, call, lse=False)
    Tq = case.Tq
    for j in range(Tq):
        lengths = (call.cache_seqlens - Tq + j + 1).clamp(min=0)
        rows = tuple(
            replace(
                x, query=x.query[:, j : j + 1], key=x.key[:, : int(n)], value=x.value[:, : int(n)]
            )
            for x, n in zip(call.rows, lengths.tolist(), strict=True)
        )
        step = replace(call, rows=rows, q=call.q[:, j : j + 1], cache_seqlens=lengths.int())
        outs, _ = _call(ctx, step, lse=False)
        for b in range(len(rows)):
            law(ctx, outs[b], rows[b], full[b], call.rows[b],
                f"sequence {b}: query {j} decoded alone against {int(lengths[b])} tokens",
                transform=lambda o, j=j: o[:, j : j + 1])  # type: ignore[misc]  # fmt: skip


def _mla_merge(ctx: Context, case: Case) -> None:
    """The LSE's merge law: the keys cut at a page boundary into two calls (the second
    through the block table's later columns), their outputs weighted by ``exp(lse)``,
    equal the whole call; and the merged LSE is the whole LSE."""
    if case.causal is not None and case.Tq > 1:
        raise Skip("the cut must not change which keys a query sees: one query, or no mask")
    call = build_latent(case, ctx.dtype, ctx.device)
    page = call.k_cache.shape[1]
    pages = [-(-n // page) for n in case.cached]
    if min(pages) < 2:
        raise Skip("needs every sequence over two pages or more")
    cut = [p // 2 * page for p in pages]
    whole, whole_lse = _call(ctx, call)
    assert whole_lse is not None
    parts = []
    for first in (True, False):
        lengths = [c if first else n - c for n, c in zip(case.cached, cut, strict=True)]
        table = torch.stack([
            call.block_table[b] if first else call.block_table[b].roll(-(c // page))
            for b, c in enumerate(cut)
        ])  # fmt: skip
        rows = tuple(
            replace(x, key=x.key[:, :c] if first else x.key[:, c:],
                    value=x.value[:, :c] if first else x.value[:, c:])
            for x, c in zip(call.rows, cut, strict=True)
        )  # fmt: skip
        lens = torch.tensor(lengths, dtype=torch.int32, device=call.q.device)
        part = replace(call, rows=rows, block_table=table, cache_seqlens=lens)
        parts.append((part, *_call(ctx, part)))
    for b, x in enumerate(call.rows):
        (_, o1, l1), (_, o2, l2) = parts
        assert l1 is not None
        assert l2 is not None
        a, z = l1[b].double(), l2[b].double()
        m = torch.logaddexp(a, z)
        merged = (
            o1[b].double() * (a - m).exp()[..., None] + o2[b].double() * (z - m).exp()[..., None]
        )
        law(
            ctx, merged, x, whole[b], x, f"sequence {b}: two halves of the keys merged by their LSE"
        )
        exp = ctx.expect_lse(x)
        close(m, exp.value, *exp.bounds(), f"sequence {b}: the merged log-sum-exp")


def _mla_examples(p: Profile, c: Capabilities) -> list[Case]:
    """Where class 35 shows: DeepSeek's model scale (``192 ** -0.5`` times a YaRN
    factor) with its many heads, a sequence with no cached token in a batch (a chunk
    with no keys), a partial last page, several causal queries."""
    page = c.page_multiple if c.page_multiple > 1 else 16
    yarn = 192**-0.5 * (0.1 * math.log(40) + 1) ** 2
    base = [
        Case("mla_model_scale", h=16, cached=(page + 5, 3), Tq=1, page=page, scale=yarn),
        Case("mla_empty_sequence", h=4, cached=(0, 7, 2 * page - 1), Tq=2, page=page,
             causal="bottom_right"),
        Case("mla_tail", h=8, cached=(page - 1, page + 1), Tq=1, page=page, pad=2),
        Case("mla_causal_queries", h=4, cached=(2 * page + 3,), Tq=4, page=page,
             causal="bottom_right", scale=0.37),
        Case("mla_short_causal", h=2, cached=(2, 1), Tq=3, page=page, causal="bottom_right"),
    ]  # fmt: skip
    return [replace(x, g=1, Dh=40, Dv=32, latent=True, seed=400 + i) for i, x in enumerate(base)]


def _mla_cases(
    name: str, **pins: Any
) -> Callable[[Profile, Capabilities], st.SearchStrategy[Case]]:
    """MLA calls: 1 to 3 sequences, 1 to 4 queries each, 1 to 128 query heads (many,
    as DeepSeek's 16 to 128), explicit scales drawn often, paged."""

    def cases(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
        m = c.page_multiple
        fields: dict[str, Any] = {
            "g": 1,
            "group": st.sampled_from((16, 1, 4, 32, 128)),
            "new": 0,
            "Tq": st.integers(1, 4),
            "page": st.sampled_from((m, 2 * m) if m > 1 else (16, 1, 4, 5, 64)),
            "pad": st.sampled_from((0, 1, 3)),
            "shuffle": True,
            "scale": st.sampled_from((None, 0.37, 192**-0.5, 1.0)),
        }
        fields.update(pins)
        return cache_strategy(name, p, c, **fields).map(lambda x: replace(x, rotary=0, g=1))

    return cases


# ------------------------------------------------------------ FP8 latent caches


def quantize_latent(call: LatentCall, fmt: str, seed: int) -> LatentCall:
    """``call`` (built in float64) with q and the latent cache stored in FP8 ``fmt`` and
    per-tensor descales (vLLM's FlashMLA FP8 path): each divided by its scale (from 1/8
    to 8, never within sqrt(2) of 1; or, half the time, calibrated: amax over the
    format's largest, times 0.8 to 1, so that stored values reach saturation), rounded
    to FP8, saturating; its rows rebuilt from the stored
    values times the scales, exact in float64, V the dequantized keys' leading dims.
    The unused slots stay NaN."""
    fp8 = FP8_FORMATS[fmt]
    gen = torch.Generator().manual_seed(seed * 31 + 23)
    dq, dk = (descales(1, 1, gen).reshape(1).to(call.q.device) for _ in range(2))
    if bool(torch.rand((), generator=gen) < CALIBRATED):  # amax / the format's largest
        factor = 0.8 + 0.2 * torch.rand(2, generator=gen, dtype=torch.float64)
        dq, dk = (
            calibrated_scale(torch.nan_to_num(x.abs(), nan=0.0).amax().reshape(1), fp8, f).to(
                call.q.device
            )
            for x, f in ((call.q, factor[:1]), (call.k_cache, factor[1:]))
        )
    q8 = saturated(call.q / dq.double(), fp8)
    k8 = saturated(call.k_cache / dk.double(), fp8)
    queries, cache = q8.double() * dq.double(), k8.double() * dk.double()
    rows = []
    for b, x in enumerate(call.rows):
        keys = valid_keys(cache, b, x.key.shape[-2], call.block_table, b).transpose(0, 1)
        rows.append(replace(x, query=queries[b].transpose(0, 1), key=keys,
                            value=keys[..., : call.head_dim_v]))  # fmt: skip
    return replace(call, rows=tuple(rows), q=q8, k_cache=k8, descale_q=dq, descale_k=dk)


@checked_internal
def _rescaled(
    call: LatentCall, descale_q: Float32[Tensor, "1"], descale_k: Float32[Tensor, "1"]
) -> LatentCall:
    """``call`` with other descales, its rows rebuilt from the same stored values."""
    assert call.descale_q is not None
    assert call.descale_k is not None
    fq = float(descale_q.double() / call.descale_q.double())
    fk = float(descale_k.double() / call.descale_k.double())
    rows = tuple(
        replace(x, query=x.query * fq, key=x.key * fk, value=x.value * fk) for x in call.rows
    )
    return replace(call, rows=rows, descale_q=descale_q, descale_k=descale_k)


def _fp8_call(
    ctx: Context, case: Case, scales: tuple[Tensor, Tensor] | None = None, scale: float = 1.0
) -> tuple[LatentCall, list[Tensor], list[Tensor]]:
    """``case``'s FP8 call (its descales replaced by ``scales``, its softmax scale
    multiplied by ``scale``) and each sequence's output and LSE, its bounds kept as the
    sequence's oracle for the laws."""
    if ctx.dtype != torch.bfloat16:
        raise Skip("an FP8 call returns bfloat16: audited in the bfloat16 run")
    if case.fp8 not in ctx.caps.fp8:
        raise Skip(f"an FP8 ({case.fp8}) latent cache not declared")
    if scale != 1.0:
        case = replace(case, scale=(case.Dh**-0.5 if case.scale is None else case.scale) * scale)
    call = quantize_latent(build_latent(case, torch.float64, ctx.device), case.fp8, case.seed)
    if scales is not None:
        call = _rescaled(call, *scales)
    args, kwargs = latent_arguments(ctx.caps, call, {})
    guard(ctx, call.first.to(torch.bfloat16), kwargs)
    raw = invoke(ctx.backend, Job(args, kwargs), ctx.timeout, ctx.executor)
    note_reading(
        ctx.executor,
        raw,
        lambda r: zip(call.rows, *with_lses(read_latent(r, call, True)), strict=True),
    )
    outs, lses = read_latent(raw, call, True)
    got, got_lse = judge(outs, lses, tuple(x.to(torch.bfloat16) for x in call.rows))
    assert got_lse is not None
    for x in call.rows:
        ctx.keep(x, fp8_expected(ctx, x, case.fp8))
    return call, got, got_lse


def _mla_fp8(ctx: Context, case: Case) -> None:
    """Each sequence of an FP8 call (q and the latent cache in FP8 with per-tensor
    descales, neither of them 1) agrees with the oracle of its dequantized rows: output
    and LSE."""
    call, outs, lses = _fp8_call(ctx, case)
    for b, (out, lse, x) in enumerate(zip(outs, lses, call.rows, strict=True)):
        label = f"sequence {b} (Tq = {x.query.shape[-2]}, Tk = {x.key.shape[-2]}, {case.fp8})"
        exp = ctx.expect(x)
        with ctx.naming_the_row(x):
            close(
                out.to(torch.float64),
                exp.value,
                *exp.bounds(),
                f"{label}: output",
                semantic=exp.semantic,
            )
        el = fp8_lse_expected(x, ctx.caps.empty_lse)
        ctx.keep_lse(x, el)
        close(lse.to(torch.float64), el.value, *el.bounds(), f"{label}: log-sum-exp")


def _mla_fp8_fold(ctx: Context, case: Case) -> None:
    """A scale folded between q and the cache, or between q and the softmax scale,
    changes nothing: ``descale_q * c`` with ``descale_k / c``, and ``descale_q * c``
    with ``softmax_scale / c`` (c a power of two: no rounding moves)."""
    call, base, _ = _fp8_call(ctx, case)
    assert call.descale_q is not None
    assert call.descale_k is not None
    c = float(powers((1,), rng(case, 7))[0])
    moved, got, _ = _fp8_call(ctx, case, (call.descale_q * c, call.descale_k / c))
    for b, (x, y) in enumerate(zip(call.rows, moved.rows, strict=True)):
        law(ctx, got[b], y, base[b], x, f"sequence {b}: descale_q * {c:g}, descale_k / {c:g}")
    d = float(powers((1,), rng(case, 8))[0])
    moved, got, _ = _fp8_call(ctx, case, (call.descale_q * d, call.descale_k), scale=1 / d)
    for b, (x, y) in enumerate(zip(call.rows, moved.rows, strict=True)):
        law(ctx, got[b], y, base[b], x, f"sequence {b}: descale_q * {d:g}, softmax_scale / {d:g}")


def _mla_fp8_values(ctx: Context, case: Case) -> None:
    """``descale_k`` dequantizes the values too (V is the same rows' leading dims):
    ``descale_k * c`` with ``descale_q / c`` leaves every score as it was and multiplies
    the output by exactly ``c``."""
    call, base, _ = _fp8_call(ctx, case)
    assert call.descale_q is not None
    assert call.descale_k is not None
    c = float(powers((1,), rng(case, 9))[0])
    moved, got, _ = _fp8_call(ctx, case, (call.descale_q / c, call.descale_k * c))
    for b, (x, y) in enumerate(zip(call.rows, moved.rows, strict=True)):
        law(ctx, got[b], y, base[b], x,
            f"sequence {b}: descale_k * {c:g}, descale_q / {c:g}: the output times {c:g}",
            transform=lambda o, c=c: o * c, factor=c)  # type: ignore[misc]  # fmt: skip


def _fp8_cases(
    name: str, **pins: Any
) -> Callable[[Profile, Capabilities], st.SearchStrategy[Case]]:
    """The MLA calls of `_mla_cases`, in an FP8 format the backend declares."""
    latent = _mla_cases(name, **pins)

    def cases(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
        formats = st.sampled_from(c.fp8 or ("e4m3fn",))
        return st.tuples(latent(p, c), formats).map(lambda t: replace(t[0], fp8=t[1]))

    return cases


PROPERTIES: tuple[Property, ...] = (
    Property(
        "mla",
        "each sequence of an MLA decode call agrees with the oracle of its latent rows "
        "(output and LSE), NaN in every unused slot, the block table padded with a huge "
        "id, pages shuffled; an explicit scale is honoured",
        (27, 32, 35),
        _mla_cases("mla"),
        _mla,
        examples=_mla_examples,
        families=(NAME,),
    ),
    Property(
        "mla_pages",
        "permuting the physical pages (and the block table) changes nothing",
        (27,),
        _mla_cases("mla_pages"),
        _mla_pages,
        families=(NAME,),
    ),
    Property(
        "mla_batch",
        "a sequence's result does not depend on the rest of its batch (split-KV scheduling)",
        (25, 32),
        _mla_cases("mla_batch", Tq=st.integers(1, 2)),
        _mla_batch,
        families=(NAME,),
    ),
    Property(
        "mla_decode",
        "several causal queries at once equal each decoded alone against the cache of its step",
        (4, 27, 35),
        _mla_cases("mla_decode", causal="bottom_right", Tq=st.integers(2, 4)),
        _mla_decode,
        families=(NAME,),
    ),
    Property(
        "mla_merge",
        "the LSE's merge law: two halves of the keys merged by their LSE equal the whole",
        (25, 35),
        _mla_cases("mla_merge", Tq=1),
        _mla_merge,
        families=(NAME,),
        requires=needs_lse,  # SGLang's MLA decode returns none
    ),
    Property(
        "mla_fp8",
        "each sequence of an FP8 MLA call (per-tensor descales, neither of them 1) agrees "
        "with the oracle of its dequantized rows, output and LSE",
        (34,),
        _fp8_cases("mla_fp8"),
        _mla_fp8,
        requires=needs_fp8,
        families=(NAME,),
    ),
    Property(
        "mla_fp8_fold",
        "a scale folded between q and the cache, or q and the softmax scale, changes nothing",
        (34,),
        _fp8_cases("mla_fp8_fold"),
        _mla_fp8_fold,
        requires=needs_fp8,
        families=(NAME,),
    ),
    Property(
        "mla_fp8_values",
        "descale_k dequantizes V too: a factor moved from descale_q to descale_k scales "
        "the output by exactly that factor",
        (34,),
        _fp8_cases("mla_fp8_values"),
        _mla_fp8_values,
        requires=needs_fp8,
        families=(NAME,),
    ),
)


# ------------------------------------------------------------------- the mutants


def _mutant_fn(self: Mutant) -> Callable[..., Any]:
    """A bug in how latent rows are read, dequantized or the result given back: the
    naive kernel behind a buggy `latent_form` and `fp8_latent`."""
    bugs = frozenset(self.switches)
    fn = fp8_latent(latent_form(flash_naive, self.name, bugs=bugs), self.name, bugs=bugs)
    fn.__doc__ = f"Class {self.bug_class}: {self.summary}"
    fn.capabilities = self.capabilities  # type: ignore[attr-defined]
    return fn


_LIKE: dict[str, Any] = {"api": NAME, "capabilities": _OURS}

MUTANTS: tuple[Mutant, ...] = (
    Mutant("mla_default_scale", 35, "the kernel's default scale D ** -0.5 (576 ** -0.5) "
           "used whatever softmax_scale the caller passes", {"default_scale": True}, **_LIKE),
    Mutant("mla_values_from_tail", 35, "V read as the latent row's last head_dim_v dims, "
           "not its first", {"values_from_tail": True}, **_LIKE),
    Mutant("mla_lse_base2", 35, "the LSE returned in base 2 (FlashInfer's default)",
           {"lse_base2": True}, **_LIKE),
    Mutant("mla_empty_chunk_nan", 35, "a sequence with no cached token (a chunk with no "
           "keys) comes out NaN", {"empty_nan": True}, **_LIKE),
    Mutant("mla_tail_counted", 27, "the unused tail of the last page enters the softmax",
           {"tail_counted": True}, **_LIKE),
    Mutant("mla_causal_top_left", 4, "several causal queries a sequence measured from the "
           "top left, not the bottom right", {"causal_top_left": True}, **_LIKE),
    Mutant("mla_offset_wraps", 21, "a page's element offset (its index times its stride) "
           "wraps at 2**16, as a 32-bit one does past 2**31", {"page_offset_16bit": True},
           **_LIKE),
    Mutant("mla_fp8_v_undescaled", 34, "an FP8 latent cache's descale_k applied to the "
           "scores only: V, the same rows' leading dims, read as stored",
           {"v_undescaled": True}, **_LIKE),
    Mutant("mla_fp8_q_descale_dropped", 34, "an FP8 call's descale_q ignored",
           {"q_descale_dropped": True}, **_LIKE),
    Mutant("mla_fp8_k_descale_twice", 34, "an FP8 latent cache's descale_k applied twice",
           {"k_descale_twice": True}, **_LIKE),
)  # fmt: skip


def _decode_workload(case: ServingCase) -> Workload:
    """One MLA decoding step: ``B`` sequences of ``seq`` cached latent rows of ``Dh``
    dims (the values their first ``Dh * 8 // 9``, 512 of 576), one query of ``h`` heads
    each, in shuffled pages of ``page`` slots. ``B`` tokens a call."""
    Dv = case.Dh * 8 // 9

    def arguments(seed: int) -> Arguments:
        gen = torch.Generator().manual_seed(seed)
        B, page, device = case.B, case.page or 64, case.device
        per_row = -(-case.seq // page)
        order = torch.randperm(B * per_row, generator=gen)
        table = order.reshape(B, per_row).to(torch.int32).to(device)
        q = case.randn(gen, B, 1, case.h, case.Dh)
        cache = case.randn(gen, B * per_row, page, 1, case.Dh)
        lengths = torch.full((B,), case.seq, dtype=torch.int32, device=device)
        return (q, cache, table, lengths, Dv), {"softmax_scale": 192**-0.5, "causal": True}

    where = f"cache={case.seq} page {case.page or 64} {case.dtype}"
    label = f"B={case.B} h={case.h} D={case.Dh}/{Dv} {where}"
    size = torch.empty((), dtype=DTYPES[case.dtype]).element_size()
    read = case.B * case.seq * case.Dh * size  # each sequence's latent rows, once
    return Workload(label, case.B, arguments, oracle="mla-reference", output=_first,
                    values=_latent_values, bytes=read)  # fmt: skip


def _first(result: object) -> object:
    """The output of an ``(out, lse)`` result (anything else as it is, which the bench
    then reports as not a tensor)."""
    if isinstance(result, tuple) and len(result) == 2:
        return result[0]
    return result


def _latent_values(args: tuple[object, ...]) -> object:
    """V: the latent cache's first ``head_dim_v`` dims."""
    cache, dv = args[1], args[4]
    assert isinstance(cache, Tensor)
    assert isinstance(dv, int)
    return cache[..., :dv]


FAMILY = ApiFamily(
    name=NAME,
    alignments=("bottom_right",),  # each sequence's, as FlashAttention's
    summary="FlashMLA's flash_mla_with_kvcache: multi-head latent attention decode over a "
    "paged cache of latent rows, one KV head, V the cache's first head_dim_v dims",
    signature="fn(q, k_cache, block_table, cache_seqlens, head_dim_v, "
    "tile_scheduler_metadata=None, num_splits=None, softmax_scale=None, causal=False, "
    "descale_q=None, descale_k=None) -> (out, lse)",
    positional=5,
    keywords=("softmax_scale", "causal"),
    defaults=FLASH_MLA,
    build=_mla_build,
    read=_mla_read,
    to_layout=flash_layout,
    from_layout=flash_back,
    native_causal=flash_native_causal,
    dropout=False,
    invoke=_invoke,
    builtins=_builtins,
    properties=PROPERTIES,
    mutants=MUTANTS,
    mutant_fn=_mutant_fn,
    bench_backends=("mla-reference", "mla-sdpa", "flash-mla"),
    workload=_decode_workload,
    serving_pages=(64,),
)
