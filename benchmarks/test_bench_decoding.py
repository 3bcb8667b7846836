"""Greedy generation of 512 tokens, with and without the KV cache (issue 3's benchmark).

A small decoder-only model (2 layers, H = 128, 4 heads) on the CPU. Reported side by
side in one run: the total time of each, their ratio, the cached per-step time over the
first and the last 64 steps (flat if the cache does its job), and the cache's bytes
against ``2 * L * B * g * T * Dh * bytes``.
"""

import time
from typing import Any

import pytest
import torch

from attnref.decoding import generate
from attnref.layers.transformer import DecoderOnlyLM

TOKENS = 512


def _model() -> DecoderOnlyLM:
    torch.manual_seed(0)
    return DecoderOnlyLM(
        vocab_size=64, num_hiddens=128, ffn_hiddens=512, num_heads=4, num_layers=2
    ).eval()


def _step_times(lm: DecoderOnlyLM, n: int) -> list[float]:
    cache = lm.new_cache(1, n + 1)
    token = torch.zeros(1, 1, dtype=torch.long)
    times = []
    with torch.inference_mode():  # as generate() decodes
        for _ in range(n):
            t0 = time.perf_counter()
            token = lm(token, cache=cache)[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
    return times


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "uncached[baseline]"])
def test_generate(benchmark: Any, use_cache: bool, batch: int) -> None:
    """Batch 1 is the issue's benchmark; batch 8 shows the same cache when each step
    carries more arithmetic than Python overhead."""
    benchmark.group = f"generate {TOKENS} tokens, batch {batch}"
    lm = _model()
    prompt = torch.zeros(batch, 1, dtype=torch.long)
    out = benchmark.pedantic(
        generate,
        args=(lm, prompt, TOKENS),
        kwargs={"use_cache": use_cache},
        rounds=5 if batch == 1 else 3,
    )
    assert out.shape == (batch, TOKENS + 1)
    if use_cache and batch == 1:
        steps = _step_times(lm, TOKENS)
        first = sorted(steps[:64])[32]
        last = sorted(steps[-64:])[32]
        benchmark.extra_info["first64_median_us"] = round(first * 1e6, 1)
        benchmark.extra_info["last64_median_us"] = round(last * 1e6, 1)
        cache = lm.new_cache(1, TOKENS + 1)
        L, B, g, T, Dh, size = 2, 1, 4, TOKENS + 1, 32, 4
        benchmark.extra_info["cache_bytes"] = cache.nbytes()
        benchmark.extra_info["formula_bytes"] = 2 * L * B * g * T * Dh * size
