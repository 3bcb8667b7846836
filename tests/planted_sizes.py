"""Kernels right on small cases and wrong past a size or a value production reaches
(classes 32 and 33), written here on their own (plain torch, none of attnref's kernels
or switches), importable as ``tests.planted_sizes:NAME``.

Each is torch's SDPA except past one threshold, where it does what a real kernel was
reported to do (BUG_CLASSES.md, classes 32 and 33): a split-KV merge that forgets to
rescale, a last partial block dropped, a grid that wraps, a finite stand-in for minus
infinity, a running maximum started at 0. The audit's default profile must fail every
one of them (`tests/test_sizes.py`).
"""

import math

import torch
from torch import Tensor

from tests.torch_sdpa import sdpa


def _sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _bias(
    q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool, fill: float = -math.inf
) -> Tensor:
    """The additive bias of the mask and the top-left causal diagonal, ``fill`` where a
    key is hidden, in float32 (float64 for float64 inputs)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    Tq, Tk = q.shape[-2], k.shape[-2]
    bias = torch.zeros(Tq, Tk, dtype=acc)
    if is_causal:
        bias = bias.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool).tril(), fill)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = bias + torch.zeros(attn_mask.shape, dtype=acc).masked_fill(~attn_mask, fill)
        else:
            bias = bias + attn_mask.to(acc).clamp(min=fill)
    return bias


def _scores(q: Tensor, k: Tensor, scale: float | None) -> tuple[Tensor, Tensor]:
    """Scores in float32 (float64 for float64 inputs), K expanded to the query heads."""
    acc = torch.promote_types(q.dtype, torch.float32)
    kk = k.to(acc).repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    s = q.shape[-1] ** -0.5 if scale is None and q.shape[-1] else (scale or 1.0)
    return (q.to(acc) @ kk.transpose(-2, -1)) * s, kk


def _values(q: Tensor, v: Tensor) -> Tensor:
    acc = torch.promote_types(q.dtype, torch.float32)
    return v.to(acc).repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)


def split_kv_past_512(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Past 512 keys, two splits merged by adding each split's unnormalised sums taken
    against its own maximum, never rescaled to the common one (flash-attention#1647)."""
    if k.shape[-2] <= 512:
        return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    s, _ = _scores(q, k, scale)
    s = s + _bias(q, k, attn_mask, is_causal)
    vv = _values(q, v)
    num: Tensor | float = 0.0
    den: Tensor | float = 0.0
    cut = k.shape[-2] // 2
    for part in (slice(0, cut), slice(cut, None)):
        sp = s[..., part]
        m = sp.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0).clamp(min=-1e30)
        e = torch.exp(sp - m)
        num = num + e @ vv[..., part, :]
        den = den + e.sum(dim=-1, keepdim=True)
    den_t = torch.as_tensor(den)
    out = torch.as_tensor(num) / den_t.masked_fill(den_t == 0, 1.0)
    return out.to(q.dtype)


