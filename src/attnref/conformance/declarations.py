"""Declarations: what a backend claims, as data, at the bottom of the conformance package.

`Capabilities` (with `EmptyRows`) is what a backend declares it supports; `Backend` is a
named callable of one API family with its declaration; `BackendError` is every failure
to resolve one. Nothing here knows a family: each family registers its preset
(`PRESETS`, `register_preset`) when the registry (`attnref.conformance.families`) installs
it, and a declaration names the family whose preset it starts from
(`Capabilities.family`). A plain function with no declaration is taken to claim its
family's preset; one that starts from another family's is an error, never read silently
as that family's.

`declaration` and `from_declaration` are the declaration as plain data: what a worker
sends the judge, checked field by field.
"""

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from attnref.distributed import SHARDINGS
from attnref.masks import Alignment

__all__ = [
    "DEFAULT_API",
    "FP8_FORMATS",
    "PRESETS",
    "VARIANTS",
    "Backend",
    "BackendError",
    "Capabilities",
    "EmptyLse",
    "EmptyRows",
    "declaration",
    "family_mismatch",
    "from_declaration",
    "register_preset",
]

#: the family a backend is of when none is named (torch SDPA's convention)
DEFAULT_API = "sdpa"

#: a backend's function: it returns a tensor, or a tuple when asked for the LSE
SDPA = Callable[..., Any]
#: the output for a query with no visible key: zeros, NaN, the mean of V ("uniform": a
#: finite fill that *replaces* the hidden scores, as ``masked_fill(~mask, finfo.min)``),
#: or "unmasked": attention over the keys the mask hid, as if it hid none (a finite fill
#: *added* to the scores, as diffusers' ``-10000``: every score of the row moves alike)
#: "diagonal": attention over the keys the causal diagonal alone hid, the mask's hidden
#: keys kept hidden (a finite fill added on the diagonal, -inf in the mask: ONNX Runtime's
#: GroupQueryAttention); NaN where the mask hides every key;
#: "diagonal_replaced": the diagonal's hidden scores *replaced* by one finite value, so
#: the plain mean of V over the keys the diagonal alone hid (the mask applied as usual
#: on top: a float mask's entries still weigh them): ONNX Runtime's MultiHeadAttention;
#: NaN where the mask hides every key;
#: "undefined": the library's documentation leaves such a row undefined (JAX's splash
#: attention: NaN, or a mean that depends on the tile): it is not judged, and the report
#: says so
EmptyRow = Literal[
    "zero", "nan", "uniform", "unmasked", "diagonal", "diagonal_replaced", "undefined"
]
#: "contained": NaN/inf in K/V at keys no query sees never reaches the output;
#: "propagates": it may (0 * NaN = NaN in a materialised P @ V, as torch's CPU kernels)
MaskedNaN = Literal["contained", "propagates"]
#: the log-sum-exp of a query with no visible key: the mathematical ``-inf``, or
#: FlashAttention 2's ``+inf`` (outside split-KV)
EmptyLse = Literal["-inf", "+inf"]
#: the variants a backend may declare (docs/variants.md), each a flag of `Capabilities`
VARIANTS = ("window", "softcap", "alibi", "sinks")


#: what hid every key from a query, as the backend was called: a boolean mask, ``-inf``
#: in a float mask, or the causal diagonal the backend applied itself (``is_causal``)
Cause = Literal["bool_mask", "float_mask", "causal"]


@dataclass(frozen=True)
class EmptyRows:
    """The output for a query with no visible key, by what hid the keys from it.

    Real kernels differ by cause: one returns zeros under a boolean mask, NaN under a
    ``-inf`` float mask (a softmax of ``-inf``) and the mean of V when only its own
    causal diagonal empties the row (a finite fill value). ``causal`` applies only when
    the backend computes the alignment itself; an alignment it does not declare reaches
    it as a boolean mask. A row that a mask alone empties is the mask's; one that the
    diagonal empties, alone or together with a mask, is ``causal``. ``causal_masked``
    (default: ``causal``'s) is the policy of such a row in a call that was also passed a
    mask: for a backend whose answer depends on whether a mask was passed (one that
    folds its diagonal into the mask it is given, with a finite fill), and
    ``causal_float_masked`` (default: ``causal_masked``'s) in a call passed a float mask,
    for one whose answer depends on the kind of mask too (Keras on torch folds its
    diagonal into a boolean mask with a finite fill, and hands a float one to torch's
    SDPA with ``is_causal``).
    """

    bool_mask: EmptyRow = "zero"
    float_mask: EmptyRow = "zero"
    causal: EmptyRow = "zero"
    causal_masked: EmptyRow | None = None
    causal_float_masked: EmptyRow | None = None

    def __post_init__(self) -> None:
        optional = ("causal_masked", "causal_float_masked")
        for name in (*get_args(Cause), *optional):
            value = getattr(self, name)
            if value not in get_args(EmptyRow) and not (name in optional and value is None):
                raise ValueError(
                    f"EmptyRows.{name} must be one of {', '.join(get_args(EmptyRow))}, "
                    f"got {value!r}"
                )

    def of(self, cause: Cause, masked: bool = False, float_mask: bool = False) -> EmptyRow:
        """The policy of a row that ``cause`` empties (``masked``: in a call that was
        also passed a mask; ``float_mask``: a float one)."""
        if cause == "causal" and masked and float_mask and self.causal_float_masked is not None:
            return self.causal_float_masked
        if cause == "causal" and masked and self.causal_masked is not None:
            return self.causal_masked
        policy: EmptyRow = getattr(self, cause)
        return policy

    def for_call(self, cause: Cause, mask: Tensor | None) -> EmptyRow:
        """The policy of a row that ``cause`` empties in a call passed ``mask`` (`of`)."""
        return self.of(cause, mask is not None, mask is not None and mask.is_floating_point())

    def policies(self) -> set[EmptyRow]:
        return {
            self.of(c, m, f) for c in get_args(Cause) for m in (False, True) for f in (False, True)
        }


