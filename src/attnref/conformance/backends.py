"""Backends: callables with torch SDPA's signature, plus what they declare they support.

A plain function with no declaration is taken to claim torch SDPA's semantics: top-left
causal alignment only, ``is_causal`` not combined with a mask, zeros for a query with no
visible key, every float dtype, boolean and float masks, GQA through ``enable_gqa``.
"""

import contextlib
import functools
import importlib
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from attnref import functional as F
from attnref.masks import Alignment

__all__ = [
    "BUILTIN_BACKENDS",
    "Backend",
    "BackendError",
    "Capabilities",
    "EmptyRows",
    "resolve_backend",
]

SDPA = Callable[..., Tensor]
#: the output for a query with no visible key: zeros, NaN, or the mean of V
EmptyRow = Literal["zero", "nan", "uniform"]
#: "contained": NaN/inf in K/V at keys no query sees never reaches the output;
#: "propagates": it may (0 * NaN = NaN in a materialised P @ V, as torch's CPU kernels)
MaskedNaN = Literal["contained", "propagates"]
# the arguments every backend is called with, by name, as torch SDPA takes them
REQUIRED_PARAMETERS = ("attn_mask", "dropout_p", "is_causal", "scale")


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
    diagonal empties, alone or together with a mask, is ``causal``.
    """

    bool_mask: EmptyRow = "zero"
    float_mask: EmptyRow = "zero"
    causal: EmptyRow = "zero"

    def __post_init__(self) -> None:
        for cause in get_args(Cause):
            if getattr(self, cause) not in get_args(EmptyRow):
                raise ValueError(
                    f"EmptyRows.{cause} must be one of {', '.join(get_args(EmptyRow))}, "
                    f"got {getattr(self, cause)!r}"
                )

    def of(self, cause: Cause) -> EmptyRow:
        policy: EmptyRow = getattr(self, cause)
        return policy

    def policies(self) -> set[EmptyRow]:
        return {self.of(c) for c in get_args(Cause)}


class BackendError(Exception):
    """A backend could not be resolved or does not have SDPA's signature."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares it supports; cases outside it are skipped and counted."""

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
    # substrings of an error message that mean "refused this input" (a skip, not a failure)
    refuses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, kind, other in (
            ("empty_row", EmptyRow, " or an EmptyRows (one per cause)"),
            ("masked_nan", MaskedNaN, ""),
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

    @property
    def empty_rows(self) -> EmptyRows:
        """The empty-row policy of every cause (one policy declared: the same for all)."""
        if isinstance(self.empty_row, EmptyRows):
            return self.empty_row
        return EmptyRows(self.empty_row, self.empty_row, self.empty_row)


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

    def available(self, device: str) -> str | None:
        """``None`` if the backend can run on ``device``, else why not."""
        if device not in self.capabilities.devices:
            return f"{self.name} does not run on {device}"
        if device == "cuda" and not torch.cuda.is_available():
            return "no CUDA device is present"
        if self.probe:
            q = torch.randn(1, 1, 8, 64, device=device, dtype=self.capabilities.dtypes[-1])
            try:
                self(q, q, q)
            except Exception as e:  # the backend says why it cannot run here
                first = (str(e).strip().splitlines() or [""])[0]
                return f"{self.name} is unavailable on {device}: {first}"
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        with self.context():
            return self.fn(*args, **kwargs)


def _reference(*args: Any, **kwargs: Any) -> Tensor:
    out: Tensor = F.scaled_dot_product_attention(*args, **kwargs)
    return out


def _reference_chunked(*args: Any, **kwargs: Any) -> Tensor:
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
) -> Tensor:
    """Textbook attention materialised with plain torch ops, in the inputs' dtype.

    ``softmax(Q K^T * scale + mask) V``: `attnref.conformance.kernels.materialised` with
    every switch off (scores and softmax in float32, probabilities rounded to the inputs'
    dtype before ``P @ V``, zeros for a query with no visible key).
    """
    if dropout_p != 0.0:
        raise ValueError("the naive backend has no dropout")
    from attnref.conformance.kernels import materialised

    out: Tensor = materialised(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa)
    return out


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
) -> Tensor:
    """FlexAttention with the mask as a ``score_mod``: eager on the CPU, compiled on CUDA."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    if dropout_p != 0.0:
        raise ValueError("FlexAttention has no dropout")
    batch = query.shape[:-3]
    h, Tq, Tk = query.shape[-3], query.shape[-2], key.shape[-2]
    B = math.prod(batch)
    q, k, v = (t.reshape(B, *t.shape[-3:]) for t in (query, key, value))
    bias = None
    if attn_mask is not None:
        full = attn_mask.expand(*batch, h, Tq, Tk).reshape(B, h, Tq, Tk)
        bias = (
            torch.zeros(full.shape, device=full.device).masked_fill(~full, -math.inf)
            if full.dtype == torch.bool
            else full.float()
        )

    def score_mod(score: Tensor, b: Tensor, hh: Tensor, qi: Tensor, kj: Tensor) -> Tensor:
        if bias is not None:
            score = score + bias[b, hh, qi, kj]
        if is_causal:
            score = torch.where(qi >= kj, score, -math.inf)
        return score

    fn: Callable[..., Tensor] = flex_attention
    if query.device.type == "cuda":
        fn = _compiled_flex()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        out = fn(q, k, v, score_mod=score_mod, scale=scale, enable_gqa=h != k.shape[-3])
    return out.reshape(*batch, h, Tq, value.shape[-1])


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
# eager FlexAttention has no backward on the CPU, and says so
# and divides by sqrt(Dqk) in Python, so Dqk = 0 raises ZeroDivisionError
_FLEX_CAPS = Capabilities(
    dropout=False, zero_head_dim=False, refuses=("does not support backward on CPU",)
)

_REFERENCE_CAPS = Capabilities(
    causal_alignments=("top_left", "bottom_right"), causal_with_mask=True, masked_nan="contained"
)


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
                "torch-flex",
                _flex,
                "FlexAttention (torch.nn.attention.flex_attention): eager on CPU, compiled on CUDA",
                _FLEX_CAPS,
            ),
            Backend(
                "naive",
                _naive,
                "textbook softmax(QK^T * scale + mask) V, materialised in the inputs' dtype",
                Capabilities(dropout=False),
            ),
        ]
    }


BUILTIN_BACKENDS: dict[str, Backend] = _builtin()


def _check_signature(fn: object, spec: str) -> SDPA:
    if not callable(fn):
        raise BackendError(f"{spec} is not callable (it is a {type(fn).__name__})")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # a builtin without a signature: trust it, calls will tell
    params = sig.parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    positional = [
        p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    takes_args = any(p.kind is p.VAR_POSITIONAL for p in params.values())
    if len(positional) < 3 and not takes_args:
        raise BackendError(
            f"{spec} must take (query, key, value, attn_mask=None, dropout_p=0.0, "
            f"is_causal=False, scale=None) like torch SDPA; its signature is {sig}"
        )
    missing = [n for n in REQUIRED_PARAMETERS if n not in params and not takes_kwargs]
    if missing:
        raise BackendError(
            f"{spec} lacks the keyword arguments {', '.join(missing)} of torch SDPA; "
            f"its signature is {sig}"
        )
    return fn


def resolve_backend(spec: str) -> Backend:
    """A built-in backend by name, ``mutant.NAME``, or ``module:function`` for any
    SDPA-compatible callable.

    A callable may carry a ``capabilities`` attribute (`Capabilities`) declaring
    what it supports.

    Raises:
        BackendError: unknown name, import error, missing attribute, not callable, or a
            signature that cannot take SDPA's arguments.
    """
    if spec in BUILTIN_BACKENDS:
        return BUILTIN_BACKENDS[spec]
    if spec.startswith("mutant."):
        from attnref.conformance.mutants import MUTANTS

        if spec.removeprefix("mutant.") in MUTANTS:
            return MUTANTS[spec.removeprefix("mutant.")].backend()
        raise BackendError(
            f"unknown mutant {spec!r}: give one of mutant.{', mutant.'.join(MUTANTS)}"
        )
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
    fn = _check_signature(obj, spec)
    caps = getattr(fn, "capabilities", Capabilities())
    if not isinstance(caps, Capabilities):
        raise BackendError(f"{spec}.capabilities must be an attnref Capabilities, got {caps!r}")
    doc = (inspect.getdoc(fn) or "").split("\n")[0]
    return Backend(spec, fn, doc or spec, caps)
