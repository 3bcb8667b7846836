"""Findings by cause (`attnref.conformance.findings`): one bug, one finding.

Each rule is held on hand-made results shaped as the audit makes them, after the real
audits that broke it: one empty-row bug came out as 5 and 11 findings, a precision miss
met beside a semantic failure as a finding of its own.
"""

from pathlib import Path

import pytest
import torch

from attnref.conformance.cases import Case
from attnref.conformance.findings import features_of, group, symptom_of
from attnref.conformance.report import Finding, PropertyResult
from attnref.conformance.verdicts import Failure, cause_of, shorten

WRONG = "output: max error 1.5 (bound 0.001); worst at (0, 0, 3, 1): got 2, expected 0.5; {}"
NAN = "output: 4 NaN/inf values where a finite value is expected; first at (0, 0, 2, 0); {}"
SEES_KEYS = "query 3 sees 4 of 9 keys"
SEES_NONE = "query 2 sees no key (a boolean mask hides them; declared policy 'zero')"


def fail(
    prop: str,
    message: str,
    *,
    kind: str = "error",
    needs: tuple[str, ...] = (),
    case: Case | None = None,
    dtype: torch.dtype = torch.float32,
    small: bool = False,
) -> PropertyResult:
    failure = Failure(message, kind=kind, small=small)
    cause = cause_of(failure, str(dtype).removeprefix("torch."))
    case = case or Case("x")
    finding = Finding(case, message, None, None, None, "", cause, needs=needs)
    return PropertyResult(prop, dtype, "fail", message=message, finding=finding)


def titles(results: list[PropertyResult]) -> list[str]:
    return [title for title, _ in group(results)]


def test_rows_that_see_no_key_are_one_finding_whatever_emptied_them() -> None:
    """empty_row_nan's 5 findings: NaN in rows a mask emptied, in rows the causal
    diagonal emptied (Tq < Tk), and the same NaN where the message names no row."""
    masked = Case("m", mask="empty_rows")
    causal = Case("c", causal="top_left", Tq=3, Tk=7)
    results = [
        fail("masked_keys", NAN.format(SEES_NONE), kind="nan", needs=("a mask",), case=masked),
        fail(
            "causality",
            NAN.format(SEES_NONE),
            kind="nan",
            needs=("causal with Tq != Tk",),
            case=causal,
        ),
        fail(
            "gradients",
            "dq: 3 NaN/inf values where a finite value is expected; first at "
            "(0, 0, 1, 0): got nan, expected 0.2",
            kind="nan",
            needs=("a mask",),
            case=masked,
        ),
    ]
    ((title, members),) = group(results)
    assert "in rows that see no key" in title
    assert members[0].property in ("masked_keys", "causality")
    assert len(members) == 3


def test_a_failure_naming_no_row_joins_the_finding_of_rows_that_see_keys() -> None:
    """fresh_values and settled_output name no row: they landed apart from the same
    wrong values "in rows that see keys"."""
    results = [
        fail("forward", WRONG.format(SEES_KEYS)),
        fail("fresh_values", "the output on new values: max error 1.2 (bound 0.001)"),
    ]
    assert len(group(results)) == 1


def test_two_triggers_that_explain_different_cases_are_two_findings() -> None:
    """A scale ignored and a causal alignment wrong: both wrong values in rows that see
    keys, each explained by its own trigger; a failure whose case has the scale but not
    the alignment joins the scale's, whatever its own re-runs found."""
    scaled = Case("s", scale=0.3)
    unequal = Case("u", causal="top_left", Tq=3, Tk=7)
    results = [
        fail("scale", WRONG.format(SEES_KEYS), needs=("an explicit scale",), case=scaled),
        fail("causality", WRONG.format(SEES_KEYS), needs=("causal with Tq != Tk",), case=unequal),
        fail("forward", WRONG.format(SEES_KEYS), case=scaled),
    ]
    found = group(results)
    assert len(found) == 2, [t for t, _ in found]
    by_trigger = {t.split("needs ")[-1]: [r.property for r in rs] for t, rs in found}
    assert by_trigger == {"an explicit scale)": ["scale", "forward"],
                          "causal with Tq != Tk)": ["causality"]}  # fmt: skip
    # a failure on a case with none of the features: the bug needs none of them, and
    # the triggers were what re-runs happened to pass without
    plain = fail("tails", WRONG.format(SEES_KEYS), case=Case("p"))
    ((title, members),) = group([*results, plain])
    assert len(members) == 4
    assert "needs" not in title


