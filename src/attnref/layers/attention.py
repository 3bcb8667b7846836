"""Attention modules: thin ``nn.Module``s that hold parameters and call `attnref.functional`.

Where Q, K and V come from: each module takes queries, keys and values as given; in
self-attention the caller passes the same sequence three times, in cross-attention the
queries come from the decoder and keys = values from the encoder memory.
"""

from collections.abc import Callable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from attnref import functional as F
from attnref._checking import checked, checked_internal
from attnref.cache import AttentionCache
from attnref.masks import valid_lens_to_mask
from attnref.rotary import RotaryEmbedding, check_rotary_dim

__all__ = ["AdditiveAttention", "DotProductAttention", "MultiHeadAttention", "NadarayaWatson"]

ValidLens = Int[Tensor, " B"] | Int[Tensor, "B Tq"] | None


def _check_dropout(dropout: float) -> None:
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must lie in [0, 1), got {dropout}")


@checked_internal
def _check_token_ids(tokens: Int[Tensor, "*shape"], vocab_size: int) -> None:
    """Raise ``ValueError`` naming the first token id outside ``[0, vocab_size)``."""
    if not tokens.numel():
        return
    low, high = torch.aminmax(tokens)  # one pass: this runs at every decoding step
    if int(low) < 0 or int(high) >= vocab_size:
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)][0]
        raise ValueError(f"token id {int(bad)} is outside the vocabulary [0, {vocab_size})")


def dropout_layer(dropout: float) -> nn.Module:
    """``nn.Dropout(dropout)``, or ``nn.Identity()`` when ``dropout == 0``: the same
    function, one call cheaper per use (a decoding step with the cache makes dozens)."""
    _check_dropout(dropout)
    return nn.Dropout(dropout) if dropout > 0 else nn.Identity()


@checked_internal
def _lens_mask(
    valid_lens: ValidLens, num_queries: int, num_keys: int
) -> Bool[Tensor, "B Tq Tk"] | None:
    """``valid_lens`` to a ``(B, Tq, Tk)`` visibility mask, or ``None``."""
    if valid_lens is None:
        return None
    return valid_lens_to_mask(valid_lens, num_queries, num_keys)


