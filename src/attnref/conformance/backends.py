"""Backends: callables of an API family, plus what they declare they support.

A plain function with no declaration is taken to claim its family's defaults, its
preset (`PRESETS`): for torch SDPA's family, top-left causal alignment only,
``is_causal`` not combined with a mask, zeros for a query with no visible key, every
float dtype, boolean and float masks, GQA through ``enable_gqa``; for the flash
families, what FlashAttention 2 documents (`FLASH_ATTN_2`). A declaration starts from
one family's preset and names it (`Capabilities.family`): `Capabilities.preset` or
``replace(FLASH_ATTN_2, ...)``. One that starts from another family's defaults is an
error, never read silently as that family's.
"""

import contextlib
import functools
import importlib
import importlib.util
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args

import torch
from jaxtyping import Float, Int
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked
from attnref.conformance.adapt import flash_form, kvcache_form, varlen_form
from attnref.kvcache import kvcache_attention
from attnref.masks import Alignment
from attnref.varlen import varlen_attention

__all__ = [
    "BUILTIN_BACKENDS",
    "FLASH_ATTN_2",
    "FLASH_ATTN_2_KVCACHE",
    "FLASH_ATTN_2_VARLEN",
    "PRESETS",
    "SDPA_DEFAULTS",
    "VARIANTS",
    "Backend",
    "BackendError",
    "Capabilities",
    "EmptyLse",
    "EmptyRows",
    "declaration",
    "from_declaration",
    "resolve_backend",
]

