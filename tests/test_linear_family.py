"""The gated delta rule's families (``gated-delta``, ``gated-delta-decode``): attnref's own
kernels pass, planted kernels written apart from the reference fail where their bug is,
and bad input to a property is reported, not a crash (docs/linear.md)."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attnref.conformance import PROFILES
from attnref.conformance import audit as run
from attnref.conformance.cases import Case
from attnref.conformance.families import FAMILIES, MUTANTS
from attnref.conformance.families.gated_delta import FLA_CHUNK, build_call, expected
from attnref.conformance.profiles import Profile
from attnref.conformance.report import AuditReport
from tests.bug_reports import reports_reproduce

QUICK = PROFILES["quick"]
FEW = replace(QUICK, name="few", examples=6)
SLOW = pytest.mark.slow


def _audit(backend: str, api: str, properties: list[str], dtypes: tuple[torch.dtype, ...],
           profile: Profile = FEW) -> AuditReport:  # fmt: skip
    return run(backend, api=api, properties=properties, dtypes=dtypes, profile=profile,
               progress=False)  # fmt: skip


def test_the_families_are_installed_with_their_own_properties_only() -> None:
    for name in ("gated-delta", "gated-delta-decode"):
        family = FAMILIES[name]
        assert not family.dense
        assert family.properties
        assert all(p.families == (name,) for p in family.properties)
        assert family.mutants


@pytest.mark.parametrize(
    ("backend", "api", "props"),
    [
        ("gated-delta-reference", "gated-delta", ["gdn_tails", "gdn_packed", "gdn_continuation"]),
        pytest.param("gated-delta-recurrent", "gated-delta", ["gdn_gates", "gdn_gva"],
                     marks=SLOW),
        pytest.param("gated-delta-decode-reference", "gated-delta-decode",
                     ["gdn_decode_pool", "gdn_speculative", "gdn_decode_steps"], marks=SLOW),
    ],
)  # fmt: skip
def test_attnref_s_own_kernels_pass(backend: str, api: str, props: list[str]) -> None:
    report = _audit(backend, api, props, (torch.float32, torch.bfloat16))
    assert report.ok, report.format_table()


@SLOW  # 20 s: every property in two dtypes
def test_a_kernel_that_rounds_its_matmuls_as_fla_s_chunk_kernels_do_passes() -> None:
    """The planted chunked kernel, written apart from attnref (the WY form, each matmul's
    operands rounded to the inputs' dtype, its state rounded before the output's dot, as
    fla's Triton kernels do): inside the bound in half precision, every property."""
    props = [p.id for p in FAMILIES["gated-delta"].properties]
    report = _audit("tests.planted_linear:right", "gated-delta", props,
                    (torch.bfloat16, torch.float16))  # fmt: skip
    assert report.ok, report.format_table()


@pytest.mark.parametrize(
    ("bug", "caught_by"),
    [
        ("gate_sum_crosses_sequences", "gdn_packed"),
        pytest.param("tail_decay_skipped", "gdn_tails", marks=SLOW),
        pytest.param("underflowing_ratio", "gdn_gates", marks=SLOW),
    ],
)
def test_planted_chunk_kernels_fail_where_their_bug_is(
    bug: str, caught_by: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    report = _audit(f"tests.planted_linear:{bug}", "gated-delta", [caught_by], (torch.float32,),
                    QUICK)  # fmt: skip
    assert not report.ok
    (result,) = report.results
    assert result.status == "fail", result.message
    reports_reproduce(request, report, "tests.planted_linear:right", tmp_path)


def test_the_pool_mutants_fail_the_pool_properties_only_where_their_bug_shows() -> None:
    """A speculative-only bug passes plain decode (its trigger is num_accepted_tokens),
    and fails the speculative property."""
    mutant = MUTANTS["gdn_pool_accepted_off_by_one"]
    report = _audit(f"mutant.{mutant.name}", "gated-delta-decode",
                    ["gdn_decode_pool", "gdn_speculative"], (torch.float32,))  # fmt: skip
    status = {r.property: r.status for r in report.results}
    assert status == {"gdn_decode_pool": "pass", "gdn_speculative": "fail"}


def test_kda_s_serving_form_is_audited_with_a_decay_a_key_channel() -> None:
    """KDA in the pool (``linear_gate="key"``: ``g (1, T, HV, K)``, as vLLM's copy of
    fla's ``fused_recurrent_kda`` takes it): attnref's reference passes the three serving
    properties; a kernel that decays the whole state by the channels' mean (a head gate
    where the model gives one a channel) fails them, and a pool mutant still fails."""
    from attnref.conformance.backends import resolve_backend
    from attnref.conformance.families.gated_delta_decode import plain_pool_decode

    def key(backend: object) -> object:
        caps = backend.capabilities  # type: ignore[attr-defined]
        return replace(backend, capabilities=replace(caps, linear_gate="key"))  # type: ignore[type-var]

    def channels_averaged(q, k, v, g, beta, scale, initial_state, *args, **kwargs):  # type: ignore[no-untyped-def]
        return plain_pool_decode(q, k, v, g.mean(-1) if g.dim() == 4 else g, beta, scale,
                                 initial_state, *args, **kwargs)  # fmt: skip

    ref = resolve_backend("gated-delta-decode-reference", api="gated-delta-decode")
    kw = {"dtypes": (torch.float32,), "progress": False, "isolate": False}
    assert run(key(ref), **kw).ok  # type: ignore[arg-type]
    averaged = replace(ref, name="channels_averaged", fn=channels_averaged)
    report = run(key(averaged), **kw)  # type: ignore[arg-type]
    assert {r.status for r in report.results} == {"fail"}, report.format_table()
    mutant = resolve_backend(f"mutant.{MUTANTS['gdn_pool_slot_by_order'].name}")
    assert not run(key(mutant), properties=["gdn_decode_pool"], **kw).ok  # type: ignore[arg-type]


def test_a_slot_no_request_names_written_is_its_own_finding() -> None:
    mutant = MUTANTS["gdn_pool_neighbour_written"]
    report = _audit(f"mutant.{mutant.name}", "gated-delta-decode", ["gdn_decode_pool"],
                    (torch.float32,))  # fmt: skip
    (result,) = report.results
    assert result.status == "fail"
    assert "a pool slot no request names was written" in result.message


def test_the_bound_covers_a_chunk_s_running_sum_of_far_decays() -> None:
    """A chunked kernel forms its decays from running sums in float32: with a decay of
    -1e4 in a chunk, exp(G_i - G_j) is off by about u |G| relative, and the floor says
    so (attnref's own chunked reference failed float32 gdn_gates at 3.1e-5 against a
    floor of 1.2e-5 before it did)."""
    case = Case("far", batch=(1,), h=1, g=1, Tq=4, Tk=4, Dh=8, Dv=8,
                options=(("gate", "far"), ("beta", "edges"), ("initial", False)))  # fmt: skip
    calm = replace(case, options=(("gate", "normal"), ("initial", False)))
    far = expected(build_call(case, torch.float32, "cpu", FLA_CHUNK))
    near = expected(build_call(calm, torch.float32, "cpu", FLA_CHUNK))
    assert far.state.floor > 10 * near.state.floor


def test_a_wrong_return_is_reported_not_a_crash() -> None:
    report = _audit("tests.planted_linear:returns_output_only", "gated-delta", ["gdn_forward"],
                    (torch.float32,))  # fmt: skip
    (result,) = report.results
    assert result.status == "fail"
    assert "returns (o, final_state)" in result.message


def test_a_declared_cost_bound_keeps_the_lengths_and_cuts_the_programs() -> None:
    """An interpreted kernel declares ``max_call_work``: a drawn case keeps its tokens
    (the tails and packs are what it tests) and gives up batch rows, GVA, heads and then
    head dims, in that order."""
    from attnref.conformance.families.gated_delta import fit_work, linear_work

    case = Case("c", batch=(2,), h=12, g=3, Tq=129, Tk=129, Dh=64, Dv=64)
    assert fit_work(case, 0) == case
    fitted = fit_work(case, 2**19)
    assert (fitted.Tq, fitted.batch) == (129, (1,))
    assert linear_work(fitted) <= 2**19
    assert fit_work(case, 2**23) == replace(case, batch=(1,))
    assert fit_work(case, 2**22) == replace(case, batch=(1,), h=3)


def test_a_backward_that_drops_the_final_state_s_gradient_is_found() -> None:
    """A kernel whose own backward recomputes the output alone (its forward right):
    the gradient property gives the final states an upstream gradient, as a loss that
    reads them (or fla's ``dht``) does, and names it in the finding."""
    report = _audit("tests.planted_linear:final_state_gradient_ignored", "gated-delta",
                    ["gdn_gradient"], (torch.float32,))  # fmt: skip
    (result,) = report.results
    assert result.status == "fail"
    assert "final states' gradients" in result.message


@SLOW  # 15 s
def test_a_backward_finding_reproduces_without_attnref(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    report = _audit("tests.planted_linear:final_state_gradient_ignored", "gated-delta",
                    ["gdn_gradient"], (torch.float32,), QUICK)  # fmt: skip
    assert not report.ok
    reports_reproduce(request, report, "tests.planted_linear:right", tmp_path)


def test_kda_s_decay_a_key_channel_is_drawn_where_declared() -> None:
    """``linear_gate="key"`` (fla's ``chunk_kda``): ``g`` comes as ``(B, T, HV, K)``,
    and a kernel that takes the channels' mean as one decay a head fails."""
    case = Case("kda", batch=(1,), h=2, g=2, Tq=5, Tk=5, Dh=8, Dv=4)
    assert build_call(case, torch.float32, "cpu", FLA_CHUNK).g.shape == (1, 5, 2)
    kda = replace(FLA_CHUNK, linear_gate="key", gqa=False)
    assert build_call(case, torch.float32, "cpu", kda).g.shape == (1, 5, 2, 8)
    report = _audit("mutant.gdn_kda_gate_mean", "gated-delta", ["gdn_forward"],
                    (torch.float32,))  # fmt: skip
    (result,) = report.results
    assert result.status == "fail"
    assert "KDA's decay a key channel" in result.message
    with pytest.raises(ValueError, match="linear_gate must be one of head, key"):
        replace(FLA_CHUNK, linear_gate="channel")


@SLOW  # 35 s
def test_attnref_s_kda_recurrence_passes_every_property_it_declares() -> None:
    report = _audit("gated-delta-kda-recurrent", "gated-delta",
                    [p.id for p in FAMILIES["gated-delta"].properties],
                    (torch.float32, torch.bfloat16))  # fmt: skip
    assert report.ok, report.format_table()


@SLOW  # 10 s
def test_a_call_that_fails_before_it_is_judged_is_a_report_that_reproduces_it(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A call that returns the wrong thing keeps what it was to be judged against, so
    that its repro.py calls it again and sees it fail (it said "pass" with no answer)."""
    report = _audit("tests.planted_linear:returns_output_only", "gated-delta",
                    ["gdn_forward"], (torch.float32,))  # fmt: skip
    assert not report.ok
    reports_reproduce(request, report, "tests.planted_linear:right", tmp_path)
