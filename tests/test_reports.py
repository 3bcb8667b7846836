"""Reports people read where they already look (docs/reports.md): a saved report read
back, JUnit XML checked against the schema Jenkins reads, and an audit split into
shards (``--shard K/N``) merged back into the report one process writes."""

import json
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attnref.cli import main
from attnref.conformance import audit
from attnref.conformance.exports import (
    MergeError,
    junit_xml,
    load_report,
    merge_reports,
    shard_of,
)
from attnref.conformance.report import AuditReport

SCHEMA = Path(__file__).parent / "data" / "junit-10.xsd"
#: a small audit of a mutant that fails some properties and skips none, or one
PROPS = ["forward", "gqa", "lse", "masked_keys", "causality"]


def _run(**kwargs: object) -> AuditReport:
    return audit("mutant.gqa_tiled", dtypes=(torch.float32, torch.float16), properties=PROPS,
                 progress=False, **kwargs)  # type: ignore[arg-type]  # fmt: skip


def _validate(text: str) -> None:
    xmlschema = pytest.importorskip("xmlschema")
    xmlschema.XMLSchema(str(SCHEMA)).validate(text)


def _key(data: dict[str, object]) -> list[tuple[object, ...]]:
    results = data["results"]
    assert isinstance(results, list)
    return [
        (r["property"], r["dtype"], r["status"], r["checks"], r["skipped"], r["message"],
         json.dumps(r["failure"], sort_keys=True))
        for r in results
    ]  # fmt: skip


@pytest.fixture(scope="module")
def small() -> AuditReport:
    """One small audit (two failures and a skip) that the default tier's tests share."""
    return audit("mutant.gqa_tiled", dtypes=(torch.float32,),
                 properties=["forward", "gqa", "sinks"], progress=False)  # fmt: skip


