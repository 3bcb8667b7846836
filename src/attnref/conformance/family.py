"""What an API family is, and the table of those installed: the engine's side of families.

A family says how a backend is called and how its answer is read back, so the runner,
the properties and the checks never ask which convention a backend uses. The engine
never imports a family: it looks up the one a backend names (`family_of`) in the table
that the registry, `attnref.conformance.families`, fills when it installs them. Each
family is one module there, holding everything of its own: the convention, its adapter
from a dense callable, its preset, its built-in backends, its properties and its
mutants. An entry, `ApiFamily`, is two parts: its `Convention` (what the engine needs to
build a call, make it and read it) and its `Manifest` (built-ins, properties, mutants, an
executor of its own, the bench's workload). The convention has:

- a name (``--api NAME``) and the signature a function must have (`ApiFamily.check`);
- the capabilities an undeclared function is taken to claim (`ApiFamily.defaults`);
- `ApiFamily.build`: how the `Inputs` of a `Case` become positional and keyword
  arguments (raising `Skip` for what the convention cannot express);
- `ApiFamily.read`: how the result becomes the output, and the log-sum-exp when asked,
  in the audit's layout ``(*batch, h, Tq, Dv)`` and ``(*batch, h, Tq)``;
- `ApiFamily.to_layout` and `ApiFamily.from_layout`: a tensor of the audit's layout
  into the family's and back (the gradient property's upstream gradient and results).

Every family runs every dense case; a family with inputs of its own (packs, caches,
shards) also brings the properties only they can have.
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from attnref.conformance.cases import Inputs
from attnref.conformance.declarations import Backend, BackendError, Capabilities
from attnref.conformance.verdicts import Failure, Skip

if TYPE_CHECKING:
    from attnref.conformance.cases import Case
    from attnref.conformance.mutants import Mutant
    from attnref.conformance.properties import Property
    from attnref.conformance.worker import Executor
    from attnref.conformance.workloads import ServingCase, Workload

__all__ = [
    "FAMILIES",
    "ApiFamily",
    "Arguments",
    "Convention",
    "Manifest",
    "family_of",
    "get_family",
    "pair",
    "variant_kwargs",
]

Arguments = tuple[tuple[Any, ...], dict[str, Any]]


def _no_hint(caps: Capabilities, kwargs: dict[str, Any], error: str) -> str:
    return ""


def _no_builtins() -> list[Backend]:
    return []


@dataclass(frozen=True, kw_only=True)
class Convention:
    """How a backend of a family is called and read: all the engine needs of a family to
    build a call, make it (in a worker: `invoke`, `share`) and read its answer."""

    name: str
    summary: str
    #: the signature, as its users know it (for error messages and docs)
    signature: str
    #: how many tensors a function takes positionally, first
    positional: int
    #: the keyword arguments every call passes
    keywords: tuple[str, ...]
    #: what a function that declares nothing is taken to claim (its preset)
    defaults: Capabilities
    build: Callable[[Capabilities, Inputs, bool, dict[str, Any]], Arguments]
    read: Callable[[object, Inputs, bool], tuple[object, object | None]]
    to_layout: Callable[[Tensor, Inputs], Tensor]
    from_layout: Callable[[Tensor, Tensor], Tensor]
    #: whether the backend applies the causal diagonal of these inputs itself
    native_causal: Callable[[Capabilities, Inputs], bool]
    #: whether the convention takes ``dropout_p`` (flash_attn_with_kvcache does not)
    dropout: bool = True
    #: whether a dense case can be one of its calls (`build`); a family whose calls
    #: cannot hold a dense case's keys as they are (a quantized cache) is audited by its
    #: own properties alone
    dense: bool = True
    #: whether its calls name the keys each query sees by indices (DeepSeek's sparse
    #: attention): a mask, the causal diagonal and a window all reach its kernel as keys
    #: left out of the indices, one trigger of a finding (`attnref.conformance.findings`)
    indexed: bool = False
    #: for a family whose calls are not attention's (the gated delta rule): repro.py's
    #: whole text from the finding's title, spec and family name (each a JSON string
    #: literal), and the shapes of a case in REPORT.md's words (None: the SDPA script
    #: and words of `attnref.conformance.bugreports`)
    repro_script: "Callable[[str, str, str], str] | None" = None
    repro_shape: "Callable[[Case], str] | None" = None
    #: what to declare when a backend raised ``error`` (its one line) on a call of these
    #: keywords that a default declaration makes (a combination some libraries refuse),
    #: or ""
    error_hint: Callable[[Capabilities, dict[str, Any], str], str] = _no_hint
    #: how a worker makes one call of this family's backend (None: ``backend(*args,
    #: **kwargs)``): a family whose calls need a setup there (a process group) does it here
    invoke: "Callable[[Backend, tuple[Any, ...], dict[str, Any]], Any] | None" = None
    #: for a family whose executor spreads a call over processes: the arguments of one
    #: process's share of a call, from the whole call's and the share the executor gave
    #: (``share(args, kwargs, share) -> (args, kwargs)``; the bench's worker applies it
    #: to a job whose case carries ``"_share"``)
    share: "Callable[[tuple[Any, ...], dict[str, Any], dict[str, Any]], Arguments] | None" = None
    #: the causal alignments its calls can express (a backend declaring another one is
    #: an error: `cannot_honour`)
    alignments: tuple[str, ...] = ("top_left", "bottom_right")

    def cannot_honour(self, caps: Capabilities) -> str | None:
        """Why this convention cannot audit a backend declaring ``caps`` as declared, or
        None. A declaration the family cannot honour is an error, not a report that says
        "not tested" and then judges those calls otherwise."""
        odd = [a for a in caps.causal_alignments if a not in self.alignments]
        if odd:
            return (
                f"causal_alignments={caps.causal_alignments!r}: the {self.name!r} "
                f"convention's causal calls are {' or '.join(self.alignments)} only "
                f"({self.signature}); declare causal_alignments={self.alignments!r}"
            )
        return None

    def argument_name(self, i: int) -> str:
        """The name positional argument ``i`` has in `signature` (``argument i`` past its
        positional ones): what a message about the argument calls it."""
        inside = self.signature.split("(", 1)[-1].split(")", 1)[0]
        names = []
        for part in inside.split(","):
            name = part.split("=", 1)[0].strip()
            if name.startswith("*"):
                break
            names.append(name)
        return names[i] if i < len(names) and names[i].isidentifier() else f"argument {i}"

    def check(self, fn: object, spec: str) -> Callable[..., Any]:
        """``fn`` if its signature can take this family's calls, else `BackendError`."""
        return _check_signature(self, fn, spec)

    def call(
        self, backend: Backend, inputs: Inputs, lse: bool = False, **overrides: Any
    ) -> Arguments:
        """The arguments to call ``backend`` with for ``inputs`` (`Skip` if the
        convention cannot express them); ``lse``: ask for the log-sum-exp too."""
        return self.build(backend.capabilities, inputs, lse, overrides)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a family brings besides its convention: its built-in backends, properties and
    mutants, how its backends run (an executor of its own, on how many processes), and
    its bench's workload (default backends, the reference that hosts dry runs)."""

    #: its built-in backends (built on first use: some import optional parts of torch)
    builtins: Callable[[], list[Backend]] = _no_builtins
    #: the properties only its calls can have (run on its backends only)
    properties: "tuple[Property, ...]" = ()
    #: its planted bugs, rows of the kill matrix
    mutants: "tuple[Mutant, ...]" = ()
    #: how a mutant of it becomes a function of this convention (None: it has none)
    mutant_fn: "Callable[[Mutant], Callable[..., Any]] | None" = None
    #: the backends ``attnref bench --api NAME`` times by default (empty: no bench)
    bench_backends: tuple[str, ...] = ()
    #: a serving family's workload for a shape (`attnref.conformance.workloads`), which
    #: ``attnref bench --api NAME`` times in place of the dense sweep (None: it has none)
    workload: "Callable[[ServingCase], Workload] | None" = None
    #: the page sizes its serving bench sweeps by default ((0,): a workload with no pages)
    serving_pages: tuple[int, ...] = (0,)
    #: the executor a backend of this family runs in (None: one worker, `Supervised`, or
    #: the judge's own thread with ``isolate=False``): ``executor(backend, api,
    #: isolate=, threads=, memory_limit=, world_size=)``, e.g. one worker per rank
    executor: "Callable[..., Executor] | None" = None
    #: the processes one call runs on when the audit names none (``--world-size``)
    world_size: int = 1
    #: the built-in backend of attnref's own code whose executor hosts the bench's dry
    #: loops for this family (it is never called there): a family with an executor of its
    #: own needs one of that executor's kind
    reference: str = "reference"
    #: what the bench adds to the note of a verified row of this family, measured on
    #: its executor: ``bench_note(executor, args, kwargs, timeout) -> str`` (the bytes a
    #: rank sends, for context-parallel); the backend's word, shown, not judged
    bench_note: "Callable[[Any, tuple[Any, ...], dict[str, Any], float], str] | None" = None
    #: for a family whose processes a launcher starts (torchrun): asked by ``attnref
    #: audit`` before the audit; on a process that is not the judge it serves that
    #: process's part and returns the exit code, on the judge None: ``serve(spec,
    #: threads=, memory_limit=)``
    serve: "Callable[..., int | None] | None" = None


