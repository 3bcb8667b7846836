"""Cached decoding equals full decoding, over random configurations (float64)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnref.cache import CacheMode
from attnref.decoding import generate, greedy_decode
from attnref.masks import make_std_mask, padding_mask
from tests.property.test_transformer_props import Config, _enc_dec, _lm, _tokens, configs

# decoding calls the model hundreds of times; checking makes it about 5x slower, and
# tests/test_cache.py decodes with checking on
pytestmark = pytest.mark.usefixtures("unchecked")


@given(configs(), st.integers(1, 5), st.integers(1, 6), st.sampled_from(["kv", "representation"]))
def test_lm_logits_at_every_step_equal_the_full_forward(
    c: Config, P: int, N: int, mode: CacheMode
) -> None:
    lm = _lm(c)
    gen = torch.Generator().manual_seed(c.seed)
    tokens = _tokens(gen, c, 2, P + N, low=0)
    full = lm(tokens)
    cache = lm.new_cache(2, P + N, mode=mode)
    steps = [lm(tokens[:, :P], cache=cache)]  # prefill, then one token at a time
    steps += [lm(tokens[:, t : t + 1], cache=cache) for t in range(P, P + N)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


@given(configs(), st.integers(1, 4), st.integers(1, 6))
def test_generation_is_identical_with_and_without_the_cache(c: Config, P: int, N: int) -> None:
    lm = _lm(c)
    prompt = _tokens(torch.Generator().manual_seed(c.seed), c, 2, P, low=0)
    plain = generate(lm, prompt, N, use_cache=False)
    assert torch.equal(generate(lm, prompt, N), plain)
    assert torch.equal(generate(lm, prompt, N, cache_mode="representation"), plain)


@given(configs(), st.integers(2, 7), st.integers(1, 7))
def test_encoder_decoder_greedy_tokens_and_logits_agree_with_the_cache(
    c: Config, Ts: int, L: int
) -> None:
    model = _enc_dec(c)
    gen = torch.Generator().manual_seed(c.seed)
    src = _tokens(gen, c, 2, Ts)
    src[1, Ts // 2 :] = 0  # padding
    src_mask = padding_mask(src, 0)
    plain = greedy_decode(model, src, src_mask, L, 1, use_cache=False)
    assert torch.equal(greedy_decode(model, src, src_mask, L, 1), plain)
    assert torch.equal(
        greedy_decode(model, src, src_mask, L, 1, cache_mode="representation"), plain
    )
    # and the decoder's states for those tokens agree step by step
    memory = model.encode(src, src_mask)
    full = model.decode(memory, src_mask, plain, make_std_mask(plain, -1))
    cache = model.new_cache(2, L)
    steps = [model.decode(memory, src_mask, plain[:, t : t + 1], None, cache=cache)
             for t in range(L)]  # fmt: skip
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
