"""Shared test configuration: Hypothesis profiles.

``HYPOTHESIS_PROFILE=ci`` (the default) is quick and derandomized, so CI is repeatable;
``thorough`` tries many more examples, for nightly runs or before a release;
``dev`` is random, for finding new failures locally.
"""

import os

# Before anything imports attnref: check the private helpers' shape contracts too.
os.environ.setdefault("ATTNREF_CHECK_INTERNALS", "1")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=40,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
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
