"""The audit's options, declared once for every entry point.

``attnref audit``, the pytest plugin (``--attnref-...``) and ``tools/gpu_audit.py`` add
the same options with `add_audit_options` and turn what the user gave into checked
settings with `audit_settings`; the choices come from the registries they name
(`PROFILES`, `PROPERTIES`, `attnref.devices.DTYPES`), so a new profile or dtype needs no
edit here.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnref.conformance.profiles import PROFILES, Profile, get_profile

if TYPE_CHECKING:  # imported when used: declaring the options must not import torch
    import torch


__all__ = ["AuditSettings", "OptionError", "add_audit_options", "audit_settings"]


class OptionError(ValueError):
    """An option has a value the audit cannot run with; the message names both."""


def add_audit_options(add: Callable[..., Any], prefix: str = "", *, choices: bool = True) -> None:
    """Declare the audit's options with ``add`` (``ArgumentParser.add_argument``, or
    pytest's ``group.addoption``), each named ``--{prefix}{name}``.

    ``choices=False`` leaves the dtype names to `audit_settings` to check, so that
    declaring the options imports no torch (the pytest plugin's case).
    """

    def option(name: str, **kwargs: Any) -> None:
        add(f"--{prefix}{name}", **kwargs)

    dtype_choices: dict[str, Any] = {}
    if choices:
        from attnref.devices import DTYPES

        dtype_choices["choices"] = list(DTYPES)

    option(
        "profile",
        default="quick",
        choices=list(PROFILES),
        help="how hard to search: quick (under half a minute on 2 cores), ci (minutes), "
        "thorough (nightly) (default: quick)",
    )
    option("device", default=None, help="cpu or cuda (default: cuda if present)")
    option(
        "dtype",
        action="append",
        default=[],
        **dtype_choices,
        help="dtype to audit, repeatable (default: every dtype the backend declares)",
    )
    option(
        "property",
        action="append",
        default=[],
        metavar="ID",
        help="audit only this property, repeatable (see attnref audit --list-properties)",
    )
    option(
        "api",
        default=None,
        metavar="FAMILY",
        help="the calling convention (API family) of a module:function backend, one of "
        "those attnref audit --list-families lists (default: sdpa, torch SDPA's signature; "
        "a built-in backend has its own)",
    )
    option(
        "world-size",
        type=int,
        default=None,
        metavar="W",
        help="processes each call runs on, for a family that spreads one call over several "
        "(context-parallel: one rank each; default: the family's)",
    )
    option("seed", type=int, default=0, help="seed of the search (default: 0)")
    option("timeout", type=float, default=60.0, help="seconds allowed per call (default: 60)")
    option(
        "deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop checking after this long; the report is then incomplete (default: none)",
    )
    option(
        "threads",
        type=int,
        default=1,
        help="torch intra-op threads (default: 1, the fastest for the audit's small cases)",
    )
    option(
        "memory-limit",
        type=float,
        default=None,
        metavar="GIB",
        help="address space the backend's worker may use, in GiB (default: no limit)",
    )
    option(
        "in-process",
        action="store_true",
        help="run the backend in this process, not a supervised worker behind the trust "
        "boundary (for debugging with pdb or a profiler). The verdict then TRUSTS the "
        "backend: an exit or a crash ends the audit, and a backend that attacks the "
        "harness can forge the result; the report says so",
    )
    option(
        "require-sandbox",
        action="store_true",
        help="stop with an error where the platform does not wholly confine the backend's "
        "worker (files, network, signals, processes: docs/untrusted.md), for CI and "
        "leaderboards (default: audit, and say so on the first line and in the report)",
    )
    option("no-grad", action="store_true", help="leave out the gradient property")
    option(
        "property-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds each property may search in each dtype; then it passes on the cases "
        "it judged (a failure found in time is still shrunk; default: no budget)",
    )
    option(
        "min-judged",
        type=int,
        default=None,
        metavar="N",
        help="a pass judged on fewer than N cases (per property and dtype) is thin, and "
        "the audit then not OK (default: thin below a fifth of the profile's examples, "
        "shown but not failed)",
    )


@dataclass(frozen=True)
class AuditSettings:
    """The audit's options, checked: what `attnref.conformance.audit` takes."""

    profile: Profile
    device: str
    dtypes: "tuple[torch.dtype, ...] | None"  # None: every dtype the backend declares
    properties: tuple[str, ...] | None  # None: every property
    seed: int
    timeout: float
    gradients: bool
    deadline: float | None = None
    threads: int = 1
    isolate: bool = True
    memory_limit: float | None = None  # GiB
    api: str | None = None  # the API family of a module:function backend (None: sdpa)
    world_size: int | None = None  # processes per call (None: the family's default)
    min_judged: int | None = None  # a thin pass fails the audit (None: shown only)
    property_budget: float | None = None  # seconds per (property, dtype)
    require_sandbox: bool = False  # an unconfined worker is an error

    @property
    def memory_limit_bytes(self) -> int | None:
        return None if self.memory_limit is None else int(self.memory_limit * 2**30)

    def audit_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `attnref.conformance.audit`."""
        return {
            "profile": self.profile,
            "device": self.device,
            "dtypes": self.dtypes,
            "properties": self.properties,
            "seed": self.seed,
            "timeout": self.timeout,
            "gradients": self.gradients,
            "deadline": self.deadline,
            "threads": self.threads,
            "isolate": self.isolate,
            "memory_limit": self.memory_limit,
            "world_size": self.world_size,
            "min_judged": self.min_judged,
            "property_budget": self.property_budget,
            "require_sandbox": self.require_sandbox,
        }


def audit_settings(get: Callable[[str], Any]) -> AuditSettings:
    """Check the options that ``get(dest)`` returns (``dest``: ``profile``, ``no_grad``, ...).

    Raises:
        OptionError: an unknown profile, dtype, property, API family or device, CUDA asked for where
            there is none, a timeout or deadline that is not positive, fewer than one
            thread.
    """
    import torch

    from attnref.conformance.properties import PROPERTIES
    from attnref.devices import best_device, parse_dtype

    try:
        profile = get_profile(get("profile"))
        dtypes = tuple(parse_dtype(d) for d in get("dtype") or [])
    except ValueError as e:
        raise OptionError(str(e)) from None
    unknown = [p for p in get("property") or [] if p not in PROPERTIES]
    if unknown:
        raise OptionError(f"unknown property {unknown[0]!r}: see --list-properties")
    device = get("device")
    if device is not None and device not in ("cpu", "cuda"):
        raise OptionError(f"unknown device {device!r}: use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise OptionError("--device cuda asked for, but no CUDA device is present")
    timeout = get("timeout")
    if not timeout > 0:
        raise OptionError(f"--timeout must be > 0 seconds, got {timeout}")
    deadline = get("deadline")
    if deadline is not None and not deadline > 0:
        raise OptionError(f"--deadline must be > 0 seconds, got {deadline}")
    threads = get("threads")
    if threads < 1:
        raise OptionError(f"--threads must be >= 1, got {threads}")
    world_size = get("world_size")
    if world_size is not None and not 1 <= world_size <= 64:
        raise OptionError(f"--world-size must be between 1 and 64, got {world_size}")
    budget = get("property_budget")
    if budget is not None and not budget > 0:
        raise OptionError(f"--property-budget must be > 0 seconds, got {budget}")
    min_judged = get("min_judged")
    if min_judged is not None and min_judged < 1:
        raise OptionError(f"--min-judged must be >= 1, got {min_judged}")
    memory_limit = get("memory_limit")
    if memory_limit is not None and not memory_limit > 0:
        raise OptionError(f"--memory-limit must be > 0 GiB, got {memory_limit}")
    properties = get("property")
    api = get("api")
    from attnref.conformance.family import FAMILIES

    if api is not None and api not in FAMILIES:
        raise OptionError(f"unknown API family {api!r}: use one of {', '.join(FAMILIES)}")
    return AuditSettings(
        profile=profile,
        device=device or best_device(),
        dtypes=dtypes or None,
        properties=tuple(properties) if properties else None,
        seed=get("seed"),
        timeout=timeout,
        gradients=not get("no_grad"),
        deadline=deadline,
        threads=threads,
        isolate=not get("in_process"),
        memory_limit=memory_limit,
        api=api,
        world_size=world_size,
        min_judged=min_judged,
        property_budget=budget,
        require_sandbox=bool(get("require_sandbox")),
    )
