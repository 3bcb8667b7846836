"""The Transformer's blocks: the position-wise FFN, the two residual placements of the
layer norm, the encoder and decoder blocks, and the token embedding.

Two placements of the layer norm:

- ``norm="post"`` (D2L, the original paper): ``LayerNorm(X + Dropout(sublayer(X)))``
  (`AddNorm`);
- ``norm="pre"`` (the Annotated Transformer): ``X + Dropout(sublayer(LayerNorm(X)))``
  (`PreNormResidual`), with one more `LayerNorm` after the stack.

Every block maps ``(B, T, H)`` to ``(B, T, H)``; with a `LayerCache` it takes only the
new positions (`attnref.cache`).
"""

import math
from collections.abc import Callable
from typing import Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from attnref._checking import checked
from attnref.cache import LayerCache
from attnref.layers.attention import MultiHeadAttention, _check_token_ids, dropout_layer
from attnref.layers.positional import SinusoidalPositionalEncoding

__all__ = [
    "AddNorm",
    "DecoderBlock",
    "EncoderBlock",
    "Norm",
    "PositionWiseFFN",
    "PreNormResidual",
    "TokenEmbedding",
]

Norm = Literal["post", "pre"]


def _check_norm(norm: str) -> None:
    if norm not in ("post", "pre"):
        raise ValueError(f"norm must be 'post' or 'pre', got {norm!r}")