def test_a_precision_loss_joins_the_same_property_wrong_in_another_dtype() -> None:
    results = [
        fail("tails", WRONG.format(SEES_KEYS)),
        fail("tails", WRONG.format(SEES_KEYS), dtype=torch.float16, small=True),
    ]
    ((title, members),) = group(results)
    assert title.startswith("wrong values")
    assert [r.dtype for r in members] == [torch.float32, torch.float16]
    # alone, a precision loss is a finding of its own, named by its dtype
    (title,) = titles(results[1:])
    assert title.startswith("precision loss")
    assert title.endswith("in float16")


def test_the_smallest_trigger_heads_the_finding() -> None:
    big = Case("b", mask="empty_rows", Tq=9, Tk=30)
    small = Case("s", mask="empty_rows", Tq=2, Tk=3)
    results = [
        fail("forward", NAN.format(SEES_NONE), kind="nan", needs=("a mask", "Dv != Dqk"), case=big),
        fail("masked_keys", NAN.format(SEES_NONE), kind="nan", needs=("a mask",), case=small),
    ]
    ((title, members),) = group(results)
    assert members[0].property == "masked_keys"
    assert title.endswith("(its smallest trigger needs a mask)")


def test_symptoms_and_features_are_read_as_the_audit_writes_them() -> None:
    assert symptom_of("NaN/inf where the oracle is finite in rows that see keys") == (
        "NaN/inf where the oracle is finite",
        "keys",
    )
    assert symptom_of(
        "wrong values (errors past what rounding makes) in rows that see no key "
        "(declared policy 'zero') (its smallest trigger needs a mask)"
    ) == ("wrong values (errors past what rounding makes) (its smallest trigger needs a mask)",
          "no key")  # fmt: skip
    case = Case("x", causal="top_left", Tq=2, Tk=5, mask="bool", scale=0.5)
    assert {"causal", "causal with Tq != Tk", "a mask", "an explicit scale"} <= features_of(case)


def test_titles_are_cut_at_a_word() -> None:
    text = "RuntimeError: the crash needs " + "many words " * 40
    cut = shorten(text)
    assert len(cut) <= 200
    assert cut.endswith("words...")
    assert shorten("short") == "short"


def test_values_are_printed_with_the_digits_that_tell_them_apart() -> None:
    """A float64 message read "got 0.703969, expected 0.703969"."""
    from attnref.conformance.oracle import shown_apart

    assert shown_apart(0.70396912, 0.70396934) == ("0.7039691", "0.7039693")
    assert shown_apart(2.5, 2.5) == ("2.5", "2.5")
    assert shown_apart(1.0, 3.0) == ("1", "3")


def test_a_modified_argument_is_named_as_its_family_calls_it() -> None:
    """ "the backend modified its inputs: value" where the argument was the sparse
    family's ``indices``: each family's signature names its positional arguments."""
    import attnref.conformance.families  # noqa: F401 (installs the families)
    from attnref.conformance.family import get_family

    assert get_family("sparse-mla").argument_name(2) == "indices"
    assert get_family("sdpa").argument_name(2) == "value"
    assert get_family("mla").argument_name(2) == "block_table"
    assert get_family("context-parallel").argument_name(3) == "argument 3"  # after the *


def test_a_trigger_that_holds_another_is_its_variation() -> None:
    """causal_bottom_right was two findings: "needs causal with Tq != Tk" and "needs
    causal with Tq != Tk, a mask"; causal_leaks_next two with "needs causal" beside
    "needs causal with Tq != Tk, a mask" (which implies causal). A trigger holding a
    smaller one is a variation of it."""
    unequal = Case("u", causal="top_left", Tq=3, Tk=7)
    masked = Case("um", causal="top_left", Tq=3, Tk=7, mask="bool")
    results = [
        fail("causality", WRONG.format(SEES_KEYS), needs=("causal with Tq != Tk",), case=unequal),
        fail(
            "masked_keys",
            WRONG.format(SEES_KEYS),
            needs=("causal with Tq != Tk", "a mask"),
            case=masked,
        ),
    ]
    ((title, members),) = group(results)
    assert title.endswith("(its smallest trigger needs causal with Tq != Tk)")
    assert [r.property for r in members] == ["causality", "masked_keys"]
    causal = fail("hot", WRONG.format(SEES_KEYS), needs=("causal",),
                  case=Case("c", causal="top_left"))  # fmt: skip
    ((title, members),) = group([*results, causal])
    assert title.endswith("(its smallest trigger needs causal)")
    assert len(members) == 3


