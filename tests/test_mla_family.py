"""The ``mla`` family (FlashMLA's ``flash_mla_with_kvcache``): its cases, its built-ins
and the kernels of tests/planted_mla.py, written apart from its mutants."""

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnref.conformance import PROFILES, PROPERTIES, Case, check_case, resolve_backend
from attnref.conformance.cases import build
from attnref.conformance.families.mla import HUGE_BLOCK, build_latent, quantize_latent, tied
from attnref.conformance.oracle import Expected, close
from attnref.conformance.strategies import case_strategy, inside
from tests.bug_reports import reports_reproduce
from tests.planted_mla import UNSEEN
from tests.planted_mla_fp8 import UNSEEN as FP8_UNSEEN
from tests.test_audit import KILL, run

MLA_PROPS = [p.id for p in PROPERTIES.values() if p.applies_to("mla")]


def _caps(name: str = "mla-reference"):  # type: ignore[no-untyped-def]
    return resolve_backend(name).capabilities


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_latent_cases_tie_the_values_to_the_keys(data: st.DataObject) -> None:
    """Any dense case moved inside a latent declaration has one KV head, Dv <= Dqk, and
    builds V as K's leading dims (whatever layout, poison or value shaping it draws);
    with FlashMLA's head dims, 576 and 512."""
    caps = _caps()
    case = data.draw(case_strategy("forward", PROFILES["quick"], caps))
    moved = inside(case, caps)
    assert moved.g == 1
    assert moved.latent
    assert moved.Dv <= moved.Dh
    x = build(moved, torch.float32)
    assert tied(x)
    flash = replace(caps, head_dims=(576, 512))
    assert (inside(case, flash).Dh, inside(case, flash).Dv) == (576, 512)


def test_a_call_that_unties_v_is_skipped_with_its_reason() -> None:
    """value_affine changes V apart from K: the mla convention cannot express it."""
    report = run("mla-reference", properties=["value_affine", "forward"], dtypes=(torch.float32,))
    by = {r.property: r for r in report.results}
    assert by["forward"].status == "pass", report.format_table()
    assert by["value_affine"].status == "skip", report.format_table()


