"""The first audit: correct backends pass, planted bugs fail, bad backends are reported."""

import json
from pathlib import Path

import pytest
import torch

from attnref.conformance import (
    BUILTIN_BACKENDS,
    AuditReport,
    BackendError,
    Case,
    audit,
    fixed_grid,
    resolve_backend,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def run(spec: str, **kwargs: object) -> AuditReport:
    return audit(resolve_backend(spec), device="cpu", progress=False, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(BUILTIN_BACKENDS))
def test_builtin_backends_pass(name: str) -> None:
    report = run(name, dtypes=DTYPES)
    assert report.ok, report.format_table()
    assert report.count("pass") >= len(fixed_grid()) * len(DTYPES) - len(DTYPES)


def test_an_independent_correct_backend_passes() -> None:
    report = run("tests.planted:correct", dtypes=DTYPES)
    assert report.ok, report.format_table()


def test_reference_contains_nan_in_padding_and_torch_skips_it() -> None:
    nan_cases = [c for c in fixed_grid() if c.nan_in_masked]
    assert nan_cases
    ref = run("reference", cases=nan_cases, dtypes=DTYPES)
    assert ref.count("pass") == len(nan_cases) * len(DTYPES)
    theirs = run("torch-sdpa", cases=nan_cases, dtypes=DTYPES)
    assert theirs.count("skip") == len(nan_cases) * len(DTYPES)


@pytest.mark.parametrize(
    ("spec", "caught_by"),
    [
        ("tests.planted:empty_row_nan", {"empty_rows", "causal_bottom_right_empty_rows"}),
        ("tests.planted:empty_row_uniform", {"empty_rows", "causal_bottom_right_empty_rows"}),
        ("tests.planted:gqa_tiled", {"gqa", "gqa_masked", "gqa_decode", "gqa_causal"}),
        ("tests.planted:causal_excludes_self", {"causal", "hot_causal", "gqa_causal"}),
        ("tests.planted:scale_by_d", {"basic", "tq_ne_tk", "hot"}),
        ("tests.planted:mask_inverted", {"bool_mask", "padding", "causal_bottom_right"}),
        ("tests.planted:contiguous_assumed", {"transposed_query", "sliced_kv", "broadcast_kv"}),
    ],
)
def test_planted_bugs_fail(spec: str, caught_by: set[str]) -> None:
    report = run(spec, dtypes=(torch.float32,))
    failed = {r.case.name for r in report.results if r.status == "fail"}
    assert not report.ok
    assert caught_by <= failed, f"expected {caught_by} among the failures, got {failed}"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.planted:raises", "RuntimeError: kernel launch failed"),
        ("tests.planted:wrong_shape", "returned shape"),
        ("tests.planted:not_a_tensor", "returned list, not a tensor"),
        ("tests.planted:wrong_dtype", "returned dtype torch.float64, expected torch.float32"),
    ],
)
def test_misbehaving_backends_are_reported(spec: str, message: str) -> None:
    report = run(spec, dtypes=(torch.float32,), cases=fixed_grid()[:3])
    assert report.count("fail") == 3
    assert all(message in r.message and "\n" not in r.message for r in report.results)


def test_a_hanging_backend_times_out() -> None:
    report = run("tests.planted:hangs", dtypes=(torch.float32,), cases=[Case("basic")], timeout=0.2)
    assert report.count("fail") == 1
    assert "TimeoutError: no answer within 0.2 s" in report.results[0].message


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("flash", "unknown backend 'flash'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("tests.planted:missing", "has no attribute 'missing'"),
        ("tests.planted:NOT_CALLABLE", "is not callable"),
        ("tests.planted:no_mask_argument", "lacks the keyword arguments attn_mask"),
    ],
)
def test_bad_backend_specs(spec: str, message: str) -> None:
    with pytest.raises(BackendError, match=message):
        resolve_backend(spec)


def test_json_report(tmp_path: Path) -> None:
    report = run("tests.planted:gqa_tiled", dtypes=(torch.float32,), cases=fixed_grid()[:20])
    path = tmp_path / "report.json"
    report.write_json(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1
    assert data["backend"] == "tests.planted:gqa_tiled"
    summary = data["summary"]
    assert summary["ok"] is False
    assert summary["passed"] + summary["failed"] + summary["skipped"] == 20
    failing = [r for r in data["results"] if r["status"] == "fail"]
    assert {r["case"]["name"] for r in failing} == {"gqa"}  # MQA (g = 1) cannot show tiling
    assert failing[0]["max_err"] > failing[0]["max_bound"]
    assert failing[0]["case"]["h"] == 6
    assert failing[0]["dtype"] == "float32"