#: a backend's function: it returns a tensor, or a tuple when asked for the LSE
SDPA = Callable[..., Any]
#: the output for a query with no visible key: zeros, NaN, the mean of V ("uniform": a
#: finite fill that *replaces* the hidden scores, as ``masked_fill(~mask, finfo.min)``),
#: or "unmasked": attention over the keys the mask hid, as if it hid none (a finite fill
#: *added* to the scores, as diffusers' ``-10000``: every score of the row moves alike)
EmptyRow = Literal["zero", "nan", "uniform", "unmasked"]
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
    folds its diagonal into the mask it is given, with a finite fill).
    """

    bool_mask: EmptyRow = "zero"
    float_mask: EmptyRow = "zero"
    causal: EmptyRow = "zero"
    causal_masked: EmptyRow | None = None

    def __post_init__(self) -> None:
        for name in (*get_args(Cause), "causal_masked"):
            value = getattr(self, name)
            if value not in get_args(EmptyRow) and not (name == "causal_masked" and value is None):
                raise ValueError(
                    f"EmptyRows.{name} must be one of {', '.join(get_args(EmptyRow))}, "
                    f"got {value!r}"
                )

    def of(self, cause: Cause, masked: bool = False) -> EmptyRow:
        """The policy of a row that ``cause`` empties (``masked``: in a call that was
        also passed a mask)."""
        if cause == "causal" and masked and self.causal_masked is not None:
            return self.causal_masked
        policy: EmptyRow = getattr(self, cause)
        return policy

    def policies(self) -> set[EmptyRow]:
        return {self.of(c, m) for c in get_args(Cause) for m in (False, True)}


class BackendError(Exception):
    """A backend could not be resolved or does not have SDPA's signature."""


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
    family: str = "sdpa"
    dtypes: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    devices: tuple[str, ...] = ("cpu", "cuda")
    bool_mask: bool = True
    float_mask: bool = True
    gqa: bool = True
    # alignments the backend computes itself through a `causal_alignment` keyword; any
    # other alignment reaches it as an explicit boolean mask
    causal_alignments: tuple[Alignment, ...] = ("top_left",)
    causal_with_mask: bool = False  # may `is_causal=True` be combined with `attn_mask`?
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
    softcap: bool = False  # softcap * tanh(score / softcap)
    alibi: bool = False  # ALiBi slopes, (h,) or (B, h)
    sinks: bool = False  # one sink logit per query head
    lse: bool = False  # returns the log-sum-exp on request
    empty_lse: EmptyLse = "-inf"  # the log-sum-exp of a query with no visible key
    combined_variants: bool = True  # may several variants be on in one call?
    # the decode calls of the flash-kvcache family (docs/kvcache.md)
    rotary: bool = False  # rotary_cos / rotary_sin for the new tokens, both layouts
    paged: bool = False  # a paged cache through block_table
    page_multiple: int = 1  # page sizes must be multiples of this (FlashAttention 2: 256)
    # narrow libraries: what they take of the whole space
    #: only self-attention: queries and keys of one length (Tq = Tk); cases are drawn so,
    #: and a property that needs Tq != Tk (decode, merge) is skipped
    self_attention_only: bool = False
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

    def __post_init__(self) -> None:
        by_dtype: object = self.empty_row_by_dtype
        if isinstance(by_dtype, dict):
            object.__setattr__(self, "empty_row_by_dtype", tuple(by_dtype.items()))
        _check_by_dtype(self.empty_row_by_dtype)
        if self.family not in PRESET_NAMES:
            raise ValueError(
                f"Capabilities.family must be one of {', '.join(PRESET_NAMES)}, got {self.family!r}"
            )
        values = tuple(float(v) for v in self.sink_values)
        if any(math.isnan(v) for v in values):
            raise ValueError(
                f"Capabilities.sink_values must not hold NaN, got {self.sink_values!r}"
            )
        object.__setattr__(self, "sink_values", values)
        if any(type(d) is not int or d < 0 for d in self.head_dims):
            raise ValueError(f"Capabilities.head_dims must be ints >= 0, got {self.head_dims!r}")
        if self.window_required and not self.window:
            raise ValueError("Capabilities.window_required needs window=True")
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
            raise ValueError(f"unknown API family {family!r}: use one of {', '.join(PRESETS)}")
        return replace(PRESETS[family], **changes)

    def narrow(self) -> bool:
        """Whether it declares any of the narrow-library limits (the cases then draw
        inside them; a declaration without one draws as it always has)."""
        return (
            self.self_attention_only
            or self.causal_only
            or not self.explicit_scale
            or self.window_required
            or bool(self.head_dims)
            or self.sink_shared
            or bool(self.sink_values)
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


#: the API families that have a preset (`PRESETS`)
PRESET_NAMES = ("sdpa", "flash", "flash-varlen", "flash-kvcache")


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
    #: the calling convention (`attnref.conformance.families.FAMILIES`)
    api: str = "sdpa"
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
        f"Capabilities.preset({api!r}, ...) or dataclasses.replace(PRESETS[{api!r}], ...)"
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
    if type(raw) is not dict or set(raw) != names:
        raise ValueError(f"capabilities must have the fields of Capabilities, got {str(raw)[:200]}")
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
        elif name == "head_dims":
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


def _reference(*args: Any, **kwargs: Any) -> Any:
    return F.scaled_dot_product_attention(*args, **kwargs)


def _reference_chunked(*args: Any, **kwargs: Any) -> Any:
    return F.chunked_attention(*args, **kwargs, block_size=4)


def _naive(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **variants: Any,
) -> Any:
    """Textbook attention materialised with plain torch ops, in the inputs' dtype.

    ``softmax(Q K^T * scale + mask) V``: `attnref.conformance.kernels.materialised` with
    every switch off (scores and softmax in float32, probabilities rounded to the inputs'
    dtype before ``P @ V``, zeros for a query with no visible key), and the variants
    (``causal_alignment``, ``window``, ``softcap``, ``alibi_slopes``, ``sinks``,
    ``return_lse``) as keywords.
    """
    if dropout_p != 0.0:
        raise ValueError("the naive backend has no dropout")
    from attnref.conformance.kernels import materialised

    return materialised(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, **variants)


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    """FlexAttention compiled once, for every shape (FlexAttention's fused path on CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled: Callable[..., Tensor] = torch.compile(flex_attention, dynamic=True)
    return compiled


def _flex(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_alignment: Alignment = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """FlexAttention: the mask, softcap and ALiBi as a ``score_mod``, the causal diagonal
    and the window as a ``mask_mod`` (a block mask); eager on the CPU, compiled on CUDA.
    Its log-sum-exp comes from ``return_aux``; sinks are applied from it afterwards
    (`attnref.functional.apply_sinks`), on a call in float32 for half-precision inputs,
    so that the output is rounded to their dtype once.

    Every setting reaches the two functions as a tensor, and both always apply every
    modifier (a neutral one when off): FlexAttention traces them with Dynamo even in
    eager mode, and a Python number or a new branch in them would trace again on every
    call with a new value (about a second each on a CPU).
    """
    import warnings

    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    if dropout_p != 0.0:
        raise ValueError("FlexAttention has no dropout")
    batch = query.shape[:-3]
    h, Tq, Tk = query.shape[-3], query.shape[-2], key.shape[-2]
    B = math.prod(batch)
    device = query.device
    q, k, v = (t.reshape(B, *t.shape[-3:]) for t in (query, key, value))
    ctype = torch.promote_types(query.dtype, torch.float32)  # what the scores are in
    if sinks is not None:  # the sink factor joins before the one rounding to the dtype
        q, k, v = q.to(ctype), k.to(ctype), v.to(ctype)
    if attn_mask is None:
        bias = torch.zeros((1, 1, 1, 1), device=device, dtype=ctype)
    else:
        full = attn_mask.expand(*batch, h, Tq, Tk).reshape(B, h, Tq, Tk)
        bias = (
            torch.zeros(full.shape, device=device, dtype=ctype).masked_fill(~full, -math.inf)
            if full.dtype == torch.bool
            else full.to(ctype)
        )
    masked = attn_mask is not None  # a branch fixed for the mask's lifetime
    slopes = torch.zeros((B, h), device=device, dtype=ctype)
    if alibi_slopes is not None:  # in the scores' dtype: m * |i - j| is not rounded
        slopes = alibi_slopes.to(ctype).reshape(-1, h).expand(B, h)
    offset = torch.tensor(0 if causal_alignment == "top_left" else Tk - Tq, device=device)
    cap = torch.tensor(float(softcap), device=device)
    left, right = (torch.tensor(w, device=device) for w in (window or (-1, -1)))
    causal = torch.tensor(is_causal, device=device)

    def score_mod(score: Tensor, b: Tensor, hh: Tensor, qi: Tensor, kj: Tensor) -> Tensor:
        capped = cap * torch.tanh(score / torch.where(cap > 0, cap, 1.0))
        score = torch.where(cap > 0, capped, score)
        score = score - slopes[b, hh] * (qi + offset - kj).abs()
        if masked:
            score = score + bias[b, hh, qi, kj]
        return score

    def mask_mod(b: Tensor, hh: Tensor, qi: Tensor, kj: Tensor) -> Tensor:
        pos = qi + offset
        seen = ~causal | (kj <= pos)
        return seen & ((left < 0) | (kj >= pos - left)) & ((right < 0) | (kj <= pos + right))

    fn: Callable[..., Any] = flex_attention
    if device.type == "cuda":
        fn = _compiled_flex()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        block_mask = create_block_mask(mask_mod, None, None, Tq, Tk, device=device)
        out, aux = fn(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=h != k.shape[-3],
            return_aux=AuxRequest(lse=True),
        )
    out = out.reshape(*batch, h, Tq, value.shape[-1])
    lse = aux.lse.reshape(*batch, h, Tq)
    if sinks is not None:
        out = F.apply_sinks(out, lse, sinks).to(query.dtype)
    return (out, lse) if return_lse else out


def _sdpa_with_bias(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_alignment: Alignment = "top_left",
    window: tuple[int, int] | None = None,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """torch SDPA with the variants a float mask can express: the causal diagonal (any
    alignment), the window as ``-inf`` and ALiBi as ``-m |i - j|``, added to the mask."""
    from attnref.masks import causal_mask, sliding_window_mask

    Tq, Tk = query.shape[-2], key.shape[-2]
    ctype = torch.promote_types(query.dtype, torch.float32)
    bias = torch.zeros((Tq, Tk), dtype=ctype, device=query.device)
    if alibi_slopes is not None:
        offset = 0 if causal_alignment == "top_left" else Tk - Tq
        rows = torch.arange(Tq, device=query.device).unsqueeze(-1) + offset
        distance = (rows - torch.arange(Tk, device=query.device)).abs().to(ctype)
        bias = -alibi_slopes.to(ctype).reshape(*alibi_slopes.shape, 1, 1) * distance
    seen = torch.ones((Tq, Tk), dtype=torch.bool, device=query.device)
    if is_causal:
        seen = seen & causal_mask(Tq, Tk, causal_alignment, device=query.device)
    if window is not None:
        seen = seen & sliding_window_mask(Tq, Tk, window, causal_alignment, query.device)
    bias = bias.masked_fill(~seen, -math.inf)
    if attn_mask is not None:
        bias = (
            bias.masked_fill(~attn_mask, -math.inf)
            if attn_mask.dtype == torch.bool
            else bias + attn_mask.to(ctype)
        )
    if alibi_slopes is not None and alibi_slopes.dim() > 1:  # (*batch, h) slopes
        bias = bias.expand(*query.shape[:-1], Tk)
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, bias.to(query.dtype), dropout_p, scale=scale, enable_gqa=enable_gqa
    )
    return out


def _force(
    backend: "torch.nn.attention.SDPBackend",
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        import warnings

        from torch.nn.attention import sdpa_kernel

        # a forced kernel that refuses an input warns why before it raises; the error
        # is the verdict, the warning only noise
        with sdpa_kernel(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield

    return ctx


# a forced kernel may refuse inputs it does not handle ("No available kernel"): a skip
_FORCED_CAPS = Capabilities(refuses=("No available kernel",))
#: every variant, and the log-sum-exp with -inf for a query with no visible key
_ALL_VARIANTS: dict[str, Any] = {
    "window": True,
    "softcap": True,
    "alibi": True,
    "sinks": True,
    "lse": True,
}
# eager FlexAttention has no backward on the CPU, and says so
# and divides by sqrt(Dqk) in Python, so Dqk = 0 raises ZeroDivisionError
_FLEX_CAPS = Capabilities(
    dropout=False,
    zero_head_dim=False,
    refuses=("does not support backward on CPU",),
    causal_alignments=("top_left", "bottom_right"),
    **_ALL_VARIANTS,
)
_REFERENCE_CAPS = Capabilities(
    causal_alignments=("top_left", "bottom_right"),
    causal_with_mask=True,
    masked_nan="contained",
    **_ALL_VARIANTS,
)
_NAIVE_CAPS = Capabilities(
    dropout=False, causal_alignments=("top_left", "bottom_right"), **_ALL_VARIANTS
)


def _flash_caps(caps: Capabilities, family: str = "flash") -> Capabilities:
    """``caps`` as a flash-convention backend of ``family`` declares them: no masks,
    bottom-right."""
    return replace(
        caps,
        family=family,
        bool_mask=False,
        float_mask=False,
        causal_alignments=("bottom_right",),
        causal_with_mask=False,
    )


#: what FlashAttention 2 documents for flash_attn_func (its README and docstring):
#: fp16 and bf16, head dims up to 256 with Dv = Dqk, bottom-right causal, a window,
#: softcap, ALiBi, the log-sum-exp (+inf for a query with no visible key), no sinks, no
#: masks. The preset of the ``flash`` family: the default of an undeclared ``--api
#: flash`` function, and where a declaration of one starts (``replace(FLASH_ATTN_2, ...)``)
FLASH_ATTN_2 = Capabilities(
    family="flash",
    dtypes=(torch.float16, torch.bfloat16),
    bool_mask=False,
    float_mask=False,
    causal_alignments=("bottom_right",),
    zero_head_dim=False,
    max_head_dim=256,
    distinct_value_dim=False,
    window=True,
    softcap=True,
    alibi=True,
    lse=True,
    empty_lse="+inf",
)


#: the ``flash-varlen`` family's preset: FlashAttention 2 documents flash_attn_varlen_func
#: as flash_attn_func
FLASH_ATTN_2_VARLEN = replace(FLASH_ATTN_2, family="flash-varlen")
#: the ``flash-kvcache`` family's preset: flash_attn_with_kvcache has no backward, and
#: takes rotary and a paged cache (pages of a multiple of 256 tokens)
FLASH_ATTN_2_KVCACHE = replace(
    FLASH_ATTN_2,
    family="flash-kvcache",
    gradients=False,
    rotary=True,
    paged=True,
    page_multiple=256,
)
#: the ``sdpa`` family's preset: torch SDPA's semantics (`Capabilities()`)
SDPA_DEFAULTS = Capabilities()
#: each API family's preset: what an undeclared function of it claims, and where a
#: declaration of one starts (`Capabilities.preset`)
PRESETS: dict[str, Capabilities] = {
    "sdpa": SDPA_DEFAULTS,
    "flash": FLASH_ATTN_2,
    "flash-varlen": FLASH_ATTN_2_VARLEN,
    "flash-kvcache": FLASH_ATTN_2_KVCACHE,
}


def _flash_attn(*args: Any, **kwargs: Any) -> Any:
    """FlashAttention 2's ``flash_attn_func`` (the ``flash_attn`` package, CUDA only)."""
    from flash_attn import flash_attn_func

    return flash_attn_func(*args, **kwargs)


def _declared(fn: Callable[..., Any], caps: Capabilities) -> Callable[..., Any]:
    fn.capabilities = caps  # type: ignore[attr-defined]
    return fn


#: the reference, FlexAttention and the naive kernel in the flash convention, as plain
#: functions with their declarations: ``attnref audit --api flash --backend
#: attnref.conformance.backends:flash_reference`` audits one as a user's kernel
flash_reference = _declared(flash_form(_reference, "flash_reference"), _flash_caps(_REFERENCE_CAPS))
flash_reference_chunked = _declared(
    flash_form(_reference_chunked, "flash_reference_chunked"),
    _flash_caps(replace(_REFERENCE_CAPS, dropout=False)),
)
flash_naive = _declared(flash_form(_naive, "flash_naive"), _flash_caps(_NAIVE_CAPS))
flash_flex = _declared(flash_form(_flex, "flash_flex"), _flash_caps(_FLEX_CAPS))


@checked
def _varlen_reference(
    q: Float[Tensor, "total_q h Dh"],
    k: Float[Tensor, "total_k g Dh"],
    v: Float[Tensor, "total_k g Dv"],
    cu_seqlens_q: Int[Tensor, " Nq"],
    cu_seqlens_k: Int[Tensor, " Nk"],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "N h"] | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    sinks: Float[Tensor, " h"] | None = None,
) -> (
    Float[Tensor, "total_q h Dv"]
    | tuple[Float[Tensor, "total_q h Dv"], Float[Tensor, "h total_q"], None]
):
    """attnref's `attnref.varlen.varlen_attention` in flash_attn_varlen_func's signature."""
    if dropout_p:
        raise ValueError(f"dropout_p must be 0 here, got {dropout_p}")
    kwargs: dict[str, Any] = {
        "softmax_scale": softmax_scale,
        "causal": causal,
        "window_size": window_size,
        "softcap": softcap,
        "alibi_slopes": alibi_slopes,
        "sinks": sinks,
    }
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if return_attn_probs:
        out, lse = varlen_attention(*args, return_lse=True, **kwargs)
        return out, lse, None
    result: Tensor = varlen_attention(*args, **kwargs)
    return result


