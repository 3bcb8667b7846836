"""Packed and paged kernels with bugs of classes 25-29 and 32, written here on their own (plain
torch, none of attnref's references, adapters or mutant switches), importable as
``tests.planted_serving:NAME`` with ``--api flash-varlen`` or ``--api flash-kvcache``.

They are the audit's test against bugs it was not built around: each plants a bug of
the class in a way the mutants of `attnref.conformance.mutants` do not. ``correct_*``
are the same kernels without a bug, which must pass.
"""

import math
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from attnref.conformance.families.flash_kvcache import KVCACHE_LIKE
from attnref.conformance.families.flash_varlen import VARLEN_LIKE

VARLEN_CLAIMS = replace(VARLEN_LIKE, gradients=False, sinks=False)
KVCACHE_CLAIMS = replace(KVCACHE_LIKE, gradients=False, fp8=())  # no FP8 caches here


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    slopes: Tensor | None,
    offset: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``q (Tq, h, D)`` against ``k``, ``v (Tk, g, D)``; query ``i`` at ``offset + i``
    (default ``Tk - Tq``, bottom-right). Returns ``out (Tq, h, Dv)``, ``lse (h, Tq)``."""
    Tq, h, D = q.shape
    Tk, g = k.shape[0], k.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh = q.to(acc).transpose(0, 1)
    kh = k.to(acc).transpose(0, 1).repeat_interleave(h // g, dim=0)
    vh = v.to(acc).transpose(0, 1).repeat_interleave(h // g, dim=0)
    s = qh @ kh.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(D) if D else 1.0)
    pos = torch.arange(Tq)[:, None] + (Tk - Tq if offset is None else offset)
    j = torch.arange(Tk)[None, :]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        s = s - slopes.to(acc)[:, None, None] * (pos - j).abs()
    seen = torch.ones(Tq, Tk, dtype=torch.bool)
    if causal:
        seen &= j <= pos
    if window[0] >= 0:
        seen &= j >= pos - window[0]
    if window[1] >= 0:
        seen &= j <= pos + window[1]
    s = s.masked_fill(~seen, -math.inf)
    m = s.amax(dim=-1, keepdim=True) if Tk else torch.zeros(h, Tq, 1, dtype=acc)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    out = (e @ vh) / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = torch.where(denom[..., 0] > 0, m[..., 0] + torch.log(denom[..., 0]), -math.inf)
    return out.transpose(0, 1).to(q.dtype), lse.to(acc)


# ------------------------------------------------------------------------ varlen


def _varlen(bug: str) -> Any:
    def kernel(
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
    ) -> Any:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        h, Dv = q.shape[1], v.shape[2]
        out = torch.zeros(q.shape[0], h, Dv, dtype=q.dtype)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = torch.full((h, q.shape[0]), -math.inf, dtype=acc)
        for n in range(len(cq) - 1):
            q0, q1, k0, k1 = cq[n], cq[n + 1], ck[n], ck[n + 1]
            if q1 == q0:
                continue
            slopes = alibi_slopes
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[n]
            offset = None
            if bug == "causal_global_offset":  # the pack's longest lengths, not its own
                offset = max_seqlen_k - max_seqlen_q
            if bug == "decode_reads_max_seqlen" and q1 - q0 == 1:
                k1 = min(k0 + max_seqlen_k, k.shape[0])  # the one-query path
            o, m = _attend(
                q[q0:q1], k[k0:k1], v[k0:k1], softmax_scale, causal, window_size, softcap,
                slopes, offset,
            )  # fmt: skip
            if bug == "empty_keys_nan" and k1 == k0:
                o = torch.full_like(o, math.nan)  # 0 / 0
            out[q0:q1] = o
            lse[:, q0:q1] = m
            if bug == "lse_padded_layout":  # sequence n's LSE at n * max_seqlen_q
                lse[:, q0:q1] = -math.inf
                at = min(n * max_seqlen_q, q.shape[0] - (q1 - q0))
                lse[:, at : at + (q1 - q0)] = m
        if return_attn_probs:
            return out, lse, None
        return out

    kernel.__name__ = f"varlen_{bug or 'correct'}"
    kernel.capabilities = VARLEN_CLAIMS  # type: ignore[attr-defined]
    return kernel


# ----------------------------------------------------------------------- kvcache


def _rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, sign: float = 1.0) -> Tensor:
    """``x (T, heads, D)`` turned by ``cos``, ``sin (T, R / 2)``."""
    half = cos.shape[-1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    r, rest = x[..., : 2 * half].to(acc), x[..., 2 * half :]
    c, s = cos.to(acc)[:, None, :], sign * sin.to(acc)[:, None, :]
    if interleaved:
        a, b = r[..., 0::2], r[..., 1::2]
        turned = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = r[..., :half], r[..., half:]
        turned = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((turned.to(x.dtype), rest), dim=-1)


def _kvcache(bug: str) -> Any:
    def kernel(
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        k: Tensor | None = None,
        v: Tensor | None = None,
        rotary_cos: Tensor | None = None,
        rotary_sin: Tensor | None = None,
        cache_seqlens: Tensor | None = None,
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
    ) -> Any:
        B, Tq = q.shape[:2]
        T_new = 0 if k is None else k.shape[1]
        page = k_cache.shape[1]
        assert cache_seqlens is not None
        sign = -1.0 if bug == "rotary_backwards" else 1.0

        def where(b: int, p: int, row: int) -> tuple[int, int]:
            if block_table is None:
                return row, p
            if bug == "append_first_page" and p >= int(cache_seqlens[b]):
                return int(block_table[b, 0]), p % page
            block = int(block_table[b, p // page])
            if bug == "page_offset_wraps":  # the page's element offset in 16 bits
                stride = page * k_cache.shape[2] * k_cache.shape[3]
                block = block * stride % 2**16 // stride
            return block, p % page

        outs, lses = [], []
        for b in range(B):
            n = int(cache_seqlens[b])
            row = b if cache_batch_idx is None else int(cache_batch_idx[b])
            if k is not None and v is not None:
                new_k = k[b]
                if rotary_cos is not None and rotary_sin is not None:
                    pos = slice(n, n + T_new)
                    new_k = _rope(new_k, rotary_cos[pos], rotary_sin[pos], rotary_interleaved, sign)
                for t in range(T_new):
                    r, s = where(b, n + t, row)
                    k_cache[r, s], v_cache[r, s] = new_k[t], v[b, t]
            total = n if bug == "ignores_new_tokens" else n + T_new
            seen = min(total, 4096) if bug == "first_4096_keys" else total
            slots = [where(b, p, row) for p in range(seen)]
            keys = torch.stack([k_cache[r, s] for r, s in slots]) if slots else k_cache[0, :0]
            values = torch.stack([v_cache[r, s] for r, s in slots]) if slots else v_cache[0, :0]
            lo = 0
            if bug == "window_of_last_query" and window_size[0] >= 0:
                lo = max(0, total - 1 - window_size[0])  # every query gets the last one's keys
            qb = q[b]
            if rotary_cos is not None and rotary_sin is not None:
                moving = (
                    causal or tuple(window_size) != (-1, -1)
                ) and bug != "queries_at_cache_len"
                idx = torch.arange(n, n + Tq) if moving else torch.full((Tq,), n)
                qb = _rope(qb, rotary_cos[idx], rotary_sin[idx], rotary_interleaved, sign)
            slopes = alibi_slopes
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[b]
            o, m = _attend(
                qb, keys[lo:], values[lo:], softmax_scale, causal, window_size, softcap,
                slopes, (seen - Tq) - lo,
            )  # fmt: skip
            outs.append(o)
            lses.append(m)
        out = torch.stack(outs)
        return (out, torch.stack(lses)) if return_softmax_lse else out

    kernel.__name__ = f"kvcache_{bug or 'correct'}"
    kernel.capabilities = KVCACHE_CLAIMS  # type: ignore[attr-defined]
    return kernel


correct_varlen = _varlen("")
causal_global_offset = _varlen("causal_global_offset")  # class 26
decode_reads_max_seqlen = _varlen("decode_reads_max_seqlen")  # class 26
empty_keys_nan = _varlen("empty_keys_nan")  # class 26
lse_padded_layout = _varlen("lse_padded_layout")  # classes 25, 26

correct_kvcache = _kvcache("")
ignores_new_tokens = _kvcache("ignores_new_tokens")  # class 27
append_first_page = _kvcache("append_first_page")  # class 27
window_of_last_query = _kvcache("window_of_last_query")  # class 28
rotary_backwards = _kvcache("rotary_backwards")  # class 29
queries_at_cache_len = _kvcache("queries_at_cache_len")  # class 29
first_4096_keys = _kvcache("first_4096_keys")  # class 32 (flashinfer#4347)
page_offset_wraps = _kvcache("page_offset_wraps")  # classes 21, 32 (flashinfer#3130)

#: each buggy kernel, its API family and the bug class it belongs to
UNSEEN: dict[str, tuple[str, int]] = {
    "causal_global_offset": ("flash-varlen", 26),
    "decode_reads_max_seqlen": ("flash-varlen", 26),
    "empty_keys_nan": ("flash-varlen", 26),
    "lse_padded_layout": ("flash-varlen", 26),
    "ignores_new_tokens": ("flash-kvcache", 27),
    "append_first_page": ("flash-kvcache", 27),
    "window_of_last_query": ("flash-kvcache", 28),
    "rotary_backwards": ("flash-kvcache", 29),
    "queries_at_cache_len": ("flash-kvcache", 29),
    "first_4096_keys": ("flash-kvcache", 32),
}


def _nan(kernel: Any, name: str) -> Any:
    def nan(*args: Any, **kwargs: Any) -> Any:
        result = kernel(*args, **kwargs)
        if isinstance(result, tuple):
            return (torch.full_like(result[0], math.nan), *result[1:])
        return torch.full_like(result, math.nan)

    nan.__name__ = name
    nan.capabilities = kernel.capabilities  # type: ignore[attr-defined]
    return nan


#: NaN in every output (and the cache appended as it should be): laws compare a backend
#: with itself, and NaN must never equal NaN there
nan_varlen = _nan(correct_varlen, "nan_varlen")
nan_kvcache = _nan(correct_kvcache, "nan_kvcache")


def decode_only(q: Tensor, k_cache: Tensor, v_cache: Tensor, *args: Any, **kwargs: Any) -> Any:
    """`correct_kvcache` behind a decode kernel's limits: one query a sequence, and never
    a sequence with no key (vLLM's ``single_query_cached_kv_attention``, SGLang's
    decode): it raises outside them. Right inside what it declares."""
    seqlens = kwargs.get("cache_seqlens")
    new = 0 if kwargs.get("k") is None else kwargs["k"].shape[1]
    if q.shape[1] != 1:
        raise ValueError(f"one query a sequence, got {q.shape[1]}")
    if seqlens is not None and bool((seqlens + new == 0).any()):
        raise ValueError("a sequence with no key")
    return correct_kvcache(q, k_cache, v_cache, *args, **kwargs)


decode_only.capabilities = replace(  # type: ignore[attr-defined]
    KVCACHE_CLAIMS, single_query=True, empty_sequences=False
)


def extend_only(q: Tensor, k_cache: Tensor, v_cache: Tensor, *args: Any, **kwargs: Any) -> Any:
    """`correct_kvcache` behind an extend kernel's limit: no row with more queries than
    keys, counted per row (its cached keys and the new ones: SGLang's extend splits the
    keys at the row's prefix); it raises otherwise. Right inside what it declares."""
    seqlens = kwargs.get("cache_seqlens")
    new = 0 if kwargs.get("k") is None else kwargs["k"].shape[1]
    if seqlens is not None and bool((seqlens + new < q.shape[1]).any()):
        raise ValueError("a row with more queries than keys")
    return correct_kvcache(q, k_cache, v_cache, *args, **kwargs)


extend_only.capabilities = replace(  # type: ignore[attr-defined]
    KVCACHE_CLAIMS, queries_at_most_keys=True
)


def _with_sinks(bug: str) -> Any:
    def kernel(q: Tensor, k_cache: Tensor, v_cache: Tensor, *args: Any, **kwargs: Any) -> Any:
        from attnref.functional import apply_sinks
        from attnref.kvcache import kvcache_attention

        sinks = kwargs.pop("sinks", None)
        lse_asked = kwargs.pop("return_softmax_lse", False)
        out, lse = kvcache_attention(q, k_cache, v_cache, *args, return_softmax_lse=True, **kwargs)
        if sinks is not None and bug != "sinks_ignored":
            out = apply_sinks(out.transpose(1, 2), lse, sinks).transpose(1, 2).to(out.dtype)
            if bug == "lse_with_sink":  # SGLang's extend: the LSE counts the sink
                lse = torch.logaddexp(lse, sinks.to(lse.dtype)[:, None])
        return (out, lse) if lse_asked else out

    kernel.__name__ = bug or "kvcache_sinks"
    kernel.capabilities = replace(  # type: ignore[attr-defined]
        KVCACHE_CLAIMS, sinks=True, rotary=False, alibi=False, lse_with_sink=bug == "lse_with_sink"
    )
    return kernel


#: attnref's kvcache reference with per-head sinks applied (SGLang's decode, vLLM's
#: unified attention): right; and the same taking ``sinks=`` and dropping them
kvcache_sinks = _with_sinks("")
sinks_ignored = _with_sinks("sinks_ignored")
#: the LSE with the sink in it, declared (`Capabilities.lse_with_sink`): right
lse_with_sink = _with_sinks("lse_with_sink")
