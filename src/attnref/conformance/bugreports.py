"""Bug reports a library's maintainers can run without attnref (docs/reports.md).

A maintainer will not install a conformance suite to read a bug report. For each finding
of an audit, `write_bug_reports` writes a folder:

- ``inputs.pt``: each call of the finding's shrunk case, its arguments exactly as the
  backend received them and what it returned (`attnref.conformance.runner.check_case`'s
  ``save``, run again in a fresh worker);
- ``expected.pt``: each float64 answer of attnref's oracle for those calls (output and
  log-sum-exp), which elements it knows, its bounds, and where it lies in what its call
  returned: the flat position of each element among the returned tensors, found by
  reading a probe of the result whose tensors hold their own positions through the
  family's reader (`attnref.conformance.runner.Recording.reading`). Every family's
  layout, packed, paged or latent, is then read the same way, with no attnref;
- ``repro.py``: a script that imports only torch, the standard library and the
  backend's own module: it loads the inputs, calls the backend as the audit did (each
  call on fresh copies, the arguments it may write returned beside its result), checks
  that it changed none of the others, reads each judged answer where expected.pt says,
  judges it as attnref does (NaN where a finite value is due, the largest and the mean
  error against their bounds), prints the worst element, and exits 1 where the bug shows
  (0 where it does not: ``--backend module:function`` runs another function, the
  reference or a fix, on the same inputs). Where the variant is plain attention (GQA,
  a mask, the causal diagonal, a window) it computes the float64 answer again in a few
  lines of plain torch;
- ``REPORT.md``: the finding in a maintainer's words, ready to paste into an issue.

Backends of attnref's own (``mutant.*``, the built-ins) have no module a maintainer
could run alone: their folders hold the tensors and the report, and ``repro.py`` says so.
"""

import importlib.metadata
import json
import platform
import re
import shutil
from pathlib import Path

import torch

from attnref.conformance.report import AuditReport, PropertyResult
from attnref.devices import dtype_name
from attnref.interpreted import triton_fixes

__all__ = ["REPRO", "write_bug_reports"]


def write_bug_reports(report: AuditReport, folder: Path, *, timeout: float = 60.0) -> list[Path]:
    """One folder per finding of ``report`` under ``folder`` (``finding-1-property-dtype``),
    written by running the finding's shrunk case once more in a fresh worker; the folders
    written."""
    from attnref.conformance.runner import check_case

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for n, (title, results) in enumerate(report.findings(), 1):
        head = results[0]
        finding = head.finding
        if finding is None:
            continue
        where = folder / f"finding-{n}-{head.property}-{dtype_name(head.dtype)}"
        if where.exists():
            shutil.rmtree(where)
        where.mkdir()
        verdict = check_case(
            head.property, report.backend, finding.case, head.dtype, report.device,
            api=report.api, timeout=timeout, save=where,
        )  # fmt: skip
        spec = report.backend if _is_module_spec(report.backend) else ""
        interpreter = (report.interpreted or {}).get("interpreter")
        # a hang is one past the time the audit gave a call; anything else gets long
        hang = re.search(r"no answer within ([0-9.]+(?:e[+-]?[0-9]+)?) s", verdict)
        limit = float(hang.group(1)) if hang else 600.0
        (where / "repro.py").write_text(_repro(spec, report.api, title, interpreter, limit))
        if interpreter == "triton":  # the interpreter's fixes the audit ran with, plain
            shutil.copyfile(Path(triton_fixes.__file__), where / FIXES)
        (where / "REPORT.md").write_text(_markdown(report, title, head, verdict, spec))
        written.append(where)
    return written


def _is_module_spec(spec: str) -> bool:
    """Whether ``spec`` names a function of an importable module (``module:function``),
    not one of attnref's own backends."""
    return bool(re.fullmatch(r"[\w.]+:[\w.]+", spec)) and not spec.startswith("attnref")


def _version(spec: str) -> str:
    """The installed version of the package a ``module:function`` spec comes from, read
    from its metadata (its code is never imported here: it is the backend's)."""
    top = spec.split(":")[0].split(".")[0]
    try:
        return f"{top} {importlib.metadata.version(top)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{top} (no installed version: a local module)"


