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
from attnref.layers.transformer import (
    AddNorm,
    DecoderBlock,
    DecoderOnlyLM,
    EncoderBlock,
    EncoderDecoder,
    Generator,
    PositionWiseFFN,
    PreNormResidual,
    TokenEmbedding,
    TransformerDecoder,
    TransformerEncoder,
    make_model,
)

__all__ = [
    "AddNorm",
    "AdditiveAttention",
    "DecoderBlock",
    "DecoderOnlyLM",
    "DotProductAttention",
    "EncoderBlock",
    "EncoderDecoder",
    "Generator",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "NadarayaWatson",
    "PositionWiseFFN",
    "PreNormResidual",
    "SinusoidalPositionalEncoding",
    "TokenEmbedding",
    "TransformerDecoder",
    "TransformerEncoder",
    "make_model",
    "sinusoidal_encoding",
]
