"""The mathematics of attention, as pure functions.

Notation (D2L, Annotated Transformer): queries ``Q``, keys ``K``, values ``V``; attention
is ``softmax(Q K^T * scale + mask) V`` with the softmax taken over **keys** (the last
axis of the scores). Shapes use the glossary of `attnref._checking`.

Semantics pinned down here (docs/semantics.md):

- boolean masks are ``True`` = may attend; float masks are added to the scores, and a
  ``-inf`` entry hides its key exactly as ``False`` would;
- a query with no visible key gets weights 0 and output 0 (torch >= 2.5, FlashAttention);
  only D2L's `masked_softmax` keeps D2L's uniform weights for such a row;
- a key hidden from every query contributes nothing even if its K or V holds NaN or inf;
- default scale ``1 / sqrt(Dh)`` (``1`` when ``Dh = 0``: every score is then 0);
- GQA: query head ``i`` reads key/value head ``i // (h // g)`` (interleaved);
- float16/bfloat16 inputs are computed in float32 and the result cast back;
- dropout draws from an explicit ``torch.Generator`` (or takes an explicit keep-mask), so
  a run can be replayed.
"""

import math
from dataclasses import dataclass
from typing import Literal, overload

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from attnref._checking import checked, checked_internal
from attnref.masks import (
    Alignment,
    Window,
    causal_block,
    causal_offset,
    check_alignment,
    check_valid_lens,
    check_window,
    sequence_mask,
    window_block,
)

__all__ = [
    "D2L_MASK_VALUE",
    "additive_scores",
    "apply_sinks",
    "chunked_attention",
    "compute_dtype",
    "default_scale",
    "dot_product_scores",
    "expand_kv_heads",
    "masked_softmax",
    "merge_attention",
    "merge_heads",
    "nadaraya_watson",
    "safe_softmax",
    "scaled_dot_product_attention",
    "split_heads",
    "transpose_output",
    "transpose_qkv",
]

#: The finite fill D2L's ``masked_softmax`` puts on masked scores.
D2L_MASK_VALUE = -1e6

_NEG_INF = float("-inf")

# Mask accepted by the SDPA-shaped functions: broadcastable to (*batch, h, Tq, Tk); a 1-D
# mask is one entry per key, as torch accepts.
AttnMask = (
    Bool[Tensor, "*#mbatch #Tq #Tk"]
    | Float[Tensor, "*#mbatch #Tq #Tk"]
    | Bool[Tensor, " #Tk"]
    | Float[Tensor, " #Tk"]
    | None
)
"""A mask for the SDPA-shaped functions: boolean (``True`` = may attend) or float (added to
the scores, ``-inf`` hides), broadcastable to ``(*batch, h, Tq, Tk)``."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and softmax are computed in: float32 for half precision.

    Raises:
        ValueError: ``dtype`` is not float16, bfloat16, float32 or float64.
    """
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype in (torch.float32, torch.float64):
        return dtype
    raise ValueError(f"attention inputs must be float16, bfloat16, float32 or float64, got {dtype}")


# --------------------------------------------------------------------------- softmax


@checked_internal
def _softmax_rows(
    scores: Float[Tensor, "*batch Tk"], hidden: Bool[Tensor, "*#hbatch #Tk"] | None
) -> Float[Tensor, "*batch Tk"]:
    """Softmax over the last axis; a row whose keys are all ``hidden`` becomes all zeros.

    ``hidden`` (``True`` = hidden, broadcastable to ``scores``) must cover every ``-inf``
    in ``scores``. Empty rows get finite scores before the softmax and zeros after: the
    softmax of a row of ``-inf`` is NaN, and its backward pass would send that NaN into
    the gradient of whatever produced the scores (``X + additive_mask`` given to
    `safe_softmax`), even though the output itself is replaced by zeros.
    """
    if scores.shape[-1] == 0:
        return scores.clone()
    empty = None if hidden is None else hidden.all(dim=-1, keepdim=True)  # (..., 1)
    if empty is not None and not empty.any():
        empty = None  # no query without a visible key: skip two passes
    if empty is not None:
        scores = scores.masked_fill(empty, 0.0)
    weights = torch.softmax(scores, dim=-1)
    return weights if empty is None else weights.masked_fill(empty, 0.0)


@checked
def safe_softmax(
    scores: Float[Tensor, "*batch Tk"], mask: Bool[Tensor, "*#mbatch #Tk"] | None = None
) -> Float[Tensor, "*batch Tk"]:
    """Softmax over keys, with hidden keys getting exactly 0, and empty rows all 0.

    ``w_j = exp(s_j - m) / sum_{visible k} exp(s_k - m)`` over visible keys, ``m`` the row
    max; a row with no visible key (or only ``-inf`` scores) is all zeros rather than NaN.
    This is the softmax the whole library uses.

    Args:
        scores: unnormalised scores; the last axis indexes keys.
        mask: ``True`` where the key is visible; broadcast against ``scores``.

    Raises:
        ValueError: ``mask`` does not broadcast to ``scores``.
    """
    hidden = scores == _NEG_INF
    if mask is not None:
        _check_broadcast("mask", mask.shape, scores.shape)
        hidden = hidden | ~mask
        scores = scores.masked_fill(hidden, _NEG_INF)
    return _softmax_rows(scores, hidden)


