"""NATTEN's 1-D neighbourhood attention behind torch SDPA's signature.

Tested with natten 0.21.7 on the CPU (its FlexAttention backend: NATTEN's own kernels
are CUDA only). ``na1d(q, k, v, kernel_size=K, is_causal=True)`` takes ``(B, T, h, D)``
and lets the query at ``i`` see the ``K`` keys ending at ``i``: the causal window
``(K - 1, 0)``. Non-causal neighbourhoods are not sliding windows (a query near a
border sees the ``K`` nearest keys, its neighbourhood shifted inwards), so the adapter
is causal only, and every call has a window (``window_required``). A window as long as
the sequence is refused: NATTEN hands it to its attention kernels, which have no
causal CPU backend. Its FlexAttention backend takes head dims that are powers of two
from 8 to 512 (``head_dims``). Self-attention only.
"""

import torch
from torch import Tensor

from attnref.adapters import as_4d, declare, no_dropout, unflatten


def attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    causal_alignment: str = "top_left",
    window: tuple[int, int] | None = None,
) -> Tensor:
    """``na1d(q, k, v, kernel_size=left + 1, is_causal=True, scale=scale)``."""
    from natten import na1d

    no_dropout(dropout_p)
    if not is_causal or attn_mask is not None:
        raise NotImplementedError("NATTEN adapter: causal neighbourhoods only, no mask")
    T = query.shape[-2]
    left = window[0] if window is not None else -1
    kernel = T if left < 0 else min(left + 1, T)
    if kernel >= T:
        raise NotImplementedError(
            "NATTEN has no CPU backend for a causal window as long as the sequence"
        )
    if kernel < 2:
        raise NotImplementedError("NATTEN's kernel_size is at least 2")
    q, k, v = (as_4d(t).transpose(1, 2).contiguous() for t in (query, key, value))
    out: Tensor = na1d(q, k, v, kernel_size=kernel, is_causal=True, scale=scale)
    return unflatten(out.transpose(1, 2), query, value.shape[-1]).to(query.dtype)


def _declare() -> None:
    declare(
        attend,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        dropout=False,
        bool_mask=False,
        float_mask=False,
        gqa=False,
        gradients=False,  # FlexAttention has no backward on the CPU
        zero_head_dim=False,
        distinct_value_dim=False,
        causal_alignments=("top_left", "bottom_right"),
        self_attention_only=True,
        causal_only=True,
        window=True,
        window_required=True,  # neighbourhood attention: there is always a kernel
        head_dims=(8, 16, 32, 64, 128),  # its FlexAttention backend: powers of two from 8
        refuses=(
            "no CPU backend for a causal window as long as the sequence",
            "kernel_size is at least 2",
        ),
    )


_declare()
