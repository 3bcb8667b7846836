"""The Transformer: D2L's blocks and the Annotated Transformer's model, on attnref's attention.

Dimension contract: token ids ``(B, T)`` -> embeddings ``(B, T, H)`` (scaled by
``sqrt(H)``, sinusoidal positions added) -> blocks ``(B, T, H)`` -> `Generator` log
probabilities ``(B, T, V)``. Masks are boolean, ``True`` = may attend: a source padding
mask is ``(B, 1, Ts)`` (`attnref.masks.padding_mask`), a target mask ``(B, T, T)``
(`attnref.masks.make_std_mask`).

Two placements of the layer norm:

- ``norm="post"`` (D2L, the original paper): ``LayerNorm(X + Dropout(sublayer(X)))``
  (`AddNorm`);
- ``norm="pre"`` (the Annotated Transformer): ``X + Dropout(sublayer(LayerNorm(X)))``
  (`PreNormResidual`), with one more `LayerNorm` after the stack.
"""

import math
from collections.abc import Callable
from typing import Literal, NamedTuple, cast

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from attnref._checking import checked
from attnref.cache import CacheMode, DecoderCache, LayerCache
from attnref.layers.attention import MultiHeadAttention, _check_token_ids, dropout_layer
from attnref.layers.positional import SinusoidalPositionalEncoding