def test_the_junit_report_is_valid_and_names_each_property_and_dtype(small: AuditReport) -> None:
    report = replace(small, results=[replace(r) for r in small.results])
    text = junit_xml(report)
    _validate(text)
    root = ET.fromstring(text)
    (suite,) = root.findall("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["forward[float32]", "gqa[float32]", "sinks[float32]"]
    assert suite.get("tests") == "3"
    assert suite.get("failures") == str(report.count("fail")) != "0"
    failed = [c for c in cases if c.find("failure") is not None]
    assert failed
    body = failed[0].find("failure")
    assert body is not None
    assert "check_case(" in (body.text or "")  # the reproducer rides along
    skipped = [c for c in cases if c.find("skipped") is not None]
    assert skipped
    assert skipped[0].find("skipped").get("message")  # type: ignore[union-attr]
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["verdict"] == "FAILED"
    assert props["seed"] == "0"
    # a message with bytes XML cannot hold is still valid XML
    report.results[0].message = "bad \x00 byte \x1b[31m"
    _validate(junit_xml(report))


def test_a_saved_report_reads_back_as_it_was_written(small: AuditReport, tmp_path: Path) -> None:
    report = small
    report.write_json(tmp_path / "r.json")
    again = load_report(tmp_path / "r.json")
    written = json.loads((tmp_path / "r.json").read_text())
    assert json.loads(json.dumps(again.to_dict())) == written


@pytest.mark.slow  # four small audits: 3 shards and the whole
def test_three_shards_merged_are_the_audit_one_process_runs(tmp_path: Path) -> None:
    whole = _run()
    shards = [_run(shard=(k, 3)) for k in (1, 2, 3)]
    assert sorted(len(s.results) for s in shards) == [3, 3, 4]
    paths = []
    for k, s in enumerate(shards, 1):
        s.write_json(tmp_path / f"s{k}.json")
        paths.append(tmp_path / f"s{k}.json")
    # in any order, through the command
    code = main(["merge", str(paths[2]), str(paths[0]), str(paths[1]), "--json",
                 str(tmp_path / "m.json"), "--junit", str(tmp_path / "m.xml")])  # fmt: skip
    assert code == (0 if whole.ok else 1)
    merged = json.loads((tmp_path / "m.json").read_text())
    one = whole.to_dict()
    assert _key(merged) == _key(one)
    assert merged["findings"] == one["findings"]
    assert merged["summary"] == one["summary"]
    assert merged["shard"] is None
    _validate((tmp_path / "m.xml").read_text())


def test_merging_anything_but_every_shard_of_one_audit_is_refused(tmp_path: Path) -> None:
    one = audit("reference", dtypes=(torch.float32,), properties=["forward", "gqa"],
                progress=False, shard=(1, 2))  # fmt: skip
    two = audit("reference", dtypes=(torch.float32,), properties=["forward", "gqa"],
                progress=False, shard=(2, 2))  # fmt: skip
    assert [r.property for r in one.results] == ["forward"]
    assert [r.property for r in two.results] == ["gqa"]
    assert merge_reports([two, one]).ok
    bad = {
        "its seed differs": [one, replace(two, seed=7)],
        "its backend differs": [one, replace(two, backend="torch-sdpa")],
        "its profile differs": [one, replace(two, profile="ci")],
        "its attnref and torch versions differs": [one, replace(two, versions=("0.0", "2.0"))],
        "its declaration differs": [one, replace(two, capabilities=replace(
            two.capabilities, gqa=False))],
        "shard 2/2 missing": [one],
        "shard 1/2 given twice": [one, one, two],
        "not a shard": [one, replace(two, shard=None)],
        "shards of different N": [one, replace(two, shard=(2, 3))],
    }  # fmt: skip
    for reason, reports in bad.items():
        with pytest.raises(MergeError, match=reason):
            merge_reports(reports)
    # through the command: exit 2 and the reason
    one.write_json(tmp_path / "a.json")
    assert main(["merge", str(tmp_path / "a.json"), "--json", str(tmp_path / "m.json")]) == 2


@pytest.mark.parametrize("text", ["3", "0/2", "3/2", "a/b", "1/"])
def test_a_bad_shard_is_named(text: str) -> None:
    with pytest.raises(ValueError, match="K/N"):
        shard_of(text)
    assert shard_of("2/5") == (2, 5)


# -------------------------------------------------------------------------- HTML


def test_the_html_page_holds_the_grid_each_finding_s_heatmap_and_coverage(
    small: AuditReport,
) -> None:
    import re

    from attnref.conformance.html import html_report

    report = small
    page = html_report(report)
    assert '<table id="grid">' in page
    assert "http://" not in page.replace("http://www.w3.org", "")  # nothing fetched
    assert "<script" not in page
    anchors = set(re.findall(r'id="([^"]+)"', page))
    links = re.findall(r'href="#([^"]+)"', page)
    assert links
    assert set(links) <= anchors  # every grid cell leads to its result
    failed = [r for r in report.results if r.finding is not None]
    assert failed
    assert all(r.finding.errors for r in failed)  # type: ignore[union-attr]
    findings = report.findings()
    # one heatmap and one reproducer a finding (not a failure); coverage as bars
    assert page.count("data:image/png;base64,") == len(findings)
    assert page.count('<table class="bars">') >= 5
    assert page.count("check_case(") == len(findings)
    assert ("<details>" in page) == any(len(rs) > 1 for _, rs in findings)
    assert '<table class="coverage">' in page
    assert "timeout" in page  # the options it ran with


def _chromium() -> str:
    """Debian's chromium, installed here if missing and possible (else the test skips
    with the reason)."""
    import os
    import shutil
    import subprocess

    found = shutil.which("chromium")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
                       capture_output=True, timeout=900, check=False)  # fmt: skip
        found = shutil.which("chromium")
    if found is None:
        pytest.skip("no chromium, and it cannot be installed here (apt-get as root)")
    return found


@pytest.mark.slow  # a whole quick audit: 60 s
def test_the_page_of_a_whole_quick_audit_is_small_and_folds_its_variations(
    tmp_path: Path,
) -> None:
    """A mutant failing 56 of 88 searches with one bug (a finite fill where the
    declaration says zero) made a page of 1.9 MB with every failure in full; one
    finding a heatmap and a reproducer, its variations folded, coverage in tables:
    under 500 kB."""
    from attnref.conformance.html import write_html

    report = audit("mutant.empty_row_uniform", progress=False)
    assert report.count("fail") > 40
    ((_, members),) = report.findings()
    page = write_html(report, tmp_path / "r.html").read_text()
    assert len(page.encode()) < 500_000
    assert page.count("check_case(") == 1
    assert page.count('class="variation"') == len(members) - 1