@checked
def masked_softmax(
    X: Float[Tensor, "B Tq Tk"], valid_lens: Int[Tensor, " B"] | Int[Tensor, "B Tq"] | None
) -> Float[Tensor, "B Tq Tk"]:
    """D2L's ``masked_softmax``, faithful to the book.

    Scores of keys ``j >= valid_len`` are replaced by ``-1e6`` (`D2L_MASK_VALUE`)
    before an ordinary softmax over the last axis. Because the fill is finite, a row whose
    valid length is 0 becomes **uniform** over all keys, not zero: D2L's behaviour, kept
    here on purpose. Use `safe_softmax` for the library's semantics.

    Args:
        X: scores.
        valid_lens: ``(B,)`` one length per sample, ``(B, Tq)`` one per query, or ``None``
            for a plain softmax.

    Raises:
        ValueError: a length outside ``[0, Tk]``.
    """
    if valid_lens is None:
        return torch.softmax(X, dim=-1)
    B, Tq, Tk = X.shape
    if valid_lens.dim() == 1:
        lens = torch.repeat_interleave(valid_lens, Tq)  # (B * Tq,)
    else:
        lens = valid_lens.reshape(-1)  # (B * Tq,)
    check_valid_lens(lens, Tk)
    masked = sequence_mask(X.reshape(-1, Tk), lens, value=D2L_MASK_VALUE)  # (B * Tq, Tk)
    return torch.softmax(masked.reshape(B, Tq, Tk), dim=-1)


# ---------------------------------------------------------------------------- scores


@checked
def additive_scores(
    queries: Float[Tensor, "B Tq Dq"],
    keys: Float[Tensor, "B Tk Dk"],
    W_q: Float[Tensor, "H Dq"],
    W_k: Float[Tensor, "H Dk"],
    w_v: Float[Tensor, "1 H"],
) -> Float[Tensor, "B Tq Tk"]:
    """Additive (Bahdanau) scores ``a(q, k) = w_v^T tanh(W_q q + W_k k)``.

    Queries and keys may have different widths; both are projected to ``H``.
    """
    q = queries @ W_q.T  # (B, Tq, H)
    k = keys @ W_k.T  # (B, Tk, H)
    features = torch.tanh(q.unsqueeze(2) + k.unsqueeze(1))  # (B, Tq, Tk, H)
    return (features @ w_v.T).squeeze(-1)


def default_scale(head_dim: int) -> float:
    """``1 / sqrt(Dh)``; ``1`` when ``Dh = 0`` (every score is then 0 whatever the scale)."""
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


@checked
def dot_product_scores(
    queries: Float[Tensor, "*batch Tq Dh"],
    keys: Float[Tensor, "*batch Tk Dh"],
    scale: float | None = None,
) -> Float[Tensor, "*batch Tq Tk"]:
    """Scaled dot-product scores ``a(q, k) = q^T k * scale``, ``scale = 1/sqrt(Dh)`` by default."""
    s = default_scale(queries.shape[-1]) if scale is None else scale
    return (queries @ keys.transpose(-2, -1)) * s


# ---------------------------------------------------------------- heads and GQA layout


