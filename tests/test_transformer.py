"""The Transformer stacks: shapes, the two norm placements, parameters, clear errors."""

from typing import cast

import pytest
import torch

from attnref.layers.transformer import (
    AddNorm,
    DecoderBlock,
    DecoderOnlyLM,
    EncoderBlock,
    PreNormResidual,
    TokenEmbedding,
    make_model,
)
from attnref.masks import make_std_mask, padding_mask


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_shapes_from_tokens_to_log_probabilities(norm: str, kv_heads: int | None) -> None:
    model = make_model(
        13, 11, num_layers=2, num_hiddens=32, ffn_hiddens=64, num_heads=4,
        num_kv_heads=kv_heads, norm=norm,  # type: ignore[arg-type]
    )  # fmt: skip
    src = torch.randint(1, 13, (3, 7))
    tgt = torch.randint(1, 11, (3, 5))
    hidden = model(src, tgt, padding_mask(src, 0), make_std_mask(tgt, 0))
    assert hidden.shape == (3, 5, 32)
    log_probs = model.generator(hidden)
    assert log_probs.shape == (3, 5, 11)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(3, 5))
    lm = DecoderOnlyLM(vocab_size=11, num_hiddens=32, ffn_hiddens=64, num_heads=4,
                       num_layers=2, num_kv_heads=kv_heads)  # fmt: skip
    assert lm(tgt).shape == (3, 5, 11)


def test_post_and_pre_norm_residuals() -> None:
    post = EncoderBlock(num_hiddens=8, ffn_hiddens=16, num_heads=2, norm="post")
    pre = EncoderBlock(num_hiddens=8, ffn_hiddens=16, num_heads=2, norm="pre")
    assert all(isinstance(m, AddNorm) for m in post.residuals.layers)
    assert all(isinstance(m, PreNormResidual) for m in pre.residuals.layers)
    # the two residual connections of a block are separate modules with their own weights
    a, b = (cast(AddNorm, m) for m in post.residuals.layers)
    assert a is not b
    assert a.ln.weight.data_ptr() != b.ln.weight.data_ptr()
    dec = DecoderBlock(num_hiddens=8, ffn_hiddens=16, num_heads=2)
    assert len({id(m) for m in dec.residuals.layers}) == 3
    # post-LN output is layer-normalised; pre-LN output is the residual stream
    X = torch.randn(2, 5, 8)
    out = post(X)
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)
    assert not torch.allclose(pre(X).mean(-1), torch.zeros(2, 5), atol=1e-3)


def test_pre_norm_stacks_end_with_a_layer_norm() -> None:
    pre = make_model(5, 5, num_layers=1, num_hiddens=8, ffn_hiddens=8, num_heads=2, norm="pre")
    post = make_model(5, 5, num_layers=1, num_hiddens=8, ffn_hiddens=8, num_heads=2)
    assert isinstance(pre.encoder.final_norm, torch.nn.LayerNorm)
    assert isinstance(pre.decoder.final_norm, torch.nn.LayerNorm)
    assert isinstance(post.encoder.final_norm, torch.nn.Identity)


def test_make_model_is_xavier_initialised() -> None:
    torch.manual_seed(0)
    model = make_model(50, 60, num_layers=1, num_hiddens=16, ffn_hiddens=32, num_heads=2)
    for name, p in model.named_parameters():
        if p.dim() > 1:
            fan_out, fan_in = p.shape[0], p.shape[1]
            bound = (6 / (fan_in + fan_out)) ** 0.5
            assert float(p.detach().abs().max()) <= bound + 1e-6, name


def test_embedding_is_scaled_by_sqrt_h_before_positions() -> None:
    emb = TokenEmbedding(vocab_size=7, num_hiddens=16)
    tokens = torch.tensor([[3, 1, 4]])
    expected = emb.embedding(tokens) * 4.0 + emb.positions.P[:, :3]
    torch.testing.assert_close(emb(tokens), expected)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: make_model(5, 5, num_heads=3, num_hiddens=8, num_layers=1),
         r"num_hiddens \(8\) must be divisible by num_heads \(3\)"),
        (lambda: make_model(5, 5, num_heads=4, num_kv_heads=3, num_hiddens=8, num_layers=1),
         r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
        (lambda: make_model(5, 5, norm="middle", num_hiddens=8, num_heads=2, num_layers=1),  # type: ignore[arg-type]
         "norm must be 'post' or 'pre', got 'middle'"),
    ],
)  # fmt: skip
def test_bad_configurations_are_clear_errors(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_token_ids_outside_the_vocabulary_are_named() -> None:
    lm = DecoderOnlyLM(vocab_size=5, num_hiddens=8, ffn_hiddens=8, num_heads=2, num_layers=1)
    with pytest.raises(ValueError, match=r"token id 7 is outside the vocabulary \[0, 5\)"):
        lm(torch.tensor([[1, 7, 2]]))
    with pytest.raises(ValueError, match="token id -1"):
        lm(torch.tensor([[-1]]))


def test_a_mask_that_does_not_fit_the_sequence_names_the_argument() -> None:
    model = make_model(7, 7, num_layers=1, num_hiddens=8, ffn_hiddens=8, num_heads=2)
    src = torch.randint(0, 7, (2, 5))
    with pytest.raises(TypeError, match="src_mask") as info:
        model.encode(src, torch.ones(2, 1, 4, dtype=torch.bool))
    assert "Ts=5" in str(info.value)
    memory = model.encode(src, None)
    with pytest.raises(TypeError, match="tgt_mask"):
        model.decode(
            memory, None, torch.randint(0, 7, (2, 3)), torch.ones(1, 4, 4, dtype=torch.bool)
        )


def test_d2l_init_state_decodes_step_by_step_like_the_full_pass() -> None:
    torch.manual_seed(0)
    model = make_model(9, 9, num_layers=2, num_hiddens=8, ffn_hiddens=16, num_heads=2).eval()
    src = torch.randint(1, 9, (2, 5))
    tgt = torch.randint(1, 9, (2, 4))
    src_mask = padding_mask(src, 0)
    memory = model.encode(src, src_mask)
    full = model.decode(memory, src_mask, tgt, make_std_mask(tgt, 0))
    for mode in ("kv", "representation"):
        state = model.decoder.init_state(memory, src_mask, 4, mode=mode)
        steps = [
            model.decoder(tgt[:, t : t + 1], state.memory, state.src_mask, None, cache=state.cache)
            for t in range(4)
        ]
        torch.testing.assert_close(torch.cat(steps, dim=1), full)
