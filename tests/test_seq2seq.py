"""The GRU encoder-decoder with Bahdanau attention: shapes, D2L's state, bad input."""

import pytest
import torch

from attnref.decoding import greedy_decode_seq2seq
from attnref.layers import Seq2Seq, Seq2SeqAttentionDecoder, Seq2SeqEncoder


def _model(layers: int = 2) -> Seq2Seq:
    torch.manual_seed(0)
    return Seq2Seq(
        Seq2SeqEncoder(vocab_size=10, embed_size=8, num_hiddens=16, num_layers=layers),
        Seq2SeqAttentionDecoder(vocab_size=12, embed_size=8, num_hiddens=16, num_layers=layers),
    )


def test_shapes_follow_d2l() -> None:
    model = _model()
    src = torch.randint(0, 10, (4, 7))
    outputs, state = model.encoder(src)
    assert outputs.shape == (4, 7, 16)  # the top layer at every step
    assert state.shape == (2, 4, 16)  # every layer's final state
    logits = model(src, torch.randint(0, 12, (4, 5)))
    assert logits.shape == (4, 5, 12)
    assert model.decoder.attention_weights.shape == (4, 5, 7)  # one row per target step


def test_the_query_is_the_top_layers_state_and_the_gru_input_is_e_plus_h() -> None:
    model = _model()
    assert model.decoder.rnn.input_size == 8 + 16
    src = torch.randint(0, 10, (2, 5))
    state = model.encode(src)
    seen: list[torch.Tensor] = []
    handle = model.decoder.attention.register_forward_pre_hook(
        lambda _m, args: seen.append(args[0])
    )
    model.decoder(torch.tensor([[3], [4]]), state)
    handle.remove()
    assert torch.equal(seen[0], state.hidden[-1].unsqueeze(1))  # (B, 1, H)


def test_packed_final_state_is_the_state_after_the_last_real_token() -> None:
    model = _model()
    src = torch.randint(1, 10, (2, 6))
    lens = torch.tensor([6, 3])
    outputs, state = model.encoder(src, lens)
    _, alone = model.encoder(src[1:, :3])
    torch.testing.assert_close(state[:, 1:], alone)
    assert bool((outputs[1, 3:] == 0).all())


def test_greedy_returns_tokens_and_one_alignment_row_per_step() -> None:
    model = _model().eval()
    src = torch.randint(0, 10, (3, 7))
    tokens, weights = greedy_decode_seq2seq(model, src, torch.tensor([7, 4, 1]), 5, 1)
    assert tokens.shape == (3, 5)
    assert bool((tokens[:, 0] == 1).all())
    assert weights.shape == (3, 4, 7)
    only, none = greedy_decode_seq2seq(model, src, None, 1, 1)
    assert only.shape == (3, 1)
    assert none.shape == (3, 0, 7)


def test_bad_input_is_a_clear_error() -> None:
    model = _model()
    src = torch.randint(0, 10, (2, 5))
    with pytest.raises(ValueError, match=r"token id 10 is outside the vocabulary \[0, 10\)"):
        model.encoder(torch.tensor([[1, 10]]))
    with pytest.raises(ValueError, match=r"token id 12 is outside the vocabulary \[0, 12\)"):
        model(src, torch.tensor([[1, 12], [1, 2]]))
    with pytest.raises(ValueError, match=r"valid_lens must lie in \[0, 5\]"):
        model(src, torch.tensor([[1], [2]]), torch.tensor([6, 2]))
    with pytest.raises(ValueError, match="at least one token, got valid length 0"):
        model(src, torch.tensor([[1], [2]]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="state does not fit a batch of 1"):
        model.decoder(torch.tensor([[1]]), model.encode(src))
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0"):
        greedy_decode_seq2seq(model, src, None, 0, 1)
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        Seq2SeqEncoder(vocab_size=3, embed_size=2, num_hiddens=2, num_layers=0)
    with pytest.raises(ValueError, match=r"share num_hiddens and num_layers, got \(16, 2\)"):
        Seq2Seq(_model().encoder, _model(layers=1).decoder)
    with pytest.raises(RuntimeError, match="call forward first"):
        _ = _model().decoder.attention_weights
