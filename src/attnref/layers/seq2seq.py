"""D2L's RNN encoder-decoder with Bahdanau attention (D2L 11.4), batch-first.

Dimension contract (``E`` embedding width, ``H`` hidden width, ``L`` GRU layers):

- `Seq2SeqEncoder`: source ids ``(B, Ts)`` -> outputs ``(B, Ts, H)`` (the top layer at
  every step) and the final state ``(L, B, H)``.
- `Seq2SeqAttentionDecoder`: at each target step the query is the top layer's hidden
  state ``(B, 1, H)``; keys = values = the encoder outputs ``(B, Ts, H)``, masked beyond
  each source's valid length; the context ``(B, 1, H)`` is concatenated with the token's
  embedding into the GRU input ``(B, 1, E + H)``. Each step's weights ``(B, 1, Ts)`` are
  kept: `Seq2SeqAttentionDecoder.attention_weights` stacks them to ``(B, T, Ts)``.

One departure from D2L, for correctness: given ``valid_lens`` the encoder packs the
sequences, so its final state (the decoder's initial state) is the state after each
source's last real token, not after its padding. Then nothing in a padded source
position can change the decoder's output, the same guarantee the Transformer gives.
"""

from typing import NamedTuple

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from attnref._checking import checked
from attnref.layers.attention import AdditiveAttention, _check_dropout, _check_token_ids
from attnref.masks import check_valid_lens

__all__ = ["BahdanauState", "Seq2Seq", "Seq2SeqAttentionDecoder", "Seq2SeqEncoder"]


class _EmbeddedGRU(nn.Module):
    """What the encoder and decoder share: the sizes, an ``embedding`` and a batch-first
    ``rnn`` (GRU) reading ``input_size`` features per step.

    Raises:
        ValueError: a size below 1, or ``dropout`` outside ``[0, 1)``.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_size: int,
        num_hiddens: int,
        num_layers: int,
        dropout: float,
        input_size: int,
    ) -> None:
        super().__init__()
        sizes = {
            "vocab_size": vocab_size,
            "embed_size": embed_size,
            "num_hiddens": num_hiddens,
            "num_layers": num_layers,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        _check_dropout(dropout)
        self.vocab_size = vocab_size
        self.num_hiddens = num_hiddens
        self.num_layers = num_layers
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.rnn = nn.GRU(
            input_size,
            num_hiddens,
            num_layers,
            dropout=dropout if num_layers > 1 else 0.0,  # GRU dropout acts between layers
            batch_first=True,
        )


class Seq2SeqEncoder(_EmbeddedGRU):
    """Embedding and a multi-layer GRU over the source.

    Args:
        vocab_size: source vocabulary.
        embed_size: ``E``.
        num_hiddens: ``H``.
        num_layers: ``L``.
        dropout: between GRU layers.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        embed_size: int,
        num_hiddens: int,
        num_layers: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(vocab_size, embed_size, num_hiddens, num_layers, dropout, embed_size)

    @checked
    def forward(
        self, src: Int[Tensor, "B Ts"], valid_lens: Int[Tensor, " B"] | None = None
    ) -> tuple[
        Float[Tensor, "B Ts {self.num_hiddens}"],
        Float[Tensor, "{self.num_layers} B {self.num_hiddens}"],
    ]:
        """Outputs at every step and the final state; with ``valid_lens`` the final state
        is taken after each sequence's last real token and padded outputs are zero.

        Raises:
            ValueError: a token id outside the vocabulary, or a valid length outside
                ``[1, Ts]``.
        """
        _check_token_ids(src, self.vocab_size)
        embs = self.embedding(src)  # (B, Ts, E)
        if valid_lens is None:
            outputs, state = self.rnn(embs)
            return outputs, state
        check_valid_lens(valid_lens, src.shape[1])
        if src.shape[0] and int(valid_lens.min()) < 1:
            raise ValueError(
                f"every source needs at least one token, got valid length {int(valid_lens.min())}"
            )
        packed = pack_padded_sequence(
            embs, valid_lens.cpu(), batch_first=True, enforce_sorted=False
        )
        packed_out, state = self.rnn(packed)
        outputs, _ = pad_packed_sequence(packed_out, batch_first=True, total_length=src.shape[1])
        return outputs, state


class BahdanauState(NamedTuple):
    """The decoder's state (D2L's ``[enc_outputs, hidden_state, enc_valid_lens]``)."""

    memory: Tensor  # (B, Ts, H): the encoder outputs, keys = values of the attention
    hidden: Tensor  # (L, B, H): the GRU state; its top layer is the next query
    valid_lens: Tensor | None  # (B,): how many source positions each query may see


