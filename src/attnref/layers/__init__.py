"""Thin ``nn.Module``s over `attnref.functional`."""

from attnref.layers.attention import (
    AdditiveAttention,
    DotProductAttention,
    MultiHeadAttention,
    NadarayaWatson,
)
from attnref.layers.latent import MultiHeadLatentAttention, mla_softmax_scale
from attnref.layers.positional import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    sinusoidal_encoding,
)
from attnref.layers.seq2seq import (
    BahdanauState,
    Seq2Seq,
    Seq2SeqAttentionDecoder,
    Seq2SeqEncoder,
)
from attnref.layers.transformer import (
    AddNorm,
    DecoderBlock,
    DecoderOnlyLM,
    DecoderState,
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
    "BahdanauState",
    "DecoderBlock",
    "DecoderOnlyLM",
    "DecoderState",
    "DotProductAttention",
    "EncoderBlock",
    "EncoderDecoder",
    "Generator",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "NadarayaWatson",
    "PositionWiseFFN",
    "PreNormResidual",
    "Seq2Seq",
    "Seq2SeqAttentionDecoder",
    "Seq2SeqEncoder",
    "SinusoidalPositionalEncoding",
    "TokenEmbedding",
    "TransformerDecoder",
    "TransformerEncoder",
    "make_model",
    "mla_softmax_scale",
    "sinusoidal_encoding",
]
