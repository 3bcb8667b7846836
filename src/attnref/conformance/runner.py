"""Run a backend through the properties: Hypothesis searches, shrinks, and we report.

Each (property, dtype) pair is one Hypothesis search seeded from the audit's seed. The
first failure Hypothesis finds is shrunk to a minimal case (within the profile's shrink
budget), then the property's explicit examples run if the search found nothing. A
precision miss does not end the search (the semantic failure it would hide is looked
for, and both are reported); one alone is searched for again and shrunk. The
backend never crashes or hangs the audit: its code runs in a supervised worker
(`attnref.conformance.worker`), and `attnref.conformance.calls` turns whatever it does
into a verdict.
"""

import math
import secrets
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from pathlib import Path
from typing import Any, cast

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from torch import Tensor
from tqdm import tqdm

from attnref._checking import audit_checking, checking_enabled, set_checking
from attnref.conformance.calls import TIMED_OUT, Reader, availability
from attnref.conformance.cases import Case
from attnref.conformance.coverage import add as add_coverage
from attnref.conformance.declarations import Backend, BackendError, Capabilities
from attnref.conformance.family import get_family
from attnref.conformance.jobs import InternalError, Raised, Series, series_outcomes
from attnref.conformance.judges import Judges, Setup, wait_after_timeout
from attnref.conformance.launch import Launch, calibrate
from attnref.conformance.needs import needs
from attnref.conformance.profiles import Profile, fitted, get_profile
from attnref.conformance.properties import PROPERTIES, Context, Property, get_property
from attnref.conformance.report import (
    FLOOR_SHARE,
    AuditReport,
    Finding,
    PropertyResult,
    Status,
    reproducer,
)
from attnref.conformance.strategies import inside, narrowed, work
from attnref.conformance.verdicts import Failure, Skip, cause_key, cause_of, shorten
from attnref.conformance.worker import Executor, start_executor
from attnref.devices import best_device, dtype_name
from attnref.interpreted import INTERPRETERS

__all__ = ["audit", "check_case", "property_seed", "run_property"]


class _Found(Exception):  # noqa: N818 (a signal to Hypothesis)
    """Raised from one place for every failure, so Hypothesis treats them as one bug."""


class _Stop(BaseException):
    """Raised once the search is over (its shrink time, budget or deadline spent, or a
    fatal failure): a BaseException, which Hypothesis does not take for a failure but
    lets through at once. Returning instead let it go on drawing and shrinking cases it
    was not given: 2.9 s of a 3.6 s kill went to a shrink whose every try was not run."""


@dataclass
class _Search:
    checks: int = 0
    skipped: int = 0
    refused: int = 0
    skip_reason: str = ""
    failure: tuple[Case, Failure] | None = None
    over_budget: bool = False  # the property's own budget ran out (not a failure)
    shrink_until: float | None = None
    stop: bool = False
    late: bool = False  # stopped by the audit's deadline
    strict: bool = False  # a precision miss is a failure to shrink (the second search)
    #: the first precision miss (an error over the bound, under 5% of the values'
    #: spread) met while searching for a semantic failure
    imprecise: tuple[Case, Failure] | None = None
    #: each drawn case's seconds
    case_seconds: list[float] = field(default_factory=list)
    #: what the judged cases covered (`attnref.conformance.coverage`)
    coverage: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the shapes called so far, where the backend declares few (`distinct_shapes`)
    shapes: list[tuple[Any, ...]] = field(default_factory=list)


def _precision_miss(f: Failure) -> bool:
    """Whether ``f`` is what a precision loss looks like (`Failure.small`), not a
    semantic failure (NaN, a policy, wrong values)."""
    return f.kind == "error" and f.small and not f.fatal


#: the message of a property the audit's deadline cut short
LATE = "not finished: the audit's deadline passed"