__all__ = [
    "AddNorm",
    "DecoderBlock",
    "DecoderOnlyLM",
    "DecoderState",
    "EncoderBlock",
    "EncoderDecoder",
    "Generator",
    "Norm",
    "PositionWiseFFN",
    "PreNormResidual",
    "TokenEmbedding",
    "TransformerDecoder",
    "TransformerEncoder",
    "make_model",
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
        self.attention = MultiHeadAttention(
            num_hiddens=num_hiddens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
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
    """Token ids to ``sqrt(H) * embedding`` plus sinusoidal positions (and dropout).

    Raises (in ``forward``):
        ValueError: a token id outside ``[0, vocab_size)``.
    """

    def __init__(
        self, *, vocab_size: int, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.num_hiddens = num_hiddens
        self.embedding = nn.Embedding(vocab_size, num_hiddens)
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
        out: Tensor = self.positions(scaled, offset)
        return out


class _Stack(nn.Module):
    """Token embedding, ``num_layers`` blocks of one kind, and a final norm for pre-LN."""

    block_type: type["EncoderBlock | DecoderBlock"]

    def __init__(
        self,
        *,
        vocab_size: int,
        num_hiddens: int,
        ffn_hiddens: int,
        num_heads: int,
        num_layers: int,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        norm: Norm = "post",
        max_len: int = 1000,
    ) -> None:
        super().__init__()
        _check_norm(norm)
        self.num_hiddens = num_hiddens
        self.embed = TokenEmbedding(
            vocab_size=vocab_size, num_hiddens=num_hiddens, dropout=dropout, max_len=max_len
        )
        self.blocks = nn.ModuleList(
            self.block_type(
                num_hiddens=num_hiddens,
                ffn_hiddens=ffn_hiddens,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                dropout=dropout,
                norm=norm,
            )
            for _ in range(num_layers)
        )
        self.final_norm = nn.LayerNorm(num_hiddens) if norm == "pre" else nn.Identity()


class TransformerEncoder(_Stack):
    """Embedding (scaled, positions added) and a stack of `EncoderBlock`s.

    With ``norm="pre"`` a final `LayerNorm` follows the stack.
    """

    block_type = EncoderBlock

    @checked
    def forward(
        self,
        tokens: Int[Tensor, "B Ts"],
        src_mask: Bool[Tensor, "#B #Ts #Ts"] | None = None,
        *,
        causal: bool = False,
        cache: DecoderCache | None = None,
    ) -> Float[Tensor, "B Ts {self.num_hiddens}"]:
        """``src_mask``: ``(B, 1, Ts)`` padding mask (`attnref.masks.padding_mask`).

        ``causal`` and ``cache`` make the stack a decoder-only model's: ``tokens`` are the
        new tokens, at positions ``cache.position`` onwards.
        """
        X = self.embed(tokens, 0 if cache is None else cache.position)
        for i, block in enumerate(self.blocks):
            X = block(X, src_mask, causal=causal, cache=None if cache is None else cache.layers[i])
        out: Tensor = self.final_norm(X)
        return out

    @property
    def attention_weights(self) -> list[Tensor | None]:
        """Each block's self-attention weights ``(B, h, Ts, Ts)`` from the last forward."""
        return [cast(EncoderBlock, b).attention.attention_weights for b in self.blocks]


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


class DecoderState(NamedTuple):
    """D2L's decoder state ``[enc_outputs, enc_valid_lens, per-layer history]``."""

    memory: Tensor  # (B, Ts, H): the encoder's output
    src_mask: Tensor | None  # (B, 1, Ts): source padding
    cache: DecoderCache  # per layer: self-attention history, cross-attention K/V


class TransformerDecoder(_Stack):
    """Embedding and a stack of `DecoderBlock`s (final `LayerNorm` with ``norm="pre"``)."""

    block_type = DecoderBlock

    @checked
    def init_state(
        self,
        memory: Float[Tensor, "B Ts {self.num_hiddens}"],
        src_mask: Bool[Tensor, "#B 1 Ts"] | None,
        max_len: int,
        *,
        mode: CacheMode = "kv",
    ) -> DecoderState:
        """D2L's ``init_state``: the memory, its mask and an empty per-layer cache for up to
        ``max_len`` target tokens; then ``decoder(new_tokens, state.memory,
        state.src_mask, None, cache=state.cache)`` decodes one step at a time.

        ``mode="representation"`` is D2L's own state (each layer's input history).
        """
        like = self.embed.embedding.weight
        cache = _new_cache(self.blocks, memory.shape[0], max_len, mode, cross=True, like=like)
        return DecoderState(memory, src_mask, cache)

    @checked
    def forward(
        self,
        tokens: Int[Tensor, "B T"],
        memory: Float[Tensor, "B Ts {self.num_hiddens}"],
        src_mask: Bool[Tensor, "#B #T #Ts"] | None,
        tgt_mask: Bool[Tensor, "#B #T #T"] | None,
        *,
        cache: DecoderCache | None = None,
    ) -> Float[Tensor, "B T {self.num_hiddens}"]:
        """With ``cache``, ``tokens`` are the new tokens at positions ``cache.position``
        onwards, and ``tgt_mask`` is not used (the cache is causal by construction)."""
        X = self.embed(tokens, 0 if cache is None else cache.position)
        for i, block in enumerate(self.blocks):
            X = block(
                X, memory, src_mask, tgt_mask, cache=None if cache is None else cache.layers[i]
            )
        out: Tensor = self.final_norm(X)
        return out


class Generator(nn.Module):
    """``log_softmax(W x + b)``: hidden states ``(B, T, H)`` to log probabilities ``(B, T, V)``."""

    def __init__(self, *, num_hiddens: int, vocab_size: int) -> None:
        super().__init__()
        self.num_hiddens = num_hiddens
        self.vocab_size = vocab_size
        self.proj = nn.Linear(num_hiddens, vocab_size)

    @checked
    def forward(
        self, X: Float[Tensor, "B T {self.num_hiddens}"]
    ) -> Float[Tensor, "B T {self.vocab_size}"]:
        out: Tensor = torch.log_softmax(self.proj(X), dim=-1)
        return out


class EncoderDecoder(nn.Module):
    """The encoder-decoder Transformer: ``decode(encode(src), tgt)``; `Generator` on top."""

    def __init__(
        self, encoder: TransformerEncoder, decoder: TransformerDecoder, generator: Generator
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.generator = generator
        self.num_hiddens = encoder.num_hiddens

    @checked
    def encode(
        self, src: Int[Tensor, "B Ts"], src_mask: Bool[Tensor, "#B #Ts #Ts"] | None
    ) -> Float[Tensor, "B Ts {self.num_hiddens}"]:
        """The memory: the encoder's output for the source tokens."""
        out: Tensor = self.encoder(src, src_mask)
        return out

    @checked
    def decode(
        self,
        memory: Float[Tensor, "B Ts {self.num_hiddens}"],
        src_mask: Bool[Tensor, "#B #T #Ts"] | None,
        tgt: Int[Tensor, "B T"],
        tgt_mask: Bool[Tensor, "#B #T #T"] | None,
        *,
        cache: DecoderCache | None = None,
    ) -> Float[Tensor, "B T {self.num_hiddens}"]:
        """The decoder's hidden states for the target tokens given the memory (with
        ``cache``: for the new tokens only)."""
        out: Tensor = self.decoder(tgt, memory, src_mask, tgt_mask, cache=cache)
        return out

    def new_cache(self, batch_size: int, max_len: int, *, mode: CacheMode = "kv") -> DecoderCache:
        """An empty decoder cache for ``batch_size`` sequences of up to ``max_len`` tokens."""
        like = self.generator.proj.weight
        return _new_cache(self.decoder.blocks, batch_size, max_len, mode, cross=True, like=like)

    @checked
    def forward(
        self,
        src: Int[Tensor, "B Ts"],
        tgt: Int[Tensor, "B T"],
        src_mask: Bool[Tensor, "#B 1 Ts"] | None,
        tgt_mask: Bool[Tensor, "#B #T #T"] | None,
    ) -> Float[Tensor, "B T {self.num_hiddens}"]:
        """Hidden states ``(B, T, H)``; ``self.generator`` turns them into log probabilities."""
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)


def _new_cache(
    blocks: nn.ModuleList,
    batch_size: int,
    max_len: int,
    mode: CacheMode,
    *,
    cross: bool,
    like: Tensor,
) -> DecoderCache:
    first = blocks[0]
    attention = first.attention if isinstance(first, EncoderBlock) else first.self_attention
    assert isinstance(attention, MultiHeadAttention)
    return DecoderCache.for_stack(
        len(blocks),
        mode=mode,
        batch_size=batch_size,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        max_len=max_len,
        cross=cross,
        dtype=like.dtype,
        device=like.device,
    )


def _xavier(model: nn.Module) -> None:
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)


def make_model(
    src_vocab: int,
    tgt_vocab: int,
    *,
    num_layers: int = 6,
    num_hiddens: int = 512,
    ffn_hiddens: int = 2048,
    num_heads: int = 8,
    num_kv_heads: int | None = None,
    dropout: float = 0.1,
    norm: Norm = "post",
    max_len: int = 1000,
) -> EncoderDecoder:
    """The encoder-decoder Transformer, Xavier-initialised (the Annotated Transformer's)."""
    common = {
        "num_hiddens": num_hiddens,
        "ffn_hiddens": ffn_hiddens,
        "num_heads": num_heads,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "dropout": dropout,
        "norm": norm,
        "max_len": max_len,
    }
    model = EncoderDecoder(
        TransformerEncoder(vocab_size=src_vocab, **common),  # type: ignore[arg-type]
        TransformerDecoder(vocab_size=tgt_vocab, **common),  # type: ignore[arg-type]
        Generator(num_hiddens=num_hiddens, vocab_size=tgt_vocab),
    )
    _xavier(model)
    return model


class DecoderOnlyLM(nn.Module):
    """A GPT-style causal language model on `EncoderBlock`s with a causal mask.

    Tokens ``(B, T)`` to next-token log probabilities ``(B, T, V)``; position ``t`` sees
    tokens ``0..t`` only. ``norm="pre"`` by default, as GPT-2.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        num_hiddens: int,
        ffn_hiddens: int,
        num_heads: int,
        num_layers: int,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        norm: Norm = "pre",
        max_len: int = 1000,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.stack = TransformerEncoder(
            vocab_size=vocab_size,
            num_hiddens=num_hiddens,
            ffn_hiddens=ffn_hiddens,
            num_heads=num_heads,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
            norm=norm,
            max_len=max_len,
        )
        self.generator = Generator(num_hiddens=num_hiddens, vocab_size=vocab_size)
        _xavier(self)

    @checked
    def forward(
        self, tokens: Int[Tensor, "B T"], *, cache: DecoderCache | None = None
    ) -> Float[Tensor, "B T {self.vocab_size}"]:
        """Log probabilities of the next token after each position; with ``cache``,
        ``tokens`` are the new tokens and attend to every cached one."""
        out: Tensor = self.generator(self.stack(tokens, None, causal=True, cache=cache))
        return out

    def new_cache(self, batch_size: int, max_len: int, *, mode: CacheMode = "kv") -> DecoderCache:
        """An empty cache for ``batch_size`` sequences of up to ``max_len`` tokens."""
        like = self.generator.proj.weight
        return _new_cache(self.stack.blocks, batch_size, max_len, mode, cross=False, like=like)
