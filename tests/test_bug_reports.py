"""A bug report's repro.py reads every family's answer where its family's reader finds it
(docs/reports.md): the positions recorded from a probe of the call's result, not a
layout written per family. Here, in this process and on one explicit case each, a
correct kernel's report passes and a planted kernel's fails, in every family whose
calls repro.py makes; the slow tier writes the report of every planted kernel's
finding and runs its repro.py where attnref cannot be imported from it
(tests/bug_reports.py)."""

import runpy
import sys
from pathlib import Path

import pytest
import torch

from attnref.conformance import PROFILES
from attnref.conformance.backends import resolve_backend
from attnref.conformance.bugreports import _repro
from attnref.conformance.cases import Case
from attnref.conformance.properties import PROPERTIES
from attnref.conformance.runner import check_case

#: (property, kernel, the correct kernel of its family, family, dtype): each kernel's bug
#: shows on one of the property's explicit cases, which the correct one passes
KERNELS = [
    ("forward", "tests.plain_kernels:scale_off_by_two",
     "torch.nn.functional:scaled_dot_product_attention", "sdpa", torch.float32),
    # a series of calls (buffers reused): each call recorded alone, repro.py makes it so
    ("fresh_values", "tests.plain_kernels:scale_off_by_two",
     "torch.nn.functional:scaled_dot_product_attention", "sdpa", torch.float32),
    ("gradient", "tests.plain_kernels:gradient_doubled",
     "torch.nn.functional:scaled_dot_product_attention", "sdpa", torch.float32),
    ("variants", "tests.planted_flash:sink_scaled", "tests.planted_flash:correct", "flash",
     torch.float32),
    ("varlen", "tests.planted_serving:causal_global_offset",
     "tests.planted_serving:correct_varlen", "flash-varlen", torch.float32),
    ("kvcache", "tests.planted_serving:ignores_new_tokens",
     "tests.planted_serving:correct_kvcache", "flash-kvcache", torch.float32),
    ("mla", "tests.planted_mla:default_scale_from_dv", "tests.planted_mla:correct_mla", "mla",
     torch.float32),
    ("sparse_mla", "tests.planted_sparse:lse_in_base_2", "tests.planted_sparse:right",
     "sparse-mla", torch.float32),
    ("sparse_fp8", "tests.planted_sparse:tile_scale_off_by_one_fp8",
     "tests.planted_sparse:right_fp8", "sparse-mla-fp8", torch.bfloat16),
]  # fmt: skip


def _repro_exit(folder: Path, backend: str) -> tuple[int, str]:
    """repro.py's exit code and what it printed, run in this process on ``backend``."""
    import contextlib
    import io

    out = io.StringIO()
    argv = sys.argv
    sys.argv = ["repro.py", "--backend", backend]
    try:
        with contextlib.redirect_stdout(out):
            module = runpy.run_path(str(folder / "repro.py"), run_name="repro")
            code = module["main"]()
    finally:
        sys.argv = argv
    return code, out.getvalue()


def _failing(pid: str, wrong: str, api: str, dtype: torch.dtype, save: Path) -> str:
    """The verdict of the first of the property's explicit cases that fails ``wrong``,
    its calls and answers saved in ``save``."""
    caps = resolve_backend(wrong, api=api).capabilities.for_dtype(dtype)
    plain = Case("plain", batch=(1,), h=2, g=1, Tq=4, Tk=6)  # a property without examples
    for case in [*PROPERTIES[pid].examples(PROFILES["quick"], caps), plain]:
        verdict = check_case(pid, wrong, case, dtype, api=api, isolate=False, save=save)
        if verdict.startswith("FAIL"):
            return verdict
    return "pass"


@pytest.mark.parametrize(("pid", "wrong", "right", "api", "dtype"), KERNELS,
                         ids=[k[3] + "-" + k[0] for k in KERNELS])  # fmt: skip
