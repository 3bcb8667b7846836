"""Run a backend through the properties: Hypothesis searches, shrinks, and we report.

Each (property, dtype) pair is one Hypothesis search seeded from the audit's seed. The
first failure Hypothesis finds is shrunk to a minimal case (within the profile's shrink
budget), then the property's explicit examples run if the search found nothing. The
backend never crashes or hangs the audit: see `attnref.conformance.calls`.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from tqdm import tqdm

from attnref.conformance.backends import Backend
from attnref.conformance.cases import Case
from attnref.conformance.profiles import Profile, get_profile
from attnref.conformance.properties import (
    PROPERTIES,
    Context,
    Property,
    get_property,
    property_seed,
)
from attnref.conformance.report import AuditReport, Finding, PropertyResult, Status, reproducer
from attnref.conformance.verdicts import Failure, Skip
from attnref.devices import best_device, dtype_name

__all__ = ["audit", "run_property"]


class _Found(Exception):  # noqa: N818 (a signal to Hypothesis)
    """Raised from one place for every failure, so Hypothesis treats them as one bug."""


@dataclass
class _Search:
    checks: int = 0
    skipped: int = 0
    skip_reason: str = ""
    failure: tuple[Case, Failure] | None = None
    shrink_until: float | None = None
    stop: bool = False


def run_property(
    backend: Backend,
    prop: Property,
    dtype: torch.dtype,
    *,
    device: str,
    profile: Profile,
    seed: int = 0,
    timeout: float = 60.0,
) -> PropertyResult:
    """Search for a case on which ``backend`` breaks ``prop`` in ``dtype``; shrink it."""
    start = time.perf_counter()
    caps = backend.capabilities

    def done(status: Status, message: str = "", finding: Finding | None = None) -> PropertyResult:
        return PropertyResult(
            prop.id,
            dtype,
            status,
            checks=search.checks,
            skipped=search.skipped,
            seconds=time.perf_counter() - start,
            message=message,
            finding=finding,
        )

    search = _Search()
    if dtype not in caps.dtypes:
        return done("skip", f"dtype {dtype_name(dtype)} not declared")
    reason = prop.requires(caps)
    if reason is not None:
        return done("skip", reason)
    ctx = Context(backend, dtype, device, timeout)

    def body(case: Case) -> None:
        if search.stop:
            return  # out of shrink budget (or the backend hangs): keep what we have
        search.checks += 1
        try:
            prop.check(ctx, case)
        except Skip as s:
            search.skipped += 1
            search.skip_reason = str(s)
            return
        except Failure as f:
            search.failure = (case, f)
            now = time.perf_counter()
            if search.shrink_until is None:
                search.shrink_until = now + profile.shrink_seconds
            search.stop = f.fatal or now > search.shrink_until
            raise _Found from None

    test = given(prop.cases(profile, caps))(body)
    test = settings(
        max_examples=profile.examples,
        deadline=None,
        database=None,
        derandomize=False,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        verbosity=Verbosity.quiet,
        print_blob=False,
    )(test)
    test = hypothesis_seed(property_seed(seed, prop.id, dtype))(test)
    try:
        test()
    except Exception:
        # _Found, or Hypothesis' own complaint when a shrink budget made the final replay
        # pass: either way the failure we recorded is the smallest one found
        if search.failure is None:
            raise
    if search.failure is None:
        for case in prop.examples(profile, caps):
            try:
                body(case)
            except _Found:
                break
    if search.failure is not None:
        case, failure = search.failure
        finding = Finding(
            case,
            str(failure),
            failure.got,
            failure.expected,
            failure.where,
            reproducer(backend.name, prop.id, case, dtype, device, str(failure)),
        )
        return done("fail", str(failure), finding)
    if search.checks and search.skipped == search.checks:
        return done("skip", search.skip_reason)
    return done("pass")


def audit(
    backend: Backend,
    *,
    profile: str | Profile = "quick",
    device: str | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    seed: int = 0,
    properties: Sequence[str] | None = None,
    timeout: float = 60.0,
    fail_fast: bool = False,
    gradients: bool = True,
    progress: bool = True,
) -> AuditReport:
    """Audit ``backend`` against the float64 oracle: every property in every dtype.

    ``dtypes`` defaults to every dtype the backend declares; ``properties`` to all of
    them (`PROPERTIES`); ``gradients=False`` leaves out the gradient property;
    ``fail_fast`` stops after the first failing property. A property the backend
    cannot be held to (an undeclared capability) is skipped and counted. The audit never
    raises because of the backend.
    """
    prof = get_profile(profile) if isinstance(profile, str) else profile
    device = device or best_device()
    chosen = [get_property(p) for p in (properties or list(PROPERTIES))]
    if not gradients:
        chosen = [p for p in chosen if not p.gradient]
    dtype_list = list(dtypes) if dtypes is not None else list(backend.capabilities.dtypes)
    report = AuditReport.start(
        backend.name, device, [str(d) for d in dtype_list], prof.name, seed, backend.capabilities
    )
    unavailable = backend.available(device)
    work = [(p, d) for p in chosen for d in dtype_list]
    bar = tqdm(work, desc=f"audit {backend.name}", disable=not progress, leave=False)
    for prop, dtype in bar:
        bar.set_postfix_str(f"{prop.id} {dtype_name(dtype)}")
        if unavailable is not None:
            report.results.append(PropertyResult(prop.id, dtype, "skip", message=unavailable))
            continue
        result = run_property(
            backend, prop, dtype, device=device, profile=prof, seed=seed, timeout=timeout
        )
        report.results.append(result)
        if fail_fast and result.status == "fail":
            report.stopped_early = True
            break
    bar.close()
    report.finish()
    return report
