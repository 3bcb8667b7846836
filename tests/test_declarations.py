"""Declarations that fit narrow libraries, cases drawn inside them, messages that name the
culprit, and reports that never mix runs (docs/conformance.md, "Declare your kernel")."""

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from attnref.conformance import (
    FLASH_ATTN_2,
    PRESETS,
    Backend,
    BackendError,
    Capabilities,
    Case,
    EmptyRows,
    audit,
    check_case,
    resolve_backend,
)
from attnref.conformance.backends import declaration, from_declaration
from attnref.conformance.checks import Context
from attnref.conformance.oracle import expect
from attnref.conformance.strategies import inside
from attnref.conformance.verdicts import Failure, cause_key, cause_of

pytestmark = pytest.mark.usefixtures("unchecked")

NARROW = "tests.narrow:causal_self_attention"


# ---------------------------------------------------------------- drawn inside


@pytest.mark.slow  # two whole audits in float32: the slow tier
def test_a_narrow_backend_is_checked_on_as_many_cases_for_every_property() -> None:
    """Causal self-attention only, the default scale, no mask: the cases are drawn inside
    that, so each property that applies checks as many cases as for torch's SDPA (at
    least 80%), and one that cannot apply is skipped with the reason."""
    wide = audit("torch-sdpa", dtypes=[torch.float32], progress=False)
    narrow = {r.property: r for r in audit(NARROW, dtypes=[torch.float32], progress=False).results}
    for r in wide.results:
        n = narrow[r.property]
        if r.property == "decode":
            assert n.status == "skip"
            assert "needs calls with Tq != Tk" in n.message
        if r.property == "key_permutation":
            assert n.status == "skip"
            assert "needs calls that are not causal" in n.message
        if r.property == "merge":
            assert n.status == "skip"  # no LSE declared
        if n.status == "skip":
            assert n.message, r.property  # undeclared, or why it cannot apply
            continue
        assert n.status == "pass", (r.property, n.message)
        assert n.checks - n.skipped - n.refused >= 0.8 * (r.checks - r.skipped - r.refused)


def test_inside_moves_a_case_into_a_narrow_declaration() -> None:
    caps = resolve_backend(NARROW).capabilities
    case = inside(Case("x", Tq=3, Tk=9, scale=0.5, mask="bool", causal=None), caps)
    assert (case.Tq, case.Tk, case.scale, case.mask, case.causal) == (
        9,
        9,
        None,
        "none",
        "top_left",
    )
    shared = Capabilities(sinks=True, sink_shared=True, sink_values=(0.0,))
    assert inside(Case("x", sinks=True), shared).sink == 0.0
    dims = inside(Case("x", Dh=3, Dv=5), Capabilities(head_dims=(8, 16), distinct_value_dim=False))
    assert dims.Dh in (8, 16)
    assert dims.Dv == dims.Dh
    windowed = Capabilities(window=True, window_required=True)
    assert inside(Case("x"), windowed).window is not None
    plain = Case("x", Tq=3, Tk=9)
    assert inside(plain, Capabilities()) == plain  # nothing narrow declared: unchanged
    # an explicit production size past a declared head dim, or a Dv the declaration does
    # not take, is refitted, not skipped (the runner refits every explicit case)
    capped = Capabilities(max_head_dim=128, distinct_value_dim=False)
    big = inside(Case("x", Dh=192, Dv=128), capped)
    assert (big.Dh, big.Dv) == (128, 128)
    assert inside(Case("x", Dh=64, Dv=32), Capabilities(distinct_value_dim=False)).Dv == 64


def test_a_call_outside_a_narrow_declaration_is_skipped_not_sent() -> None:
    backend = resolve_backend(NARROW)
    cross = Case("x", Tq=2, Tk=5, causal="top_left")
    assert check_case("forward", backend, cross, torch.float32, isolate=False).startswith(
        "skip: Tq = 2 != Tk = 5: self-attention only declared"
    )
    scaled = Case("x", Tq=5, Tk=5, causal="top_left", scale=0.5)
    verdict = check_case("forward", backend, scaled, torch.float32, isolate=False)
    assert verdict.startswith("skip: an explicit scale")


# ---------------------------------------------------------------- declarations


def test_a_declaration_from_another_family_is_loud() -> None:
    with pytest.raises(BackendError, match=r"start from the 'sdpa' family's defaults.*'flash'"):
        Backend("x", print, "", Capabilities(window=True), api="flash")
    ok = Backend("x", print, "", Capabilities.preset("flash", window=False), api="flash")
    assert ok.capabilities.dtypes == FLASH_ATTN_2.dtypes
    assert ok.capabilities.empty_lse == "+inf"  # the family's, not SDPA's
    assert PRESETS["flash-kvcache"].paged
    data = declaration(ok)
    data["api"] = "sdpa"
    with pytest.raises(ValueError, match="start from the 'flash' family's defaults"):
        from_declaration(data)


