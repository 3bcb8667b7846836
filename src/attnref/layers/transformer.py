"""The Transformer: D2L's stacks and the Annotated Transformer's model, on attnref's attention.

Dimension contract: token ids ``(B, T)`` -> embeddings ``(B, T, H)`` (scaled by
``sqrt(H)``, sinusoidal positions added) -> blocks ``(B, T, H)`` -> `Generator` log
probabilities ``(B, T, V)``. Masks are boolean, ``True`` = may attend: a source padding
mask is ``(B, 1, Ts)`` (`attnref.masks.padding_mask`), a target mask ``(B, T, T)``
(`attnref.masks.make_std_mask`). The blocks, and the two placements of the layer norm
(``norm="post" | "pre"``), are `attnref.layers.blocks`; their names are importable from
here too.
"""

from typing import NamedTuple, cast

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from attnref._checking import checked
from attnref.cache import CacheMode, DecoderCache
from attnref.layers.attention import MultiHeadAttention
from attnref.layers.blocks import (
    AddNorm,
    DecoderBlock,
    EncoderBlock,
    Norm,
    PositionWiseFFN,
    PreNormResidual,
    TokenEmbedding,
    _check_norm,
)

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
        **attention: int | None,
    ) -> None:
        super().__init__()
        _check_norm(norm)
        self.num_hiddens = num_hiddens
        self.embed = TokenEmbedding(
            vocab_size=vocab_size,
            num_hiddens=num_hiddens,
            dropout=dropout,
            max_len=max_len,
            positional=not attention.get("rotary_dim"),  # rotary replaces the table
        )
        self.blocks = nn.ModuleList(
            self.block_type(
                num_hiddens=num_hiddens,
                ffn_hiddens=ffn_hiddens,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                dropout=dropout,
                norm=norm,
                **attention,  # type: ignore[arg-type]
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
        window=attention.window,
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

    ``rotary_dim``: rotary positions on that many dims of each head (Llama), in place of
    the sinusoidal table; ``window``: a sliding window (Mistral): position ``t`` sees
    tokens ``t - window .. t``, and the cache (`new_cache`) keeps only those
    (`attnref.cache.RollingKVCache`).
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
        rotary_dim: int = 0,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        extra: dict[str, int | None] = {}
        if rotary_dim:
            extra["rotary_dim"] = rotary_dim
        if window is not None:
            extra["window"] = window
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
            **extra,
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
