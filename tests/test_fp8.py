"""FP8 KV caches in the flash-kvcache family: q, K and V stored in FP8 with
FlashAttention 3's per-row, per-KV-head descales (docs/kvcache.md#fp8-caches)."""

from pathlib import Path

import pytest
import torch

from attnref.conformance import PROPERTIES, Case, resolve_backend
from attnref.conformance.serving import build_cache, quantize
from attnref.conformance.wire import decode, encode
from tests.bug_reports import reports_reproduce
from tests.planted_fp8 import UNSEEN
from tests.test_audit import KILL, run

FP8_PROPS = ["kvcache_fp8", "kvcache_fp8_fold", "kvcache_fp8_groups"]


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_an_fp8_call_stores_each_row_divided_by_its_own_scales(fmt: str) -> None:
    """The descales are float32 (B, g), none within sqrt(2) of 1, different per KV head;
    each row's dense inputs are exactly its stored FP8 values times its scales; the
    FP8 tensors cross the trust boundary as they are."""
    case = Case("fp8", h=4, g=2, Dh=8, Dv=8, cached=(5, 0, 9), Tq=2, page=4, shuffle=True,
                causal="bottom_right", seed=11, fp8=fmt)  # fmt: skip
    call = quantize(build_cache(case, torch.float64), fmt, case.seed)
    for d in (call.q_descale, call.k_descale, call.v_descale):
        assert d is not None
        assert d.dtype == torch.float32
        assert d.shape == (3, 2)
        assert bool((d.log2().abs() >= 0.5).all())
        assert bool((d[:, 0] != d[:, 1]).all())
    assert call.q.dtype == call.k_cache.dtype == getattr(torch, f"float8_{fmt}")
    assert call.k_descale is not None
    assert call.q_descale is not None
    x = call.rows[2]
    table = call.block_table
    assert table is not None
    for t in range(9):
        stored = call.k_cache[int(table[2, t // 4]), t % 4].double()  # (g, Dh)
        assert torch.equal(x.key[:, t], stored * call.k_descale[2][:, None].double())
    heads = call.q_descale[0].repeat_interleave(2).double()
    assert torch.equal(
        call.rows[0].query, call.q[0].double().transpose(0, 1) * heads[:, None, None]
    )
    back = decode(encode((call.q, call.k_cache)))
    assert torch.equal(back[1].view(torch.uint8), call.k_cache.view(torch.uint8))


@pytest.mark.slow
def test_the_dequantizing_built_ins_pass_the_fp8_properties() -> None:
    for name in ("kvcache-reference", "kvcache-naive"):
        report = run(name, properties=FP8_PROPS, dtypes=(torch.bfloat16,))
        assert report.ok, report.format_table()
        assert {r.property for r in report.results if r.status == "pass"} == set(FP8_PROPS)


def test_an_fp8_call_is_skipped_outside_bfloat16_and_without_a_declaration() -> None:
    report = run("kvcache-reference", properties=["kvcache_fp8"], dtypes=(torch.float32,))
    (result,) = report.results
    assert result.status == "skip"
    assert "bfloat16" in result.message, result.message
    plain = resolve_backend("kvcache-sdpa")  # declares no FP8
    assert PROPERTIES["kvcache_fp8"].why_not(plain.capabilities) == "FP8 caches not declared"


# both in the slow tier (5-6 s each): the default tier fails the FP8 mutants
@pytest.mark.slow
@pytest.mark.parametrize("name", ["correct_fp8", "rounds_p"])
def test_independent_fp8_kernels_pass(name: str) -> None:
    """Dequantizing to bfloat16 (vLLM's way) and folding the scales into float32 scores
    with P rounded to e4m3, declared (FlashAttention 3's), both pass."""
    backend = resolve_backend(f"tests.planted_fp8:{name}", api="flash-kvcache")
    report = run(backend, properties=FP8_PROPS, dtypes=(torch.bfloat16,))
    assert report.ok, report.format_table()


@pytest.mark.parametrize(
    "name",
    # all in the slow tier: the default tier fails the FP8 mutants of the kill matrix
    [pytest.param(n, marks=pytest.mark.slow) for n in UNSEEN],
)
def test_fp8_kernels_with_bugs_the_mutants_do_not_plant_are_failed(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Class-34 kernels written apart from the mutants (q_descale ignored, the descales
    read transposed, a query head's KV head taken modulo, v_descale on the scores), and
    P rounded to FP8 without declaring it (the first in the default tier, every one in
    the slow tier)."""
    backend = resolve_backend(f"tests.planted_fp8:{name}", api="flash-kvcache")
    report = run(backend, properties=FP8_PROPS, dtypes=(torch.bfloat16,), profile=KILL)
    assert not report.ok, report.format_table()
    reports_reproduce(request, report, "tests.planted_fp8:correct_fp8", tmp_path)


@pytest.mark.slow  # 20-32 s on a loaded machine: the default tier ran 240 s of its 180
def test_a_kernel_built_for_another_fp8_variant_fails_the_default_audit() -> None:
    """Calibrated caches (scale = amax / 448, as vLLM's and FlashAttention 3's callers
    compute it) store values up to the format's largest: a kernel that reads e4m3fn
    values as e4m3fnuz's range allows (clamped at 240) fails the default (quick) audit.
    Scales of 1/8 to 8 alone kept stored values below about 32, and it passed."""
    backend = resolve_backend("tests.planted_fp8:clamps_at_240", api="flash-kvcache")
    report = run(backend, properties=FP8_PROPS, dtypes=(torch.bfloat16,))
    assert not report.ok, report.format_table()


def test_a_calibrated_scale_puts_the_stored_values_at_the_format_s_largest() -> None:
    from attnref.conformance.serving import calibrated_scale

    x = torch.randn(1000, dtype=torch.float64) * 3
    for fmt, top in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        scale = calibrated_scale(x.abs().max(), fmt, torch.tensor(1.0, dtype=torch.float64))
        stored = (x / scale.double()).to(fmt).double()
        assert stored.abs().max() == top


def test_a_declaration_with_an_unknown_fp8_format_is_refused() -> None:
    from attnref.conformance.declarations import Capabilities

    with pytest.raises(ValueError, match="unknown format 'e4m3'"):
        Capabilities.preset("flash-kvcache", fp8=("e4m3",))


def test_the_log_sum_exp_of_an_fp8_call_is_judged() -> None:
    """A kernel whose output is right and whose LSE comes from the scores before the
    descales fails `kvcache_fp8` on its log-sum-exp (written apart from the mutants)."""
    backend = resolve_backend("tests.planted_fp8:lse_without_descale", api="flash-kvcache")
    report = run(backend, properties=["kvcache_fp8"], dtypes=(torch.bfloat16,))
    (result,) = report.results
    assert result.status == "fail", report.format_table()
    assert "log-sum-exp" in result.message, result.message


@pytest.mark.parametrize(
    ("name", "what"),
    [("new_keys_undescaled", ": output: max error"), ("append_not_stored", "appended slot")],
)
def test_an_append_into_an_fp8_cache_is_judged(name: str, what: str) -> None:
    """An FP8 call may append new keys and values (FP8, with the row's scales): a kernel
    that attends them without their scales fails on its output, one that attends them
    right but never stores them fails on the cache it leaves (written apart from the
    mutants); the correct kernels append and pass (`test_independent_fp8_kernels_pass`)."""
    backend = resolve_backend(f"tests.planted_fp8:{name}", api="flash-kvcache")
    report = run(backend, properties=["kvcache_fp8"], dtypes=(torch.bfloat16,))
    (result,) = report.results
    assert result.status == "fail", report.format_table()
    assert what in result.message, result.message
