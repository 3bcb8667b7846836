"""FP8 decode kernels (``flash_attn_with_kvcache``'s convention with FlashAttention 3's
``q_descale``, ``k_descale``, ``v_descale``) with bugs of class 34, written here on their
own (plain torch, none of attnref's references, adapters or mutant switches),
importable as ``tests.planted_fp8:NAME`` with ``--api flash-kvcache``.

``correct_fp8`` dequantizes to bfloat16 and attends there, as vLLM does; ``rounds_p``
folds the scales into float32 scores and rounds P to e4m3 before ``P V``, as
FlashAttention 3 does, and declares it (`Capabilities.fp8_rounds_p`): both must pass.
The others must fail. Each appends new keys and values (FP8, as given) and returns the
log-sum-exp when asked (``return_softmax_lse``); ``lse_without_descale`` computes its
output right and its LSE from the scores before the descales; ``new_keys_undescaled``
appends right and attends the new tokens as stored, without their scales;
``append_not_stored`` attends them right and never writes them into the cache;
``clamps_at_240`` reads stored values as e4m3fnuz's range allows (AMD's, at most 240):
right on values of a few units, wrong on a calibrated cache's (up to 448).
"""

import math
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from attnref.conformance.families.flash_kvcache import KVCACHE_LIKE

CLAIMS = replace(
    KVCACHE_LIKE, dtypes=(torch.bfloat16,), rotary=False, window=False, softcap=False,
    alibi=False, sinks=False, fp8=("e4m3fn", "e5m2"),
)  # fmt: skip


