"""Mutants: attention backends with one real bug planted, at least one per bug class.

They are the suite's proof of power: its tests audit every mutant and assert that it
FAILS, and which property catches it; docs/kill-matrix.md shows every mutant against
every property. Use one as a backend with ``--backend mutant.NAME``.

`MUTANTS` is one table, in the registry's order of families: each family's module
holds its rows (`attnref.conformance.families`) and says how a row becomes a function of
its convention (`ApiFamily.mutant_fn`). A row names the bug class of
docs/architecture.md it plants, a one-line summary, what the mutant claims to support,
and how it is built: a kernel of `attnref.conformance.kernels` (``materialised``: scores
and softmax in float32, probabilities rounded to the input dtype before ``P @ V``, like
real kernels; or ``blocked``, online softmax over tiles) with one switch turned on, or
the reference (gradient bugs). Bugs no switch expresses are a ``prepare`` step that
misreads the inputs before a correct kernel sees them, or a kernel of their own.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaxtyping import Bool, Float
from torch import Tensor

from attnref.conformance.declarations import DEFAULT_API, Backend, Capabilities
from attnref.conformance.family import get_family
from attnref.conformance.kernels import materialised

__all__ = ["MUTANTS", "REFERENCE_LIKE", "TORCH_LIKE", "Mutant", "register"]

#: what the materialised kernel honestly declares: torch's semantics
TORCH_LIKE = Capabilities()
#: what the reference declares (mutants of the reference claim the same)
REFERENCE_LIKE = Capabilities(
    causal_alignments=("top_left", "bottom_right"), causal_with_mask=True, masked_nan="contained"
)

Kernel = Callable[..., Any]
# a misread may change any shape (a key dropped, heads expanded): no dims are bound
Some = Float[Tensor, "..."]
SomeMask = Bool[Tensor, "..."] | Float[Tensor, "..."] | None
Inputs4 = tuple[Some, Some, Some, SomeMask]
# (query, key, value, attn_mask, scale) -> the inputs as the buggy kernel reads them
Prepare = Callable[[Tensor, Tensor, Tensor, Tensor | None, float | None], Inputs4]


@dataclass(frozen=True)
class Mutant:
    """One planted bug: a row of the table, and the backend built from it."""

    name: str
    bug_class: int
    summary: str
    #: keyword arguments of ``kernel`` (or of the family's adapter) that plant the bug
    switches: dict[str, Any] = field(default_factory=dict)
    kernel: Kernel = materialised
    #: how the inputs are misread before ``kernel`` sees them (None: read correctly)
    prepare: Prepare | None = None
    capabilities: Capabilities = TORCH_LIKE
    #: its calling convention (an API family)
    api: str = DEFAULT_API

    @functools.cached_property
    def fn(self) -> Callable[..., Any]:
        """The mutant as a function with the signature of its API family."""
        build = get_family(self.api).mutant_fn
        if build is None:
            raise ValueError(f"the {self.api!r} family has no mutants")
        return build(self)

    def backend(self) -> Backend:
        return Backend(
            f"mutant.{self.name}", self.fn, self.summary, self.capabilities, api=self.api
        )


#: every installed family's mutants, by name, in the registry's order
MUTANTS: dict[str, Mutant] = {}


def register(mutants: tuple[Mutant, ...]) -> None:
    """Add a family's mutants to `MUTANTS` (what installing a family does)."""
    for m in mutants:
        if m.name in MUTANTS:
            raise ValueError(f"mutant {m.name!r} is defined twice")
        MUTANTS[m.name] = m
