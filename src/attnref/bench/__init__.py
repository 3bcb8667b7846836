"""Benchmark attention backends at the same shapes: time, TFLOP/s, peak memory, a plot.

``attnref bench`` and ``python -m attnref.bench`` are the same command. The backends are
the conformance suite's registry (`attnref.conformance.BUILTIN_BACKENDS`, or any
``module:function``): one list of backends in the project.

Method:

- A `BenchCase` is one shape: ``(B, h, Tq, Dh)`` queries against ``(B, g, Tk, Dh)``
  keys and values, a dtype, a device, a causal alignment or none, and a mask kind
  (``none``, or ``padding``: key lengths spread evenly from ``Tk`` down to ``Tk / 2``
  across the batch, as a ``(B, 1, 1, Tk)`` boolean mask).
- FLOPs count the work the mask leaves: ``4 * h * Dh`` per visible (query, key) pair
  (two matmuls, a multiply and an add each), so ``4 * B * h * Tq * Tk * Dh`` without a
  mask, and the exact count of visible pairs under a causal mask of either alignment
  and under padding (`visible_pairs`). The same count for every backend, whatever it
  computes internally.
- Timing: ``warmup`` calls, then ``runs`` timed calls, each on the next of a few input
  sets in rotation (so no run reads inputs the previous run left in the cache), with
  CUDA events and a synchronisation on a GPU and ``perf_counter`` on the CPU. The median
  is reported.
- Peak memory: on a GPU, the CUDA allocator's peak during one call above what was
  allocated before it; on the CPU, the process's peak resident size during one call
  above its resident size before it (Linux: ``/proc/self/clear_refs`` resets the
  high-water mark and freed heap is trimmed first; elsewhere ``ru_maxrss``, coarser).
- TFLOP/s are divided by a peak (``--peak-tflops``, or ``--measure-peak``: the device's
  measured matmul rate in the benchmark's dtype) for the fraction of peak.

A backend that cannot run a case (not declared for the dtype or device, a kernel that
refuses the shape, out of memory) gets a row with ``status`` ``skipped`` or ``error``
and the reason; the run goes on.
"""

from attnref.bench.cases import (
    MASKS,
    BenchCase,
    bench_inputs,
    case_flops,
    padding_lengths,
    sweep_cases,
    visible_pairs,
)
from attnref.bench.cli import DEFAULT_BACKENDS, add_arguments, main, run_cli
from attnref.bench.output import format_table, plot_results, write_results
from attnref.bench.runner import BenchResult, environment, run_benchmarks, run_case
from attnref.bench.timing import measure_bandwidth, measure_device_peak, measure_matmul_peak

__all__ = [
    "DEFAULT_BACKENDS",
    "MASKS",
    "BenchCase",
    "BenchResult",
    "add_arguments",
    "bench_inputs",
    "case_flops",
    "environment",
    "format_table",
    "main",
    "measure_bandwidth",
    "measure_device_peak",
    "measure_matmul_peak",
    "padding_lengths",
    "plot_results",
    "run_benchmarks",
    "run_case",
    "run_cli",
    "sweep_cases",
    "visible_pairs",
    "write_results",
]