def _interpreted(report: AuditReport, head: PropertyResult) -> str:
    """REPORT.md's paragraph on an interpreted kernel (empty for a native one)."""
    record = report.interpreted or {}
    if record.get("interpreter") != "triton":
        return ""
    patched = record.get("patched") or "nothing"
    bf16 = (
        " This finding is in bfloat16, which Triton's interpreter as installed computes "
        "on the raw bits: on a CPU, repro.py may show the interpreter's error rather than "
        "the kernel's; run it on a GPU before filing it."
        if head.dtype == torch.bfloat16 and patched != "nothing"
        else ""
    )
    return (
        f"\n**Run through Triton's interpreter.** The audit ran the kernel on a CPU through "
        f"Triton {record.get('version', '?')}'s interpreter (`TRITON_INTERPRET=1`, which "
        f"repro.py sets where no GPU is); attnref patched there: {patched}. On a GPU, "
        f"repro.py runs the kernel natively.{bf16}\n"
    )


def _markdown(
    report: AuditReport, title: str, head: PropertyResult, verdict: str, spec: str
) -> str:
    assert head.finding is not None
    case = head.finding.case
    batch = f"batch dims {case.batch}" if case.batch else "no batch dims"
    shape = (
        f"{batch}, {case.h} query head(s) on {case.g} KV head(s), {case.Tq} queries, "
        f"{case.Tk} keys, head dim {case.Dh} (values {case.Dv})"
    )
    from attnref.conformance.family import get_family

    described = get_family(report.api).repro_shape  # a family whose calls are not SDPA's
    if described is not None:
        shape = described(case)
    features = ", ".join(
        f"{name} {value}"
        for name, value in (
            ("mask", case.mask if case.mask != "none" else None),
            ("causal", case.causal),
            ("scale", case.scale),
            ("window", case.window),
            ("softcap", case.softcap or None),
            ("sinks", case.sinks or None),
        )
        if value is not None
    )
    run = (
        "python repro.py            # exits 1 while the bug shows"
        if spec
        else "# the backend is attnref's own: the tensors are in inputs.pt and expected.pt"
    )
    if not verdict.startswith("FAIL"):
        verdict += (
            ": made alone, in a fresh process, the finding's calls do not show the bug. "
            "The audit met it after other calls (state a backend keeps between calls, or "
            "memory an earlier call corrupted, shows later), and repro.py, which makes the "
            "finding's own calls only, passes (exit 0) on it"
        )
    return f"""# {title}

**What is wrong.** {head.finding.message}

**Where.** `{report.backend}` called in the `{report.api}` convention, in
{dtype_name(head.dtype)}, on {shape}{"; " + features if features else ""}. The float64
answer and its bound come from attnref's oracle (`expected.pt`); the inputs are those
the function received (`inputs.pt`).

**Reproduce** (needs torch and the library only, not attnref):

```sh
{run}
```

Checked again when this report was written: {verdict}
{_interpreted(report, head)}
**Versions.** {_version(spec) if spec else "attnref's own backend"}; torch
{report.versions[1]}; Python {platform.python_version()} on {platform.platform()}; found
by attnref {report.versions[0]} (`attnref audit`, profile {report.profile}, seed
{report.seed}, property `{head.property}`).
"""


def _repro(
    spec: str, api: str, title: str, interpreter: str | None = None, timeout: float = 600.0
) -> str:
    """repro.py's text: plain torch and the standard library, and the backend's module;
    for a Triton kernel the audit ran through Triton's interpreter, the script runs it so
    too where there is no GPU (`TRITON_INTERPRETED`). ``timeout``: the seconds a call may
    take before the script calls it a hang (the audit's, for a finding of a hang)."""
    from attnref.conformance.family import get_family

    family = get_family(api)
    if family.repro_script is not None:  # a convention of its own (Convention.repro_script)
        text = family.repro_script(json.dumps(title), json.dumps(spec), json.dumps(api))
    else:
        text = repro_text(json.dumps(title), json.dumps(spec), json.dumps(api))
    text = text.replace("@TIMEOUT@", f"{timeout:g}")
    if interpreter == "triton":
        marker = "HERE = Path(__file__).resolve().parent\n"
        assert marker in text, "a repro.py template names HERE"
        text = text.replace(marker, marker + TRITON_INTERPRETED, 1)
    return text


