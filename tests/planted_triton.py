"""attnref's Triton flash kernel (`attnref.interpreted.triton_flash`), right and with
bugs planted in its Triton code, as backends of the ``flash`` family that run through
Triton's interpreter: ``tests.planted_triton:NAME`` with ``--api flash``.

Each bug is a line of the kernel switched on by its ``BUG`` constant (`BUGS`):

- ``tail_dropped``: the last, partial key block is never visited (a loop bound of
  ``Tk // BLOCK_N``);
- ``causal_top_left``: the causal diagonal from the top left when ``Tq != Tk``;
- ``no_rescale``: the running sum and output are not rescaled when a later key block
  raises the running max (a merge of blocks without its correction).

``sums_in_bfloat16`` is right: its row sums are a ``tl.sum`` over bfloat16 P for
bfloat16 inputs, which must pass (the interpreter's reductions are attnref's to fix).

And attnref's split-KV decode kernel (`attnref.interpreted.triton_decode`), right
(``decode_right``) and with its bugs, as backends of the ``flash-kvcache`` family:

- ``page_off_by_one``: a key's page is looked up at ``(t + 1) // page``, so the last
  slot of every page is read from the next page;
- ``merge_unweighted``: the KV splits are averaged, not weighted by their log-sum-exps;
- ``v_descale_dropped``: FP8 values are read without their descale.
"""

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from attnref.conformance.families.flash import FLASH_ATTN_2
from attnref.conformance.families.flash_kvcache import FLASH_ATTN_2_KVCACHE
from attnref.interpreted.triton_decode import BUGS as DECODE_BUGS
from attnref.interpreted.triton_decode import flash_attn_with_kvcache
from attnref.interpreted.triton_flash import BUGS, flash_attn_func

#: what the kernel declares: the flash convention with a window and the LSE, every dtype
#: (the interpreter's check leaves out those it computes wrong), tiles of 16 x 16
CLAIMS = replace(
    FLASH_ATTN_2,
    dtypes=(torch.float64, torch.float32, torch.float16, torch.bfloat16),
    softcap=False,
    alibi=False,
    distinct_value_dim=True,
    gradients=False,
    interpreter="triton",
    tile_queries=16,
    tile_keys=16,
)


def _backend(bug: str, sums_in_input: bool = False) -> Any:
    def call(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        return_attn_probs: bool = False,
    ) -> Any:
        return flash_attn_func(
            q, k, v, dropout_p, softmax_scale, causal, window_size, return_attn_probs,
            bug=BUGS[bug] if bug else 0, sums_in_input=sums_in_input,
        )  # fmt: skip

    call.__doc__ = f"attnref's Triton flash kernel, interpreted{': ' + bug if bug else ''}"
    call.capabilities = CLAIMS  # type: ignore[attr-defined]
    return call


right = _backend("")
#: right, its softmax's row sums taken over P in the inputs' dtype: a tl.sum over a
#: bfloat16 tile, which Triton 3.9's interpreter summed as integers until attnref fixed it
sums_in_bfloat16 = _backend("", sums_in_input=True)
tail_dropped = _backend("tail_dropped")
causal_top_left = _backend("causal_top_left")
no_rescale = _backend("no_rescale")


# ------------------------------------------------ the split-KV decode kernel

#: what the decode kernel declares: the flash-kvcache convention, paged with any page
#: size, FlashAttention 3's FP8 descales, a window, the LSE; no rotary, softcap or ALiBi;
#: key blocks of 16 and 4 KV splits
DECODE_CLAIMS = replace(
    FLASH_ATTN_2_KVCACHE,
    dtypes=(torch.float64, torch.float32, torch.float16, torch.bfloat16),
    softcap=False,
    alibi=False,
    rotary=False,
    distinct_value_dim=True,
    page_multiple=1,
    fp8=("e4m3fn", "e5m2"),
    interpreter="triton",
    tile_keys=16,
    kv_splits=4,
    # a program a (batch row, 16 queries, head, split), and a merge: at the default
    # bound (2**20) its quick audit ran past 30 min; a quarter of it keeps every tile
    # and split boundary (4 splits of 16 keys: 64 keys and 65) within reach
    max_call_work=2**18,
)


def _decode(bug: str) -> Any:
    def call(
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        k: Tensor | None = None,
        v: Tensor | None = None,
        cache_seqlens: Tensor | int | None = None,
        cache_batch_idx: Tensor | None = None,
        block_table: Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        num_splits: int = 0,
        q_descale: Tensor | None = None,
        k_descale: Tensor | None = None,
        v_descale: Tensor | None = None,
        return_softmax_lse: bool = False,
    ) -> Any:
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
            softmax_scale, causal, window_size, num_splits, q_descale, k_descale,
            v_descale, return_softmax_lse, bug=DECODE_BUGS[bug] if bug else 0,
        )  # fmt: skip

    call.__doc__ = f"attnref's Triton split-KV decode, interpreted{': ' + bug if bug else ''}"
    call.capabilities = DECODE_CLAIMS  # type: ignore[attr-defined]
    return call


decode_right = _decode("")
page_off_by_one = _decode("page_off_by_one")
merge_unweighted = _decode("merge_unweighted")
v_descale_dropped = _decode("v_descale_dropped")