@pytest.mark.slow  # a browser, and its install where missing
def test_the_html_report_of_a_size_gated_kernel_renders_where_the_error_starts(
    tmp_path: Path,
) -> None:
    """The quick audit of a kernel whose causal rows past query 1024 see one key too
    many: its heatmap's first wrong column is query 1024; the page loads in headless
    Chromium with no console error, and its screenshot is not blank."""
    import subprocess

    browser = _chromium()
    paths = ["--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html")]
    code = main(["audit", "--backend", "tests.planted_sizes:causal_rows_past_1024",
                 "--dtype", "float64", "--property", "forward", "--fail-fast", "--no-progress",
                 *paths])  # fmt: skip
    assert code == 1
    data = json.loads((tmp_path / "r.json").read_text())
    (failed,) = [r for r in data["results"] if r["failure"]]
    errors = failed["failure"]["errors"]
    row = errors["map"][0]
    first = next(i for i, x in enumerate(row) if x is None or x > errors["bound"])
    assert errors["column_labels"][first] == 1024
    assert all(errors["column_labels"][i] < 1024 for i in range(first))
    url = (tmp_path / "r.html").resolve().as_uri()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,1600"]
    out = subprocess.run([browser, *flags, "--enable-logging=stderr", "--v=0",
                          f"--screenshot={tmp_path / 'shot.png'}", url],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    console = [x for x in out.stderr.splitlines() if "CONSOLE" in x]
    assert not [x for x in console if "error" in x.lower()], console
    dom = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120).stdout  # fmt: skip
    assert 'id="grid"' in dom
    assert "data:image/png;base64," in dom
    import matplotlib.image

    pixels = matplotlib.image.imread(tmp_path / "shot.png")
    assert pixels.shape[0] > 500
    assert float(pixels[..., :3].std()) > 0.05  # not blank


