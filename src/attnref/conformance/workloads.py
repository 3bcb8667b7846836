"""What a serving family hands the bench: its workload for a shape, as data.

The bench (`attnref.bench.serving`) sweeps `ServingCase` shapes and owns the timing; the
family whose name a case carries says what one call of that shape is (`Workload`): its
arguments for a seed (fresh values each), the label of its row, the tokens it
processes, and the built-in that verifies its outputs. No family imports the bench;
the bench asks `ApiFamily.workload` (`workload_of`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from attnref._checking import checked
from attnref.conformance.declarations import Capabilities
from attnref.conformance.family import Arguments
from attnref.devices import DTYPES

__all__ = ["ServingCase", "Workload", "spread_lengths"]


@dataclass(frozen=True)
class ServingCase:
    """One shape of a serving family's bench: ``B`` rows (sequences), ``h`` query and
    ``g`` key/value heads of ``Dh`` dims, ``seq`` tokens (cached, or the longest packed),
    cache pages of ``page`` slots (0: contiguous), in ``dtype`` on ``device``; ``api``,
    the family whose workload it is."""

    api: str
    B: int
    h: int
    g: int
    Dh: int
    seq: int
    page: int = 0
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("B", "h", "g", "Dh", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.h % self.g:
            raise ValueError(f"h ({self.h}) must be divisible by g ({self.g})")
        if self.page < 0:
            raise ValueError(f"page must be >= 0 (0: a contiguous cache), got {self.page}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def shape(self) -> str:
        return f"B={self.B} h={self.h} g={self.g} Dh={self.Dh}"

    @checked
    def randn(self, gen: torch.Generator, *shape: int) -> Float[Tensor, "..."]:
        """Standard normal values of ``shape`` from ``gen``, in the case's dtype and device."""
        return torch.randn(shape, generator=gen).to(dtype=DTYPES[self.dtype], device=self.device)


def _takes_it(caps: Capabilities) -> str | None:
    return None


def _same(result: object) -> object:
    return result


def _third(args: tuple[object, ...]) -> object:
    return args[2]


@dataclass(frozen=True)
class Workload:
    """One call of a serving family at one shape (`ServingCase`), as the bench needs it."""

    #: the row's name for the shape
    label: str
    #: tokens one call processes: the rate is ``tokens / median``
    tokens: int
    #: the call's ``(args, kwargs)`` for a seed: fresh values, the same for the same seed
    arguments: Callable[[int], Arguments]
    #: the built-in backend (of the same family) whose output, in float64 and in the
    #: case's dtype, judges a timed call's
    oracle: str
    #: the output tensor of a call's result (a family whose call returns ``(out, lse)``
    #: picks the first); given the backend's untrusted result, it only selects
    output: Callable[[object], object] = _same
    #: V among a call's positional arguments (its largest value scales the bound)
    values: Callable[[tuple[object, ...]], object] = _third
    #: the bytes one call must read at least (its cache, for a memory-bound decode): the
    #: bench shows them over the median as GB/s, to set against the device's memory
    #: bandwidth (the roofline of a memory-bound kernel); 0: not shown
    bytes: int = 0
    #: why a backend declaring these capabilities cannot take this call, or None (the
    #: bench skips its row with the reason)
    refused: "Callable[[Capabilities], str | None]" = _takes_it


def spread_lengths(case: ServingCase) -> list[int]:
    """``B`` sequence lengths spread evenly from ``seq`` down to ``seq / 2``."""
    if case.B == 1:
        return [case.seq]
    return [case.seq - (case.seq // 2) * i // (case.B - 1) for i in range(case.B)]
