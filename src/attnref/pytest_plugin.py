"""pytest plugin: ``pytest --attnref-backend=module:function`` audits a backend in your CI.

Registered through the ``pytest11`` entry point, so installing attnref is enough. Without
``--attnref-backend`` it adds nothing. With it, the run gains one test per property and
dtype (``attnref/BACKEND::PROPERTY[DTYPE]``), reported like any other test, JUnit XML
included: a failure shows the shrunk case and a runnable reproducer; a property the
backend does not declare support for is a skip with the reason.

torch and the audit are imported only once the option is given.
"""

from typing import Any

import pytest

from attnref.conformance.options import AuditSettings, add_audit_options

__all__ = ["AuditItem"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnref", "attnref conformance audit")
    group.addoption(
        "--attnref-backend",
        action="append",
        default=[],
        metavar="SPEC",
        help="audit this backend (built-in name, mutant.NAME or module:function); repeatable",
    )
    add_audit_options(group.addoption, prefix="attnref-", choices=False)


class AuditFailure(Exception):  # noqa: N818 (a test outcome)
    """A property failed: the message is the shrunk case's summary and reproducer."""


class AuditItem(pytest.Item):
    """One property of one backend in one dtype."""

    def __init__(
        self,
        *,
        backend: Any,
        prop: Any,
        dtype: Any,
        settings: AuditSettings,
        executor: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.prop = prop
        self.dtype = dtype
        self.settings = settings
        self.executor = executor
        self.add_marker(pytest.mark.attnref)

    def runtest(self) -> None:
        from attnref.conformance import run_property
        from attnref.conformance.calls import availability
        from attnref.conformance.report import is_thin

        s = self.settings
        reason = availability(self.backend, s.device, s.timeout, self.executor)
        if reason is not None:
            pytest.skip(reason)
        result = run_property(
            self.backend,
            self.prop,
            self.dtype,
            device=s.device,
            profile=s.profile,
            seed=s.seed,
            timeout=s.timeout,
            executor=self.executor,
            budget=s.property_budget,
        )
        self.user_properties.append(("checks", result.checks))
        self.user_properties.append(("judged", result.judged))
        if result.status == "skip":
            pytest.skip(result.message)
        if result.status == "fail":
            assert result.finding is not None
            raise AuditFailure(f"{result.message}\n\n{result.finding.reproducer}")
        if s.min_judged is not None and is_thin(result, s.min_judged, s.profile.examples):
            raise AuditFailure(
                f"thin: judged on {result.judged} of {result.checks} drawn cases "
                f"({result.skipped} skipped, {result.refused} refused), fewer than "
                f"--attnref-min-judged {s.min_judged}"
            )

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, AuditFailure):  # the failure first: the short summary
            return f"{excinfo.value}\n(property {self.prop.id}: {self.prop.summary})"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int | None, str]:
        return f"attnref/{self.backend.name}", None, self.name


_EXECUTORS: list[Any] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "attnref: a property audited by attnref's plugin")
    if config.getoption("attnref_backend"):
        from attnref import _forkserver

        # the workers' parent imports torch while pytest collects and imports the rest
        _forkserver.start()


def pytest_unconfigure(config: pytest.Config) -> None:
    while _EXECUTORS:
        _EXECUTORS.pop().close()


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    specs: list[str] = config.getoption("attnref_backend")
    if not specs:
        return
    from attnref.conformance import PROPERTIES, BackendError
    from attnref.conformance.options import OptionError, audit_settings
    from attnref.devices import dtype_name

    try:
        settings = audit_settings(lambda dest: config.getoption(f"attnref_{dest}"))
    except OptionError as e:
        raise pytest.UsageError(f"attnref: {e}") from None
    import torch

    from attnref.conformance.worker import start_executor

    torch.set_num_threads(settings.threads)
    props = [PROPERTIES[n] for n in settings.properties or PROPERTIES]
    if not settings.gradients:
        props = [p for p in props if not p.gradient]
    audited: list[pytest.Item] = []
    for spec in specs:
        try:  # the backend's module is imported in its worker only
            executor = start_executor(
                spec,
                settings.api,
                isolate=settings.isolate,
                threads=settings.threads,
                memory_limit=settings.memory_limit_bytes,
                world_size=settings.world_size,
                require_sandbox=settings.require_sandbox,
            )
        except BackendError as e:
            raise pytest.UsageError(f"--attnref-backend: {e}") from None
        backend = executor.backend
        _EXECUTORS.append(executor)  # one worker per backend, for every item
        for prop in props:
            for dtype in settings.dtypes or backend.capabilities.dtypes:
                name = f"{prop.id}[{dtype_name(dtype)}]"
                audited.append(
                    AuditItem.from_parent(
                        session,
                        name=name,
                        nodeid=f"attnref/{spec}::{name}",  # like pytest's path::test[param]
                        backend=backend,
                        prop=prop,
                        dtype=dtype,
                        settings=settings,
                        executor=executor,
                    )
                )
    items.extend(audited)
    # counted like collected items, so the header's "collected N items" includes them
    report = pytest.CollectReport("attnref", "passed", None, list(audited))
    config.hook.pytest_collectreport(report=report)