class BackendError(Exception):
    """A backend could not be resolved or does not have SDPA's signature."""


#: the FP8 formats of an FP8 KV cache, by the name a declaration gives them
FP8_FORMATS: dict[str, torch.dtype] = {
    "e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}


#: the invalid top-k index forms a sparse kernel may ignore, and what it may do with an
#: index listed twice (`Capabilities.invalid_indices`, `Capabilities.duplicates`)
INVALID_INDICES = ("-1", "past_end")
DUPLICATES = ("counted", "refused")
#: the decay a linear attention kernel takes (`Capabilities.linear_gate`): one a value
#: head (Gated DeltaNet's ``g (B, T, HV)``) or one a key channel (KDA's ``(B, T, HV, K)``)
LINEAR_GATES = ("head", "key")
#: FlashMLA's packed FP8 sparse caches (`Capabilities.sparse_caches`, attnref.sparse):
#: 656 bytes a 576-dim row (DeepSeek-V3.2), and 584 a 512-dim row laid out by page (V4)
SPARSE_CACHES = ("V32", "MODEL1")


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares it supports. The audit draws its cases inside the
    declaration; a call a check derives that falls outside it is skipped and counted,
    and a property no declared call can meet is skipped with the reason.

    The defaults are the ``sdpa`` family's (`SDPA_DEFAULTS`); a backend of another
    family starts from that family's preset (`PRESETS`, `Capabilities.preset`), and
    ``family`` says which: a declaration whose ``family`` is not the backend's is an
    error (`BackendError`), not read as the other family's.
    """

    #: the API family whose preset this declaration starts from
    family: str = DEFAULT_API
    dtypes: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    devices: tuple[str, ...] = ("cpu", "cuda")
    bool_mask: bool = True
    float_mask: bool = True
    gqa: bool = True
    # alignments the backend computes itself through a `causal_alignment` keyword; any
    # other alignment reaches it as an explicit boolean mask
    causal_alignments: tuple[Alignment, ...] = ("top_left",)
    # may `is_causal=True` be combined with `attn_mask`? The signature takes both, so
    # both are tested unless declared away (torch's own SDPA raises on both: its
    # built-ins declare False, and the diagonal then reaches it folded into the mask)
    causal_with_mask: bool = True
    #: its own causal flag only where Tq == Tk (ONNX Runtime's attention operators):
    #: elsewhere the diagonal reaches it folded into the mask, as an undeclared
    #: alignment does
    causal_square_only: bool = False
    # output for a query with no visible key: one policy, or one per cause (`EmptyRows`)
    empty_row: EmptyRow | EmptyRows = "zero"
    masked_nan: MaskedNaN = "propagates"  # may NaN/inf at hidden keys reach the output?
    gradients: bool = True  # backward through the output gives dQ, dK, dV
    dropout: bool = True  # takes dropout_p (only dropout_p = 0 is audited)
    zero_head_dim: bool = True  # Dqk = 0 (scores all zero: the mean of V)
    max_head_dim: int | None = None  # the largest Dqk (and Dv) taken; None: any
    distinct_value_dim: bool = True  # may Dv differ from Dqk?
    # substrings of an error message that mean "refused this input" (a skip, not a failure)
    refuses: tuple[str, ...] = ()
    # the variants of docs/variants.md, each as the API family spells it
    window: bool = False  # a sliding window (left, right)
    #: only windows that end at the query, ``(left, 0)`` (ONNX Runtime GQA's
    #: ``local_window_size``): cases draw so, and `window_none` checks ``(-1, 0)`` and the
    #: covering ``(left, 0)`` on causal calls
    causal_windows_only: bool = False
    softcap: bool = False  # softcap * tanh(score / softcap)
    alibi: bool = False  # ALiBi slopes, (h,) or (B, h)
    sinks: bool = False  # one sink logit per query head
    lse: bool = False  # returns the log-sum-exp on request
    empty_lse: EmptyLse = "-inf"  # the log-sum-exp of a query with no visible key
    #: the log-sum-exp it returns counts the sink: ``logaddexp(lse, sink)`` (SGLang's
    #: extend kernel); False: over the keys only, as FlashAttention's
    lse_with_sink: bool = False
    combined_variants: bool = True  # may several variants be on in one call?
    # the decode calls of the flash-kvcache family (docs/kvcache.md)
    rotary: bool = False  # rotary_cos / rotary_sin for the new tokens, both layouts
    paged: bool = False  # a paged cache through block_table
    page_multiple: int = 1  # page sizes must be multiples of this (FlashAttention 2: 256)
    #: the FP8 formats (of "e4m3fn", "e5m2") of q and the cache it takes, with
    #: (flash-kvcache) FlashAttention 3's per-KV-head ``q_descale``, ``k_descale``,
    #: ``v_descale``, or (mla) vLLM's FlashMLA per-tensor ``descale_q``, ``descale_k``;
    #: such a call returns bfloat16
    fp8: tuple[str, ...] = ()
    #: it rounds the probabilities P to the FP8 format before ``P V`` (FlashAttention 3):
    #: the bound of an FP8 call grows by that rounding
    fp8_rounds_p: bool = False
    # narrow libraries: what they take of the whole space
    #: only self-attention: queries and keys of one length (Tq = Tk); cases are drawn so,
    #: and a property that needs Tq != Tk (decode, merge) is skipped
    self_attention_only: bool = False
    #: queries never outnumber keys (Tq <= Tk: prefill of a whole sequence, or decode
    #: against a cache); cases are drawn so, a longer query side cut to the keys'
    queries_at_most_keys: bool = False
    #: only causal calls (its causal alignments, `causal_alignments`); cases are drawn
    #: causal, and a property that needs a non-causal call is skipped
    causal_only: bool = False
    #: takes an explicit ``scale``; False: only the default 1/sqrt(Dqk) (scale=None)
    explicit_scale: bool = True
    #: every call carries a sliding window (a library of windowed attention only, such
    #: as NATTEN's): cases are drawn with one (``window`` must be declared)
    window_required: bool = False
    #: the only head dims taken (Dqk and Dv), e.g. powers of two; () : any up to
    #: ``max_head_dim``. Cases draw among them
    head_dims: tuple[int, ...] = ()
    #: head dims (Dqk and Dv) must be multiples of this (ONNX Runtime GQA's CPU kernel:
    #: 8), a rule rather than a list; cases draw the nearest multiple at or above
    head_dim_multiple: int = 1
    #: one query per sequence (decode kernels: vLLM's ``single_query_cached_kv_attention``,
    #: SGLang's and FlashInfer's decode): cases draw Tq = 1 (one new token at most), and a
    #: call of more is skipped
    single_query: bool = False
    #: may a sequence have no key at all? False: a serving kernel that never sees one
    #: (cases draw at least one key a sequence; a call with none is skipped)
    empty_sequences: bool = True
    #: (queries, keys): a dense call's Tq and Tk must be multiples of these (Pallas'
    #: ``block_q``, ``block_k``); cases draw the nearest at or above, and a call of other
    #: lengths (a decode step of one query) is skipped
    length_multiples: tuple[int, int] = (1, 1)
    #: multi-head latent attention (the ``mla`` family): one key/value head, and the
    #: values are the keys' leading ``Dv`` dims (V is the cached latent row itself).
    #: Cases are drawn so (``g = 1``, ``Dv <= Dqk``; with ``head_dims``, the keys take
    #: the largest and the values the next); a call that breaks the tie is skipped
    latent_values: bool = False
    #: (context-parallel) only the process group of every rank the audit started: no
    #: call on a subgroup (a smaller world size), which some libraries hang on
    cp_full_group: bool = False
    #: (context-parallel) the shardings taken, of ``contiguous`` and ``zigzag`` (a ring
    #: library of contiguous shards only: ``("contiguous",)``); cases draw among them
    cp_shardings: tuple[str, ...] = ("contiguous", "zigzag")
    #: (context-parallel) only sequences that cut into equal chunks: the length a multiple
    #: of the world size (of twice it, zigzag). Cases are drawn so; a call that would
    #: leave the chunks unequal runs at a smaller world size where they are equal
    cp_equal_shards: bool = False
    #: every call carries sink logits (a library whose attention always has them, as
    #: GPT-OSS's): cases are drawn with them (``sinks`` must be declared)
    sinks_required: bool = False
    #: one sink logit shared by every head (cases draw one value for all heads)
    sink_shared: bool = False
    #: the sink logits taken (() : any); cases draw among them, ``-inf`` is no sink
    sink_values: tuple[float, ...] = ()
    #: a gradient with respect to the sinks (False: the sink is a constant)
    sink_gradients: bool = True
    #: the empty-row policy of some dtypes, where it differs from ``empty_row`` (a dict
    #: ``{"float64": "nan"}`` is taken, kept as pairs)
    empty_row_by_dtype: (
        tuple[tuple[str, EmptyRow | EmptyRows], ...] | dict[str, EmptyRow | EmptyRows]
    ) = ()

    #: the kernel runs through an interpreter on the CPU: ``"triton"`` (Triton's,
    #: ``TRITON_INTERPRET=1``) or ``"pallas"`` (JAX's Pallas in interpret mode);
    #: ``""``: it runs natively. The worker sets the interpreter up before the backend's
    #: module is imported (`attnref.interpreted`), leaves out the dtypes the interpreter
    #: computes wrong, checks the interpreter on a kernel of attnref's own first, and
    #: fits the cases' sizes to the tiles and the cost bound below
    interpreter: str = ""
    #: the kernel's tiles: its query block and key block (a program's rows and the keys
    #: one step of its loop reads), and the number of KV splits it makes (split-KV
    #: decode: the keys cut into that many chunks, merged after). 0: not declared. Cases
    #: then put lengths one below, at and one above each tile and split boundary within
    #: ``max_call_work`` (`attnref.conformance.profiles.fitted`)
    tile_queries: int = 0
    tile_keys: int = 0
    kv_splits: int = 0
    #: the most work one call may do, ``batch * h * Tq * Tk * (Dh + Dv)`` (0: the
    #: profile's): an interpreted call costs milliseconds per program and tile, and the
    #: profile's production sizes would take minutes a case
    max_call_work: int = 0
    #: the most distinct shapes (batch, heads, lengths, head dims) one (property, dtype)
    #: search calls it with (0: any): a backend whose first call of a shape compiles for
    #: seconds (JAX, Pallas in interpret mode: 2-3 s a new shape, 0.01 s a repeated one)
    #: declares a few, and the cases past them take one of the shapes already drawn,
    #: their values, masks and variants still drawn. Pallas kernels get 4 undeclared
    distinct_shapes: int = 0

    #: sparse attention (the ``sparse-mla`` families, docs/sparse.md): the invalid
    #: index forms the kernel ignores, ``"-1"`` (any negative index) and ``"past_end"``
    #: (an index at the rows' count or past it); what it does with an index listed
    #: twice, ``"counted"`` (twice, as FlashMLA's reference) or ``"refused"`` (never
    #: drawn); whether it returns ``max_logits``; the top-k lengths it takes (multiples
    #: of ``topk_multiple``); whether it takes per-query counts (``topk_length``) and a
    #: sink logit per head (``attn_sink``, FlashMLA's name: the output times
    #: ``sigmoid(lse - sink)``); the packed FP8 caches its sparse decode reads
    #: (``sparse-mla-fp8``): ``"V32"`` (656 bytes a 576-dim row), ``"MODEL1"`` (584
    #: bytes a 512-dim row, by page)
    invalid_indices: tuple[str, ...] = ("-1", "past_end")
    duplicates: str = "counted"
    max_logits: bool = False
    topk_multiple: int = 1
    topk_length: bool = False
    attn_sink: bool = False
    sparse_caches: tuple[str, ...] = ("V32",)

    #: linear attention (the ``gated-delta`` families, docs/linear.md): whether it takes
    #: fla's ``use_qk_l2norm_in_kernel=True`` (False: it is never passed; keys are drawn
    #: near unit norm, as a model that normalizes them first passes them); a log decay of
    #: ``-inf`` (a gate that forgets everything: drawn only where declared); packed
    #: sequences (``cu_seqlens``); the chunk its prefill cuts a sequence into (the tails
    #: are drawn around it); and, for the serving form, a pool of states read and written
    #: at each request's slot (``ssm_state_indices``) and speculative decoding (a state a
    #: drafted token, ``num_accepted_tokens``); ``linear_gate``: ``"head"`` (one log decay
    #: a value head and token, ``g (B, T, HV)``: Gated DeltaNet's) or ``"key"`` (one a key
    #: channel, ``g (B, T, HV, K)``: KDA's, fla's ``chunk_kda``)
    qk_l2norm: bool = True
    gate_neg_inf: bool = False
    linear_packed: bool = True
    linear_chunk: int = 64
    state_pool: bool = True
    speculative: bool = True
    linear_gate: str = "head"

    def __post_init__(self) -> None:
        by_dtype: object = self.empty_row_by_dtype
        if isinstance(by_dtype, dict):
            object.__setattr__(self, "empty_row_by_dtype", tuple(by_dtype.items()))
        _check_by_dtype(self.empty_row_by_dtype)
        if type(self.family) is not str or not self.family:
            raise ValueError(
                f"Capabilities.family must name an API family (a string), got {self.family!r}"
            )
        values = tuple(float(v) for v in self.sink_values)
        if any(math.isnan(v) for v in values):
            raise ValueError(
                f"Capabilities.sink_values must not hold NaN, got {self.sink_values!r}"
            )
        object.__setattr__(self, "sink_values", values)
        if type(self.head_dim_multiple) is not int or self.head_dim_multiple < 1:
            raise ValueError(
                "Capabilities.head_dim_multiple must be an int >= 1, got "
                f"{self.head_dim_multiple!r}"
            )
        multiples = self.length_multiples
        if not (
            isinstance(multiples, tuple)
            and len(multiples) == 2
            and all(type(m) is int and m >= 1 for m in multiples)
        ):
            raise ValueError(
                "Capabilities.length_multiples must be (queries, keys), ints >= 1, got "
                f"{multiples!r}"
            )
        from attnref.interpreted import INTERPRETERS

        if self.interpreter and self.interpreter not in INTERPRETERS:
            raise ValueError(
                f"Capabilities.interpreter must be one of {', '.join(INTERPRETERS)} (or '' "
                f"for a kernel that runs natively), got {self.interpreter!r}"
            )
        if not self.invalid_indices or any(f not in INVALID_INDICES for f in self.invalid_indices):
            raise ValueError(
                f"Capabilities.invalid_indices must name one or both of "
                f"{', '.join(INVALID_INDICES)}, got {self.invalid_indices!r}"
            )
        if not self.sparse_caches or any(c not in SPARSE_CACHES for c in self.sparse_caches):
            raise ValueError(
                f"Capabilities.sparse_caches must name one or both of "
                f"{', '.join(SPARSE_CACHES)}, got {self.sparse_caches!r}"
            )
        if self.linear_gate not in LINEAR_GATES:
            raise ValueError(
                f"Capabilities.linear_gate must be one of {', '.join(LINEAR_GATES)}, "
                f"got {self.linear_gate!r}"
            )
        if self.duplicates not in DUPLICATES:
            raise ValueError(
                f"Capabilities.duplicates must be one of {', '.join(DUPLICATES)}, "
                f"got {self.duplicates!r}"
            )
        if type(self.topk_multiple) is not int or self.topk_multiple < 1:
            raise ValueError(
                f"Capabilities.topk_multiple must be an int >= 1, got {self.topk_multiple!r}"
            )
        for name in ("tile_queries", "tile_keys", "kv_splits", "max_call_work", "distinct_shapes"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"Capabilities.{name} must be an int >= 0, got {value!r}")
        if any(type(d) is not int or d < 0 for d in self.head_dims):
            raise ValueError(f"Capabilities.head_dims must be ints >= 0, got {self.head_dims!r}")
        if self.window_required and not self.window:
            raise ValueError("Capabilities.window_required needs window=True")
        if self.causal_windows_only and not self.window:
            raise ValueError("Capabilities.causal_windows_only needs window=True")
        if self.sinks_required and not self.sinks:
            raise ValueError("Capabilities.sinks_required needs sinks=True")
        if self.causal_only and not self.causal_alignments:
            raise ValueError(
                "Capabilities.causal_only needs the alignment the backend computes in "
                "causal_alignments (top_left or bottom_right)"
            )
        for name, kind, other in (
            ("empty_row", EmptyRow, " or an EmptyRows (one per cause)"),
            ("masked_nan", MaskedNaN, ""),
            ("empty_lse", EmptyLse, ""),
        ):
            value = getattr(self, name)
            if value not in get_args(kind) and not (other and isinstance(value, EmptyRows)):
                raise ValueError(
                    f"Capabilities.{name} must be one of {', '.join(get_args(kind))}{other}, "
                    f"got {value!r}"
                )
        for alignment in self.causal_alignments:
            if alignment not in get_args(Alignment):
                raise ValueError(
                    f"Capabilities.causal_alignments: unknown alignment {alignment!r} "
                    "(use top_left, bottom_right)"
                )
        if not self.cp_shardings or any(s not in SHARDINGS for s in self.cp_shardings):
            raise ValueError(
                f"Capabilities.cp_shardings must name one or both of {', '.join(SHARDINGS)}, "
                f"got {self.cp_shardings!r}"
            )
        unknown = [f for f in self.fp8 if f not in FP8_FORMATS]
        if unknown:
            raise ValueError(
                f"Capabilities.fp8: unknown format {unknown[0]!r} (use {', '.join(FP8_FORMATS)})"
            )
        if self.page_multiple < 1:
            raise ValueError(f"Capabilities.page_multiple must be >= 1, got {self.page_multiple!r}")
        if self.max_head_dim is not None and self.max_head_dim < 1:
            raise ValueError(
                f"Capabilities.max_head_dim must be >= 1 or None, got {self.max_head_dim!r}"
            )

    def variants(self) -> tuple[str, ...]:
        """The variants declared (`VARIANTS`)."""
        return tuple(v for v in VARIANTS if getattr(self, v))

    @property
    def empty_rows(self) -> EmptyRows:
        """The empty-row policy of every cause (one policy declared: the same for all)."""
        if isinstance(self.empty_row, EmptyRows):
            return self.empty_row
        return EmptyRows(self.empty_row, self.empty_row, self.empty_row)

    def for_dtype(self, dtype: torch.dtype) -> "Capabilities":
        """The declaration as it holds in ``dtype``: its `empty_row_by_dtype` entry, if
        any, as ``empty_row`` (what the checks of one dtype read)."""
        name = str(dtype).removeprefix("torch.")
        pairs = self.empty_row_by_dtype
        for key, policy in pairs.items() if isinstance(pairs, dict) else pairs:
            if key == name:
                return replace(self, empty_row=policy, empty_row_by_dtype=())
        return self

    @classmethod
    def preset(cls, family: str, **changes: Any) -> "Capabilities":
        """Family ``family``'s preset (`PRESETS`) with ``changes``: how a backend of a
        family other than ``sdpa`` declares, e.g. ``Capabilities.preset("flash",
        window=False)``."""
        if family not in PRESETS:
            known = ", ".join(PRESETS) or "none is installed: import attnref.conformance.backends"
            raise ValueError(f"unknown API family {family!r}: use one of {known}")
        return replace(PRESETS[family], **changes)

    def narrow(self) -> bool:
        """Whether it declares any of the narrow-library limits (the cases then draw
        inside them; a declaration without one draws as it always has)."""
        return (
            self.self_attention_only
            or self.queries_at_most_keys
            or self.causal_only
            or not self.explicit_scale
            or self.window_required
            or self.sinks_required
            or bool(self.head_dims)
            or self.latent_values
            or self.sink_shared
            or bool(self.sink_values)
            or self.cp_equal_shards
            or self.causal_windows_only
            or self.head_dim_multiple > 1
            or self.single_query
            or not self.empty_sequences
            or self.length_multiples != (1, 1)
        )


def _check_by_dtype(pairs: object) -> None:
    from attnref.devices import DTYPES

    if type(pairs) is not tuple:
        raise ValueError(f"Capabilities.empty_row_by_dtype must be a dict or pairs, got {pairs!r}")
    for pair in pairs:
        if type(pair) is not tuple or len(pair) != 2 or pair[0] not in DTYPES:
            raise ValueError(
                f"Capabilities.empty_row_by_dtype: {pair!r} is not (dtype name, policy); "
                f"dtype names: {', '.join(DTYPES)}"
            )
        if pair[1] not in get_args(EmptyRow) and not isinstance(pair[1], EmptyRows):
            raise ValueError(
                f"Capabilities.empty_row_by_dtype[{pair[0]!r}] must be one of "
                f"{', '.join(get_args(EmptyRow))} or an EmptyRows, got {pair[1]!r}"
            )


#: each installed API family's preset: what an undeclared function of it claims, and
#: where a declaration of one starts (`Capabilities.preset`); filled by the registry
PRESETS: dict[str, Capabilities] = {}


#: the standard dtypes: one a declaration leaves out is not audited
_STANDARD_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def not_tested(caps: Capabilities) -> list[str]:
    """What a backend's declaration leaves untested, each with the declaration that
    does: the calls its signature might take that the audit never makes (so an "OK"
    says nothing of them). The family's own variants it does not declare are left out
    (a plain SDPA backend takes no window)."""
    out: list[str] = []

    def add(off: bool, what: str, why: str) -> None:
        if off:
            out.append(f"{what} ({why})")

    missing = [str(d).removeprefix("torch.") for d in _STANDARD_DTYPES if d not in caps.dtypes]
    add(bool(missing), f"dtypes {', '.join(missing)}", "not in dtypes")
    masks = caps.bool_mask or caps.float_mask
    add(
        masks and not caps.causal_with_mask,
        "causal attention with a mask passed together",
        "causal_with_mask=False: the diagonal reaches the backend folded into the mask",
    )
    add(
        caps.causal_square_only,
        "its own causal flag with Tq != Tk",
        "causal_square_only=True: the diagonal reaches the backend folded into the mask",
    )
    rows = caps.empty_rows
    undefined = [
        c for c in ("bool_mask", "float_mask", "causal") if getattr(rows, c) == "undefined"
    ]
    if rows.causal_masked == "undefined" and "causal" not in undefined:
        undefined.append("causal_masked")
    add(
        bool(undefined),
        "the output of a query with no visible key (" + ", ".join(undefined) + ")",
        "empty_row 'undefined', as the library documents it: such rows are not judged",
    )
    add(not caps.bool_mask, "boolean masks", "bool_mask=False")
    add(not caps.float_mask, "float (additive) masks", "float_mask=False")
    add(not caps.gqa, "grouped-query attention", "gqa=False")
    others = [a for a in ("top_left", "bottom_right") if a not in caps.causal_alignments]
    add(
        bool(others),
        f"the {' and '.join(others)} causal alignment computed by the backend",
        f"causal_alignments={caps.causal_alignments!r}: "
        + ("it reaches the backend as a mask" if masks else "never drawn"),
    )
    add(not caps.distinct_value_dim, "Dv != Dqk", "distinct_value_dim=False")
    add(
        caps.max_head_dim is not None,
        f"head dims above {caps.max_head_dim}",
        f"max_head_dim={caps.max_head_dim}",
    )
    add(bool(caps.head_dims), "head dims other than those listed", f"head_dims={caps.head_dims}")
    add(not caps.zero_head_dim, "Dqk = 0", "zero_head_dim=False")
    add(
        caps.latent_values,
        "values other than the keys' leading dims, several key/value heads",
        "latent_values=True: a property that changes V apart from K is skipped",
    )
    add(not caps.gradients, "gradients", "gradients=False")
    add(not caps.explicit_scale, "an explicit scale", "explicit_scale=False")
    add(caps.self_attention_only, "Tq != Tk", "self_attention_only=True")
    add(
        caps.queries_at_most_keys and not caps.self_attention_only,
        "Tq > Tk",
        "queries_at_most_keys=True",
    )
    add(caps.causal_only, "non-causal calls", "causal_only=True")
    add(caps.window_required, "calls without a window", "window_required=True")
    add(caps.single_query, "more than one query a sequence", "single_query=True")
    add(not caps.empty_sequences, "sequences with no key", "empty_sequences=False")
    add(
        caps.head_dim_multiple > 1,
        f"head dims that are not multiples of {caps.head_dim_multiple}",
        f"head_dim_multiple={caps.head_dim_multiple}",
    )
    add(
        caps.length_multiples != (1, 1),
        "query and key lengths that are not multiples of {} and {}".format(*caps.length_multiples),
        f"length_multiples={caps.length_multiples}",
    )
    add(
        caps.causal_windows_only,
        "windows that reach past the query (right > 0)",
        "causal_windows_only=True",
    )
    add(caps.sinks_required, "calls without sink logits", "sinks_required=True")
    add(caps.cp_full_group, "calls on a subgroup of the ranks", "cp_full_group=True")
    others = [s for s in SHARDINGS if s not in caps.cp_shardings]
    add(
        bool(others),
        f"{' and '.join(others)} shards",
        f"cp_shardings={caps.cp_shardings!r}",
    )
    add(
        caps.cp_equal_shards,
        "sequences that cut into chunks of unequal lengths",
        "cp_equal_shards=True: such a call runs at a smaller world size, or not at all",
    )
    variants = sum((caps.window, caps.softcap, caps.alibi, caps.sinks))
    add(
        variants > 1 and not caps.combined_variants,
        "several variants in one call",
        "combined_variants=False",
    )
    add(
        bool(caps.refuses),
        "inputs the backend refuses with an error it names",
        f"refuses={caps.refuses!r}: each such case is counted as refused",
    )
    return out


def register_preset(name: str, preset: Capabilities) -> None:
    """Make ``preset`` family ``name``'s (what installing a family does)."""
    if preset.family != name:
        raise ValueError(f"the preset of family {name!r} names family {preset.family!r}")
    PRESETS[name] = preset


@dataclass(frozen=True)
class Backend:
    """A named attention implementation under audit."""

    name: str
    fn: SDPA
    description: str
    capabilities: Capabilities = field(default_factory=Capabilities)
    # entered around every call (e.g. forcing one torch SDPBackend)
    context: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    # try a small call first: a backend that cannot run at all here is skipped, not failed
    probe: bool = False
    #: the calling convention (an API family: `attnref.conformance.family.get_family`)
    api: str = DEFAULT_API
    #: a module the backend needs; without it the backend is skipped with the reason
    needs: str | None = None
    #: how a worker resolves it (`resolve_backend`'s spec; "": its name)
    spec: str = ""

    def __post_init__(self) -> None:
        family = self.capabilities.family
        if family != self.api:
            raise BackendError(family_mismatch(self.name, family, self.api))

    def available(self, device: str) -> str | None:
        """``None`` if the backend can run on ``device``, else why not: what its
        declaration says. Whether its package is there and a probe call runs is asked of
        the worker (`attnref.conformance.calls.availability`)."""
        if device not in self.capabilities.devices:
            return f"{self.name} does not run on {device}"
        if device == "cuda" and not torch.cuda.is_available():
            return "no CUDA device is present"
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.context():
            return self.fn(*args, **kwargs)


def family_mismatch(name: str, declared: str, api: str) -> str:
    """Why a declaration that starts from family ``declared``'s preset cannot be read as
    one of family ``api``."""
    return (
        f"{name} declares Capabilities that start from the {declared!r} family's defaults, "
        f"but it is audited in the {api!r} family, whose defaults differ (masks, causal "
        f"alignment, dtypes, the LSE): start the declaration from that family's preset, "
        f"Capabilities.preset({api!r}, ...) or dataclasses.replace(PRESETS[{api!r}], ...), "
        f"or audit it in its own family (--api {declared})"
    )


def _runs_in_its_worker(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("this backend was declared by its worker: its code runs only there")


def declaration(backend: Backend) -> dict[str, Any]:
    """What ``backend`` declares, as plain data (what a worker sends the judge)."""
    caps: dict[str, Any] = {}
    for f in fields(Capabilities):
        value = getattr(backend.capabilities, f.name)
        if f.name == "dtypes":
            value = [str(d).removeprefix("torch.") for d in value]
        elif isinstance(value, EmptyRows):
            value = _rows_data(value)
        elif f.name == "empty_row_by_dtype":
            value = [[d, _rows_data(p) if isinstance(p, EmptyRows) else p] for d, p in value]
        elif f.name == "sink_values":
            value = [repr(v) for v in value]  # -inf and inf as text: JSON has no infinity
        elif isinstance(value, tuple):
            value = list(value)
        caps[f.name] = value
    return {
        "name": backend.name,
        "description": backend.description,
        "api": backend.api,
        "probe": backend.probe,
        "needs": backend.needs,
        "spec": backend.spec or backend.name,
        "capabilities": caps,
    }


def _rows_data(rows: EmptyRows) -> dict[str, Any]:
    return {f.name: getattr(rows, f.name) for f in fields(EmptyRows)}


def _rows_from(value: object, where: str) -> EmptyRow | EmptyRows:
    if type(value) is dict:
        names = {f.name for f in fields(EmptyRows)}
        if set(value) != names:
            raise ValueError(f"{where} must name the fields {sorted(names)}")
        if not all(v is None or type(v) is str for v in value.values()):
            raise ValueError(f"{where}: each policy must be a string")
        return EmptyRows(**value)
    if type(value) is not str or value not in get_args(EmptyRow):
        raise ValueError(f"{where} must be one of {', '.join(get_args(EmptyRow))}")
    return value  # type: ignore[return-value]


def _strings(value: object, what: str) -> tuple[str, ...]:
    if type(value) is not list or not all(type(x) is str for x in value):
        raise ValueError(f"{what} must be a list of strings, got {str(value)[:100]}")
    return tuple(value)


def from_declaration(data: object) -> Backend:
    """The `Backend` a worker declared, checked field by field; its code stays there.

    Raises:
        ValueError: a field is missing, unknown, or of the wrong type or value.
    """
    if type(data) is not dict:
        raise ValueError(f"a declaration must be a dict, got {type(data).__name__}")
    expected = {"name", "description", "api", "probe", "needs", "spec", "capabilities"}
    if set(data) != expected:
        raise ValueError(f"a declaration has the fields {sorted(expected)}, got {sorted(data)}")
    for key in ("name", "description", "api", "spec"):
        if type(data[key]) is not str:
            raise ValueError(f"the declaration's {key} must be a string")
    if type(data["probe"]) is not bool or not (data["needs"] is None or type(data["needs"]) is str):
        raise ValueError("the declaration's probe must be a bool and needs a string or None")
    raw = data["capabilities"]
    defaults = Capabilities()
    names = {f.name for f in fields(Capabilities)}
    if type(raw) is not dict:
        raise ValueError(f"capabilities must be a dict, got {type(raw).__name__}")
    if set(raw) != names:
        missing, unknown = sorted(names - set(raw)), sorted(str(k) for k in set(raw) - names)
        said = [f"lack {', '.join(missing[:5])}" if missing else "",
                f"have unknown {', '.join(unknown[:5])}" if unknown else ""]  # fmt: skip
        raise ValueError(
            f"capabilities must have the fields of this attnref's Capabilities: they "
            f"{' and '.join(x for x in said if x)} (written by another version of attnref?)"
        )
    caps: dict[str, Any] = {}
    for name, value in raw.items():
        default = getattr(defaults, name)
        where = f"capabilities.{name}"
        if name == "dtypes":
            from attnref.devices import DTYPES

            names_given = _strings(value, where)
            unknown = [d for d in names_given if d not in DTYPES]
            if unknown:
                raise ValueError(f"{where}: unknown dtype {unknown[0]!r}")
            caps[name] = tuple(DTYPES[d] for d in names_given)
        elif name == "empty_row":
            caps[name] = _rows_from(value, where)
        elif name == "empty_row_by_dtype":
            if type(value) is not list or not all(
                type(x) is list and len(x) == 2 and type(x[0]) is str for x in value
            ):
                raise ValueError(f"{where} must be a list of [dtype, policy] pairs")
            caps[name] = tuple((d, _rows_from(p, f"{where}[{d!r}]")) for d, p in value)
        elif name in ("head_dims", "length_multiples"):
            if type(value) is not list or not all(type(x) is int for x in value):
                raise ValueError(f"{where} must be a list of ints")
            caps[name] = tuple(value)
        elif name == "sink_values":
            try:
                caps[name] = tuple(float(x) for x in _strings(value, where))
            except ValueError:
                raise ValueError(f"{where} must be numbers, got {str(value)[:100]}") from None
        elif isinstance(default, tuple):
            caps[name] = _strings(value, where)
        elif name == "max_head_dim":
            if not (value is None or type(value) is int):
                raise ValueError(f"{where} must be an int or None")
            caps[name] = value
        elif type(default) is not type(value):
            raise ValueError(f"{where} must be a {type(default).__name__}, got {str(value)[:50]}")
        else:
            caps[name] = value
    if caps["family"] != data["api"]:
        raise ValueError(family_mismatch(data["name"], caps["family"], data["api"]))
    return Backend(
        data["name"],
        _runs_in_its_worker,
        data["description"][:500],
        Capabilities(**caps),
        api=data["api"],
        probe=data["probe"],
        needs=data["needs"],
        spec=data["spec"],
    )
