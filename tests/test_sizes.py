"""The audit reaches the sizes and values where production kernels break (classes 32 and
33): kernels right on small cases and wrong past a threshold fail it at the default
profile; a correct blocked kernel passes; every strawman fails every property that can
see it."""

from dataclasses import replace

import pytest
import torch

from attnref.conformance import audit
from attnref.conformance.backends import resolve_backend
from attnref.conformance.profiles import PROFILES
from attnref.conformance.report import AuditReport
from tests.planted_sizes import PLANTED, STRAWMEN

SLOW = pytest.mark.slow
#: the default profile, shrinking for at most half a second (only the verdict matters)
KILL = replace(PROFILES["quick"], name="quick-kill", shrink_seconds=0.5)
#: one of each class runs in the default tier, the others in the slow tier
DEFAULT_TIER = ("split_kv_past_512", "minus_inf_is_5e4")
DEFAULT_STRAWMEN = ("zeros", "one_precision_lower")


def run(spec: str, **kwargs: object) -> AuditReport:
    return audit(resolve_backend(spec), device="cpu", progress=False, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if n in DEFAULT_TIER else (SLOW,)) for n in PLANTED],
)
def test_kernels_wrong_past_a_size_or_a_value_fail_the_default_audit(name: str) -> None:
    report = run(f"tests.planted_sizes:{name}", fail_fast=True, profile=KILL)
    assert not report.ok, report.format_table()
    failed = [r for r in report.results if r.status == "fail"]
    assert failed, report.format_table()


@SLOW
def test_a_correct_blocked_kernel_passes_the_long_cases() -> None:
    # the full audit of it is in the slow tier; here the properties that meet long cases
    report = run(
        "tests.planted_sizes:correct_blocked",
        properties=["forward", "causality", "decode"],
        dtypes=(torch.float32,),
    )
    assert report.ok, report.format_table()


@SLOW
def test_a_correct_blocked_kernel_passes_the_audit() -> None:
    report = run("tests.planted_sizes:correct_blocked", dtypes=(torch.float32, torch.bfloat16))
    assert report.ok, report.format_table()


@pytest.mark.parametrize(
    ("name", "full"),
    [
        pytest.param(n, False, id=f"{n}-forward", marks=() if n in DEFAULT_STRAWMEN else SLOW)
        for n in STRAWMEN
    ]
    + [pytest.param(n, True, id=f"{n}-all", marks=SLOW) for n in STRAWMEN],
)
def test_every_strawman_fails_every_property_that_can_see_it(name: str, full: bool) -> None:
    seen_by = STRAWMEN[name] if full else STRAWMEN[name][:1]
    report = run(
        f"tests.planted_sizes:{name}",
        properties=list(seen_by),
        dtypes=(torch.float32,),
        profile=KILL,
    )
    passed = [r.property for r in report.results if r.status != "fail"]
    assert not passed, report.format_table()