_VARLEN_REFERENCE_CAPS = _flash_caps(replace(_REFERENCE_CAPS, dropout=False), "flash-varlen")
_SERVING = {"gradients": False, "sinks": False, "rotary": True, "paged": True, "dropout": False}
#: the packed and paged conventions (flash_attn_varlen_func, flash_attn_with_kvcache):
#: the reference itself, and the naive kernel and torch SDPA (with the window and ALiBi
#: folded into a float mask) driven sequence by sequence, row by row
varlen_reference = _declared(_varlen_reference, _VARLEN_REFERENCE_CAPS)
varlen_naive = _declared(
    varlen_form(flash_naive, "varlen_naive"), _flash_caps(_NAIVE_CAPS, "flash-varlen")
)
_SDPA_BIAS_CAPS = Capabilities(
    dtypes=(torch.float64, torch.float32),
    causal_alignments=("top_left", "bottom_right"),
    causal_with_mask=True,
    window=True,
    alibi=True,
)
varlen_sdpa = _declared(
    varlen_form(flash_form(_sdpa_with_bias, "flash_sdpa"), "varlen_sdpa"),
    _flash_caps(replace(_SDPA_BIAS_CAPS, gradients=True), "flash-varlen"),
)
kvcache_flex = _declared(
    kvcache_form(flash_flex, "kvcache_flex"),
    _flash_caps(replace(_FLEX_CAPS, **_SERVING), "flash-kvcache"),  # type: ignore[arg-type]
)
kvcache_reference = _declared(
    kvcache_attention,
    _flash_caps(replace(_REFERENCE_CAPS, **_SERVING), "flash-kvcache"),  # type: ignore[arg-type]
)
kvcache_naive = _declared(
    kvcache_form(flash_naive, "kvcache_naive"),
    _flash_caps(replace(_NAIVE_CAPS, **_SERVING), "flash-kvcache"),  # type: ignore[arg-type]
)
kvcache_sdpa = _declared(
    kvcache_form(flash_form(_sdpa_with_bias, "flash_sdpa"), "kvcache_sdpa"),
    _flash_caps(replace(_SDPA_BIAS_CAPS, **_SERVING), "flash-kvcache"),  # type: ignore[arg-type]
)


