"""attnref: a shape-checked, typed reference implementation of attention and the Transformer.

Start with `attnref.functional.scaled_dot_product_attention` (a drop-in for torch's),
`attnref.masks` and `attnref.layers.MultiHeadAttention`;
``attnref audit`` compares any SDPA-compatible backend with the float64 reference.

Submodules load on first use, so that ``import attnref`` (which pytest does when it
loads attnref's plugin) imports neither torch nor the checked functions before the
test run has configured them.
"""

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["__version__", "checking_enabled", "functional", "layers", "masks", "set_checking"]

if TYPE_CHECKING:
    from attnref import functional, layers, masks
    from attnref._checking import checking_enabled, set_checking


def __getattr__(name: str) -> Any:
    if name in ("functional", "layers", "masks"):
        return importlib.import_module(f"attnref.{name}")
    if name in ("checking_enabled", "set_checking"):
        return getattr(importlib.import_module("attnref._checking"), name)
    raise AttributeError(f"module 'attnref' has no attribute {name!r}")
