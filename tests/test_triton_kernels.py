"""Triton kernels audited through Triton's interpreter on the CPU (docs/interpreted.md):
attnref's own flash and split-KV decode kernels pass, and each bug planted in their
Triton code fails the quick audit, within the kernel's declared tiles and cost bound
(`tests/planted_triton.py`). Slow: an interpreted call costs milliseconds a program, so
the decode kernels are audited on their family's cache properties, each planted bug on
the one aimed at its class (the whole quick audits are measured in
docs/interpreted.md). Needs the ``interpret`` extra (triton,
numpy), which `.ci/run` installs."""

from dataclasses import replace

import pytest
import torch

from attnref.conformance import audit
from attnref.conformance.profiles import PROFILES

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

#: the quick profile with 10 drawn cases a search, not 25 (each property's fixed cases
#: all run): the correct kernels' tests ask that no property fails them, and the whole
#: quick audits, every dtype, are measured in docs/interpreted.md
SMOKE = replace(PROFILES["quick"], name="smoke", examples=10)


@pytest.mark.parametrize(
    ("spec", "api", "properties"),
    [
        ("tests.planted_triton:tail_dropped", "flash", None),
        ("tests.planted_triton:causal_top_left", "flash", None),
        ("tests.planted_triton:no_rescale", "flash", None),
        # each on the cache property aimed at its class, for time (every cache property
        # fails page_off_by_one and merge_unweighted: docs/interpreted.md)
        ("tests.planted_triton:page_off_by_one", "flash-kvcache", ["kvcache_pages"]),
        ("tests.planted_triton:merge_unweighted", "flash-kvcache", ["kvcache_splits"]),
        ("tests.planted_triton:v_descale_dropped", "flash-kvcache", ["kvcache_fp8"]),
    ],
)
def test_a_bug_planted_in_triton_code_fails_the_quick_audit(
    spec: str, api: str, properties: list[str] | None
) -> None:
    report = audit(spec, api=api, properties=properties, fail_fast=True, progress=False)
    assert report.interpreted["interpreter"] == "triton"
    assert not report.ok, report.format_table()
    assert report.count("fail"), report.format_table()


#: the properties whose cases cross the kernel's tiles, masks and alignments (every
#: property took 200 s of CI's slow tier; the whole quick audit is measured in
#: docs/interpreted.md)
TILE_PROPERTIES = ["forward", "tails", "causality", "gqa", "masked_keys", "decode",
                   "degenerate", "variants", "lse", "merge", "layouts", "empty_rows"]  # fmt: skip


def test_the_right_flash_kernel_passes_interpreted() -> None:
    """The tile-crossing properties in float32 here (`TILE_PROPERTIES`), with fewer
    drawn cases (`SMOKE`); bfloat16 passes
    the interpreter's own check once attnref has fixed its bfloat16 arithmetic
    (`attnref.interpreted.triton_fixes`)."""
    report = audit("tests.planted_triton:right", api="flash", dtypes=(torch.float32,),
                   properties=TILE_PROPERTIES, profile=SMOKE, progress=False)  # fmt: skip
    assert report.ok, report.format_table()
    assert report.interpreted["dtypes_out"] == {}
    assert report.interpreted["checked"]["bfloat16"] < 0.1
    assert "bfloat16" in report.interpreted["patched"]
    assert report.interpreted["sizes"].startswith("tiles")
    assert report.interpreted["launch"].startswith("launch model: ")  # timed on the kernel
    # and its cases cut to the profile's budget a call (quick's 1 s, not the model's 8)
    assert "cut to a predicted 1 s a call" in report.interpreted["launch"]


def test_a_module_that_sets_triton_interpret_itself_is_audited_as_interpreted() -> None:
    """A module that sets TRITON_INTERPRET=1 at import and declares no interpreter got a
    native kernel's production sizes and 60 s timeouts (35 properties failed for them,
    with no hint): it is now audited as declared, after attnref set the interpreter up,
    and the report says so."""
    from attnref.conformance.sandboxed import UNDECLARED_TRITON

    report = audit("tests.triton_undeclared:flash", api="flash", properties=["forward"],
                   dtypes=(torch.float32,), profile=SMOKE, progress=False)  # fmt: skip
    assert report.interpreted["interpreter"] == "triton"
    assert "bfloat16" in report.interpreted["patched"]
    assert report.interpreted["sizes"].startswith("tiles")
    assert UNDECLARED_TRITON in report.judge_notes
    assert f"note: {UNDECLARED_TRITON}" in report.format_table()
    assert report.ok, report.format_table()


