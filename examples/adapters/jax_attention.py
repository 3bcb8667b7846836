"""``jax.nn.dot_product_attention`` behind torch SDPA's signature.

Tested with jax 0.10 on the CPU (``implementation=None``: XLA). It takes ``(B, T, N, H)``
arrays (time before heads), ``(B, S, K, H)`` keys and values with ``N`` a multiple of
``K`` (GQA), a boolean ``mask`` (True: attend) or an additive ``bias``, both
broadcastable to ``(B, N, T, S)``, ``scale`` and ``is_causal``. Keys and values share one
shape, so ``Dv`` must equal ``Dh``. The adapter moves tensors through NumPy (bfloat16
through ``ml_dtypes``) and calls the function jitted, as a JAX model does.
"""

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnref.adapters import as_4d, declare, expand_mask, no_dropout, unflatten

#: the adapter's error for a call JAX's signature cannot express (declared as a refusal)
REFUSAL = "jax.nn.dot_product_attention needs"


def to_jax(t: Tensor) -> Any:
    """``t`` as a JAX array (bfloat16 through ``ml_dtypes``): also Keras' JAX adapter's."""
    import jax.numpy as jnp

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return jnp.asarray(t.float().numpy().astype(ml_dtypes.bfloat16))
    return jnp.asarray(t.detach().numpy())


def to_torch(a: Any, dtype: torch.dtype) -> Tensor:
    """A JAX (or NumPy) array as a torch tensor of ``dtype``."""
    return torch.from_numpy(
        np.asarray(a, dtype=np.float32 if dtype == torch.bfloat16 else None).copy()
    ).to(dtype)


@functools.cache
def _jitted(is_causal: bool, scale: float | None) -> Callable[..., Any]:
    import jax

    def fn(q: Any, k: Any, v: Any, mask: Any, bias: Any) -> Any:
        return jax.nn.dot_product_attention(
            q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal
        )

    jitted: Callable[..., Any] = jax.jit(fn)
    return jitted


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
    """``jax.jit(jax.nn.dot_product_attention)`` on the inputs moved to JAX."""
    import jax

    config: Any = jax.config  # typed where JAX is installed, Any where it is not
    config.update("jax_enable_x64", True)  # float64 stays float64
    no_dropout(dropout_p)
    if value.shape[-1] != key.shape[-1]:
        raise NotImplementedError(f"{REFUSAL} values shaped like keys (Dv = Dh)")
    # (*batch, h, T, D) -> (B, T, h, D)
    q, k, v = (to_jax(as_4d(t).transpose(1, 2).contiguous()) for t in (query, key, value))
    full = expand_mask(attn_mask, query, key)
    mask = bias = None
    if full is not None and full.dtype == torch.bool:
        mask = to_jax(full)
    elif full is not None:
        bias = to_jax(full)
    out = _jitted(is_causal, scale)(q, k, v, mask, bias)
    return unflatten(to_torch(out, query.dtype).transpose(1, 2), query, value.shape[-1])


def _declare() -> None:
    from attnref.conformance import EmptyRows

    declare(
        attention,
        dropout=False,
        gradients=False,  # JAX differentiates its own arrays, not torch's
        # the errors XLA's CPU backend raises for half-precision dot products
        refuses=(REFUSAL, "is not supported by dot_general on CPU", "Algorithm not supported"),
        # hidden logits get -0.7 * finfo.max (a row that sees nothing averages V); -inf in
        # the bias is a softmax of -inf; is_causal is top-left (jnp.tril)
        empty_row=EmptyRows(bool_mask="uniform", float_mask="nan", causal="uniform"),
    )


_declare()
