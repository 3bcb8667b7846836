"""Thin ``nn.Module``s over `attnref.functional`."""

from attnref.layers.attention import (
    AdditiveAttention,
    DotProductAttention,
    MultiHeadAttention,
    NadarayaWatson,
)
from attnref.layers.positional import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    sinusoidal_encoding,
)

__all__ = [
    "AdditiveAttention",
    "DotProductAttention",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "NadarayaWatson",
    "SinusoidalPositionalEncoding",
    "sinusoidal_encoding",
]
