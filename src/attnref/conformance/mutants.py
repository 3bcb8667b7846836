"""Mutants: attention backends with one real bug planted, at least one per bug class.

They are the suite's proof of power: its tests audit every mutant and assert that it
FAILS, and which property catches it; docs/kill-matrix.md shows every mutant against
every property. Use one as a backend with ``--backend mutant.NAME``.

`MUTANTS` is one table. A row names the bug class of docs/architecture.md it plants, a
one-line summary, what the mutant claims to support, and how it is built: a kernel of
`attnref.conformance.kernels` (``materialised``: scores and softmax in float32,
probabilities rounded to the input dtype before ``P @ V``, like real kernels; or
``blocked``, online softmax over tiles) with one switch turned on, or the reference
(gradient bugs). Bugs no switch expresses are a ``prepare`` step that misreads the
inputs before a correct kernel sees them, or, for one, a kernel of their own.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked, checked_internal
from attnref.conformance.adapt import flash_form, kvcache_form, varlen_form
from attnref.conformance.backends import (
    Backend,
    Capabilities,
    flash_naive,
    kvcache_naive,
    varlen_naive,
)
from attnref.conformance.kernels import (
    Key,
    Mask,
    Out,
    Query,
    Value,
    blocked,
    kv_heads,
    materialised,
)

__all__ = ["MUTANTS", "Mutant"]

#: what the materialised kernel honestly declares: torch's semantics
TORCH_LIKE = Capabilities()
#: what the reference declares (mutants of the reference claim the same)
REFERENCE_LIKE = Capabilities(
    causal_alignments=("top_left", "bottom_right"), causal_with_mask=True, masked_nan="contained"
)
#: what a flash-convention kernel with every variant declares (the mutants of classes
#: 22-25 claim it): the naive kernel's declaration in the flash convention
FLASH_LIKE = flash_naive.capabilities  # type: ignore[attr-defined]
#: the same for the packed and paged conventions (the mutants of classes 26-29 claim
#: them): the naive kernel driven sequence by sequence, and row by row
VARLEN_LIKE = varlen_naive.capabilities  # type: ignore[attr-defined]
KVCACHE_LIKE = kvcache_naive.capabilities  # type: ignore[attr-defined]

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
    #: keyword arguments of ``kernel`` that plant the bug
    switches: dict[str, Any] = field(default_factory=dict)
    kernel: Kernel = materialised
    #: how the inputs are misread before ``kernel`` sees them (None: read correctly)
    prepare: Prepare | None = None
    capabilities: Capabilities = TORCH_LIKE
    #: its calling convention (`attnref.conformance.families`)
    api: str = "sdpa"

    @functools.cached_property
    def fn(self) -> Callable[..., Tensor]:
        """The mutant as a function with the signature of its API family."""
        if self.api in ("flash-varlen", "flash-kvcache"):  # a layout bug: the adapter's
            form = varlen_form if self.api == "flash-varlen" else kvcache_form
            fn = form(flash_naive, self.name, bugs=frozenset(self.switches))
            fn.__doc__ = f"Class {self.bug_class}: {self.summary}"
            fn.capabilities = self.capabilities  # type: ignore[attr-defined]
            return fn
        if self.api == "flash":
            kernel = functools.partial(self.kernel, **self.switches)
            kernel.__name__ = self.name  # type: ignore[attr-defined]
            flash = flash_form(kernel, self.name)
            flash.__doc__ = f"Class {self.bug_class}: {self.summary}"
            flash.capabilities = self.capabilities  # type: ignore[attr-defined]
            return flash

        @checked
        def mutant(
            query: Query,
            key: Key,
            value: Value,
            attn_mask: Mask = None,
            dropout_p: float = 0.0,
            is_causal: bool = False,
            scale: float | None = None,
            enable_gqa: bool = False,
            **extra: Any,  # causal_alignment, where the mutant declares it
        ) -> Out:
            if self.prepare is not None:
                query, key, value, attn_mask = self.prepare(query, key, value, attn_mask, scale)
            out: Tensor = self.kernel(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale,
                enable_gqa,
                **extra,
                **self.switches,
            )
            return out

        mutant.__name__ = mutant.__qualname__ = self.name
        mutant.__doc__ = f"Class {self.bug_class}: {self.summary}"
        mutant.capabilities = self.capabilities  # type: ignore[attr-defined]
        return mutant

    def backend(self) -> Backend:
        return Backend(
            f"mutant.{self.name}", self.fn, self.summary, self.capabilities, api=self.api
        )


# ------------------------------------------------- inputs misread, kernels of their own


@checked_internal
def _raw(t: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """``t`` read the way a kernel that ignores strides and offsets reads it: its storage
    from the start, as if contiguous; memory past the end of the storage reads as zeros."""
    available = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.as_strided(t, (min(available, t.numel()),), (1,), 0)
    if flat.numel() < t.numel():
        flat = torch.cat([flat, flat.new_zeros(t.numel() - flat.numel())])
    return flat.reshape(t.shape)


@checked_internal
def _strides_ignored(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    q, k, v = (t if t.is_contiguous() or 0 in t.stride() else _raw(t) for t in (q, k, v))
    return q, k, v, m


@checked_internal
def _broadcast_misread(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    k, v = (_raw(t) if 0 in t.stride() and t.numel() else t for t in (k, v))
    return q, k, v, m


@checked_internal
def _gqa_decode_tiled(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    if q.shape[-2] == 1:  # the decode path expands the KV heads tiled
        k, v = kv_heads(k, v, q.shape[-3], tiled=True)
    return q, k, v, m


@checked_internal
def _gqa_mask_per_kv_head(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    h, g = q.shape[-3], k.shape[-3]
    if m is not None and h != g and m.dim() >= 3 and m.shape[-3] == h:
        m = m[..., [i // (h // g) for i in range(h)], :, :]
    return q, k, v, m


@checked_internal
def _heads_folded_by_reshape(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    if k.dim() >= 4:
        n, g, Tk = math.prod(k.shape[:-3]), k.shape[-3], k.shape[-2]
        # (batch, head) meant, (head, batch) read
        k, v = (t.reshape(g, n, Tk, t.shape[-1]).transpose(0, 1).reshape(t.shape) for t in (k, v))
    return q, k, v, m


@checked_internal
def _decode_drops_last_key(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    if q.shape[-2] == 1 and k.shape[-2] > 1:
        k, v = k[..., :-1, :], v[..., :-1, :]
        if m is not None and m.shape[-1] > 1:
            m = m[..., :-1]
    return q, k, v, m


@checked_internal
def _index_wraps_16bit(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    def gather(t: Tensor) -> Tensor:
        rows = t.numel() // max(t.shape[-1], 1)
        if rows == 0:
            return t
        index = torch.arange(rows, device=t.device).to(torch.int16).to(torch.int64) % rows
        return t.reshape(rows, t.shape[-1])[index].reshape(t.shape)

    return q, gather(k), gather(v), m


@checked_internal
def _with_grad_hook(
    t: Float[Tensor, "*shape"], hook: Callable[[Tensor], Tensor]
) -> Float[Tensor, "*shape"]:
    if not t.requires_grad:
        return t
    t = t.view_as(t)
    t.register_hook(hook)  # type: ignore[no-untyped-call]
    return t


@checked_internal
def _grad_tail_block_dropped(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    tail = k.shape[-2] - k.shape[-2] % 16

    def drop(g: Tensor) -> Tensor:
        g = g.clone()
        g[..., tail:, :] = 0
        return g

    return q, _with_grad_hook(k, drop), _with_grad_hook(v, drop), m


@checked_internal
def _grad_query_unscaled(q: Some, k: Some, v: Some, m: SomeMask, s: float | None) -> Inputs4:
    scale = F.default_scale(q.shape[-1]) if s is None else s
    return _with_grad_hook(q, lambda g: g / scale if scale else g), k, v, m


def _top_left_only(*args: Any, causal_alignment: str = "top_left") -> Tensor:
    """The reference, with the causal alignment it was asked for dropped."""
    out: Tensor = F.scaled_dot_product_attention(*args)
    return out


def _single_key_shortcut(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, *args: Any
) -> Tensor:
    """With one key, V for every query, the mask ignored; otherwise a correct kernel."""
    if key.shape[-2] == 1:
        _, v = kv_heads(key, value, query.shape[-3])
        return v.expand(*query.shape[:-1], value.shape[-1]).clone()
    out = materialised(query, key, value, attn_mask, *args)
    assert isinstance(out, Tensor)
    return out


def _reference(*args: Any, **kwargs: Any) -> Tensor:
    out: Tensor = F.scaled_dot_product_attention(*args, **kwargs)
    return out


# -------------------------------------------------------------------------- the table

#: a mutant of the materialised kernel in the flash convention, declaring every variant
_FLASH: dict[str, Any] = {"api": "flash", "capabilities": FLASH_LIKE}
_VARLEN: dict[str, Any] = {"api": "flash-varlen", "capabilities": VARLEN_LIKE}
_KVCACHE: dict[str, Any] = {"api": "flash-kvcache", "capabilities": KVCACHE_LIKE}

MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        Mutant("empty_row_nan", 1, "a query with no visible key returns NaN (softmax of a "
               "row of -inf)", {"zero_empty_rows": False}),
        Mutant("empty_row_uniform", 2, "masks filled with a finite -1e9: a query with no "
               "visible key averages V", {"fill": -1e9}),
        Mutant("masked_nan_leaks", 3, "claims NaN in masked-out K/V is contained, but "
               "``P @ V`` gives 0 * NaN", capabilities=Capabilities(masked_nan="contained")),
        Mutant("causal_bottom_right", 4, "``is_causal`` aligned bottom-right while claiming "
               "torch's top-left", {"causal_alignment": "bottom_right"}),
        Mutant("causal_alignment_ignored", 4, "declares both alignments but always aligns "
               "top-left", kernel=_top_left_only, capabilities=REFERENCE_LIKE),
        Mutant("causal_excludes_self", 5, "the causal diagonal is off by one: a query does "
               "not see its own key", {"diagonal": -1}),
        Mutant("causal_leaks_next", 5, "the causal diagonal is off by one: a query sees the "
               "next token", {"diagonal": 1}),
        Mutant("strides_ignored", 6, "transposed, sliced or offset inputs read as if "
               "contiguous from offset 0", prepare=_strides_ignored),
        Mutant("broadcast_misread", 7, "stride-0 (broadcast) K/V read as if every sample had "
               "its own storage", prepare=_broadcast_misread),
        Mutant("no_max_subtraction", 8, "``exp`` of raw scores in the input dtype, no max "
               "subtracted: overflow", {"subtract_max": False}),
        Mutant("gqa_tiled", 9, "GQA heads tiled (head i reads KV head i % g) instead of "
               "interleaved", {"tiled_gqa": True}),
        Mutant("gqa_decode_tiled", 10, "GQA with a single query (the decode path) maps heads "
               "tiled", prepare=_gqa_decode_tiled),
        Mutant("gqa_mask_per_kv_head", 10, "GQA with a per-head mask: query head i gets the "
               "mask of head i // group", prepare=_gqa_mask_per_kv_head),
        Mutant("grad_tail_block_dropped", 11, "the backward drops dK and dV of the last "
               "partial tile of 16 keys", kernel=_reference,
               prepare=_grad_tail_block_dropped, capabilities=REFERENCE_LIKE),
        Mutant("grad_query_unscaled", 11, "the backward forgets the softmax scale in dQ",
               kernel=_reference, prepare=_grad_query_unscaled, capabilities=REFERENCE_LIKE),
        Mutant("tail_block_dropped", 12, "tiles of 16 keys; the last partial tile is never "
               "visited", {"drop_tail": True}, kernel=blocked),
        Mutant("online_softmax_no_rescale", 13, "online softmax over tiles of 8 keys that "
               "never rescales the accumulator", {"block": 8, "rescale": False},
               kernel=blocked),
        Mutant("scale_by_d", 14, "the default scale is 1/d instead of 1/sqrt(d)",
               {"scale_rule": lambda d: 1 / d if d else 1.0}),
        Mutant("scale_ignored", 14, "an explicit ``scale`` is ignored; 1/sqrt(d) is always "
               "used", {"ignore_scale": True}),
        Mutant("softmax_over_queries", 15, "the softmax normalises over queries (dim -2) "
               "instead of keys", {"softmax_dim": -2}),
        Mutant("mask_inverted", 16, "boolean mask polarity inverted (True read as "
               "\"hide\")", {"invert_mask": True}),
        Mutant("float_mask_as_bool", 16, "a float (additive) mask is read as a boolean one "
               "(nonzero = visible)", {"float_mask_as_bool": True}),
        Mutant("heads_folded_by_reshape", 17, "K and V folded (head, batch) by a reshape "
               "where (batch, head) was meant", prepare=_heads_folded_by_reshape),
        Mutant("decode_drops_last_key", 18, "the one-query (decode) path reads one key too "
               "few (cache length - 1)", prepare=_decode_drops_last_key),
        Mutant("dropout_at_zero", 19, "dropout is applied (p = 0.05) even when "
               "``dropout_p == 0``", {"dropout_floor": 0.05}),
        Mutant("single_key_shortcut", 20, "with one key, returns V for every query, ignoring "
               "the mask", kernel=_single_key_shortcut),
        Mutant("zero_head_dim_nan", 20, "Dqk = 0 gives scale 1/sqrt(0) = inf, and 0 * inf = "
               "NaN scores", {"scale_rule": lambda d: 1 / math.sqrt(d) if d else math.inf}),
        Mutant("index_wraps_16bit", 21, "key rows addressed by a 16-bit flat index that "
               "wraps past 32767 rows (32-bit offset overflow, scaled down to show on a "
               "CPU)", prepare=_index_wraps_16bit),
        # the variants, in FlashAttention's calling convention (docs/variants.md)
        Mutant("window_bound_exclusive", 22, "the window's left bound is exclusive: a "
               "query sees one key too few", {"window_exclusive": True}, **_FLASH),
        Mutant("window_causal_symmetric", 22, "causal with window_size (w, -1) attends "
               "(w, w): w keys past the query", {"causal_window_symmetric": True},
               **_FLASH),
        Mutant("window_top_left", 22, "the window is measured from the top-left (query i "
               "at position i) when Tq != Tk", {"window_top_left": True}, **_FLASH),
        Mutant("softcap_dropped", 23, "softcap accepted and never applied",
               {"softcap_dropped": True}, **_FLASH),
        Mutant("softcap_before_scale", 23, "softcap applied to q.k before the softmax "
               "scale: c tanh(q.k / c) * scale", {"softcap_before_scale": True}, **_FLASH),
        Mutant("alibi_sign", 23, "ALiBi added with the wrong sign: +m |i - j| rewards "
               "distant keys", {"alibi_sign": 1.0}, **_FLASH),
        Mutant("alibi_top_left", 23, "ALiBi distance measured top-left, |i - j|, "
               "ignoring the Tk - Tq offset", {"alibi_top_left": True}, **_FLASH),
        Mutant("sink_in_numerator", 24, "the sink's probability mass is handed to the "
               "visible keys instead of dropped", {"sink_numerator": True}, **_FLASH),
        Mutant("sink_per_split", 24, "split-KV over two splits adds the sink to each "
               "split's denominator: counted twice", {"sink_count": 2}, **_FLASH),
        Mutant("sink_lost_on_empty_split", 24, "the sink is added in the first split, "
               "which a query with no visible key there skips", {"sink_first_split_only":
               True}, **_FLASH),
        Mutant("lse_base2", 25, "the log-sum-exp is returned in base 2 (log2), as the "
               "kernel computes it", {"lse_base2": True}, **_FLASH),
        Mutant("lse_relative_max", 25, "the log-sum-exp is returned relative to the row's "
               "max (log l, not m + log l)", {"lse_relative_max": True}, **_FLASH),
        Mutant("lse_empty_split_overwrites", 25, "an empty second split's -inf LSE "
               "overwrites the real one in the merge", {"lse_empty_split_overwrites":
               True}, **_FLASH),
        # packed sequences and KV caches (docs/varlen.md, docs/kvcache.md): the bug is in
        # how the adapter reads the pack or the cache; the kernel is the naive one
        Mutant("varlen_global_max_seqlen_k", 26, "each sequence reads max_seqlen_k keys "
               "from its start: a short one sees the next one's keys",
               {"global_max_seqlen_k": True}, **_VARLEN),
        Mutant("varlen_zero_length_shift", 26, "empty sequences are dropped from the query "
               "and the key lists separately, so the sequences after one pair up wrongly",
               {"zero_length_shift": True}, **_VARLEN),
        Mutant("varlen_reads_next_key", 26, "the queries of a sequence also see the next "
               "sequence's first key", {"reads_next_key": True}, **_VARLEN),
        Mutant("paged_tail_counted", 27, "the unused tail of the last page enters the "
               "softmax", {"tail_counted": True}, **_KVCACHE),
        Mutant("paged_logical_as_physical", 27, "logical page i is read at physical page "
               "i, ignoring the block table", {"logical_pages": True}, **_KVCACHE),
        Mutant("append_one_too_far", 27, "the new keys and values are written one slot "
               "past cache_seqlens", {"append_one_too_far": True}, **_KVCACHE),
        Mutant("append_rewrites_slot0", 27, "the append also writes the first new token "
               "over slot 0", {"append_rewrites_slot0": True}, **_KVCACHE),
        Mutant("window_cache_keeps_left", 28, "once the cache is longer than the window, "
               "only the last window_size[0] keys are kept: one too few",
               {"window_cache_keeps_left": True}, **_KVCACHE),
        Mutant("window_cache_keeps_oldest", 28, "once the cache is longer than the "
               "window, the oldest keys are kept instead of the newest",
               {"window_cache_keeps_oldest": True}, **_KVCACHE),
        Mutant("rotary_interleaved_as_halves", 29, "interleaved rotary (GPT-J pairs) "
               "applied as halves (GPT-NeoX)", {"rotary_halves": True}, **_KVCACHE),
        Mutant("rotary_new_keys_at_zero", 29, "the new keys are rotated from position 0, "
               "not from cache_seqlens", {"rotary_at_zero": True}, **_KVCACHE),
        Mutant("split_merge_unweighted", 25, "split-KV parts averaged instead of weighted "
               "by their log-sum-exps (the merge without rescaling)",
               {"split_merge_unweighted": True}, **_KVCACHE),
    )
}  # fmt: skip