def test_new_declarations_cross_the_trust_boundary_as_data() -> None:
    caps = Capabilities(
        self_attention_only=True,
        causal_only=True,
        explicit_scale=False,
        sinks=True,
        sink_shared=True,
        sink_values=(0.0, -math.inf),
        sink_gradients=False,
        empty_row=EmptyRows(causal="uniform", causal_masked="nan"),
        empty_row_by_dtype={"float64": "nan", "float16": EmptyRows(bool_mask="unmasked")},
    )
    back = from_declaration(declaration(Backend("x", print, "", caps)))
    assert back.capabilities == caps
    assert caps.for_dtype(torch.float64).empty_row == "nan"
    assert caps.for_dtype(torch.float32).empty_row == caps.empty_row


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"family": ""}, "Capabilities.family must name an API family"),
        ({"empty_row_by_dtype": {"float8": "nan"}}, "is not (dtype name, policy)"),
        ({"empty_row_by_dtype": {"float16": "zeros"}}, "empty_row_by_dtype['float16']"),
        ({"sink_values": (math.nan,)}, "sink_values must not hold NaN"),
        ({"causal_only": True, "causal_alignments": ()}, "causal_only needs the alignment"),
    ],
)
def test_a_bad_narrow_declaration_is_a_clear_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(
        ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        Capabilities(**kwargs)  # type: ignore[arg-type]


def test_an_empty_row_policy_may_depend_on_the_dtype_and_on_a_mask_passed() -> None:
    caps = Capabilities(
        causal_alignments=("top_left", "bottom_right"),
        causal_with_mask=True,  # it applies its diagonal itself, a mask passed or not
        empty_row=EmptyRows(causal="uniform", causal_masked="nan", causal_float_masked="zero"),
        empty_row_by_dtype={"float64": "zero"},
    )
    backend = Backend("x", torch.nn.functional.scaled_dot_product_attention, "", caps)
    case = Case("x", batch=(1,), h=1, g=1, Tq=5, Tk=2, causal="bottom_right")
    ctx = Context(backend, torch.float32, "cpu")
    plain = ctx.build(case)
    assert ctx.empty(plain, "uniform").any()  # the diagonal empties rows: "causal"
    masked = ctx.build(replace(case, mask="padding"))
    assert ctx.empty(masked, "nan").any()  # the same rows, a mask passed: "causal_masked"
    # and a float mask passed: "causal_float_masked"
    floated = ctx.build(replace(case, mask="float"))
    assert floated.attn_mask is not None
    assert floated.attn_mask.is_floating_point()
    assert ctx.empty(floated, "zero").any()
    assert not ctx.empty(floated, "nan").any()
    assert not Context(backend, torch.float64, "cpu").empty(plain, "uniform").any()


@pytest.mark.slow  # three audits (7 s)
def test_a_finite_fill_added_to_the_scores_is_declared_unmasked() -> None:
    """diffusers' -10000 added at hidden keys: a row its mask empties attends the keys the
    mask hid. Declared so, its empty rows pass; declared as zeros, they fail. Rows that
    see keys fail either way once hidden keys' scores lie more than 1e4 above the
    visible ones' (class 33: the fill is a finite stand-in for minus infinity)."""
    props = ["empty_rows", "mask_kinds"]
    for spec, ok in (
        ("tests.narrow:additive_fill", True),
        ("tests.narrow:additive_fill_as_zero", False),
    ):
        report = audit(spec, properties=props, dtypes=[torch.float32], progress=False)
        statuses = {r.property: r.status for r in report.results}
        assert statuses["empty_rows"] == ("pass" if ok else "fail"), report.format_table()
        empty = [cause for cause, _ in report.findings() if "rows that see no key" in cause]
        assert bool(empty) is not ok, report.format_table()
    report = audit(
        "tests.narrow:additive_fill", properties=["forward"], dtypes=[torch.float32], progress=False
    )
    (result,) = report.results
    assert result.status == "fail", report.format_table()
    assert result.finding is not None
    assert result.finding.case.logits != "randn", result.finding.case  # scores past -1e4
    inputs = Context(resolve_backend("reference"), torch.float32, "cpu").build(
        Case("x", batch=(1,), h=1, g=1, Tq=4, Tk=5, mask="empty_rows")
    )
    opened = expect(inputs, EmptyRows(bool_mask="unmasked")).value
    assert bool(torch.isfinite(opened).all())
    assert not bool((opened == 0).all(dim=-1).any())  # no row is zeros


def test_sinks_of_declared_values_shared_by_heads_without_a_gradient() -> None:
    report = audit(
        "tests.narrow:softmax_one", properties=["sinks", "variants"], dtypes=[torch.float64],
        progress=False,
    )  # fmt: skip
    assert report.ok, report.format_table()
    assert all(r.checks - r.skipped >= 20 for r in report.results)


# ---------------------------------------------------------------- messages


def test_failures_with_one_cause_are_one_finding() -> None:
    report = audit(
        "mutant.gqa_tiled", properties=["forward", "gqa", "scale"], dtypes=[torch.float32],
        progress=False,
    )  # fmt: skip
    ((cause, results),) = report.findings()
    assert len(results) == 3
    assert cause.startswith("wrong values")
    table = report.format_table()
    assert "1. wrong values" in table
    assert "3 failures: forward [float32], gqa [float32], scale [float32]" in table


def test_causes_tell_precision_from_wrong_values_and_name_the_policy() -> None:
    small = Failure("x; query 0 sees 3 of 4 keys", kind="error", small=True)
    assert cause_of(small, "float16") == (
        "precision loss: errors above the bound, of a size rounding makes in rows that see "
        "keys, in float16"
    )
    # in a row that sees no key the value is a policy's: an error there breaks it
    policy = Failure("x; query 0 sees no key (declared policy 'zero')", kind="error", small=True)
    assert cause_of(policy, "float16").startswith("wrong values")
    nan = Failure("y; query 1 sees no key (a boolean mask hides them; declared policy 'zero')",
                  kind="nan")  # fmt: skip
    assert cause_of(nan, "float32") == (
        "NaN/inf where the oracle is finite in rows that see no key (declared policy 'zero')"
    )
    # a hint about another row does not label this one (a group "in rows that see no
    # key" once held "query 0 sees 1 of 1 keys; head 1 ... sees no key")
    hinted = Failure(
        "z; query 0 sees 1 of 1 keys; head 1 at the same position sees no key: if ...",
        kind="error",
    )
    assert cause_of(hinted, "float32").endswith("in rows that see keys")
    raised = Failure("RuntimeError: shape '[1, 3, -1, 0]' is invalid for input of size 0")
    assert cause_of(raised, "float32") == str(raised)  # its numbers as they are
    assert (
        cause_key(str(raised))
        == "RuntimeError: shape '[N, N, N, N]' is invalid for input of size N"
    )


def test_a_finding_names_a_dtype_only_where_all_its_failures_are_of_it() -> None:
    """One rule: causes that differ only in numbers (sizes, ranks, values) are one
    finding, named by its first failure's own text (the 32 of float32 is not a number to
    take out); a cause that names a dtype (a precision miss, a returned dtype) is kept
    apart by it, and one that names none (wrong values) is one finding across dtypes. A
    group lists each (property, dtype) once. Before, a group titled "in float16" held
    float32 results, and one listed the same (property, dtype) twice."""
    from attnref.conformance.declarations import Capabilities
    from attnref.conformance.report import AuditReport, Finding, PropertyResult

    report = AuditReport.start("b", "cpu", ["float32", "float64"], "quick", 0, Capabilities())

    def fail(prop: str, dtype: str, failure: Failure, also: Failure | None = None) -> None:
        def finding(f: Failure) -> Finding:
            return Finding(Case("x"), str(f), None, None, None, "", cause_of(f, dtype))

        report.results.append(
            PropertyResult(
                prop,
                getattr(torch, dtype),
                "fail",
                message=str(failure),
                finding=finding(failure),
                also=None if also is None else finding(also),
            )
        )

    small = "max error 0.{}; query 0 sees 3 of 4 keys"
    wrong = "max error {}; query 0 sees 2 of 2 keys"
    fail(
        "forward",
        "float32",
        Failure("returned dtype torch.float16, expected torch.float32 (then rank 0)"),
    )
    fail(
        "hot",
        "float32",
        Failure("returned dtype torch.float16, expected torch.float32 (then rank 1)"),
    )
    fail("forward", "float64", Failure("returned dtype torch.float16, expected torch.float64"))
    fail("scale", "float16", Failure(small.format(1), kind="error", small=True))
    fail("scale", "float32", Failure(small.format(2), kind="error", small=True))
    fail("gqa", "float16", Failure(wrong.format(3), kind="error"),
         also=Failure(wrong.format(4), kind="error"))  # fmt: skip
    fail("gqa", "float32", Failure(wrong.format(5), kind="error"))

    def named(text: str) -> set[str]:
        return {d for d in ("float16", "float32", "float64") if d in text}

    for cause, rs in report.findings():  # every member's own cause names what the title does
        assert all(named(r.finding.cause) == named(cause) for r in rs if r.finding), cause
    groups = {cause: [(r.property, str(r.dtype)) for r in rs] for cause, rs in report.findings()}
    for cause, members in groups.items():
        assert len(set(members)) == len(members), (cause, members)
    first = "returned dtype torch.float16, expected torch.float32 (then rank 0)"
    assert groups[first] == [("forward", "torch.float32"), ("hot", "torch.float32")]
    assert len(groups) == 5  # the returned dtype twice, precision twice, wrong values once
    assert groups[cause_of(Failure(wrong, kind="error"), "float16")] == [
        ("gqa", "torch.float16"), ("gqa", "torch.float32")
    ]  # fmt: skip
    # the ranks a failure spread to are not part of its cause: a series' failure names none
    assert cause_key("rank 0: overflow (then ranks 1, 2, 3)") == cause_key("rank 0: overflow")


def test_a_law_failure_names_both_calls_and_the_oracle() -> None:
    verdict = check_case(
        "gqa", "mutant.gqa_tiled", Case("x", batch=(1,), h=4, g=2, Tq=3, Tk=5), torch.float32
    )
    # the two calls named by what tells them apart (not "changed" and "original", which
    # read the wrong way round for a law whose changed call is the grouped one)
    assert "the call with grouped KV heads gave" in verdict
    assert "the call with the KV heads expanded 0." in verdict
    assert "the oracle sides with the call with the KV heads expanded" in verdict
    # the wrong call first, judged against its oracle; the law after it calls neither
    # call "expected"
    assert "the call with grouped KV heads: max error" in verdict
    assert "expected" not in verdict.split("; the law: ")[1]


def test_the_softcap_bound_names_a_hidden_key_with_weight() -> None:
    """litgpt's softcap path adds a boolean mask to the scores (+1 visible, +0 hidden):
    the check says a hidden key has weight, not that a score left (-c, c)."""
    case = Case(
        "softcap_bound", batch=(1,), h=1, g=1, Tq=1, Tk=16, Dh=16, Dv=16, mask="bool",
        amp=4.0, softcap=1.0, seed=3,
    )  # fmt: skip
    verdict = check_case(
        "softcap_bound", "tests.narrow:softcap_adds_bool_mask", case, torch.float32
    )
    assert "is hidden from query 0 (a boolean mask hides it) but has weight" in verdict
    assert check_case("softcap_bound", "reference", case, torch.float32) == "pass"


def test_a_nan_spread_across_heads_is_explained() -> None:
    """A row that sees keys holds NaN; another head's row at the same position sees none."""
    case = Case("x", batch=(1,), h=2, g=2, Tq=3, Tk=2, mask="bool_full", seed=1)
    verdict = check_case("forward", "tests.narrow:mixes_heads", case, torch.float32)
    assert "NaN/inf values where a finite value is expected" in verdict
    assert "at the same position sees no key: if the backend mixes heads" in verdict


def test_a_raise_on_causal_with_a_mask_says_what_to_declare_in_every_property() -> None:
    """torch's SDPA raises when given is_causal and a mask together; left at the default
    declaration, each failure says which declaration keeps such calls out, a series'
    (fresh_values) as well as a single call's, and they are one finding."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backend = Backend("sdpa", sdpa, "", Capabilities(dtypes=(torch.float32,)))
    report = audit(backend, properties=["forward", "fresh_values"], progress=False,
                   isolate=False)  # fmt: skip
    assert [r.status for r in report.results] == ["fail", "fail"], report.format_table()
    for r in report.results:
        assert "declares causal_with_mask=False" in r.message, r.message
    assert len(report.findings()) == 1, report.format_table()
    # an error of another kind on such a call (a compiler's) gets no hint
    from attnref.conformance.families.sdpa import _sdpa_error_hint

    both = {"is_causal": True, "attn_mask": torch.ones(1, dtype=torch.bool)}
    assert _sdpa_error_hint(Capabilities(), both, "InductorError: C++ compile error") == ""
    assert "causal_with_mask=False" in _sdpa_error_hint(Capabilities(), both, "attn_mask and x")


def test_what_a_declaration_leaves_untested_is_listed_with_why() -> None:
    """The report names each call the declaration rules out, and the declaration that
    does (an OK says nothing of them); a full declaration lists nothing."""
    from attnref.conformance.declarations import not_tested
    from attnref.conformance.report import AuditReport

    full = Capabilities(causal_with_mask=True, causal_alignments=("top_left", "bottom_right"))
    assert not_tested(full) == []
    narrow = replace(full, causal_with_mask=False, gqa=False, dtypes=(torch.float32,))
    listed = not_tested(narrow)
    assert any(
        x.startswith("causal attention with a mask passed together (causal_with_mask=False")
        for x in listed
    )
    assert "grouped-query attention (gqa=False)" in listed
    assert listed[0] == "dtypes float64, float16, bfloat16 (not in dtypes)"
    report = AuditReport.start("b", "cpu", ["float32"], "quick", 0, narrow)
    assert "not tested, as declared:\n  - dtypes float64" in report.format_table()
    assert report.to_dict()["not_tested"] == listed


def test_queries_at_most_keys_keeps_every_call_inside_it() -> None:
    """Declared, no call has more queries than keys (the backend raises on one: the
    audit passes, every property judged); without it, the same backend fails; a call
    outside it is skipped with the reason."""
    props = ["forward", "decode", "causality", "empty_rows", "masked_keys"]
    report = audit(
        "tests.narrow:at_most_keys", dtypes=[torch.float32], properties=props, progress=False
    )
    assert report.ok, report.format_table()
    assert all(r.status == "pass" and r.judged and not r.skipped for r in report.results)
    assert "Tq > Tk (queries_at_most_keys=True)" in report.format_table()
    plain = Backend("plain", resolve_backend("tests.narrow:at_most_keys").fn, "undeclared")
    assert not audit(
        plain, dtypes=[torch.float32], properties=["forward"], progress=False, isolate=False
    ).ok
    case = Case("x", Tq=5, Tk=3)
    verdict = check_case("forward", "tests.narrow:at_most_keys", case, torch.float32)
    assert verdict == "skip: Tq = 5 > Tk = 3: queries at most keys declared"


@pytest.mark.parametrize(
    ("spec", "ok"),
    [("tests.narrow:causal_bottom_right", True), ("tests.narrow:decode_step_top_left", False)],
)
def test_a_causal_only_bottom_right_kernel_is_held_to_decode(spec: str, ok: bool) -> None:
    """A decode step is itself a causal call of a bottom-right kernel (one query, aligned
    with the last key): `decode` runs it so instead of skipping the property, and a
    kernel that aligns a single query top-left fails it."""
    report = audit(
        resolve_backend(spec),
        device="cpu",
        progress=False,
        dtypes=(torch.float32,),
        properties=["decode"],
    )
    (result,) = report.results
    assert result.status == ("pass" if ok else "fail"), report.format_table()
    assert result.judged > 0


def test_sinks_on_every_call_are_declared_and_kept_to() -> None:
    """A library whose attention always has sink logits declares sinks_required: every
    case is drawn with them, none skipped; without the declaration its raise on a call
    without sinks is a failure, and a declaration that asks for it without sinks is
    refused."""
    backend = resolve_backend("tests.narrow:always_sinks")
    props = ["forward", "causality", "masked_keys", "sinks"]
    report = audit(backend, device="cpu", progress=False, dtypes=(torch.float32,), properties=props)
    assert report.ok, report.format_table()
    assert all(r.status == "pass" and r.skipped == 0 for r in report.results), report.format_table()
    plain = replace(backend, capabilities=replace(backend.capabilities, sinks_required=False))
    report = audit(plain, device="cpu", progress=False, dtypes=(torch.float32,), properties=props)
    assert not report.ok
    with pytest.raises(ValueError, match="sinks_required needs sinks=True"):
        Capabilities(sinks_required=True)


def test_sinks_on_every_call_as_gpt_oss_computes_them() -> None:
    """GPT-OSS's way (the sink a column of the softmax): with a sink of -inf as the
    sink law's call without a sink, a row that sees no key is NaN, which the law leaves
    to empty_rows (the declared policy is for its sinks); decode steps keep the sinks."""
    report = audit(
        resolve_backend("tests.narrow:sink_in_the_softmax"),
        device="cpu",
        progress=False,
        dtypes=(torch.float32,),
        properties=["sinks", "decode", "empty_rows", "forward"],
    )
    assert report.ok, report.format_table()
    assert all(r.status == "pass" and r.skipped == 0 for r in report.results), report.format_table()


def test_a_poisoned_case_keeps_the_sinks_and_slopes_of_its_clean_twin() -> None:
    """`masked_keys` compares a call with poison at hidden keys against the clean call:
    the two must differ at the hidden keys alone. The poison once drew from the case's
    generator, and the sink logits and per-sample ALiBi slopes drawn after it changed
    (the reference failed masked_keys with sinks, "query 0 sees 1 of 1 keys")."""
    from attnref.conformance.cases import build

    case = Case(
        "x", batch=(2,), Tq=3, Tk=5, mask="bool", poison="garbage", sinks=True, alibi="batch_heads"
    )
    dirty, clean = (build(c, torch.float32) for c in (case, replace(case, poison="none")))
    assert dirty.sinks is not None
    assert clean.sinks is not None
    assert torch.equal(dirty.sinks, clean.sinks)
    assert dirty.alibi_slopes is not None
    assert clean.alibi_slopes is not None
    assert torch.equal(dirty.alibi_slopes, clean.alibi_slopes)
    assert torch.equal(dirty.query, clean.query)


@pytest.mark.parametrize("bug", ["future_keys", "window_one_short", "garbage_in_a_law"])
def test_semantic_bugs_on_values_far_from_zero_are_wrong_values_not_precision(bug: str) -> None:
    """A wrong function is told from a precision loss by the error against the spread of
    the values a row averages (`Expected.semantic`: 5% of max - min of V over the keys
    seen, at least a few ulps of the output), not the output's size, which a V far from
    zero inflates. The three shapes ONNX Runtime's attention showed, on V shifted by -20
    as the audit draws it, in rows that see 16 keys or more: one future key attended, a
    window one key short, and uninitialised memory (1e14) in the call a law compares
    against. All three were grouped as precision misses before (errors of 0.57, 0.81
    and 1e14, under 5% of the output's size, 36, or of the garbage's)."""
    from attnref.conformance.cases import build
    from attnref.conformance.oracle import close, reference

    case = Case("c", batch=(1,), h=2, g=2, Tq=40, Tk=40, Dh=8, Dv=8, v_offset=-20.0, seed=3)
    case = replace(case, window=(16, 0) if bug == "window_one_short" else (-1, 0))
    inputs = build(case, torch.float32)
    exp = expect(inputs)
    assert exp.semantic is not None
    assert exp.semantic < 0.05 * float(exp.value.abs().max()) / 4  # far below the old rule
    wide = inputs.to(torch.float64)
    rows = torch.zeros(40, 1, dtype=torch.bool)
    rows[16:] = True
    law = None
    if bug == "future_keys":
        got, want = reference(replace(wide, window=(-1, 1))), exp.value
    elif bug == "window_one_short":
        got, want = reference(replace(wide, window=(15, 0))), exp.value
    else:  # the original call's row was never written: the law carries garbage over
        got, law = exp.value.clone(), exp.value
        want = exp.value.clone()
        want[..., 20, :] = 1e14
    with pytest.raises(Failure) as failed:
        close(got, want, *exp.bounds(), "output", rows, law=law, semantic=exp.semantic)
    assert failed.value.kind == "error"
    assert not failed.value.small  # wrong values, not "errors under 5%"
    assert cause_of(failed.value, "float32").startswith("wrong values")
    # a precision loss on the same values stays one: a bfloat16 case's output, rounded
    low = expect(build(case, torch.bfloat16))
    assert low.semantic is not None
    rounded = low.value.to(torch.bfloat16).to(torch.float64)
    with pytest.raises(Failure) as imprecise:
        close(rounded + 8 * (rounded - low.value), low.value, *low.bounds(), "output",
              semantic=low.semantic)  # fmt: skip
    assert imprecise.value.small


@pytest.mark.slow  # two properties at quick: 8 s
def test_a_backend_whose_value_dim_is_its_head_dim_is_drawn_inside_it() -> None:
    """``distinct_value_dim=False``: every property draws Dv == Dqk, as the declaration
    says, and judges its cases instead of skipping them (``large_index`` skipped 28-38 of
    60 at ci, and ``degenerate`` drew Dv != Dqk too)."""
    same = Backend(
        "same-dims",
        torch.nn.functional.scaled_dot_product_attention,
        "",
        Capabilities(distinct_value_dim=False, causal_with_mask=False),
        spec="torch-sdpa",
    )
    report = audit(same, device="cpu", progress=False, properties=["large_index", "degenerate"],
                   dtypes=[torch.float32])  # fmt: skip
    for r in report.results:
        assert r.status == "pass", r.message
        assert r.skipped == 0, (r.property, r.message)


def test_a_flash_kernel_that_is_top_left_declares_it_and_is_judged_so() -> None:
    """A ``flash`` kernel whose causal diagonal is top-left when Tq != Tk (FlashAttention
    before 2.1) declares ``causal_alignments=("top_left",)``: its causal calls with Tq !=
    Tk are made and judged top-left, and it passes; declaring the preset's bottom-right
    instead, the same kernel fails."""
    props = ["forward", "causality"]
    kwargs = {"properties": props, "dtypes": [torch.float32], "device": "cpu", "progress": False}
    right = audit(resolve_backend("tests.planted_flash:top_left_causal", api="flash"), **kwargs)  # type: ignore[arg-type]
    assert right.ok, right.format_table()
    assert all(r.judged for r in right.results)
    wrong = audit(resolve_backend("tests.planted_flash:top_left_undeclared", api="flash"), **kwargs)  # type: ignore[arg-type]
    assert not wrong.ok


def test_a_declaration_the_family_cannot_honour_is_an_error() -> None:
    """``causal_alignments=("top_left",)`` on a ``flash-varlen`` (or kvcache, mla)
    backend was accepted, reported "not tested", and its Tq != Tk causal calls were
    judged bottom-right anyway (11 failures): it is refused, naming what to declare, from
    a spec and from Python alike."""
    from attnref.conformance.families.flash_varlen import FLASH_ATTN_2_VARLEN

    caps = replace(FLASH_ATTN_2_VARLEN, causal_alignments=("top_left",))
    backend = Backend("top-left-varlen", lambda *a, **k: None, "", caps, api="flash-varlen")
    with pytest.raises(BackendError, match=r"bottom_right only.*declare causal_alignments"):
        audit(backend, device="cpu", progress=False, properties=["varlen"])
    from attnref.conformance.family import get_family

    for api in ("flash-varlen", "flash-kvcache", "mla"):
        family = get_family(api)
        assert family.cannot_honour(family.defaults) is None
        bad = replace(family.defaults, causal_alignments=("top_left",))
        assert family.cannot_honour(bad) is not None


@pytest.mark.slow  # six window audits: 6 s
def test_a_backend_whose_windows_end_at_the_query_is_audited_inside_that() -> None:
    """``causal_windows_only`` (ONNX Runtime GQA's ``local_window_size``): windows are
    drawn ``(left, 0)`` and ``window_none`` checks ``(-1, 0)`` on causal calls, so such
    a backend passes (two-sided windows judged 5-6 of 25 cases before); declaring
    two-sided windows, the same kernel fails."""
    from attnref.conformance.declarations import not_tested

    props = ["window_keys", "window_none", "variants"]
    kwargs = {"properties": props, "dtypes": [torch.float32], "device": "cpu", "progress": False}
    spec = "tests.planted:windows_end_at_the_query"
    right = audit(resolve_backend(spec), **kwargs)  # type: ignore[arg-type]
    assert right.ok, right.format_table()
    assert all(r.judged >= 10 for r in right.results), right.format_table()
    assert any("windows that reach past the query" in u for u in not_tested(
        right.capabilities))  # fmt: skip
    declared = replace(resolve_backend(spec).capabilities, causal_windows_only=False)
    both = Backend("two-sided", resolve_backend(spec).fn, "", declared, spec=spec)
    assert not audit(both, **kwargs).ok  # type: ignore[arg-type]


def test_head_dims_and_lengths_by_a_rule_are_drawn_inside_it() -> None:
    """Head dims that must be multiples of 8 and lengths of 16 and 32 (a kernel's
    blocks) are declared as rules, not lists: cases are drawn at the nearest multiple,
    the kernel (which raises outside them) passes with its cases judged, and a call of
    other lengths is skipped, not failed. Undeclared, the same kernel fails."""
    spec = "tests.planted:tiled_lengths_and_dims"
    kwargs = {"properties": ["forward", "layouts", "decode"], "dtypes": [torch.float32],
              "device": "cpu", "progress": False}  # fmt: skip
    report = audit(resolve_backend(spec), **kwargs)  # type: ignore[arg-type]
    assert report.ok, report.format_table()
    forward, layouts, decode = report.results
    assert forward.judged >= 20, report.format_table()
    assert layouts.judged >= 20, report.format_table()
    assert decode.status in ("pass", "skip")  # its one-query steps are outside it
    declared = replace(resolve_backend(spec).capabilities, head_dim_multiple=1,
                       length_multiples=(1, 1))  # fmt: skip
    plain = Backend("untiled", resolve_backend(spec).fn, "", declared, spec=spec)
    assert not audit(plain, **kwargs).ok  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="length_multiples"):
        Capabilities(length_multiples=(0, 16))


def test_a_causal_flag_for_square_calls_only_gets_the_rest_folded_into_the_mask() -> None:
    """``causal_square_only``: the library's own causal flag holds for Tq == Tk only;
    a causal call with Tq != Tk reaches it folded into the mask, and it passes (with
    the flag it raises there, as the same kernel undeclared shows)."""
    spec = "tests.planted:causal_flag_square_only"
    kwargs = {"properties": ["forward", "causality"], "dtypes": [torch.float32],
              "device": "cpu", "progress": False}  # fmt: skip
    report = audit(resolve_backend(spec), **kwargs)  # type: ignore[arg-type]
    assert report.ok, report.format_table()
    assert all(r.skipped == 0 for r in report.results), report.format_table()
    caps = replace(resolve_backend(spec).capabilities, causal_square_only=False)
    flagged = Backend("flag-everywhere", resolve_backend(spec).fn, "", caps, spec=spec)
    assert not audit(flagged, **kwargs).ok  # type: ignore[arg-type]


@pytest.mark.slow  # four audits: 5 s
def test_a_finite_diagonal_and_an_inf_mask_is_a_policy_that_can_be_declared() -> None:
    """ONNX Runtime's GroupQueryAttention adds a finite fill on its causal diagonal and
    -inf in its mask: a row the diagonal alone empties attends the keys it hid, one the
    mask empties is NaN, and one both empty attends the keys the diagonal alone hid.
    ``EmptyRows(causal="diagonal", ...)`` declares it, and such a kernel's empty rows
    pass; declared as the default policy, they fail. (Its finite fill is still a
    stand-in for -inf that scores past 1e4 see through: forward fails it, rightly.)"""
    spec = "tests.planted:finite_diagonal_inf_mask"
    kwargs = {"properties": ["empty_rows", "mask_kinds"], "dtypes": [torch.float32],
              "device": "cpu", "progress": False}  # fmt: skip
    report = audit(resolve_backend(spec), **kwargs)  # type: ignore[arg-type]
    assert report.ok, report.format_table()
    caps = replace(resolve_backend(spec).capabilities, empty_row="nan")
    plain = Backend("nan-everywhere", resolve_backend(spec).fn, "", caps, spec=spec)
    assert not audit(plain, **kwargs).ok  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="diagonal"):
        EmptyRows(causal="diagonals")  # type: ignore[arg-type]


@pytest.mark.slow  # three audits: 9 s
def test_a_replaced_diagonal_fill_is_declared_diagonal_replaced() -> None:
    """ONNX Runtime's MultiHeadAttention replaces its causal diagonal's scores with one
    finite value: a row the diagonal empties is the plain mean of V over the keys it hid,
    which neither the added fill (``diagonal``) nor the mean of every V (``uniform``)
    expressed, so the library failed as declared as well as it could. Declared
    ``diagonal_replaced`` it passes; the added fill declared so fails, and the replaced
    one declared as the added fill fails too."""
    kwargs = {"properties": ["empty_rows", "mask_kinds"], "dtypes": [torch.float32],
              "device": "cpu", "progress": False}  # fmt: skip
    replaced = resolve_backend("tests.planted:replaced_diagonal_inf_mask")
    assert audit(replaced, **kwargs).ok  # type: ignore[arg-type]
    added = resolve_backend("tests.planted:finite_diagonal_inf_mask")
    caps = replaced.capabilities
    wrong = Backend("added", added.fn, "", caps, spec="tests.planted:finite_diagonal_inf_mask")
    assert not audit(wrong, **kwargs).ok  # type: ignore[arg-type]
    swapped = Backend("replaced", replaced.fn, "", added.capabilities,
                      spec="tests.planted:replaced_diagonal_inf_mask")  # fmt: skip
    assert not audit(swapped, **kwargs).ok  # type: ignore[arg-type]


@pytest.mark.slow  # two audits: 9 s
def test_rows_a_library_leaves_undefined_are_not_judged_and_said_so() -> None:
    """JAX's splash attention documents a query with no visible key as undefined (NaN,
    or a mean that depends on the tile): no policy expressed it. Declared
    ``empty_row="undefined"``, such rows are not judged in any property (agreement or
    law), and the report lists them as not tested; the rows that see keys still are, and
    a kernel that spoils one of them fails."""
    props = ["empty_rows", "masked_keys", "mask_kinds", "variants", "forward"]
    kwargs = {"properties": props, "dtypes": [torch.float32], "progress": False}
    report = audit("tests.planted:undefined_empty_rows", **kwargs)  # type: ignore[arg-type]
    assert report.ok, report.format_table()
    assert "such rows are not judged" in report.format_table()
    leak = audit("tests.planted:undefined_rows_leak", **kwargs)  # type: ignore[arg-type]
    assert not leak.ok
    (finding,) = leak.findings()
    assert "in rows that see keys" in finding[0], finding[0]


def test_softcap_bound_draws_inside_a_narrow_head_dim_declaration() -> None:
    """softcap_bound read the weights with V = I in one call, so it set Dqk = Dv = Tk and
    a kernel declaring head dims (8, 16) without Dv != Dqk had 17 of 25 cases skipped:
    it now reads them Dv at a time, skips none, and still catches a dropped softcap."""
    from attnref.conformance.mutants import MUTANTS

    narrow = {"distinct_value_dim": False, "head_dims": (8, 16)}
    ref = resolve_backend("reference")
    backend = replace(ref, capabilities=replace(ref.capabilities, **narrow))  # type: ignore[arg-type]
    report = audit(backend, properties=["softcap_bound"], dtypes=[torch.float32],
                   progress=False, isolate=False)  # fmt: skip
    (result,) = report.results
    assert (result.status, result.skipped) == ("pass", 0), result.message
    dropped = MUTANTS["softcap_dropped"].backend()
    dropped = replace(dropped, capabilities=replace(dropped.capabilities, **narrow))  # type: ignore[arg-type]
    report = audit(dropped, properties=["softcap_bound"], dtypes=[torch.float32],
                   progress=False, isolate=False)  # fmt: skip
    assert not report.ok


@pytest.mark.slow  # two audits: 6 s
def test_merge_and_decode_are_drawn_at_the_declared_length_multiples() -> None:
    """A kernel that takes lengths of multiples of 16 queries and 32 keys never had its
    merge or decode judged: a decode step is one query against a prefix of keys, and
    merge split the keys anywhere, so every case was skipped (decode: 25 of 25). A step
    now repeats its query to 16 rows and stops at a multiple of 32 keys; merge splits by
    blocks of 32. A base-2 LSE behind the same declaration fails merge."""
    kwargs = {"properties": ["decode", "merge"], "dtypes": [torch.float32], "progress": False}
    report = audit("tests.planted:tiled_with_lse", **kwargs)  # type: ignore[arg-type]
    assert report.ok, report.format_table()
    assert all(r.judged >= 20 for r in report.results), report.format_table()
    base2 = audit("tests.planted:tiled_lse_base2", **kwargs)  # type: ignore[arg-type]
    assert {r.property for r in base2.results if r.status == "fail"} == {"merge"}


def test_a_backend_that_compiles_each_shape_is_called_with_few() -> None:
    """JAX and Pallas in interpret mode compile every new shape (2-3 s; a repeated one
    costs 0.01 s): a backend declaring ``distinct_shapes`` is called with at most that
    many shapes a search, its cases' values, masks and variants still drawn, and the
    report says so. Undeclared, the same search calls it with many."""
    seen: list[tuple[object, ...]] = []

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
             **kwargs: Any) -> torch.Tensor:  # fmt: skip
        seen.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        out: torch.Tensor = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, *args, **kwargs
        )
        return out

    caps = Capabilities(causal_with_mask=False)
    kw = {"properties": ["forward"], "dtypes": (torch.float32,), "progress": False,
          "isolate": False}  # fmt: skip
    few = audit(Backend("few", sdpa, "", replace(caps, distinct_shapes=2)), **kw)  # type: ignore[arg-type]
    assert few.ok, few.format_table()
    assert few.results[0].checks > 10
    assert len(set(seen)) <= 2, set(seen)
    assert any("at most 2 distinct shapes (declared" in n for n in few.judge_notes)
    seen.clear()
    audit(Backend("many", sdpa, "", caps), **kw)  # type: ignore[arg-type]
    assert len(set(seen)) > 10