def run_property(
    backend: Backend,
    prop: Property,
    dtype: torch.dtype,
    *,
    device: str,
    profile: Profile,
    seed: int = 0,
    timeout: float = 60.0,
    executor: Executor | None = None,
    stop_at: float | None = None,
    budget: float | None = None,
    on_case: Callable[[int], None] | None = None,
) -> PropertyResult:
    """Search for a case on which ``backend`` breaks ``prop`` in ``dtype``; shrink it.

    ``executor`` runs the backend's code (default: a thread of this process; `audit`
    passes a supervised worker). Past ``stop_at`` (a `time.perf_counter` reading) no
    more cases are checked: what was found stands, and a property with no failure by
    then is a skip, not a pass. ``budget``: seconds this property may search for a
    failure; after them (and one judged case) it passes on the cases it judged (thin,
    maybe: see `AuditReport.mark_thin`), while a failure found in time is still shrunk.
    ``on_case`` is called with the count of cases checked so far after each one (a
    progress line within a long search).
    """
    start = time.perf_counter()
    caps = backend.capabilities

    def done(status: Status, message: str = "", finding: Finding | None = None) -> PropertyResult:
        return PropertyResult(
            prop.id,
            dtype,
            status,
            checks=search.checks,
            skipped=search.skipped,
            refused=search.refused,
            seconds=time.perf_counter() - start,
            message=message,
            finding=finding,
            cut=search.over_budget,
            case_seconds=search.case_seconds,
            coverage=search.coverage,
        )

    search = _Search()
    if dtype not in caps.dtypes:
        return done("skip", f"dtype {dtype_name(dtype)} not declared")
    if not prop.applies_to(backend.api):
        return done("skip", f"a property of the {' and '.join(prop.families)} family")
    reason = prop.why_not(caps)
    if reason is not None:
        return done("skip", reason)
    # equal shards only: lengths that cut into as many equal chunks as zigzag needs
    chunks = chunks_of(executor)
    # the sample of a long case's rows is drawn with a secret of this search's own
    ctx = Context(backend, dtype, device, timeout, executor, secret=secrets.randbits(62))

    budget_at = None if budget is None else start + budget
    shapes = few_shapes(
        caps, interpreter=str(getattr(executor, "interpreted", {}).get("interpreter", ""))
    )

    def body(case: Case) -> None:
        if stop_at is not None and time.perf_counter() > stop_at:
            search.stop = search.late = True
        spent = budget_at is not None and time.perf_counter() > budget_at
        if spent and search.checks and search.failure is None:  # at least one case judged
            search.stop = search.over_budget = True
        if search.stop:
            raise _Stop  # out of shrink budget (or the backend hangs): keep what we have
        search.checks += 1
        # an interpreted kernel's case cut to its per-call budget, waited on for what its
        # launch predicts (`attnref.conformance.launch`)
        launch = profile.launch
        patience = timeout
        if launch is not None:
            case = launch.fit(case)
            patience = launch.timeout(case, timeout)
        if shapes:  # a backend that compiles each new shape: one it has seen, past a few
            case = _seen_shape(case, search.shapes, shapes, caps, chunks)
        # a budget or deadline holds within a case too: a call still running when it
        # passes is stopped (its worker ended), and the search ends there, not failed
        judged = search.checks - 1 - search.skipped - search.refused
        ends = [stop_at] if stop_at is not None else []
        if budget_at is not None and search.failure is None and judged:
            ends.append(budget_at)  # as between cases: after one judged case
        left = min(ends) - time.perf_counter() if ends else None
        wait = patience if left is None else max(1.0, min(patience, left))
        t0 = time.perf_counter()
        try:
            prop.check(ctx if wait == timeout else replace(ctx, timeout=wait), case)
            add_coverage(search.coverage, case)
        except Skip as s:
            if s.refused:
                search.refused += 1
            else:
                search.skipped += 1
            search.skip_reason = str(s)
            return
        except Failure as f:
            if wait < patience and str(f).startswith(TIMED_OUT):
                search.checks -= 1  # stopped, not judged
                search.stop = True
                if stop_at is not None and time.perf_counter() >= stop_at - 1.0:
                    search.late = True
                else:
                    search.over_budget = True
                return
            if launch is not None and str(f).startswith(TIMED_OUT):
                programs, steps = launch.shape(case)
                f = f.reworded(
                    f"{f}; its launch model predicted {launch.predict(case):.3g} s for "
                    f"{programs} programs stepping over {steps} key tiles"
                )
            if not search.strict and _precision_miss(f):
                # judged apart: the search goes on for a semantic failure, which a
                # precision miss met first would otherwise hide (and shrink away)
                if search.imprecise is None:
                    search.imprecise = (case, f)
                return
            search.failure = (case, f)
            add_coverage(search.coverage, case)
            now = time.perf_counter()
            if search.shrink_until is None:
                search.shrink_until = now + profile.shrink_seconds
            search.stop = f.fatal or now > search.shrink_until
            raise _Found from None
        finally:
            search.case_seconds.append(time.perf_counter() - t0)
            if on_case is not None:
                on_case(search.checks)

    def searched() -> None:
        test = given(narrowed(prop.cases(profile, caps), caps, profile, chunks))(body)
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
        except _Stop:
            pass  # what was found stands
        except Exception:
            # _Found, or Hypothesis' own complaint when a shrink budget made the final
            # replay pass: either way the failure recorded is the smallest one found
            if search.failure is None:
                raise
        if search.failure is None:
            for case in prop.examples(profile, caps):
                keys = max([case.Tk, *(n + case.new for n in case.cached)])
                batch_heads = math.prod(case.batch) * case.h * max(1, len(case.cached))
                if not profile.within(batch_heads, work(replace(case, Tk=keys))):
                    continue  # a production size, past a fitted kernel's bound
                # an explicit case is refitted to every declared limit (a production
                # size past max_head_dim, a Dv the backend does not take), not skipped
                case = inside(case, caps, chunks=chunks)
                try:
                    body(case)
                except (_Found, _Stop):
                    break

    def finding_of(case: Case, failure: Failure, isolate: bool = True) -> Finding:
        # what the shrunk case needs, before the worker's output is read (its checks
        # add to it)
        needed = needs(prop, ctx, case, failure) if isolate else ()
        return Finding(
            case,
            str(failure),
            failure.got,
            failure.expected,
            failure.where,
            reproducer(
                backend.name,
                prop.id,
                case,
                dtype,
                device,
                str(failure),
                backend.api,
                getattr(executor, "world_size", None),
            ),
            cause_of(failure, dtype_name(dtype)),
            # a supervised worker's (an executor of another kind keeps none)
            getattr(executor, "output_tail", str)(),
            needed,
            None if failure.errors_from is None else failure.errors_from(),
        )

    searched()
    cut = search.shrink_until is not None and time.perf_counter() > search.shrink_until
    if search.failure is not None and cut and not search.late:
        # the shrinker ran out of time (a slow backend: minutes of small steps left a
        # case of 26 queries, 7 keys and 96 dims that 2, 1 and 1 fail the same way)
        budget = max(profile.shrink_seconds, SMALLEST_FIRST_SECONDS)
        search.failure = _smallest_first(
            prop, ctx, search, caps, chunks, dtype_name(dtype), budget, stop_at
        )
    if search.failure is None and search.imprecise is not None and not search.stop:
        # only precision misses: searched again, the same cases in the same order, with
        # a miss a failure to shrink to its smallest case
        search.strict = True
        search.checks = search.skipped = search.refused = 0  # counted as the search that reports
        searched()
    if search.failure is None and search.imprecise is not None:
        search.failure = search.imprecise  # (the second search stopped before it)
    if search.failure is not None and search.failure[1].kind == "died":
        search.failure = (search.failure[0], _alone(search.failure, prop, ctx, executor))
    if search.failure is not None:
        case, failure = search.failure
        also = None
        if search.imprecise is not None and not search.strict:
            # a semantic failure, and precision misses besides: both are findings
            also = finding_of(*search.imprecise, isolate=False)
        result = done("fail", str(failure), finding_of(case, failure))
        result.also = also
        return result
    if search.late:
        return done("skip", LATE)
    spent = f"its budget of {budget:g} s ran out" if search.over_budget else ""
    unchecked = search.skipped + search.refused
    if search.checks and unchecked == search.checks:
        return done("skip", search.skip_reason)
    if unchecked:
        counts = [
            f"{n} cases {what}"
            for n, what in ((search.skipped, "skipped"), (search.refused, "refused"))
            if n
        ]
        note = "; ".join(x for x in (spent, ", ".join(counts)) if x)
        return done("pass", f"{note}, the last: {search.skip_reason}")
    return done("pass", spent)


