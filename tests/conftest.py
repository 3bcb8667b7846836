"""Shared test configuration: Hypothesis profiles.

``HYPOTHESIS_PROFILE=ci`` (the default) is quick and derandomized, so CI is repeatable;
``thorough`` tries many more examples, for nightly runs or before a release;
``dev`` is random, for finding new failures locally; ``mutations`` is ``ci`` without
shrinking, for tools/property_mutations.py, which asks only whether a test fails.
"""

import os
from collections.abc import Iterator

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
