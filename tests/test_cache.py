"""Caches and greedy decoding: the cache changes speed, never results; bad input is named."""

import pytest
import torch

from attnref.cache import (
    AttentionCache,
    DecoderCache,
    KVCache,
    RepresentationCache,
    StaticKVCache,
)
from attnref.decoding import generate, greedy_decode
from attnref.layers import MultiHeadAttention
from attnref.layers.transformer import DecoderOnlyLM, make_model
from attnref.masks import padding_mask


def test_kv_cache_appends_and_resets() -> None:
    cache = KVCache(batch_size=2, num_kv_heads=3, max_len=5, head_dim=4)
    k, v = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    keys, values = cache.append(k, v)
    assert keys.shape == (2, 3, 2, 4)
    torch.testing.assert_close(values, v)
    keys, _ = cache.append(k[:, :, :1], v[:, :, :1])
    assert keys.shape == (2, 3, 3, 4)
    assert cache.position == 3
    cache.reset()
    assert cache.position == 0


def test_kv_cache_errors_name_the_values() -> None:
    cache = KVCache(batch_size=2, num_kv_heads=1, max_len=3, head_dim=4)
    with pytest.raises(ValueError, match="holds a batch of 2, got a batch of 3"):
        cache.append(torch.randn(3, 1, 1, 4), torch.randn(3, 1, 1, 4))
    cache.append(torch.randn(2, 1, 2, 4), torch.randn(2, 1, 2, 4))
    with pytest.raises(ValueError, match="max_len=3 positions; 2 are used and 2 more do not fit"):
        cache.append(torch.randn(2, 1, 2, 4), torch.randn(2, 1, 2, 4))
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0"):
        KVCache(batch_size=1, num_kv_heads=1, max_len=0, head_dim=4)
    history = RepresentationCache()
    history.append(torch.randn(2, 1, 8))
    with pytest.raises(ValueError, match="holds a batch of 2, got a batch of 1"):
        history.append(torch.randn(1, 1, 8))
    with pytest.raises(ValueError, match="mode must be 'kv' or 'representation'"):
        DecoderCache.for_stack(
            1,
            mode="both",  # type: ignore[arg-type]
            batch_size=1,
            num_kv_heads=1,
            head_dim=2,
            max_len=2,
        )


def test_cache_memory_is_two_buffers_of_b_g_t_dh_per_layer() -> None:
    lm = DecoderOnlyLM(vocab_size=7, num_hiddens=32, ffn_hiddens=32, num_heads=4,
                       num_kv_heads=2, num_layers=3)  # fmt: skip
    cache = lm.new_cache(5, 40)
    assert cache.nbytes() == 2 * 3 * 5 * 2 * 40 * 8 * 4


def test_mha_step_by_step_with_a_cache_equals_the_causal_pass() -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_hiddens=16, num_heads=4, num_kv_heads=2).double().eval()
    X = torch.randn(2, 6, 16, dtype=torch.float64)
    full = mha(X, X, X, causal=True)
    cache = KVCache(batch_size=2, num_kv_heads=2, max_len=6, head_dim=4, dtype=torch.float64)
    steps = [mha(X[:, :2], X[:, :2], X[:, :2], causal=True, cache=cache)]  # prefill
    steps += [mha(X[:, t : t + 1], X[:, t : t + 1], X[:, t : t + 1], cache=cache,
                  causal=True) for t in range(2, 6)]  # fmt: skip
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_a_cache_too_short_or_a_wrong_batch_is_a_clear_error() -> None:
    lm = DecoderOnlyLM(vocab_size=7, num_hiddens=8, ffn_hiddens=8, num_heads=2, num_layers=1)
    cache = lm.new_cache(2, 3)
    with pytest.raises(ValueError, match="max_len=3 positions; 0 are used and 4 more"):
        lm(torch.zeros(2, 4, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="holds a batch of 2, got a batch of 1"):
        lm(torch.zeros(1, 1, dtype=torch.long), cache=lm.new_cache(2, 3))


def test_max_len_below_one_is_an_error() -> None:
    model = make_model(5, 5, num_layers=1, num_hiddens=8, ffn_hiddens=8, num_heads=2)
    src = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0"):
        greedy_decode(model, src, padding_mask(src, 0), 0, 1)
    lm = DecoderOnlyLM(vocab_size=5, num_hiddens=8, ffn_hiddens=8, num_heads=2, num_layers=1)
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0"):
        generate(lm, src, 0)


def test_decoded_tokens_can_feed_a_training_step() -> None:
    """Decoding runs under inference_mode; what it returns must still be usable where
    autograd saves tensors (an embedding lookup saves its indices)."""
    torch.manual_seed(0)
    lm = DecoderOnlyLM(vocab_size=9, num_hiddens=8, ffn_hiddens=8, num_heads=2, num_layers=1)
    tokens = generate(lm, torch.tensor([[1, 2]]), 3)
    assert not tokens.is_inference()
    lm.train()
    lm(tokens).sum().backward()
    assert lm.generator.proj.weight.grad is not None


def test_reorder_moves_each_rows_history_with_its_hypothesis() -> None:
    kv = KVCache(batch_size=3, num_kv_heads=1, max_len=4, head_dim=2)
    keys = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 2, 2)
    kv.append(keys, -keys)
    rows = torch.tensor([2, 2, 0])
    kv.reorder(rows)
    k, v = kv.append(torch.zeros(3, 1, 1, 2), torch.zeros(3, 1, 1, 2))
    assert k[:, 0, :2, 0].tolist() == [[2.0, 2.0], [2.0, 2.0], [0.0, 0.0]]
    assert v[:, 0, :2, 0].tolist() == [[-2.0, -2.0], [-2.0, -2.0], [0.0, 0.0]]
    rep = RepresentationCache()
    rep.append(torch.arange(3.0).view(3, 1, 1))
    rep.reorder(rows)
    assert rep.append(torch.zeros(3, 1, 1))[:, 0, 0].tolist() == [2.0, 2.0, 0.0]
    cache = DecoderCache.for_stack(
        1, batch_size=3, num_kv_heads=1, head_dim=2, max_len=4, cross=True
    )
    layer = cache.layers[0]
    assert isinstance(layer.self_attention, KVCache)
    assert isinstance(layer.cross_attention, StaticKVCache)
    layer.self_attention.append(keys, keys)
    cross = torch.ones(3, 1, 5, 2)
    layer.cross_attention.keys = layer.cross_attention.values = cross
    cache.reorder(rows)
    assert layer.self_attention.keys[:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0]
    assert layer.cross_attention.keys is cross  # one source's memory: nothing to move