#: the least time the smallest shapes are tried in after a shrink cut short (each is a
#: call of the smallest sizes: fast even interpreted)
SMALLEST_FIRST_SECONDS = 10.0


def _least(case: Case) -> list[list[dict[str, Any]]]:
    """For each of ``case``'s sizes in turn (head dims, batch, heads, queries, keys),
    the changes that make it smaller, the least first: the first that fails the same
    way is kept. Packed and cached cases keep their lengths (each sequence's are part
    of what they test)."""
    dims = [d for d in (1, 2, 4) if d < max(case.Dh, case.Dv)]
    sizes: list[list[dict[str, Any]]] = [
        [{"Dh": d, "Dv": d} for d in dims],
        [{"batch": (1,) * len(case.batch)}],
        [{"h": case.h // case.g, "g": 1}, {"h": 1, "g": 1}],
    ]
    if not case.seqlens and not case.cached:
        sizes += [[{"Tq": n} for n in (1, 2) if n < case.Tq]]
        sizes += [[{"Tk": n} for n in (1, 2) if n < case.Tk]]
    return sizes


def _smallest_first(
    prop: Property,
    ctx: Context,
    search: _Search,
    caps: Capabilities,
    chunks: int,
    dtype: str,
    budget: float,
    stop_at: float | None,
) -> tuple[Case, Failure]:
    """The search's failure with its case made smaller where it fails the same way (one
    cause): each size taken to its least in turn (`_least`), each change kept where the
    case still fails so, within ``budget`` seconds (at least one try) and the audit's
    deadline. For the shrinker cut short by its time: smallest shapes are cheap to run,
    and a reader takes in 2 queries and 1 key at once."""
    assert search.failure is not None
    case, failure = search.failure
    same = cause_key(cause_of(failure, dtype))
    until = time.perf_counter() + budget
    tried = 0
    for changes in _least(case):
        for change in changes:
            now = time.perf_counter()
            if (tried and now > until) or (stop_at is not None and now > stop_at):
                return case, failure
            try:
                smaller = inside(replace(case, **change), caps, chunks=chunks)
            except (ValueError, TypeError):  # not a case: a size another field needs
                continue
            if smaller == case or _size(smaller) > _size(case):
                continue
            tried += 1
            search.checks += 1
            try:
                prop.check(ctx, smaller)
            except Failure as f:
                if cause_key(cause_of(f, dtype)) == same:
                    case, failure = smaller, f
                    break  # this size is at its least that fails so
            except Skip:
                search.checks -= 1  # not judged
    return case, failure


def _size(case: Case) -> int:
    """How large ``case`` is to a reader: its batch, heads, queries, keys and dims."""
    return math.prod(case.batch) * case.h * case.Tq * case.Tk * max(1, case.Dh + case.Dv)


#: what a crash that its shrunk case does not repeat alone says of itself
NOT_ALONE = (
    "; it does not reproduce alone, in a fresh worker ({}): the crash needs the calls "
    "before it (state kept from earlier calls, or memory they corrupted: an out-of-bounds "
    "write shows later)"
)


def _alone(
    found: tuple[Case, Failure], prop: Property, ctx: Context, executor: Executor | None
) -> Failure:
    """A crash's shrunk case checked once more in a fresh worker (``executor``'s
    ``restart``): a process killed by heap corruption dies on a later call than the one
    that corrupted it, so the case it died on may pass alone, and its reproducer would
    not reproduce. The failure, with what the fresh worker said where it differs."""
    case, failure = found
    restart = getattr(executor, "restart", None)
    if restart is None:  # in the judge's process, or a family's group: no fresh worker
        return failure
    restart()
    try:
        prop.check(ctx, case)
        alone = "it passes"
    except Skip as s:
        alone = f"it is skipped: {s}"
    except Failure as f:
        if f.kind == "died":
            return failure
        # it fails alone too, without the crash: the case is wrong either way, and its
        # reproducer fails; only the crash needs what came before
        return failure.reworded(
            f"{failure}; alone, in a fresh worker, it fails too but does not crash "
            f"({shorten(str(f))}): the crash needs the calls before it, the wrong answer "
            "does not"
        )
    return failure.reworded(str(failure) + NOT_ALONE.format(alone))


def audit(
    backend: Backend | str,
    *,
    api: str | None = None,
    executor: Executor | None = None,
    profile: str | Profile = "quick",
    device: str | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    seed: int = 0,
    properties: Sequence[str] | None = None,
    timeout: float = 60.0,
    fail_fast: bool = False,
    gradients: bool = True,
    progress: bool = True,
    isolate: bool = True,
    threads: int = 1,
    deadline: float | None = None,
    memory_limit: float | None = None,
    on_result: Callable[[AuditReport], None] | None = None,
    report: AuditReport | None = None,
    world_size: int | None = None,
    min_judged: int | None = None,
    property_budget: float | None = None,
    require_sandbox: bool = False,
    jobs: int = 1,
    shard: tuple[int, int] | None = None,
    on_case: Callable[[str, int, float], None] | None = None,
) -> AuditReport:
    """Audit ``backend`` against the float64 oracle: every property in every dtype.

    ``backend``: a `Backend`, or a spec (``module:function``, a built-in, ``mutant.NAME``)
    that only the worker resolves (``api``: its API family), its declaration read back as
    data. ``executor``: where its code runs (default: a new supervised worker, closed
    at the end; one given is left open for the caller to close).

    ``dtypes`` defaults to every dtype the backend declares; ``properties`` to all of
    them (`PROPERTIES`); ``gradients=False`` leaves out the gradient property;
    ``fail_fast`` stops after the first failing property. A property the backend
    cannot be held to (an undeclared capability) is skipped and counted. The audit never
    raises because of the backend.

    ``isolate``: the backend's code runs in a supervised worker process behind the trust
    boundary (`attnref.conformance.worker.Supervised`), so that an exit, a crash or a
    hang is a failure of one case and nothing it does reaches the judge; ``False`` runs
    it in a thread of this process, trusting it. The judge runs its own oracle with
    runtime shape checking off (its inputs are the audit's own cases, and the test suite
    runs the same oracle checked); ``ATTNREF_CHECK_JUDGE=1`` keeps it on. ``threads``:
    torch's intra-op threads here and in the worker (the cases are small: one is
    fastest, and far faster on a loaded machine). ``require_sandbox``: a worker the
    platform does not wholly confine is an error (`BackendError`; the report's
    ``sandbox`` says what was enforced either way). After the backend's first timeout,
    later calls wait at most ten times its slowest answer (at least 1 s).
    ``deadline``: seconds after which no more cases are checked and the report is
    marked incomplete (not OK). ``memory_limit``: GiB of address space the worker may
    use. ``on_result`` is called with the report after each
    (property, dtype), for a partial report on disk, and once more if Ctrl-C
    interrupts the audit (which then raises ``KeyboardInterrupt``, the report marked
    incomplete). ``report``: an empty report to fill (default: a new one), so that a
    caller keeps what was found when the audit is interrupted. ``on_case`` is called
    after each case this judge checks with its search ("forward [float32]"), the cases
    checked in it so far and the seconds since it began: progress within a search, which
    on an interpreted kernel can take minutes.

    A pass judged on fewer cases than a floor (`FLOOR_SHARE` of the profile's examples,
    at least one) is *thin*, shown as such; ``min_judged`` sets the floor, and a thin
    pass then makes the audit not OK (verdict ``THIN``). ``property_budget``: seconds
    each (property, dtype) may search (`run_property`'s ``budget``).

    ``jobs``: judge processes sharing the searches (`attnref.conformance.judges`): this
    one and ``jobs - 1`` helpers, each with a worker of its own. Each search is seeded
    alone, so the verdict on a backend whose answers depend on its inputs alone does not
    depend on ``jobs``; only a backend given as a spec and run in one supervised worker
    is shared out (otherwise one judge runs all).
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    # ``shard=(K, N)``: only the searches K - 1, K - 1 + N, ... of the audit's list; the
    # shards' reports merge into this audit's (`attnref.conformance.exports`)
    if min_judged is not None and min_judged < 1:
        raise ValueError(f"min_judged must be >= 1, got {min_judged}")
    if isinstance(backend, Backend):  # a spec's declaration is checked where it resolves
        why = get_family(backend.api).cannot_honour(backend.capabilities)
        if why is not None:
            raise BackendError(f"{backend.name}: {why}")
    prof = get_profile(profile) if isinstance(profile, str) else profile
    device = device or best_device()
    limit = None if memory_limit is None else int(memory_limit * 2**30)
    owned = executor is None
    if executor is None:
        executor = start_executor(
            backend,
            api,
            isolate=isolate,
            threads=threads,
            memory_limit=limit,
            world_size=world_size,
            require_sandbox=require_sandbox,
        )
    if isinstance(backend, str):
        declared = getattr(executor, "backend", None)
        if not isinstance(declared, Backend):
            raise TypeError("an executor for a backend given by its spec must know its backend")
        backend = declared
    if properties:
        chosen = [get_property(p) for p in properties]
    else:  # every property a backend of its API family can be held to
        chosen = [p for p in PROPERTIES.values() if p.applies_to(backend.api)]
    if not gradients:
        chosen = [p for p in chosen if not p.gradient]
    if deadline is not None or property_budget is not None:
        chosen = family_first(chosen)
    dtype_list = list(dtypes) if dtypes is not None else list(backend.capabilities.dtypes)
    interpreted = dict(getattr(executor, "interpreted", {}) or {})
    prof, sizes = _fitted(prof, backend.capabilities, interpreted.get("interpreter", ""))
    if sizes:
        interpreted["sizes"] = sizes
    left_out = interpreted.get("dtypes_out") or {}
    # an FP8 call returns bfloat16 and is audited in the bfloat16 search; its rounding
    # (FP8's, 2**-4) is far past the interpreter's bfloat16 artefacts (a truncation of
    # 2**-8 at worst), so those searches stay where bfloat16 itself is left out
    fp8_kept = [
        d for d in dtype_list if dtype_name(d) in left_out and d == torch.bfloat16
    ] if backend.capabilities.fp8 else []  # fmt: skip
    dtype_list = [d for d in dtype_list if dtype_name(d) not in left_out]
    report = report or AuditReport.start(
        backend.name,
        device,
        [str(d) for d in dtype_list],
        prof.name,
        seed,
        backend.capabilities,
        backend.api,
    )
    report.trusted = executor.trusted
    report.interpreted = interpreted
    for note in getattr(executor, "notes", ()):
        if note not in report.judge_notes:
            report.judge_notes.append(note)
    few = few_shapes(backend.capabilities, str(interpreted.get("interpreter", "")))
    if few:
        why = "declared" if backend.capabilities.distinct_shapes else "a Pallas kernel"
        report.judge_notes.append(
            f"each (property, dtype) search calls it with at most {few} distinct shapes "
            f"({why}: its first call of a shape compiles); the cases past them take one "
            "of those, their values, masks and variants their own"
        )
    report.dtypes = [dtype_name(d) for d in dtype_list]
    report.sandbox = dict(getattr(executor, "sandbox", {}))
    report.world_size = getattr(executor, "world_size", None)
    report.min_judged = min_judged
    report.examples = prof.examples
    report.floor = min_judged or max(1, math.ceil(prof.examples * FLOOR_SHARE))
    report.options = {
        "timeout": f"{timeout:g} s a call",
        "deadline": "none" if deadline is None else f"{deadline:g} s",
        "property budget": "none" if property_budget is None else f"{property_budget:g} s",
        "min judged": "the floor" if min_judged is None else str(min_judged),
        "gradients": "judged" if gradients else "left out (--no-grad)",
        "fail fast": "yes" if fail_fast else "no",
        "threads": str(threads),
        "properties": "all" if properties is None else ", ".join(properties),
    }
    work = [(p, d) for p in chosen for d in dtype_list]
    work += [(p, d) for p in chosen for d in fp8_kept if "fp8" in p.id]
    if fp8_kept and any(d in fp8_kept for _, d in work):
        report.dtypes.append(dtype_name(torch.bfloat16))
    if shard is not None:  # searches k - 1, k - 1 + n, ... (each seeded alone)
        k, n = shard
        if not 1 <= k <= n:
            raise ValueError(f"shard must be (K, N) with 1 <= K <= N, got {shard!r}")
        work = work[k - 1 :: n]
        report.shard = (k, n)
    report.planned = len(work)
    stop_at = None if deadline is None else time.perf_counter() + deadline
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    was_checking = checking_enabled()
    wait = timeout
    bar = tqdm(total=len(work), desc=f"audit {backend.name}", disable=not progress, leave=False)
    done: dict[int, PropertyResult] = {}
    earlier = list(report.results)
    judges: Judges | None = None

    def record(i: int, result: PropertyResult) -> bool:
        """Keep ``result`` in its place; whether the audit stops here."""
        done[i] = report.mark_thin(result)
        report.results[:] = earlier + [done[k] for k in sorted(done)]
        bar.update()
        if result.message == LATE:
            report.incomplete = f"the deadline of {deadline:g} s passed"
        report.finish()  # the time so far, in a partial report too
        if on_result is not None:
            on_result(report)
        if fail_fast and result.status == "fail":
            report.stopped_early = True
        return report.stopped_early or bool(report.incomplete)

    def collect(judges: Judges, block: bool) -> bool:
        """Record what the helper judges finished; whether the audit stops here."""
        stop = False
        for j, result, note in judges.results(block=block):
            if note:
                bar.write(
                    f"attnref audit: {backend.name} timed out in {result.property} "
                    f"[{dtype_name(result.dtype)}] (a helper judge's); {note}"
                )
            stop = record(j, result) or stop
        return stop

    try:
        if not audit_checking():
            set_checking(False)
        unavailable = availability(backend, device, timeout, executor)
        if unavailable is not None:  # every search skipped, none run
            report.results += [
                PropertyResult(p.id, d, "skip", message=unavailable) for p, d in work
            ]
            bar.update(len(work))
            work = []
        if work and interpreted.get("interpreter"):  # its launch, timed on itself
            chunks = chunks_of(executor)
            launch = _calibrated(backend, executor, device, dtype_list, timeout, chunks)
            if launch is not None:
                launch = replace(launch, budget=prof.call_budget)
                prof = replace(prof, launch=launch)
                report.interpreted["launch"] = launch.said()
        helpers = _helpers_for(jobs, len(work), executor)
        if jobs > 1 and len(work) > 1 and not helpers:
            report.judge_notes.append(
                f"{jobs} judges were asked for; one judged every search: only a backend "
                "given by its spec and run in one supervised worker is shared out (this "
                "one was given from Python, runs in this process, or its family runs a "
                "call on several processes)"
            )
        if helpers:
            judges = _start_judges(
                helpers,
                Setup(
                    spec=executor.spec,  # type: ignore[attr-defined]
                    api=backend.api,
                    work=tuple((p.id, d) for p, d in work),
                    device=device,
                    profile=prof,
                    seed=seed,
                    timeout=timeout,
                    threads=threads,
                    memory_limit=limit,
                    require_sandbox=require_sandbox,
                    budget=property_budget,
                    deadline=None if stop_at is None else stop_at - time.perf_counter(),
                ),
                run_property,
                report.judge_notes,
            )
            report.judges = 1 if judges is None else 1 + helpers
        position = iter(range(len(work)))
        stopped = False
        while not stopped:
            i = next(position, None) if judges is None else judges.take()
            if i is None:
                if judges is None or not judges.busy():
                    break
                stopped = collect(judges, block=True)
                continue
            prop, dtype = work[i]
            bar.set_postfix_str(f"{prop.id} {dtype_name(dtype)}")
            if stop_at is not None and time.perf_counter() > stop_at:
                report.incomplete = f"the deadline of {deadline:g} s passed"
                break
            result = run_property(
                backend,
                prop,
                dtype,
                device=device,
                profile=prof,
                seed=seed,
                timeout=wait,
                executor=executor,
                stop_at=stop_at,
                budget=property_budget,
                on_case=_case_counter(f"{prop.id} [{dtype_name(dtype)}]", bar, on_case),
            )
            if result.message.startswith(TIMED_OUT) and wait == timeout:
                wait = wait_after_timeout(timeout, executor.slowest)
                bar.write(
                    f"attnref audit: {backend.name} timed out in {prop.id} "
                    f"[{dtype_name(dtype)}]; later calls wait at most {wait:.3g} s"
                )
            stopped = record(i, result)
            if judges is not None:
                stopped = collect(judges, block=False) or stopped
        if judges is not None:
            for j, result, _ in judges.results():  # what came in before the audit stopped
                record(j, result)
            report.judge_notes += judges.failures
    except KeyboardInterrupt:  # Ctrl-C: what was found stands, marked incomplete
        report.incomplete = "interrupted"
        report.finish()
        if on_result is not None:
            on_result(report)
        raise
    finally:
        if judges is not None:
            judges.close()
        bar.close()
        if owned:
            executor.close()
        set_checking(was_checking)
        torch.set_num_threads(threads_before)
        report.finish()
    return report


#: the distinct shapes a search of a Pallas kernel calls it with, undeclared
PALLAS_SHAPES = 4
#: a case's shape: what a backend that compiles per shape compiles for
SHAPE_FIELDS = ("batch", "h", "g", "Tq", "Tk", "Dh", "Dv")


def few_shapes(caps: Capabilities, interpreter: str = "") -> int:
    """The distinct shapes one search may call ``caps``'s backend with (0: any): its
    declaration's `distinct_shapes`, else `PALLAS_SHAPES` for a Pallas kernel."""
    if caps.distinct_shapes:
        return caps.distinct_shapes
    return PALLAS_SHAPES if (caps.interpreter or interpreter) == "pallas" else 0


def _seen_shape(
    case: Case, seen: list[tuple[Any, ...]], limit: int, caps: Capabilities, chunks: int
) -> Case:
    """``case`` with a shape the search has called already, once ``limit`` shapes have
    been (its values, masks and variants its own); the first ``limit`` shapes are the
    ones drawn. Packed and cached cases keep theirs (their lengths are each sequence's)."""
    if case.seqlens or case.cached:
        return case
    shape = tuple(getattr(case, f) for f in SHAPE_FIELDS)
    if shape in seen:
        return case
    if len(seen) < limit:
        seen.append(shape)
        return case
    pick = seen[case.seed % len(seen)]
    try:
        moved = inside(replace(case, **dict(zip(SHAPE_FIELDS, pick, strict=True))), caps,
                       chunks=chunks)  # fmt: skip
    except (ValueError, TypeError):  # a shape this case's other fields cannot take
        return case
    return moved


def chunks_of(executor: Executor | None) -> int:
    """The equal chunks a context-parallel case's length must cut into (2 a rank)."""
    return 2 * int(getattr(executor, "world_size", 1) or 1)


def _calibrated(
    backend: Backend,
    executor: Executor,
    device: str,
    dtypes: list[torch.dtype],
    timeout: float,
    chunks: int,
) -> Launch | None:
    """The launch model of an interpreted kernel (`attnref.conformance.launch.calibrate`),
    timed on calls of its own (float32 where it is audited in it): None where one of
    them was refused or failed (a kernel that cannot run the calibration's shapes keeps
    the fitted profile's bounds alone)."""
    if not dtypes:
        return None
    caps = backend.capabilities
    dtype = torch.float32 if torch.float32 in dtypes else dtypes[0]
    ctx = Context(backend, dtype, device, timeout, executor, secret=0)
    dims = caps.head_dims[0] if caps.head_dims else 16

    def time_call(case: Case) -> float | None:
        try:
            inputs = ctx.build(inside(case, caps, chunks=chunks))
            start = time.perf_counter()
            ctx.run(inputs, oracle=False)
            return time.perf_counter() - start
        except (Skip, Failure):
            return None
        except Exception:  # our own building of a case its family cannot take
            return None

    base = Case("launch", Dh=dims, Dv=dims)
    return calibrate(time_call, caps.tile_queries, caps.tile_keys, caps.kv_splits, base)


def family_first(chosen: list[Property]) -> list[Property]:
    """``chosen`` in the order an audit with a deadline or a budget runs them: the first
    (``forward``, the widest), then the family's own properties taking turns with the
    rest. In the registry's order a family's own come last, and a deadline reached among
    the dense properties left every one of them unrun (varlen's, the MLA properties,
    extend's log-sum-exp and sinks)."""
    head, tail = chosen[:1], chosen[1:]
    own = [p for p in tail if p.families]
    rest = [p for p in tail if not p.families]
    turns = [p for pair in zip_longest(own, rest) for p in pair if p is not None]
    return head + turns


def _case_counter(
    label: str, bar: Any, on_case: Callable[[str, int, float], None] | None
) -> Callable[[int], None]:
    """What `run_property` calls after each case of the search ``label``: the progress
    bar's note says how many cases it has checked (at most every half second), and
    ``on_case`` hears of each."""
    start = time.perf_counter()
    shown = [0.0]

    def counted(cases: int) -> None:
        now = time.perf_counter()
        if now - shown[0] >= 0.5:
            shown[0] = now
            bar.set_postfix_str(f"{label}: {cases} cases", refresh=False)
        if on_case is not None:
            on_case(label, cases, now - start)

    return counted


def _fitted(prof: Profile, caps: Capabilities, interpreter: str) -> tuple[Profile, str]:
    """The profile fitted to a kernel's declared tiles and cost bound (`fitted`), and
    what to say of it; an interpreted kernel that declares no bound gets its
    interpreter's (`Interpreter.default_work`). ``prof`` as it is for a kernel that
    declares neither and runs natively."""
    interpreter = caps.interpreter or interpreter
    work = caps.max_call_work
    if not work and interpreter:
        work = INTERPRETERS[interpreter].default_work
    tiles = (caps.tile_queries, caps.tile_keys, caps.kv_splits)
    if not work and not any(tiles):
        return prof, ""
    prof = fitted(
        prof,
        tile_queries=caps.tile_queries,
        tile_keys=caps.tile_keys,
        kv_splits=caps.kv_splits,
        max_call_work=work,
    )
    said = [f"tiles {caps.tile_queries or '-'} x {caps.tile_keys or '-'} (queries x keys)"]
    if caps.kv_splits:
        said.append(f"{caps.kv_splits} KV splits")
    said.append(f"work per call at most {prof.max_work:,} (batch*h*Tq*Tk*(Dh+Dv))")
    said.append(f"long keys {', '.join(map(str, prof.long_keys))}")
    said.append(f"long queries {', '.join(map(str, prof.long_queries))}")
    return prof, "; ".join(said)


def _start_judges(
    n: int, setup: Setup, run: Callable[..., PropertyResult], notes: list[str]
) -> Judges | None:
    """``n`` helper judges, or None (and a note why) where they cannot start: they only
    make the audit faster, and one judge runs every search as well."""
    try:
        return Judges(n, setup, run)
    except Exception as e:  # no process, no pipe: the audit goes on alone
        notes.append(f"helper judges could not start ({type(e).__name__}: {e}); one judged all")
        return None


def _helpers_for(jobs: int, searches: int, executor: Executor) -> int:
    """How many helper judges an audit of ``searches`` searches starts for ``jobs``: none
    where its backend is not one supervised worker resolved from a spec (a declaration
    given from Python stays in this process; a family that runs a call on several
    processes has its own), and never more than there are searches to share."""
    if jobs <= 1 or searches <= 1 or not getattr(executor, "from_spec", False):
        return 0
    return min(jobs, searches) - 1


def check_case(
    pid: str,
    backend: Backend | str,
    case: Case,
    dtype: torch.dtype,
    device: str = "cpu",
    *,
    api: str | None = None,
    isolate: bool = True,
    timeout: float = 60.0,
    world_size: int | None = None,
    save: str | Path | None = None,
) -> str:
    """Check one case of property ``pid``: ``"pass"``, ``"skip: why"`` or ``"FAIL: why"``.

    What reproducers call. ``backend``: a `Backend`, or a spec that only the worker
    resolves (``api``: its family). ``isolate``: the backend runs in a supervised worker
    behind the trust boundary, so that a crash is a failure rather than the end of the
    reproducer; ``False`` runs it in this process, trusting it. ``save``: a folder to
    write what the check saw into, for a debugger: ``inputs.pt`` (each call's arguments
    exactly as the backend received them, and what it returned) and ``expected.pt``
    (each float64 oracle the check computed, its inputs and its bounds); load them with
    ``torch.load(path, weights_only=True)``.
    """
    executor: Any = start_executor(backend, api, isolate=isolate, world_size=world_size)
    if save is not None:
        executor = Recording(executor)
    resolved: Backend = executor.backend
    prop = get_property(pid)
    if not prop.applies_to(resolved.api):
        executor.close()
        return f"skip: a property of the {' and '.join(prop.families)} family"
    # every row of a long case is judged: a reproducer must see the row that failed
    ctx = Context(resolved, dtype, device, timeout, executor, sample=False)
    try:
        prop.check(ctx, case)
    except Skip as s:
        return f"skip: {s}"
    except Failure as f:
        return f"FAIL: {f}"
    finally:
        executor.close()
        if save is not None:
            _save(Path(save), executor.calls, ctx.oracles(), ctx.answers(), executor.notes)
    return "pass"


#: the most elements a call's result may hold for `Recording.reading` to probe it (a
#: float64 position each: 1 GiB); a larger result (a cache of billions of slots, as
#: kvcache_far_pages' at the default profile) is not located, and repro.py says so
PROBE_ELEMENTS = 2**27


class Recording:
    """An executor that keeps each call it runs: the job (its arguments, as the backend
    receives them) and what came back (None where the call failed)."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.calls: list[tuple[Any, Any]] = []
        #: where each judged answer lies in what its call returned, by the identity of
        #: the inputs it answers: (inputs, call index, output's flat positions, LSE's,
        #: what is wrong with the output read where it is not one: its type or shape)
        self.readings: dict[int, tuple[Any, int, Tensor | None, Tensor | None, str]] = {}
        #: what repro.py is told of a call beyond its job and result, by its index: for
        #: a failed call, the ``shapes`` a correct one returns, the ``dtype`` of its
        #: output and what was ``malformed`` in what it returned (`reading`); the
        #: ``world`` it ran on, where the executor runs a call on several ranks
        self.notes: dict[int, dict[str, Any]] = {}
        #: the last call's index, its probe and the number of elements it returned
        self.probe: tuple[int, object, int] | None = None
        #: the index of the first call of the last `Series` (its calls are recorded
        #: one by one)
        self.series_start = 0

    def locate(self, read: Callable[[object], object]) -> tuple[int, Tensor] | None:
        """The last call's index and the flat positions of the part ``read`` picks from
        its result (`reading`'s probe), or None where that part is not positions."""
        if self.probe is None:
            return None
        call, probe, total = self.probe
        try:
            part = read(probe)
        except Exception:
            return None
        if not isinstance(part, Tensor):
            return None
        where, _ = _positions(part, total, tuple(part.shape), "a part")
        return None if where is None else (call, where)

    def run(self, job: Any, timeout: float, meanwhile: Any = None) -> Any:
        first = len(self.calls)
        world = self._world(job)
        try:
            out = self.inner.run(job, timeout, meanwhile)
        except BaseException:
            self.calls.append((job, None))
            if world is not None:
                self.notes.setdefault(first, {})["world"] = world
            raise
        if isinstance(job, Series):  # each of its calls, as repro.py makes it alone
            self.series_start = len(self.calls)
            try:
                values = series_outcomes(out, len(job.calls))
            except (Raised, InternalError):
                values = [None] * len(job.calls)
            for call, value in zip(job.calls, values, strict=True):
                failed = isinstance(value, Raised | InternalError)
                self.calls.append((call, None if failed else value))
        else:
            self.calls.append((job, out))
        if world is not None:
            for i in range(first, len(self.calls)):
                self.notes.setdefault(i, {})["world"] = world
        return out

    def _world(self, job: Any) -> int | None:
        """The ranks ``job`` runs on, where the executor runs a call on several
        (`attnref.conformance.families.context_parallel.RankGroup.world_of`)."""
        world_of = getattr(self.inner, "world_of", None)
        if world_of is None:
            return None
        try:
            calls = job.calls if isinstance(job, Series) else [job]
            return max(int(world_of(c)) for c in calls)
        except Exception:  # outside the declaration: the call is skipped, not run
            return None

    def reading(
        self,
        raw: object,
        read: Reader,
        failed: bool = False,
        series_call: int | None = None,
        dtype: torch.dtype | None = None,
        malformed: str | None = None,
    ) -> None:
        """How the result ``raw`` of the last call is read (`note_reading`): ``read``
        applied to a probe of ``raw`` whose tensors hold their own flat positions
        (counted from 1, so that a zero the reader made up is no position), kept where
        each part it reads is made of positions alone (a reader that computes, rounds or
        fills is not kept: repro.py then compares nothing of that call). ``failed``:
        the call failed, and ``raw`` is the result a correct one would return: its shapes
        are kept as the call's (what repro.py reads a function swapped in by).
        ``series_call``: ``raw`` is that call's of the last `Series` (each recorded as a
        call of its own: repro.py calls it on fresh copies). ``dtype``: with ``failed``,
        the dtype a correct call returns its output in; ``malformed``: what was wrong
        with the result the call returned."""
        leaves = _tensor_leaves(raw)
        total = sum(t.numel() for t in leaves)
        if not self.calls or not leaves or total > PROBE_ELEMENTS:
            return
        call = len(self.calls) - 1
        if series_call is not None:
            call = self.series_start + series_call
        blocks, start = [], 1
        for t in leaves:
            blocks.append(
                torch.arange(start, start + t.numel(), dtype=torch.float64).reshape(t.shape)
            )
            start += t.numel()
        probe = _rebuild(raw, iter(blocks))
        self.probe = (call, probe, total)
        try:
            parts = list(read(probe))
        except Exception:  # a reader that checks what a probe is not: nothing kept
            return
        if failed:
            note = self.notes.setdefault(call, {})
            note["shapes"] = [list(t.shape) for t in leaves]
            if dtype is not None:
                note["dtype"] = str(dtype).removeprefix("torch.")
            if malformed is not None:
                note["malformed"] = malformed
        for inputs, out, lse in parts:
            shape = (*inputs.query.shape[:-1], inputs.value.shape[-1])
            where, problem = _positions(out, total, shape, "an output")
            lse_where, _ = _positions(lse, total, shape[:-1], "a log-sum-exp")
            self.readings[id(inputs)] = (inputs, call, where, lse_where, problem)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _tensor_leaves(x: object) -> list[Tensor]:
    """The tensors of ``x``, depth first through its tuples and lists (repro.py's order)."""
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, tuple | list):
        return [t for item in x for t in _tensor_leaves(item)]
    return []


def _rebuild(x: object, blocks: Iterator[Tensor]) -> object:
    """``x`` with its tensors replaced, in `_tensor_leaves`' order, by ``blocks``."""
    if isinstance(x, Tensor):
        return next(blocks)
    if isinstance(x, list):
        return [_rebuild(item, blocks) for item in x]
    if isinstance(x, tuple):
        items = [_rebuild(item, blocks) for item in x]
        return cast(Any, type(x))(*items) if hasattr(x, "_fields") else tuple(items)
    return x


def _positions(
    part: object, total: int, shape: tuple[int, ...], what: str
) -> tuple[Tensor | None, str]:
    """``part`` of a probe's reading as flat positions from 0, or None where it is not
    made of positions alone; and what is wrong with it where it is not ``what`` of
    ``shape`` (a message repro.py prints where the backend returns the same again)."""
    if not isinstance(part, Tensor):
        return None, f"returned {what} that is a {type(part).__name__}, not a tensor"
    if tuple(part.shape) != shape:
        return None, f"returned {what} of shape {tuple(part.shape)}, expected {shape}"
    if part.dtype != torch.float64:
        return None, ""
    part = part.detach()
    if part.numel() and not bool(((part == part.round()) & (part >= 1) & (part <= total)).all()):
        return None, ""
    return (part - 1).long(), ""


def _save(
    folder: Path,
    calls: list[tuple[Any, Any]],
    oracles: list[Any],
    answers: list[Any],
    notes: dict[int, dict[str, Any]],
) -> None:
    """``inputs.pt`` and ``expected.pt`` in ``folder`` (`check_case`'s ``save``): each
    call's ``shapes`` those of the tensors it returned, or (a failed call) those a
    correct one returns, where known (`Recording.notes`: then ``well_formed`` is true,
    with the ``dtype`` its output is due in and what was ``malformed``); ``world`` the
    ranks it ran on, where several."""
    folder.mkdir(parents=True, exist_ok=True)
    kept = []
    for i, (job, out) in enumerate(calls):
        note = notes.get(i, {})
        kept.append({
            "args": list(getattr(job, "args", ())),
            "kwargs": dict(getattr(job, "kwargs", {})),
            "d_out": getattr(job, "d_out", None),
            "writable": list(getattr(job, "writable", ())),
            "leaves": list(getattr(job, "leaves", ())),
            "returned": out,
            "shapes": note.get("shapes", [list(t.shape) for t in _tensor_leaves(out)]),
            "well_formed": "shapes" in note,
            "dtype": note.get("dtype"),
            "world": note.get("world"),
            "malformed": note.get("malformed"),
        })  # fmt: skip
    torch.save({"calls": kept}, folder / "inputs.pt")
    torch.save({"oracles": oracles, "answers": answers}, folder / "expected.pt")


def property_seed(seed: int, pid: str, dtype: torch.dtype) -> int:
    """The Hypothesis seed of one (property, dtype) run of an audit seeded ``seed``."""
    return zlib.crc32(f"{seed}:{pid}:{dtype}".encode())