def repro_text(title: str, spec: str, api: str, run: str | None = None) -> str:
    """`REPRO` for one finding (``title``, ``spec`` and ``api`` as Python literals), its
    calls made by ``run`` (the text of a ``run(fn, args, kwargs, record)`` function, and
    what it needs; default `RUN_HERE`, in this process). A ``run`` that defines
    ``rank_main`` is the entry point where the script is started with ``--rank``."""
    text = REPRO.replace("@TITLE@", title).replace("@SPEC@", spec).replace("@API@", api)
    text = text.replace("@RUN@", RUN_HERE if run is None else run)
    if run is not None and "def rank_main(" in run:
        entry = '    sys.exit(rank_main() if sys.argv[1:2] == ["--rank"] else main())'
        text = text.replace("    sys.exit(main())", entry)
    return text


#: how repro.py makes a recorded call by default: in its own process
RUN_HERE = r'''def run(fn, args, kwargs, record):
    """One recorded call as a library makes it, in this process; for a gradient call
    (an upstream gradient ``d_out``), backward() after it, and the gradients of its
    leaves."""
    if record.get("d_out") is None:
        return fn(*args, **kwargs)
    chosen = make_leaves(args, kwargs, record.get("leaves"))
    return gradients_of(fn(*args, **kwargs), record["d_out"], chosen)'''


#: the file of a Triton finding's folder that holds the fixes of Triton's interpreter
#: the audit ran with: `attnref.interpreted.triton_fixes`, copied (NumPy and the standard
#: library only)
FIXES = "triton_interpreter_fixes.py"

#: what repro.py adds for a Triton kernel the audit ran through Triton's interpreter
TRITON_INTERPRETED = """
# the audit ran this Triton kernel through Triton's interpreter on a CPU: so does this
# script where there is no GPU (set before the kernel's module is imported; on a GPU it
# runs natively). As in the audit, the interpreter is mended where it differs from a
# device (triton_interpreter_fixes.py beside this script: bfloat16 arithmetic, a loop's
# variable, a constexpr beside a tensor; TRITON_AS_INSTALLED=1 leaves it as installed),
# and an autotuner, whose configurations the interpreter cannot time, runs for each call
# the first configuration the kernel's own pruning keeps.
if not torch.cuda.is_available():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    mended = (HERE / "triton_interpreter_fixes.py").exists()
    if mended and os.environ.get("TRITON_AS_INSTALLED") != "1":
        sys.path.insert(0, str(HERE))
        import triton_interpreter_fixes

        triton_interpreter_fixes.fix()
        sys.path.remove(str(HERE))
    import triton.runtime.autotuner as autotuner

    autotuner_init = autotuner.Autotuner.__init__

    def first_kept(self, *args, **kwargs):
        autotuner_init(self, *args, **kwargs)
        order = {config: i for i, config in enumerate(self.configs)}
        self._bench = lambda *a, config, **k: [float(order[config])] * 3
        prune = self.prune_configs

        def pruned(kwargs):
            try:
                return list(prune(kwargs))
            except Exception:  # a pruning that asks the device's properties
                return list(self.configs[:1])

        self.prune_configs = pruned

    autotuner.Autotuner.__init__ = first_kept
"""


