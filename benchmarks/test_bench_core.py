"""Core benchmarks: reference SDPA vs torch, the cost of runtime checking, chunked memory.

Run: ``python -m pytest benchmarks`` (``-k chunked`` for the memory benchmark alone).
"""

import inspect
import json
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnref import functional as F
from attnref import set_checking

torch.set_num_threads(2)


def _qkv(shape: tuple[int, int, int, int]) -> tuple[torch.Tensor, ...]:
    """Float32 query, key and value of shape ``(B, h, T, Dh)``."""
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(shape, generator=gen) for _ in range(3))


# ------------------------------------------------- reference vs torch, same shapes

SHAPE = (2, 8, 512, 64)  # (B, h, T, Dh)


def _torch_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


SDPA_IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "attnref": F.scaled_dot_product_attention,
    "torch_math[baseline]": _torch_math,
    "torch_default": torch.nn.functional.scaled_dot_product_attention,
}


@pytest.mark.benchmark(group="sdpa fp32 B=2 h=8 T=512 Dh=64")
@pytest.mark.parametrize("impl", list(SDPA_IMPLS))
def test_sdpa(benchmark: Any, impl: str) -> None:
    q, k, v = _qkv(SHAPE)
    out = benchmark(SDPA_IMPLS[impl], q, k, v)
    assert out.shape == q.shape


@pytest.mark.benchmark(group="sdpa fp32 causal B=2 h=8 T=512 Dh=64")
@pytest.mark.parametrize("impl", list(SDPA_IMPLS))
def test_sdpa_causal(benchmark: Any, impl: str) -> None:
    q, k, v = _qkv(SHAPE)
    fn = SDPA_IMPLS[impl]
    if impl == "torch_math[baseline]":

        def call() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.MATH):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:

        def call() -> torch.Tensor:
            return fn(q, k, v, is_causal=True)

    assert benchmark(call).shape == q.shape


def _interleaved_ratio(
    a: Callable[[], object], b: Callable[[], object], pairs: int = 40
) -> tuple[float, float, float]:
    """Median, first and third quartile of ``time(a) / time(b)`` over alternating pairs.

    Timing a and b in turn (ab, ba, ab, ...) exposes both to the same drift of a shared
    machine, which separate benchmark loops do not.
    """
    for _ in range(3):  # warm-up
        a()
        b()
    ratios = []
    for i in range(pairs):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        t2 = time.perf_counter()
        ta, tb = (t1 - t0, t2 - t1) if i % 2 == 0 else (t2 - t1, t1 - t0)
        ratios.append(ta / tb)
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return median, q1, q3


@pytest.mark.benchmark(group="attnref / torch MATH, interleaved pairs, fp32 B=2 h=8 T=512 Dh=64")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_ratio_interleaved(benchmark: Any, causal: bool) -> None:
    q, k, v = _qkv(SHAPE)

    def ours() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def theirs() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    result: list[tuple[float, float, float]] = []
    benchmark.pedantic(lambda: result.append(_interleaved_ratio(ours, theirs)), rounds=1)
    median, q1, q3 = result[0]
    benchmark.extra_info["ratio_median"] = round(median, 3)
    benchmark.extra_info["ratio_IQR"] = f"{q1:.3f}-{q3:.3f}"


# ------------------------------------------------------- cost of runtime checking

SMALL = (1, 2, 16, 8)  # (B, h, T, Dh)
UNCHECKED = inspect.unwrap(F.scaled_dot_product_attention)


@pytest.mark.benchmark(group="runtime checking, B=1 h=2 T=16 Dh=8")
@pytest.mark.parametrize("mode", ["unwrapped[baseline]", "checking_off", "checking_on"])
def test_checking_cost(benchmark: Any, mode: str) -> None:
    q, k, v = _qkv(SMALL)
    fn = UNCHECKED if mode.startswith("unwrapped") else F.scaled_dot_product_attention
    set_checking(mode == "checking_on")
    try:
        benchmark(fn, q, k, v)
    finally:
        set_checking(False)


# ------------------------------------------------ chunked vs materialised memory

_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, time
    import torch
    from attnref import functional as F, set_checking
    set_checking(False)
    torch.set_num_threads(2)
    T, Dh, block = int(sys.argv[2]), 64, 1024
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, T, Dh, generator=gen, dtype=torch.float64) for _ in range(3))
    def rss_kib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() // 1024
    before = rss_kib()
    start = time.perf_counter()
    if sys.argv[1] == "chunked":
        out = F.chunked_attention(q, k, v, block_size=block)
    elif sys.argv[1] == "chunked-variants":  # every variant on: the same contract
        out = F.chunked_attention(
            q, k, v, block_size=block, is_causal=True, causal_alignment="bottom_right",
            window=(4095, 0), softcap=30.0, alibi_slopes=torch.tensor([0.01]),
            sinks=torch.tensor([1.0], dtype=torch.float64),
        )
    else:
        out = F.scaled_dot_product_attention(q, k, v)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"seconds": seconds, "peak_mib": (peak - before) / 1024,
                      "checksum": float(out.sum())}))
    """
)


def _measure(kind: str, T: int) -> dict[str, float]:
    """Run one attention in a fresh process: its peak memory is then this call's alone."""
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, kind, str(T)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(proc.stdout)
    return result


@pytest.mark.benchmark(group="float64 Tq=Tk=16384 h=1 Dh=64: time and peak memory")
@pytest.mark.parametrize("kind", ["materialised[baseline]", "chunked", "chunked-variants"])
def test_chunked_memory(benchmark: Any, kind: str) -> None:
    name = kind.split("[")[0]
    results: list[dict[str, float]] = []
    benchmark.pedantic(lambda: results.append(_measure(name, 16384)), rounds=1, iterations=1)
    peak = results[0]["peak_mib"]
    benchmark.extra_info["peak_MiB"] = round(peak)
    benchmark.extra_info["scores_MiB"] = 16384 * 16384 * 8 // 2**20
    if name.startswith("chunked"):
        assert peak < 1024, f"{name} attention peaked at {peak:.0f} MiB"