def test_an_empty_row_is_named_by_what_emptied_it() -> None:
    """A row a window emptied was said to be hidden by "the causal diagonal the backend
    applies": each of the mask, the diagonal and the window that hides its keys is
    named, and the policy by the cause the declaration knows it by."""
    from dataclasses import replace

    from attnref.conformance.backends import resolve_backend
    from attnref.conformance.cases import build
    from attnref.conformance.checks import Context
    from attnref.conformance.declarations import Capabilities

    backend = replace(resolve_backend("reference"), capabilities=Capabilities(window=True))
    ctx = Context(backend, torch.float32, "cpu", 10.0)
    windowed = build(Case("w", batch=(1,), h=1, g=1, Tq=4, Tk=2, window=(0, 0)), torch.float32)
    text = ctx.row(windowed, (0, 0, 0, 0))
    assert text.startswith("query 0 sees no key (the sliding window hides them;"), text
    assert "causal diagonal" not in text
    both = build(Case("b", batch=(1,), h=1, g=1, Tq=4, Tk=2, causal="bottom_right",
                      mask="bool_full"), torch.float32)  # fmt: skip
    text = ctx.row(both, (0, 0, 0, 0))
    assert "causal diagonal" in text, text


@pytest.mark.slow  # three audits: 6 s
def test_a_row_one_key_off_says_which_key() -> None:
    """A row that attends one key too many among 31 or 65 was called a precision loss;
    where the oracle over one key more or fewer is what the backend returned, the
    finding says which key (a diagonal that leaks the next token, one that leaves out
    the query's own), and a wrong scale is not taken for it."""
    from attnref.conformance import audit

    said = {}
    for mutant in ("causal_leaks_next", "causal_excludes_self", "scale_ignored"):
        report = audit(f"mutant.{mutant}", properties=["forward"], dtypes=[torch.float32],
                       progress=False, jobs=1)  # fmt: skip
        (result,) = report.results
        assert result.status == "fail"
        said[mutant] = result.message
    assert "attends key 1, which it must not see" in said["causal_leaks_next"]
    assert "leaves out key 0, which it sees" in said["causal_excludes_self"]
    assert "which it" not in said["scale_ignored"]


def test_the_key_set_one_off_is_found_on_the_oracle_alone() -> None:
    """`one_key_off` on hand-made rows: the oracle over the key after the last one seen,
    over the first one left out, and a row that is neither."""
    from attnref.conformance.cases import build
    from attnref.conformance.oracle import one_key_off, reference

    inputs = build(Case("c", batch=(1,), h=1, g=1, Tq=5, Tk=5, causal="top_left"),
                   torch.float64)  # fmt: skip
    opened = reference(build(Case("o", batch=(1,), h=1, g=1, Tq=5, Tk=5), torch.float64))
    # query 2 sees keys 0-2; the row over keys 0-3 is "one key too many"
    from dataclasses import replace

    wider = replace(inputs, causal=None, attn_mask=torch.ones(5, 5, dtype=torch.bool).tril(1))
    row = reference(wider)[0, 0, 2]
    assert one_key_off(inputs, row, (0, 0, 2), 1e-9).startswith(
        "query 2 attends key 3, which it must not see"
    )
    narrower = replace(inputs, causal=None, attn_mask=torch.ones(5, 5, dtype=torch.bool).tril(-1))
    row = reference(narrower)[0, 0, 2]
    assert one_key_off(inputs, row, (0, 0, 2), 1e-9).startswith(
        "query 2 leaves out key 2, which it sees"
    )
    assert one_key_off(inputs, opened[0, 0, 2] * 2, (0, 0, 2), 1e-9) == ""


#: mutants whose whole quick audit gave many findings for one bug (before: 9 and 4), and
#: the symptoms each may show: one finding, two where the bug shows in rows that see keys
#: and in rows that see none (empty_row_uniform's 11, one now, are held by the HTML
#: page's test in tests/test_reports.py, on the same audit)
ONE_BUG = {
    # the one live check that recorded grouping still holds (tests/data/findings holds
    # 59 whole audits; causal_alignment_ignored's, 99 s of CI, is among them)
    "strides_ignored": 1,
}


#: whole quick audits of every planted kernel, their failures kept by
#: ``python tools/findings_count.py --planted --out DIR --keep tests/data/findings``
RECORDED = Path(__file__).parent / "data" / "findings"


