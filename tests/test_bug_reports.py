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


@pytest.mark.slow  # fourteen audits stopped at their first failure, their reports run: 30 s
@pytest.mark.parametrize(("spec", "api", "right"), AUDITED, ids=[s for s, _, _ in AUDITED])
def test_each_finding_of_a_planted_kernel_is_a_report_that_reproduces_it(
    spec: str, api: str, right: str, tmp_path: Path
) -> None:
    """Each finding of the audit, a folder whose repro.py exits 1 on the kernel and 0
    with the correct function swapped in (an exception, an input changed in place, NaN,
    a value past its bound, an LSE off: each as the bug shows). The flash kernels are
    audited on the properties aimed at their bug's class (as tests/test_audit.py's)."""
    from dataclasses import replace

    from attnref.conformance import audit
    from tests.bug_reports import assert_reports_reproduce
    from tests.planted_flash import UNSEEN

    name = spec.partition(":")[2]
    aimed = None
    if api == "flash":
        aimed = [p.id for p in PROPERTIES.values() if UNSEEN[name] in p.classes]
    kill = replace(PROFILES["quick"], name="quick-kill", shrink_seconds=0.5)
    report = audit(resolve_backend(spec, api=api), device="cpu", progress=False,
                   properties=aimed, dtypes=(torch.float32,), fail_fast=True,
                   profile=kill)  # fmt: skip
    assert not report.ok, report.format_table()
    assert_reports_reproduce(report, right, tmp_path)


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
