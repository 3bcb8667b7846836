"""Shared test configuration: Hypothesis profiles.

``HYPOTHESIS_PROFILE=ci`` (the default) is quick and derandomized, so CI is repeatable;
``thorough`` tries many more examples, for nightly runs or before a release;
``dev`` is random, for finding new failures locally; ``mutations`` is ``ci`` without
shrinking, for tools/property_mutations.py, which asks only whether a test fails.
"""

import json
import os
from collections.abc import Iterator
from pathlib import Path

# Before anything imports attnref: check the private helpers' shape contracts too.
os.environ.setdefault("ATTNREF_CHECK_INTERNALS", "1")
# `attnref audit` run by a test judges in one process (its default is one per core, up
# to 2): pytest-xdist already keeps every core busy. tests/test_judges.py holds --jobs.
os.environ.setdefault("ATTNREF_JOBS", "1")

import torch
from hypothesis import HealthCheck, Phase, settings

# Every tensor in the suite is tiny: torch's thread pool costs more than it gives there,
# and far more on a loaded machine.
torch.set_num_threads(1)

settings.register_profile(
    "ci",
    max_examples=40,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "mutations",
    settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.register_profile("dev", max_examples=60, deadline=None, print_blob=True)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402 (after the environment is set, like the import above)


@pytest.fixture(scope="module")
def unchecked() -> Iterator[None]:
    """Runtime shape checking off for a module (``pytestmark =
    pytest.mark.usefixtures("unchecked")``): for tests that call the reference thousands
    of times (audits, decoding loops), whose shape contracts are tested elsewhere.
    Module-scoped, so that Hypothesis tests can use it."""
    from attnref import set_checking

    set_checking(False)
    try:
        yield
    finally:
        set_checking(True)


#: each long test's seconds (setup, call and teardown), as last recorded: pytest-xdist
#: hands tests out in collection order, and a 5-minute test handed out last ran alone
#: while the other core idled. ``ATTNREF_DURATIONS=record`` records a run's (merged
#: into the file); tests/README.md says when.
DURATIONS = Path(__file__).parent / "data" / "durations.json"
#: a test recorded at least this long is run first, the longest first; the rest keep
#: their order (and a module's tests their module-scoped fixtures)
LONG = 2.0
_took: dict[str, float] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The long tests first, longest first (the same order on every worker)."""
    try:
        known = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    long = sorted(
        (item for item in items if known.get(item.nodeid, 0.0) >= LONG),
        key=lambda item: -known[item.nodeid],
    )
    first = {id(item) for item in long}
    items[:] = long + [item for item in items if id(item) not in first]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("ATTNREF_DURATIONS") == "record":
        _took[report.nodeid] = _took.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With ``ATTNREF_DURATIONS=record``, the run's times merged into `DURATIONS` (on the
    controller, which hears every worker's reports; each rounded to 0.1 s)."""
    if os.environ.get("ATTNREF_DURATIONS") != "record" or hasattr(session.config, "workerinput"):
        return
    try:
        known = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        known = {}
    known.update({k: round(v, 1) for k, v in _took.items()})
    long = {k: v for k, v in sorted(known.items()) if v >= LONG / 2}
    DURATIONS.write_text(json.dumps(long, indent=0, sort_keys=True) + "\n")