class AdditiveAttention(nn.Module):
    """D2L's additive attention: ``softmax(w_v^T tanh(W_q q + W_k k)) V``.

    Args:
        query_size: ``Dq``, width of each query.
        key_size: ``Dk``, width of each key.
        num_hiddens: ``H``, width both are projected to.
        dropout: dropout on the attention weights.
    """

    def __init__(
        self, *, query_size: int, key_size: int, num_hiddens: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        _check_dropout(dropout)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = dropout_layer(dropout)
        self.attention_weights: Tensor | None = None  # (B, Tq, Tk) after each forward

    @checked
    def forward(
        self,
        queries: Float[Tensor, "B Tq Dq"],
        keys: Float[Tensor, "B Tk Dk"],
        values: Float[Tensor, "B Tk Dv"],
        valid_lens: ValidLens = None,
    ) -> Float[Tensor, "B Tq Dv"]:
        scores = F.additive_scores(queries, keys, self.W_q.weight, self.W_k.weight, self.w_v.weight)
        mask = _lens_mask(valid_lens, queries.shape[1], keys.shape[1])
        self.attention_weights = F.safe_softmax(scores, mask)  # (B, Tq, Tk)
        dropped: Tensor = self.dropout(self.attention_weights)
        return torch.bmm(dropped, values)


class DotProductAttention(nn.Module):
    """D2L's scaled dot-product attention, ``softmax(Q K^T / sqrt(d)) V``, with ``valid_lens``.

    Args:
        dropout: dropout on the attention weights.
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        _check_dropout(dropout)
        self.dropout = dropout
        self.attention_weights: Tensor | None = None  # (B, Tq, Tk) after each forward

    @checked
    def forward(
        self,
        queries: Float[Tensor, "B Tq Dh"],
        keys: Float[Tensor, "B Tk Dh"],
        values: Float[Tensor, "B Tk Dv"],
        valid_lens: ValidLens = None,
    ) -> Float[Tensor, "B Tq Dv"]:
        mask = _lens_mask(valid_lens, queries.shape[1], keys.shape[1])
        out, self.attention_weights = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            mask,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=True,
        )
        return out


class MultiHeadAttention(nn.Module):
    """Multi-head attention with optional grouped-query (GQA) or multi-query (MQA) heads.

    ``MultiHead(Q, K, V) = Concat(head_1 .. head_h) W_o``, ``head_i = Attention(Q W_q^i,
    K W_k^j, V W_v^j)`` with ``j = i // (h // g)``: ``g = h`` key/value heads is the
    original MHA, ``g = 1`` is MQA.

    Args:
        num_hiddens: ``H``, the model width (input and output).
        num_heads: ``h`` query heads; must divide ``H`` (head dim ``Dh = H / h``).
        num_kv_heads: ``g`` key/value heads; must divide ``h``; defaults to ``h``.
        dropout: dropout on the attention weights.
        bias: whether the four projections carry a bias.
        rotary_dim: rotate the first ``rotary_dim`` dims of each query and key head by
            its position (`attnref.rotary.RotaryEmbedding`, the halves layout of Llama);
            0: none. For self-attention: queries and keys share positions, starting at
            the cache's position.
        window: a sliding window: a query sees the ``window`` keys before it (and
            itself), none earlier (FlashAttention's ``window_size=(window, -1)``; with
            ``causal``, ``(window, 0)``). ``None``: no window.
    """

    def __init__(
        self,
        *,
        num_hiddens: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = False,
        rotary_dim: int = 0,
        window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads < 1 or num_hiddens % num_heads != 0:
            raise ValueError(
                f"num_hiddens ({num_hiddens}) must be divisible by num_heads ({num_heads})"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
            )
        _check_dropout(dropout)
        if window is not None and (not isinstance(window, int) or window < 0):
            raise ValueError(f"window must be an int >= 0 or None, got {window!r}")
        head_dim = num_hiddens // num_heads
        self.rotary = RotaryEmbedding(rotary_dim) if rotary_dim else None
        if rotary_dim:
            check_rotary_dim(rotary_dim, head_dim)
        self.window = window
        self.num_hiddens = num_hiddens
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = num_hiddens // num_heads
        self.dropout = dropout
        kv_width = num_kv_heads * self.head_dim
        self.query_proj = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        self.key_proj = nn.Linear(num_hiddens, kv_width, bias=bias)
        self.value_proj = nn.Linear(num_hiddens, kv_width, bias=bias)
        self.output_proj = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        self.attention_weights: Tensor | None = None  # (B, h, Tq, Tk) after each forward

    @checked
    def forward(
        self,
        queries: Float[Tensor, "B Tq {self.num_hiddens}"],
        keys: Float[Tensor, "B Tk {self.num_hiddens}"],
        values: Float[Tensor, "B Tk {self.num_hiddens}"],
        mask: Bool[Tensor, "#B #Tq #Tk"] | None = None,
        valid_lens: ValidLens = None,
        *,
        causal: bool = False,
        cache: AttentionCache | None = None,
    ) -> Float[Tensor, "B Tq {self.num_hiddens}"]:
        """Attend from ``queries`` to ``keys``/``values``, all of width ``H = num_hiddens``.

        Args:
            queries: the sequence asking; keys/values: the sequence asked.
            mask: ``True`` where query ``i`` may see key ``j``; ``(B, 1, Tk)`` for padding,
                ``(B, Tq, Tk)`` or ``(1, Tq, Tk)`` for causal; broadcast over heads.
            valid_lens: D2L's lengths, combined with ``mask`` when both are given.
            causal: hide the keys after each query, queries aligned with the *last* keys
                (bottom-right): what decoding new tokens against a cache needs.
            cache: for incremental decoding (`attnref.cache`): ``keys``/``values`` are
                then this step's new inputs, and the cache returns the heads of every
                position to attend to (``cache.update``). ``mask`` then applies to the
                keys the attention really sees.
        """
        offset = 0 if cache is None else cache.position  # of the first new token
        q = F.split_heads(self.query_proj(queries), self.num_heads)  # (B, h, Tq, Dh)
        project: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] = self._project_kv
        if self.rotary is not None:
            q = self.rotary(q, offset)
            project = self._rotated(offset + keys.shape[1])
        if cache is None:
            k, v = project(keys, values)
        else:
            k, v = cache.update(keys, values, project)
        lens_mask = _lens_mask(valid_lens, queries.shape[1], k.shape[2])
        if lens_mask is not None:
            mask = lens_mask if mask is None else mask & lens_mask
        attn_mask = None if mask is None else mask.unsqueeze(1)  # (B, 1, Tq, Tk)
        out, self.attention_weights = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            enable_gqa=self.num_kv_heads != self.num_heads,
            causal_alignment="bottom_right",
            return_weights=True,
            window=None if self.window is None else (self.window, -1),
        )
        merged = F.merge_heads(out)  # (B, Tq, H)
        result: Tensor = self.output_proj(merged)
        return result

    def _rotated(self, end: int) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """`_project_kv` with the keys rotated: the ``t`` inputs it is given are the
        positions ``end - t .. end - 1`` (the new tokens for a cache of keys, the whole
        history for D2L's cache of inputs)."""
        rotary = self.rotary
        assert rotary is not None

        def project(keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
            k, v = self._project_kv(keys, values)
            start = end - k.shape[2]
            if start < 0:
                raise ValueError(
                    f"rotary positions need self-attention: {k.shape[2]} keys for queries "
                    f"ending at position {end}"
                )
            return rotary(k, start), v

        return project

    def _project_kv(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Inputs ``(B, Tk, H)`` to key and value heads ``(B, g, Tk, Dh)``."""
        k = F.split_heads(self.key_proj(keys), self.num_kv_heads)
        v = F.split_heads(self.value_proj(values), self.num_kv_heads)
        return k, v


class NadarayaWatson(nn.Module):
    """Nadaraya-Watson regression with a learnable kernel parameter ``w`` (D2L 11.2).

    ``f(x) = sum_i softmax_i(-((x - x_i) w)^2 / 2) y_i``.
    """

    def __init__(self, w: float = 1.0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(float(w)))
        self.attention_weights: Tensor | None = None  # (*batch, Tq, Tk) after each forward

    @checked
    def forward(
        self,
        queries: Float[Tensor, "*batch Tq"],
        keys: Float[Tensor, "*batch Tk"],
        values: Float[Tensor, "*batch Tk"],
    ) -> Float[Tensor, "*batch Tq"]:
        predictions, self.attention_weights = F.nadaraya_watson(queries, keys, values, self.w)
        return predictions
