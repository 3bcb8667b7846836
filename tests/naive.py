"""An independent float64 attention in NumPy, written without any of attnref's code.

It takes the *same* (already rounded) inputs, upcast to float64, so that it measures the
error of a computation, not of the rounding of its inputs.
"""

import numpy as np
from torch import Tensor

from tests.property.strategies import AttnCase


def f64(t: Tensor) -> np.ndarray:
    return np.asarray(t.detach().double().numpy())


def naive_attention(case: AttnCase) -> tuple[np.ndarray, np.ndarray]:
    """Output ``(*batch, h, Tq, Dv)`` and weights ``(*batch, h, Tq, Tk)`` in float64."""
    q, k, v = f64(case.query), f64(case.key), f64(case.value)
    h, g = q.shape[-3], k.shape[-3]
    k = np.repeat(k, h // g, axis=-3)  # head i reads kv head i // (h // g)
    v = np.repeat(v, h // g, axis=-3)
    Dh = q.shape[-1]
    scale = case.scale if case.scale is not None else (1 / np.sqrt(Dh) if Dh else 1.0)
    scores = np.einsum("...id,...jd->...ij", q, k) * scale
    if case.attn_mask is not None and case.attn_mask.is_floating_point():
        scores = scores + f64(case.attn_mask)
    visible = case.visible()
    rows = np.asarray(visible.any(axis=-1))  # queries with at least one visible key
    seen = np.asarray(visible.any(axis=-2))  # keys some query sees
    scores = np.where(visible, scores, -np.inf)
    weights = np.zeros_like(scores)
    shifted = scores - np.where(rows, scores.max(axis=-1), 0.0)[..., None]
    e = np.where(visible, np.exp(shifted), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    weights = np.where(rows[..., None], e / np.where(denom == 0, 1.0, denom), 0.0)
    v = np.where(seen[..., None], v, 0.0)  # keys no query sees drop out
    return weights @ v, weights


def naive_variants(
    case: AttnCase,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Output and log-sum-exp ``(*batch, h, Tq)`` with the variants of docs/variants.md,
    in their order: softcap, ALiBi, the float mask, visibility (mask, causal, window),
    sinks in the denominator only. Query ``i`` sits at ``i + off``, ``off`` from the
    case's alignment."""
    q, k, v = f64(case.query), f64(case.key), f64(case.value)
    h, g = q.shape[-3], k.shape[-3]
    k = np.repeat(k, h // g, axis=-3)
    v = np.repeat(v, h // g, axis=-3)
    Dh = q.shape[-1]
    scale = case.scale if case.scale is not None else (1 / np.sqrt(Dh) if Dh else 1.0)
    s = np.einsum("...id,...jd->...ij", q, k) * scale
    Tq, Tk = s.shape[-2], s.shape[-1]
    off = 0 if case.alignment == "top_left" else Tk - Tq
    pos = np.arange(Tq)[:, None] + off
    j = np.arange(Tk)[None, :]
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if alibi_slopes is not None:
        m = f64(alibi_slopes)[..., None, None]  # (h, 1, 1) or (*batch, h, 1, 1)
        s = s - m * np.abs(pos - j)
    if case.attn_mask is not None and case.attn_mask.is_floating_point():
        s = s + f64(case.attn_mask)
    visible = case.visible()
    if window is not None:
        left, right = window
        if left >= 0:
            visible = visible & (j >= pos - left)
        if right >= 0:
            visible = visible & (j <= pos + right)
    s = np.where(visible, s, -np.inf)
    rows: np.ndarray = np.asarray(visible.any(axis=-1))
    top = np.where(rows, s.max(axis=-1), 0.0)[..., None]
    e = np.where(visible, np.exp(s - top), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    log_denom = np.log(np.where(rows[..., None], denom, 1.0))[..., 0]
    lse = np.where(rows, log_denom + top[..., 0], -np.inf)
    if sinks is not None:
        denom = denom + np.exp(f64(sinks)[:, None, None] - top)
    weights = np.where(rows[..., None], e / np.where(denom == 0, 1.0, denom), 0.0)
    seen: np.ndarray = np.asarray(visible.any(axis=-2))
    v = np.where(seen[..., None], v, 0.0)
    return weights @ v, lse