def _planted() -> list[str]:
    from tools.findings_count import planted

    return sorted(spec.removeprefix("tests.").replace(":", "-") for spec in planted())


def test_every_planted_kernel_s_whole_quick_audit_is_recorded() -> None:
    recorded = sorted(p.name.removesuffix(".json.gz") for p in RECORDED.glob("*.json.gz"))
    assert recorded == _planted(), (
        "run python tools/findings_count.py --planted --out DIR --keep tests/data/findings"
    )


def test_a_report_of_an_earlier_attnref_reads_a_field_it_lacks_as_its_default() -> None:
    """A report records the whole declaration: one written before a field was added
    lacks it (these recorded audits lacked ``distinct_shapes``), and reads as that
    attnref audited, the field at its default; a field this attnref does not know (a
    later attnref's report) is still refused."""
    import gzip
    import json

    from attnref.conformance.exports import load_report

    path = sorted(RECORDED.glob("*.json.gz"))[0]
    data = json.loads(gzip.decompress(path.read_bytes()))
    data["capabilities"].pop("distinct_shapes", None)
    data["capabilities"].pop("tile_keys")
    report = load_report(data)
    assert (report.capabilities.distinct_shapes, report.capabilities.tile_keys) == (0, 0)
    data["capabilities"]["from_the_future"] = 1
    with pytest.raises(ValueError, match="unknown from_the_future"):
        load_report(data)


#: recorded audits that still give more than two findings, and why
MORE = {
    "planted_sparse-invalid_read_as_zero": "3 findings: rows that see no key, rows that "
    "see keys, and a replay named in bfloat16 by byte equality with an earlier right "
    "output where the wrong row sees keys (not explained yet: docs/conformance.md)",
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason=MORE[n], strict=True)) if n in MORE else n
        for n in _planted()
    ],
)
def test_a_whole_quick_audit_of_a_planted_kernel_is_one_finding(name: str) -> None:
    """Each planted kernel in tests/planted_*.py has one bug: its whole quick audit (seed
    0, recorded in tests/data/findings by tools/findings_count.py: an audit is 30-190 s,
    an hour for all of them) is one finding, two where the bug shows in rows that see
    keys and in rows that see none, or as two symptoms. The audits' failures are grouped
    again here, by this version's rules."""
    import gzip
    import json

    from attnref.conformance.exports import load_report

    path = RECORDED / f"{name}.json.gz"
    if not path.exists():
        pytest.fail(f"{name}: no recorded audit (see test_every_planted_kernel_s_...)")
    report = load_report(json.loads(gzip.decompress(path.read_bytes())))
    found = report.findings()
    assert report.count("fail") >= 1
    assert 1 <= len(found) <= 2, [title for title, _ in found]


@pytest.mark.slow  # a whole quick audit each, in two dtypes of four: 50-90 s
@pytest.mark.parametrize(("mutant", "most"), ONE_BUG.items())
def test_a_whole_quick_audit_of_one_bug_is_one_finding(mutant: str, most: int) -> None:
    """Every property, in float32 and bfloat16 (a variation across dtypes folds as one
    across properties; the 59 recorded audits hold all four dtypes)."""
    from attnref.conformance import audit
    from attnref.conformance.families import MUTANTS

    report = audit(f"mutant.{mutant}", api=MUTANTS[mutant].api, progress=False,
                   dtypes=(torch.float32, torch.bfloat16))  # fmt: skip
    found = report.findings()
    assert report.count("fail") > 5
    assert 1 <= len(found) <= most, [title for title, _ in found]


def test_triggers_are_compared_as_the_backend_got_the_call() -> None:
    """mask_inverted came out as "needs causal" and "needs a mask": its declaration
    computes only the top-left diagonal, so a bottom-right case's diagonal reached it as
    a mask. Read by the declaration, both triggers are a mask: one finding."""
    from attnref.conformance.declarations import Capabilities

    causal = Case("c", causal="bottom_right", Tq=3, Tk=5)
    masked = Case("m", mask="bool")
    results = [
        fail("causality", WRONG.format(SEES_KEYS), needs=("causal with Tq != Tk",), case=causal),
        fail("masked_keys", WRONG.format(SEES_KEYS), needs=("a mask",), case=masked),
    ]
    assert len(group(results)) == 2  # without the declaration: two triggers
    ((title, _),) = group(results, Capabilities(causal_alignments=("top_left",)))
    assert title.endswith("(its smallest trigger needs a mask)")
    both = Capabilities(causal_alignments=("top_left", "bottom_right"))
    assert len(group(results, both)) == 2  # computed by the backend: two triggers