REPRO = r'''"""Reproduce: @TITLE@

Written by attnref; runs without it: torch, the standard library and the backend's own
module. ``python repro.py`` exits 1 while the bug shows; ``python repro.py --backend
module:function`` runs another function (a fix, a reference) on the same inputs.

inputs.pt holds each call the audit made, its arguments exactly as the backend received
them; expected.pt each float64 answer it was judged against, with its bounds and where
that answer lies in what the call returns (the flat position of each element among the
tensors it returned, in order).

The calls run in a child process (where the system can fork): a backend that crashes,
ends the process or hangs is then reported with the call it was in, not mistaken for
this script's own end. ``--in-process`` runs them here (for a debugger).
"""

import argparse
import importlib
import os
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SPEC = @SPEC@
API = @API@
#: seconds one call may take before it is called a hang (``--timeout``)
TIMEOUT = @TIMEOUT@


def load(name):
    return torch.load(HERE / name, weights_only=True)


def resolve(spec):
    """The function ``module:function`` names."""
    module, _, name = spec.partition(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


def leaves(x):
    """The tensors of ``x``, depth first through its tuples and lists."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in leaves(item)]
    return []


#: bytes of a known value around each argument's memory (`guarded`): a backend that
#: writes outside its tensors changes them, as attnref's worker checks
GUARD = 64


def guarded(t):
    """A copy of ``t``, its shape, strides and dtype, whose memory has GUARD bytes of
    0xA5 before and after it (its ``guard``: on the CPU its storage is exactly its own
    bytes, as a library allocates it; on a GPU, a view into the guarded buffer)."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    size = span * t.element_size()
    if not size:
        return t.clone()
    if t.device.type == "cpu":
        raw = bytearray(b"\xa5" * (size + 2 * GUARD))
        flat = torch.frombuffer(raw, dtype=torch.uint8, count=size, offset=GUARD)
    else:
        raw = torch.full((size + 2 * GUARD,), 0xA5, dtype=torch.uint8, device=t.device)
        flat = raw[GUARD:GUARD + size]
    body = flat.view(t.dtype).as_strided(t.shape, t.stride())
    body.copy_(t.detach())
    body.guard = raw
    return body


def overrun(name, t):
    """Where the backend wrote outside argument ``name``'s memory, or None."""
    raw = getattr(t, "guard", None)
    if raw is None:
        return None
    if not isinstance(raw, bytearray):
        raw = bytes(raw.cpu().tolist())
    sides = [side for side, part in (("before its start", raw[:GUARD]),
                                     ("after its end", raw[-GUARD:]))
             if part != b"\xa5" * GUARD]
    return f"{name} (guard bytes {' and '.join(sides)} changed)" if sides else None


def copied(x):
    """``x`` with fresh copies of its tensors (each call gets its own), each `guarded`."""
    if isinstance(x, torch.Tensor):
        return guarded(x)
    if isinstance(x, list):
        return [copied(item) for item in x]
    if isinstance(x, tuple):
        return tuple(copied(item) for item in x)
    if isinstance(x, dict):
        return {key: copied(item) for key, item in x.items()}
    return x


def same_bytes(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().cpu().contiguous().flatten().view(torch.uint8),
                       b.detach().cpu().contiguous().flatten().view(torch.uint8))


def gradients_of(returned, d_out, chosen):
    """backward() from ``returned`` with the upstream gradient(s) ``d_out``, as a training
    loop calls it; the gradients it left in ``chosen``."""
    if isinstance(d_out, (tuple, list)):
        pairs = [(r, d) for r, d in zip(returned, d_out) if d is not None]
    else:
        pairs = [(returned, d_out)]
    for r, _ in pairs:
        if not isinstance(r, torch.Tensor) or not r.requires_grad:
            raise RuntimeError("the output does not require grad: no gradient reaches "
                               "the query, key and value")
    torch.autograd.backward([r for r, _ in pairs], [d.to(r.dtype) for r, d in pairs])
    return tuple(t.grad for t in chosen)


def make_leaves(args, kwargs, names):
    """The arguments a gradient call differentiates made leaves that require grad:
    those ``names`` names (positions or keywords), else the query, key and value (and
    the sinks, where given); the leaves, in order."""
    chosen = []
    if not names:
        names = [0, 1, 2] + (["sinks"] if isinstance(kwargs.get("sinks"), torch.Tensor) else [])
    for name in names:
        box = kwargs if isinstance(name, str) else args
        box[name] = box[name].detach().requires_grad_(True)
        chosen.append(box[name])
    return chosen


@RUN@


class Hang(Exception):
    pass


class BugShows(Exception):
    """The bug showed as the message says (a rank of a call that failed)."""


def on_alarm(signum, frame):
    raise Hang()


#: where the child process notes each call it starts and ends (`isolated`)
MARKS = None
#: the backend's ``module:function``, and the index of the call it is making
BACKEND, CALL = SPEC, None


def mark(line):
    if MARKS is not None:
        os.write(MARKS, (line + "\n").encode())


def call(fn, record):
    """What the backend returns for one recorded call (with the arguments it may write,
    as it left them; for a gradient call, the gradients of its leaves, as a training
    loop's backward() leaves them), and the names of the arguments it changed though it
    may not."""
    args, kwargs = copied(list(record["args"])), copied(dict(record["kwargs"]))
    every = [(f"argument {i}", t) for i, t in enumerate(args) if isinstance(t, torch.Tensor)]
    every += [(f"{name}=", t) for name, t in kwargs.items() if isinstance(t, torch.Tensor)]
    writable = record.get("writable", [])
    kept = [(f"argument {i}", t, t.detach().clone()) for i, t in enumerate(args)
            if isinstance(t, torch.Tensor) and i not in writable]
    kept += [(f"{name}=", t, t.detach().clone()) for name, t in kwargs.items()
             if isinstance(t, torch.Tensor)]
    alarm = MARKS is None and hasattr(signal, "SIGALRM")  # in a child, its parent times it
    if alarm:
        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(int(TIMEOUT) + 1)
    try:
        returned = run(fn, args, kwargs, record)
    finally:
        if alarm:
            signal.alarm(0)
    past = [said for said in (overrun(name, t) for name, t in every) if said]
    if past:
        raise BugShows(f"it wrote outside its arguments' memory: {', '.join(past)}")
    changed = [name for name, t, before in kept if not same_bytes(t, before)]
    if writable:
        returned = (returned, tuple(args[i] for i in writable))
    return returned, changed


def plain_attention(inputs):
    """The float64 answer again in plain torch, from the inputs in (batch, heads, tokens,
    dim): scaled dot-product attention with GQA, a mask, the causal diagonal and a
    sliding window; None for the other variants."""
    if any(inputs.get(n) is not None for n in ("alibi_slopes", "sinks")) or inputs.get("softcap"):
        return None
    q, k, v = (inputs[n].double() for n in ("query", "key", "value"))
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = inputs["scale"] if inputs["scale"] is not None else q.shape[-1] ** -0.5
    scores = q @ k.transpose(-2, -1) * scale
    tq, tk = scores.shape[-2:]
    # query i sits at key position i (top left) or tk - tq + i (bottom right)
    causal, window = inputs["causal"], inputs["window"]
    at = torch.arange(tq)[:, None] + (0 if causal == "top_left" else tk - tq)
    keys = torch.arange(tk)[None, :]
    seen = torch.ones(tq, tk, dtype=torch.bool)
    if causal is not None:
        seen &= keys <= at
    if window is not None:
        left, right = window
        if left >= 0:
            seen &= keys >= at - left
        if right >= 0:
            seen &= keys <= at + right
    scores = scores.masked_fill(~seen, float("-inf"))
    mask = inputs["attn_mask"]
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.double()
    weights = torch.softmax(scores, -1).nan_to_num(0.0)  # a row that sees no key: 0
    return weights @ v


def compare(got, want, known, bound):
    """(worst element, its error, how many times its bound, what fails or None), judged
    as attnref judges: NaN or inf where a finite value is expected fails, as does any
    other value where the declared policy gives NaN or an infinity; then the largest and
    the mean error."""
    known = torch.ones_like(want, dtype=torch.bool) if known is None else known.expand_as(want)
    want_nan, got_bad = ~torch.isfinite(want) & known, ~torch.isfinite(got) & known
    same = (got == want) | (torch.isnan(want) & ~torch.isfinite(got))  # an infinity exactly
    for bad, why in ((got_bad & ~want_nan, "where a finite value is expected"),
                     (want_nan & ~same, "where the declared policy gives")):
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0])
            said = f"{float(got[at]):g} {why}"
            said += f" {float(want[at]):g}" if why.endswith("gives") else ""
            return at, float("inf"), float("inf"), f"{int(bad.sum())} elements: {said}"
    judged = known & ~want_nan
    n = int(judged.sum())
    if n == 0:
        return None, 0.0, 0.0, None
    error = torch.where(judged, (got - want).abs(), 0.0)
    at = tuple(int(i) for i in torch.unravel_index(error.argmax(), error.shape))
    big, mean = float(error.max()), float(error.sum()) / n
    times = max(big / bound[0] if bound[0] else float("inf") * big,
                mean / bound[1] if bound[1] else float("inf") * mean)
    verdict = None
    if big > bound[0] or mean > bound[1]:
        verdict = (f"max error {big:.3g} (bound {bound[0]:.3g}), mean error {mean:.3g} "
                   f"(bound {bound[1]:.3g})")
    return at, big, times, verdict


def form(x):
    """The form of a call's result: its types, and each tensor's shape and dtype."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), str(x.dtype))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(form(item) for item in x))
    return type(x).__name__


def malformed(returned, tensors, record):
    """What is wrong with a call's result where the audit knows a correct one's form
    (``well_formed``: it judged the backend's own malformed, or it failed): the audit's
    words where the result has the very form the audit judged malformed; else its
    tensors must begin with a correct one's shapes; None where it is well formed."""
    if record.get("malformed") and form(returned) == form(record["returned"]):
        return record["malformed"]
    shapes, want = [list(t.shape) for t in tensors], record["shapes"]
    if not record.get("well_formed") or not want:
        return None
    if record.get("d_out") is not None and isinstance(returned, tuple):
        names = record.get("leaves") or ["query", "key", "value", "sinks"]
        missing = [str(n) for n, g in zip(names, returned[:len(want)]) if g is None]
        if missing:
            return f"returned no gradient (None) for {', '.join(missing)}"
    if shapes[:len(want)] != want:
        what = f"tensors of shapes {shapes}" if tensors else f"a {type(returned).__name__}"
        return f"returned {what}; a correct call returns tensors of shapes {want} first"
    return None


def judge(backend):
    """Each judged answer of expected.pt against ``backend``'s on the same inputs: 0
    where all are within their bounds, 1 where the bug shows, 2 where nothing could be
    judged."""
    global BACKEND
    BACKEND = backend
    fn = resolve(backend)
    calls, expected = load("inputs.pt")["calls"], load("expected.pt")
    # what the audit judged, each a part of one call's result: (call, what, where it
    # lies in the result, expected values, which are known, bounds, the oracle's inputs)
    parts = []
    for oracle in expected["oracles"]:
        if oracle.get("call") is None:
            continue
        parts.append((oracle["call"], "output", oracle["where"], oracle["output"],
                      oracle["known"], oracle["bound"], oracle["inputs"], oracle.get("problem")))
        if oracle.get("lse_where") is not None and oracle.get("lse") is not None:
            parts.append((oracle["call"], "log-sum-exp", oracle["lse_where"], oracle["lse"],
                          oracle.get("lse_known"), oracle["lse_bound"], None, None))
    for answer in expected.get("answers", []):  # a family's own: a cache, max_logits
        if answer.get("where") is not None and answer.get("call") is not None:
            parts.append((answer["call"], answer["what"], answer["where"], answer["expected"],
                          answer["known"], answer["bound"], None, None))
    if not parts:
        print("no answer of expected.pt says where it lies in a call's result: inputs.pt "
              "and expected.pt hold the finding's tensors")
        return 2
    results, worst, failed = {}, None, []
    for i, what, where, want, known, bound, inputs, problem in parts:
        if i not in results:
            record = calls[i]
            global CALL
            CALL = i
            mark(f"call {i}")
            try:
                returned, changed = call(fn, record)
            except Hang:
                print(f"FAIL: the bug shows: call {i} gave no answer within {TIMEOUT:g} s")
                return 1
            except BugShows as e:
                print(f"FAIL: the bug shows: call {i}: {e}")
                return 1
            except BaseException as e:  # SystemExit and KeyboardInterrupt too: the backend's
                traceback.print_exc()
                print(f"FAIL: the bug shows: call {i} raised {type(e).__name__}: {e}")
                return 1
            mark(f"done {i}")
            if changed:
                print(f"FAIL: the bug shows: call {i} changed its inputs in place: "
                      f"{', '.join(changed)}")
                return 1
            tensors = leaves(returned)
            wrong = malformed(returned, tensors, record)
            if wrong:
                print(f"FAIL: the bug shows: call {i} {wrong}")
                return 1
            shapes = [list(t.shape) for t in tensors]
            if not record.get("well_formed") and shapes != record["shapes"]:
                print(f"call {i} returned tensors of shapes {shapes}; the call the audit "
                      f"judged returned {record['shapes']}: nothing of it is read here")
                results[i] = None
            else:
                results[i] = (torch.cat([t.detach().cpu().double().flatten() for t in tensors]
                                        or [torch.zeros(0, dtype=torch.float64)]), tensors)
        if results[i] is None:
            continue
        flat, tensors = results[i]
        if where is None:
            if problem:  # what the audit's call returned, the same again
                print(f"FAIL: the bug shows: call {i} {problem}")
                return 1
            continue
        due = calls[i].get("dtype")
        if due and what == "output" and where.numel():
            first, start = int(where.min()), 0
            for t in tensors:  # the tensor that holds the output
                if first < start + t.numel():
                    break
                start += t.numel()
            if str(t.dtype).removeprefix("torch.") != due:
                print(f"FAIL: the bug shows: call {i} returned its output in {t.dtype}, "
                      f"the query's dtype is {due}")
                return 1
        got = flat[where]
        at, big, times, verdict = compare(got, want, known, bound)
        if at is not None and (worst is None or times > worst[0]):
            worst = (times, i, what, at, float(got[at]), float(want[at]), big, bound)
        if verdict:
            failed.append(f"call {i}, {what}: {verdict}")
        again = plain_attention(inputs) if inputs is not None else None
        if again is not None and again.numel():
            gap = (again - want).abs().nan_to_num(0.0)
            if known is not None:
                gap = gap.masked_fill(~known.expand_as(gap), 0.0)
            print(f"call {i}: the float64 answer again in plain torch: "
                  f"{float(gap.max()):.3g} from expected.pt")
    if worst is None:
        print("no element of a call's answer could be compared")
        return 2
    times, i, what, at, got, want, big, bound = worst
    print(f"{backend} ({API} convention), call {i}, {what}, worst element {at}: "
          f"got {got:.9g}, expected {want:.9g} (float64); error {big:.3g}, bound "
          f"{bound[0]:.3g}")
    if failed:
        for line in failed:
            print(line)
        print("FAIL: the bug shows")
        return 1
    print("pass: within the bound")
    return 0


def isolated(work):
    """``work()``'s exit code, run in a child process: a call that kills the process,
    ends it or gives no answer within TIMEOUT seconds is the bug showing, with the call
    it was in (``mark``). The child's output is shown as it comes."""
    with tempfile.TemporaryFile() as output, tempfile.TemporaryFile() as marks:
        return supervised(work, output, marks)


def supervised(work, output, marks):
    global MARKS
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():  # torch's own threads: none takes part in the calls
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: everything it or the backend prints goes to `output`
        code = 2
        try:
            os.dup2(output.fileno(), 1)
            os.dup2(output.fileno(), 2)
            sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
            MARKS = marks.fileno()
            code = work()
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os.write(marks.fileno(), f"exit {code}\n".encode())
            os._exit(code)

    shown = 0

    def show():
        nonlocal shown
        while True:
            chunk = os.pread(output.fileno(), 1 << 16, shown)
            if not chunk:
                return
            shown += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))

    noted, since, status = b"", time.monotonic(), 0
    while True:
        show()
        done, status = os.waitpid(pid, os.WNOHANG)
        now = os.pread(marks.fileno(), 1 << 20, 0)
        if now != noted:
            noted, since = now, time.monotonic()
        if done:
            break
        last = noted.decode().splitlines()[-1:]
        # (5 s more than a call has: a call's own timer, where it has one, names more)
        if last and last[0].startswith("call ") and time.monotonic() - since > TIMEOUT + 5:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            show()
            print(f"FAIL: the bug shows: {last[0]} gave no answer within {TIMEOUT:g} s")
            return 1
        time.sleep(0.02)
    show()
    lines = noted.decode().splitlines()
    if lines and lines[-1].startswith("exit "):
        return int(lines[-1].split()[1])
    if os.WIFSIGNALED(status):
        how = f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        how = f"ended with exit code {os.WEXITSTATUS(status)}"
    if lines and lines[-1].startswith("call "):
        print(f"FAIL: the bug shows: during {lines[-1]}, the process {how}")
        return 1
    print(f"the process {how} before any call: nothing was judged")
    return 2


def main():
    global TIMEOUT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=SPEC, help="module:function to call")
    parser.add_argument("--timeout", type=float, default=TIMEOUT,
                        help="seconds a call may take before it is called a hang")
    parser.add_argument("--in-process", action="store_true",
                        help="run the calls in this process (a crash then ends it)")
    args = parser.parse_args()
    if not args.backend:
        print("the backend is attnref's own: inputs.pt and expected.pt hold the finding's "
              "tensors (torch.load(..., weights_only=True)); --backend module:function "
              "runs a function of yours on them")
        return 2
    TIMEOUT = args.timeout
    if args.in_process or not hasattr(os, "fork"):
        return judge(args.backend)
    return isolated(lambda: judge(args.backend))


if __name__ == "__main__":
    sys.exit(main())
'''
