"""``attnref audit`` on the command line: exit codes, messages, reports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnref.cli import main


def test_audit_passes_torch_sdpa(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--no-progress", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "backend torch-sdpa on cpu" in out
    assert "0 failed" in out
    assert out.rstrip().endswith("OK")


def test_audit_fails_a_planted_bug_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "r.json"
    code = main(
        [
            "audit",
            "--backend",
            "tests.planted:gqa_tiled",
            "--dtype",
            "float32",
            "--no-progress",
            "--json",
            str(path),
        ]
    )
    assert code == 1
    out = capsys.readouterr().out
    assert "failures:" in out
    assert "gqa [float32]: max error" in out
    assert json.loads(path.read_text())["summary"]["ok"] is False


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("nope", "unknown backend 'nope'"),
        ("tests.planted:no_mask_argument", "lacks the keyword arguments"),
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
    for name in ("reference", "torch-sdpa", "torch-sdpa-math"):
        assert name in out


def test_python_dash_m() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "attnref", "audit", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert "--backend" in proc.stdout
