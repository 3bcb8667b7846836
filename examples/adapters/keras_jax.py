"""Keras 3's ``keras.ops.dot_product_attention`` on its JAX backend (`keras_attention`).

``attnref audit --backend examples.adapters.keras_jax:attention``
"""

import os

os.environ["KERAS_BACKEND"] = "jax"

from attnref.conformance import EmptyRows
from examples.adapters.keras_attention import attention, declared

__all__ = ["attention"]

# hidden logits get -0.7 * finfo.max (a row a boolean mask or the diagonal empties
# averages V); -inf in the bias is a softmax of -inf alone; is_causal is top-left
declared(empty_row=EmptyRows(bool_mask="uniform", float_mask="nan", causal="uniform"))
