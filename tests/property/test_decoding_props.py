"""Beam search and sampling reduce to greedy decoding at their limits (float64)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnref.decoding import (
    beam_search,
    beam_search_lm,
    generate,
    greedy_decode,
    sample,
    sample_lm,
)
from attnref.masks import padding_mask
from tests.property.test_transformer_props import Config, _enc_dec, _lm, _tokens, configs

# decoding calls the model hundreds of times; checking makes it about 5x slower, and
# tests/test_cache.py decodes with checking on
pytestmark = pytest.mark.usefixtures("unchecked")


@given(configs(), st.integers(2, 6), st.integers(1, 6))
def test_beam_one_and_top_k_one_equal_greedy(c: Config, Ts: int, L: int) -> None:
    model = _enc_dec(c)
    gen = torch.Generator().manual_seed(c.seed)
    src = _tokens(gen, c, 2, Ts)
    mask = padding_mask(src, 0)
    greedy = greedy_decode(model, src, mask, L, 1)
    assert torch.equal(beam_search(model, src, mask, L, 1, beam_size=1), greedy)
    assert torch.equal(sample(model, src, mask, L, 1, top_k=1, generator=gen), greedy)
    lm = _lm(c)
    prompt = _tokens(gen, c, 2, 2, low=0)
    lm_greedy = generate(lm, prompt, L)
    assert torch.equal(beam_search_lm(lm, prompt, L, beam_size=1), lm_greedy)
    assert torch.equal(sample_lm(lm, prompt, L, top_k=1, generator=gen), lm_greedy)
    assert torch.equal(sample_lm(lm, prompt, L, top_p=1e-9, generator=gen), lm_greedy)


def test_sampling_replays_from_a_generator_and_eos_pads() -> None:
    c = Config(layers=1, heads=2, kv_heads=1, head_dim=4, norm="pre", vocab=9, seed=3)
    lm = _lm(c)
    prompt = torch.tensor([[1, 2], [3, 4]])
    a = sample_lm(lm, prompt, 8, temperature=1.5, generator=torch.Generator().manual_seed(7))
    b = sample_lm(lm, prompt, 8, temperature=1.5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    out = beam_search_lm(lm, prompt, 8, beam_size=3, eos=int(a[0, 2]))
    assert out.shape == (2, 10)
    for row in out:
        hits = (row[2:] == a[0, 2]).nonzero()
        if len(hits):  # after the first EOS, only EOS
            assert bool((row[2 + int(hits[0]) :] == a[0, 2]).all())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.0}, "temperature must be > 0, got 0.0"),
        ({"top_k": 0}, "top_k must be >= 1, got 0"),
        ({"top_p": 1.5}, r"top_p must lie in \(0, 1\], got 1.5"),
    ],
)
def test_bad_sampling_arguments(kwargs: dict[str, float], message: str) -> None:
    lm = _lm(Config(1, 2, 2, 2, "post", 5, 0))
    with pytest.raises(ValueError, match=message):
        sample_lm(lm, torch.ones(1, 1, dtype=torch.long), 3, **kwargs)  # type: ignore[arg-type]


def test_bad_beam_arguments() -> None:
    lm = _lm(Config(1, 2, 2, 2, "post", 5, 0))
    with pytest.raises(ValueError, match="beam_size must be >= 1, got 0"):
        beam_search_lm(lm, torch.ones(1, 1, dtype=torch.long), 3, beam_size=0)
    with pytest.raises(ValueError, match="length_penalty must be >= 0, got -1"):
        beam_search_lm(lm, torch.ones(1, 1, dtype=torch.long), 3, length_penalty=-1.0)


@given(configs(), st.integers(2, 6), st.integers(1, 6), st.integers(2, 4))
def test_beam_search_and_sampling_give_the_same_tokens_with_and_without_the_cache(
    c: Config, Ts: int, L: int, k: int
) -> None:
    """Beam search reorders its hypotheses every step; the cache must follow them."""
    model = _enc_dec(c)
    gen = torch.Generator().manual_seed(c.seed)
    src = _tokens(gen, c, 2, Ts)
    mask = padding_mask(src, 0)
    beams = [
        beam_search(model, src, mask, L, 1, beam_size=k, eos=2, length_penalty=0.6, use_cache=u)
        for u in (True, False)
    ]
    assert torch.equal(*beams)
    draws = [
        sample(model, src, mask, L, 1, top_p=0.9, generator=_seeded(1), use_cache=u)
        for u in (True, False)
    ]
    assert torch.equal(*draws)
    lm = _lm(c)
    prompt = _tokens(gen, c, 2, 2, low=0)
    lm_beams = [beam_search_lm(lm, prompt, L, beam_size=k, use_cache=u) for u in (True, False)]
    assert torch.equal(*lm_beams)
    lm_draws = [
        sample_lm(lm, prompt, L, temperature=2.0, generator=_seeded(2), use_cache=u)
        for u in (True, False)
    ]
    assert torch.equal(*lm_draws)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
