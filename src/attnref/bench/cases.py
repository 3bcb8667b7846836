"""Benchmark cases: one shape each, the FLOPs of the work its mask leaves, its inputs."""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from attnref.conformance.cases import Inputs
from attnref.conformance.families import FAMILIES
from attnref.conformance.family import Arguments
from attnref.conformance.workloads import ServingCase, Workload
from attnref.devices import DTYPES
from attnref.masks import Alignment, causal_offset, check_alignment, valid_lens_to_mask

__all__ = [
    "MASKS",
    "BenchCase",
    "BenchMask",
    "bench_inputs",
    "case_flops",
    "padding_lengths",
    "serving_call",
    "sweep_cases",
    "visible_pairs",
    "workload_of",
]

#: no mask, or key padding: lengths spread from ``Tk`` down to ``Tk / 2`` over the batch
BenchMask = Literal["none", "padding"]
MASKS: tuple[BenchMask, ...] = get_args(BenchMask)


@dataclass(frozen=True)
class BenchCase:
    """One benchmark shape, run on every backend alike.

    Raises:
        ValueError: a non-positive size, ``g`` not dividing ``h``, an unknown mask kind,
            dtype or alignment.
    """

    B: int
    h: int
    Tq: int
    Tk: int
    Dh: int
    dtype: str = "float32"
    device: str = "cpu"
    g: int | None = None  # key/value heads; None = h
    causal: Alignment | None = None
    mask: BenchMask = "none"

    def __post_init__(self) -> None:
        for name in ("B", "h", "Tq", "Tk", "Dh"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.g is not None and (self.g < 1 or self.h % self.g):
            raise ValueError(f"h ({self.h}) must be divisible by g ({self.g})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if self.causal is not None:
            check_alignment(self.causal)

    @property
    def kv_heads(self) -> int:
        return self.h if self.g is None else self.g

    @property
    def label(self) -> str:
        causal = f" causal={self.causal}" if self.causal else ""
        mask = f" mask={self.mask}" if self.mask != "none" else ""
        gqa = f" g={self.g}" if self.g not in (None, self.h) else ""
        return (
            f"B={self.B} h={self.h}{gqa} Tq={self.Tq} Tk={self.Tk} Dh={self.Dh} "
            f"{self.dtype}{causal}{mask}"
        )


def padding_lengths(B: int, Tk: int) -> list[int]:
    """Key lengths of the ``padding`` mask: spread evenly from ``Tk`` down to ``ceil(Tk / 2)``."""
    if B == 1:
        return [Tk]
    low = math.ceil(Tk / 2)
    return [Tk - round((Tk - low) * b / (B - 1)) for b in range(B)]


def visible_pairs(
    Tq: int, Tk: int, causal: str | None = None, key_lengths: Sequence[int] | None = None
) -> int:
    """The number of (query, key) pairs a mask leaves visible, summed over the batch.

    ``causal``: query ``i`` sees key ``j`` iff ``j <= i`` (``top_left``, torch's
    ``is_causal``) or ``j <= i + Tk - Tq`` (``bottom_right``); ``key_lengths``: one
    sample per entry, whose keys from that length on are padding. Without either it is
    ``Tq * Tk`` (one sample).
    """
    per_row = (
        torch.full((Tq,), Tk, dtype=torch.int64)
        if causal is None
        else (torch.arange(Tq) + causal_offset(Tq, Tk, causal) + 1).clamp(0, Tk)
    )  # keys query i may see, before padding
    lengths = [Tk] if key_lengths is None else list(key_lengths)
    return sum(int(per_row.clamp(max=length).sum()) for length in lengths)


def case_flops(case: BenchCase) -> int:
    """Forward FLOPs for the mask applied: ``4 * h * Dh`` per visible pair."""
    lengths = padding_lengths(case.B, case.Tk) if case.mask == "padding" else [case.Tk] * case.B
    return 4 * case.h * case.Dh * visible_pairs(case.Tq, case.Tk, case.causal, lengths)


def case_bytes(case: BenchCase) -> int:
    """The fewest bytes one call must move: Q, K and V read once and the output written
    once (a key-padding mask's few bytes aside), for the bandwidth roofline."""
    size = torch.finfo(DTYPES[case.dtype]).bits // 8
    q = case.B * case.h * case.Tq * case.Dh
    kv = 2 * case.B * case.kv_heads * case.Tk * case.Dh
    return size * (2 * q + kv)


def sweep_cases(
    *,
    seqs: Sequence[int],
    dtypes: Sequence[str],
    head_dims: Sequence[int],
    causal: Sequence[Alignment | None],
    device: str,
    tokens: int | None = None,
    batch: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    mask: BenchMask = "none",
    queries: int | None = None,
) -> list[BenchCase]:
    """Every combination: ``Tk = seq`` keys, and ``Tq = seq`` queries (self-attention)
    or ``Tq = queries`` (``queries=1``: one decoding step against a cache of ``seq``).

    The batch is ``batch``, or ``tokens // seq`` (at least 1) for a fixed number of
    tokens per batch; the heads are ``heads``, or ``hidden // Dh`` for a fixed model
    width (FlashAttention's benchmarks use 16k tokens and a width of 2048).
    """
    if (tokens is None) == (batch is None):
        raise ValueError("give exactly one of tokens and batch")
    if (hidden is None) == (heads is None):
        raise ValueError("give exactly one of hidden and heads")
    cases = []
    for dtype in dtypes:
        for Dh in head_dims:
            h = heads if heads is not None else max((hidden or 0) // Dh, 1)
            for c in causal:
                for seq in seqs:
                    B = batch if batch is not None else max((tokens or 0) // seq, 1)
                    cases.append(
                        BenchCase(
                            B=B,
                            h=h,
                            g=kv_heads,
                            Tq=seq if queries is None else queries,
                            Tk=seq,
                            Dh=Dh,
                            dtype=dtype,
                            device=device,
                            causal=c,
                            mask=mask,
                        )
                    )
    return cases


def bench_inputs(case: BenchCase, seed: int) -> Inputs:
    gen = torch.Generator(device=case.device).manual_seed(seed)
    dtype = DTYPES[case.dtype]

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen, device=case.device, dtype=dtype)

    g = case.kv_heads
    mask = None
    if case.mask == "padding":
        lengths = torch.tensor(padding_lengths(case.B, case.Tk), device=case.device)
        mask = valid_lens_to_mask(lengths, 1, case.Tk).unsqueeze(1)  # (B, 1, 1, Tk)
    return Inputs(
        query=randn(case.B, case.h, case.Tq, case.Dh),
        key=randn(case.B, g, case.Tk, case.Dh),
        value=randn(case.B, g, case.Tk, case.Dh),
        attn_mask=mask,
        causal=case.causal,
        scale=None,
    )


# ------------------------------------------- the serving families' workloads


def workload_of(case: ServingCase) -> Workload:
    """The workload ``case``'s family gives for it (a ValueError naming the families that
    have one, where it has none, or a page size for a workload without pages)."""
    family = FAMILIES.get(case.api)
    if family is None or family.workload is None:
        with_one = ", ".join(sorted(n for n, f in FAMILIES.items() if f.workload))
        raise ValueError(f"api must be a family with a serving workload ({with_one}), "
                         f"got {case.api!r}")  # fmt: skip
    if case.page and family.serving_pages == (0,):
        raise ValueError(f"page must be 0: the {case.api} workload has no pages")
    return family.workload(case)


def serving_call(case: ServingCase, seed: int = 0) -> Arguments:
    """The arguments of one call of ``case``'s family, drawn from ``seed``."""
    return workload_of(case).arguments(seed)
