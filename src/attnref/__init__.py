"""attnref: a shape-checked, typed reference implementation of attention and the Transformer.

Start with `attnref.functional.scaled_dot_product_attention` (a drop-in for torch's),
`attnref.masks` and `attnref.layers.MultiHeadAttention`;
``attnref audit`` compares any SDPA-compatible backend with the float64 reference.
"""

from attnref import functional, layers, masks
from attnref._checking import checking_enabled, set_checking

__version__ = "0.1.0"

__all__ = ["__version__", "checking_enabled", "functional", "layers", "masks", "set_checking"]
