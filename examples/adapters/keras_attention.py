"""Keras 3's ``keras.ops.dot_product_attention`` behind torch SDPA's signature, on the
Keras backend the process was started with.

Tested with keras 3.15.1, on its torch backend (torch 2.13.0, CPU) and its JAX backend
(jax 0.10.2, CPU). Keras picks its backend once per process, from ``KERAS_BACKEND``, at
its first import; ``keras_torch`` and ``keras_jax`` (the two modules next to this one)
set it and then import this one, so that each audit's worker runs one backend. The
function takes ``(B, T, N, H)`` queries and ``(B, S, K, H)`` keys and values of one
shape (``N`` a multiple of ``K``: GQA), a boolean ``mask`` (True: attend) and an
additive ``bias``, both broadcastable to ``(B, N, T, S)``, ``scale`` and ``is_causal``.
The adapter passes a boolean SDPA mask as ``mask`` and a float one as ``bias``.
"""

import os
from typing import Any

import torch
from torch import Tensor

from attnref.adapters import as_4d, declare, expand_mask, no_dropout, unflatten
from examples.adapters.jax_attention import to_jax, to_torch

#: the adapter's error for a call Keras' signature cannot express (declared: a refusal)
REFUSAL = "keras.ops.dot_product_attention needs"


def _backend() -> str:
    import keras

    name: str = keras.backend.backend()
    wanted = os.environ.get("KERAS_BACKEND")
    if wanted and name != wanted:
        raise RuntimeError(
            f"Keras runs on {name!r} in this process, not {wanted!r}: it picks its backend "
            "at its first import, so audit keras_torch and keras_jax in separate runs"
        )
    return name


def _to_keras(t: Tensor, backend: str) -> Any:
    if backend == "torch":  # torch's own tensors: gradients flow through Keras' ops
        return t.contiguous()
    return to_jax(t.contiguous())


def _to_torch(a: Any, dtype: torch.dtype) -> Tensor:
    return a if isinstance(a, Tensor) else to_torch(a, dtype)


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``keras.ops.dot_product_attention`` on the inputs in Keras' layout."""
    import keras

    no_dropout(dropout_p)
    backend = _backend()
    if value.shape[-1] != key.shape[-1]:
        raise NotImplementedError(f"{REFUSAL} values shaped like keys (Dv = Dh)")
    q, k, v = (_to_keras(as_4d(t).transpose(1, 2), backend) for t in (query, key, value))
    full = expand_mask(attn_mask, query, key)
    mask = bias = None
    if full is not None and full.dtype == torch.bool:
        mask = _to_keras(full, backend)
    elif full is not None:
        bias = _to_keras(full, backend)
    out = keras.ops.dot_product_attention(
        q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal, flash_attention=False
    )
    return unflatten(_to_torch(out, query.dtype).transpose(1, 2), query, value.shape[-1])


def declared(**changes: Any) -> None:
    """Declare `attention` with ``changes`` (each backend's module calls it once)."""
    declare(
        attention,
        dropout=False,
        gradients=_backend() == "torch",  # the JAX backend's arrays are not torch's
        distinct_value_dim=False,  # "value: The value array with the same shape of key"
        refuses=(REFUSAL,),
        **changes,
    )