def _project(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's projection to 2 heads of width 2, for the protocol test."""
    B, T, _ = keys.shape
    return keys.view(B, T, 2, 2).transpose(1, 2), values.view(B, T, 2, 2).transpose(1, 2)


def test_every_cache_answers_one_protocol_with_one_position() -> None:
    """Each kind returns the heads of every position so far and counts them, from the
    same call; a decoder's position is its layers', not a counter of its own."""
    X = torch.randn(3, 5, 4)
    kinds: list[AttentionCache] = [
        KVCache(batch_size=3, num_kv_heads=2, max_len=5, head_dim=2),
        RepresentationCache(),
    ]
    for cache in kinds:
        assert isinstance(cache, AttentionCache)
        assert cache.position == 0
        cache.update(X[:, :2], X[:, :2], _project)
        k, v = cache.update(X[:, 2:3], X[:, 2:3], _project)
        assert cache.position == 3
        torch.testing.assert_close(k, _project(X[:, :3], X[:, :3])[0])
        torch.testing.assert_close(v, _project(X[:, :3], X[:, :3])[1])
        assert cache.nbytes() > 0
        cache.reset()
        assert cache.position == 0
    static = StaticKVCache()
    assert isinstance(static, AttentionCache)
    first = static.update(X, X, _project)
    again = static.update(X[:, :1], X[:, :1], _project)  # the memory is projected once
    assert again[0] is first[0]
    assert static.position == 5
    lm = DecoderOnlyLM(vocab_size=7, num_hiddens=8, ffn_hiddens=8, num_heads=2, num_layers=2)
    decoder_cache = lm.new_cache(1, 6)
    lm(torch.tensor([[1, 2, 3]]), cache=decoder_cache)
    lm(torch.tensor([[4]]), cache=decoder_cache)
    assert decoder_cache.position == 4
    assert {layer.self_attention.position for layer in decoder_cache.layers} == {4}


def test_cached_decoding_equals_full_decoding_with_checking_on() -> None:
    """One example with every shape check on (the properties run with checking off)."""
    from attnref import checking_enabled

    assert checking_enabled()
    torch.manual_seed(1)
    lm = DecoderOnlyLM(vocab_size=9, num_hiddens=8, ffn_hiddens=16, num_heads=2,
                       num_kv_heads=1, num_layers=2).double()  # fmt: skip
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for mode in ("kv", "representation"):
        assert torch.equal(
            generate(lm, prompt, 5, cache_mode=mode), generate(lm, prompt, 5, use_cache=False)
        )
    model = make_model(9, 9, num_layers=2, num_hiddens=8, ffn_hiddens=16, num_heads=2)
    model = model.double().eval()  # no dropout
    src = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    mask = padding_mask(src, 0)
    assert torch.equal(
        greedy_decode(model, src, mask, 6, 1),
        greedy_decode(model, src, mask, 6, 1, use_cache=False),
    )