def test_a_kernel_that_sums_a_bfloat16_tile_passes_in_bfloat16() -> None:
    """The right kernel with its row sums over bfloat16 P (`tl.sum` of a bfloat16 tile):
    bfloat16 is judged (the interpreter's check of itself runs the same sums) and it
    passes. Before the reductions were fixed, every sum was the bits' and the kernel
    took the blame, as vLLM's Triton MLA decode did for 9 failures."""
    report = audit("tests.planted_triton:sums_in_bfloat16", api="flash",
                   properties=["forward", "tails", "causality"], dtypes=(torch.bfloat16,),
                   profile=SMOKE, progress=False)  # fmt: skip
    assert report.interpreted["dtypes_out"] == {}
    assert report.ok, report.format_table()
    assert all(r.status == "pass" for r in report.results), report.format_table()


def test_the_right_decode_kernel_passes_the_cache_properties_fp8_included() -> None:
    """FP8 calls return bfloat16 and are audited in the bfloat16 search (float32 and
    bfloat16 here, with fewer drawn cases (`SMOKE`), for time)."""
    report = audit("tests.planted_triton:decode_right", api="flash-kvcache",
                   properties=["kvcache_pages", "kvcache_splits", "kvcache_fp8"],
                   dtypes=(torch.float32, torch.bfloat16), profile=SMOKE,
                   progress=False)  # fmt: skip
    assert report.ok, report.format_table()
    fp8 = [r for r in report.results if "fp8" in r.property and r.status == "pass"]
    assert fp8, report.format_table()
    assert {r.dtype for r in fp8} == {torch.bfloat16}


def test_an_autotuned_kernel_runs_the_configuration_its_pruning_keeps() -> None:
    """Each call runs the first configuration the kernel's own ``prune_configs_by``
    keeps for it, and the report names the kernel and its configurations: pinned to the
    first listed (16 keys a row), a kernel whose pruning drops it past 16 keys was
    blamed for every longer row. Without its pruning, the same kernel fails so."""
    kw = {"api": "sdpa", "properties": ["forward"], "profile": SMOKE, "progress": False}
    pruned = audit("tests.triton_autotuned:attention", **kw)  # type: ignore[arg-type]
    assert pruned.ok, pruned.format_table()
    tuned = {t["kernel"]: t for t in pruned.interpreted["autotuned"] if t["pruned"]}
    assert tuned["_softmax_rows"]["configs"] == 6
    assert "BLOCK_N: 16" in tuned["_softmax_rows"]["first"]
    assert "autotuned: _softmax_rows, 6 configurations: each call runs the first its " \
        "prune_configs_by keeps" in pruned.format_table()  # fmt: skip
    unpruned = audit("tests.triton_autotuned:unpruned", fail_fast=True, **kw)  # type: ignore[arg-type]
    assert not unpruned.ok, unpruned.format_table()


@pytest.mark.parametrize(
    ("spec", "ok", "properties"),
    [
        ("tests.planted_linear_triton:right", True, ["gdn_packed"]),
        ("tests.planted_linear_triton:gva_modulo", False, ["gdn_gva"]),
        ("tests.planted_linear_triton:last_token_unwritten", False, ["gdn_tails"]),
    ],
)
def test_a_gated_delta_kernel_in_triton_is_audited_interpreted(
    spec: str, ok: bool, properties: list[str]
) -> None:
    """A plain Triton fused-recurrent kernel (tests/planted_linear_triton.py) whose loop
    variable is used as a tensor (``i.to(tl.int64)``) and whose autotuner is built as a
    class, as fla's kernels are: it runs through the interpreter (without attnref's
    fixes it raised in every call, a blame on the kernel for its interpreter), the
    correct one passes and each planted bug fails the property aimed at it."""
    report = audit(spec, api="gated-delta", properties=properties, dtypes=(torch.float32,),
                   profile=SMOKE, progress=False, fail_fast=not ok)  # fmt: skip
    assert report.ok == ok, report.format_table()
    if ok:
        tuned = {t["kernel"] for t in report.interpreted["autotuned"]}
        assert "_recurrent" in tuned, report.interpreted
