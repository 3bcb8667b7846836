"""lucidrains' local-attention behind torch SDPA's signature, with a sliding window.

Tested with local-attention 1.11.2. ``LocalAttention(window_size=w, causal=...,
look_backward=b, look_forward=f, exact_windowsize=True, autopad=True,
use_rotary_pos_emb=False)(q, k, v)`` splits the sequence into buckets of ``w`` and lets
a query see the keys of ``b`` buckets back and ``f`` ahead; with ``exact_windowsize`` a
query at ``i`` sees exactly the keys ``i - w b .. i + w f``: the window ``(w b, w f)``
(causal: ``(w b, 0)``). The adapter picks ``w``, ``b`` and ``f`` for the window asked
(``w`` the largest common divisor of its sides); without a window, buckets that reach
every key. ``autopad=True`` pads a sequence that is not a multiple of ``w``, as its
README suggests. Self-attention only: Q, K and V share one length.
"""

import math

from torch import Tensor

from attnref.adapters import as_4d, declare, no_dropout, unflatten


def _buckets(window: tuple[int, int] | None, n: int, causal: bool) -> tuple[int, int, int]:
    """``(window_size, look_backward, look_forward)`` for a window over ``n`` tokens."""
    left, right = window if window is not None else (-1, -1)
    left = n if left < 0 else left
    right = 0 if causal else (n if right < 0 else right)
    sides = [s for s in (left, right) if s > 0]
    w = math.gcd(*sides) if sides else 1
    return w, left // w, right // w


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
    """``LocalAttention(...)(q, k, v)`` with the window as exact buckets."""
    from local_attention import LocalAttention

    no_dropout(dropout_p)
    q, k, v = as_4d(query), as_4d(key), as_4d(value)
    w, back, ahead = _buckets(window, q.shape[-2], is_causal)
    attention = LocalAttention(
        window_size=w,
        causal=is_causal,
        look_backward=back,
        look_forward=ahead,
        exact_windowsize=True,
        autopad=True,
        scale=scale,
        use_rotary_pos_emb=False,
    ).eval()
    out: Tensor = attention(q, k, v)
    return unflatten(out, query, value.shape[-1])


def _declare() -> None:
    declare(
        attend,
        dropout=False,
        bool_mask=False,  # its key-padding mask is (B, T): not an SDPA mask
        float_mask=False,
        gqa=False,  # Q, K and V share their heads
        zero_head_dim=False,  # dim_head ** -0.5
        causal_alignments=("top_left", "bottom_right"),  # one length: the same diagonal
        self_attention_only=True,
        window=True,
    )


_declare()
