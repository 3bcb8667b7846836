"""Timing calls (median of runs after warm-up, inputs rotated) and their peak memory."""

import contextlib
import ctypes
import gc
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from attnref.devices import DTYPES

__all__ = ["PEAK_DTYPES", "measure_device_peak", "measure_matmul_peak", "peak_bytes", "time_calls"]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(
    calls: Sequence[Callable[[], Any]], *, warmup: int, runs: int, device: str
) -> list[float]:
    """Seconds of each of ``runs`` calls, rotating through ``calls``, after ``warmup``."""
    for i in range(warmup):
        calls[i % len(calls)]()
    _sync(device)
    times = []
    for i in range(runs):
        call = calls[i % len(calls)]
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return times


def _proc_status(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _trim_heap() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_bytes(call: Callable[[], Any], device: str) -> int | None:
    """Memory one call adds at its peak (see the module docstring for the method)."""
    if device == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()
        call()
        _sync(device)
        return max(torch.cuda.max_memory_allocated() - allocated, 0)
    _trim_heap()
    before: int | None = _proc_status("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    except OSError:
        before = None
    if before is None:  # not Linux: the process's lifetime peak, in kilobytes or bytes
        scale = 1 if sys.platform == "darwin" else 1024
        start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        call()
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale - start, 0)
    call()
    peak = _proc_status("VmHWM")
    return None if peak is None else max(peak - before, 0)


def measure_matmul_peak(dtype: str, device: str, *, n: int = 8192, runs: int = 10) -> float:
    """The device's measured matmul rate in TFLOP/s: the fastest of ``runs`` ``n x n``
    matmuls in ``dtype``. A peak is the most the device was seen to do: the median would
    put it below what a kernel can show on a good call, and flag an honest one."""
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen, device=device, dtype=DTYPES[dtype]) for _ in range(2))
    times = time_calls([lambda: a @ b], warmup=3, runs=runs, device=device)
    return 2 * n**3 / min(times) / 1e12


def measure_bandwidth(device: str, *, mib: int = 256, runs: int = 10) -> float:
    """The device's measured memory bandwidth in GB/s: the fastest of ``runs`` copies of
    ``mib`` MiB (read once, written once). As for the matmul peak, the best call seen."""
    n = mib * 2**20 // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    times = time_calls([lambda: dst.copy_(src)], warmup=2, runs=runs, device=device)
    return 2 * src.numel() * 4 / min(times) / 1e9


#: the precisions a kernel may compute in, whatever the dtype of its inputs
PEAK_DTYPES = ("bfloat16", "float16", "float32")


def measure_device_peak(device: str, *, n: int = 8192, runs: int = 10) -> tuple[float, str]:
    """The device's peak for the roofline check and the fraction of peak: the fastest
    matmul rate in TFLOP/s over `PEAK_DTYPES`, and its dtype. A kernel given half
    precision may compute in float32: on a CPU that emulates half-precision matmuls
    (1.3 GFLOP/s here, against 100 GFLOP/s in float32) a bf16 peak flagged an honest
    float16 kernel. On a GPU the half-precision tensor cores win."""
    # a probe at n = 256 first: a dtype whose matmul is emulated (a quarter of the best
    # probe's rate or less) is not timed at full size (minutes on a CPU at n = 1024)
    probe = {d: measure_matmul_peak(d, device, n=min(n, 256), runs=1) for d in PEAK_DTYPES}
    fast = [d for d in PEAK_DTYPES if probe[d] >= max(probe.values()) / 4]
    rates = {d: measure_matmul_peak(d, device, n=n, runs=runs) for d in fast}
    best = max(rates, key=lambda d: rates[d])
    return rates[best], best