def _kernel(bug: str = "", claims: Any = CLAIMS) -> Any:
    def kvcache(
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        k: Tensor | None = None,
        v: Tensor | None = None,
        cache_seqlens: Tensor | None = None,
        cache_batch_idx: Tensor | None = None,
        block_table: Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        q_descale: Tensor | None = None,
        k_descale: Tensor | None = None,
        v_descale: Tensor | None = None,
        return_softmax_lse: bool = False,
        **_: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        B, Tq, h, D = q.shape
        g = k_cache.shape[2]
        group = h // g
        one = torch.ones(B, g, device=q.device)
        dq, dk, dv = (one if d is None else d.float() for d in (q_descale, k_descale, v_descale))
        if bug == "q_descale_ignored":
            dq = one
        if bug == "descale_transposed":  # read as (num_heads_k, batch), in memory order
            dq, dk, dv = (d.t().contiguous().reshape(B, g) for d in (dq, dk, dv))
        head_of = torch.arange(h) // group
        if bug == "head_modulo":  # query head i read KV head i % g's scales
            head_of = torch.arange(h) % g
        scale = softmax_scale if softmax_scale is not None else D**-0.5 if D else 1.0
        out = torch.zeros(B, Tq, h, v_cache.shape[-1], dtype=torch.bfloat16, device=q.device)
        lse = torch.full((B, h, Tq), -math.inf, device=q.device)  # no key: -inf
        new = 0 if k is None or v is None else k.shape[1]
        for b in range(B):
            n = int(cache_seqlens[b]) if cache_seqlens is not None else k_cache.shape[1]
            for t in range(new):  # the append: the FP8 bytes as given, after the cached
                assert k is not None
                assert v is not None
                if block_table is not None:
                    slots = k_cache.shape[1]
                    at = (int(block_table[b, (n + t) // slots]), (n + t) % slots)
                else:
                    at = (b if cache_batch_idx is None else int(cache_batch_idx[b]), n + t)
                if bug != "append_not_stored":
                    k_cache[at], v_cache[at] = k[b, t], v[b, t]
            n += new
            if block_table is not None:
                page = k_cache.shape[1]
                ids = block_table[b, : -(-n // page)].long()
                keys = k_cache[ids].flatten(0, 1)[:n]
                vals = v_cache[ids].flatten(0, 1)[:n]
            else:
                r = b if cache_batch_idx is None else int(cache_batch_idx[b])
                keys, vals = k_cache[r, :n], v_cache[r, :n]
            if bug == "append_not_stored" and new:  # attended from k and v, never stored
                assert k is not None
                assert v is not None
                keys = torch.cat([keys[: n - new], k[b]])
                vals = torch.cat([vals[: n - new], v[b]])
            kq = torch.arange(h) // group  # each query head's KV head, for the values
            dense = ("correct", "q_descale_ignored", "descale_transposed", "head_modulo",
                     "clamps_at_240")  # fmt: skip
            if bug in (*dense, "new_keys_undescaled", "append_not_stored"):
                q8, k8, v8 = q[b].float(), keys.float(), vals.float()
                if bug == "clamps_at_240":  # built for e4m3fnuz (AMD), whose largest is 240
                    q8, k8, v8 = (x.clamp(-240, 240) for x in (q8, k8, v8))
                qd = (q8 * dq[b][head_of][None, :, None]).to(torch.bfloat16).float()
                kd = (k8 * dk[b][None, :, None]).to(torch.bfloat16).float()
                vd = (v8 * dv[b][None, :, None]).to(torch.bfloat16).float()
                if bug == "new_keys_undescaled" and new:  # the new tokens attended as given
                    kd[n - new :], vd[n - new :] = keys[n - new :].float(), vals[n - new :].float()
                s = torch.einsum("thd,nhd->htn", qd, kd[:, kq]) * scale
                vv = vd[:, kq]
                if bug == "head_modulo":
                    vv = vd[:, head_of]
            else:  # fold the scales into float32 scores (FlashAttention 3)
                folded = (dq[b] * dk[b])[kq]  # (h,)
                if bug == "v_descale_on_scores":
                    folded = folded * dv[b][kq]
                s = torch.einsum("thd,nhd->htn", q[b].float(), keys.float()[:, kq])
                unfolded = s * scale  # the scores before the descales
                s = s * (scale * folded)[:, None, None]
                vv = vals.float()[:, kq]
            seen = torch.ones(Tq, n, dtype=torch.bool, device=q.device)
            if causal:
                seen = seen.tril(diagonal=n - Tq)
            s = s.masked_fill(~seen, -math.inf)
            if n == 0:
                continue  # no key: the output stays 0
            m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
            p = torch.exp(s - m)
            total = p.sum(-1, keepdim=True)
            lse[b] = (m + total.log()).squeeze(-1)
            if bug == "lse_without_descale":  # the LSE written from the raw scores
                lse[b] = unfolded.masked_fill(~seen, -math.inf).logsumexp(-1)
            fp8_call = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            if fp8_call and bug in ("rounds_p", "rounds_p_undeclared", "v_descale_on_scores"):
                p = p.to(torch.float8_e4m3fn).float()  # P rounded to FP8 before P V
            o = torch.einsum("htn,nhd->thd", p, vv) / total.transpose(0, 1).clamp(min=1e-30)
            if bug in ("rounds_p", "rounds_p_undeclared", "lse_without_descale"):
                o = o * dv[b][kq][None, :, None]
            o = o.masked_fill(~seen.any(-1)[:, None, None], 0.0)
            out[b] = o.to(torch.bfloat16)
        return (out, lse) if return_softmax_lse else out

    kvcache.capabilities = claims  # type: ignore[attr-defined]
    kvcache.__name__ = bug or "correct_fp8"
    return kvcache


correct_fp8 = _kernel("correct")
rounds_p = _kernel("rounds_p", replace(CLAIMS, fp8=("e4m3fn",), fp8_rounds_p=True))
rounds_p_undeclared = _kernel("rounds_p_undeclared", replace(CLAIMS, fp8=("e4m3fn",)))
q_descale_ignored = _kernel("q_descale_ignored")
descale_transposed = _kernel("descale_transposed")
head_modulo = _kernel("head_modulo")
#: FlashAttention 3's path (P rounded to e4m3, declared), v_descale folded into the
#: scores where it belongs on the output: its one bug
v_descale_on_scores = _kernel(
    "v_descale_on_scores", replace(CLAIMS, fp8=("e4m3fn",), fp8_rounds_p=True)
)
lse_without_descale = _kernel("lse_without_descale")
new_keys_undescaled = _kernel("new_keys_undescaled")
append_not_stored = _kernel("append_not_stored")
clamps_at_240 = _kernel("clamps_at_240")

#: the kernels that must fail (class 34 each, or an undeclared rounding)
UNSEEN = (
    "q_descale_ignored",
    "descale_transposed",
    "head_modulo",
    "v_descale_on_scores",
    "rounds_p_undeclared",
    "lse_without_descale",
    "new_keys_undescaled",
    "append_not_stored",
    "clamps_at_240",
)
