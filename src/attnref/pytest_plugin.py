"""pytest plugin: ``pytest --attnref-backend=module:function`` audits a backend in your CI.

Registered through the ``pytest11`` entry point, so installing attnref is enough. Without
``--attnref-backend`` it adds nothing. With it, the run gains one test per property and
dtype (``attnref[BACKEND]::PROPERTY[DTYPE]``), reported like any other test, JUnit XML
included: a failure shows the shrunk case and a runnable reproducer; a property the
backend does not declare support for is a skip with the reason.

attnref and torch are imported only once the option is given.
"""

from typing import Any

import pytest

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
    group.addoption(
        "--attnref-profile",
        default="quick",
        choices=["quick", "ci", "thorough"],
        help="how hard to search (default: quick)",
    )
    group.addoption("--attnref-device", default=None, help="cpu or cuda (default: best)")
    group.addoption(
        "--attnref-dtype",
        action="append",
        default=[],
        help="dtype to audit, repeatable (default: every dtype the backend declares)",
    )
    group.addoption(
        "--attnref-property", action="append", default=[], help="only this property; repeatable"
    )
    group.addoption("--attnref-seed", type=int, default=0, help="seed of the search")
    group.addoption("--attnref-timeout", type=float, default=60.0, help="seconds per call")
    group.addoption(
        "--attnref-no-grad", action="store_true", help="leave out the gradient property"
    )


class AuditFailure(Exception):  # noqa: N818 (a test outcome)
    """A property failed: the message is the shrunk case's summary and reproducer."""


class AuditItem(pytest.Item):
    """One property of one backend in one dtype."""

    def __init__(self, *, backend: Any, prop: Any, dtype: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.prop = prop
        self.dtype = dtype
        self.add_marker(pytest.mark.attnref)

    def runtest(self) -> None:
        from attnref.conformance import run_property
        from attnref.conformance.profiles import get_profile
        from attnref.conformance.runner import best_device

        opt = self.config.getoption
        device = opt("attnref_device") or best_device()
        reason = self.backend.available(device)
        if reason is not None:
            pytest.skip(reason)
        result = run_property(
            self.backend,
            self.prop,
            self.dtype,
            device=device,
            profile=get_profile(opt("attnref_profile")),
            seed=opt("attnref_seed"),
            timeout=opt("attnref_timeout"),
        )
        self.user_properties.append(("checks", result.checks))
        if result.status == "skip":
            pytest.skip(result.message)
        if result.status == "fail":
            assert result.finding is not None
            raise AuditFailure(f"{result.message}\n\n{result.finding.reproducer}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, AuditFailure):
            return f"{self.prop.id}: {self.prop.summary}\n{excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "attnref", None, self.name


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "attnref: a property audited by attnref's plugin")


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    specs: list[str] = config.getoption("attnref_backend")
    if not specs:
        return
    import os
    import sys

    import torch

    from attnref.conformance import PROPERTIES, BackendError, resolve_backend

    if os.getcwd() not in sys.path:  # module:function may name a file in this folder
        sys.path.insert(0, os.getcwd())
    names = config.getoption("attnref_property") or list(PROPERTIES)
    unknown = [n for n in names if n not in PROPERTIES]
    if unknown:
        raise pytest.UsageError(f"--attnref-property: unknown property {unknown[0]!r}")
    props = [PROPERTIES[n] for n in names]
    if config.getoption("attnref_no_grad"):
        props = [p for p in props if not p.gradient]
    dtype_names: list[str] = config.getoption("attnref_dtype")
    for spec in specs:
        try:
            backend = resolve_backend(spec)
        except BackendError as e:
            raise pytest.UsageError(f"--attnref-backend: {e}") from None
        dtypes = list(backend.capabilities.dtypes)
        if dtype_names:
            try:
                dtypes = [getattr(torch, d) for d in dtype_names]
            except AttributeError as e:
                raise pytest.UsageError(f"--attnref-dtype: {e}") from None
        for prop in props:
            for dtype in dtypes:
                dt = str(dtype).removeprefix("torch.")
                items.append(
                    AuditItem.from_parent(
                        session,
                        name=f"attnref[{spec}]::{prop.id}[{dt}]",
                        backend=backend,
                        prop=prop,
                        dtype=dtype,
                    )
                )
