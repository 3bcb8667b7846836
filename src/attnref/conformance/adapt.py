"""An SDPA-shaped function seen through FlashAttention's calling convention.

`flash_form` turns a function that speaks the ``sdpa`` family's language (``(*batch, h,
T, D)`` tensors, the variants as keywords, ``causal_alignment``) into one with
``flash_attn_func``'s signature, so that the reference, the naive kernel, FlexAttention
and the mutants each exist in both conventions from one implementation.
"""

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnref.varlen import check_cu_seqlens, seqlens

__all__ = ["flash_form", "kvcache_form", "varlen_form"]


def flash_form(fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
    """``fn`` (SDPA family, variants as keywords) with ``flash_attn_func``'s signature.

    Tensors ``(B, T, h, D)`` are transposed to ``(B, h, T, D)`` and back; ``causal`` is
    bottom-right; ``window_size=(-1, -1)`` is no window; ``return_attn_probs=True``
    returns ``(out, lse, None)`` with ``lse (B, h, Tq)``, as FlashAttention 2 does
    (its third item, the probabilities, is not computed). ``sinks`` (one logit per head)
    is an extension FlashAttention 2 does not have.
    """

    def flash(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        sinks: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor, None]:
        kwargs: dict[str, Any] = {"causal_alignment": "bottom_right"}
        if tuple(window_size) != (-1, -1):
            kwargs["window"] = tuple(window_size)
        if softcap:
            kwargs["softcap"] = softcap
        if alibi_slopes is not None:
            kwargs["alibi_slopes"] = alibi_slopes
        if sinks is not None:
            kwargs["sinks"] = sinks
        if return_attn_probs:
            kwargs["return_lse"] = True
        h, g = q.shape[-2], k.shape[-2]
        result = fn(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            None,
            dropout_p,
            causal,
            softmax_scale,
            h != g,
            **kwargs,
        )
        if return_attn_probs:
            out, lse = result
            return out.transpose(1, 2), lse, None
        out_: Tensor = result.transpose(1, 2)
        return out_

    flash.__name__ = flash.__qualname__ = name or f"flash_{fn.__name__}"
    flash.__doc__ = fn.__doc__  # not functools.wraps: the signature must stay flash's
    return flash


def _empty_part(q: Tensor, h: int, Dv: int, rows: int) -> tuple[Tensor, Tensor]:
    """The output and LSE of ``rows`` queries that see no key: 0 and ``-inf``."""
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (
        q.new_zeros((rows, h, Dv)),
        torch.full((h, rows), float("-inf"), dtype=lse_dtype, device=q.device),
    )


def varlen_form(
    flash: Callable[..., Any], name: str, *, bugs: frozenset[str] = frozenset()
) -> Callable[..., Any]:
    """``flash`` (``flash_attn_func``'s signature) with ``flash_attn_varlen_func``'s: each
    sequence of the pack is one call of ``flash`` with a batch of one; a sequence with
    no keys gets 0 (LSE ``-inf``) without a call; padding after the pack gets 0.

    ``bugs`` plants class-26 bugs, for the mutants (`attnref.conformance.mutants`):
    ``global_max_seqlen_k`` (every sequence reads ``max_seqlen_k`` keys from its start),
    ``zero_length_shift`` (empty sequences dropped from the query and key lists
    separately, so the sequences after one pair up wrongly), ``reads_next_key`` (each
    sequence sees the next one's first key).
    """

    def varlen(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        sinks: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor, None]:
        check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
        check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
        spans_q, spans_k = seqlens(cu_seqlens_q), seqlens(cu_seqlens_k)
        if "zero_length_shift" in bugs:
            spans_q = [s for s in spans_q if s[1] > s[0]]
            spans_k = [s for s in spans_k if s[1] > s[0]]
            spans_k += [(k.shape[0], k.shape[0])] * (len(spans_q) - len(spans_k))
        h, Dv = q.shape[1], v.shape[2]
        extra: dict[str, Any] = {"softmax_scale": softmax_scale, "causal": causal}
        if tuple(window_size) != (-1, -1):
            extra["window_size"] = window_size
        if softcap:
            extra["softcap"] = softcap
        if sinks is not None:
            extra["sinks"] = sinks
        outs: list[Tensor] = []
        lses: list[Tensor | None] = []
        for n, ((q0, q1), (k0, k1)) in enumerate(zip(spans_q, spans_k, strict=False)):
            if "global_max_seqlen_k" in bugs:
                k1 = min(k0 + max_seqlen_k, k.shape[0])
            if "reads_next_key" in bugs and k1 < k.shape[0]:
                k1 += 1
            if q1 == q0:
                continue
            lse: Tensor | None
            if k1 == k0:
                out, lse = _empty_part(q, h, Dv, q1 - q0)
            else:
                kwargs = dict(extra)
                if alibi_slopes is not None:
                    kwargs["alibi_slopes"] = (
                        alibi_slopes[n] if alibi_slopes.dim() == 2 else alibi_slopes
                    )
                result = flash(
                    q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dropout_p,
                    return_attn_probs=return_attn_probs, **kwargs,
                )  # fmt: skip
                out, lse = (result[0][0], result[1][0]) if return_attn_probs else (result[0], None)
            outs.append(out)
            lses.append(lse)
        rows = q.shape[0] - sum(o.shape[0] for o in outs)
        pad_out, pad_lse = _empty_part(q, h, Dv, rows)
        packed = torch.cat([*outs, pad_out])
        if return_attn_probs:
            parts = [x for x in lses if x is not None]
            lse_dtype = parts[0].dtype if parts else pad_lse.dtype
            return (
                packed,
                torch.cat([*(x.to(lse_dtype) for x in parts), pad_lse.to(lse_dtype)], dim=1),
                None,
            )
        return packed

    varlen.__name__ = varlen.__qualname__ = name
    varlen.__doc__ = f"{flash.__doc__ or ''}\n\nIn flash_attn_varlen_func's convention."
    return varlen


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
    (split-KV parts averaged, not weighted by their log-sum-exps).
    """
    from attnref.kvcache import cache_slots, valid_keys
    from attnref.rotary import rotary

    def kvcache(
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        k: Tensor | None = None,
        v: Tensor | None = None,
        rotary_cos: Tensor | None = None,
        rotary_sin: Tensor | None = None,
        cache_seqlens: Tensor | int | None = None,
        cache_batch_idx: Tensor | None = None,
        cache_leftpad: Tensor | None = None,
        block_table: Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        rotary_interleaved: bool = True,
        alibi_slopes: Tensor | None = None,
        num_splits: int = 0,
        return_softmax_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if cache_leftpad is not None:
            raise ValueError("cache_leftpad is not supported")
        B, Tq, h = q.shape[:3]
        T_new = 0 if k is None else k.shape[1]
        page = k_cache.shape[1]
        if cache_seqlens is None:
            lengths = [k_cache.shape[1] - T_new] * B
        elif isinstance(cache_seqlens, int):
            lengths = [cache_seqlens] * B
        else:
            lengths = [int(n) for n in cache_seqlens.tolist()]
        table = block_table
        if table is not None and "logical_pages" in bugs:
            table = torch.arange(table.numel(), dtype=table.dtype).reshape(table.shape)
        interleaved = rotary_interleaved and "rotary_halves" not in bugs
        moving = causal or tuple(window_size) != (-1, -1)
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
                    at = 0 if "rotary_at_zero" in bugs else n
                    pos = torch.arange(at, at + T_new)
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
                pos = torch.arange(n, n + Tq) if moving else torch.full((Tq,), n)
                c, s = rotary_cos[pos].unsqueeze(-2), rotary_sin[pos].unsqueeze(-2)
                qb = rotary(qb, c, s, interleaved=interleaved)
            kwargs = dict(extra)
            if alibi_slopes is not None:
                kwargs["alibi_slopes"] = (
                    alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
                )
            lse: Tensor | None
            if keys.shape[0] == 0:
                out, lse = _empty_part(q, h, v_cache.shape[-1], Tq)
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
        part = torch.full((1, Tk), float("-inf"), dtype=torch.float64)
        part[:, lo:hi] = 0.0
        o, m = attend_one(q, keys, values, key_mask=part, **kwargs)
        outs.append(o)
        lses.append(m)
    seen = torch.stack([torch.isfinite(m) for m in lses]).to(q.dtype)  # (splits, h, Tq)
    out = sum(o * w.transpose(0, 1).unsqueeze(-1) for o, w in zip(outs, seen, strict=True))
    out = out / seen.sum(0).clamp(min=1).transpose(0, 1).unsqueeze(-1)
    return out, torch.logsumexp(torch.stack(lses), dim=0)  # the LSE itself is right
