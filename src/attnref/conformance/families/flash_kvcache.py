"""The ``flash-kvcache`` family: FlashAttention 2's ``flash_attn_with_kvcache``, decoding
against a contiguous or paged KV cache, an in-place append, rotary for the new tokens,
split-KV (docs/kvcache.md).

Everything of the family is here: the convention (`cache_arguments`, `read_cache`; a
dense case runs as a decode call on a cache holding its keys), `kvcache_form` (a
flash-convention function driven row by row on the gathered cache, with the switches of
the class 27-29 mutants), the preset (`FLASH_ATTN_2_KVCACHE`), the built-in backends,
the properties only a cache can have and the mutants. The cache rules themselves
(slots, valid keys, rotation positions) are `attnref.kvcache`'s, used by the reference,
by `kvcache_form` and by the cases (`attnref.conformance.serving`) alike.
"""

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from hypothesis import strategies as st
from jaxtyping import Float, Float32, Int, Shaped
from torch import Tensor

from attnref._checking import checked_internal
from attnref.conformance.calls import invoke, note_reading
from attnref.conformance.cases import Case, Inputs
from attnref.conformance.checks import Context, law, rng
from attnref.conformance.declarations import FP8_FORMATS, Backend, Capabilities, EmptyLse
from attnref.conformance.families.flash import (
    FLASH_ATTN_2,
    declared,
    dense_read,
    empty_part,
    flash_back,
    flash_caps,
    flash_checks,
    flash_flex,
    flash_form,
    flash_kwargs,
    flash_layout,
    flash_naive,
    flash_native_causal,
)
from attnref.conformance.families.sdpa import (
    FLEX_CAPS,
    NAIVE_CAPS,
    REFERENCE_CAPS,
    SDPA_BIAS_CAPS,
    sdpa_with_bias,
)
from attnref.conformance.family import ApiFamily, Arguments, pair
from attnref.conformance.mutants import Mutant
from attnref.conformance.oracle import Expected, close, expect, expect_lse
from attnref.conformance.profiles import Profile
from attnref.conformance.properties import Property, some_variants
from attnref.conformance.serving import GARBAGE, CacheCall, build_cache, dense_cache, quantize
from attnref.conformance.serving_checks import agree, expect_rotated, guard, judge, with_lses
from attnref.conformance.strategies import cache_strategy
from attnref.conformance.verdicts import Failure, Skip
from attnref.conformance.worker import Job
from attnref.conformance.workloads import ServingCase, Workload
from attnref.kvcache import kvcache_attention
from attnref.rotary import halves_from_interleaved

__all__ = [
    "FAMILY",
    "FLASH_ATTN_2_KVCACHE",
    "cache_arguments",
    "fp8_lse_expected",
    "kvcache_flex",
    "kvcache_form",
    "kvcache_naive",
    "kvcache_reference",
    "kvcache_sdpa",
    "read_cache",
]

NAME = "flash-kvcache"
#: the ``flash-kvcache`` family's preset: flash_attn_with_kvcache has no backward, and
#: takes rotary and a paged cache (pages of a multiple of 256 tokens)
FLASH_ATTN_2_KVCACHE = replace(
    FLASH_ATTN_2,
    family=NAME,
    gradients=False,
    rotary=True,
    paged=True,
    page_multiple=256,
)


# ----------------------------------------------------------------- the convention


def cache_arguments(
    caps: Capabilities, call: CacheCall, lse: bool, overrides: dict[str, Any] | None = None
) -> Arguments:
    """``flash_attn_with_kvcache``'s call for ``call``: keywords left at FlashAttention's
    defaults are not passed."""
    for row in call.rows:
        flash_checks(row)
        Tq, Tk = row.query.shape[-2], row.key.shape[-2]
        if caps.queries_at_most_keys and Tq > Tk:  # per row: each has its own keys
            raise Skip(f"a row of {Tq} queries and {Tk} keys: queries at most keys declared")
    # sinks (our extension of flash_attn_with_kvcache's names: SGLang's decode and
    # vLLM's unified attention have one logit a query head) reach it as ``sinks=``
    # where declared (`variant_kwargs`: a Skip otherwise)
    if call.rotary_cos is not None and not caps.rotary:
        raise Skip("rotary not declared")
    if call.block_table is not None:
        if not caps.paged:
            raise Skip("a paged cache not declared")
        page = call.k_cache.shape[1]
        if page % caps.page_multiple:
            raise Skip(
                f"page size {page}: the declared sizes are multiples of {caps.page_multiple}"
            )
    kwargs: dict[str, Any] = {"cache_seqlens": call.cache_seqlens}
    if call.k_new is not None:
        kwargs["k"], kwargs["v"] = call.k_new, call.v_new
    if call.rotary_cos is not None:
        kwargs["rotary_cos"], kwargs["rotary_sin"] = call.rotary_cos, call.rotary_sin
        kwargs["rotary_interleaved"] = call.interleaved
    if call.cache_batch_idx is not None:
        kwargs["cache_batch_idx"] = call.cache_batch_idx
    if call.block_table is not None:
        kwargs["block_table"] = call.block_table
    kwargs.update(flash_kwargs(caps, call.first, call.alibi_slopes))
    if call.num_splits:
        kwargs["num_splits"] = call.num_splits
    if call.q_descale is not None:
        fmt = next(n for n, d in FP8_FORMATS.items() if d == call.q.dtype)
        if fmt not in caps.fp8:
            raise Skip(f"an FP8 ({fmt}) cache not declared")
        kwargs["q_descale"], kwargs["k_descale"] = call.q_descale, call.k_descale
        kwargs["v_descale"] = call.v_descale
    if lse:
        kwargs["return_softmax_lse"] = True
    kwargs.update(overrides or {})
    return (call.q, call.k_cache, call.v_cache), kwargs


def read_cache(out: object, call: CacheCall, lse: bool) -> tuple[list[object], list[object] | None]:
    """The output (and LSE) of each batch row of ``call``, as ``(h, Tq, Dv)`` and
    ``(h, Tq)``."""
    first, lse_out = pair(out, "return_softmax_lse=True") if lse else (out, None)
    B, Tq, h = call.q.shape[:3]
    return per_row(first, lse_out, (B, Tq, h, call.v_cache.shape[-1]), lse)


def per_row(
    first: object, lse_out: object, shape: tuple[int, int, int, int], lse: bool
) -> tuple[list[object], list[object] | None]:
    """A decode call's output ``(B, Tq, h, Dv)`` and LSE ``(B, h, Tq)`` (``shape`` is
    ``(B, Tq, h, Dv)``) as each row's ``(h, Tq, Dv)`` and ``(h, Tq)``: `Failure` for a
    tensor of another shape (anything else is left for the checks to name)."""
    B, Tq, h, Dv = shape
    outs: list[object] = [first] * B
    if isinstance(first, Tensor):
        if tuple(first.shape) != (B, Tq, h, Dv):
            raise Failure(
                f"returned shape {tuple(first.shape)}, expected {(B, Tq, h, Dv)} (B, Tq, h, Dv)"
            )
        outs = list(first.transpose(1, 2).unbind(0))
    if not lse:
        return outs, None
    lses: list[object] = [lse_out] * B
    if isinstance(lse_out, Tensor):
        if tuple(lse_out.shape) != (B, h, Tq):
            raise Failure(
                f"returned a log-sum-exp of shape {tuple(lse_out.shape)}, expected "
                f"{(B, h, Tq)} (B, h, Tq)"
            )
        lses = list(lse_out.unbind(0))
    return outs, lses


