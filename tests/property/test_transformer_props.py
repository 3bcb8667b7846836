"""Properties of the Transformer stacks over random configurations (float64, no dropout)."""

from dataclasses import dataclass
from typing import cast

import torch
from hypothesis import given
from hypothesis import strategies as st

from attnref.layers.transformer import (
    DecoderBlock,
    DecoderOnlyLM,
    EncoderBlock,
    EncoderDecoder,
    make_model,
)
from attnref.masks import make_std_mask, padding_mask

PAD = 0


@dataclass(frozen=True)
class Config:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    norm: str
    vocab: int
    seed: int
    # the decoder-only LM's rotary dims (0: sinusoidal positions) and sliding window
    rotary: int = 0
    window: int | None = None

    @property
    def hiddens(self) -> int:
        return self.heads * self.head_dim


@st.composite
def configs(draw: st.DrawFn) -> Config:
    heads = draw(st.sampled_from((1, 2, 4)))
    head_dim = draw(st.sampled_from((2, 4)))
    return Config(
        layers=draw(st.integers(1, 2)),
        heads=heads,
        kv_heads=draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0])),
        head_dim=head_dim,
        norm=draw(st.sampled_from(("post", "pre"))),
        vocab=draw(st.integers(3, 12)),
        seed=draw(st.integers(0, 2**16)),
        rotary=draw(st.sampled_from((0, 2, head_dim))),
        window=draw(st.sampled_from((None, 0, 1, 2, 4))),
    )


def _enc_dec(c: Config) -> EncoderDecoder:
    torch.manual_seed(c.seed)
    model = make_model(
        c.vocab,
        c.vocab,
        num_layers=c.layers,
        num_hiddens=c.hiddens,
        ffn_hiddens=2 * c.hiddens,
        num_heads=c.heads,
        num_kv_heads=c.kv_heads,
        dropout=0.0,
        norm=c.norm,  # type: ignore[arg-type]
    )
    return model.double().eval()


def _lm(c: Config) -> DecoderOnlyLM:
    torch.manual_seed(c.seed)
    lm = DecoderOnlyLM(
        vocab_size=c.vocab,
        num_hiddens=c.hiddens,
        ffn_hiddens=2 * c.hiddens,
        num_heads=c.heads,
        num_kv_heads=c.kv_heads,
        num_layers=c.layers,
        norm=c.norm,  # type: ignore[arg-type]
        rotary_dim=c.rotary,
        window=c.window,
    )
    return lm.double().eval()


def _tokens(gen: torch.Generator, c: Config, B: int, T: int, low: int = 1) -> torch.Tensor:
    return torch.randint(low, c.vocab, (B, T), generator=gen)


@given(configs(), st.integers(1, 7), st.integers(1, 3))
def test_encoder_block_without_positions_is_permutation_equivariant(
    c: Config, T: int, B: int
) -> None:
    torch.manual_seed(c.seed)
    block = (
        EncoderBlock(
            num_hiddens=c.hiddens,
            ffn_hiddens=2 * c.hiddens,
            num_heads=c.heads,
            num_kv_heads=c.kv_heads,
            norm=c.norm,  # type: ignore[arg-type]
        )
        .double()
        .eval()
    )
    X = torch.randn(B, T, c.hiddens, dtype=torch.float64)
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(c.seed))
    torch.testing.assert_close(block(X[:, perm]), block(X)[:, perm])


@given(configs(), st.integers(2, 8), st.data())
def test_later_target_tokens_never_change_earlier_outputs(
    c: Config, T: int, data: st.DataObject
) -> None:
    gen = torch.Generator().manual_seed(c.seed)
    t = data.draw(st.integers(1, T - 1))
    tgt = _tokens(gen, c, 2, T)
    changed = tgt.clone()
    changed[:, t:] = _tokens(gen, c, 2, T - t)
    lm = _lm(c)
    torch.testing.assert_close(lm(changed)[:, :t], lm(tgt)[:, :t])
    model = _enc_dec(c)
    src = _tokens(gen, c, 2, 5)
    src_mask = padding_mask(src, PAD)
    out = model(src, tgt, src_mask, make_std_mask(tgt, PAD))
    out_changed = model(src, changed, src_mask, make_std_mask(changed, PAD))
    torch.testing.assert_close(out_changed[:, :t], out[:, :t])


@given(configs(), st.integers(2, 8), st.integers(1, 6))
def test_padded_source_contents_never_matter(c: Config, Ts: int, T: int) -> None:
    gen = torch.Generator().manual_seed(c.seed)
    src = _tokens(gen, c, 2, Ts)
    src[0, Ts // 2 :] = PAD  # the first sample is padded
    other = src.clone()
    other[0, Ts // 2 :] = _tokens(gen, c, 1, Ts - Ts // 2)  # new contents behind the mask
    tgt = _tokens(gen, c, 2, T)
    model = _enc_dec(c)
    mask = padding_mask(src, PAD)
    out = model(src, tgt, mask, make_std_mask(tgt, PAD))
    torch.testing.assert_close(model(other, tgt, mask, make_std_mask(tgt, PAD)), out)


@given(configs(), st.integers(1, 6), st.integers(2, 4))
def test_a_batch_equals_its_samples_one_at_a_time(c: Config, T: int, B: int) -> None:
    gen = torch.Generator().manual_seed(c.seed)
    tokens = _tokens(gen, c, B, T)
    lm = _lm(c)
    whole = lm(tokens)
    for b in range(B):
        torch.testing.assert_close(lm(tokens[b : b + 1]), whole[b : b + 1])


@given(configs(), st.integers(2, 7), st.integers(2, 7))
def test_attention_weights_respect_causality_and_padding(c: Config, Ts: int, T: int) -> None:
    gen = torch.Generator().manual_seed(c.seed)
    src = _tokens(gen, c, 2, Ts)
    src[1, -1] = PAD
    tgt = _tokens(gen, c, 2, T)
    model = _enc_dec(c)
    model(src, tgt, padding_mask(src, PAD), make_std_mask(tgt, PAD))
    hidden_key = src == PAD  # (B, Ts)
    for module in model.decoder.blocks:
        block = cast(DecoderBlock, module)
        self_w = block.self_attention.attention_weights
        assert self_w is not None
        future = ~torch.ones(T, T, dtype=torch.bool).tril()
        assert bool((self_w[..., future] == 0).all())  # lower triangular
        cross_w = block.cross_attention.attention_weights
        assert cross_w is not None
        assert bool((cross_w.transpose(1, 3)[hidden_key] == 0).all())
    for w in model.encoder.attention_weights:
        assert w is not None
        assert bool((w.transpose(1, 3)[hidden_key] == 0).all())