def test_a_saved_report_is_printed_with_its_own_torch_version(
    small: AuditReport, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``attnref report`` printed the running torch's version, not the report's."""
    path = tmp_path / "r.json"
    small.write_json(path)
    data = json.loads(path.read_text())
    data["torch_version"] = "1.2.3+elsewhere"
    path.write_text(json.dumps(data))
    assert main(["report", str(path)]) == 1
    assert "torch 1.2.3+elsewhere" in capsys.readouterr().out


def test_an_output_that_cannot_be_written_is_named_before_the_audit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Into a missing folder, --html and --junit blamed --json; checked before the audit
    starts, each names itself, and ``attnref report`` checks its outputs before reading."""
    missing = tmp_path / "nowhere" / "page.html"
    for option in ("--html", "--junit"):
        assert main(["audit", "--no-progress", option, str(missing)]) == 2
        err = capsys.readouterr().err
        assert f"{option} {missing}: the folder" in err, err
    assert main(["report", str(tmp_path / "absent.json"), "--html", str(missing)]) == 2
    assert f"--html {missing}: the folder" in capsys.readouterr().err


def test_a_reproducer_saves_the_inputs_each_call_got_and_the_oracle(tmp_path: Path) -> None:
    """A user wrote an input-dumping copy of an adapter to look at the tensors that broke
    a kernel: ``check_case(..., save=DIR)`` (a reproducer's ``--save DIR``) writes each
    call's arguments as the backend received them, what it returned, and the oracle's
    answer with its bounds."""
    from attnref.conformance import Case, check_case
    from attnref.conformance.report import reproducer

    case = Case("x", batch=(1,), h=2, g=2, Tq=3, Tk=3, causal="top_left")
    verdict = check_case("forward", "mutant.causal_leaks_next", case, torch.float32,
                         isolate=False, save=tmp_path / "saved")  # fmt: skip
    assert verdict.startswith("FAIL")
    calls = torch.load(tmp_path / "saved" / "inputs.pt", weights_only=True)["calls"]
    (call,) = calls
    q = call["args"][0]
    assert tuple(q.shape) == (1, 2, 3, 8)
    assert q.dtype == torch.float32
    assert call["kwargs"]["is_causal"] is True
    (oracle,) = torch.load(tmp_path / "saved" / "expected.pt", weights_only=True)["oracles"]
    assert oracle["output"].dtype == torch.float64
    assert torch.equal(oracle["inputs"]["query"], q)
    got = call["returned"].to(torch.float64)
    assert float((got - oracle["output"]).abs().max()) > oracle["bound"][0]
    assert "--save" in reproducer("b", "forward", case, torch.float32, "cpu", "m")


@pytest.mark.parametrize("rows", [1, 2])
def test_a_heatmap_of_infinite_errors_is_drawn_with_them_marked(rows: int) -> None:
    """An error map keeps an infinite error as the largest float: the page of a sparse
    FP8 kernel's audit raised OverflowError in matplotlib's tick layout (errors of
    1.8e308 over a bound of 1.28), and no page was written. They are marked off the
    scale now, one query's map and a grid alike."""
    pytest.importorskip("matplotlib")
    from attnref.conformance.html import heatmap

    big = 1.7976931348623157e308
    grid = [[big, big, 0.5, 2.0], [0.1, big, 1.0, 3.0]][:rows]
    errors = {"map": grid, "bound": 1.2826, "columns": "keys", "rows": "queries"}
    assert heatmap(errors, "sparse_fp8 [bfloat16]").startswith('<img alt="plot"')


@pytest.mark.slow  # an audit, a bug report and two runs of its script: 15 s
def test_a_bug_report_runs_without_attnref_and_passes_on_the_reference(tmp_path: Path) -> None:
    """``attnref report --bug-reports DIR`` writes, per finding, the inputs, the float64
    answer, REPORT.md and a repro.py that imports only torch and the backend's module:
    with attnref not importable it exits 1 on the kernel, 0 with torch's SDPA swapped in."""
    import subprocess
    import sys

    from attnref.cli import main

    path = tmp_path / "r.json"
    args = ["--property", "forward", "--dtype", "float32", "--no-progress", "--json", str(path)]
    assert main(["audit", "--backend", "tests.plain_kernels:scale_off_by_two", *args]) == 1
    out = tmp_path / "bugs"
    assert main(["report", str(path), "--bug-reports", str(out)]) == 1
    (folder,) = sorted(out.iterdir())
    assert {p.name for p in folder.iterdir()} == {"inputs.pt", "expected.pt", "repro.py",
                                                   "REPORT.md"}  # fmt: skip
    report = (folder / "REPORT.md").read_text()
    assert "**What is wrong.** output: max error" in report
    assert f"torch\n{torch.__version__}" in report
    root = Path(__file__).resolve().parents[1]
    blocked = (
        "import sys, runpy; sys.modules['attnref'] = None; sys.argv = ['repro.py', *sys.argv[1:]]; "
    )
    run = blocked + "runpy.run_path('repro.py', run_name='__main__')"
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    bug = subprocess.run([sys.executable, "-c", run], cwd=folder, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert bug.returncode == 1, bug.stdout + bug.stderr
    assert "FAIL: the bug shows" in bug.stdout
    assert "the float64 answer again in plain torch: 0 from expected.pt" in bug.stdout
    fixed = subprocess.run([sys.executable, "-c", run, "--backend",
                            "torch.nn.functional:scaled_dot_product_attention"], cwd=folder,
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "pass: within the bound" in fixed.stdout


@pytest.mark.slow  # an audit, a bug report and two runs of its script: 15 s
def test_a_gated_delta_bug_report_recomputes_the_recurrence_without_attnref(
    tmp_path: Path,
) -> None:
    """A finding of the ``gated-delta`` family: repro.py calls the kernel as fla's
    convention is called, computes the recurrence again in plain torch, compares the
    output and the final states with expected.pt, and exits 1 on the planted kernel, 0
    on the correct one, attnref not importable."""
    import subprocess
    import sys

    from attnref.cli import main

    out = tmp_path / "bugs"
    args = ["--api", "gated-delta", "--property", "gdn_tails", "--dtype", "float32",
            "--no-progress", "--bug-reports", str(out)]  # fmt: skip
    assert main(["audit", "--backend", "tests.planted_linear:tail_decay_skipped", *args]) == 1
    (folder,) = sorted(out.iterdir())
    report = (folder / "REPORT.md").read_text()
    assert "query/key head(s)" in report
    root = Path(__file__).resolve().parents[1]
    run = (
        "import sys, runpy; sys.modules['attnref'] = None; sys.argv = ['repro.py', *sys.argv[1:]]; "
        "runpy.run_path('repro.py', run_name='__main__')"
    )
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    bug = subprocess.run([sys.executable, "-c", run], cwd=folder, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert bug.returncode == 1, bug.stdout + bug.stderr
    assert "FAIL: the bug shows" in bug.stdout
    assert "final state: worst element" in bug.stdout
    gaps = [float(line.split(" is ")[1].split()[0]) for line in bug.stdout.splitlines()
            if "the recurrence again in plain torch is" in line]  # fmt: skip
    assert gaps, bug.stdout
    assert max(gaps) < 1e-12, bug.stdout
    right = [sys.executable, "-c", run, "--backend", "tests.planted_linear:right"]
    fixed = subprocess.run(right, cwd=folder, env=env, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "pass: within the bound" in fixed.stdout