def _kvcache_build(
    caps: Capabilities, inputs: Inputs, lse: bool, overrides: dict[str, Any]
) -> Arguments:
    """A dense case as a decode call: its keys in a contiguous cache, nothing appended."""
    flash_checks(inputs)
    return cache_arguments(caps, dense_cache(inputs), lse, overrides)


def _kvcache_read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    return dense_read(out, inputs, lse, read_cache(out, dense_cache(inputs), lse))


# ---------------------------------------------- the adapter from a flash callable


def kvcache_form(
    flash: Callable[..., Any], name: str, *, bugs: frozenset[str] = frozenset()
) -> Callable[..., Any]:
    """``flash`` (``flash_attn_func``'s signature) with ``flash_attn_with_kvcache``'s: the
    append written in place (rotated), the valid keys of each row gathered (through the
    block table when paged), the queries rotated, then one call of ``flash`` per row.
    ``num_splits`` is accepted and not needed (one call sees every key).

    ``bugs`` plants class-27 to 29 bugs, for the mutants: ``tail_counted`` (the whole
    last page attended), ``logical_pages`` (logical page ``i`` read at physical page
    ``i``), ``append_one_too_far`` (the new tokens written one slot late),
    ``append_rewrites_slot0`` (the first new token also written over slot 0),
    ``rotary_halves`` (interleaved tables applied as halves), ``rotary_at_zero`` (new
    keys rotated from position 0), ``window_cache_keeps_left`` (a windowed call keeps
    only the last ``left`` cached keys, one too few, once the cache is longer),
    ``window_cache_keeps_oldest`` (keeps the oldest keys of the window's size instead of
    the newest, once the cache is longer than the window), ``split_merge_unweighted``
    (split-KV parts averaged, not weighted by their log-sum-exps), ``page_offset_16bit``
    (a page's element offset, its index times its stride, kept in 16 bits).
    """
    from attnref.kvcache import (
        cache_slots,
        cached_lengths,
        key_positions,
        query_positions,
        valid_keys,
    )
    from attnref.rotary import rotary

    @checked_internal
    def kvcache(
        q: Float[Tensor, "B Tq h Dh"],
        k_cache: Float[Tensor, "Bc S g Dh"],
        v_cache: Float[Tensor, "Bc S g Dv"],
        k: Float[Tensor, "B Tn g Dh"] | None = None,
        v: Float[Tensor, "B Tn g Dv"] | None = None,
        rotary_cos: Float[Tensor, "R r"] | None = None,
        rotary_sin: Float[Tensor, "R r"] | None = None,
        cache_seqlens: Int[Tensor, " B"] | int | None = None,
        cache_batch_idx: Int[Tensor, " B"] | None = None,
        cache_leftpad: Int[Tensor, " B"] | None = None,
        block_table: Int[Tensor, "B P"] | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        rotary_interleaved: bool = True,
        alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "B h"] | None = None,
        num_splits: int = 0,
        return_softmax_lse: bool = False,
    ) -> Float[Tensor, "B Tq h Dv"] | tuple[Float[Tensor, "B Tq h Dv"], Float[Tensor, "B h Tq"]]:
        if cache_leftpad is not None:
            raise ValueError("cache_leftpad is not supported")
        B, Tq, h = q.shape[:3]
        T_new = 0 if k is None else k.shape[1]
        page = k_cache.shape[1]
        capacity = page if block_table is None else block_table.shape[1] * page
        lengths = cached_lengths(cache_seqlens, B, capacity, T_new)
        table = block_table
        if table is not None and "logical_pages" in bugs:
            table = torch.arange(table.numel(), dtype=table.dtype).reshape(table.shape)
        if table is not None and "page_offset_16bit" in bugs:  # the offset wraps at 2**16
            stride = k_cache[0].numel()
            table = (table.long() * stride % 2**16 // stride).to(table.dtype)
        interleaved = rotary_interleaved and "rotary_halves" not in bugs
        extra: dict[str, Any] = {"softmax_scale": softmax_scale, "causal": causal}
        if tuple(window_size) != (-1, -1):
            extra["window_size"] = window_size
        if softcap:
            extra["softcap"] = softcap
        outs: list[Tensor] = []
        lses: list[Tensor | None] = []
        for b, n in enumerate(lengths):
            row = b if cache_batch_idx is None else int(cache_batch_idx[b])
            if k is not None and v is not None:
                new_k = k[b]
                if rotary_cos is not None and rotary_sin is not None:
                    pos = key_positions(0 if "rotary_at_zero" in bugs else n, T_new)
                    c, s = rotary_cos[pos].unsqueeze(-2), rotary_sin[pos].unsqueeze(-2)
                    new_k = rotary(new_k, c, s, interleaved=interleaved)
                start = n + (1 if "append_one_too_far" in bugs else 0)
                slots = cache_slots(b, range(start, start + T_new), table, page, row)
                for t, (r, s_) in enumerate(slots):
                    k_cache[r, s_] = new_k[t]
                    v_cache[r, s_] = v[b, t]
                if "append_rewrites_slot0" in bugs and T_new:
                    r, s_ = cache_slots(b, range(1), table, page, row)[0]
                    k_cache[r, s_], v_cache[r, s_] = new_k[0], v[b, 0]
            total = n + T_new
            lo = 0
            if (
                tuple(window_size) != (-1, -1)
                and window_size[0] >= 0
                and total > window_size[0] + Tq
            ):
                if "window_cache_keeps_left" in bugs:
                    lo = total - Tq - window_size[0] + 1
                if "window_cache_keeps_oldest" in bugs:
                    total = window_size[0] + Tq
            span = total
            if table is not None and "tail_counted" in bugs:
                span = -(-total // page) * page
            keys = valid_keys(k_cache, b, span, table, row)[lo:]
            values = valid_keys(v_cache, b, span, table, row)[lo:]
            qb = q[b]
            if rotary_cos is not None and rotary_sin is not None:
                pos = query_positions(n, Tq, causal, window_size)
                c, s = rotary_cos[pos].unsqueeze(-2), rotary_sin[pos].unsqueeze(-2)
                qb = rotary(qb, c, s, interleaved=interleaved)
            kwargs = dict(extra)
            if alibi_slopes is not None:
                kwargs["alibi_slopes"] = (
                    alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
                )
            lse: Tensor | None
            if keys.shape[0] == 0:
                out, lse = empty_part(q, h, v_cache.shape[-1], Tq)
            elif "split_merge_unweighted" in bugs and num_splits > 1:
                out, lse = _unweighted_splits(qb, keys, values, num_splits, kwargs)
            else:
                result = flash(
                    qb[None],
                    keys[None],
                    values[None],
                    return_attn_probs=return_softmax_lse,
                    **kwargs,
                )
                out, lse = (result[0][0], result[1][0]) if return_softmax_lse else (result[0], None)
            outs.append(out)
            lses.append(lse)
        result_out = torch.stack(outs)
        if return_softmax_lse:
            return result_out, torch.stack([x for x in lses if x is not None])
        return result_out

    kvcache.__name__ = kvcache.__qualname__ = name
    kvcache.__doc__ = f"{flash.__doc__ or ''}\n\nIn flash_attn_with_kvcache's convention."
    return kvcache


def _unweighted_splits(
    q: Tensor, keys: Tensor, values: Tensor, splits: int, kwargs: dict[str, Any]
) -> tuple[Tensor, Tensor]:
    """Split-KV merged wrongly: the parts that saw a key averaged with equal weights."""
    from attnref.varlen import attend_one

    Tk = keys.shape[0]
    bounds = [Tk * s // splits for s in range(splits + 1)]
    outs, lses = [], []
    for lo, hi in itertools.pairwise(bounds):
        part = torch.full((1, Tk), float("-inf"), dtype=torch.float64, device=q.device)
        part[:, lo:hi] = 0.0
        o, m = attend_one(q, keys, values, key_mask=part, **kwargs)
        outs.append(o)
        lses.append(m)
    seen = torch.stack([torch.isfinite(m) for m in lses]).to(q.dtype)  # (splits, h, Tq)
    out = sum(o * w.transpose(0, 1).unsqueeze(-1) for o, w in zip(outs, seen, strict=True))
    out = out / seen.sum(0).clamp(min=1).transpose(0, 1).unsqueeze(-1)
    return out, torch.logsumexp(torch.stack(lses), dim=0)  # the LSE itself is right


def _append_fp8(
    k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None, kwargs: dict[str, Any]
) -> None:
    """FlashAttention's append into an FP8 cache: the new keys and values, FP8 in the
    cache's format (stored with the cache's scales), written as given at the slots after
    each row's cached ones; ``cache_seqlens`` in ``kwargs`` then counts them, so that the
    call attends every key the cache holds, in place of an append of its own."""
    from attnref.kvcache import cache_slots

    if k is None or v is None:
        raise ValueError("an append takes both k and v")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(
            f"an append into an FP8 cache takes k and v in its format ({k_cache.dtype}), "
            f"not {k.dtype} and {v.dtype}"
        )
    seqlens = kwargs.get("cache_seqlens")
    if not isinstance(seqlens, Tensor):
        raise ValueError("an append needs cache_seqlens, one per row")
    table, batch_idx = kwargs.get("block_table"), kwargs.get("cache_batch_idx")
    T = k.shape[1]
    for b in range(k.shape[0]):
        n, r = int(seqlens[b]), b if batch_idx is None else int(batch_idx[b])
        for t, (row, slot) in enumerate(
            cache_slots(b, range(n, n + T), table, k_cache.shape[1], r)
        ):
            k_cache[row, slot], v_cache[row, slot] = k[b, t], v[b, t]
    kwargs["cache_seqlens"] = seqlens + T


def dequantized(
    fn: Callable[..., Any], name: str, *, bugs: frozenset[str] = frozenset()
) -> Callable[..., Any]:
    """``fn`` (``flash_attn_with_kvcache``'s signature) that also takes FP8 q, K and V
    with FlashAttention 3's descales (float32 ``(batch, num_heads_k)``, one per row and
    KV head): each row's q, cache and values dequantized to float32 with its own scales
    (a query head by its KV head's), ``fn`` called on that row, the output returned in
    bfloat16, FlashAttention 3's; the LSE in float32. Without FP8 inputs, ``fn`` itself.

    ``bugs`` plants the class-34 bugs, for the mutants: ``v_descale_dropped``,
    ``k_descale_twice``, ``descale_per_tensor`` (the first row's first KV head's scales
    for every head and row), ``descale_neighbour_group`` (KV head ``j``'s query heads
    read KV head ``j + 1``'s scales).
    """

    @checked_internal
    def kvcache(
        q: Shaped[Tensor, "B Tq h D"],
        k_cache: Shaped[Tensor, "rows slots g D"],
        v_cache: Shaped[Tensor, "rows slots g Dv"],
        *args: Any,
        q_descale: Float[Tensor, "B g"] | None = None,
        k_descale: Float[Tensor, "B g"] | None = None,
        v_descale: Float[Tensor, "B g"] | None = None,
        **kwargs: Any,
    ) -> Any:
        if q.dtype not in FP8_FORMATS.values():
            return fn(q, k_cache, v_cache, *args, **kwargs)
        if args:
            raise ValueError("an FP8 call takes its arguments after v_cache by keyword")
        k_new, v_new = kwargs.pop("k", None), kwargs.pop("v", None)
        if k_new is not None or v_new is not None:
            _append_fp8(k_cache, v_cache, k_new, v_new, kwargs)
        B, _, h, _ = q.shape
        g = k_cache.shape[2]
        ones = torch.ones((B, g), dtype=torch.float32, device=q.device)
        dq, dk, dv = (ones if d is None else d.float() for d in (q_descale, k_descale, v_descale))
        if "v_descale_dropped" in bugs:
            dv = ones
        if "k_descale_twice" in bugs:
            dk = dk * dk
        if "descale_per_tensor" in bugs:
            dq, dk, dv = (d[:1, :1].expand(B, g) for d in (dq, dk, dv))
        if "descale_neighbour_group" in bugs:
            dq, dk, dv = (d.roll(-1, dims=1) for d in (dq, dk, dv))
        outs, lses = [], []
        for b in range(B):
            one = {k: _row_of(k, v, b) for k, v in kwargs.items()}
            if one.get("block_table") is None and one.get("cache_batch_idx") is None:
                # a contiguous cache: row b's is cache row b, whatever the batch's size
                one["cache_batch_idx"] = torch.tensor([b], dtype=torch.int32, device=q.device)
            result = fn(
                q[b : b + 1].float() * dq[b].repeat_interleave(h // g)[None, None, :, None],
                k_cache.float() * dk[b][None, None, :, None],
                v_cache.float() * dv[b][None, None, :, None],
                **one,
            )
            out, lse = result if kwargs.get("return_softmax_lse") else (result, None)
            outs.append(out.to(torch.bfloat16))
            lses.append(lse)
        if kwargs.get("return_softmax_lse"):
            return torch.cat(outs), torch.cat([x.float() for x in lses if x is not None])
        return torch.cat(outs)

    kvcache.__name__ = kvcache.__qualname__ = name
    kvcache.__doc__ = f"{fn.__doc__ or ''}\n\nWith FP8 caches (FlashAttention 3's descales)."
    return kvcache


def _row_of(name: str, value: Any, b: int) -> Any:
    """Batch row ``b``'s share of keyword ``name`` of a decode call."""
    per_row = ("cache_seqlens", "block_table", "cache_batch_idx", "k", "v")
    if name in per_row and isinstance(value, Tensor) and value.dim() >= 1:
        return value[b : b + 1]
    if name == "alibi_slopes" and isinstance(value, Tensor) and value.dim() == 2:
        return value[b : b + 1]
    return value


# ------------------------------------------------------------------ the builtins


_SERVING: dict[str, Any] = {
    "gradients": False,
    "sinks": False,
    "rotary": True,
    "paged": True,
    "dropout": False,
}
kvcache_flex = declared(
    kvcache_form(flash_flex, "kvcache_flex"),
    flash_caps(replace(FLEX_CAPS, **_SERVING), "flash-kvcache"),
)
_FP8: dict[str, Any] = {"fp8": tuple(FP8_FORMATS)}
kvcache_reference = declared(
    dequantized(kvcache_attention, "kvcache_reference"),
    flash_caps(replace(REFERENCE_CAPS, **_SERVING, **_FP8), "flash-kvcache"),
)
kvcache_naive = declared(
    dequantized(kvcache_form(flash_naive, "kvcache_naive"), "kvcache_naive"),
    flash_caps(replace(NAIVE_CAPS, **_SERVING, **_FP8), "flash-kvcache"),
)
kvcache_sdpa = declared(
    kvcache_form(flash_form(sdpa_with_bias, "flash_sdpa"), "kvcache_sdpa"),
    flash_caps(replace(SDPA_BIAS_CAPS, **_SERVING), "flash-kvcache"),
)


def _flash_attn_kvcache(*args: Any, **kwargs: Any) -> Any:
    """FlashAttention 2's ``flash_attn_with_kvcache`` (the ``flash_attn`` package)."""
    from flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache(*args, **kwargs)


def _builtins() -> list[Backend]:
    return [
        *(
            Backend(name, fn, description, fn.capabilities, api=NAME)  # type: ignore[attr-defined]
            for name, fn, description in (
                (
                    "kvcache-reference",
                    kvcache_reference,
                    "attnref's kvcache_attention (real split-KV)",
                ),
                ("kvcache-naive", kvcache_naive, "the naive kernel on each row's gathered cache"),
                (
                    "kvcache-sdpa",
                    kvcache_sdpa,
                    "torch SDPA on each row's gathered cache (window and ALiBi as a float mask)",
                ),
                ("kvcache-flex", kvcache_flex, "FlexAttention on each row's gathered cache"),
            )
        ),
        Backend(
            "flash-attn-kvcache",
            _flash_attn_kvcache,
            "FlashAttention 2's flash_attn_with_kvcache (skipped where flash_attn is absent)",
            replace(FLASH_ATTN_2_KVCACHE, devices=("cuda",)),
            api=NAME,
            needs="flash_attn",
        ),
    ]


# ---------------------------------------------------------------- the properties


def _call_cache(
    ctx: Context,
    call: CacheCall,
    lse: bool = False,
    copy: bool = True,
    like: torch.dtype | None = None,
) -> tuple[list[Tensor], list[Tensor] | None, tuple[Tensor, Tensor]]:
    """The backend's output (and LSE) for each row of ``call``, and the cache as it left
    it (the call gets copies: ``call`` itself is never written; ``copy=False``: a call
    without new tokens gets the cache itself, which a backend behind the trust boundary
    cannot write, and one in this process must not). ``like``: the dtype the outputs
    come back in where it is not the rows' (an FP8 call's bfloat16)."""
    if lse and not ctx.caps.lse:
        raise Skip("the log-sum-exp not declared")
    appends = call.k_new is not None
    if copy or appends:
        call = replace(call, k_cache=call.k_cache.clone(), v_cache=call.v_cache.clone())
    rows = call.rows if like is None else tuple(x.to(like) for x in call.rows)
    args, kwargs = cache_arguments(ctx.caps, call, lse)
    guard(ctx, rows[0], kwargs)
    job = Job(args, kwargs, writable=(1, 2) if appends else ())
    raw = invoke(ctx.backend, job, ctx.timeout, ctx.executor)
    caches = (call.k_cache, call.v_cache)

    def reading(r: Any) -> list[tuple[Inputs, object, object | None]]:
        parts = with_lses(read_cache(r[0] if appends else r, call, lse))
        return [part for x in {id(call.rows): call.rows, id(rows): rows}.values()
                for part in zip(x, *parts, strict=True)]  # fmt: skip

    note_reading(ctx.executor, raw, reading)
    if appends:
        raw, caches = raw
    outs, lses = read_cache(raw, call, lse)
    checked, checked_lses = judge(outs, lses, rows)
    return checked, checked_lses, caches


def _check_append(ctx: Context, call: CacheCall, after: tuple[Tensor, Tensor]) -> None:
    """The append wrote the new keys (rotated) and values at exactly the new slots, and
    left every other byte of the cache as it was."""
    assert call.k_after is not None
    assert call.v_after is not None
    assert call.written is not None
    for n, (name, got, want) in enumerate((
        ("k_cache", after[0], call.k_after),
        ("v_cache", after[1], call.v_after),
    )):  # fmt: skip
        bound = 0.0  # every byte as expected, but a rotated key's rounding
        if name == "k_cache" and call.rotary_cos is not None and call.k_new is not None:
            eps = torch.finfo(want.dtype).eps
            top = float(want.double().abs().max()) + float(call.k_new.double().abs().max())
            bound = eps * top

        def written(r: Any, n: int = n) -> object:
            return r[1][n]  # the call's (result, (k_cache, v_cache)) as it left them

        ctx.answer_part(f"{name} after the append", written, want.double(), (bound, bound))
        if not isinstance(got, Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            raise Failure(f"{name} came back as something other than the cache it was")
        if want.dtype in FP8_FORMATS.values():  # FP8 bytes: the same byte, NaN or not
            same = (got.view(torch.uint8) == want.view(torch.uint8)).to(got.device)
        else:
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


def _kvcache(ctx: Context, case: Case) -> None:
    """Each row agrees with the oracle of its valid keys (output and LSE); the append
    writes exactly the new slots."""
    call = build_cache(case, ctx.dtype, ctx.device)
    outs, lses, after = _call_cache(ctx, call, lse=ctx.caps.lse)
    agree(ctx, outs, lses, call.rows, "row", rotated=call.rotary_cos is not None)
    if call.k_new is not None:
        _check_append(ctx, call, after)


def _rows_law(
    ctx: Context, got: list[Tensor], base: list[Tensor], call: CacheCall, what: str
) -> None:
    for b, x in enumerate(call.rows):
        law(ctx, got[b], x, base[b], x, f"row {b}: {what}")


def _kvcache_pages(ctx: Context, case: Case) -> None:
    """Permuting the physical pages (and the block table with them), with other garbage
    in the pages no row uses, changes nothing."""
    call = build_cache(case, ctx.dtype, ctx.device)
    if call.block_table is None:
        raise Skip("a contiguous cache has no pages")
    base, _, _ = _call_cache(ctx, call)
    blocks = call.k_cache.shape[0]
    perm = torch.randperm(blocks, generator=rng(case, 5))
    if bool((perm == torch.arange(blocks)).all()):
        perm = perm.flip(0)
    gen = rng(case, 6)

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


def _kvcache_splits(ctx: Context, case: Case) -> None:
    """``num_splits`` (split-KV) changes nothing: the declared splits against one."""
    call = build_cache(case, ctx.dtype, ctx.device)
    one, _, _ = _call_cache(ctx, replace(call, num_splits=1))
    for splits in sorted({2, max(2, case.splits), 5}):
        split, _, _ = _call_cache(ctx, replace(call, num_splits=splits))
        _rows_law(ctx, split, one, call, f"num_splits = {splits} against 1")


def _kvcache_decode(ctx: Context, case: Case) -> None:
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
            law(
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


def _rotary_layouts(ctx: Context, case: Case) -> None:
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


def _rotary_shift(ctx: Context, case: Case) -> None:
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
        expect_rotated(ctx, x, rotated=True)  # each call rounds its own rotation
        expect_rotated(ctx, y, rotated=True)
        law(ctx, moved[b], y, base[b], x, f"row {b}: every position moved by {shift}")


def _far_examples(p: Profile, c: Capabilities) -> list[Case]:
    """Paged decode calls whose pages all lie past ``p.far_pages`` elements (a page index
    times its stride; flashinfer#3130): one row against two pages, and two rows of GQA
    with their pages shuffled. The pages before them hold NaN."""
    page = c.page_multiple if c.page_multiple > 1 else 16
    dims = (128, 64) if c.max_head_dim is None else (min(128, c.max_head_dim),) * 2
    base = []
    for i, (name, cached, h, g, Dh, shuffle) in enumerate((
        ("far_pages_decode", (page + 3,), 2, 1, dims[0], False),
        ("far_pages_rows", (2 * page - 1, 5), 4, 2, dims[1], True),
    )):  # fmt: skip
        first = -(-p.far_pages // (page * g * Dh))  # K's stride; V's is the same
        base.append(
            Case(name, batch=(len(cached),), h=h, g=g, Tq=1, Tk=max(cached), Dh=Dh, Dv=Dh,
                 cached=cached, page=page, causal="bottom_right", shuffle=shuffle,
                 seed=350 + i, options=(("first_page", first),))
        )  # fmt: skip
    return base


def _available_memory() -> int | None:
    """Bytes of memory the kernel says are available (Linux), or None."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _short_of_memory(case: Case, dtype: torch.dtype, device: str) -> str | None:
    """Why ``case``'s cache cannot be held here, or None: the judge holds K and V, the
    transfer to the worker a copy, and the worker a copy of its own to tell whether the
    backend wrote them (three in all on the host; on CUDA, two on the device too)."""
    first = int(case.option("first_page", 0))
    per_row = -(-(max(case.cached) + case.new + case.pad) // case.page)
    blocks = first + len(case.cached) * per_row + 1
    nbytes = blocks * case.page * case.g * (case.Dh + case.Dv) * dtype.itemsize
    need, free = 3 * nbytes, _available_memory()
    if free is not None and need > free:
        return (f"a cache past {first * case.page * case.g * case.Dh:,} elements needs about "
                f"{need / 2**30:.1f} GiB of memory, {free / 2**30:.1f} GiB available")  # fmt: skip
    if str(device).startswith("cuda") and torch.cuda.is_available():
        free_device, _ = torch.cuda.mem_get_info()
        if 2 * nbytes > free_device:
            return (f"a cache past {first * case.page * case.g * case.Dh:,} elements needs "
                    f"{2 * nbytes / 2**30:.1f} GiB of device memory, "
                    f"{free_device / 2**30:.1f} GiB free")  # fmt: skip
    return None


def _kvcache_far_pages(ctx: Context, case: Case) -> None:
    """Each row agrees with the oracle of its valid keys when every page lies past a
    large element offset (`Profile.far_pages`): a 32-bit page offset wraps there."""
    why = _short_of_memory(case, ctx.dtype, str(ctx.device))
    if why is not None:
        raise Skip(why)
    call = build_cache(case, ctx.dtype, ctx.device)
    outs, lses, _ = _call_cache(ctx, call, lse=ctx.caps.lse, copy=False)
    agree(ctx, outs, lses, call.rows, "row")


def _cache_variants(c: Capabilities) -> st.SearchStrategy[dict[str, object]]:
    """The declared variants, sinks included (``sinks=``, our extension)."""
    return some_variants(c)


def _cache_examples(p: Profile, c: Capabilities) -> list[Case]:
    """Where the class-27-29 bugs show: a paged cache whose last page is partial, the
    cache full to capacity, an append across a page boundary, a window shorter than the
    cache (class 28), rotary in both layouts at an offset, split-KV."""
    page = c.page_multiple if c.page_multiple > 1 else 4
    base = [
        Case("cache_contiguous", cached=(5, 12), new=1, Tq=1, causal="bottom_right", pad=3),
        Case("cache_full", cached=(9, 3), new=2, Tq=2, causal="bottom_right", pad=0),
        Case("cache_rows_shuffled", cached=(4, 0, 7), new=1, Tq=1, shuffle=True),
        Case("cache_prefill_chunk", cached=(6,), new=4, Tq=4, causal="bottom_right", pad=1),
        Case("cache_no_append", cached=(11, 2), Tq=2, causal="bottom_right", pad=2),
        Case("cache_splits", cached=(17, 30), new=1, Tq=1, splits=3),
    ]
    if c.paged:
        base += [
            Case("paged_tail", cached=(page + 1, 2 * page - 1), new=1, Tq=1, page=page,
                 causal="bottom_right", pad=page - 1, shuffle=True),
            Case("paged_across_pages", cached=(page - 1,), new=3, Tq=3, page=page,
                 causal="bottom_right", shuffle=True, pad=2),
        ]  # fmt: skip
    if c.window:
        base.append(
            Case("cache_window_passed", cached=(20, 9), new=1, Tq=1, causal="bottom_right",
                 window=(4, 0))
        )  # fmt: skip
    if c.rotary:
        base += [
            Case("rotary_interleaved", cached=(5, 9), new=2, Tq=2, rotary=8, interleaved=True,
                 causal="bottom_right"),
            Case("rotary_halves", cached=(5, 9), new=2, Tq=2, rotary=4, interleaved=False,
                 causal="bottom_right"),
            Case("rotary_not_causal", cached=(3,), new=2, Tq=2, rotary=8, interleaved=False),
        ]  # fmt: skip
    return [replace(x, seed=300 + i) for i, x in enumerate(base)]


def _needs_paged(caps: Capabilities) -> str | None:
    return None if caps.paged else "a paged cache not declared"


def _needs_rotary(caps: Capabilities) -> str | None:
    return None if caps.rotary else "rotary not declared"


def _needs_rotary_window(caps: Capabilities) -> str | None:
    if not (caps.rotary and caps.window):
        return "rotary and sliding windows not both declared"
    return None


def _shift_cases(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
    """Causal decode calls with rotary and a window no longer than the shortest cached
    row (so that it hides the garbage a shift puts first), moved by 1 to 64."""

    @st.composite
    def draw(draw: st.DrawFn) -> Case:
        new = draw(st.sampled_from((1, 2, 4)))
        case = draw(
            cache_strategy(
                "rotary_shift", p, c, causal="bottom_right", new=new, Tq=new,
                Dh=st.sampled_from((8, 4, 16, 64)), rotary=st.sampled_from((2, 4, 8)),
                cached=st.lists(st.integers(1, p.max_len), min_size=1, max_size=3).map(tuple),
            )
        )  # fmt: skip
        left = draw(st.integers(0, min(case.cached)))
        return replace(case, window=(left, 0), shift=draw(st.sampled_from((1, 3, 17, 64))))

    return draw()


# ------------------------------------------------------------------ FP8 caches


def fp8_expected(ctx: Context, x: Inputs, fmt: str) -> Expected:
    """The oracle of an FP8 row ``x`` (dequantized, exact in float64), held to a call
    that returns bfloat16: the bounds of the same values rounded to bfloat16 (a kernel
    may dequantize to its output dtype, as vLLM does, or fold the scales into float32
    scores, as FlashAttention 3 does), plus what rounding them moves the oracle by; for a
    kernel that declares it rounds P to FP8 before ``P V`` (`Capabilities.fp8_rounds_p`),
    that rounding too: ``u`` of the format for each normal probability and half the
    smallest subnormal for each of the ``n`` keys, times max |V|."""
    half = x.to(torch.bfloat16)
    rows = ctx.rows(x)  # a long call's sampled rows, the same in both
    e = expect(half, ctx.caps.empty_row, ctx.native(half), rows)
    exact = expect(x, ctx.caps.empty_row, ctx.native(x), rows)
    moved = torch.nan_to_num((e.value - exact.value).abs(), nan=0.0)
    floor = e.floor
    if ctx.caps.fp8_rounds_p and x.value.numel():
        fp8 = torch.finfo(FP8_FORMATS[fmt])
        subnormal = fp8.smallest_normal * fp8.eps  # the spacing below smallest_normal
        n = x.key.shape[-2]
        v = float(torch.nan_to_num(x.value.abs(), nan=0.0).max())
        floor += (fp8.eps / 2 + n * subnormal / 2) * v
    return replace(exact, ref_err=e.ref_err + moved, floor=floor)


def fp8_lse_expected(x: Inputs, empty_lse: EmptyLse) -> Expected:
    """The LSE's oracle of an FP8 row or sequence ``x`` (dequantized, exact in float64):
    the bounds of the same values rounded to bfloat16 (a kernel may dequantize to it),
    plus what that rounding moves the oracle by. Rounding P to FP8 before ``P V``
    (`Capabilities.fp8_rounds_p`) happens after the LSE is taken and adds nothing."""
    half = expect_lse(x.to(torch.bfloat16), empty_lse)
    exact = expect_lse(x, empty_lse)
    both = torch.isfinite(half.value) & torch.isfinite(exact.value)
    moved = torch.where(both, (half.value - exact.value).abs(), 0.0)
    return replace(exact, ref_err=half.ref_err + moved, floor=half.floor)


def _fp8_call(
    ctx: Context, case: Case, lse: bool = False, **scales: Tensor
) -> tuple[CacheCall, list[Tensor], list[Tensor] | None, tuple[Tensor, Tensor]]:
    """``case``'s FP8 call (its descales replaced by ``scales``, the rows rebuilt) and
    each row's output, its bounds kept as each row's oracle for the laws; with ``lse``
    (for a backend that declares the LSE), each row's log-sum-exp too; and the caches as
    the call left them (an append writes them)."""
    if ctx.dtype != torch.bfloat16:
        raise Skip("an FP8 call returns bfloat16 (FlashAttention 3's): audited in the bfloat16 run")
    if case.fp8 not in ctx.caps.fp8:
        raise Skip(f"an FP8 ({case.fp8}) cache not declared")
    call = quantize(build_cache(case, torch.float64, ctx.device), case.fp8, case.seed)
    if scales:
        call = _rescaled(call, **scales)
    lse = lse and ctx.caps.lse
    got, got_lse, caches = _call_cache(ctx, call, lse, copy=False, like=torch.bfloat16)
    for x in call.rows:
        ctx.keep(x, fp8_expected(ctx, x, case.fp8))
    return call, got, got_lse, caches


def _rescaled(call: CacheCall, **scales: Tensor) -> CacheCall:
    """``call`` with some of its descales replaced (``q_descale=...``), its rows'
    dequantized values rebuilt from the stored FP8 values: a change of the scales alone."""
    assert call.q_descale is not None
    assert call.k_descale is not None
    assert call.v_descale is not None
    old = {"q_descale": call.q_descale, "k_descale": call.k_descale, "v_descale": call.v_descale}
    new = {**old, **scales}
    h, g = call.q.shape[2], call.k_cache.shape[2]

    def factor(name: str, b: int, heads: int) -> Tensor:
        f = (new[name][b].double() / old[name][b].double()).repeat_interleave(heads // g)
        return f[:, None, None]

    rows = tuple(
        replace(x, query=x.query * factor("q_descale", b, h), key=x.key * factor("k_descale", b, g),
                value=x.value * factor("v_descale", b, g))
        for b, x in enumerate(call.rows)
    )  # fmt: skip
    return replace(call, rows=rows, q_descale=new["q_descale"], k_descale=new["k_descale"],
                   v_descale=new["v_descale"])  # fmt: skip


def _kvcache_fp8(ctx: Context, case: Case) -> None:
    """Each row of an FP8 call (q, K and V in FP8 with FlashAttention 3's per-row,
    per-KV-head descales, none of them 1) agrees with the oracle of its dequantized
    values: its output and, where the LSE is declared, its log-sum-exp; an append (new
    keys and values in FP8, attended with the row's scales) writes their FP8 bytes at
    exactly the new slots."""
    call, outs, lses, after = _fp8_call(ctx, case, lse=True)
    if call.k_new is not None:
        _check_append(ctx, call, after)
    for b, (out, x) in enumerate(zip(outs, call.rows, strict=True)):
        exp = ctx.expect(x)
        label = f"row {b} (Tq = {x.query.shape[-2]}, Tk = {x.key.shape[-2]}, {case.fp8})"
        with ctx.naming_the_row(x):
            close(
                out.to(torch.float64),
                exp.value,
                *exp.bounds(),
                f"{label}: output",
                semantic=exp.semantic,
            )
        if lses is not None:
            el = fp8_lse_expected(x, ctx.caps.empty_lse)
            ctx.keep_lse(x, el)
            close(lses[b].to(torch.float64), el.value, *el.bounds(), f"{label}: log-sum-exp")


@checked_internal
def powers(shape: tuple[int, ...], gen: torch.Generator) -> Float32[Tensor, "*shape"]:
    """Powers of two from 1/4 to 4, never 1: a scale moved by one changes no rounding."""
    e = torch.randint(1, 3, shape, generator=gen) * (
        torch.randint(0, 2, shape, generator=gen) * 2 - 1
    )
    return torch.exp2(e.float())


def _kvcache_fp8_fold(ctx: Context, case: Case) -> None:
    """A scale folded between q and k, or between q and the softmax scale, changes
    nothing: ``q_descale * c`` with ``k_descale / c`` (c a power of two, per row and KV
    head), and ``q_descale * c`` with ``softmax_scale / c`` (one c for the call)."""
    call, base, _, _ = _fp8_call(ctx, case)
    assert call.q_descale is not None
    assert call.k_descale is not None
    c = powers(tuple(call.q_descale.shape), rng(case, 7)).to(call.q_descale.device)
    moved, got, _, _ = _fp8_call(
        ctx, case, q_descale=call.q_descale * c, k_descale=call.k_descale / c
    )
    for b, (x, y) in enumerate(zip(call.rows, moved.rows, strict=True)):
        law(ctx, got[b], y, base[b], x, f"row {b}: q_descale * c, k_descale / c")
    one = float(powers((1,), rng(case, 8))[0])
    scale = case.scale if case.scale is not None else case.Dh**-0.5
    folded = replace(case, scale=scale / one)
    moved, got, _, _ = _fp8_call(ctx, folded, q_descale=call.q_descale * one)
    for b, (x, y) in enumerate(zip(call.rows, moved.rows, strict=True)):
        law(ctx, got[b], y, base[b], x, f"row {b}: q_descale * {one:g}, softmax_scale / {one:g}")


def _kvcache_fp8_groups(ctx: Context, case: Case) -> None:
    """A per-KV-head scale reaches exactly its query heads: doubling ``v_descale`` of
    one KV head doubles the outputs of its group's query heads and no other."""
    if case.g < 2:
        raise Skip("needs two KV heads or more")
    call, base, _, _ = _fp8_call(ctx, case)
    assert call.v_descale is not None
    j = int(torch.randint(0, case.g, (1,), generator=rng(case, 9)))
    dv = call.v_descale.clone()
    dv[:, j] *= 2
    moved, got, _, _ = _fp8_call(ctx, case, v_descale=dv)
    group = case.h // case.g
    times = torch.ones(case.h, dtype=torch.float64)
    times[j * group : (j + 1) * group] = 2.0

    def doubled(o: Tensor) -> Tensor:
        return o * times.to(o.device, o.dtype)[:, None, None]

    for b, (x, y) in enumerate(zip(call.rows, moved.rows, strict=True)):
        what = f"row {b}: v_descale of KV head {j} doubled"
        law(ctx, got[b], y, base[b], x, what, transform=doubled, factor=2.0)


def needs_fp8(caps: Capabilities) -> str | None:
    """Why an FP8 property does not apply (no format declared), or None."""
    return None if caps.fp8 else "FP8 caches not declared"


def _fp8_cases(
    name: str, **pins: Any
) -> Callable[[Profile, Capabilities], st.SearchStrategy[Case]]:
    """FP8 decode calls: 1 to 3 rows, 1 to 3 queries, contiguous or paged, GQA, nothing
    appended (unless ``new`` is pinned), no rotary, in a format the backend declares."""

    def cases(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
        formats = c.fp8 or ("e4m3fn",)

        @st.composite
        def draw(draw: st.DrawFn) -> Case:
            # 1 to 3 queries, or as many as the new tokens
            queries = {} if "new" in pins else {"Tq": st.integers(1, 3)}
            fields: dict[str, Any] = {"new": 0, "rotary": 0, **queries, **pins}
            case = draw(cache_strategy(name, p, c, **fields))
            return replace(case, fp8=draw(st.sampled_from(formats)))

        return draw()

    return cases


FP8_PROPERTIES: tuple[Property, ...] = (
    Property(
        "kvcache_fp8",
        "each row of an FP8 decode call (per-row, per-KV-head descales, none of them 1) "
        "agrees with the oracle of its dequantized values",
        (34,),
        _fp8_cases("kvcache_fp8", new=st.sampled_from((0, 0, 1, 2))),
        _kvcache_fp8,
        requires=needs_fp8,
        families=(NAME,),
    ),
    Property(
        "kvcache_fp8_fold",
        "a scale folded between q and k, or q and the softmax scale, changes nothing",
        (34,),
        _fp8_cases("kvcache_fp8_fold"),
        _kvcache_fp8_fold,
        requires=needs_fp8,
        families=(NAME,),
    ),
    Property(
        "kvcache_fp8_groups",
        "a KV head's descale reaches exactly its group's query heads",
        (34,),
        _fp8_cases("kvcache_fp8_groups", g=st.integers(2, 3)),
        _kvcache_fp8_groups,
        requires=needs_fp8,
        families=(NAME,),
    ),
)


PROPERTIES: tuple[Property, ...] = (
    Property(
        "kvcache",
        "each row of a decode call agrees with the oracle of its valid keys (paged, "
        "garbage in unused slots, rotary, split-KV), and the append writes exactly "
        "the new slots",
        (27, 28, 29, 32),
        lambda p, c: cache_strategy("kvcache", p, c, variants=_cache_variants(c)),
        _kvcache,
        examples=_cache_examples,
        families=(NAME,),
    ),
    Property(
        "kvcache_pages",
        "permuting the physical pages (and the block table) changes nothing",
        (27,),
        lambda p, c: cache_strategy(
            "kvcache_pages",
            p,
            c,
            page=st.sampled_from(
                (c.page_multiple, 2 * c.page_multiple) if c.page_multiple > 1 else (1, 4, 5)
            ),
        ),
        _kvcache_pages,
        requires=_needs_paged,
        families=(NAME,),
    ),
    Property(
        "kvcache_far_pages",
        "each row agrees with the oracle when every page lies past 2**31 elements (a page "
        "index times its stride), the pages before it NaN",
        (21, 27, 32),
        lambda p, c: st.sampled_from(_far_examples(p, c)),
        _kvcache_far_pages,
        requires=_needs_paged,
        families=(NAME,),
    ),
    Property(
        "kvcache_splits",
        "num_splits (split-KV) changes nothing",
        (25, 27, 32),
        lambda p, c: cache_strategy("kvcache_splits", p, c, variants=_cache_variants(c)),
        _kvcache_splits,
        families=(NAME,),
    ),
    Property(
        "kvcache_decode",
        "decoding token by token from an empty cache equals one causal prefill, and "
        "leaves the same cache",
        (27, 28, 29),
        lambda p, c: cache_strategy(
            "kvcache_decode",
            p,
            c,
            causal="bottom_right",
            Tq=st.integers(2, 9),
            variants=_cache_variants(c),
        ),
        _kvcache_decode,
        families=(NAME,),
    ),
    Property(
        "rotary_layouts",
        "the interleaved rotary layout equals the halves one on permuted dims",
        (29,),
        lambda p, c: cache_strategy(
            "rotary_layouts",
            p,
            c,
            new=st.sampled_from((1, 2, 4)),
            Dh=st.sampled_from((8, 4, 16, 64)),
            rotary=st.sampled_from((2, 4, 8)),
        ),
        _rotary_layouts,
        requires=_needs_rotary,
        families=(NAME,),
    ),
    Property(
        "rotary_shift",
        "rotary scores depend on relative positions only: every position moved, the "
        "cache rotated with them, changes nothing",
        (29,),
        _shift_cases,
        _rotary_shift,
        requires=_needs_rotary_window,
        families=(NAME,),
    ),
    *FP8_PROPERTIES,
)


# ------------------------------------------------------------------- the mutants


def _mutant_fn(self: Mutant) -> Callable[..., Any]:
    """A bug in how the cache is read or written: the naive kernel behind a buggy
    `kvcache_form`."""
    bugs = frozenset(self.switches)
    fn = dequantized(kvcache_form(flash_naive, self.name, bugs=bugs), self.name, bugs=bugs)
    fn.__doc__ = f"Class {self.bug_class}: {self.summary}"
    fn.capabilities = self.capabilities  # type: ignore[attr-defined]
    return fn


#: what the class 25 and 27-29 mutants claim: the naive kernel driven row by row
KVCACHE_LIKE: Capabilities = kvcache_naive.capabilities  # type: ignore[attr-defined]
_LIKE: dict[str, Any] = {"api": NAME, "capabilities": KVCACHE_LIKE}

MUTANTS: tuple[Mutant, ...] = (
    Mutant("paged_tail_counted", 27, "the unused tail of the last page enters the "
           "softmax", {"tail_counted": True}, **_LIKE),
    Mutant("paged_logical_as_physical", 27, "logical page i is read at physical page "
           "i, ignoring the block table", {"logical_pages": True}, **_LIKE),
    Mutant("append_one_too_far", 27, "the new keys and values are written one slot "
           "past cache_seqlens", {"append_one_too_far": True}, **_LIKE),
    Mutant("append_rewrites_slot0", 27, "the append also writes the first new token "
           "over slot 0", {"append_rewrites_slot0": True}, **_LIKE),
    Mutant("window_cache_keeps_left", 28, "once the cache is longer than the window, "
           "only the last window_size[0] keys are kept: one too few",
           {"window_cache_keeps_left": True}, **_LIKE),
    Mutant("window_cache_keeps_oldest", 28, "once the cache is longer than the "
           "window, the oldest keys are kept instead of the newest",
           {"window_cache_keeps_oldest": True}, **_LIKE),
    Mutant("rotary_interleaved_as_halves", 29, "interleaved rotary (GPT-J pairs) "
           "applied as halves (GPT-NeoX)", {"rotary_halves": True}, **_LIKE),
    Mutant("rotary_new_keys_at_zero", 29, "the new keys are rotated from position 0, "
           "not from cache_seqlens", {"rotary_at_zero": True}, **_LIKE),
    Mutant("split_merge_unweighted", 25, "split-KV parts averaged instead of weighted "
           "by their log-sum-exps (the merge without rescaling)",
           {"split_merge_unweighted": True}, **_LIKE),
    Mutant("paged_offset_wraps", 21, "a page's element offset (its index times its "
           "stride) wraps at 2**16, as a 32-bit one does past 2**31",
           {"page_offset_16bit": True}, **_LIKE),
    Mutant("fp8_v_descale_dropped", 34, "an FP8 cache's v_descale is taken and never "
           "applied", {"v_descale_dropped": True}, **_LIKE),
    Mutant("fp8_k_descale_twice", 34, "an FP8 cache's k_descale is applied twice",
           {"k_descale_twice": True}, **_LIKE),
    Mutant("fp8_descale_per_tensor", 34, "the descales are read per tensor (the first "
           "row's first KV head's) where they are per row and KV head",
           {"descale_per_tensor": True}, **_LIKE),
    Mutant("fp8_descale_neighbour_group", 34, "a KV head's query heads read the "
           "neighbouring KV head's descales under GQA", {"descale_neighbour_group": True},
           **_LIKE),
)  # fmt: skip


def _decode_workload(case: ServingCase) -> Workload:
    """One decoding step: ``B`` rows each hold ``seq`` cached tokens and append one
    (``k``, ``v`` given), in a contiguous cache or in pages of ``page`` slots whose
    physical order is shuffled; one query per row, causal. ``B`` tokens a call."""

    def arguments(seed: int) -> Arguments:
        gen = torch.Generator().manual_seed(seed)
        B, g, Dh, device = case.B, case.g, case.Dh, case.device
        q = case.randn(gen, B, 1, case.h, Dh)
        k, v = case.randn(gen, B, 1, g, Dh), case.randn(gen, B, 1, g, Dh)
        kwargs: dict[str, Any] = {
            "k": k,
            "v": v,
            "cache_seqlens": torch.full((B,), case.seq, dtype=torch.int32, device=device),
            "causal": True,
        }
        if case.page:
            per_row = -(-(case.seq + 1) // case.page)
            order = torch.randperm(B * per_row, generator=gen)
            kwargs["block_table"] = order.reshape(B, per_row).to(torch.int32).to(device)
            shape = (B * per_row, case.page)
        else:
            shape = (B, case.seq + 1)
        k_cache, v_cache = case.randn(gen, *shape, g, Dh), case.randn(gen, *shape, g, Dh)
        return (q, k_cache, v_cache), kwargs

    where = "contiguous" if case.page == 0 else f"page {case.page}"
    label = f"{case.shape} cache={case.seq} {where} {case.dtype}"
    return Workload(label, case.B, arguments, oracle="kvcache-reference")


FAMILY = ApiFamily(
    name=NAME,
    alignments=("bottom_right",),  # each sequence's, as FlashAttention's
    summary="FlashAttention 2's flash_attn_with_kvcache: decoding against a contiguous or "
    "paged KV cache, an in-place append, rotary for the new tokens, split-KV",
    signature="fn(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
    "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, "
    "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
    "rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False)",
    positional=3,
    keywords=("cache_seqlens", "softmax_scale", "causal"),
    defaults=FLASH_ATTN_2_KVCACHE,
    build=_kvcache_build,
    read=_kvcache_read,
    to_layout=flash_layout,
    from_layout=flash_back,
    native_causal=flash_native_causal,
    dropout=False,
    builtins=_builtins,
    properties=PROPERTIES,
    mutants=MUTANTS,
    mutant_fn=_mutant_fn,
    bench_backends=("kvcache-reference", "kvcache-naive", "kvcache-sdpa", "flash-attn-kvcache"),
    workload=_decode_workload,
    serving_pages=(0, 16),
)
