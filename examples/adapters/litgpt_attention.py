"""litgpt's attention behind torch SDPA's signature.

Tested with litgpt 0.5.13. `sdpa` calls ``CausalSelfAttention.scaled_dot_product_attention``
(``(B, h, T, D)`` in, ``(B, T, h, D)`` out) as ``GPT.forward`` calls it:

- without a KV cache, ``mask=None``: causal self-attention (top-left);
- with a KV cache, a boolean mask (True: attend) sliced from the model's causal mask
  cache, which is how a non-causal call and a call with ``Tq != Tk`` reach it here;
- KV heads expanded to the query heads first, as ``forward`` does (query head ``i``
  reads KV head ``i // (h / g)``);
- ``softcap`` as ``config.attention_logit_softcapping`` (the Gemma-2 configs), where
  litgpt computes the scores itself instead of calling torch's SDPA.

Its scale is ``1 / sqrt(head_size)``, or a config's ``attention_scores_scalar``: no
explicit scale.
"""

import types
from typing import Any

import torch
from torch import Tensor

from attnref.adapters import as_4d, declare, expand_mask, no_dropout, unflatten


def sdpa(
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
    """``CausalSelfAttention.scaled_dot_product_attention`` on a model of this head size."""
    from litgpt.model import CausalSelfAttention

    no_dropout(dropout_p)
    if scale is not None:
        raise NotImplementedError("litgpt's scale comes from its config")
    q, k, v = as_4d(query), as_4d(key), as_4d(value)
    if k.shape[1] != q.shape[1]:  # GPT.forward expands the KV heads first
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    mask = expand_mask(attn_mask, query, key)
    Tq, Tk = q.shape[-2], k.shape[-2]
    if mask is None and not (is_causal and Tq == Tk):
        # what the KV-cache path passes: a boolean mask (here: every key, or causal)
        mask = torch.ones(Tq, Tk, dtype=torch.bool)
        if is_causal:
            mask = mask.tril()
        mask = mask.expand(q.shape[0], 1, Tq, Tk)
    config = types.SimpleNamespace(
        attention_scores_scalar=None,
        head_size=q.shape[-1],
        attention_logit_softcapping=softcap or None,
    )
    module: Any = types.SimpleNamespace(config=config, mscale=1.0)
    out: Tensor = CausalSelfAttention.scaled_dot_product_attention(module, q, k, v, mask)
    return unflatten(out.transpose(1, 2), query, value.shape[-1])


def _declare() -> None:
    declare(
        sdpa,
        dropout=False,
        float_mask=False,  # GPT.forward passes boolean masks only
        # no is_causal: causal without a mask, the mask alone with one (the model folds
        # the diagonal into it)
        causal_with_mask=False,
        explicit_scale=False,
        softcap=True,
        zero_head_dim=False,  # 1 / sqrt(head_size)
    )


_declare()
