"""torchtune's ``MultiHeadAttention`` behind torch SDPA's signature.

Tested with torchtune 0.6.1 (and torchao 0.11.0, which it imports; torchao 0.18.0 breaks
that import). The module takes hidden states ``x`` (queries) and ``y`` (keys and
values) and projects them; here the projections only select: ``q_proj`` is the
identity on ``x = Q``, and ``k_proj`` and ``v_proj`` take the two halves of ``y = [K, V]``,
so the module's attention sees exactly the audit's Q, K and V. Its output projection is
the identity. The module expands KV heads itself (GQA), scales by ``1 / sqrt(head_dim)``
(no explicit scale) and takes one boolean mask ``(B, Tq, Tk)`` for every head.

- `mha`: ``forward(x, y, mask=...)`` without a cache: ``mask=None`` with ``is_causal``
  is causal (top-left, torch's SDPA underneath);
- `mha_cached`: after ``setup_cache(B, dtype, max_seq_len=T + 3)``, the prefill of a
  sequence through the cache, as generation does, ``mask=None``: the docstring says
  "If no mask is specified, a causal mask is used by default".
"""

from typing import Any

import torch
from torch import Tensor, nn

from attnref.adapters import as_4d, declare, expand_mask, no_dropout, unflatten

#: cache slots beyond the sequence in `mha_cached` (a cache with room to spare)
SPARE = 3


class _Take(nn.Module):
    """The columns ``start:stop`` of its input: a projection that selects."""

    def __init__(self, start: int, stop: int) -> None:
        super().__init__()
        self.start, self.stop = start, stop

    def forward(self, y: Tensor) -> Tensor:
        return y[..., self.start : self.stop]


def _module(h: int, g: int, d: int, is_causal: bool, max_seq_len: int) -> nn.Module:
    from torchtune.modules import MultiHeadAttention

    module: nn.Module = MultiHeadAttention(
        embed_dim=h * d,
        num_heads=h,
        num_kv_heads=g,
        head_dim=d,
        q_proj=nn.Identity(),
        k_proj=_Take(0, g * d),
        v_proj=_Take(g * d, 2 * g * d),
        output_proj=nn.Identity(),
        max_seq_len=max_seq_len,
        is_causal=is_causal,
    ).eval()
    return module


def _inputs(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """``x = Q`` and ``y = [K, V]`` as ``(B, T, heads * D)`` hidden states."""
    q, k, v = as_4d(query), as_4d(key), as_4d(value)
    x = q.transpose(1, 2).flatten(2)
    y = torch.cat([k.transpose(1, 2).flatten(2), v.transpose(1, 2).flatten(2)], dim=-1)
    return x, y


def _output(out: Tensor, query: Tensor, value: Tensor) -> Tensor:
    B, h, Tq = as_4d(query).shape[:3]
    return unflatten(out.reshape(B, Tq, h, -1).transpose(1, 2), query, value.shape[-1])


def mha(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``MultiHeadAttention(is_causal=is_causal)(x, y, mask=...)``, no cache."""
    no_dropout(dropout_p)
    mask = expand_mask(attn_mask, query, key)
    if mask is not None:
        if mask.shape[1] != 1:
            raise NotImplementedError("torchtune takes one mask for every head")
        mask = mask[:, 0]
    h, g, d = query.shape[-3], key.shape[-3], query.shape[-1]
    module = _module(h, g, d, is_causal, max(query.shape[-2], key.shape[-2], 1))
    x, y = _inputs(query, key, value)
    out: Tensor = module(x, y, mask=mask)
    return _output(out, query, value)


def mha_cached(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """The causal prefill through a KV cache with room to spare: ``setup_cache``, then
    ``forward(x, y, input_pos=arange(T))`` with no mask."""
    no_dropout(dropout_p)
    if attn_mask is not None or not is_causal or query.shape[-2] != key.shape[-2]:
        raise NotImplementedError("the cached adapter is the causal prefill of a sequence")
    h, g, d, T = query.shape[-3], key.shape[-3], query.shape[-1], query.shape[-2]
    module = _module(h, g, d, True, T + SPARE)
    x, y = _inputs(query, key, value)
    module.setup_cache(x.shape[0], x.dtype, max_seq_len=T + SPARE)  # type: ignore[operator]
    with torch.no_grad():
        out: Tensor = module(x, y, input_pos=torch.arange(T).expand(x.shape[0], T))
    return _output(out, query, value)


def _declare() -> None:
    common: dict[str, Any] = {"dropout": False, "float_mask": False, "explicit_scale": False}
    # one head_dim for K, Q and V (the module views V with it)
    # is_causal applies without a mask only ("If no mask is specified, a causal mask is
    # used by default"): a mask carries the diagonal
    declare(
        mha,
        distinct_value_dim=False,
        causal_with_mask=False,
        refuses=("one mask for every head",),
        **common,
    )
    declare(
        mha_cached,
        bool_mask=False,
        distinct_value_dim=False,
        self_attention_only=True,
        causal_only=True,
        gradients=False,  # inference: the cache is filled under no_grad
        **common,
    )


_declare()
