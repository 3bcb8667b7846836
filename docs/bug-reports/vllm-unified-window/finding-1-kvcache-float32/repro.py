"""Reproduce: "wrong values (errors past what rounding makes) in rows that see keys (its smallest trigger needs a window)"

Written by attnref; runs without it: torch, the standard library and the backend's own
module. ``python repro.py`` exits 1 while the bug shows; ``python repro.py --backend
module:function`` runs another function (a fix, a reference) on the same inputs.

inputs.pt holds each call the audit made, its arguments exactly as the backend received
them; expected.pt each float64 answer it was judged against, with its bounds and where
that answer lies in what the call returns (the flat position of each element among the
tensors it returned, in order).
"""

import argparse
import importlib
import signal
import sys
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

# the audit ran this Triton kernel through Triton's interpreter on a CPU: so does this
# script where there is no GPU (set before the kernel's module is imported; on a GPU it
# runs natively). attnref's audit also patched the interpreter where its own check
# failed (REPORT.md says where); this script runs Triton as installed.
if not torch.cuda.is_available():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
SPEC = "examples.adapters.vllm_unified:unified"
API = "flash-kvcache"
#: seconds one call may take before it is called a hang
TIMEOUT = 600


def load(name):
    return torch.load(HERE / name, weights_only=True)


def leaves(x):
    """The tensors of ``x``, depth first through its tuples and lists."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in leaves(item)]
    return []


def copied(x):
    """``x`` with fresh copies of its tensors (each call gets its own)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
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


class Hang(Exception):
    pass


def on_alarm(signum, frame):
    raise Hang()


def call(fn, record):
    """What the backend returns for one recorded call (with the arguments it may write,
    as it left them; for a gradient call, the gradients of the query, key and value, as
    a training loop's backward() leaves them), and the names of the arguments it changed
    though it may not."""
    args, kwargs = copied(list(record["args"])), copied(dict(record["kwargs"]))
    writable = record.get("writable", [])
    d_out = record.get("d_out")
    if d_out is not None:  # the query, key and value become leaves
        args[:3] = [t.detach().requires_grad_(True) for t in args[:3]]
    kept = [(f"argument {i}", t, t.detach().clone()) for i, t in enumerate(args)
            if isinstance(t, torch.Tensor) and i not in writable]
    kept += [(f"{name}=", t, t.detach().clone()) for name, t in kwargs.items()
             if isinstance(t, torch.Tensor)]
    if hasattr(signal, "SIGALRM"):
        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(TIMEOUT)
    try:
        returned = fn(*args, **kwargs)
        if d_out is not None:
            if not isinstance(returned, torch.Tensor) or not returned.requires_grad:
                raise RuntimeError("the output does not require grad: no gradient reaches "
                                   "the query, key and value")
            torch.autograd.backward(returned, d_out)
            returned = tuple(t.grad for t in args[:3])
    finally:
        if hasattr(signal, "SIGALRM"):
            signal.alarm(0)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=SPEC, help="module:function to call")
    args = parser.parse_args()
    if not args.backend:
        print("the backend is attnref's own: inputs.pt and expected.pt hold the finding's "
              "tensors (torch.load(..., weights_only=True)); --backend module:function "
              "runs a function of yours on them")
        return 2
    module, _, name = args.backend.partition(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
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
            try:
                returned, changed = call(fn, record)
            except Hang:
                print(f"FAIL: the bug shows: call {i} gave no answer within {TIMEOUT} s")
                return 1
            except Exception as e:
                traceback.print_exc()
                print(f"FAIL: the bug shows: call {i} raised {type(e).__name__}: {e}")
                return 1
            if changed:
                print(f"FAIL: the bug shows: call {i} changed its inputs in place: "
                      f"{', '.join(changed)}")
                return 1
            tensors = leaves(returned)
            shapes = [list(t.shape) for t in tensors]
            if shapes != record["shapes"]:
                print(f"call {i} returned tensors of shapes {shapes}; the call the audit "
                      f"judged returned {record['shapes']}: nothing of it is read here")
                results[i] = None
            else:
                results[i] = torch.cat([t.detach().cpu().double().flatten() for t in tensors]
                                       or [torch.zeros(0, dtype=torch.float64)])
        flat = results[i]
        if flat is None:
            continue
        if where is None:
            if problem:  # what the audit's call returned, the same again
                print(f"FAIL: the bug shows: call {i} {problem}")
                return 1
            continue
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
    print(f"{args.backend} ({API} convention), call {i}, {what}, worst element {at}: "
          f"got {got:.9g}, expected {want:.9g} (float64); error {big:.3g}, bound "
          f"{bound[0]:.3g}")
    if failed:
        for line in failed:
            print(line)
        print("FAIL: the bug shows")
        return 1
    print("pass: within the bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