@checked
def split_heads(X: Float[Tensor, "B T H"], num_heads: int) -> Float[Tensor, "B h T Dh"]:
    """``(B, T, H)`` to ``(B, h, T, H / h)``: the layout SDPA-shaped functions take.

    Raises:
        ValueError: ``H`` is not divisible by ``num_heads``.
    """
    B, T, H = X.shape
    if num_heads < 1 or H % num_heads != 0:
        raise ValueError(f"width ({H}) must be divisible by num_heads ({num_heads})")
    return X.reshape(B, T, num_heads, H // num_heads).permute(0, 2, 1, 3)  # (B, h, T, Dh)


@checked
def merge_heads(X: Float[Tensor, "B h T Dh"]) -> Float[Tensor, "B T h*Dh"]:
    """``(B, h, T, Dh)`` to ``(B, T, h * Dh)``: heads side by side, head 0 first."""
    B, h, T, Dh = X.shape
    return X.permute(0, 2, 1, 3).reshape(B, T, h * Dh)  # (B, T, H)


@checked
def transpose_qkv(X: Float[Tensor, "B T H"], num_heads: int) -> Float[Tensor, "Bh T Dh"]:
    """D2L's ``transpose_qkv``: ``(B, T, H)`` to ``(B * h, T, H / h)``, batch-major.

    Row ``b * h + i`` holds head ``i`` of sample ``b`` (a permute, not a bare reshape).
    """
    heads = split_heads(X, num_heads)  # (B, h, T, Dh)
    return heads.reshape(-1, heads.shape[2], heads.shape[3])  # (B * h, T, Dh)


@checked
def transpose_output(X: Float[Tensor, "Bh T Dh"], num_heads: int) -> Float[Tensor, "B T H"]:
    """D2L's ``transpose_output``, the inverse of `transpose_qkv`.

    Raises:
        ValueError: the leading dim is not a multiple of ``num_heads``.
    """
    Bh, T, Dh = X.shape
    if num_heads < 1 or Bh % num_heads != 0:
        raise ValueError(f"leading dim ({Bh}) must be a multiple of num_heads ({num_heads})")
    return merge_heads(X.reshape(Bh // num_heads, num_heads, T, Dh))


def _check_gqa(num_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"number of query heads ({num_heads}) must be divisible by the number of "
            f"key/value heads ({num_kv_heads})"
        )


@checked_internal
def _repeat_kv_heads(
    x: Float[Tensor, "*batch g Tk D"], num_heads: int
) -> Float[Tensor, "*batch {num_heads} Tk D"]:
    """The GQA head mapping as copies (see `expand_kv_heads`); `_heads_matmul` computes
    the same mapping without them."""
    g = x.shape[-3]
    _check_gqa(num_heads, g)
    if num_heads == g:
        return x  # nothing to repeat: no copy
    return x.repeat_interleave(num_heads // g, dim=-3)


@checked
def expand_kv_heads(
    x: Float[Tensor, "*batch g Tk D"], num_heads: int
) -> Float[Tensor, "*batch {num_heads} Tk D"]:
    """Repeat each of the ``g`` key (or value) heads ``h / g`` times, interleaved.

    After expansion head ``i`` is original head ``i // (h // g)``: ``[k0, k0, k1, k1]`` for
    ``h = 4, g = 2``, never the tiled ``[k0, k1, k0, k1]``. With ``h = g`` it returns
    ``x`` itself, not a copy.

    Raises:
        ValueError: ``num_heads`` is not a multiple of ``g``.
    """
    return _repeat_kv_heads(x, num_heads)


# ------------------------------------------------------------------- the SDPA function


@dataclass(frozen=True)
class _Problem:
    """Validated, normalised inputs shared by the materialised and the chunked paths."""

    q: Tensor  # (*batch, h, Tq, Dh), compute dtype, multiplied by the scale
    k: Tensor  # (*batch, g, Tk, Dh), compute dtype; query head i reads k head i // (h // g)
    v: Tensor  # (*batch, g, Tk, Dv), compute dtype, the same heads (`_heads_matmul`)
    bool_mask: Tensor | None  # broadcastable to (*batch, h, Tq, Tk), True = visible
    float_mask: Tensor | None  # broadcastable, added to scores, compute dtype
    causal: bool  # query i sees key j only if j <= i + offset
    offset: int  # query i sits at key position i + offset (the alignment)
    window: Window | None  # (left, right) around the query's position; None: no window
    softcap: float  # scores become softcap * tanh(score / softcap); 0: off
    alibi: Tensor | None  # (*#batch, h, 1, 1) slopes, compute dtype
    sinks: Tensor | None  # (h, 1, 1) sink logits, compute dtype
    out_dtype: torch.dtype

    @property
    def positional(self) -> bool:
        """Whether a score depends on where its query and key sit (causal, window, ALiBi)."""
        return self.causal or self.window is not None or self.alibi is not None


@checked_internal
def _as(x: Shaped[Tensor, "*shape"], dtype: torch.dtype) -> Shaped[Tensor, "*shape"]:
    """``x.to(dtype)``, skipping the call when it would return ``x`` itself: a decoding
    step makes dozens of such calls, each a dispatch of a few microseconds."""
    return x if x.dtype == dtype else x.to(dtype)


@checked_internal
def _key_rows(
    x: Float[Tensor, "*batch Tk D"], start: int, stop: int
) -> Float[Tensor, "*batch Tb D"]:
    """Keys (or values) ``start:stop``; ``x`` itself when that is all of them (one
    decoding step's single block), sparing a slice."""
    return x if (start, stop) == (0, x.shape[-2]) else x[..., start:stop, :]


def _check_broadcast(name: str, shape: torch.Size, target: torch.Size) -> None:
    """Raise unless ``shape`` broadcasts to exactly ``target`` (right-aligned, 1 stretches)."""
    ok = len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(target), strict=False)
    )
    if not ok:
        raise ValueError(
            f"{name} of shape {tuple(shape)} does not broadcast to shape {tuple(target)}"
        )


@checked_internal
def _prepare(
    query: Float[Tensor, "*batch h Tq Dh"],
    key: Float[Tensor, "*batch g Tk Dh"],
    value: Float[Tensor, "*batch g Tk Dv"],
    attn_mask: AttnMask,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    causal_alignment: str,
    window: Window | None = None,
    softcap: float = 0.0,
    alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "*batch h"] | None = None,
    sinks: Float[Tensor, " h"] | None = None,
) -> _Problem:
    check_alignment(causal_alignment)
    if window is not None:
        check_window(window)
        window = None if tuple(window) == (-1, -1) else (int(window[0]), int(window[1]))
    if not (isinstance(softcap, int | float) and math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    if alibi_slopes is not None and alibi_slopes.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"alibi_slopes must be float32 (or float64), got {alibi_slopes.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            "query, key and value must share a dtype, got "
            f"{query.dtype}, {key.dtype} and {value.dtype}"
        )
    h, Tq = query.shape[-3], query.shape[-2]
    g, Tk = key.shape[-3], key.shape[-2]
    if g != h:
        layout = (
            "; tensors in (B, T, h, Dh) layout (FlashAttention's) must be transposed to "
            "(B, h, T, Dh) first: x.transpose(-3, -2)"
        )
        if not enable_gqa:
            gqa = "" if h % g else "; pass enable_gqa=True for grouped-query attention"
            raise ValueError(
                f"key and value have {g} heads (dim -3) but query has {h}{gqa}{layout}"
            )
        _check_gqa(h, g)  # K and V keep their g heads: `_heads_matmul` maps them
    ctype = compute_dtype(query.dtype)
    scores_shape = torch.Size((*query.shape[:-1], Tk))
    bool_mask = float_mask = None
    if attn_mask is not None:
        _check_broadcast("attn_mask", attn_mask.shape, scores_shape)
        if attn_mask.dtype == torch.bool:
            bool_mask = attn_mask
        else:
            float_mask = attn_mask.to(ctype)
    scale = default_scale(query.shape[-1]) if scale is None else scale
    return _Problem(
        q=_as(query, ctype) * scale,  # scaling Q (Tq x Dh) is cheaper than the scores (Tq x Tk)
        k=_as(key, ctype),
        v=_as(value, ctype),
        bool_mask=bool_mask,
        float_mask=float_mask,
        causal=is_causal,
        offset=causal_offset(Tq, Tk, causal_alignment),
        window=window,
        softcap=float(softcap),
        alibi=None if alibi_slopes is None else alibi_slopes.to(ctype)[..., None, None],
        sinks=None if sinks is None else sinks.to(ctype)[:, None, None],
        out_dtype=query.dtype,
    )


@checked_internal
def _key_block(
    mask: Shaped[Tensor, "*#mbatch #Tk"], start: int, stop: int, num_keys: int
) -> Shaped[Tensor, "*#mbatch #Tb"]:
    """Columns ``start:stop`` of a mask whose key axis may be broadcast (size 1)."""
    if mask.shape[-1] == 1 and num_keys != 1:
        return mask
    return mask[..., start:stop]


@checked_internal
def _masked_scores(
    p: _Problem, start: int, stop: int
) -> tuple[Float[Tensor, "*batch h Tq Tb"], Bool[Tensor, "*#hbatch #Tq #Tb"] | None]:
    """Scores of every query against the ``Tb`` keys ``start:stop``, hidden ones ``-inf``.

    In the order of docs/variants.md: the scaled score, then the softcap, then ALiBi,
    then a float mask; then every key the masks, the causal diagonal or the window hide
    becomes ``-inf``. Returns the scores and the ``hidden`` mask (``True`` = hidden,
    broadcastable to the scores), or ``None`` when nothing is hidden.
    """
    Tq, Tk = p.q.shape[-2], p.k.shape[-2]
    k = _key_rows(p.k, start, stop)
    scores = _heads_matmul(p.q, k.transpose(-2, -1))  # (*batch, h, Tq, block); q is pre-scaled
    if p.softcap:
        scores = p.softcap * torch.tanh(scores / p.softcap)
    if p.alibi is not None:
        # positions in the scores' dtype (exact below 2**24): one (Tq, block) temporary
        pos = torch.arange(Tq, device=scores.device, dtype=scores.dtype).unsqueeze(-1)
        cols = torch.arange(start, stop, device=scores.device, dtype=scores.dtype)
        distance = (pos + p.offset - cols).abs_()  # (Tq, block)
        scores = scores - p.alibi * distance  # -m_h |i + off - j|
    hidden: Tensor | None = None
    if p.float_mask is not None:
        fm = _key_block(p.float_mask, start, stop, Tk)
        scores = scores + fm
        hidden = fm == _NEG_INF
    if p.bool_mask is not None:
        bm = ~_key_block(p.bool_mask, start, stop, Tk)
        hidden = bm if hidden is None else hidden | bm
    if p.causal and stop - 1 > p.offset:
        # (when even the first query sees the block's last key, the diagonal hides
        # nothing here: one query decoded against a cache, bottom-right)
        cm = ~causal_block(Tq, start, stop, p.offset, device=scores.device)
        hidden = cm if hidden is None else hidden | cm
    if p.window is not None:
        wm = ~window_block(Tq, start, stop, p.offset, p.window, device=scores.device)
        hidden = wm if hidden is None else hidden | wm
    if hidden is not None:
        # masked_fill (not +(-inf)) so a NaN or inf score at a hidden key is replaced too;
        # in place: `scores` is this function's own tensor, and matmul's backward needs
        # only its inputs
        scores.masked_fill_(hidden, _NEG_INF)
    return scores, hidden


@checked_internal
def _weights(
    p: _Problem,
    scores: Float[Tensor, "*batch h Tq Tk"],
    hidden: Bool[Tensor, "*#hbatch #Tq #Tk"] | None,
) -> Float[Tensor, "*batch h Tq Tk"]:
    """The softmax over keys; with sinks, over the keys and one sink per head.

    A sink is a key with a logit of its own and no value:
    ``w_ij = exp(s_ij) / (exp(sigma_h) + sum_k exp(s_ik))``. A row with no visible key
    gets zeros either way.
    """
    if p.sinks is None:
        return _softmax_rows(scores, hidden)
    sink = p.sinks.expand(*scores.shape[:-1], 1)  # (*batch, h, Tq, 1)
    full = torch.cat([scores, sink], dim=-1)
    none_hidden = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    keys_hidden = none_hidden if hidden is None else hidden.expand(scores.shape)
    # a row whose keys are all hidden stays empty (zeros) however large its sink
    empty = keys_hidden.all(dim=-1, keepdim=True)
    full_hidden = torch.cat([keys_hidden, empty | (sink == _NEG_INF)], dim=-1)
    return _softmax_rows(full, full_hidden)[..., :-1]


@checked_internal
def _lse(
    scores: Float[Tensor, "*batch h Tq Tk"], hidden: Bool[Tensor, "*#hbatch #Tq #Tk"] | None
) -> Float[Tensor, "*batch h Tq"]:
    """``log sum_j exp(s_ij)`` over the visible keys (sinks not included); ``-inf`` for a
    row with no visible key (computed from finite scores, so no NaN reaches a backward)."""
    if hidden is None:
        return torch.logsumexp(scores, dim=-1)
    empty = hidden.expand(scores.shape).all(dim=-1, keepdim=True)  # (*batch, h, Tq, 1)
    lse = torch.logsumexp(scores.masked_fill(empty, 0.0), dim=-1)
    return lse.masked_fill(empty.squeeze(-1), _NEG_INF)


@checked_internal
def _values_block(
    p: _Problem, start: int, stop: int, hidden: Bool[Tensor, "*#hbatch #Tq #Tb"] | None
) -> Float[Tensor, "*batch _ Tb Dv"]:
    """Values of keys ``start:stop`` (their ``g`` heads), zeroed at keys hidden from
    every query of a head.

    ``0 * NaN`` is NaN, so a NaN or inf in the value of a padding key would otherwise
    reach every output through the matmul even though its weight is exactly 0. Only
    then are the values repeated per query head (``h`` heads: two heads of a group may
    hide different keys), each copy zeroed where its own queries see nothing.
    """
    v = _key_rows(p.v, start, stop)
    if hidden is None:
        return v
    hidden_for_all = hidden.all(dim=-2).unsqueeze(-1)  # (..., block, 1), per query head
    if not hidden_for_all.any():
        return v  # e.g. causal: every key is seen by some query; no copy of V needed
    if bool(torch.isfinite(v.detach().sum())):
        return v  # every value is finite (a NaN or inf makes the sum so): 0 * v is 0
    return _repeat_kv_heads(v, p.q.shape[-3]).masked_fill(hidden_for_all, 0.0)


@checked_internal
def _heads_matmul(
    x: Float[Tensor, "*batch h M K"], y: Float[Tensor, "*batch g K N"]
) -> Float[Tensor, "*batch h M N"]:
    """``x @ y`` where head ``i`` of ``x`` (a query head) meets head ``i // (h // g)`` of
    ``y`` (its key/value head: the interleaved mapping of `expand_kv_heads`), with no
    copy of ``y`` per query head: the ``h // g`` query heads of each group are stacked
    as the rows of one matrix, which meets its key/value head once. Keys and values of
    a long context with few KV heads are the largest tensors attention reads."""
    h, g = x.shape[-3], y.shape[-3]
    if h == g:
        return x @ y
    _check_gqa(h, g)
    # contiguous first: the same rows in the same layout make the same product, bit for
    # bit (a sink's weights are a slice of a wider softmax; without, they are not)
    stacked = x.contiguous().reshape(*x.shape[:-3], g, (h // g) * x.shape[-2], x.shape[-1])
    return (stacked @ y).reshape(*x.shape[:-1], y.shape[-1])


@checked_internal
def _dropout(
    weights: Float[Tensor, "*batch Tq Tk"],
    dropout_p: float,
    generator: torch.Generator | None,
    dropout_mask: Bool[Tensor, "*#dbatch #Tq #Tk"] | None,
) -> Float[Tensor, "*batch Tq Tk"]:
    if dropout_mask is not None:
        _check_broadcast("dropout_mask", dropout_mask.shape, weights.shape)
        keep = dropout_mask
    elif dropout_p == 0.0:
        return weights
    else:
        draws = torch.rand(
            weights.shape, generator=generator, device=weights.device, dtype=weights.dtype
        )
        keep = draws >= dropout_p
    if dropout_p >= 1.0:
        return torch.zeros_like(weights)
    return weights * keep / (1.0 - dropout_p)


def _check_dropout_p(dropout_p: float) -> None:
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1], got {dropout_p}")


_VARIANT_ARGS = """
        window: a sliding window ``(left, right)`` around each query's position under
            ``causal_alignment``: query ``i`` at position ``p`` sees keys
            ``p - left .. p + right``, both ends inclusive, ``-1`` unbounded on that side
            (FlashAttention's ``window_size``); combined with ``is_causal``, a key must
            pass both. ``(-1, -1)`` is no window.
        softcap: ``c > 0`` caps each scaled score as ``c * tanh(s / c)`` (Gemma 2); ``0``
            is off.
        alibi_slopes: ALiBi slopes ``m`` of shape ``(h,)`` or ``(*batch, h)``, float32:
            adds ``-m_h * |p - j|`` to the score of query position ``p`` and key ``j``,
            after the softcap and before ``attn_mask``.
        sinks: one logit ``sigma_h`` per query head (gpt-oss): the softmax denominator
            gains ``exp(sigma_h)`` and the sink carries no value, so
            ``out = out_plain * sigmoid(lse - sigma_h)``.
        return_lse: also return ``lse = log sum_j exp(s_ij)`` over the visible keys,
            natural log, after softcap, ALiBi and the mask, the sink not included:
            ``(*batch, h, Tq)`` in float32 (float64 for float64 inputs), ``-inf`` for a
            query with no visible key."""


@overload
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    *,
    causal_alignment: Alignment = ...,
    return_weights: Literal[False] = ...,
    generator: torch.Generator | None = ...,
    dropout_mask: Tensor | None = ...,
    window: Window | None = ...,
    softcap: float = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    return_lse: Literal[False] = ...,
) -> Tensor: ...


@overload
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    *,
    causal_alignment: Alignment = ...,
    return_weights: Literal[True],
    generator: torch.Generator | None = ...,
    dropout_mask: Tensor | None = ...,
    window: Window | None = ...,
    softcap: float = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    return_lse: Literal[False] = ...,
) -> tuple[Tensor, Tensor]: ...


