"""The attention modules and positional encodings: D2L's worked examples and bad input."""

from typing import Any

import pytest
import torch

from attnref.layers import (
    AdditiveAttention,
    DotProductAttention,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    NadarayaWatson,
    SinusoidalPositionalEncoding,
    sinusoidal_encoding,
)

# D2L 11.3: keys all equal, so every visible key gets the same weight and the output is
# the mean of the first valid_len values: rows 0-1 -> [2, 3, 4, 5], rows 0-5 -> [10 .. 13]
VALUES = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
VALID_LENS = torch.tensor([2, 6])
EXPECTED = torch.tensor([[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]])


def test_d2l_additive_attention_example() -> None:
    queries, keys = torch.normal(0, 1, (2, 1, 20)), torch.ones((2, 10, 2))
    attention = AdditiveAttention(query_size=20, key_size=2, num_hiddens=8, dropout=0.1).eval()
    out = attention(queries, keys, VALUES, VALID_LENS)
    assert out.shape == (2, 1, 4)
    torch.testing.assert_close(out, EXPECTED)
    assert attention.attention_weights is not None
    assert attention.attention_weights.shape == (2, 1, 10)


def test_d2l_dot_product_attention_example() -> None:
    queries, keys = torch.normal(0, 1, (2, 1, 2)), torch.ones((2, 10, 2))
    attention = DotProductAttention(dropout=0.5).eval()
    torch.testing.assert_close(attention(queries, keys, VALUES, VALID_LENS), EXPECTED)


def test_d2l_multihead_attention_example() -> None:
    attention = MultiHeadAttention(num_hiddens=100, num_heads=5, dropout=0.5).eval()
    X, Y = torch.ones((2, 4, 100)), torch.ones((2, 6, 100))
    assert attention(X, Y, Y, valid_lens=torch.tensor([3, 2])).shape == (2, 4, 100)
    assert attention.attention_weights is not None
    assert attention.attention_weights.shape == (2, 5, 4, 6)
    assert (attention.attention_weights[1, :, :, 2:] == 0).all()


def test_mha_mask_forms_agree_with_valid_lens() -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_hiddens=12, num_heads=3, num_kv_heads=1).eval()
    X = torch.randn(2, 5, 12)
    lens = torch.tensor([5, 3])
    pad = (torch.arange(5) < lens.unsqueeze(-1)).unsqueeze(1)  # (B, 1, Tk)
    by_lens = mha(X, X, X, valid_lens=lens)
    torch.testing.assert_close(mha(X, X, X, pad), by_lens)
    torch.testing.assert_close(mha(X, X, X, pad.expand(2, 5, 5)), by_lens)
    causal = torch.ones(1, 5, 5, dtype=torch.bool).tril()
    both = mha(X, X, X, causal, valid_lens=lens)
    torch.testing.assert_close(both, mha(X, X, X, causal & pad))


def test_mha_dropout_only_in_training() -> None:
    mha = MultiHeadAttention(num_hiddens=8, num_heads=2, dropout=0.5)
    X = torch.randn(1, 6, 8)
    mha.eval()
    assert torch.equal(mha(X, X, X), mha(X, X, X))
    mha.train()
    torch.manual_seed(1)
    a = mha(X, X, X)
    torch.manual_seed(2)
    assert not torch.allclose(a, mha(X, X, X))


def test_nadaraya_watson_module_learns_w() -> None:
    torch.manual_seed(0)
    x_train = torch.sort(torch.rand(50) * 5).values
    y_train = 2 * torch.sin(x_train) + x_train**0.8 + torch.normal(0.0, 0.5, (50,))
    # leave-one-out keys and values, as in D2L
    keep = ~torch.eye(50, dtype=torch.bool)
    keys, values = (
        x_train.expand(50, 50)[keep].view(50, 49),
        y_train.expand(50, 50)[keep].view(50, 49),
    )
    model = NadarayaWatson(w=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = ((model(x_train.unsqueeze(-1), keys, values).squeeze(-1) - y_train) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"num_hiddens": 10, "num_heads": 4},
            r"num_hiddens \(10\) must be divisible by num_heads \(4\)",
        ),
        (
            {"num_hiddens": 12, "num_heads": 6, "num_kv_heads": 4},
            r"num_heads \(6\) must be divisible by num_kv_heads \(4\)",
        ),
        ({"num_hiddens": 12, "num_heads": 0}, r"must be divisible by num_heads \(0\)"),
        (
            {"num_hiddens": 12, "num_heads": 3, "dropout": 1.0},
            r"dropout must lie in \[0, 1\), got 1.0",
        ),
    ],
)
def test_mha_bad_config(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(**kwargs)


def test_mha_bad_mask_and_lens() -> None:
    mha = MultiHeadAttention(num_hiddens=8, num_heads=2)
    X = torch.randn(2, 5, 8)
    with pytest.raises(TypeError, match="parameter 'mask'"):
        mha(X, X, X, torch.ones(2, 5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"valid_lens must lie in \[0, 5\]"):
        mha(X, X, X, valid_lens=torch.tensor([6, 1]))
    with pytest.raises(TypeError, match="parameter 'queries'"):
        mha(torch.randn(2, 5, 6), X, X)


def test_sinusoidal_encoding_values_and_buffer() -> None:
    P = sinusoidal_encoding(3, 4)
    i = torch.arange(3.0)
    torch.testing.assert_close(P[:, 0], torch.sin(i))
    torch.testing.assert_close(P[:, 1], torch.cos(i))
    torch.testing.assert_close(P[:, 2], torch.sin(i / 100))
    pe = SinusoidalPositionalEncoding(num_hiddens=4, max_len=10)
    assert "P" in dict(pe.named_buffers())
    assert not list(pe.parameters())
    X = torch.zeros(1, 3, 4)
    torch.testing.assert_close(pe(X, offset=2)[0], sinusoidal_encoding(10, 4)[2:5])


def test_positions_past_max_len() -> None:
    pe = SinusoidalPositionalEncoding(num_hiddens=4, max_len=8)
    with pytest.raises(ValueError, match=r"positions 6\.\.9 lie outside \[0, 7\]"):
        pe(torch.zeros(1, 4, 4), offset=6)
    learned = LearnedPositionalEmbedding(num_hiddens=4, max_len=8)
    assert learned(torch.zeros(2, 8, 4)).shape == (2, 8, 4)
    with pytest.raises(ValueError, match="max_len is 8"):
        learned(torch.zeros(2, 9, 4))


def test_sinusoidal_needs_even_width() -> None:
    with pytest.raises(ValueError, match="positive even number, got 5"):
        SinusoidalPositionalEncoding(num_hiddens=5)