def test_the_cache_of_an_mla_case_holds_nan_where_no_sequence_reads() -> None:
    """Unused slots and the tail of each last page are NaN, the table past a sequence's
    pages is FlashMLA's huge id, and the tokens sit where the table says."""
    case = Case("mla", h=4, g=1, Dh=12, Dv=8, cached=(5, 0, 9), Tq=2, page=4, pad=2, seed=3)
    call = build_latent(case, torch.float32)
    assert call.block_table.shape == (3, 3 + 2)
    assert bool((call.block_table[1, 1:] == HUGE_BLOCK).all())
    assert bool((call.block_table[0, 2:] == HUGE_BLOCK).all())
    read = torch.zeros(call.k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(case.cached):
        for t in range(n):
            page, slot = int(call.block_table[b, t // 4]), t % 4
            read[page, slot] = True
            assert torch.equal(call.k_cache[page, slot, 0], call.rows[b].key[0, t])
        assert torch.equal(call.rows[b].value, call.rows[b].key[..., :8])
    assert bool(call.k_cache[~read].isnan().all())


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        pytest.param("mla-sdpa", torch.float32, marks=pytest.mark.slow),
        pytest.param("mla-reference", torch.bfloat16, marks=pytest.mark.slow),
    ],
)
def test_the_mla_built_ins_pass_a_full_audit(name: str, dtype: torch.dtype) -> None:
    """Every property the family can meet (its own and the dense ones through its
    layout); masks, windows and gradients skipped as declared."""
    report = run(name, dtypes=(dtype,))
    assert report.ok, report.format_table()
    judged = {r.property for r in report.results if r.status == "pass"}
    assert {"mla", "mla_pages", "mla_batch", "mla_decode", "mla_merge", "forward"} <= judged


@pytest.mark.slow
def test_the_independent_mla_kernel_itself_passes() -> None:
    backend = resolve_backend("tests.planted_mla:correct_mla", api="mla")
    report = run(backend, properties=MLA_PROPS, dtypes=(torch.float32,))
    assert report.ok, report.format_table()


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if i == 0 else pytest.mark.slow) for i, n in enumerate(UNSEEN)],
)
def test_mla_kernels_with_bugs_the_mutants_do_not_plant_are_failed(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Kernels of classes 25, 27 and 35 written in tests/planted_mla.py on their own: the
    properties of the family aimed at each class fail them."""
    backend = resolve_backend(f"tests.planted_mla:{name}", api="mla")
    aimed = [p.id for p in PROPERTIES.values() if UNSEEN[name] in p.classes and p.applies_to("mla")]
    report = run(backend, properties=aimed, dtypes=(torch.float32,), fail_fast=True, profile=KILL)
    assert not report.ok, report.format_table()
    reports_reproduce(request, report, "tests.planted_mla:correct_mla", tmp_path)


def test_a_kernel_that_ignores_the_caller_s_scale_is_told_so() -> None:
    """The scale trap: outputs that match the kernel's default ``D ** -0.5`` in place of
    the scale passed are named as such."""
    backend = resolve_backend("tests.planted_mla:scale_ignored_many_heads", api="mla")
    report = run(backend, properties=["mla"], dtypes=(torch.float32,), profile=KILL)
    (result,) = report.results
    assert result.status == "fail", report.format_table()
    assert "the scale trap" in result.message, result.message


def test_a_kernel_with_flash_mla_s_own_signature_is_called_as_flash_mla_is() -> None:
    """FlashMLA's tile_scheduler_metadata has no default: the audit gives it None (a
    port schedules its own work), and never passes num_splits, which FlashMLA asserts is
    None."""
    backend = resolve_backend("tests.planted_mla:flashmla_signature", api="mla")
    report = run(backend, properties=["mla", "forward"], dtypes=(torch.float32,))
    assert report.ok, report.format_table()


def test_a_kernel_that_declares_no_lse_is_judged_on_its_output_alone() -> None:
    """An MLA decode that returns no LSE and says so (SGLang's Triton MLA decode): the
    family's own properties judge its output (the ``mla`` property once failed it for the
    LSE it does not return), and the merge law, which needs the LSE, is skipped."""
    backend = resolve_backend("tests.planted_mla:without_lse", api="mla")
    report = run(backend, properties=["mla", "mla_merge"], dtypes=(torch.float32,), profile=KILL)
    status = {r.property: r.status for r in report.results}
    assert status == {"mla": "pass", "mla_merge": "skip"}, report.format_table()


# ------------------------------------------------------------ FP8 latent caches

MLA_FP8 = ["mla_fp8", "mla_fp8_fold", "mla_fp8_values"]


def test_an_fp8_latent_call_stores_q_and_the_cache_in_fp8_with_scales_not_1() -> None:
    """The rows are the stored values times the per-tensor descales (exact in float64),
    V the dequantized keys' leading dims; the unused slots stay NaN; neither scale is
    within sqrt(2) of 1 (a scale of 1 hides class 34)."""
    case = Case("mla", h=4, g=1, Dh=12, Dv=8, cached=(5, 0, 9), Tq=2, page=4, seed=3)
    call = quantize_latent(build_latent(case, torch.float64), "e4m3fn", 3)
    assert call.q.dtype == call.k_cache.dtype == torch.float8_e4m3fn
    assert call.descale_q is not None
    assert call.descale_k is not None
    assert call.descale_q.shape == call.descale_k.shape == (1,)
    for d in (call.descale_q, call.descale_k):
        assert abs(float(d.log2())) >= 0.5
    dq, dk = float(call.descale_q), float(call.descale_k)
    for b, n in enumerate(case.cached):
        x = call.rows[b]
        assert torch.equal(x.query, call.q[b].double().transpose(0, 1) * dq)
        for t in range(n):
            page, slot = int(call.block_table[b, t // 4]), t % 4
            assert torch.equal(x.key[0, t], call.k_cache[page, slot, 0].double() * dk)
        assert torch.equal(x.value, x.key[..., :8])
    assert bool(call.k_cache.float().isnan().any())


# torch's SDPA in the slow tier (3 s each)
@pytest.mark.parametrize(
    "name", ["mla-reference", pytest.param("mla-sdpa", marks=pytest.mark.slow)]
)
def test_the_mla_built_ins_pass_the_fp8_properties(name: str) -> None:
    """The reference (dequantized to float32) and torch's SDPA (dequantized to
    bfloat16, vLLM's way) both pass: the bound covers either rounding."""
    report = run(name, properties=MLA_FP8, dtypes=(torch.bfloat16,))
    assert report.ok, report.format_table()
    assert {r.status for r in report.results} == {"pass"}, report.format_table()