class PositionWiseFFN(nn.Module):
    """``W_2 Dropout(ReLU(W_1 x))`` applied to every position alike: ``H -> F -> H``."""

    def __init__(self, *, num_hiddens: int, ffn_hiddens: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_hiddens = num_hiddens
        self.dense1 = nn.Linear(num_hiddens, ffn_hiddens)
        self.dense2 = nn.Linear(ffn_hiddens, num_hiddens)
        self.dropout = dropout_layer(dropout)

    @checked
    def forward(
        self, X: Float[Tensor, "B T {self.num_hiddens}"]
    ) -> Float[Tensor, "B T {self.num_hiddens}"]:
        out: Tensor = self.dense2(self.dropout(torch.relu(self.dense1(X))))
        return out


class AddNorm(nn.Module):
    """Post-LN residual (D2L): ``LayerNorm(X + Dropout(Y))``."""

    def __init__(self, *, num_hiddens: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_hiddens = num_hiddens
        self.dropout = dropout_layer(dropout)
        self.ln = nn.LayerNorm(num_hiddens)

    @checked
    def forward(
        self, X: Float[Tensor, "B T {self.num_hiddens}"], Y: Float[Tensor, "B T {self.num_hiddens}"]
    ) -> Float[Tensor, "B T {self.num_hiddens}"]:
        out: Tensor = self.ln(X + self.dropout(Y))
        return out


class PreNormResidual(nn.Module):
    """Pre-LN residual (the Annotated Transformer): ``X + Dropout(sublayer(LayerNorm(X)))``."""

    def __init__(self, *, num_hiddens: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_hiddens = num_hiddens
        self.dropout = dropout_layer(dropout)
        self.ln = nn.LayerNorm(num_hiddens)

    @checked
    def forward(
        self,
        X: Float[Tensor, "B T {self.num_hiddens}"],
        sublayer: Callable[[Float[Tensor, "B T H"]], Float[Tensor, "B T H"]],
    ) -> Float[Tensor, "B T {self.num_hiddens}"]:
        out: Tensor = X + self.dropout(sublayer(self.ln(X)))
        return out


class _Residuals(nn.Module):
    """The residual connections of one block: separate modules, separate parameters."""

    def __init__(self, count: int, *, num_hiddens: int, dropout: float, norm: str) -> None:
        super().__init__()
        _check_norm(norm)
        self.norm = norm
        kind = AddNorm if norm == "post" else PreNormResidual
        self.layers = nn.ModuleList(
            kind(num_hiddens=num_hiddens, dropout=dropout) for _ in range(count)
        )

    def run(self, i: int, X: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        layer = self.layers[i]
        if self.norm == "post":
            out: Tensor = layer(X, sublayer(X))
        else:
            out = layer(X, sublayer)
        return out


class EncoderBlock(nn.Module):
    """Self-attention then the FFN, each inside a residual connection.

    Args:
        num_hiddens: ``H``.
        ffn_hiddens: the FFN's inner width.
        num_heads: ``h``; must divide ``H``.
        num_kv_heads: ``g`` (GQA); must divide ``h``; defaults to ``h``.
        dropout: on attention weights and residual branches.
        norm: ``"post"`` (`AddNorm`) or ``"pre"`` (`PreNormResidual`).
        rotary_dim: the self-attention's rotary dims (`MultiHeadAttention`; 0: none).
        window: its sliding window (`MultiHeadAttention`; None: none).
    """

    def __init__(
        self,
        *,
        num_hiddens: int,
        ffn_hiddens: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        norm: Norm = "post",
        rotary_dim: int = 0,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_hiddens = num_hiddens
        self.attention = MultiHeadAttention(
            num_hiddens=num_hiddens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
            rotary_dim=rotary_dim,
            window=window,
        )
        self.ffn = PositionWiseFFN(
            num_hiddens=num_hiddens, ffn_hiddens=ffn_hiddens, dropout=dropout
        )
        self.residuals = _Residuals(2, num_hiddens=num_hiddens, dropout=dropout, norm=norm)

    @checked
    def forward(
        self,
        X: Float[Tensor, "B T {self.num_hiddens}"],
        mask: Bool[Tensor, "#B #T #T"] | None = None,
        *,
        causal: bool = False,
        cache: LayerCache | None = None,
    ) -> Float[Tensor, "B T {self.num_hiddens}"]:
        """``mask``: which positions each position may attend to (padding, or causal);
        ``causal``: hide later positions; ``cache``: this layer's cache (then ``X`` holds
        only the new positions, and ``causal`` aligns them last)."""
        self_cache = None if cache is None else cache.self_attention
        Y = self.residuals.run(
            0, X, lambda x: self.attention(x, x, x, mask, causal=causal, cache=self_cache)
        )
        return self.residuals.run(1, Y, self.ffn)


class TokenEmbedding(nn.Module):
    """Token ids to ``sqrt(H) * embedding`` plus sinusoidal positions (and dropout);
    ``positional=False``: no positions (a model with rotary ones).

    Raises (in ``forward``):
        ValueError: a token id outside ``[0, vocab_size)``.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        num_hiddens: int,
        dropout: float = 0.0,
        max_len: int = 1000,
        positional: bool = True,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.num_hiddens = num_hiddens
        self.embedding = nn.Embedding(vocab_size, num_hiddens)
        self.positional = positional
        self.positions = SinusoidalPositionalEncoding(
            num_hiddens=num_hiddens, dropout=dropout, max_len=max_len
        )

    @checked
    def forward(
        self, tokens: Int[Tensor, "B T"], offset: int = 0
    ) -> Float[Tensor, "B T {self.num_hiddens}"]:
        """``offset``: the position of the first token (for one step of decoding)."""
        _check_token_ids(tokens, self.vocab_size)
        scaled = self.embedding(tokens) * math.sqrt(self.num_hiddens)
        if not self.positional:  # positions come from the attention (rotary)
            dropped: Tensor = self.positions.dropout(scaled)
            return dropped
        out: Tensor = self.positions(scaled, offset)
        return out


class DecoderBlock(nn.Module):
    """Masked self-attention, cross-attention over the encoder memory, then the FFN.

    Queries of the self-attention come from the target, keys and values from the target
    (masked causally); the cross-attention's queries come from the target and its keys
    and values from the encoder's output (the memory), masked by source padding.
    """

    def __init__(
        self,
        *,
        num_hiddens: int,
        ffn_hiddens: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        norm: Norm = "post",
    ) -> None:
        super().__init__()
        self.num_hiddens = num_hiddens

        def mha() -> MultiHeadAttention:
            return MultiHeadAttention(
                num_hiddens=num_hiddens,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                dropout=dropout,
            )

        self.self_attention = mha()
        self.cross_attention = mha()
        self.ffn = PositionWiseFFN(
            num_hiddens=num_hiddens, ffn_hiddens=ffn_hiddens, dropout=dropout
        )
        self.residuals = _Residuals(3, num_hiddens=num_hiddens, dropout=dropout, norm=norm)

    @checked
    def forward(
        self,
        X: Float[Tensor, "B T {self.num_hiddens}"],
        memory: Float[Tensor, "B Ts {self.num_hiddens}"],
        src_mask: Bool[Tensor, "#B #T #Ts"] | None,
        tgt_mask: Bool[Tensor, "#B #T #T"] | None,
        *,
        cache: LayerCache | None = None,
    ) -> Float[Tensor, "B T {self.num_hiddens}"]:
        """With ``cache``, ``X`` holds only the new target positions: the self-attention
        sees every cached position up to each one (``tgt_mask`` is not used), the
        cross-attention reuses the memory's projected keys and values."""
        self_cache = None if cache is None else cache.self_attention
        cross_cache = None if cache is None else cache.cross_attention
        self_mask = tgt_mask if cache is None else None
        Y = self.residuals.run(
            0,
            X,
            lambda x: self.self_attention(
                x, x, x, self_mask, causal=cache is not None, cache=self_cache
            ),
        )
        Z = self.residuals.run(
            1, Y, lambda y: self.cross_attention(y, memory, memory, src_mask, cache=cross_cache)
        )
        return self.residuals.run(2, Z, self.ffn)
