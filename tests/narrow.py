"""A narrow backend, as litgpt's or natten's attention is: causal self-attention only, the
default scale, no mask. ``tests.narrow:causal_self_attention`` calls torch's SDPA and
refuses, with an error, every call outside that."""

from typing import Any

import torch
from torch import Tensor

from attnref.conformance import Capabilities, EmptyRows


def causal_self_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **variants: Any,
) -> Tensor:
    """torch SDPA, causal self-attention only."""
    if attn_mask is not None or not is_causal or scale is not None or variants:
        raise NotImplementedError("causal self-attention only, default scale, no mask")
    if query.shape[-2] != key.shape[-2]:
        raise NotImplementedError("self-attention only: Tq must equal Tk")
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout_p, is_causal=True, enable_gqa=enable_gqa
    )
    return out


causal_self_attention.capabilities = Capabilities(  # type: ignore[attr-defined]
    bool_mask=False,
    float_mask=False,
    self_attention_only=True,
    causal_only=True,
    explicit_scale=False,
)


def additive_fill(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """torch SDPA given a boolean mask as diffusers gives it: ``-10000`` *added* at hidden
    keys, so that a query that sees no key attends every key the mask hid."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, -1e4)
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return out


def softmax_one(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: Tensor | None = None,
) -> Tensor:
    """softmax_1 (``exp(x) / (1 + sum exp(x))``): a sink of logit 0 shared by every head,
    a constant (no gradient); no sink when ``sinks`` is None."""
    if sinks is not None and bool((sinks != 0).any()):
        raise NotImplementedError("softmax_1: the sink logit is 0")
    scores_scale = query.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = query.double(), key.double(), value.double()
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    s = q @ k.transpose(-2, -1) * scores_scale
    if attn_mask is not None:
        s = (
            s.masked_fill(~attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else s + attn_mask
        )
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if sinks is not None:  # the sink's logit 0 joins the row's maximum and its sum
        top = s.amax(-1, keepdim=True).clamp(min=0).nan_to_num(0.0, neginf=0.0)
        e = (s - top).exp()
        p = e / (e.sum(-1, keepdim=True) + (-top).exp())
    else:
        p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).to(query.dtype)


#: diffusers' fill declared as what it is: a row the mask empties attends the keys it hid
additive_fill.capabilities = Capabilities(  # type: ignore[attr-defined]
    empty_row=EmptyRows(bool_mask="unmasked"),
    causal_with_mask=False,  # torch's SDPA underneath
)


def additive_fill_as_zero(*args: Any, **kwargs: Any) -> Tensor:
    """`additive_fill` declared with torch SDPA's zeros for an empty row (wrongly)."""
    return additive_fill(*args, **kwargs)


softmax_one.capabilities = Capabilities(  # type: ignore[attr-defined]
    dtypes=(torch.float64, torch.float32),
    sinks=True,
    sink_shared=True,
    sink_values=(0.0,),
    sink_gradients=False,
    gradients=False,
)


def softcap_adds_bool_mask(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    softcap: float = 0.0,
) -> Tensor:
    """litgpt 0.5.13's softcap path: the mask is *added* to the capped scores, so a
    boolean mask adds 1 where visible and 0 where hidden, and hides nothing."""
    s = query.double() @ key.double().transpose(-2, -1) * (scale or query.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if attn_mask is not None:
        s = s + attn_mask.double()
    return (torch.softmax(s, -1) @ value.double()).to(query.dtype)


def mixes_heads(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Materialised attention (NaN for a row that sees no key), then a mean over the
    heads added to each: a projection that mixes heads, as a module's output projection."""
    s = query.double() @ key.double().transpose(-2, -1) * (scale or query.shape[-1] ** -0.5)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    out = torch.softmax(s, -1) @ value.double()
    return (out + 0.0 * out.mean(dim=-3, keepdim=True)).to(query.dtype)


softcap_adds_bool_mask.capabilities = Capabilities(  # type: ignore[attr-defined]
    dtypes=(torch.float32,), float_mask=False, gqa=False, causal_alignments=(), softcap=True
)
mixes_heads.capabilities = Capabilities(  # type: ignore[attr-defined]
    dtypes=(torch.float32,), float_mask=False, gqa=False, causal_alignments=(), empty_row="nan"
)


def at_most_keys(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kw: Any) -> Tensor:
    """torch SDPA for calls with no more queries than keys (a prefill of a whole
    sequence, or decode against a cache); it raises on any other."""
    if query.shape[-2] > key.shape[-2]:
        raise ValueError(f"{query.shape[-2]} queries against {key.shape[-2]} keys")
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(query, key, value, *args, **kw)
    return out


at_most_keys.capabilities = Capabilities(  # type: ignore[attr-defined]
    queries_at_most_keys=True, causal_with_mask=False
)


def causal_bottom_right(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    causal_alignment: str = "top_left",
) -> Tensor:
    """Causal attention aligned bottom-right only (a prefill against a cache, and its
    decode steps), no mask: torch's SDPA with that diagonal as a mask."""
    from attnref.masks import causal_mask

    if attn_mask is not None or not is_causal or causal_alignment != "bottom_right":
        raise NotImplementedError("causal bottom-right only, no mask")
    seen = causal_mask(query.shape[-2], key.shape[-2], "bottom_right")
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, seen, scale=scale, enable_gqa=enable_gqa
    )
    return out


def decode_step_top_left(*args: Any, **kwargs: Any) -> Tensor:
    """`causal_bottom_right`, except that a single query is aligned top-left (it sees
    key 0 only): a decode step that takes the prefill's other convention."""
    query, key = args[0], args[1]
    if query.shape[-2] == 1 and kwargs.get("is_causal"):
        seen = torch.zeros(1, key.shape[-2], dtype=torch.bool)
        seen[0, 0] = True
        out: Tensor = torch.nn.functional.scaled_dot_product_attention(
            query, key, args[2], seen, scale=kwargs.get("scale"), enable_gqa=True
        )
        return out
    return causal_bottom_right(*args, **kwargs)


_BOTTOM_RIGHT_ONLY = Capabilities(
    bool_mask=False, float_mask=False, causal_only=True, causal_alignments=("bottom_right",)
)
causal_bottom_right.capabilities = _BOTTOM_RIGHT_ONLY  # type: ignore[attr-defined]
decode_step_top_left.capabilities = _BOTTOM_RIGHT_ONLY  # type: ignore[attr-defined]


def always_sinks(*args: Any, sinks: Tensor | None = None, **kwargs: Any) -> Tensor:
    """attnref's reference with sink logits, as GPT-OSS's attention always has them: it
    raises on a call without."""
    from attnref.functional import scaled_dot_product_attention

    if sinks is None:
        raise ValueError("sinks are required")
    out: Tensor = scaled_dot_product_attention(*args, sinks=sinks, **kwargs)
    return out


always_sinks.capabilities = Capabilities(  # type: ignore[attr-defined]
    sinks=True, sinks_required=True, causal_with_mask=True
)


def sink_in_the_softmax(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: Tensor | None = None,
) -> Tensor:
    """GPT-OSS's eager attention in plain torch: the sink logit joins each row's
    softmax as one more column, dropped after it; a row that sees no key is then 0, or,
    with a sink of -inf, a softmax of -inf (NaN). Sinks on every call."""
    if sinks is None or is_causal:
        raise ValueError("sinks on every call, causality as a mask")
    h = query.shape[-3]
    kk, vv = (t.repeat_interleave(h // t.shape[-3], dim=-3) for t in (key, value))
    s = (query.shape[-1] ** -0.5 if query.shape[-1] else 1.0) if scale is None else scale
    scores = (query @ kk.transpose(-2, -1)) * s
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask
    sink = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs.to(value.dtype) @ vv


sink_in_the_softmax.capabilities = Capabilities(  # type: ignore[attr-defined]
    sinks=True, sinks_required=True, causal_alignments=(), gradients=False
)
