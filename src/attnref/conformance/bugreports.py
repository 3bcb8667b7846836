"""Bug reports a library's maintainers can run without attnref (docs/reports.md).

A maintainer will not install a conformance suite to read a bug report. For each finding
of an audit, `write_bug_reports` writes a folder:

- ``inputs.pt``: each call of the finding's shrunk case, its arguments exactly as the
  backend received them and what it returned (`attnref.conformance.runner.check_case`'s
  ``save``, run again in a fresh worker);
- ``expected.pt``: each float64 answer of attnref's oracle for those calls, which
  elements it knows and its bounds;
- ``repro.py``: a script that imports only torch, the standard library and the
  backend's own module: it loads the inputs, calls the backend as the audit did, finds the
  call that disagrees most with its float64 answer, prints the observed and expected
  values at the worst element and the error against the bound, and exits 1 where the bug
  shows (0 where it does not: ``--backend module:function`` runs another function, the
  reference or a fix, on the same inputs). For torch SDPA's convention without variants it
  also computes the float64 answer again in a few lines of plain torch;
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

from attnref.conformance.report import AuditReport, PropertyResult
from attnref.devices import dtype_name

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
        (where / "repro.py").write_text(_repro(spec, report.api, title))
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

**Versions.** {_version(spec) if spec else "attnref's own backend"}; torch
{report.versions[1]}; Python {platform.python_version()} on {platform.platform()}; found
by attnref {report.versions[0]} (`attnref audit`, profile {report.profile}, seed
{report.seed}, property `{head.property}`).
"""


def _repro(spec: str, api: str, title: str) -> str:
    """repro.py's text: plain torch and the standard library, and the backend's module."""
    from attnref.conformance.family import get_family

    family = get_family(api)
    if family.repro_script is not None:  # a convention of its own (Convention.repro_script)
        return family.repro_script(json.dumps(title), json.dumps(spec), json.dumps(api))
    known = family.repro_layout  # its family's (Convention.repro_layout)
    layout = {"bhtd": "False", "bthd": "True"}.get(known, "None")
    return REPRO.format(title=json.dumps(title), spec=json.dumps(spec), api=json.dumps(api),
                        transposed=layout)  # fmt: skip


REPRO = '''"""Reproduce: {title}

Written by attnref; runs without it: torch, the standard library and the backend's own
module. ``python repro.py`` exits 1 while the bug shows; ``python repro.py --backend
module:function`` runs another function (a fix, a reference) on the same inputs.
"""

import argparse
import importlib
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SPEC = {spec}
API = {api}
#: the output's layout against the float64 answer's (B, h, T, D): False as it is, True
#: with its token and head dims swapped (FlashAttention's), None: not known here
TRANSPOSED = {transposed}


def load(name):
    return torch.load(HERE / name, weights_only=True)


def as_oracle(x):
    x = x[0] if isinstance(x, (tuple, list)) else x
    return x.transpose(-3, -2) if TRANSPOSED else x


def plain_sdpa(inputs):
    """The float64 answer again, in plain torch: torch SDPA's convention, no variants."""
    q, k, v = (inputs[n].double() for n in ("query", "key", "value"))
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = inputs["scale"] if inputs["scale"] is not None else q.shape[-1] ** -0.5
    scores = q @ k.transpose(-2, -1) * scale
    tq, tk = scores.shape[-2:]
    seen = torch.ones(tq, tk, dtype=torch.bool)
    if inputs["causal"] is not None:
        seen = seen.tril(tk - tq if inputs["causal"] == "bottom_right" else 0)
    scores = scores.masked_fill(~seen, float("-inf"))
    mask = inputs["attn_mask"]
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.double()
    weights = torch.softmax(scores, -1).nan_to_num(0.0)  # a row that sees no key: 0
    return weights @ v


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=SPEC, help="module:function to call")
    args = parser.parse_args()
    if not args.backend or TRANSPOSED is None:
        print("this finding's calls are not in a convention this script reads; inputs.pt "
              "and expected.pt hold its tensors (torch.load(..., weights_only=True))")
        return 2
    module, _, name = args.backend.partition(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    calls, oracles = load("inputs.pt")["calls"], load("expected.pt")["oracles"]
    worst = None
    for oracle in oracles:
        query = oracle["inputs"]["query"]
        for call in calls:
            q = call["args"][0]
            if not isinstance(q, torch.Tensor) or as_oracle(q).shape != query.shape:
                continue
            if not torch.equal(as_oracle(q), query):
                continue
            out = as_oracle(fn(*call["args"], **call["kwargs"])).detach().double()
            expected = oracle["output"]
            if out.shape != expected.shape:
                print(f"returned shape {{tuple(out.shape)}}, expected {{tuple(expected.shape)}}")
                return 1
            known = oracle["known"]
            every = torch.ones_like(expected, dtype=torch.bool)
            known = every if known is None else known.expand_as(expected)
            error = (out - expected).abs()
            error = error.masked_fill(out.isnan() & expected.isnan(), 0.0)  # NaN as declared
            error = error.nan_to_num(nan=torch.inf).masked_fill(~known, 0.0)
            big, at = float(error.max()), tuple(int(i) for i in (error == error.max()).nonzero()[0])
            if worst is None or big > worst[0]:
                worst = (big, at, out, expected, oracle)
    if worst is None:
        print("no call of inputs.pt matches an answer of expected.pt")
        return 2
    big, at, out, expected, oracle = worst
    bound = float(oracle["bound"][0])
    print(f"{{args.backend}} ({{API}} convention), worst element {{at}}: got "
          f"{{float(out[at]):.9g}}, expected {{float(expected[at]):.9g}} (float64); "
          f"error {{big:.3g}}, bound {{bound:.3g}}")
    plain = oracle["inputs"]
    variants = [plain[n] for n in ("window", "alibi_slopes", "sinks")]
    simple = all(x is None for x in variants) and not plain["softcap"]
    if API == "sdpa" and simple:
        again = plain_sdpa(plain)
        gap = (again - expected).abs().nan_to_num(0.0).max()
        print(f"the float64 answer again in plain torch: {{float(gap):.3g}} from expected.pt")
    if big > bound:
        print("FAIL: the bug shows")
        return 1
    print("pass: within the bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''