def test_repro_reads_each_family_s_answer_where_its_reader_finds_it(
    pid: str, wrong: str, right: str, api: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    verdict = _failing(pid, wrong, api, dtype, tmp_path)
    assert verdict.startswith("FAIL"), verdict
    saved = torch.load(tmp_path / "expected.pt", weights_only=True)
    located = [o for o in saved["oracles"] + saved["answers"] if o.get("where") is not None]
    assert located, "no answer located"
    (tmp_path / "repro.py").write_text(_repro(wrong, api, "a finding"))
    code, printed = _repro_exit(tmp_path, wrong)
    assert code == 1, printed
    assert "FAIL: the bug shows" in printed
    code, printed = _repro_exit(tmp_path, right)
    assert code == 0, printed
    assert "pass: within the bound" in printed


#: kernels of tests/planted.py and tests/planted_flash.py whose finding a bug report
#: must reproduce, with the correct function it is swapped for (torch's SDPA, whose
#: convention the plain ones keep, or attnref's where a call passes a mask with
#: is_causal, which torch's refuses; the flash file's own correct kernel)
SDPA = "torch.nn.functional:scaled_dot_product_attention"
AUDITED = [
    *[(f"tests.planted_flash:{name}", "flash", "tests.planted_flash:correct")
      for name in ("window_is_a_length", "window_right_ignored", "softcap_after_alibi",
                   "sink_scaled", "lse_block_max", "lse_empty_zero")],
    *[(f"tests.planted:{name}", "sdpa", SDPA)
      for name in ("returns_nan", "returns_inf", "scales_query_in_place",
                   "wrong_past_one_query", "raises")],
    *[(f"tests.planted:{name}", "sdpa", "attnref.functional:scaled_dot_product_attention")
      for name in ("leaks_in_one_row", "drops_causal_with_a_mask", "detached")],
]  # fmt: skip


#: kernels of tests/planted.py that misbehave as programs, or whose answer is malformed:
#: each repro.py shows the bug as the audit did (a crash, an exit, a hang, a write past
#: an argument's memory, a result of the wrong type, shape or dtype, a gradient missing),
#: in a child process of its own, and exits 1; with the correct function, 0
HARNESS = [
    *[(f"tests.planted:{name}", "sdpa", SDPA)
      for name in ("wrong_shape", "wrong_dtype", "not_a_tensor", "exits_0", "segfaults",
                   "aborts", "calls_sys_exit", "raises_keyboard_interrupt", "busy_loop",
                   "allocates_without_bound", "bare_assert", "writes_past_key",
                   "writes_before_query", "wrong_then_dies", "chatty_and_wrong")],
    # NaN declared for a query with no visible key: swapped for a kernel that keeps it
    *[(f"tests.planted:{name}", "sdpa", "tests.planted:nan_empty_rows_softcap")
      for name in ("nan_row_spreads", "garbage_beside_empty_rows", "nan_empty_rows_beside_sinks")],
    *[(f"tests.planted:{name}", "sdpa", "attnref.functional:scaled_dot_product_attention")
      for name in ("sinks_detached", "sinks_gradient_doubled", "returns_nan_everywhere",
                   "imprecise", "imprecise_and_mask_wrong", "mask_dropped_always",
                   "mask_dropped_under_softcap", "scale_and_alignment_ignored",
                   "finite_diagonal_inf_mask", "undefined_rows_leak")],
    *[(f"tests.planted_flash:{name}", "flash", "tests.planted_flash:correct")
      for name in ("lse_not_returned", "top_left_undeclared")],
]  # fmt: skip


@pytest.mark.slow  # 43 audits stopped at their first failure, their reports run: 2 min
@pytest.mark.parametrize(("spec", "api", "right"), AUDITED + HARNESS,
                         ids=[s for s, _, _ in AUDITED + HARNESS])  # fmt: skip
def test_each_finding_of_a_planted_kernel_is_a_report_that_reproduces_it(
    spec: str, api: str, right: str, tmp_path: Path
) -> None:
    """Each finding of the audit, a folder whose repro.py exits 1 on the kernel and 0
    with the correct function swapped in (an exception, an input changed in place, NaN,
    a value past its bound, an LSE off, a crash, an exit, a hang: each as the bug
    shows). The flash kernels are audited on the properties aimed at their bug's class
    (as tests/test_audit.py's); a call that hangs is given 5 s."""
    from dataclasses import replace

    from attnref.conformance import audit
    from tests.bug_reports import assert_reports_reproduce
    from tests.planted_flash import UNSEEN

    name = spec.partition(":")[2]
    aimed = None
    if api == "flash" and name in UNSEEN:
        aimed = [p.id for p in PROPERTIES.values() if UNSEEN[name] in p.classes]
    kill = replace(PROFILES["quick"], name="quick-kill", shrink_seconds=0.5)
    report = audit(resolve_backend(spec, api=api), device="cpu", progress=False,
                   properties=aimed, dtypes=(torch.float32,), fail_fast=True,
                   profile=kill, timeout=5.0)  # fmt: skip
    assert not report.ok, report.format_table()
    assert_reports_reproduce(report, right, tmp_path, timeout=5.0)


@pytest.mark.slow  # one audit, its report written and run: 5 s
def test_a_finding_that_needs_the_calls_before_it_is_reported_as_not_reproducing_alone(
    tmp_path: Path,
) -> None:
    """A crash met only after other calls (memory an earlier call corrupted) does not
    show in the finding's own calls: its REPORT.md says so, and its repro.py passes
    rather than claiming the bug."""
    from dataclasses import replace

    from attnref.conformance import audit
    from attnref.conformance.bugreports import write_bug_reports
    from tests.bug_reports import run_repros

    kill = replace(PROFILES["quick"], name="quick-kill", shrink_seconds=0.5)
    report = audit("tests.planted:dies_after_corrupting", device="cpu", progress=False,
                   dtypes=(torch.float32,), fail_fast=True, profile=kill)  # fmt: skip
    assert not report.ok
    (folder,) = write_bug_reports(report, tmp_path)
    assert (
        "made alone, in a fresh process, the finding's calls do not show the bug"
        in (folder / "REPORT.md").read_text()
    )
    ((_, _, code, printed),) = run_repros([(folder, "")])
    assert code == 0, printed


#: Triton kernels of tests/ (their own code, run by Triton's interpreter), each on the
#: property aimed at its bug, with the correct kernel of its file
TRITON = [
    ("tests.planted_triton:tail_dropped", "flash", ["tails"], "tests.planted_triton:right"),
    ("tests.planted_triton:page_off_by_one", "flash-kvcache", ["kvcache_pages"],
     "tests.planted_triton:decode_right"),
    ("tests.planted_linear_triton:gva_modulo", "gated-delta", ["gdn_gva"],
     "tests.planted_linear_triton:right"),
]  # fmt: skip


@pytest.mark.slow  # three interpreted audits stopped at their first failure: 60 s
@pytest.mark.parametrize(("spec", "api", "properties", "right"), TRITON,
                         ids=[t[0] for t in TRITON])  # fmt: skip
def test_an_interpreted_triton_kernel_s_finding_is_a_report_that_reproduces_it(
    spec: str, api: str, properties: list[str], right: str, tmp_path: Path
) -> None:
    """repro.py of a Triton kernel the audit ran interpreted sets ``TRITON_INTERPRET=1``
    where there is no GPU, and shows the bug with Triton as installed: exit 1 on the
    kernel, 0 with its file's correct kernel."""
    from attnref.conformance import audit
    from tests.bug_reports import assert_reports_reproduce

    report = audit(spec, api=api, properties=properties, dtypes=(torch.float32,),
                   fail_fast=True, progress=False)  # fmt: skip
    assert report.interpreted["interpreter"] == "triton"
    assert not report.ok, report.format_table()
    assert_reports_reproduce(report, right, tmp_path)


#: kernels of the gated delta rule's serving form (tests/planted_pool.py: plain torch):
#: a pool slot read by the request's order, an output allocated as the keys
POOL = ["slot_by_order", "output_as_keys"]


@pytest.mark.slow  # two audits in this process, their reports run: 10 s
@pytest.mark.parametrize("name", POOL)
def test_a_serving_form_finding_is_a_report_that_reproduces_it(name: str, tmp_path: Path) -> None:
    """The pool family keeps where its output and its pool lie in what a call returns
    (and where a well-formed result would hold them, for a call it judged malformed):
    repro.py exits 1 on the kernel and 0 on its correct twin (it once had nothing to
    compare: no answer of the family's was kept)."""
    from attnref.conformance import audit
    from tests.bug_reports import assert_reports_reproduce

    report = audit(f"tests.planted_pool:{name}", api="gated-delta-decode",
                   properties=["gdn_decode_pool"], dtypes=(torch.float32,), fail_fast=True,
                   progress=False)  # fmt: skip
    assert not report.ok, report.format_table()
    assert_reports_reproduce(report, "tests.planted_pool:right", tmp_path)


#: context-parallel kernels whose finding a repro.py reproduces on ranks of its own: a
#: wrong output, a rank that raises, one that hangs (the call is given 6 s), a gradient
CP_KERNELS = [
    ("zigzag_equal_chunks", ("cp_agreement",), "output: max error"),
    ("raises_on_rank_2", ("cp_agreement", "cp_world_size"), "rank 2: "),
    ("hangs_on_rank_3", ("cp_agreement", "cp_world_size"), "rank 3 gave no answer within 6 s"),
    ("dq_doubled", ("cp_gradients",), "FAIL: the bug shows"),
]


@pytest.mark.slow  # four audits at world size 4, each report run twice on 4 ranks: 100 s
@pytest.mark.parametrize(("name", "properties", "shown"), CP_KERNELS,
                         ids=[k[0] for k in CP_KERNELS])  # fmt: skip
def test_a_context_parallel_finding_is_a_report_whose_ranks_reproduce_it(
    name: str, properties: tuple[str, ...], shown: str, tmp_path: Path
) -> None:
    """repro.py of a context-parallel finding starts one process a rank (this script
    again, with ``--rank``), joins them in a gloo group on this machine, gives each its
    shard at the world size the audit ran the call at, and puts their answers together:
    it exits 1 on the planted kernel, naming the rank where one raised or hung, and 0
    with attnref's ring reference, a plain function of the same convention."""
    from attnref.conformance import audit
    from tests.bug_reports import assert_reports_reproduce

    report = audit(f"tests.planted_cp:{name}", api="context-parallel",
                   properties=list(properties), dtypes=(torch.float32,), progress=False,
                   world_size=4, fail_fast=True, timeout=6.0)  # fmt: skip
    assert not report.ok, report.format_table()
    printed: list[str] = []
    assert_reports_reproduce(report, "attnref.distributed:ring_attention", tmp_path,
                             timeout=6.0, printed=printed)  # fmt: skip
    assert any(shown in said for said in printed), printed


@pytest.mark.parametrize("api", ["sdpa", "gated-delta"])
def test_an_interpreted_triton_kernel_s_repro_runs_it_interpreted_where_no_gpu_is(
    api: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A kernel the audit ran through Triton's interpreter: repro.py sets
    ``TRITON_INTERPRET=1`` before the kernel's module is imported, where there is no GPU
    (and nothing for a native kernel)."""
    native = _repro("k:f", api, "t")
    interpreted = _repro("k:f", api, "t", "triton")
    assert "TRITON_INTERPRET" not in native
    assert interpreted.index("TRITON_INTERPRET") < interpreted.index("def main")
    script = tmp_path / "repro.py"
    script.write_text(interpreted)
    monkeypatch.setenv("TRITON_INTERPRET", "")  # restored as it was after the test
    monkeypatch.delenv("TRITON_INTERPRET")
    if not torch.cuda.is_available():  # the script pins Triton's autotuner: undone after
        import triton.runtime.autotuner as autotuner

        monkeypatch.setattr(autotuner.Autotuner, "__init__", autotuner.Autotuner.__init__)
    monkeypatch.setattr(sys, "argv", [str(script), "--backend", ""])
    with pytest.raises(SystemExit) as stop:  # its main refuses a backend of attnref's own
        runpy.run_path(str(script), run_name="__main__")
    assert stop.value.code == 2
    import os

    assert os.environ.get("TRITON_INTERPRET") == ("1" if not torch.cuda.is_available() else None)


def test_the_real_kernels_reports_in_docs_import_no_attnref() -> None:
    """docs/bug-reports/ (SGLang's, vLLM's and FlashAttention's kernels): each finding
    folder is whole, and its repro.py imports torch, the standard library and the
    backend's module only (their running needs the library and Triton:
    docs/bug-reports/README.md says how they ran)."""
    import ast

    folders = sorted((Path(__file__).parents[1] / "docs" / "bug-reports").glob("*/finding-*"))
    assert folders
    for folder in folders:
        assert {p.name for p in folder.iterdir()} >= {"repro.py", "REPORT.md", "inputs.pt",
                                                      "expected.pt"}  # fmt: skip
        tree = ast.parse((folder / "repro.py").read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m.split(".")[0] == "attnref" for m in imported), folder
        assert "TRITON_INTERPRET" in (folder / "repro.py").read_text(), folder


def test_repro_holds_a_declared_infinity_to_itself(tmp_path: Path) -> None:
    """Where the declared policy gives +inf (FlashAttention's LSE of a query that sees no
    key), repro.py fails any other value, -inf and 0 included, and names both; where it
    gives NaN, any NaN or infinity passes, as attnref's judge has it. (It once failed only
    a finite value there, and said "gives NaN" of a +inf.)"""
    script = tmp_path / "repro.py"
    script.write_text(_repro("tests.plain_kernels:scale_off_by_two", "sdpa", "an empty row"))
    compare = runpy.run_path(str(script))["compare"]
    inf, nan, bound = float("inf"), float("nan"), (1e-5, 1e-5)

    def verdict(got: float, want: float) -> str | None:
        said: str | None = compare(torch.tensor([got]), torch.tensor([want]), None, bound)[3]
        return said

    assert verdict(inf, inf) is None
    assert verdict(-inf, inf) == "1 elements: -inf where the declared policy gives inf"
    assert verdict(0.0, inf) == "1 elements: 0 where the declared policy gives inf"
    assert verdict(nan, nan) is None
    assert verdict(inf, nan) is None
    assert verdict(2.0, nan) == "1 elements: 2 where the declared policy gives nan"
    assert verdict(nan, 2.0) == "1 elements: nan where a finite value is expected"