@overload
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    *,
    causal_alignment: Alignment = ...,
    return_weights: Literal[False] = ...,
    generator: torch.Generator | None = ...,
    dropout_mask: Tensor | None = ...,
    window: Window | None = ...,
    softcap: float = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    return_lse: Literal[True],
) -> tuple[Tensor, Tensor]: ...


@overload
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    *,
    causal_alignment: Alignment = ...,
    return_weights: Literal[True],
    generator: torch.Generator | None = ...,
    dropout_mask: Tensor | None = ...,
    window: Window | None = ...,
    softcap: float = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    return_lse: Literal[True],
) -> tuple[Tensor, Tensor, Tensor]: ...


@checked
def scaled_dot_product_attention(
    query: Float[Tensor, "*batch h Tq Dh"],
    key: Float[Tensor, "*batch g Tk Dh"],
    value: Float[Tensor, "*batch g Tk Dv"],
    attn_mask: AttnMask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_alignment: Alignment = "top_left",
    return_weights: bool = False,
    generator: torch.Generator | None = None,
    dropout_mask: Bool[Tensor, "*#batch #h #Tq #Tk"] | None = None,
    window: Window | None = None,
    softcap: float = 0.0,
    alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "*batch h"] | None = None,
    sinks: Float[Tensor, " h"] | None = None,
    return_lse: bool = False,
) -> (
    Float[Tensor, "*batch h Tq Dv"]
    | tuple[Float[Tensor, "*batch h Tq Dv"], Float[Tensor, "*batch h Tq Tk"]]
    | tuple[Float[Tensor, "*batch h Tq Dv"], Float[Tensor, "*batch h Tq"]]
    | tuple[
        Float[Tensor, "*batch h Tq Dv"],
        Float[Tensor, "*batch h Tq Tk"],
        Float[Tensor, "*batch h Tq"],
    ]
):
    """Scaled dot-product attention: a drop-in for torch's ``scaled_dot_product_attention``,
    with the variants production kernels ship (docs/variants.md).

    ``out = dropout(softmax(Q K^T * scale + M)) V``, softmax over keys, where ``M`` hides
    every key the masks hide. See the module docstring for the semantics it pins down.

    Args:
        query: ``Q``.
        key: ``K``; ``g`` may differ from ``h`` only with ``enable_gqa``.
        value: ``V``.
        attn_mask: boolean (``True`` = may attend) or float (added to the scores; ``-inf``
            hides the key), broadcastable to ``(*batch, h, Tq, Tk)``.
        dropout_p: probability of dropping an attention weight (kept ones are scaled by
            ``1 / (1 - p)``).
        is_causal: hide future keys under ``causal_alignment``; unlike torch, may be
            combined with ``attn_mask`` (a key must pass both).
        scale: factor on ``Q K^T``; ``1 / sqrt(Dh)`` when ``None``.
        enable_gqa: allow ``g < h`` key/value heads (``h % g == 0``), head ``i`` reading
            key/value head ``i // (h // g)``.
        causal_alignment: ``"top_left"`` (torch's ``is_causal``) or ``"bottom_right"``
            (query ``i`` at position ``Tk - Tq + i``); it places the window and ALiBi too.
        return_weights: also return the attention weights (before dropout).
        generator: random stream for dropout, so a run can be replayed.
        dropout_mask: explicit keep-mask for dropout (``True`` = keep), overriding the
            random draw.{variants}

    Returns:
        The output ``(*batch, h, Tq, Dv)`` in the input dtype; with ``return_weights``
        also the weights ``(*batch, h, Tq, Tk)``: the probability that query ``i`` reads
        key ``j``, 0 for hidden keys, rows summing to 1 (or all 0 with no visible key;
        less than 1 with a sink); with ``return_lse`` then the log-sum-exp.

    Raises:
        ValueError: mismatched dtypes, ``g`` not dividing ``h`` (or ``g != h`` without
            ``enable_gqa``), a mask that does not broadcast, an unknown alignment,
            ``dropout_p`` outside ``[0, 1]``, a window side below ``-1``, a negative
            softcap, or ALiBi slopes that are not float32.
    """
    _check_dropout_p(dropout_p)
    p = _prepare(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        scale,
        enable_gqa,
        causal_alignment,
        window,
        softcap,
        alibi_slopes,
        sinks,
    )
    Tk = p.k.shape[-2]
    scores, hidden = _masked_scores(p, 0, Tk)  # (*batch, h, Tq, Tk)
    weights = _weights(p, scores, hidden)
    dropped = _dropout(weights, dropout_p, generator, dropout_mask)
    out = _as(_heads_matmul(dropped, _values_block(p, 0, Tk, hidden)), p.out_dtype)
    if return_weights and return_lse:
        return out, _as(weights, p.out_dtype), _lse(scores, hidden)
    if return_weights:
        return out, _as(weights, p.out_dtype)
    if return_lse:
        return out, _lse(scores, hidden)
    return out


