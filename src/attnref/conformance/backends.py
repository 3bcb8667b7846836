"""Backends: callables with torch SDPA's signature, plus what they declare they support.

A plain function with no declaration is taken to claim torch SDPA's semantics: top-left
causal alignment only, ``is_causal`` not combined with a mask, zeros for a query with no
visible key, every float dtype, boolean and float masks, GQA through ``enable_gqa``.
"""

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnref import functional as F

__all__ = [
    "BUILTIN_BACKENDS",
    "Backend",
    "BackendError",
    "Capabilities",
    "resolve_backend",
]

SDPA = Callable[..., Tensor]
# the arguments every backend is called with, by name, as torch SDPA takes them
REQUIRED_PARAMETERS = ("attn_mask", "dropout_p", "is_causal", "scale")


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
    causal_alignments: tuple[str, ...] = ("top_left",)
    causal_with_mask: bool = False  # may `is_causal=True` be combined with `attn_mask`?
    empty_row: str = "zero"  # output for a query with no visible key
    # "contained": NaN/inf in K/V at keys no query sees never reaches the output;
    # "propagates": it may (0 * NaN = NaN in a materialised P @ V, as torch's CPU kernels)
    masked_nan: str = "propagates"


@dataclass(frozen=True)
class Backend:
    """A named attention implementation under audit."""

    name: str
    fn: SDPA
    description: str
    capabilities: Capabilities = field(default_factory=Capabilities)
    # entered around every call (e.g. forcing one torch SDPBackend)
    context: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext

    def available(self, device: str) -> str | None:
        """``None`` if the backend can run on ``device``, else why not."""
        if device not in self.capabilities.devices:
            return f"{self.name} does not run on {device}"
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        with self.context():
            return self.fn(*args, **kwargs)


def _reference(*args: Any, **kwargs: Any) -> Tensor:
    out: Tensor = F.scaled_dot_product_attention(*args, **kwargs)
    return out


def _reference_chunked(*args: Any, **kwargs: Any) -> Tensor:
    return F.chunked_attention(*args, **kwargs, block_size=4)


def _force(
    backend: "torch.nn.attention.SDPBackend",
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backend):
            yield

    return ctx


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
    """A built-in backend by name, or ``module:function`` for any SDPA-compatible callable.

    A callable may carry a ``capabilities`` attribute (`Capabilities`) declaring
    what it supports.

    Raises:
        BackendError: unknown name, import error, missing attribute, not callable, or a
            signature that cannot take SDPA's arguments.
    """
    if spec in BUILTIN_BACKENDS:
        return BUILTIN_BACKENDS[spec]
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
