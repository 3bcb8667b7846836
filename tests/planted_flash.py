"""FlashAttention-style kernels with bugs of classes 22-25, written here on their own
(plain torch, none of attnref's kernels or switches), importable as
``tests.planted_flash:NAME`` with ``--api flash``.

They are the audit's test against bugs it was not built around: each plants a bug of
the class in a way the mutants of `attnref.conformance.mutants` do not.
"""

import math
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from attnref.conformance.families.flash import FLASH_LIKE

#: what each kernel claims: the flash convention, every variant, the LSE with -inf
CLAIMS = replace(FLASH_LIKE, gradients=False)


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    return_attn_probs: bool = False,
    sinks: Tensor | None = None,
    *,
    bug: str = "",
) -> Any:
    _, Tq, h, D = q.shape
    Tk, g = k.shape[1], k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh = q.to(acc).permute(0, 2, 1, 3)  # (B, h, Tq, D)
    kh = k.to(acc).permute(0, 2, 1, 3).repeat_interleave(h // g, dim=1)
    vh = v.to(acc).permute(0, 2, 1, 3).repeat_interleave(h // g, dim=1)
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(D) if D else 1.0
    s = qh @ kh.transpose(-1, -2) * scale
    pos = torch.arange(Tq)[:, None] + Tk - Tq
    j = torch.arange(Tk)[None, :]
    if alibi_slopes is not None and bug == "softcap_after_alibi":
        s = s - alibi_slopes.to(acc).reshape(-1, h)[:, :, None, None] * (pos - j).abs()
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None and bug != "softcap_after_alibi":
        s = s - alibi_slopes.to(acc).reshape(-1, h)[:, :, None, None] * (pos - j).abs()
    left, right = window_size
    if bug == "window_is_a_length" and left > 0:
        left -= 1  # window_size[0] read as the number of keys, the query's own included
    if bug == "window_right_ignored":
        right = -1
    seen = torch.ones(Tq, Tk, dtype=torch.bool)
    if causal:
        seen &= j <= pos
    if left >= 0:
        seen &= j >= pos - left
    if right >= 0:
        seen &= j <= pos + right
    s = s.masked_fill(~seen, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    if sinks is not None:
        sigma = sinks.to(acc)[None, :, None, None]
        if bug == "sink_scaled":
            sigma = sigma * scale  # the sink logit scaled like a score
        denom = denom + torch.exp(sigma - m)
    out = (e @ vh) / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = out.permute(0, 2, 1, 3).to(q.dtype)
    if not return_attn_probs:
        return out
    l_keys = e.sum(dim=-1)
    lse = torch.where(l_keys > 0, m[..., 0] + torch.log(l_keys), -math.inf)
    if bug == "lse_block_max":  # relative to the max of the last block of 16 keys
        start = (Tk - 1) // 16 * 16
        block_max = s[..., start:].amax(dim=-1)
        lse = torch.where(torch.isfinite(block_max), lse - block_max, lse)
    if bug == "lse_empty_zero":
        lse = torch.where(l_keys > 0, lse, torch.zeros_like(lse))
    return out, lse.to(torch.float32 if acc == torch.float32 else acc), None


def _kernel(bug: str) -> Any:
    def kernel(
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
    ) -> Any:
        return _attend(
            q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
            return_attn_probs, sinks, bug=bug,
        )  # fmt: skip

    kernel.__name__ = bug or "correct"
    kernel.capabilities = CLAIMS  # type: ignore[attr-defined]
    return kernel


#: the correct kernel, and one per bug, with the class each belongs to
correct = _kernel("")
window_is_a_length = _kernel("window_is_a_length")  # class 22
window_right_ignored = _kernel("window_right_ignored")  # class 22
softcap_after_alibi = _kernel("softcap_after_alibi")  # class 23
sink_scaled = _kernel("sink_scaled")  # class 24
lse_block_max = _kernel("lse_block_max")  # class 25
lse_empty_zero = _kernel("lse_empty_zero")  # class 25
UNSEEN = {
    "window_is_a_length": 22,
    "window_right_ignored": 22,
    "softcap_after_alibi": 23,
    "sink_scaled": 24,
    "lse_block_max": 25,
    "lse_empty_zero": 25,
}


def undeclared(*args: Any, **kwargs: Any) -> Any:
    """The correct kernel with no declaration: taken to claim FlashAttention 2's."""
    return correct(*args, **kwargs)


def lse_not_returned(*args: Any, **kwargs: Any) -> Tensor:
    """Declares the log-sum-exp, and returns the output alone when asked for it."""
    kwargs["return_attn_probs"] = False
    out: Tensor = correct(*args, **kwargs)
    return out


lse_not_returned.capabilities = CLAIMS  # type: ignore[attr-defined]


def top_left_causal(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    **_: Any,
) -> Tensor:
    """``flash_attn_func``'s signature, its causal diagonal from the top left when Tq !=
    Tk (FlashAttention before 2.1): right for a kernel that declares so."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
        scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2],
    )  # fmt: skip
    return out.transpose(1, 2)


top_left_causal.capabilities = replace(  # type: ignore[attr-defined]
    FLASH_LIKE, causal_alignments=("top_left",), window=False, softcap=False, alibi=False,
    lse=False, sinks=False, gradients=False,
)  # fmt: skip


def top_left_undeclared(*args: Any, **kwargs: Any) -> Tensor:
    """`top_left_causal`, declaring the flash preset's bottom-right diagonal: wrong."""
    return top_left_causal(*args, **kwargs)


_TOP_LEFT: Any = top_left_causal.capabilities  # type: ignore[attr-defined]
top_left_undeclared.capabilities = replace(  # type: ignore[attr-defined]
    _TOP_LEFT, causal_alignments=("bottom_right",)
)
