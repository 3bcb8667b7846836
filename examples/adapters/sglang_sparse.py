"""SGLang's Triton sparse MLA kernels (DeepSeek's sparse attention, SGLang 0.5.23:
``sglang/kernels/ops/attention/dsa/triton_sparse_mla.py`` and
``triton_sparse_mla_decode.py``) behind FlashMLA's ``flash_mla_sparse_fwd`` signature
(``--api sparse-mla``), run through Triton's interpreter on the CPU (docs/sparse.md,
docs/interpreted.md).

SGLang's kernels take the latent query in two parts, ``q_nope (Tq, h, d_v)`` and
``q_rope (Tq, h, D - d_v)``, against ``kv (rows, 1, D)`` (one row a token: pages of one)
and ``indices (Tq, 1, topk)``, and return ``(1, Tq, h, d_v)`` in bfloat16: no LSE, no
``max_logits``. An entry below 0 is skipped (``valid & (slot >= 0)``); an entry at the
rows' count or past it is not checked (their indexer never writes one), so the
declaration says ``invalid_indices=("-1",)``. Three entry points, three launch paths:

- ``prefill``: ``triton_sparse_mla_fwd``, the public entry, which picks the split-K path
  (a kernel per KV split, then a reduce) when the grid is smaller than the device, the
  single-pass kernel otherwise;
- ``single``: ``_triton_sparse_mla_fwd_single``, the single-pass kernel a long prefill
  takes (a head count of at most 16, or a power of two);
- ``decode``: ``triton_sparse_mla_decode_splitk``, the decode launcher;
- ``packed``: ``prefill`` with ``kv`` made contiguous first: the kernels read ``kv``'s
  rows ``D`` elements apart whatever its stride (the audit's first finding, docs/
  sparse.md), and this entry looks past it.

What running them on a CPU took: the launchers ask the device for its compute units
(``_cu_count``) and shared memory (``_sparse_mla_block_k``); the adapter answers as an
H100 would (132 SMs, 227 KiB: the preferred 64-entry KV tile), which picks their tiles
and splits, not what they compute. Triton's interpreter needed two fixes of attnref's own
(`attnref.interpreted.triton_fixes`: bfloat16 arithmetic, and a module-level
``constexpr`` added to a tensor). Imports as for ``sglang_decode``: SGLang's wheel with
``--no-deps`` and the pure-Python packages pinned in constraints.txt.
"""

from dataclasses import replace
from typing import Any

from torch import Tensor

from attnref.conformance.families.sparse_mla import FLASH_MLA_SPARSE

#: what an H100 reports to the launchers: streaming multiprocessors, and shared memory
#: a block may use (bytes)
H100_SMS, H100_SHARED = 132, 232448


def _kernels() -> Any:
    """SGLang's two modules, their device queries answered as an H100's."""
    from sglang.kernels.ops.attention.dsa import triton_sparse_mla as fwd
    from sglang.kernels.ops.attention.dsa import triton_sparse_mla_decode as dec

    def block_k(kv: Tensor) -> int:
        return int(fwd._block_k_for_shared_memory(kv.shape[-1], kv.element_size(), H100_SHARED))

    for module in (fwd, dec):
        module._cu_count = lambda device=None: H100_SMS
        module._sparse_mla_block_k = block_k
    return fwd, dec


def _entry(launch: Any, name: str, doc: str, contiguous: bool = False) -> Any:
    """A function of ``flash_mla_sparse_fwd``'s signature that calls ``launch(modules,
    q_nope, q_rope, kv, indices, sm_scale, d_v)``."""

    def sparse(
        q: Tensor,
        kv: Tensor,
        indices: Tensor,
        sm_scale: float,
        d_v: int = 512,
        attn_sink: Tensor | None = None,
        topk_length: Tensor | None = None,
    ) -> tuple[Tensor, None, None]:
        if attn_sink is not None or topk_length is not None:  # not dropped in silence
            raise ValueError("SGLang's sparse MLA kernels take neither attn_sink nor topk_length")
        rows = kv.contiguous() if contiguous else kv
        out = launch(_kernels(), q[..., :d_v], q[..., d_v:], rows, indices, sm_scale, d_v)
        return out[0], None, None  # (1, Tq, h, d_v): neither max_logits nor the LSE

    sparse.__name__ = sparse.__qualname__ = name
    sparse.__doc__ = doc
    sparse.capabilities = CLAIMS  # type: ignore[attr-defined]
    return sparse


CLAIMS = replace(
    FLASH_MLA_SPARSE,
    lse=False,
    max_logits=False,
    invalid_indices=("-1",),
    topk_multiple=1,
    interpreter="triton",
    tile_keys=64,
)
prefill = _entry(
    lambda m, *a: m[0].triton_sparse_mla_fwd(*a),
    "prefill",
    "SGLang's ``triton_sparse_mla_fwd``, interpreted.",
)
packed = _entry(
    lambda m, *a: m[0].triton_sparse_mla_fwd(*a),
    "packed",
    "``prefill`` on a contiguous copy of ``kv`` (SGLang's kernels ignore its stride).",
    contiguous=True,
)
single = _entry(
    lambda m, *a: m[0]._triton_sparse_mla_fwd_single(*a),
    "single",
    "SGLang's single-pass ``_triton_sparse_mla_fwd_single``, interpreted.",
)
decode = _entry(
    lambda m, *a: m[1].triton_sparse_mla_decode_splitk(*a, workspace=[]),
    "decode",
    "SGLang's ``triton_sparse_mla_decode_splitk``, interpreted (its split-K buffers "
    "its own, one list a call).",
)