def test_a_sparse_kernel_gets_every_hidden_key_as_an_index_left_out() -> None:
    """A sparse kernel never sees a mask, the causal diagonal or a window: each reaches it
    as keys left out of its indices. A planted kernel that read an invalid entry as row 0
    needed "a mask" in one case, "causal" in another and "a window" in a third: one bug,
    one finding, named by what the kernel got. A dense kernel keeps three triggers."""
    from attnref.conformance.declarations import Capabilities

    results = [
        fail(
            "masked_keys", WRONG.format(SEES_KEYS), needs=("a mask",), case=Case("m", mask="bool")
        ),
        fail(
            "causality",
            WRONG.format(SEES_KEYS),
            needs=("causal",),
            case=Case("c", causal="top_left"),
        ),
        fail(
            "windows", WRONG.format(SEES_KEYS), needs=("a window",), case=Case("w", window=(2, 0))
        ),
    ]
    assert len(group(results, Capabilities())) == 3
    ((title, members),) = group(results, Capabilities(family="sparse-mla"))
    assert title.endswith("(its smallest trigger needs keys left out of the indices)"), title
    assert len(members) == 3


def test_rows_that_see_no_key_are_one_finding_whatever_they_hold() -> None:
    """A kernel that read an invalid index as row 0 put NaN in some rows that see no key
    (row 0 NaN there) and wrong finite values in others: one decision of the kernel's
    about such rows, one finding (it came out as two)."""
    results = [
        fail("empty_rows", WRONG.format(SEES_NONE), case=Case("e", mask="bool")),
        fail("masked_keys", NAN.format(SEES_NONE), kind="nan", case=Case("m", mask="bool")),
    ]
    causes = [r.finding.cause for r in results if r.finding is not None]
    assert causes[0].startswith("wrong values"), causes
    assert causes[1].startswith("NaN"), causes
    assert all("in rows that see no key" in c for c in causes), causes
    assert len(group(results)) == 1, [t for t, _ in group(results)]


def test_a_precision_loss_with_a_wrong_values_trigger_is_that_bug() -> None:
    """A kernel that scales by the wrong head dim where Dv != Dqk is far off in most
    cases and off by a rounding's size in a few bfloat16 ones: both need Dv != Dqk, one
    bug (two findings before). A precision loss with no trigger stays apart."""
    prec = (
        "output: max error 0.02 (bound 0.0125); worst at (0, 0, 0, 1): got 0.52, expected 0.5; {}"
    )
    dv = Case("d", Dh=8, Dv=4)
    results = [
        fail("forward", WRONG.format(SEES_KEYS), needs=("Dv != Dqk",), case=dv),
        fail(
            "tails",
            prec.format(SEES_KEYS),
            needs=("Dv != Dqk",),
            case=dv,
            dtype=torch.bfloat16,
            small=True,
        ),
        fail("hot", prec.format(SEES_KEYS), case=Case("h"), dtype=torch.bfloat16, small=True),
    ]
    assert results[1].finding is not None
    assert results[1].finding.cause.startswith("precision loss"), results[1].finding.cause
    found = group(results)
    assert len(found) == 2, [t for t, _ in found]
    assert {m.property for m in found[0][1]} == {"forward", "tails"}


def test_a_wrong_values_finding_needing_no_feature_takes_the_precision_losses() -> None:
    """A kernel that accumulates in half precision past 512 keys is wrong with no
    feature needed, and off by a rounding's size in other dtypes and cases of the same
    properties, whose re-runs without a feature passed by chance: one bug (five findings
    before). A precision loss of another property, or beside a wrong-values finding
    that needs a mask, stays apart."""
    prec = (
        "output: max error 0.02 (bound 0.0125); worst at (0, 0, 0, 1): got 0.52, expected 0.5; {}"
    )

    def loss(prop: str) -> PropertyResult:
        return fail(prop, prec.format(SEES_KEYS), needs=("an explicit scale",),
                    case=Case("s", scale=0.3), dtype=torch.float16, small=True)  # fmt: skip

    anywhere = fail("forward", WRONG.format(SEES_KEYS), case=Case("f"))
    masked = fail("masked_keys", WRONG.format(SEES_KEYS), needs=("a mask",),
                  case=Case("m", mask="bool"))  # fmt: skip
    assert len(group([anywhere, loss("forward")])) == 1
    assert len(group([anywhere, loss("tails")])) == 2
    assert len(group([masked, loss("forward")])) == 2