@pytest.mark.slow  # 5 s: the default tier fails the FP8 MLA mutants, and passes the built-ins
def test_the_independent_fp8_mla_kernel_passes() -> None:
    """Descales folded into float32 scores (FlashAttention 3's way), written apart."""
    backend = resolve_backend("tests.planted_mla_fp8:correct_mla_fp8", api="mla")
    report = run(backend, properties=MLA_FP8, dtypes=(torch.bfloat16,))
    assert report.ok, report.format_table()


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if i == 0 else pytest.mark.slow) for i, n in enumerate(FP8_UNSEEN)],
)
def test_fp8_mla_kernels_with_bugs_the_mutants_do_not_plant_are_failed(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The output scaled by descale_q, the rotary dims left undescaled, descale_k read
    as its reciprocal: each fails the FP8 properties."""
    backend = resolve_backend(f"tests.planted_mla_fp8:{name}", api="mla")
    report = run(backend, properties=["mla_fp8"], dtypes=(torch.bfloat16,), profile=KILL)
    assert not report.ok, report.format_table()
    reports_reproduce(request, report, "tests.planted_mla_fp8:correct_mla_fp8", tmp_path)


def test_the_fp8_mla_properties_are_skipped_where_fp8_is_not_declared() -> None:
    """FlashMLA's own dense path takes no FP8 cache: a kernel that declares none is not
    called with one."""
    backend = resolve_backend("tests.planted_mla:correct_mla", api="mla")
    report = run(backend, properties=MLA_FP8, dtypes=(torch.bfloat16,))
    assert {r.status for r in report.results} == {"skip"}, report.format_table()


def test_the_mean_bound_averages_only_the_entries_close_judges() -> None:
    """An LSE expected +inf (a row that sees no key) is held to that policy, not to a
    size: its zero reference error must not dilute the mean bound of the finite rows.
    Before, three empty rows of four cut the mean bound to a quarter, and mla-sdpa, whose
    one finite LSE was off by exactly its rounding to bfloat16, failed (seed 2, quick)."""
    value = torch.tensor([0.8, math.inf, math.inf, math.inf], dtype=torch.float64)
    exp = Expected(value, torch.tensor([2e-3, 0.0, 0.0, 0.0], dtype=torch.float64), 1e-6)
    got = value + torch.tensor([2e-3, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert exp.bounds() == pytest.approx((6e-3, 6e-3))
    close(got, exp.value, *exp.bounds(), "lse")  # within the reference's own error
    case = Case("mla_fp8", h=1, g=1, Tq=4, Tk=1, Dh=8, Dv=8, causal="bottom_right",
                cached=(1,), page=16, shuffle=True, latent=True, fp8="e4m3fn")  # fmt: skip
    verdict = check_case("mla_fp8", "mla-sdpa", case, torch.bfloat16, "cpu", api="mla")
    assert verdict == "pass", verdict


@pytest.mark.slow  # two audits: 13 s
def test_a_kernel_that_gives_nan_for_an_empty_sequence_declares_it() -> None:
    """A torch reference of FlashMLA's decode gives NaN for a query that sees no key (a
    softmax over nothing), where FlashMLA gives 0: declared ``empty_row="nan"``, it
    passes the family's properties; declared as zeros, it fails them."""
    from attnref.conformance import audit

    spec = "tests.planted_mla:nan_empty"
    kwargs = {"api": "mla", "dtypes": [torch.float32], "progress": False,
              "properties": ["mla", "empty_rows", "forward"]}  # fmt: skip
    assert audit(spec, **kwargs).ok  # type: ignore[arg-type]
    backend = resolve_backend(spec, "mla")
    zeros = replace(backend, capabilities=replace(backend.capabilities, empty_row="zero"))
    assert not audit(zeros, **kwargs).ok  # type: ignore[arg-type]