scaled_dot_product_attention.__doc__ = (scaled_dot_product_attention.__doc__ or "").replace(
    "{variants}", _VARIANT_ARGS
)


@overload
def chunked_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    *,
    causal_alignment: Alignment = ...,
    block_size: int = ...,
    window: Window | None = ...,
    softcap: float = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    return_lse: Literal[False] = ...,
) -> Tensor: ...


@overload
def chunked_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    *,
    causal_alignment: Alignment = ...,
    block_size: int = ...,
    window: Window | None = ...,
    softcap: float = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    return_lse: Literal[True],
) -> tuple[Tensor, Tensor]: ...


@checked
def chunked_attention(
    query: Float[Tensor, "*batch h Tq Dh"],
    key: Float[Tensor, "*batch g Tk Dh"],
    value: Float[Tensor, "*batch g Tk Dv"],
    attn_mask: AttnMask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_alignment: Alignment = "top_left",
    block_size: int = 512,
    window: Window | None = None,
    softcap: float = 0.0,
    alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "*batch h"] | None = None,
    sinks: Float[Tensor, " h"] | None = None,
    return_lse: bool = False,
) -> (
    Float[Tensor, "*batch h Tq Dv"]
    | tuple[Float[Tensor, "*batch h Tq Dv"], Float[Tensor, "*batch h Tq"]]
):
    """`scaled_dot_product_attention` computed over blocks of keys (online softmax).

    Keys are visited ``block_size`` at a time. A running row max ``m``, running
    denominator ``l`` and running output ``acc`` are rescaled whenever the max grows
    (Milakov & Gimelshein 2018; FlashAttention)::

        m' = max(m, rowmax(S_b));   a = exp(m - m');   P = exp(S_b - m')
        l' = a * l + rowsum(P);     acc' = a * acc + P V_b;   out = acc / l

    so memory grows with ``Tq * block_size`` rather than ``Tq * Tk``. Same semantics as the
    materialised function, variants included (empty rows give 0, hidden keys never
    matter); the log-sum-exp is ``m + log l``, and a sink joins the denominator once,
    after the last block: ``out = acc / (l + exp(sigma - m))``. Dropout is not supported.

    Raises:
        ValueError: as `scaled_dot_product_attention`; ``block_size < 1``;
            ``dropout_p != 0``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if dropout_p != 0.0:
        raise ValueError(f"chunked_attention does not implement dropout, got dropout_p={dropout_p}")
    p = _prepare(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        scale,
        enable_gqa,
        causal_alignment,
        window,
        softcap,
        alibi_slopes,
        sinks,
    )
    Tk = p.k.shape[-2]
    stats_shape = (*p.q.shape[:-1], 1)  # (*batch, h, Tq, 1)
    row_max = p.q.new_full(stats_shape, _NEG_INF)
    denom = p.q.new_zeros(stats_shape)
    acc = p.q.new_zeros((*p.q.shape[:-1], p.v.shape[-1]))  # (*batch, h, Tq, Dv)
    for start in range(0, Tk, block_size):
        stop = min(start + block_size, Tk)
        scores, hidden = _masked_scores(p, start, stop)  # (*batch, h, Tq, block)
        new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
        safe_max = new_max.masked_fill(new_max == _NEG_INF, 0.0)  # no visible key yet
        rescale = torch.exp(row_max - safe_max)
        probs = torch.exp(scores - safe_max)
        denom = rescale * denom + probs.sum(dim=-1, keepdim=True)
        acc = rescale * acc + _heads_matmul(probs, _values_block(p, start, stop, hidden))
        row_max = new_max
        del scores, probs  # before the next block's: memory stays at one block's worth
    seen = denom > 0  # (*batch, h, Tq, 1): the row saw a key
    out = acc / denom.masked_fill(~seen, 1.0)
    lse = torch.where(seen, row_max + torch.log(denom.masked_fill(~seen, 1.0)), _NEG_INF)
    lse = lse.squeeze(-1)
    if sinks is not None:  # once, after every block, as after a merge; an empty row stays 0
        # (a sum with exp(sink - max) overflowed for a sink far above every score: the
        # output 0, its gradient 0 * inf = NaN; the sigmoid does not)
        out = apply_sinks(out, lse, sinks)
    out = out.to(p.out_dtype)
    if not return_lse:
        return out
    return out, lse


@checked
def merge_attention(
    out1: Float[Tensor, "*batch h Tq Dv"],
    lse1: Float[Tensor, "*batch h Tq"],
    out2: Float[Tensor, "*batch h Tq Dv"],
    lse2: Float[Tensor, "*batch h Tq"],
) -> tuple[Float[Tensor, "*batch h Tq Dv"], Float[Tensor, "*batch h Tq"]]:
    """Attention over two disjoint sets of keys, combined from each set's output and LSE.

    ``lse = logaddexp(lse1, lse2)``, ``out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2``
    (split-KV decoding, ring attention, prefix sharing). A part in which a query saw no
    key (``lse = -inf``) drops out whatever its output holds (0, or NaN from ``0 / 0``);
    a query that saw no key in either part gets 0 and ``-inf``. Apply sinks after the
    merge (`apply_sinks`): counted in each part they would be counted twice.

    Raises:
        ValueError: an LSE holds ``+inf`` or NaN (FlashAttention 2 returns ``+inf`` for a
            row with no visible key: map it to ``-inf`` first).
    """
    for name, lse in (("lse1", lse1), ("lse2", lse2)):
        bad = torch.isnan(lse) | torch.isposinf(lse)
        if bool(bad.any()):
            raise ValueError(
                f"{name} holds {int(bad.sum())} NaN or +inf values; a row with no visible "
                "key must have lse -inf (map FlashAttention 2's +inf to -inf first)"
            )
    ctype = torch.promote_types(torch.promote_types(lse1.dtype, lse2.dtype), torch.float32)
    a, b = lse1.to(ctype), lse2.to(ctype)
    lse = torch.logaddexp(a, b)
    safe = lse.masked_fill(lse == _NEG_INF, 0.0)
    w1, w2 = torch.exp(a - safe).unsqueeze(-1), torch.exp(b - safe).unsqueeze(-1)

    def part(w: Tensor, out: Tensor) -> Tensor:
        return torch.where(w > 0, w * out.to(ctype), 0.0)  # an empty part drops out

    out = part(w1, out1) + part(w2, out2)
    return out.to(out1.dtype), lse


@checked
def apply_sinks(
    out: Float[Tensor, "*batch h Tq Dv"],
    lse: Float[Tensor, "*batch h Tq"],
    sinks: Float[Tensor, " h"],
) -> Float[Tensor, "*batch h Tq Dv"]:
    """Attention without sinks made attention with one: ``out * sigmoid(lse - sigma_h)``.

    The sink adds ``exp(sigma_h)`` to the denominator and nothing to the numerator, so
    every weight shrinks by ``l / (l + exp(sigma)) = sigmoid(lse - sigma)``. A row with no
    visible key (``lse = -inf``) stays 0.
    """
    lse64 = lse.to(torch.float64)
    factor = torch.sigmoid(lse64 - sinks.to(torch.float64).unsqueeze(-1))
    factor = factor.masked_fill(lse64 == -math.inf, 0.0)  # (a sink of -inf: NaN otherwise)
    return (out.to(torch.float64) * factor.unsqueeze(-1)).to(out.dtype)


# ------------------------------------------------------------------ Nadaraya-Watson


@checked
def nadaraya_watson(
    queries: Float[Tensor, "*batch Tq"],
    keys: Float[Tensor, "*batch Tk"],
    values: Float[Tensor, "*batch Tk"],
    w: float | Float[Tensor, ""] = 1.0,
) -> tuple[Float[Tensor, "*batch Tq"], Float[Tensor, "*batch Tq Tk"]]:
    """Nadaraya-Watson kernel regression, attention pooling with a Gaussian kernel.

    ``f(x) = sum_i softmax_i(-((x - x_i) w)^2 / 2) y_i``: queries ``x``, keys ``x_i`` (the
    training inputs), values ``y_i``. ``w = 1`` is the non-parametric estimator; a learnable
    ``w`` (see `attnref.layers.NadarayaWatson`) sets the kernel's width ``1 / w``.

    Returns:
        The predictions and the weights ``(*batch, Tq, Tk)``.
    """
    diffs = (queries.unsqueeze(-1) - keys.unsqueeze(-2)) * w  # (*batch, Tq, Tk)
    weights = torch.softmax(-(diffs**2) / 2, dim=-1)
    predictions = (weights @ values.unsqueeze(-1)).squeeze(-1)  # (*batch, Tq)
    return predictions, weights