def drops_last_block_past_2048(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Past 2048 keys, the last partial block of 128 keys is never visited."""
    Tk = k.shape[-2]
    if Tk <= 2048 or Tk % 128 == 0:
        return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    keep = Tk - Tk % 128
    hidden = torch.zeros(q.shape[-2], Tk, dtype=torch.bool)
    hidden[:, keep:] = True
    mask = ~hidden if attn_mask is None else _as_bool(attn_mask) & ~hidden
    return _sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask > float("-inf")


def head_dim_above_128(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """For head dims above 128 (a template it has no tile for) the scores read only the
    first 128 dims of Q and K."""
    if q.shape[-1] <= 128:
        return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    d = q.shape[-1]
    return _sdpa(
        q[..., :128], k[..., :128], v, attn_mask, dropout_p, is_causal,
        d**-0.5 if scale is None else scale, enable_gqa,
    )  # fmt: skip


def value_dim_scale(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """When Dqk != Dv and Dqk > 128 (192/128, 576/512), the default scale is taken from
    Dv."""
    Dqk, Dv = q.shape[-1], v.shape[-1]
    if scale is None and Dqk != Dv and Dqk > 128:
        scale = Dv**-0.5
    return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def causal_rows_past_1024(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Causal rows past query 1024 (a second row tile) see one key more than they may."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    if not is_causal or Tq <= 1024:
        return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    seen = torch.ones(Tq, Tk, dtype=torch.bool).tril()
    seen[1024:] = torch.ones(Tq - 1024, Tk, dtype=torch.bool).tril(1025)
    mask = seen if attn_mask is None else _as_bool(attn_mask) & seen
    return _sdpa(q, k, v, mask, dropout_p, False, scale, enable_gqa)


def half_accumulation_past_512(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Past 512 keys, ``P @ V`` accumulates in half precision (bfloat16)."""
    if k.shape[-2] <= 512:
        return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    s, _ = _scores(q, k, scale)
    p = torch.softmax(s + _bias(q, k, attn_mask, is_causal), dim=-1).nan_to_num(0.0)
    vv = _values(q, v)
    acc = torch.zeros((*p.shape[:-1], vv.shape[-1]), dtype=torch.bfloat16)
    for start in range(0, k.shape[-2], 64):  # blocks summed in bfloat16
        part = p[..., start : start + 64] @ vv[..., start : start + 64, :]
        acc = acc + part.to(torch.bfloat16)
    return acc.to(q.dtype)


def grid_wraps_past_64(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """A grid of batch * heads programs that wraps past 64: program 64 + i writes the
    output of program i."""
    out = _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if out.numel() == 0:  # no program writes anything (its base took this as given)
        return out
    flat = out.reshape(-1, *out.shape[-2:])
    if flat.shape[0] <= 64:
        return out
    index = torch.arange(flat.shape[0]) % 64
    return flat[index].reshape(out.shape)


def rows_wrap_past_2048(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """A grid of query-row tiles that wraps past 2048 rows: row 2048 + i is written with
    row i's output."""
    out = _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    Tq = out.shape[-2]
    if Tq <= 2048:
        return out
    return out.index_select(-2, torch.arange(Tq) % 2048)


def groups_past_4(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """GQA groups of more than 4 query heads per KV head (past the group sizes it has a
    template for) map query head i to KV head (i // 4) mod g, as groups of 4 would."""
    h, g = q.shape[-3], k.shape[-3]
    if h // g <= 4:
        return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    index = (torch.arange(h) // 4) % g
    kk, vv = k.index_select(-3, index), v.index_select(-3, index)
    return _sdpa(q, kk, vv, attn_mask, dropout_p, is_causal, scale, False)


def minus_inf_is_5e4(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Hidden keys get a finite -5e4 (FlashInfer's stand-in for minus infinity): right
    while real scores stay above it (flashinfer#4267)."""
    if attn_mask is None and not is_causal:
        return _sdpa(q, k, v, None, dropout_p, False, scale, enable_gqa)
    s, _ = _scores(q, k, scale)
    bias = _bias(q, k, attn_mask, is_causal, fill=-5e4)
    seen = torch.isfinite(s + _bias(q, k, attn_mask, is_causal)).any(dim=-1, keepdim=True)
    p = torch.softmax(s + bias, dim=-1)
    out = (p @ _values(q, v)).masked_fill(~seen, 0.0)  # its empty rows stay zero
    return out.to(q.dtype)


def unnormalised_half_sums(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """In half precision, ``P @ V`` is summed before the division by the softmax's
    denominator, in the inputs' dtype: unnormalised weights of up to 1 each, so a flat
    row over thousands of keys of a V far from zero overflows float16."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    s, _ = _scores(q, k, scale)
    s = s + _bias(q, k, attn_mask, is_causal)
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - m.masked_fill(m == -math.inf, 0.0))
    den = e.sum(dim=-1, keepdim=True)
    num = (e.to(q.dtype) @ _values(q, v).to(q.dtype)).to(e.dtype)
    return (num / den.masked_fill(den == 0, 1.0)).to(q.dtype)


def running_max_from_zero(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Online softmax whose running maximum starts at 0, not -inf: a row whose scores are
    all far below 0 underflows to zeros."""
    s, _ = _scores(q, k, scale)
    s = s + _bias(q, k, attn_mask, is_causal)
    vv = _values(q, v)
    m = torch.zeros((*s.shape[:-1], 1), dtype=s.dtype)
    den = torch.zeros_like(m)
    acc = torch.zeros((*s.shape[:-1], vv.shape[-1]), dtype=s.dtype)
    for start in range(0, s.shape[-1], 128):
        part = s[..., start : start + 128]
        new = torch.maximum(m, part.amax(dim=-1, keepdim=True))
        fix = torch.exp(m - new)
        e = torch.exp(part - new)
        den = den * fix + e.sum(dim=-1, keepdim=True)
        acc = acc * fix + e @ vv[..., start : start + 128, :]
        m = new
    return (acc / den.masked_fill(den == 0, 1.0)).to(q.dtype)


def zeros_below_minus_5e4(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """A row whose largest score lies below -5e4 is taken for a row with no visible key
    and comes out zero (flashinfer#4450, #4451)."""
    out = _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    s, _ = _scores(q, k, scale)
    top = (s + _bias(q, k, attn_mask, is_causal)).amax(dim=-1, keepdim=True)
    return out.masked_fill(top < -5e4, 0.0)


def correct_blocked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """A correct kernel: online softmax over blocks of 128 keys, the running maximum
    started at -inf and every block rescaled to the new one (FlashAttention's
    recurrence); no dropout (declared)."""
    s, _ = _scores(q, k, scale)
    s = s + _bias(q, k, attn_mask, is_causal)
    vv = _values(q, v)
    m = torch.full((*s.shape[:-1], 1), -math.inf, dtype=s.dtype)
    den = torch.zeros_like(m)
    acc = torch.zeros((*s.shape[:-1], vv.shape[-1]), dtype=s.dtype)
    for start in range(0, s.shape[-1], 128):
        part = s[..., start : start + 128]
        new = torch.maximum(m, part.amax(dim=-1, keepdim=True))
        safe = new.masked_fill(new == -math.inf, 0.0)
        fix = torch.exp(m - safe)
        e = torch.exp(part - safe)
        if q.dtype != s.dtype:  # P rounded to the inputs' dtype before P @ V
            e = e.to(q.dtype).to(s.dtype)
        den = den * fix + e.sum(dim=-1, keepdim=True)
        acc = acc * fix + e @ vv[..., start : start + 128, :]
        m = new
    return (acc / den.masked_fill(den == 0, 1.0)).to(q.dtype)


def correct_key_by_key(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """A correct kernel that sums over keys one at a time (the softmax's denominator and
    ``P @ V``, each a running sum in float32: recursive summation, the least accurate
    order a correct kernel may use; torch's CPU ``cumsum`` would sum in float64); no
    dropout (declared)."""
    s, _ = _scores(q, k, scale)
    s = s + _bias(q, k, attn_mask, is_causal)
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - m.masked_fill(m == -math.inf, 0.0))
    vv = _values(q, v)
    den = torch.zeros_like(m)
    acc = torch.zeros((*s.shape[:-1], vv.shape[-1]), dtype=s.dtype)
    for j in range(s.shape[-1]):
        w = e[..., j : j + 1]  # (..., Tq, 1)
        den = den + w
        acc = acc + w * vv[..., j : j + 1, :]
    return (acc / den.masked_fill(den == 0, 1.0)).to(q.dtype)


#: every planted kernel, with the class it belongs to
PLANTED = {
    "split_kv_past_512": 32,
    "drops_last_block_past_2048": 32,
    "head_dim_above_128": 32,
    "value_dim_scale": 32,
    "causal_rows_past_1024": 32,
    "half_accumulation_past_512": 32,
    "grid_wraps_past_64": 32,
    "rows_wrap_past_2048": 32,
    "groups_past_4": 32,
    "minus_inf_is_5e4": 33,
    "unnormalised_half_sums": 33,
    "running_max_from_zero": 33,
    "zeros_below_minus_5e4": 33,
}


def _declare() -> None:
    from attnref.conformance import Capabilities

    correct_blocked.capabilities = Capabilities(dropout=False)  # type: ignore[attr-defined]
    for name in PLANTED:
        globals()[name].capabilities = Capabilities(dropout=False)


_declare()


# ------------------------------------------------------------------------- strawmen
# What a generated kernel returns when it games a loose check (BUG_CLASSES.md, class 31,
# "strawmen"): each must fail every property that can see it (`tests/test_sizes.py`).


def _visible(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    """``(*batch, h, Tq, Tk)`` booleans: the keys each query sees (top-left causal)."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    seen = torch.ones(Tq, Tk, dtype=torch.bool)
    if is_causal:
        seen = seen.tril()
    if attn_mask is not None:
        seen = seen & _as_bool(attn_mask)
    return seen.expand(*q.shape[:-1], Tk)


def zeros(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Zeros of the output's shape."""
    return torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)


def mean_of_v(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """The mean of every V row, whatever the mask and the scores."""
    vv = _values(q, v)
    return vv.mean(dim=-2, keepdim=True).expand(*q.shape[:-1], v.shape[-1]).to(q.dtype)


def uniform_visible(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Uniform weights over the keys each query sees (zero for one that sees none)."""
    seen = _visible(q, k, attn_mask, is_causal).to(torch.promote_types(q.dtype, torch.float32))
    w = seen / seen.sum(dim=-1, keepdim=True).clamp(min=1)
    return (w @ _values(q, v)).to(q.dtype)


def last_visible(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """The value of the last key each query sees (zero for one that sees none)."""
    seen = _visible(q, k, attn_mask, is_causal)
    Tk = k.shape[-2]
    last = torch.where(seen, torch.arange(Tk), -1).amax(dim=-1)  # (*batch, h, Tq)
    w = torch.nn.functional.one_hot(last.clamp(min=0), Tk) * (last >= 0)[..., None]
    return (w.to(torch.promote_types(q.dtype, torch.float32)) @ _values(q, v)).to(q.dtype)


#: the next precision down: what "the right output, one precision lower" computes in
_LOWER = {torch.float64: torch.float32, torch.float32: torch.bfloat16}


def one_precision_lower(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """The right output computed one precision lower (float64 in float32, float32 in
    bfloat16); declares float64 and float32 only."""
    low = _LOWER[q.dtype]
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.to(low)
    out = _sdpa(q.to(low), k.to(low), v.to(low), mask, dropout_p, is_causal, scale, enable_gqa)
    return out.to(q.dtype)


def _declare_strawmen() -> None:
    from attnref.conformance import Capabilities

    for fn in (zeros, mean_of_v, uniform_visible, last_visible):
        fn.capabilities = Capabilities(dropout=False, gradients=False)  # type: ignore[attr-defined]
    one_precision_lower.capabilities = Capabilities(  # type: ignore[attr-defined]
        dropout=False, gradients=False, dtypes=(torch.float64, torch.float32)
    )


_declare_strawmen()

#: the agreement properties: every strawman that changes a visible row's value fails them
_AGREE = ("forward", "hot", "tails", "scale", "layouts", "large_index", "fresh_values")
#: each strawman, and the properties that can see it (docs/testing.md, "Strawmen")
STRAWMEN: dict[str, tuple[str, ...]] = {
    "zeros": (*_AGREE, "degenerate", "empty_rows", "dropout_zero", "value_affine"),
    "mean_of_v": (*_AGREE, "degenerate", "empty_rows", "dropout_zero", "masked_keys"),
    "uniform_visible": (*_AGREE, "degenerate", "empty_rows", "dropout_zero"),
    "last_visible": (*_AGREE, "degenerate", "empty_rows", "dropout_zero", "key_permutation"),
    "one_precision_lower": _AGREE,
}


def rounds_float64_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """A port's bug: float64 inputs rounded to float32 on their way in (the runtime's
    tensors are float32), then computed in float64. Exact on float32 numbers."""
    if q.dtype == torch.float64:
        q, k, v = (t.float().double() for t in (q, k, v))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.float().double()
    return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
