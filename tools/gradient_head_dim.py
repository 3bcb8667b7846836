"""torch's CPU SDPA backward against the gradient bound at a long head dim, under the
score-rounding bound of today and the one before it.

    python tools/gradient_head_dim.py [--cases 12] [--head-dim 160]

The shape of the thorough seed-2 finding (docs/conformance.md, "Profiles"): 7 queries,
511 keys, float32, scores up to about 15. For each random case it prints dV's largest
error against float64 and the dV bound (the max bound of `expect_grads`) with the
score rounding of `attnref.tolerances.score_rounding`, ``(2 + sqrt(D)) u``, and with the
``2 u`` it replaced, and which gradients fail under each.
"""

import argparse

import torch

import attnref.conformance.oracle as oracle
from attnref.conformance.cases import Inputs
from attnref.conformance.verdicts import Failure
from attnref.tolerances import score_eps, score_rounding


def _before(dtype: torch.dtype, head_dim: int) -> float:
    """The score rounding the judge allowed before: ``2 u`` whatever the head dim."""
    return 2 * score_eps(dtype) / 2


def one(seed: int, D: int) -> list[tuple[str, float, float, list[str]]]:
    """(rule, dV's error, dV's max bound, the gradients that fail) for each rule."""
    g = torch.Generator().manual_seed(seed)
    h, Tq, Tk = 2, 7, 511
    q, k = (2.0 * torch.randn(1, h, n, D, generator=g) for n in (Tq, Tk))
    v, d_out = (torch.randn(1, h, n, D, generator=g) for n in (Tk, Tq))
    lq, lk, lv = (t.clone().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(lq, lk, lv)
    got = torch.autograd.grad(out, (lq, lk, lv), d_out)
    inputs = Inputs(q, k, v, None, None, None)
    rows = []
    for rule, fn in (("now", score_rounding), ("before", _before)):
        setattr(oracle, "score_rounding", fn)  # what expect_grads calls  # noqa: B010
        try:
            expected = oracle.expect_grads(inputs, d_out)
        finally:
            setattr(oracle, "score_rounding", score_rounding)  # noqa: B010
        failing = []
        for name, g_, e in zip(("dQ", "dK", "dV"), got, expected, strict=True):
            try:
                oracle.close(g_.double(), e.value, *e.bounds(), name)
            except Failure:
                failing.append(name)
        dv_err = float((got[2].double() - expected[2].value).abs().max())
        rows.append((rule, dv_err, expected[2].bounds()[0], failing))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=160)
    args = parser.parse_args()
    torch.set_num_threads(1)
    failed = {"now": 0, "before": 0}
    for seed in range(args.cases):
        rows = one(seed, args.head_dim)
        for rule, _, _, failing in rows:
            failed[rule] += bool(failing)
        text = "  ".join(f"{r}: bound {b:.2e} fails {f or '-'}" for r, _, b, f in rows)
        print(f"case {seed:2}  dV error {rows[0][1]:.2e}  {text}")
    print(f"cases failing: now {failed['now']}, before {failed['before']} of {args.cases}")


if __name__ == "__main__":
    main()
