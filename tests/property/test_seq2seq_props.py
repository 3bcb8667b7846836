"""Bahdanau attention in the GRU encoder-decoder: every step's weights are a distribution
over the real source positions, and padding cannot change the decoder (float64)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from attnref.decoding import greedy_decode_seq2seq
from attnref.layers import Seq2Seq, Seq2SeqAttentionDecoder, Seq2SeqEncoder


@st.composite
def seq2seq_configs(draw: st.DrawFn) -> tuple[Seq2Seq, torch.Tensor, torch.Tensor, int]:
    seed = draw(st.integers(0, 2**16))
    layers = draw(st.integers(1, 3))
    hiddens = draw(st.sampled_from([4, 8, 16]))
    embed = draw(st.sampled_from([3, 8]))
    B, Ts = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    lens = draw(st.lists(st.integers(1, Ts), min_size=B, max_size=B))
    torch.manual_seed(seed)
    model = Seq2Seq(
        Seq2SeqEncoder(vocab_size=7, embed_size=embed, num_hiddens=hiddens, num_layers=layers),
        Seq2SeqAttentionDecoder(
            vocab_size=9, embed_size=embed, num_hiddens=hiddens, num_layers=layers
        ),
    ).double()
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 7, (B, Ts), generator=gen)
    return model.eval(), src, torch.tensor(lens), seed


@given(seq2seq_configs(), st.integers(1, 6))
def test_bahdanau_weights_sum_to_one_and_are_zero_beyond_the_valid_length(
    config: tuple[Seq2Seq, torch.Tensor, torch.Tensor, int], T: int
) -> None:
    model, src, lens, seed = config
    tgt = torch.randint(0, 9, (src.shape[0], T), generator=torch.Generator().manual_seed(seed))
    model(src, tgt, lens)
    weights = model.decoder.attention_weights  # (B, T, Ts)
    assert weights.shape == (src.shape[0], T, src.shape[1])
    torch.testing.assert_close(weights.sum(-1), torch.ones(src.shape[0], T, dtype=weights.dtype))
    beyond = torch.arange(src.shape[1]) >= lens.unsqueeze(-1)  # (B, Ts)
    assert bool((weights.masked_select(beyond.unsqueeze(1)) == 0).all())
    assert bool((weights >= 0).all())


@given(seq2seq_configs(), st.integers(1, 6))
def test_padded_source_contents_never_change_the_decoder(
    config: tuple[Seq2Seq, torch.Tensor, torch.Tensor, int], max_len: int
) -> None:
    model, src, lens, seed = config
    tokens, weights = greedy_decode_seq2seq(model, src, lens, max_len, 1)
    noisy = src.clone()
    beyond = torch.arange(src.shape[1]) >= lens.unsqueeze(-1)
    noise = torch.randint(0, 7, src.shape, generator=torch.Generator().manual_seed(seed + 1))
    noisy[beyond] = noise[beyond]
    tokens2, weights2 = greedy_decode_seq2seq(model, noisy, lens, max_len, 1)
    assert torch.equal(tokens, tokens2)
    torch.testing.assert_close(weights, weights2, rtol=0, atol=1e-12)


@given(seq2seq_configs(), st.integers(1, 5))
def test_step_by_step_greedy_equals_teacher_forcing_on_its_own_output(
    config: tuple[Seq2Seq, torch.Tensor, torch.Tensor, int], max_len: int
) -> None:
    """The decoder's state carries everything: feeding one token at a time gives the
    logits and weights of one teacher-forced pass over the same tokens."""
    model, src, lens, _ = config
    tokens, weights = greedy_decode_seq2seq(model, src, lens, max_len + 1, 1)
    logits = model(src, tokens[:, :-1], lens)
    assert torch.equal(logits.argmax(-1), tokens[:, 1:])
    torch.testing.assert_close(model.decoder.attention_weights, weights, rtol=0, atol=1e-12)
