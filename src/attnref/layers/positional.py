"""Positional encodings: attention alone is blind to order, so position is added to the input.

Both modules take embeddings ``X`` of shape ``(B, T, H)`` and return ``X + P[offset :
offset + T]`` (then dropout). Following D2L and the Annotated Transformer, the caller
scales token embeddings by ``sqrt(H)`` before adding positions, so that the two terms
have comparable magnitude.
"""

import torch
from jaxtyping import Float
from torch import Tensor, nn

from attnref._checking import checked
from attnref.layers.attention import dropout_layer

__all__ = ["LearnedPositionalEmbedding", "SinusoidalPositionalEncoding", "sinusoidal_encoding"]


@checked
def sinusoidal_encoding(max_len: int, num_hiddens: int) -> Float[Tensor, "T H"]:
    """D2L's sinusoidal table ``P`` of shape ``(max_len, H)``.

    ``P[i, 2j] = sin(i / 10000^(2j/H))``, ``P[i, 2j+1] = cos(i / 10000^(2j/H))``. For each
    frequency the pair (sin, cos) rotates by a fixed angle per step, so ``P[i + d]`` is
    a fixed rotation of ``P[i]``, the same for every ``i``.

    Raises:
        ValueError: ``num_hiddens`` is odd or not positive, or ``max_len`` is negative.
    """
    if num_hiddens < 2 or num_hiddens % 2 != 0:
        raise ValueError(f"num_hiddens must be a positive even number, got {num_hiddens}")
    if max_len < 0:
        raise ValueError(f"max_len must be >= 0, got {max_len}")
    positions = torch.arange(max_len, dtype=torch.float32).unsqueeze(-1)  # (T, 1)
    freqs = torch.pow(10000, torch.arange(0, num_hiddens, 2, dtype=torch.float32) / num_hiddens)
    angles = positions / freqs  # (T, H / 2)
    P = torch.zeros(max_len, num_hiddens)
    P[:, 0::2] = torch.sin(angles)
    P[:, 1::2] = torch.cos(angles)
    return P


def _check_positions(offset: int, length: int, max_len: int) -> None:
    if offset < 0 or offset + length > max_len:
        raise ValueError(
            f"positions {offset}..{offset + length - 1} lie outside [0, {max_len - 1}]: "
            f"max_len is {max_len}"
        )


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal table (a buffer, not a parameter) to the input.

    Args:
        num_hiddens: ``H`` (even).
        dropout: dropout applied after the addition.
        max_len: the longest sequence (plus offset) it will encode.
    """

    P: Tensor

    def __init__(self, *, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000) -> None:
        super().__init__()
        self.dropout = dropout_layer(dropout)
        self.num_hiddens = num_hiddens
        self.max_len = max_len
        self.register_buffer("P", sinusoidal_encoding(max_len, num_hiddens).unsqueeze(0))

    @checked
    def forward(
        self, X: Float[Tensor, "B T {self.num_hiddens}"], offset: int = 0
    ) -> Float[Tensor, "B T {self.num_hiddens}"]:
        """``dropout(X + P[offset : offset + T])``; ``offset`` is the first position."""
        _check_positions(offset, X.shape[1], self.max_len)
        out: Tensor = self.dropout(X + self.P[:, offset : offset + X.shape[1]].to(X.dtype))
        return out


class LearnedPositionalEmbedding(nn.Module):
    """Adds a learned embedding per position (BERT, GPT-2).

    Args:
        num_hiddens: ``H``.
        max_len: number of positions it has an embedding for.
        dropout: dropout applied after the addition.
    """

    def __init__(self, *, num_hiddens: int, max_len: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_hiddens = num_hiddens
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, num_hiddens)
        self.dropout = dropout_layer(dropout)

    @checked
    def forward(
        self, X: Float[Tensor, "B T {self.num_hiddens}"], offset: int = 0
    ) -> Float[Tensor, "B T {self.num_hiddens}"]:
        """``dropout(X + E[offset : offset + T])``."""
        _check_positions(offset, X.shape[1], self.max_len)
        positions = torch.arange(offset, offset + X.shape[1], device=X.device)
        out: Tensor = self.dropout(X + self.embedding(positions).to(X.dtype))
        return out