class Seq2SeqAttentionDecoder(_EmbeddedGRU):
    """D2L's Bahdanau decoder: additive attention from the GRU's top state to the source.

    Args:
        vocab_size: target vocabulary ``V``.
        embed_size: ``E``.
        num_hiddens: ``H`` (the encoder's width too).
        num_layers: ``L`` (the encoder's too: its final state starts the decoder).
        dropout: on the attention weights and between GRU layers.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        embed_size: int,
        num_hiddens: int,
        num_layers: int,
        dropout: float = 0.0,
    ) -> None:
        # the GRU reads the token's embedding and the context: E + H wide
        gru_input = embed_size + num_hiddens
        super().__init__(vocab_size, embed_size, num_hiddens, num_layers, dropout, gru_input)
        self.attention = AdditiveAttention(
            query_size=num_hiddens, key_size=num_hiddens, num_hiddens=num_hiddens, dropout=dropout
        )
        self.dense = nn.Linear(num_hiddens, vocab_size)
        self._step_weights: list[Tensor] = []

    @checked
    def init_state(
        self,
        outputs: Float[Tensor, "B Ts {self.num_hiddens}"],
        state: Float[Tensor, "{self.num_layers} B {self.num_hiddens}"],
        valid_lens: Int[Tensor, " B"] | None = None,
    ) -> BahdanauState:
        """D2L's ``init_state``: the encoder's outputs and final state, and ``valid_lens``."""
        return BahdanauState(outputs, state, valid_lens)

    @property
    def attention_weights(self) -> Tensor:
        """The last forward's weights, one row per target step: ``(B, T, Ts)``."""
        if not self._step_weights:
            raise RuntimeError("no attention weights yet: call forward first")
        return torch.cat(self._step_weights, dim=1)

    @checked
    def forward(
        self, tgt: Int[Tensor, "B T"], state: BahdanauState
    ) -> tuple[Float[Tensor, "B T {self.vocab_size}"], BahdanauState]:
        """Logits for every target step (teacher forcing: ``tgt`` is the decoder input)
        and the state after the last step.

        Raises:
            ValueError: a token id outside the vocabulary, or a state whose batch or
                width does not fit.
        """
        _check_token_ids(tgt, self.vocab_size)
        memory, hidden, valid_lens = state
        B = tgt.shape[0]
        if memory.shape[0] != B or hidden.shape != (self.num_layers, B, self.num_hiddens):
            raise ValueError(
                f"state does not fit a batch of {B}: memory {tuple(memory.shape)}, hidden "
                f"{tuple(hidden.shape)} (expected ({self.num_layers}, {B}, {self.num_hiddens}))"
            )
        embs = self.embedding(tgt)  # (B, T, E)
        outputs: list[Tensor] = []
        self._step_weights = []
        for t in range(tgt.shape[1]):
            query = hidden[-1].unsqueeze(1)  # (B, 1, H): the top layer's state
            context = self.attention(query, memory, memory, valid_lens)  # (B, 1, H)
            x = torch.cat([embs[:, t : t + 1], context], dim=-1)  # (B, 1, E + H)
            out, hidden = self.rnn(x, hidden)  # (B, 1, H), (L, B, H)
            outputs.append(out)
            weights = self.attention.attention_weights
            assert weights is not None
            self._step_weights.append(weights)  # (B, 1, Ts)
        stacked = torch.cat(outputs, dim=1) if outputs else embs.new_zeros(B, 0, self.num_hiddens)
        logits: Tensor = self.dense(stacked)
        return logits, BahdanauState(memory, hidden, valid_lens)


class Seq2Seq(nn.Module):
    """The RNN encoder-decoder: ``decoder(tgt, init_state(*encoder(src, valid_lens)))``."""

    def __init__(self, encoder: Seq2SeqEncoder, decoder: Seq2SeqAttentionDecoder) -> None:
        super().__init__()
        if (encoder.num_hiddens, encoder.num_layers) != (decoder.num_hiddens, decoder.num_layers):
            raise ValueError(
                "the encoder and decoder must share num_hiddens and num_layers, got "
                f"({encoder.num_hiddens}, {encoder.num_layers}) and "
                f"({decoder.num_hiddens}, {decoder.num_layers})"
            )
        self.encoder = encoder
        self.decoder = decoder
        self.vocab_size = decoder.vocab_size

    @checked
    def encode(
        self, src: Int[Tensor, "B Ts"], valid_lens: Int[Tensor, " B"] | None = None
    ) -> BahdanauState:
        """The decoder's initial state for the source ``(B, Ts)``."""
        outputs, state = self.encoder(src, valid_lens)
        return self.decoder.init_state(outputs, state, valid_lens)

    @checked
    def forward(
        self,
        src: Int[Tensor, "B Ts"],
        tgt: Int[Tensor, "B T"],
        valid_lens: Int[Tensor, " B"] | None = None,
    ) -> Float[Tensor, "B T {self.vocab_size}"]:
        """Logits for every target step under teacher forcing."""
        logits, _ = self.decoder(tgt, self.encode(src, valid_lens))
        out: Tensor = logits
        return out
