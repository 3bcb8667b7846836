"""Keras 3's ``keras.ops.dot_product_attention`` on its torch backend (`keras_attention`).

``attnref audit --backend examples.adapters.keras_torch:attention``
"""

import os

os.environ["KERAS_BACKEND"] = "torch"

from attnref.conformance import EmptyRows
from examples.adapters.keras_attention import attention, declared

__all__ = ["attention"]

# a boolean mask becomes -0.7 * finfo.max added to the scores (a row it empties averages
# V); a float mask reaches torch's SDPA as it is (a row of -inf comes out 0 on the CPU);
# the diagonal is torch's is_causal (top-left: it empties no row), folded into a boolean
# mask when one is passed
declared(empty_row=EmptyRows(bool_mask="uniform", float_mask="zero", causal="zero",
                             causal_masked="uniform", causal_float_masked="zero"))  # fmt: skip