@dataclass(frozen=True, kw_only=True)
class ApiFamily(Convention, Manifest):
    """One family: its calling convention (`Convention`, what the engine needs) and its
    manifest (`Manifest`, what it brings besides); see the module docstring."""


def _check_signature(convention: Convention, fn: object, spec: str) -> Callable[..., Any]:
    """``fn`` if its signature can take ``convention``'s calls, else `BackendError`."""
    if not callable(fn):
        raise BackendError(f"{spec} is not callable (it is a {type(fn).__name__})")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # a builtin without a signature: trust it, calls will tell
    params = sig.parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    takes_args = any(p.kind is p.VAR_POSITIONAL for p in params.values())
    positional = [
        p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    missing = [n for n in convention.keywords if n not in params and not takes_kwargs]
    if (len(positional) < convention.positional and not takes_args) or missing:
        lacks = f"; it lacks {', '.join(missing)}" if missing else ""
        raise BackendError(
            f"{spec} does not have the signature of the {convention.name!r} API family, "
            f"{convention.signature}{lacks}; its signature is {sig}"
            f"{_other_families(convention.name, sig)}"
        )
    return fn


#: the installed families, by name, in the registry's order (filled by
#: `attnref.conformance.families.install`)
FAMILIES: dict[str, ApiFamily] = {}


def get_family(name: str) -> ApiFamily:
    """The family called ``name``; a clear error for an unknown one."""
    try:
        return FAMILIES[name]
    except KeyError:
        known = ", ".join(FAMILIES) or "none is installed: import attnref.conformance.backends"
        raise BackendError(f"unknown API family {name!r}: use one of {known}") from None


def family_of(backend: Backend) -> ApiFamily:
    """The calling convention of ``backend``."""
    return get_family(backend.api)


def _other_families(name: str, sig: inspect.Signature) -> str:
    """A hint naming the family a signature does match, if one does (the one whose
    keywords it has the most of, when several)."""
    ranked = sorted(FAMILIES.values(), key=lambda f: -len(f.keywords))
    for family in ranked:
        if family.name == name:
            continue
        if all(n in sig.parameters for n in family.keywords):
            return f" (it looks like the {family.name!r} family: pass --api {family.name})"
    return ""


# ------------------------------------------------ what the conventions share


def variant_kwargs(caps: Capabilities, inputs: Inputs) -> dict[str, Any]:
    """The keyword arguments of the variants ``inputs`` turn on (`Skip` for a variant, or
    a combination, the backend does not declare)."""
    on = inputs.variants
    for variant in on:
        if not getattr(caps, variant):
            raise Skip(f"{variant} not declared")
    if len(on) > 1 and not caps.combined_variants:
        raise Skip(f"{' and '.join(on)} together not declared")
    kwargs: dict[str, Any] = {}
    if inputs.softcap:
        kwargs["softcap"] = inputs.softcap
    if inputs.alibi_slopes is not None:
        kwargs["alibi_slopes"] = inputs.alibi_slopes
    if inputs.sinks is not None:
        kwargs["sinks"] = inputs.sinks
    return kwargs


def pair(out: object, what: str) -> tuple[object, object]:
    """``out`` as (output, log-sum-exp): `Failure` if it is not a pair (``what``: how the
    log-sum-exp was asked for)."""
    if not isinstance(out, tuple | list) or len(out) < 2:
        raise Failure(f"asked for the log-sum-exp ({what}), returned {type(out).__name__}")
    return out[0], out[1]
