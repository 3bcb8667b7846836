"""An autotuned Triton kernel whose configurations are not all right for every call, as
real kernels' are: its softmax reads a row of scores in one block of ``BLOCK_N`` keys,
so a block shorter than the row drops its last keys. Its ``prune_configs_by`` keeps, for
each call, the blocks that cover the row (the kernel's own rule, as FlashAttention's and
vLLM's kernels prune tiles a short or long sequence cannot use); the first listed,
16 keys, covers only short rows. Audited interpreted, each call must run the first
configuration the pruning keeps: pinned to the first listed, it fails every row past 16
keys, and the kernel would be blamed for the harness.

``tests.triton_autotuned:attention``, ``--api sdpa``: the scores and the product with V
in torch, the row softmax in Triton. ``tests.triton_autotuned:unpruned`` is the same
kernel without its pruning: the first configuration runs, and rows past 16 keys are
wrong (the bug the pruning exists to avoid)."""

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnref.conformance import Capabilities

CONFIGS = [triton.Config({"BLOCK_N": n}) for n in (16, 64, 256, 1024, 4096, 16384)]


def _covering(configs: list[Any], named: dict[str, Any], **kwargs: Any) -> list[Any]:
    """The configurations whose block covers the row (``n`` keys)."""
    kept = [c for c in configs if c.kwargs["BLOCK_N"] >= named["n"]]
    return kept or configs[-1:]


def _softmax_rows(scores: Any, out: Any, n: Any, BLOCK_N: tl.constexpr) -> None:
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < n
    x = tl.load(scores + row * n + cols, mask=inside, other=float("-inf"))
    top = tl.max(x, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row with no visible key: zeros
    e = tl.where(inside, tl.exp(x - top), 0.0)
    total = tl.sum(e, axis=0)
    tl.store(out + row * n + cols, e / tl.where(total == 0.0, 1.0, total), mask=inside)


PRUNED = triton.autotune(CONFIGS, key=["n"], prune_configs_by={"early_config_prune": _covering})(
    triton.jit(_softmax_rows)
)
UNPRUNED = triton.autotune(CONFIGS, key=["n"])(triton.jit(_softmax_rows))


def _attention(
    kernel: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """The scores, mask and causal diagonal (top left) in torch, each row's softmax in
    ``kernel``, the product with V in torch."""
    d = query.shape[-1]
    s = scale if scale is not None else d**-0.5
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scores = query.float() @ key.float().transpose(-2, -1) * s
    if is_causal:
        tq, tk = scores.shape[-2:]
        seen = torch.ones(tq, tk, dtype=torch.bool).tril()
        scores = scores.masked_fill(~seen, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    scores = scores.contiguous()
    n = scores.shape[-1]
    weights = torch.empty_like(scores)
    if scores.numel():
        rows = scores.numel() // n
        kernel[(rows,)](scores, weights, n)
    return (weights @ value.float()).to(query.dtype)


def _sdpa(kernel: Any, doc: str) -> Any:
    """A backend of torch SDPA's convention whose row softmax is ``kernel``."""

    def call(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        return _attention(kernel, query, key, value, attn_mask, is_causal, scale, enable_gqa)

    call.__doc__ = doc
    #: torch SDPA's convention, float32 only, no gradients (rows up to 16384 keys)
    call.capabilities = Capabilities(  # type: ignore[attr-defined]
        gradients=False, dtypes=(torch.float32,), interpreter="triton"
    )
    return call


attention = _sdpa(PRUNED, "Attention whose row softmax prunes its configurations per call.")
unpruned = _sdpa(UNPRUNED, "The same kernel without its pruning: 16 keys a row.")
