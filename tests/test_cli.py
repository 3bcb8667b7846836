"""``attnref audit`` on the command line: exit codes, messages, reports."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnref.cli import main


def test_audit_passes_torch_sdpa(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["audit", "--no-progress", "--dtype", "float32", "--property", "forward"])
    assert code == 0
    out = capsys.readouterr().out
    assert "backend torch-sdpa on cpu, profile quick, seed 0" in out
    assert "0 failed" in out
    assert "forward" in out
    assert "gradient" not in out
    assert out.rstrip().endswith("OK")


def test_audit_fails_a_mutant_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "r.json"
    code = main(
        [
            "audit",
            "--backend",
            "mutant.gqa_tiled",
            "--dtype",
            "float32",
            "--property",
            "gqa",
            "--seed",
            "7",
            "--no-progress",
            "--json",
            str(path),
        ]
    )
    assert code == 1
    out = capsys.readouterr().out
    assert "findings (failures grouped by cause, each shrunk to a minimal case):" in out
    assert "gqa [float32]: GQA against expanded heads: the call with grouped KV heads" in out
    assert "check_case('gqa', 'mutant.gqa_tiled', case" in out  # the reproducer
    assert "reproducers written to" in out
    data = json.loads(path.read_text())
    assert data["summary"]["ok"] is False
    assert data["seed"] == 7
    assert (tmp_path / "r.reproducers" / "gqa-float32.py").exists()
    # a law names both of the backend's calls and the oracle; neither is "expected"
    assert "the call with grouped KV heads gave" in out
    assert "the oracle" in out
    (finding,) = data["findings"]
    assert finding["count"] == 1
    assert finding["results"] == ["gqa [float32]"]
    # a later run into the same path leaves none of this run's reproducers beside it
    args = ["audit", "--backend", "reference", "--dtype", "float32", "--property", "gqa"]
    assert main([*args, "--no-progress", "--json", str(path)]) == 0
    assert not (tmp_path / "r.reproducers").exists()
    assert json.loads(path.read_text())["findings"] == []


def test_fail_fast(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--backend", "mutant.scale_by_d", "--fail-fast", "--no-progress"]) == 1
    assert "stopped at the first failure (--fail-fast)" in capsys.readouterr().out


def test_list_properties(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--list-properties"]) == 0
    out = capsys.readouterr().out
    for pid in ("forward", "gradient", "masked_keys", "decode", "large_index"):
        assert pid in out


def test_unknown_property(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--property", "speed"]) == 2
    assert "unknown property 'speed'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("nope", "unknown backend 'nope'"),
        ("tests.planted:no_mask_argument", "it lacks attn_mask"),
        ("mutant.nope", "unknown mutant"),
        ("no_such_module_xyz:f", "cannot import module"),
    ],
)
def test_bad_backend_is_a_clear_message(
    backend: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", "--backend", backend]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_cuda_absent_and_unknown_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["audit", "--device", "cuda"]) == 2
        assert "no CUDA device is present" in capsys.readouterr().err


def test_list_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--list-backends"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "torch-sdpa", "torch-sdpa-flash", "naive", "mutant.gqa_tiled"):
        assert name in out


def test_python_dash_m() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "attnref", "audit", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert "--backend" in proc.stdout


@pytest.mark.slow
def test_gpu_audit_script_runs_on_the_cpu(tmp_path: Path) -> None:
    """tools/gpu_audit.py is what a lent GPU runs; here it must work at the same sizes."""
    proc = subprocess.run(
        [
            sys.executable,
            "tools/gpu_audit.py",
            "--out",
            str(tmp_path),
            "--backend",
            "torch-sdpa-flash",
            "--backend",
            "torch-sdpa-efficient",
            "--property",
            "forward",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "README.md").read_text()
    assert "| `torch-sdpa-flash` | 2 | 0 | 0 |" in summary
    assert "| `torch-sdpa-efficient` | 0 | 0 | 2 |" in summary  # no such kernel on a CPU
    assert (tmp_path / "torch-sdpa-flash.json").exists()


@pytest.mark.slow
def test_demo_copy_trains_prints_examples_and_saves_heatmaps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two epochs are too few to copy everything: the demo says so and exits 1."""
    code = main(["demo", "copy", "--epochs", "2", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1
    assert "epoch 2: loss" in out
    assert "2 epochs, 40 batches" in out
    assert out.count("  source  [1,") == 3
    assert out.count("  decoded [1,") == 3
    assert "6 heatmaps saved" in out
    assert len(list(tmp_path.glob("*.png"))) == 6


def test_demo_rejects_a_bad_epoch_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "copy", "--epochs", "0"]) == 2
    assert "--epochs must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_reverse_trains_bahdanau_and_saves_its_alignment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One hundred steps: the loss falls, the examples print, the alignment is saved."""
    code = main(["demo", "reverse", "--epochs", "1", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert "100 steps" in out
    first, last = (float(x) for x in out.split("loss ")[1].split(":")[0].split(" -> "))
    assert last < 0.5 * first
    assert out.count("  decoded [") == 3
    assert (tmp_path / "bahdanau-alignment.png").read_bytes()[:4] == b"\x89PNG"


def test_audit_a_flash_convention_kernel_with_api_flash(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["audit", "--no-progress", "--dtype", "float32", "--property", "variants",
            "--property", "lse", "--api", "flash"]  # fmt: skip
    assert main([*args, "--backend", "attnref.conformance.families.flash:flash_reference"]) == 0
    out = capsys.readouterr().out
    assert "variants" in out
    assert out.rstrip().endswith("OK")
    assert main([*args, "--backend", "mutant.lse_base2"]) == 1
    assert "log-sum-exp" in capsys.readouterr().out


@pytest.mark.slow
def test_audit_a_decode_kernel_with_api_flash_kvcache(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["audit", "--no-progress", "--dtype", "float32", "--property", "kvcache",
            "--api", "flash-kvcache"]  # fmt: skip
    assert (
        main([*args, "--backend", "attnref.conformance.families.flash_kvcache:kvcache_reference"])
        == 0
    )
    assert capsys.readouterr().out.rstrip().endswith("OK")
    assert main([*args, "--backend", "tests.planted_serving:append_first_page"]) == 1
    out = capsys.readouterr().out
    assert "kvcache [float32]" in out
    assert "api='flash-kvcache'" in out  # the reproducer loads it in its family


def test_an_unknown_api_family_is_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--api", "cudnn"]) == 2
    assert "unknown API family 'cudnn': use one of sdpa, flash" in capsys.readouterr().err


def test_the_option_tables_in_the_docs_are_written_from_the_parsers() -> None:
    """docs/conformance.md lists every option of ``attnref audit`` and of the plugin as
    their parsers declare them (``python tools/options_doc.py`` rewrites the tables)."""
    from tools.options_doc import PAGE, render

    text = PAGE.read_text()
    assert render(text) == text, "run: python tools/options_doc.py"
    assert "`--attnref-api`" in text
    assert "`--api`" in text


def test_min_judged_fails_a_thin_audit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --min-judged, a pass judged on fewer cases is thin and the audit not OK; the
    summary line counts judged cases, not drawn ones."""
    path = tmp_path / "r.json"
    args = ["audit", "--no-progress", "--dtype", "float32", "--property", "forward"]
    assert main([*args, "--min-judged", "100000", "--json", str(path)]) == 1
    out = capsys.readouterr().out
    assert "thin " in out
    assert "1 thin" in out
    assert "cases judged" in out
    assert "THIN (not OK: 1 of 1 pass judged on fewer than 100000 cases, --min-judged)" in out
    summary = json.loads(path.read_text())["summary"]
    assert (summary["thin"], summary["min_judged"], summary["ok"]) == (1, 100000, False)
    assert summary["judged"] == summary["checks"] > 0
    assert main([*args, "--min-judged", "0"]) == 2
    assert "--min-judged must be >= 1" in capsys.readouterr().err


def test_a_property_budget_an_estimate_and_the_start_up_in_the_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--property-budget ends each property's search (it passes on what it judged, thin
    here, and the audit, cut short by its budget, is THIN: exit 1, saying how to get a
    whole one); after three searches the command estimates what is left; the time it
    reports counts its start-up, in the summary line and the JSON."""
    path = tmp_path / "r.json"
    args = ["audit", "--no-progress", "--dtype", "float32", "--dtype", "float64"]
    args += ["--property", "forward", "--property", "hot"]
    args += ["--property-budget", "0.01", "--json", str(path)]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert "attnref audit: 3 of 4 (property, dtype) searches done; " in err
    assert " left (" in err
    assert "s of it start-up): THIN (not OK: 4 of 4 passes judged on fewer than" in out
    assert "a larger budget, or none, searches them whole" in out
    data = json.loads(path.read_text())
    for r in data["results"]:
        assert r["status"] == "pass"
        assert "its budget of 0.01 s ran out" in r["message"]
        assert 1 <= r["checked"] < 67
    assert 0 < data["startup_seconds"] < data["seconds"]
    assert main([*args[:-2], "--property-budget", "0"]) == 2


def test_a_log_hears_of_a_long_search_while_it_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a terminal (a CI log) the audit says how it goes every PROGRESS_EVERY
    seconds, within a search too: an interpreted kernel's search can take minutes, and
    its log went silent until the search ended."""
    import attnref.cli

    monkeypatch.setattr(attnref.cli, "PROGRESS_EVERY", 0.3)
    assert main(["audit", "--dtype", "float64", "--property", "forward", "--jobs", "1"]) == 0
    err = capsys.readouterr().err
    within = re.findall(
        r"attnref audit: 0 of 1 \(property, dtype\) searches done, 0 failed, [0-9.]+ min "
        r"so far; forward \[float64\]: (\d+) cases checked in \d+ s",
        err,
    )
    assert within, err
    assert int(within[-1]) > int(within[0]) > 0  # counted as it went


def test_the_estimate_rests_on_several_searches_and_says_how_sure_it_is() -> None:
    """The first search (``forward``) takes 2-5 times the others: the estimate is the
    median of those finished, with a range, and how many it rests on (4.0 min predicted
    from the first alone, where the audit took 63 s)."""
    from attnref.cli import _checkpoints, estimate

    said = estimate([30.0, 2.0, 3.0, 2.5], planned=100, judges=1)
    assert "4 of 100 (property, dtype) searches done" in said
    assert "about 4.4 min left" in said  # 96 searches at the median, 2.75 s; not 30 s
    assert "(3.2 min to 15.0 min; a rough guess, from 4 searches" in said
    assert "about 2.2 min left" in estimate([30.0, 2.0, 3.0, 2.5], planned=100, judges=2)
    assert "sure, from 60" in estimate([1.0] * 60, planned=100, judges=1)
    # the point lies inside its range where a few searches were quick (the mean below
    # the median), and a time under a second is not "about 0 s"
    skewed = estimate([10.0] * 6 + [0.1] * 3, planned=100, judges=1)
    assert "about 15.2 min left (9 s to 15.2 min;" in skewed
    assert "under 1 s left (a rough guess" in estimate([0.01, 0.02, 0.01], planned=4, judges=2)
    assert _checkpoints(100) == {3, 10, 25, 50, 75}
    assert _checkpoints(2) == set()


@pytest.mark.slow  # two audits in fresh processes: 7 s
def test_a_backend_s_own_output_stays_out_of_the_terminal(tmp_path: Path) -> None:
    """What the backend writes to its stdout and stderr (a library's logging: 12 MB
    around an audit once) is the backend's: captured in its worker's scratch folder, the
    last of it kept with each finding in the JSON and shown by ``-v``, none of it
    printed by default."""
    report = tmp_path / "r.json"
    args = ["audit", "--backend", "tests.planted:chatty_and_wrong", "--dtype", "float32",
            "--property", "forward", "--no-progress", "--jobs", "1"]  # fmt: skip
    quiet = subprocess.run(
        [sys.executable, "-m", "attnref", *args, "--json", str(report)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert quiet.returncode == 1, quiet.stdout + quiet.stderr
    assert "chatty std" not in quiet.stdout + quiet.stderr
    (result,) = json.loads(report.read_text())["results"]
    output = result["failure"]["output"]
    assert output.rstrip().endswith("the last words [31mred[0m")  # escapes dropped
    assert len(output.encode()) <= 4096
    loud = subprocess.run(
        [sys.executable, "-m", "attnref", *args, "-v"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert "| the last words" in loud.stdout
    assert loud.stdout.count("chatty std") < 400  # the tail, not the 4,000 lines a call
