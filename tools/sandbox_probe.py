"""Which parts of the worker's sandbox a device's driver and compilers put up with.

Each try runs in a fresh interpreter that enters the sandbox as a worker does (with some
of its parts switched off), then does what a backend does first on the device: it
initialises it, multiplies two matrices and, with ``--flex``, compiles FlexAttention
once. The tries run at once: the whole sandbox (and no sandbox: where that fails too, the
work itself is broken, and the sandbox stays whole), each part switched off alone, then
each pair. Printed on stderr: each try and, for one that failed, its error; on stdout, last,
the value for ``ATTNREF_NO_SANDBOX``: empty where the whole sandbox works, else the
fewest parts whose switching off makes it work, or ``1`` where nothing short of no
sandbox does (``tools/gpu_session.sh`` exports it for the rest of a GPU session, and
the audits' first line and reports then list those parts as missing).

    python tools/sandbox_probe.py --device cuda --flex
"""

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from attnref._sandbox import NO_SANDBOX, PARTS  # noqa: E402 (torch-free)

#: what a backend does first on a device; ``device`` and ``flex`` are set before it
WORK = """
import torch
x = torch.randn(256, 256, device=device)
float((x @ x).sum())
if flex:
    from torch.nn.attention.flex_attention import flex_attention
    q = torch.randn(1, 2, 128, 64, device=device)
    float(torch.compile(flex_attention)(q, q, q).sum())
"""

CHILD = """
import json, os, sys, traceback
from attnref import _sandbox
done = _sandbox.enter(sys.argv[1], _sandbox.Policy.from_environment())
device, flex = sys.argv[2], sys.argv[3] == "1"
try:
    exec(sys.argv[4])
    print(json.dumps({"ok": True, "sandbox": done.message()}))
except BaseException as e:
    lines = traceback.format_exception_only(type(e), e)
    print(json.dumps({"ok": False, "error": "".join(lines).strip()[-600:]}))
"""


def _try(without: tuple[str, ...], device: str, flex: bool, work: str, timeout: float) -> Any:
    """Start one try (a fresh interpreter); `_result` collects it."""
    scratch = tempfile.mkdtemp(prefix="attnref-probe-")
    env = {**os.environ, NO_SANDBOX: ",".join(without)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", CHILD, scratch, device, "1" if flex else "0", work]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    return proc, scratch, timeout


def _result(started: Any) -> dict[str, Any]:
    proc, scratch, timeout = started
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"ok": False, "error": f"no answer within {timeout:.0f} s"}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for line in reversed(out.strip().splitlines()):
        try:
            result: dict[str, Any] = json.loads(line)
            return result
        except ValueError:
            continue
    tail = (err.strip().splitlines() or [f"exit {proc.returncode}, nothing printed"])[-1]
    return {"ok": False, "error": tail[-600:]}


def probe(device: str, flex: bool, work: str = WORK, timeout: float = 120.0) -> str:
    """The ``ATTNREF_NO_SANDBOX`` value under which ``work`` runs on ``device``."""
    rounds: list[list[tuple[str, ...]]] = [
        [(), ("1",)],  # the whole sandbox, and none: is it the sandbox that breaks it?
        [(p,) for p in PARTS],
        [tuple(c) for c in itertools.combinations(PARTS, 2)],
    ]
    for tries in rounds:
        started = [(w, _try(w, device, flex, work, timeout)) for w in tries]
        results = [(w, _result(s)) for w, s in started]
        working = []
        for without, result in results:
            name = "the whole sandbox" if not without else "without " + ", ".join(without)
            name = "no sandbox" if without == ("1",) else name
            if result["ok"]:
                print(f"{name}: works", file=sys.stderr)
                working.append(without)
            else:
                print(f"{name}: FAILS: {result['error']}", file=sys.stderr)
        if tries[0] == () and not working:
            print("it fails without a sandbox too: not the sandbox's doing", file=sys.stderr)
            return ""
        if () in working:
            return ""
        working = [w for w in working if w != ("1",)]
        if working:
            # the first that works, in the order of PARTS: lifetime before files, say
            return ",".join(working[0])
    return "1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--flex", action="store_true", help="compile FlexAttention too")
    parser.add_argument("--work", default=WORK, help="Python to run instead (tests)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per try")
    args = parser.parse_args(argv)
    print(probe(args.device, args.flex, args.work, args.timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