def _doc_ids(cu: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Each token's sequence (-1 for padding after the pack) and position in it."""
    device = cu.device
    lengths = (cu[1:] - cu[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    pos = torch.arange(doc.numel(), device=device) - cu[:-1].long()[doc]
    pad = total - doc.numel()
    minus = torch.full((pad,), -1, dtype=torch.long, device=device)
    return torch.cat([doc, minus]), torch.cat([pos, torch.zeros_like(minus)])


@checked
def _varlen_flex(
    q: Float[Tensor, "total_q h Dh"],
    k: Float[Tensor, "total_k g Dh"],
    v: Float[Tensor, "total_k g Dv"],
    cu_seqlens_q: Int[Tensor, " Nq"],
    cu_seqlens_k: Int[Tensor, " Nk"],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Float[Tensor, " h"] | Float[Tensor, "N h"] | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    sinks: Float[Tensor, " h"] | None = None,
) -> (
    Float[Tensor, "total_q h Dv"]
    | tuple[Float[Tensor, "total_q h Dv"], Float[Tensor, "h total_q"], None]
):
    """FlexAttention's document masking (attention-gym's recipe): the whole pack in one
    call, a ``mask_mod`` that lets a query see only keys of its own sequence, causal and
    windowed at the sequence's own bottom-right offset, and softcap and ALiBi in a
    ``score_mod`` at the sequence's own distances. Settings reach both as tensors (see
    `_flex`)."""
    import warnings

    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    if dropout_p != 0.0:
        raise ValueError("FlexAttention has no dropout")
    device = q.device
    total_q, h, _ = q.shape
    total_k, g = k.shape[0], k.shape[1]
    if total_q == 0 or total_k == 0:  # FlexAttention takes no empty sequence: no key
        lse_dtype = torch.promote_types(q.dtype, torch.float32)
        empty = q.new_zeros((total_q, h, v.shape[-1]))
        no_key = torch.full((h, total_q), -math.inf, dtype=lse_dtype, device=device)
        return (empty, no_key, None) if return_attn_probs else empty
    doc_q, pos_q = _doc_ids(cu_seqlens_q, total_q)
    doc_k, pos_k = _doc_ids(cu_seqlens_k, total_k)
    lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    offset = torch.cat([lengths_k - lengths_q, torch.zeros(1, dtype=torch.long, device=device)])
    ctype = torch.promote_types(q.dtype, torch.float32)
    N = lengths_q.numel()
    slopes = torch.zeros((N + 1, h), device=device, dtype=ctype)
    if alibi_slopes is not None:
        slopes[:N] = alibi_slopes.to(ctype).reshape(-1, h).expand(N, h)
    cap = torch.tensor(float(softcap), device=device)
    left, right = (torch.tensor(w, device=device) for w in window_size)
    is_causal = torch.tensor(causal, device=device)

    def score_mod(score: Tensor, b: Tensor, hh: Tensor, qi: Tensor, kj: Tensor) -> Tensor:
        capped = cap * torch.tanh(score / torch.where(cap > 0, cap, 1.0))
        score = torch.where(cap > 0, capped, score)
        d = doc_q[qi]
        return score - slopes[d, hh] * (pos_q[qi] + offset[d] - pos_k[kj]).abs()

    def mask_mod(b: Tensor, hh: Tensor, qi: Tensor, kj: Tensor) -> Tensor:
        d = doc_q[qi]
        pos, kpos = pos_q[qi] + offset[d], pos_k[kj]
        seen = (d >= 0) & (d == doc_k[kj]) & (~is_causal | (kpos <= pos))
        return seen & ((left < 0) | (kpos >= pos - left)) & ((right < 0) | (kpos <= pos + right))

    fn: Callable[..., Any] = flex_attention
    if device.type == "cuda":
        fn = _compiled_flex()
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, T, D)
    if sinks is not None:
        qh, kh, vh = qh.to(ctype), kh.to(ctype), vh.to(ctype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        block_mask = create_block_mask(mask_mod, None, None, total_q, total_k, device=device)
        out, aux = fn(
            qh, kh, vh, score_mod=score_mod, block_mask=block_mask, scale=softmax_scale,
            enable_gqa=h != g, return_aux=AuxRequest(lse=True),
        )  # fmt: skip
    lse = aux.lse
    if sinks is not None:
        out = F.apply_sinks(out, lse, sinks).to(q.dtype)
    packed = out[0].transpose(0, 1)
    return (packed, lse[0], None) if return_attn_probs else packed


varlen_flex = _declared(
    _varlen_flex, _flash_caps(replace(_FLEX_CAPS, gradients=False), "flash-varlen")
)


def _flash_attn_varlen(*args: Any, **kwargs: Any) -> Any:
    """FlashAttention 2's ``flash_attn_varlen_func`` (the ``flash_attn`` package)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(*args, **kwargs)


def _flash_attn_kvcache(*args: Any, **kwargs: Any) -> Any:
    """FlashAttention 2's ``flash_attn_with_kvcache`` (the ``flash_attn`` package)."""
    from flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache(*args, **kwargs)


def _builtin() -> dict[str, Backend]:
    from torch.nn.attention import SDPBackend

    torch_sdpa = torch.nn.functional.scaled_dot_product_attention
    return {
        b.name: b
        for b in [
            Backend(
                "reference", _reference, "attnref's reference, in the case's dtype", _REFERENCE_CAPS
            ),
            Backend(
                "reference-chunked",
                _reference_chunked,
                "attnref's online-softmax chunked attention, blocks of 4 keys",
                _REFERENCE_CAPS,
            ),
            Backend("torch-sdpa", torch_sdpa, "torch SDPA, default dispatch"),
            Backend(
                "torch-sdpa-math",
                torch_sdpa,
                "torch SDPA with the MATH backend forced",
                context=_force(SDPBackend.MATH),
            ),
            *(
                Backend(
                    f"torch-sdpa-{name}",
                    torch_sdpa,
                    f"torch SDPA with the {kernel.name} backend forced (skipped where absent)",
                    _FORCED_CAPS,
                    context=_force(kernel),
                    probe=True,
                )
                for name, kernel in (
                    ("flash", SDPBackend.FLASH_ATTENTION),
                    ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                    ("cudnn", SDPBackend.CUDNN_ATTENTION),
                )
            ),
            Backend(
                "torch-sdpa-bias",
                _sdpa_with_bias,
                "torch SDPA with the window and ALiBi folded into its float mask",
                # not half precision: torch SDPA takes the mask in the query's dtype, and
                # rounding the ALiBi bias m * |i - j| to it grows with the distance
                _SDPA_BIAS_CAPS,
            ),
            Backend(
                "torch-flex",
                _flex,
                "FlexAttention (torch.nn.attention.flex_attention): eager on CPU, compiled on CUDA",
                _FLEX_CAPS,
            ),
            Backend(
                "naive",
                _naive,
                "textbook softmax(QK^T * scale + mask) V, materialised in the inputs' dtype",
                _NAIVE_CAPS,
            ),
            # the flash convention (FlashAttention 2's flash_attn_func)
            *(
                Backend(name, fn, description, fn.capabilities, api="flash")  # type: ignore[attr-defined]
                for name, fn, description in (
                    (
                        "flash-reference",
                        flash_reference,
                        "attnref's reference in the flash convention",
                    ),
                    (
                        "flash-reference-chunked",
                        flash_reference_chunked,
                        "attnref's chunked attention (blocks of 4 keys), flash convention",
                    ),
                    ("flash-naive", flash_naive, "the naive kernel in the flash convention"),
                    (
                        "flash-flex",
                        flash_flex,
                        "FlexAttention in the flash convention (mask_mod for causal and "
                        "window, score_mod for softcap and ALiBi)",
                    ),
                )
            ),
            Backend(
                "flash-attn",
                _flash_attn,
                "FlashAttention 2's flash_attn_func (skipped where flash_attn is absent)",
                replace(FLASH_ATTN_2, devices=("cuda",)),
                api="flash",
                needs="flash_attn",
            ),
            # packed sequences (flash_attn_varlen_func) and KV caches (flash_attn_with_kvcache)
            *(
                Backend(name, fn, description, fn.capabilities, api=api)  # type: ignore[attr-defined]
                for name, fn, description, api in (
                    (
                        "varlen-reference",
                        varlen_reference,
                        "attnref's varlen_attention",
                        "flash-varlen",
                    ),
                    (
                        "varlen-naive",
                        varlen_naive,
                        "the naive kernel, sequence by sequence",
                        "flash-varlen",
                    ),
                    (
                        "varlen-sdpa",
                        varlen_sdpa,
                        "torch SDPA (window and ALiBi as a float mask), sequence by sequence",
                        "flash-varlen",
                    ),
                    (
                        "varlen-flex",
                        varlen_flex,
                        "FlexAttention's document masking: the whole pack in one call",
                        "flash-varlen",
                    ),
                    (
                        "kvcache-reference",
                        kvcache_reference,
                        "attnref's kvcache_attention (real split-KV)",
                        "flash-kvcache",
                    ),
                    (
                        "kvcache-naive",
                        kvcache_naive,
                        "the naive kernel on each row's gathered cache",
                        "flash-kvcache",
                    ),
                    (
                        "kvcache-sdpa",
                        kvcache_sdpa,
                        "torch SDPA on each row's gathered cache "
                        "(window and ALiBi as a float mask)",
                        "flash-kvcache",
                    ),
                    (
                        "kvcache-flex",
                        kvcache_flex,
                        "FlexAttention on each row's gathered cache",
                        "flash-kvcache",
                    ),
                )
            ),
            Backend(
                "flash-attn-varlen",
                _flash_attn_varlen,
                "FlashAttention 2's flash_attn_varlen_func (skipped where flash_attn is absent)",
                replace(FLASH_ATTN_2_VARLEN, devices=("cuda",)),
                api="flash-varlen",
                needs="flash_attn",
            ),
            Backend(
                "flash-attn-kvcache",
                _flash_attn_kvcache,
                "FlashAttention 2's flash_attn_with_kvcache (skipped where flash_attn is absent)",
                replace(FLASH_ATTN_2_KVCACHE, devices=("cuda",)),
                api="flash-kvcache",
                needs="flash_attn",
            ),
        ]
    }


BUILTIN_BACKENDS: dict[str, Backend] = _builtin()


def resolve_backend(spec: str, api: str | None = None) -> Backend:
    """A built-in backend by name, ``mutant.NAME``, or ``module:function`` for any
    callable with the signature of API family ``api`` (default ``sdpa``: torch SDPA's;
    ``flash``: FlashAttention's ``flash_attn_func``, see
    `attnref.conformance.families`).

    A callable may carry a ``capabilities`` attribute (`Capabilities`) declaring
    what it supports; without one it is taken to claim the family's defaults. A
    built-in or a mutant has an API of its own: ``api`` must match it (``--api flash
    --backend reference`` names ``flash-reference``).

    Raises:
        BackendError: unknown name or family, import error, missing attribute, not
            callable, or a signature that cannot take the family's arguments.
    """
    from attnref.conformance.families import get_family

    family = get_family(api or "sdpa")
    builtin: Backend | None = None
    if spec in BUILTIN_BACKENDS:
        builtin = BUILTIN_BACKENDS[spec]
    elif spec.startswith("mutant."):
        from attnref.conformance.mutants import MUTANTS

        if spec.removeprefix("mutant.") not in MUTANTS:
            raise BackendError(
                f"unknown mutant {spec!r}: give one of mutant.{', mutant.'.join(MUTANTS)}"
            )
        builtin = MUTANTS[spec.removeprefix("mutant.")].backend()
    if builtin is not None:
        if api is None or builtin.api == api:
            return builtin
        other = f"{api}-{spec}"
        if other in BUILTIN_BACKENDS:
            return BUILTIN_BACKENDS[other]
        raise BackendError(f"{spec} is a backend of the {builtin.api!r} API family, not {api!r}")
    if ":" not in spec:
        known = ", ".join(sorted(BUILTIN_BACKENDS))
        raise BackendError(f"unknown backend {spec!r}: give one of {known}, or module:function")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure of user code is reported, not raised
        raise BackendError(f"cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BackendError(f"module {module_name!r} has no attribute {attr!r}") from None
    fn = family.check(obj, spec)
    caps = getattr(fn, "capabilities", family.defaults)
    if not isinstance(caps, Capabilities):
        raise BackendError(f"{spec}.capabilities must be an attnref Capabilities, got {caps!r}")
    if caps.family != family.name:
        raise BackendError(family_mismatch(spec, caps.family, family.name))
    doc = (inspect.getdoc(fn) or "").split("\n")[0]
    return Backend(spec, fn, doc or spec, caps, api=family.name, spec=spec)
