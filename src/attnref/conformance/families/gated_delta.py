"""The ``gated-delta`` family: linear attention by the gated delta rule (Gated DeltaNet,
Qwen3-Next and Qwen3.5's linear layers), in flash-linear-attention's prefill convention
(docs/linear.md).

``fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
use_qk_l2norm_in_kernel=False, cu_seqlens=None) -> (o, final_state)``, as fla's
``chunk_gated_delta_rule``: ``q, k (B, T, H, K)``, ``v (B, T, HV, V)`` with ``HV`` a
multiple of ``H`` (GVA), ``g`` the log decay and ``beta`` the write strength ``(B, T,
HV)``, states ``(N, HV, K, V)`` (float32 for half-precision calls, as fla keeps them),
packed sequences by ``cu_seqlens`` (``N + 1`` offsets, ``B = 1``). Returns ``o`` like
``v`` and the final states (``None`` unless ``output_final_state``).

A call of this family holds no softmax: no dense case is one of its calls, and it is
audited by its own properties, each against the float64 recurrence
(`attnref.linear.gated_delta_rule`) on the very inputs the backend received. Each
property aims at a point of class 37: the output and the final state, the tails around
the chunk, a state handed from one call to the next, packed sequences, the gates at
their edges, GVA's head mapping, production sizes.

The bound (docs/linear.md, "How far a kernel may stray"): the audit rule of the rest of
attnref, ``max(floor, FUDGE * |reference in the call's precision - oracle|)``, the
reference there being the recurrence in float32 on the rounded inputs, its output
rounded to the call's dtype; the floor adds what a kernel that rounds the operands of
its matmuls to the inputs' dtype (fla's chunk kernels do: ``k * beta``, the WY factors,
the state before the output's dot) cannot avoid, ``4 u M sqrt(chunks)``, ``u`` the unit
roundoff of the dtype, ``M`` the largest of the values, outputs and states.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as tnf
from hypothesis import strategies as st
from jaxtyping import Float, Integer
from torch import Tensor

from attnref._checking import checked_internal
from attnref.conformance.calls import invoke
from attnref.conformance.cases import Case, Inputs
from attnref.conformance.checks import Context
from attnref.conformance.declarations import Backend, Capabilities
from attnref.conformance.families.flash import flash_back, flash_layout
from attnref.conformance.family import ApiFamily, Arguments
from attnref.conformance.jobs import Job
from attnref.conformance.mutants import Mutant
from attnref.conformance.oracle import Expected, close
from attnref.conformance.profiles import Profile
from attnref.conformance.properties import Property
from attnref.conformance.verdicts import Failure, Skip
from attnref.conformance.workloads import ServingCase, Workload, spread_lengths
from attnref.devices import DTYPES
from attnref.linear import chunked_gated_delta_rule, gated_delta_rule
from attnref.tolerances import FUDGE, TOLERANCES

__all__ = [
    "FAMILY",
    "FLA_CHUNK",
    "GdnCall",
    "build_call",
    "expected",
    "gdn_cases",
    "plain_gated_delta",
]

NAME = "gated-delta"
#: the class of every property here (docs/architecture.md's catalogue)
LINEAR = 37

#: what fla documents for ``chunk_gated_delta_rule``: every float dtype this family
#: audits, GVA, the in-kernel L2 norm, initial and final states, packed sequences, chunks
#: of 64; no gradients audited yet (docs/linear.md)
FLA_CHUNK = Capabilities(
    family=NAME,
    bool_mask=False,
    float_mask=False,
    causal_alignments=(),
    causal_with_mask=False,
    gradients=False,
    dropout=False,
    zero_head_dim=False,
    lse=False,
)


# ------------------------------------------------------------------ one call


@dataclass(frozen=True)
class GdnCall:
    """One call's tensors, as the backend receives them: ``q, k (B, T, H, K)``, ``v (B,
    T, HV, V)`` and ``beta (B, T, HV)`` in the call's dtype, ``g (B, T, HV)`` (KDA's:
    ``(B, T, HV, K)``) in float32 (float64 in a float64 call: a model computes its gate in
    float32), the initial states ``(N, HV, K, V)`` in the state dtype (float32 for half
    precision), and the offsets of a pack."""

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    scale: float | None
    initial_state: Tensor | None
    cu_seqlens: Tensor | None
    l2norm: bool

    @property
    def sequences(self) -> int:
        return self.q.shape[0] if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    def part(self, start: int, end: int, initial: Tensor | None) -> "GdnCall":
        """Tokens ``start:end`` of each batch row, from ``initial``."""
        if self.cu_seqlens is not None:
            raise ValueError("a pack is not cut into parts")
        q, k, v, g, beta = (x[:, start:end] for x in (self.q, self.k, self.v, self.g, self.beta))
        return GdnCall(q, k, v, g, beta, self.scale, initial, None, self.l2norm)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The states' dtype of a call in ``dtype``: float32 for half precision (fla's)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _gate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def build_call(case: Case, dtype: torch.dtype, device: str, caps: Capabilities) -> GdnCall:
    """The call ``case`` describes: ``case.batch`` rows of ``case.Tq`` tokens (or one row
    packing ``case.seqlens``), ``case.g`` query/key heads, ``case.h`` value heads,
    ``K = case.Dh``, ``V = case.Dv``; the gates one a value head, or one a key channel
    where ``caps.linear_gate`` is ``"key"`` (KDA). Options: ``l2norm``; ``initial`` (random initial
    states); ``gate`` (``normal``: ``logsigmoid`` of a normal, a decay near 1; ``zero``;
    ``far``: a quarter of the tokens forget everything, ``-50`` to ``-1e4``;
    ``underflow``: ``-20`` to ``-40`` each token, so a chunk's running sum passes
    float32's smallest exp; ``neg_inf``: a quarter ``-inf``); ``beta`` (``random``,
    ``zero``, ``one``, ``edges``: each token 0, 1 or random); ``keys`` (``unit``: near
    unit norm, or L2-normed in the kernel; ``far``: norms from ``1e-3`` to ``1e3``,
    L2-normed in the kernel)."""
    gen = torch.Generator().manual_seed(case.seed)
    l2 = bool(case.option("l2norm", False))
    H, HV, K, V = case.g, case.h, case.Dh, case.Dv
    if case.seqlens:
        B, T = 1, sum(t for t, _ in case.seqlens)
        offsets = [0]
        for t, _ in case.seqlens:
            offsets.append(offsets[-1] + t)
        cu: Tensor | None = torch.tensor(offsets, dtype=torch.long)
    else:
        B, T, cu = (case.batch[0] if case.batch else 1), case.Tq, None
    N = B if cu is None else len(case.seqlens)
    f64 = torch.float64
    q = case.amp * torch.randn((B, T, H, K), generator=gen, dtype=f64)
    k = torch.randn((B, T, H, K), generator=gen, dtype=f64)
    keys = case.option("keys", "unit")
    if keys == "far":  # norms far from 1: only the kernel's own L2 norm makes them unit
        k = k * 10.0 ** (6 * torch.rand((B, T, H, 1), generator=gen, dtype=f64) - 3)
        q = q * 10.0 ** (6 * torch.rand((B, T, H, 1), generator=gen, dtype=f64) - 3)
    elif not l2:  # a model normalizes its keys first: norms 0.5 to 1.2 keep it stable
        k = tnf.normalize(k, dim=-1) * (0.5 + 0.7 * torch.rand((B, T, H, 1), generator=gen))
    v = torch.randn((B, T, HV, V), generator=gen, dtype=f64) + case.v_offset
    gates = (B, T, HV, K) if caps.linear_gate == "key" else (B, T, HV)
    g = tnf.logsigmoid(1.5 * torch.randn(gates, generator=gen, dtype=f64) + 2.0)
    some = torch.rand(gates, generator=gen) < 0.25
    gate = case.option("gate", "normal")
    if gate == "zero":
        g = torch.zeros_like(g)
    elif gate == "far":
        far = -(10.0 ** (1.7 + 2.3 * torch.rand(gates, generator=gen, dtype=f64)))
        g = torch.where(some, far, g)
    elif gate == "underflow":
        g = -20.0 - 20.0 * torch.rand(gates, generator=gen, dtype=f64)
    elif gate == "neg_inf":
        g = g.masked_fill(some, -math.inf)
    beta = torch.sigmoid(torch.randn((B, T, HV), generator=gen, dtype=f64))
    edge = case.option("beta", "random")
    if edge == "zero":
        beta = torch.zeros_like(beta)
    elif edge == "one":
        beta = torch.ones_like(beta)
    elif edge == "edges":
        pick = torch.randint(3, (B, T, HV), generator=gen)
        beta = torch.where(pick == 0, 0.0, torch.where(pick == 1, 1.0, beta))
    initial = None
    if case.option("initial", True):
        initial = 0.5 * torch.randn((N, HV, K, V), generator=gen, dtype=f64)
    return GdnCall(
        q.to(device, dtype),
        k.to(device, dtype),
        v.to(device, dtype),
        g.to(device, _gate_dtype(dtype)),
        beta.to(device, dtype),
        case.scale,
        None if initial is None else initial.to(device, state_dtype(dtype)),
        None if cu is None else cu.to(device),
        l2,
    )


# ------------------------------------------------------------------- the oracle


def _gates(g: Tensor) -> dict[str, Tensor]:
    """``g`` as `attnref.linear`'s functions take it: ``g`` one a value head (``(B, T,
    HV)``), ``gk`` one a key channel (KDA's ``(B, T, HV, K)``)."""
    return {"g": g} if g.dim() == 3 else {"g": None, "gk": g}  # type: ignore[dict-item]


def _run(call: GdnCall, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The recurrence on ``call``'s tensors as given, computed in ``dtype``."""
    s0 = call.initial_state
    return gated_delta_rule(
        call.q.cpu().to(dtype), call.k.cpu().to(dtype), call.v.cpu().to(dtype),
        beta=call.beta.cpu().to(dtype), scale=call.scale, **_gates(call.g.cpu().to(dtype)),
        initial_state=None if s0 is None else s0.cpu().to(dtype), l2norm_qk=call.l2norm,
        cu_seqlens=None if call.cu_seqlens is None else call.cu_seqlens.cpu(),
    )  # fmt: skip


def _running_sums(g: Tensor, chunk: int = 64) -> float:
    """The largest finite running sum of the log decays ``g (B, T, HV)`` (or ``(B, T, HV,
    K)``) over a chunk of ``chunk`` tokens from its start (what a chunked kernel forms its
    decays from)."""
    g = g.detach().cpu().double().flatten(2)
    T = g.shape[1]
    pad = (-T) % chunk
    gp = torch.nn.functional.pad(g, (0, 0, 0, pad))
    runs = gp.reshape(g.shape[0], -1, chunk, g.shape[2]).cumsum(2)
    finite = runs[torch.isfinite(runs)].abs()
    return float(finite.max()) if finite.numel() else 0.0


@dataclass(frozen=True)
class GdnExpected:
    """The oracle of one call: its output and final states, each with its bound."""

    output: Expected
    state: Expected


def expected(call: GdnCall) -> GdnExpected:
    """The float64 recurrence on ``call``'s rounded inputs, and the bounds (the module
    docstring): the reference's error in the call's precision times `FUDGE`, at least
    the floor."""
    dtype = call.q.dtype
    o64, s64 = _run(call, torch.float64)
    if dtype == torch.float64:
        o_ref, s_ref = o64, s64
    else:
        o32, s32 = _run(call, torch.float32)
        o_ref, s_ref = o32.to(dtype).double(), s32.to(state_dtype(dtype)).double()
    u = torch.finfo(dtype).eps / 2
    chunks = max(1, -(-call.q.shape[1] // 64))
    finite = [x[torch.isfinite(x)].abs() for x in (o64, s64, call.v.cpu().double())]
    M = max([1.0] + [float(x.max()) for x in finite if x.numel()])
    # a chunked kernel sums the log decays in float32 (its compute precision): a decay
    # exp(G_i - G_j) formed from running sums of size |G| is off by u_c |G| relative
    u_c = torch.finfo(_gate_dtype(dtype)).eps / 2
    gates = u_c * _running_sums(call.g) * M
    floor = TOLERANCES[dtype].atol + 4 * u * M * math.sqrt(chunks) + 4 * gates
    s_floor = TOLERANCES[state_dtype(dtype)].atol + 4 * u * M * math.sqrt(chunks) + 4 * gates
    return GdnExpected(
        Expected(o64, (o_ref - o64).abs(), floor, FUDGE),
        Expected(s64, (s_ref - s64).abs(), s_floor, FUDGE),
    )


# ------------------------------------------------------------------ calling it


def arguments(call: GdnCall, final: bool = True) -> Arguments:
    """fla's call for ``call``: the five tensors, and the keywords (only those a
    default would not give, so that a backend taking fewer keywords runs what it can)."""
    kwargs: dict[str, Any] = {"scale": call.scale, "output_final_state": final}
    if call.initial_state is not None:
        kwargs["initial_state"] = call.initial_state
    if call.l2norm:
        kwargs["use_qk_l2norm_in_kernel"] = True
    if call.cu_seqlens is not None:
        kwargs["cu_seqlens"] = call.cu_seqlens
    return (call.q, call.k, call.v, call.g, call.beta), kwargs


def _declared(caps: Capabilities, call: GdnCall) -> None:
    """`Skip` for a call outside the declaration (a property's derived call)."""
    if call.l2norm and not caps.qk_l2norm:
        raise Skip("use_qk_l2norm_in_kernel not declared (qk_l2norm)")
    if call.scale is not None and not caps.explicit_scale:
        raise Skip("an explicit scale not declared (explicit_scale)")
    if call.cu_seqlens is not None and not caps.linear_packed:
        raise Skip("packed sequences (cu_seqlens) not declared (linear_packed)")
    if call.q.dtype not in caps.dtypes:
        raise Skip(f"{call.q.dtype} not declared")


def _run_call(ctx: Context, call: GdnCall, exp: GdnExpected | None = None) -> tuple[Tensor, Tensor]:
    """The backend's ``(o, final_state)`` for ``call``, checked for type and shape, as
    float64 (a wrong shape or type is a `Failure` naming what was expected). ``exp``:
    what the call is judged against, kept for a bug report where the call fails (its
    repro.py then calls it again and sees it fail)."""
    _declared(ctx.caps, call)
    args, kwargs = arguments(call)
    try:
        raw = invoke(ctx.backend, Job(args, kwargs), ctx.timeout, ctx.executor)
        return _read_pair(raw, call)
    except Failure:
        if exp is not None:
            _answer(ctx, exp)
        raise


def _read_pair(raw: object, call: GdnCall) -> tuple[Tensor, Tensor]:
    """``(o, final_state)`` out of what a backend returned for ``call``, as float64."""
    if not isinstance(raw, tuple | list) or len(raw) != 2:
        raise Failure(
            f"chunk_gated_delta_rule returns (o, final_state), returned {type(raw).__name__}"
        )
    o, final = raw
    want_o = tuple(call.v.shape)
    want_s = (call.sequences, call.v.shape[2], call.k.shape[3], call.v.shape[3])
    for name, x, want in (("o", o, want_o), ("final_state", final, want_s)):
        if not isinstance(x, Tensor):
            raise Failure(f"returned {name} of type {type(x).__name__}, expected a tensor")
        if tuple(x.shape) != want:
            raise Failure(f"returned {name} of shape {tuple(x.shape)}, expected {want}")
    assert isinstance(o, Tensor)
    assert isinstance(final, Tensor)
    if o.dtype != call.v.dtype:
        raise Failure(f"returned o in {o.dtype}, expected {call.v.dtype} (the values' dtype)")
    return o.detach().cpu().double(), final.detach().cpu().double()


def _judge_states(
    ctx: Context, got_o: Tensor, got_s: Tensor, exp: GdnExpected, what: str,
    o_sel: Tensor | None = None,
) -> None:  # fmt: skip
    """``got_o`` and ``got_s`` (of the backend's last call) within ``exp``'s bounds
    (`close`), named by ``what``; kept for a bug report (`Context.answer`)."""
    _answer(ctx, exp, o_sel)
    close(got_o, exp.output.value, *exp.output.bounds(o_sel), f"{what}: output", o_sel)
    close(got_s, exp.state.value, *exp.state.bounds(), f"{what}: final state")


def _answer(ctx: Context, exp: GdnExpected, o_sel: Tensor | None = None) -> None:
    """Keep what the backend's last call is judged against, for a bug report."""
    ctx.answer(output=exp.output.value, state=exp.state.value,
               output_bound=exp.output.bounds(o_sel), state_bound=exp.state.bounds())  # fmt: skip


# --------------------------------------------------------------- the properties


def _forward(ctx: Context, case: Case) -> None:
    """Output and final states of one call against the float64 recurrence."""
    call = build_call(case, ctx.dtype, ctx.device, ctx.caps)
    exp = expected(call)
    o, s = _run_call(ctx, call, exp)
    _judge_states(ctx, o, s, exp, _named(call))


def _named(call: GdnCall) -> str:
    B, T, H, K = call.q.shape
    HV, V = call.v.shape[2:]
    pack = "" if call.cu_seqlens is None else f", {call.sequences} packed sequences"
    kda = ", KDA's decay a key channel" if call.g.dim() == 4 else ""
    return f"B {B}, T {T}, H {H}, HV {HV}, K {K}, V {V}{pack}{kda}"


def _continuation(ctx: Context, case: Case) -> None:
    """A sequence cut at ``split``: the first part's output and final state, then the
    second part from that state (the oracle's, in the state dtype: the hand-off a
    prefill gives a decode step or the next chunk of a chunked prefill)."""
    whole = build_call(case, ctx.dtype, ctx.device, ctx.caps)
    T = whole.q.shape[1]
    s = min(max(1, int(case.option("split", T // 2))), T - 1)
    first = whole.part(0, s, whole.initial_state)
    exp1 = expected(first)
    o1, s1 = _run_call(ctx, first, exp1)
    _judge_states(ctx, o1, s1, exp1, f"tokens 0:{s} of {T}")
    handed = exp1.state.value.to(state_dtype(ctx.dtype)).to(ctx.device)
    second = whole.part(s, T, handed)
    exp2 = expected(second)
    o2, s2 = _run_call(ctx, second, exp2)
    _judge_states(ctx, o2, s2, exp2, f"tokens {s}:{T} of {T}, from the state at {s}")


def _gva(ctx: Context, case: Case) -> None:
    """Value heads sharing query/key heads (``HV = r H``): against the oracle, and equal
    to the call with each query/key head repeated for its ``r`` value heads."""
    call = build_call(case, ctx.dtype, ctx.device, ctx.caps)
    exp = expected(call)
    o, s = _run_call(ctx, call, exp)
    _judge_states(ctx, o, s, exp, _named(call))
    r = call.v.shape[2] // call.q.shape[2]
    wide = replace(call, q=call.q.repeat_interleave(r, 2), k=call.k.repeat_interleave(r, 2))
    ow, sw = _run_call(ctx, wide)
    close(o, ow, *exp.output.bounds(), f"{_named(call)}: output against HV = H (the heads "
          "repeated)", law=exp.output.value, names=("GVA", "heads repeated"))  # fmt: skip
    close(s, sw, *exp.state.bounds(), f"{_named(call)}: final state against HV = H (the "
          "heads repeated)", law=exp.state.value, names=("GVA", "heads repeated"))  # fmt: skip


#: the gradients a gradient call returns, in its leaves' order (`_gradient`)
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _grads(
    call: GdnCall, d_o: Tensor, d_s: Tensor | None, dtype: torch.dtype
) -> tuple[Tensor, ...]:
    """The recurrence's gradients for ``call`` in ``dtype`` (backward from ``d_o`` on
    the output and ``d_s`` on the final states): ``dq, dk, dv, dg, dbeta`` and, with an
    initial state, ``dh0``, each in its argument's shape."""
    tensors = [call.q, call.k, call.v, call.g, call.beta]
    if call.initial_state is not None:
        tensors.append(call.initial_state)
    leaves = [x.detach().cpu().to(dtype).requires_grad_(True) for x in tensors]
    q, k, v, g, beta = leaves[:5]
    o, s = gated_delta_rule(
        q, k, v, beta=beta, **_gates(g), scale=call.scale, l2norm_qk=call.l2norm,
        initial_state=leaves[5] if len(leaves) > 5 else None,
        cu_seqlens=None if call.cu_seqlens is None else call.cu_seqlens.cpu(),
    )  # fmt: skip
    outs, ups = [o], [d_o.cpu().to(dtype)]
    if d_s is not None:
        outs.append(s)
        ups.append(d_s.cpu().to(dtype))
    return torch.autograd.grad(outs, leaves, ups)


def _expected_grads(call: GdnCall, d_o: Tensor, d_s: Tensor | None) -> tuple[Expected, ...]:
    """The float64 recurrence's gradients for ``call`` (`_grads`), each with its bound:
    the audit rule (`expected`'s), the reference there being the recurrence's backward
    in float32 on the rounded inputs, each gradient rounded to its argument's dtype; the
    floor adds ``8 u M sqrt(chunks)`` (twice the forward's: a backward rounds the
    operands of its dots twice over), ``u`` the unit roundoff of the call's dtype and
    ``M`` the largest of that gradient, and what forming decays from a chunk's running
    sums in float32 costs (docs/linear.md)."""
    dtype = call.q.dtype
    g64 = _grads(call, d_o, d_s, torch.float64)
    if dtype == torch.float64:
        low = g64
    else:
        g32 = _grads(call, d_o, d_s, torch.float32)
        dtypes = [x.dtype for x in (call.q, call.k, call.v, call.g, call.beta)]
        if call.initial_state is not None:
            dtypes.append(call.initial_state.dtype)
        low = tuple(x.to(d).double() for x, d in zip(g32, dtypes, strict=True))
    chunks = max(1, -(-call.q.shape[1] // 64))
    u, u_c = torch.finfo(dtype).eps / 2, torch.finfo(_gate_dtype(dtype)).eps / 2
    sums = _running_sums(call.g)
    found = []
    for exact, near, leaf in zip(g64, low, (call.q, call.k, call.v, call.g, call.beta,
                                            call.initial_state), strict=False):  # fmt: skip
        assert leaf is not None
        finite = exact[torch.isfinite(exact)].abs()
        M = max(1.0, float(finite.max()) if finite.numel() else 0.0)
        # twice the forward's rounding: a backward's dots take rounded operands twice
        # over (the forward's factors it recomputes, then the upstream gradients)
        floor = (TOLERANCES[leaf.dtype].atol + 8 * u * M * math.sqrt(chunks)
                 + 4 * u_c * sums * M)  # fmt: skip
        found.append(Expected(exact, (near - exact).abs(), floor, FUDGE))
    return tuple(found)


def _gradient(ctx: Context, case: Case) -> None:
    """The backward of one call, as a training step makes it: an upstream gradient on
    the output (and, with ``d_state``, on the final states), ``q, k, v, g, beta`` and the
    initial states leaves; each gradient against the float64 recurrence's."""
    call = build_call(case, ctx.dtype, ctx.device, ctx.caps)
    _declared(ctx.caps, call)
    gen = torch.Generator().manual_seed(case.seed + 1)
    d_o = torch.randn(call.v.shape, generator=gen, dtype=torch.float64)
    d_o = d_o.to(ctx.device, ctx.dtype)
    d_s = None
    if case.option("d_state", True):
        shape = (call.sequences, call.v.shape[2], call.k.shape[3], call.v.shape[3])
        d_s = torch.randn(shape, generator=gen, dtype=torch.float64)
        d_s = d_s.to(ctx.device, state_dtype(ctx.dtype))
    args, kwargs = arguments(call)
    leaves: tuple[int | str, ...] = (0, 1, 2, 3, 4)
    if call.initial_state is not None:
        leaves += ("initial_state",)
    job = Job(args, kwargs, (d_o, d_s), leaves=leaves)

    def answer(exp: tuple[Expected, ...]) -> None:  # for a bug report, failed or not
        ctx.answer(
            grads={n: e.value for n, e in zip(GRADS, exp, strict=False)},
            grad_bounds={n: e.bounds() for n, e in zip(GRADS, exp, strict=False)},
        )

    try:
        got = invoke(ctx.backend, job, ctx.timeout, ctx.executor)
    except Failure:
        answer(_expected_grads(call, d_o, d_s))
        raise
    exp = _expected_grads(call, d_o, d_s)
    answer(exp)
    if not isinstance(got, tuple) or len(got) != len(leaves):
        raise Failure(f"the backward returned {type(got).__name__}, expected {len(leaves)} "
                      "gradients")  # fmt: skip
    upstream = "the output's and the final states'" if d_s is not None else "the output's"
    what = f"{_named(call)}, backward from {upstream} gradients"
    for name, grad, e in zip(GRADS, got, exp, strict=False):
        if grad is None:
            raise Failure(f"{what}: {name} is None: no gradient reaches it")
        if tuple(grad.shape) != tuple(e.value.shape):
            raise Failure(f"{what}: {name} has shape {tuple(grad.shape)}, expected "
                          f"{tuple(e.value.shape)}")  # fmt: skip
        close(grad.detach().cpu().double(), e.value, *e.bounds(), f"{what}: {name}")


def _gradient_cases(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
    """`_gradient`'s calls: unpacked ones, and packed ones where declared."""
    pins: dict[str, Any] = {"d_state": st.booleans()}
    unpacked = gdn_cases("gdn_gradient", **pins)(p, c)
    if not c.linear_packed:
        return unpacked
    return st.one_of(unpacked, gdn_cases("gdn_gradient", packed=True, **pins)(p, c))


def _heads(c: Capabilities) -> st.SearchStrategy[tuple[int, int]]:
    """(H, HV): one to three query/key heads, value heads a multiple (with ``gqa``)."""
    ratios = (1, 2, 4) if c.gqa else (1,)
    return st.tuples(st.integers(1, 3), st.sampled_from(ratios)).map(lambda x: (x[0], x[0] * x[1]))


def _dims(c: Capabilities) -> st.SearchStrategy[tuple[int, int]]:
    """(K, V): among the declared head dims, or small powers of two and odd sizes."""
    if c.head_dims:
        return st.tuples(st.sampled_from(c.head_dims), st.sampled_from(c.head_dims))
    dims = st.sampled_from(
        tuple(d for d in (8, 16, 32, 64, 12) if c.max_head_dim is None or d <= c.max_head_dim)
    )
    return st.tuples(dims, dims)


def _chunk(c: Capabilities) -> int:
    return c.linear_chunk if c.linear_chunk > 0 else 64


def _lengths(c: Capabilities, longest: int) -> st.SearchStrategy[int]:
    """Lengths from 1 to ``longest``, half of them one off a chunk boundary."""
    ch = _chunk(c)
    tails = sorted({n for b in (ch, 2 * ch) for n in (b - 1, b, b + 1) if 1 <= n <= longest})
    if not tails:
        return st.integers(1, longest)
    return st.one_of(st.integers(1, longest), st.sampled_from(tails))


def gdn_cases(
    name: str, *, packed: bool = False, **pins: Any
) -> Callable[[Profile, Capabilities], st.SearchStrategy[Case]]:
    """Calls of the family: ``pins`` fix a field or option to a strategy (``T``,
    ``heads``, ``gate``, ``beta``, ``keys``, ``l2norm``, ``initial``, ``split``,
    ``d_state``)."""

    def cases(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
        ch = _chunk(c)

        @st.composite
        def draw(d: st.DrawFn) -> Case:
            H, HV = d(pins.get("heads", _heads(c)))
            K, V = d(_dims(c))
            l2 = d(pins.get("l2norm", st.booleans())) and c.qk_l2norm
            opts: dict[str, Any] = {
                "l2norm": l2,
                "initial": d(pins.get("initial", st.booleans())),
                "gate": d(pins.get("gate", st.just("normal"))),
                "beta": d(pins.get("beta", st.just("random"))),
                "keys": d(pins.get("keys", st.just("unit"))) if l2 else "unit",
            }
            if "d_state" in pins:
                opts["d_state"] = d(pins["d_state"])
            if opts["gate"] == "neg_inf" and not c.gate_neg_inf:
                opts["gate"] = "far"
            seqlens: tuple[tuple[int, int], ...] = ()
            batch: tuple[int, ...] = (d(st.integers(1, 2)),)
            if packed:
                lens = d(st.lists(st.one_of(st.just(1), _lengths(c, 2 * ch + 3)),
                                  min_size=2, max_size=5))  # fmt: skip
                seqlens, batch, T = tuple((n, n) for n in lens), (1,), sum(lens)
            else:
                # a recurrence costs linearly in T: the softmax profiles' max_len (40 at
                # quick) would leave out every chunk boundary
                T = d(pins.get("T", _lengths(c, 2 * ch + 3)))
            if "split" in pins:
                T = max(T, 2)
                opts["split"] = d(st.one_of(st.integers(1, T - 1), st.sampled_from(
                    [s for s in (ch - 1, ch, ch + 1, T - 1) if 1 <= s < T])))  # fmt: skip
            return fit_work(Case(
                name, batch=batch, h=HV, g=H, Tq=T, Tk=T, Dh=K, Dv=V,
                scale=d(st.sampled_from((None, 0.3, 1.0))) if c.explicit_scale else None,
                seed=d(st.integers(0, 2**16)),
                seqlens=seqlens, amp=1.0, options=tuple(opts.items()),
            ), c.max_call_work, gva="heads" in pins)  # fmt: skip

        return draw()

    return cases


def linear_work(case: Case) -> int:
    """What a call of ``case`` costs a recurrence: ``batch * T * HV * K * V``."""
    B = case.batch[0] if case.batch else 1
    return B * case.Tq * case.h * case.Dh * case.Dv


def fit_work(case: Case, budget: int, gva: bool = False) -> Case:
    """``case`` within ``budget`` (`linear_work`; 0: any), its lengths kept (they are
    what the tails and packs test): one batch row, then no GVA, one head, then head dims
    of 16 (``gva``: one query/key head with its value heads, the ratio kept). An
    interpreted kernel costs per program (a batch row and value head) and per chunk, so
    the lengths stay and the programs go first."""
    heads: tuple[dict[str, Any], ...] = (
        ({"h": case.h // case.g, "g": 1},) if gva else ({"h": case.g}, {"h": 1, "g": 1})
    )
    steps: tuple[dict[str, Any], ...] = (
        {"batch": (1,)} if not case.seqlens else {},
        *heads,
        {"Dh": min(case.Dh, 16), "Dv": min(case.Dv, 16)},
    )
    for step in steps:
        if not budget or linear_work(case) <= budget:
            break
        case = replace(case, **step)
    return case


def _production(p: Profile, c: Capabilities) -> list[Case]:
    """Qwen3-Next's linear layers (16 query/key heads, 32 value heads, K = V = 128, the
    L2 norm in the kernel) over a pack of three sequences, one past a thousand tokens;
    fitted to the declared head dims and a kernel's cost bound."""
    K = 128 if not c.head_dims or 128 in c.head_dims else max(c.head_dims)
    H, HV = (16, 32) if c.gqa else (16, 16)
    lens = ((1030, 1030), (65, 65), (1, 1))
    work = sum(n for n, _ in lens) * HV * K * K
    if c.max_call_work and work > c.max_call_work:
        return []
    opts = (("l2norm", c.qk_l2norm), ("initial", True), ("gate", "normal"))
    return [Case("gdn_qwen3_next", batch=(1,), h=HV, g=H, Tq=1096, Tk=1096, Dh=K, Dv=K,
                 seqlens=lens if c.linear_packed else (), options=opts, seed=37)]  # fmt: skip


def requiring(flag: str, what: str) -> Callable[[Capabilities], str | None]:
    """A property's `Property.requires`: ``what`` not declared unless ``flag`` is."""

    def requires(c: Capabilities) -> str | None:
        return None if getattr(c, flag) else f"{what} not declared ({flag})"

    return requires


_FAM = (NAME,)
PROPERTIES: tuple[Property, ...] = (
    Property(
        "gdn_forward",
        "the output and final states of a gated delta rule call (GVA, the L2 norm, "
        "initial states, an explicit scale) agree with the float64 recurrence",
        (LINEAR,),
        gdn_cases("gdn_forward"),
        _forward,
        examples=_production,
        families=_FAM,
    ),
    Property(
        "gdn_tails",
        "lengths one below, at and one above the chunk and twice it: the last, partial "
        "chunk's outputs and its share of the final state",
        (LINEAR, 12),
        gdn_cases(
            "gdn_tails", T=st.sampled_from((1, 63, 64, 65, 127, 128, 129)), initial=st.just(True)
        ),
        _forward,
        families=_FAM,
    ),
    Property(
        "gdn_continuation",
        "a sequence cut anywhere (inside a chunk, at its edge): the first part's final "
        "state handed to the second as its initial state gives the whole call's outputs "
        "and state (the prefill-to-decode hand-off)",
        (LINEAR,),
        gdn_cases("gdn_continuation", split=st.just(True)),
        _continuation,
        families=_FAM,
    ),
    Property(
        "gdn_packed",
        "packed sequences (cu_seqlens), one-token ones and boundaries inside a chunk: each "
        "starts from its own initial state, no state or gate crosses a boundary, each "
        "final state is its own",
        (LINEAR, 26),
        gdn_cases("gdn_packed", packed=True, initial=st.just(True)),
        _forward,
        requires=requiring("linear_packed", "packed sequences (cu_seqlens)"),
        families=_FAM,
    ),
    Property(
        "gdn_gates",
        "gates at their edges: a decay far below 0 (forgets everything before it), a "
        "running sum that underflows a chunk's exp in float32, no decay, beta 0 and 1, "
        "keys far from unit norm under the in-kernel L2 norm",
        (LINEAR, 33),
        gdn_cases(
            "gdn_gates",
            gate=st.sampled_from(("far", "underflow", "zero", "neg_inf", "normal")),
            beta=st.sampled_from(("edges", "zero", "one", "random")),
            keys=st.sampled_from(("far", "unit")),
        ),
        _forward,
        families=_FAM,
    ),
    Property(
        "gdn_gva",
        "value heads sharing a query/key head (HV = 2 H or 4 H): value head j reads "
        "head j // (HV / H), the same as the heads repeated",
        (LINEAR, 6),
        gdn_cases(
            "gdn_gva",
            heads=st.tuples(st.integers(1, 3), st.sampled_from((2, 4))).map(
                lambda x: (x[0], x[0] * x[1])
            ),
        ),
        _gva,
        requires=requiring("gqa", "GVA (HV a multiple of H)"),
        families=_FAM,
    ),
    Property(
        "gdn_gradient",
        "the backward of a call (dq, dk, dv, dg, dbeta and the initial states' gradient, "
        "from the output's and the final states' upstream gradients), packed or not, "
        "agrees with the float64 recurrence's",
        (LINEAR, 11, 12),
        _gradient_cases,
        _gradient,
        requires=requiring("gradients", "gradients"),
        gradient=True,
        families=_FAM,
    ),
)


# ----------------------------------------------- built-ins and the mutants' kernel


@checked_internal
def plain_gated_delta(
    q: Float[Tensor, "B T H K"], k: Float[Tensor, "B T H K"], v: Float[Tensor, "B T HV V"],
    g: Float[Tensor, "B T HV *channels"], beta: Float[Tensor, "B T HV"],
    scale: float | None = None, initial_state: Float[Tensor, "N HV K V"] | None = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Integer[Tensor, " N1"] | None = None,
    *, bugs: frozenset[str] = frozenset(), chunk: int = 64,
) -> tuple[Float[Tensor, "B T HV V"], Float[Tensor, "_ HV K V"] | None]:  # fmt: skip
    """The gated delta rule written apart from `attnref.linear`, token by token in chunks
    of ``chunk`` as a kernel walks them, in float32 (float64 for float64 inputs); the
    host of the mutants, each of ``bugs`` one point of class 37 (``g`` one decay a value
    head, or KDA's one a key channel):

    ``tail_state_dropped`` (the final state taken before the last, partial chunk);
    ``tail_gate_at_chunk_end`` (the partial chunk's tokens decayed by the gate a full
    chunk would end on, read past the sequence as the chunk's last one);
    ``initial_first_only`` (in a pack, only the first sequence starts from its state);
    ``state_crosses`` (in a pack, each sequence starts from the one before's state);
    ``final_of_last`` (every sequence's final state is the pack's last);
    ``decay_after_update`` (the gate applied after the delta update);
    ``beta_outside`` (``beta v - S^T k`` in place of ``beta (v - S^T k)``);
    ``read_before_update`` (each output read from the state before its token);
    ``gva_modulo`` (value head ``j`` reads head ``j % H``);
    ``ratio_of_exps`` (a chunk's decays as ``exp(G_i) / exp(G_j)`` of its running sum);
    ``scale_ignored`` (always ``K ** -0.5``); ``l2norm_keys_only`` (the queries not
    normed). Their outputs are right, their gradients not: ``grad_beta_detached`` (no
    gradient reaches ``beta``); ``grad_tail_gate_detached`` (none reaches the gates of
    the last, partial chunk); ``grad_initial_detached`` (none reaches the initial
    states); ``grad_final_detached`` (the final states returned without their graph).
    ``kda_gate_mean``: KDA's decays a key channel taken as their mean, one a head (a kernel
    of Gated DeltaNet's decay given KDA's)."""
    dtype = q.dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32
    qf, kf, vf, gf, bf = (x.to(work) for x in (q, k, v, g, beta))
    if "grad_beta_detached" in bugs:
        bf = bf.detach()
    if "kda_gate_mean" in bugs and gf.dim() == 4:
        gf = gf.mean(-1)
    # the state (HV, K, V) is decayed by (HV,) a head, or (HV, K) a key channel
    per_key = gf.dim() == 4
    B, T, H, K = qf.shape
    HV, V = vf.shape[2], vf.shape[3]
    if use_qk_l2norm_in_kernel:
        kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
        if "l2norm_keys_only" not in bugs:
            qf = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
    if scale is None or "scale_ignored" in bugs:
        scale = K**-0.5
    heads = [(j % H) if "gva_modulo" in bugs else j // (HV // H) for j in range(HV)]
    qf, kf = qf[:, :, heads], kf[:, :, heads]
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(x) for x in cu_seqlens.tolist()]
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = torch.zeros_like(vf)
    finals = []
    prev_final = None
    for n, (b, start, end) in enumerate(spans):
        if initial_state is None or ("initial_first_only" in bugs and n > 0):
            S = vf.new_zeros(HV, K, V)
        else:
            S = initial_state[n].to(work).clone()
            if "grad_initial_detached" in bugs:
                S = S.detach()
        if "state_crosses" in bugs and prev_final is not None:
            S = prev_final.clone()
        for c0 in range(start, end, chunk):
            c1 = min(end, c0 + chunk)
            before = S.clone()
            run = torch.zeros(gf.shape[2:], dtype=work)
            for t in range(c0, c1):
                gt = gf[b, t]
                if "tail_gate_at_chunk_end" in bugs and c1 - c0 < chunk:
                    last = min(c0 + chunk - 1, gf.shape[1] - 1)
                    gt = gf[b, last]
                if "grad_tail_gate_detached" in bugs and c1 - c0 < chunk:
                    gt = gt.detach()
                if "ratio_of_exps" in bugs:
                    decay = torch.exp(run + gt) / torch.exp(run)
                    run = run + gt
                else:
                    decay = torch.exp(gt)
                decay = decay[:, :, None] if per_key else decay[:, None, None]
                if "decay_after_update" not in bugs:
                    S = S * decay
                pred = torch.einsum("hkv,hk->hv", S, kf[b, t])
                if "beta_outside" in bugs:
                    u = bf[b, t][:, None] * vf[b, t] - pred
                else:
                    u = bf[b, t][:, None] * (vf[b, t] - pred)
                new = S + kf[b, t][:, :, None] * u[:, None, :]
                if "decay_after_update" in bugs:
                    new = new * decay
                read = S if "read_before_update" in bugs else new
                o[b, t] = scale * torch.einsum("hkv,hk->hv", read, qf[b, t])
                S = new
            if "tail_state_dropped" in bugs and c1 - c0 < chunk:
                S = before
        finals.append(S)
        prev_final = S
    if "final_of_last" in bugs and finals:
        finals = [finals[-1]] * len(finals)
    final = torch.stack(finals) if finals else vf.new_zeros(0, HV, K, V)
    if "grad_final_detached" in bugs:
        final = final.detach()
    states = state_dtype(dtype)
    return o.to(dtype), (final.to(states) if output_final_state else None)


def _in_float32(
    rule: Callable[..., tuple[Tensor, Tensor]], name: str, doc: str
) -> Callable[..., Any]:
    """``rule`` (attnref's recurrence or its chunked form) in fla's convention, computed
    in float32 (float64 for float64 calls)."""

    def fn(
        q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
        initial_state: Tensor | None = None, output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        o, final = rule(
            q.to(work), k.to(work), v.to(work), beta=beta.to(work), **_gates(g.to(work)),
            scale=scale,
            initial_state=None if initial_state is None else initial_state.to(work),
            l2norm_qk=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        )  # fmt: skip
        return o.to(q.dtype), (final.to(state_dtype(q.dtype)) if output_final_state else None)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


_reference = _in_float32(chunked_gated_delta_rule, "_reference",
                         "attnref's `chunked_gated_delta_rule` in float32.")  # fmt: skip
_recurrent = _in_float32(gated_delta_rule, "_recurrent",
                         "attnref's `gated_delta_rule` in float32.")  # fmt: skip


_OURS = replace(FLA_CHUNK, gate_neg_inf=True, gradients=True)
#: KDA as fla's ``chunk_kda`` takes it: a decay a key channel, no GVA (``q``, ``k`` and
#: ``g`` of one shape)
_KDA = replace(_OURS, linear_gate="key", gqa=False)


def _builtins() -> list[Backend]:
    return [
        Backend("gated-delta-reference", _reference,
                "attnref's chunked gated delta rule (chunks of 64, the WY form) in float32",
                replace(_OURS, gate_neg_inf=False), api=NAME),
        Backend("gated-delta-recurrent", _recurrent,
                "attnref's gated delta recurrence, token by token, in float32", _OURS,
                api=NAME),
        Backend("gated-delta-kda-recurrent", _recurrent,
                "attnref's gated delta recurrence with KDA's decay a key channel (g of (B, "
                "T, H, K), fla's chunk_kda), token by token, in float32", _KDA, api=NAME),
    ]  # fmt: skip


def _mutant_fn(self: Mutant) -> Callable[..., Any]:
    bugs = frozenset(self.switches)

    def fn(
        q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
        initial_state: Tensor | None = None, output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        return plain_gated_delta(q, k, v, g, beta, scale, initial_state, output_final_state,
                                 use_qk_l2norm_in_kernel, cu_seqlens, bugs=bugs)  # fmt: skip

    fn.__name__ = fn.__qualname__ = self.name
    fn.__doc__ = f"Class {self.bug_class}: {self.summary}"
    fn.capabilities = self.capabilities  # type: ignore[attr-defined]
    return fn


_LIKE: dict[str, Any] = {"api": NAME, "capabilities": _OURS}
MUTANTS: tuple[Mutant, ...] = (
    *(Mutant(f"gdn_{bug}", LINEAR, summary, {bug: True}, **_LIKE) for bug, summary in (
        ("tail_state_dropped", "the final state taken before the last, partial chunk"),
        ("tail_gate_at_chunk_end", "a partial chunk's tokens decayed by the gate at the "
         "full chunk's end (read past the sequence)"),
        ("initial_first_only", "in a pack, only the first sequence starts from its "
         "initial state"),
        ("state_crosses", "in a pack, each sequence starts from the previous one's state"),
        ("final_of_last", "every packed sequence's final state is the last one's"),
        ("decay_after_update", "the gate applied after the delta update, not before"),
        ("beta_outside", "the correction beta v - S^T k, not beta (v - S^T k)"),
        ("read_before_update", "each output read from the state before its token's update"),
        ("gva_modulo", "value head j reads query/key head j % H, not j // (HV / H)"),
        ("ratio_of_exps", "a chunk's decays as exp(G_i) / exp(G_j) of its running sum "
         "(0 / 0 once it underflows)"),
        ("scale_ignored", "the scale argument ignored (always K ** -0.5)"),
        ("l2norm_keys_only", "the in-kernel L2 norm applied to the keys only"),
        ("grad_beta_detached", "beta detached: no gradient reaches it (dbeta None)"),
        ("grad_tail_gate_detached", "the gates of the last, partial chunk detached: dg "
         "0 there"),
        ("grad_initial_detached", "the initial states detached: no gradient reaches them"),
        ("grad_final_detached", "the final states returned detached: their upstream "
         "gradient reaches nothing"),
    )),
    Mutant("gdn_kda_gate_mean", LINEAR, "KDA's decays a key channel taken as their mean, "
           "one a head", {"kda_gate_mean": True}, api=NAME, capabilities=_KDA),
)  # fmt: skip


def no_dense(caps: Capabilities, inputs: Inputs, lse: bool, overrides: dict[str, Any]) -> Arguments:
    """A gated delta family's `Convention.build`: no softmax case is one of its calls."""
    raise Skip("a gated delta rule call holds no softmax: audited by its own properties")


def no_read(out: object, inputs: Inputs, lse: bool) -> tuple[object, object | None]:
    """A gated delta family's `Convention.read`: never called (no dense case is built)."""
    raise AssertionError("no dense case is built for the gated delta families")


def no_causal(caps: Capabilities, inputs: Inputs) -> bool:
    """A gated delta family's `Convention.native_causal`: a recurrence is causal itself."""
    return False


def _repro_shape(case: Case) -> str:
    """A case's shapes in REPORT.md's words."""
    pack = f", packing {len(case.seqlens)} sequences" if case.seqlens else ""
    return (
        f"{case.batch[0] if case.batch else 1} batch row(s) of {case.Tq} tokens{pack}, "
        f"{case.g} query/key head(s) and {case.h} value head(s), K {case.Dh}, V {case.Dv}"
    )


def _repro_script(title: str, spec: str, api: str) -> str:
    """repro.py for a finding of this family (`REPRO`): it calls the kernel on each judged
    call's saved arguments, computes the recurrence again in plain torch, and compares the
    output and final states with expected.pt's answers (`Context.answer`)."""
    return REPRO.replace("@TITLE@", title).replace("@SPEC@", spec).replace("@API@", api)


REPRO = '''"""Reproduce: @TITLE@

Written by attnref; runs without it: torch, the standard library and the backend's own
module. ``python repro.py`` exits 1 while the bug shows; ``python repro.py --backend
module:function`` runs another function (a fix, a reference) on the same inputs.

The calls are fla's ``chunk_gated_delta_rule(q, k, v, g, beta, scale=None,
initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
cu_seqlens=None) -> (o, final_state)``; the float64 answers (expected.pt) are the gated
delta recurrence, which ``recurrence`` below computes again in plain torch.
"""

import argparse
import importlib
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SPEC = @SPEC@
API = @API@


def load(name):
    return torch.load(HERE / name, weights_only=True)


def recurrence(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The gated delta rule token by token in float64: for each token, S = exp(g) S
    (KDA's g (B, T, HV, K): diag(exp(g)) S); u = beta (v - S^T k); S = S + k u^T;
    o = S^T (scale q)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k = q.repeat_interleave(HV // H, 2), k.repeat_interleave(HV // H, 2)
    scale = K ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(x) for x in cu_seqlens.tolist()]
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    finals = []
    for n, (b, start, end) in enumerate(spans):
        S = torch.zeros(HV, K, V, dtype=torch.float64)
        if initial_state is not None:
            S = initial_state[n].double().clone()
        for t in range(start, end):
            decay = g[b, t].exp()  # one a value head, or (KDA) one a key channel
            S = S * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t]))
            S = S + k[b, t][:, :, None] * u[:, None, :]
            o[b, t] = torch.einsum("hkv,hk->hv", S, scale * q[b, t])
        finals.append(S)
    return o, torch.stack(finals)


def call(fn, record, rule=None):
    """``fn`` on one recorded call: its ``(o, final_state)``; for a gradient call, the
    gradients of the arguments the audit made leaves (``record["leaves"]``: positions or
    keywords), from the upstream gradients it gave the output and the final states, as a
    training loop's backward() leaves them."""
    args = [x.clone() if isinstance(x, torch.Tensor) else x for x in record["args"]]
    kwargs = {n: x.clone() if isinstance(x, torch.Tensor) else x
              for n, x in record["kwargs"].items()}
    if rule is not None:  # the recurrence: float64 on the very inputs
        args[:5] = [x.double() for x in args[:5]]
        if isinstance(kwargs.get("initial_state"), torch.Tensor):
            kwargs["initial_state"] = kwargs["initial_state"].double()
        kwargs.pop("output_final_state", None)
        fn = rule
    leaves, d_out = record.get("leaves") or [], record.get("d_out")
    if d_out is None or not leaves:
        return fn(*args, **kwargs)
    chosen = []
    for name in leaves:
        box = kwargs if isinstance(name, str) else args
        box[name] = box[name].detach().requires_grad_(True)
        chosen.append(box[name])
    returned = fn(*args, **kwargs)
    pairs = [(r, d) for r, d in zip(returned, d_out) if d is not None]
    for r, _ in pairs:
        if not isinstance(r, torch.Tensor) or not r.requires_grad:
            raise RuntimeError("a result given an upstream gradient does not require grad")
    torch.autograd.backward([r for r, _ in pairs], [d.to(r.dtype) for r, d in pairs])
    return tuple(t.grad for t in chosen)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=SPEC, help="module:function to call")
    args = parser.parse_args()
    if not args.backend:
        print("the backend is attnref's own: inputs.pt and expected.pt hold its tensors")
        return 2
    module, _, name = args.backend.partition(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    calls, answers = load("inputs.pt")["calls"], load("expected.pt")["answers"]
    if not any(answer["call"] is not None for answer in answers):
        print("no answer of expected.pt names a call: inputs.pt and expected.pt hold the "
              "finding's tensors")
        return 2
    failed = False
    for answer in answers:
        if answer["call"] is None:
            continue
        record = calls[answer["call"]]
        try:
            got = call(fn, record)
        except Exception as e:
            print(f"FAIL: the bug shows: call {answer['call']} raised {type(e).__name__}: {e}")
            return 1
        if not isinstance(got, (tuple, list)) or len(got) < 2 + 3 * ("grads" in answer):
            print(f"FAIL: the bug shows: call {answer['call']} returned "
                  f"{type(got).__name__}, not (o, final_state) or its gradients")
            return 1
        again = call(None, record, rule=recurrence)
        if "grads" in answer:  # a gradient call: its leaves' gradients, in order
            names = list(answer["grads"])
            parts = [(n, got[i] if i < len(got) else None, answer["grads"][n],
                      answer["grad_bounds"][n], again[i]) for i, n in enumerate(names)]
        else:
            parts = [("output", got[0], answer["output"], answer["output_bound"], again[0]),
                     ("final state", got[1], answer["state"], answer["state_bound"], again[1])]
        gap = max(float((a.detach() - want).abs().max()) for _, _, want, _, a in parts)
        print(f"call {answer['call']}: the recurrence again in plain torch is {gap:.3g} "
              "from expected.pt")
        for what, got_x, want, bound, _ in parts:
            if got_x is None:
                print(f"  {what}: None (no value returned, or no gradient reaches it)")
                failed = True
                continue
            error = (got_x.detach().double() - want).abs().nan_to_num(nan=torch.inf)
            big = float(error.max()) if error.numel() else 0.0
            mean = float(error.mean()) if error.numel() else 0.0
            at = tuple(int(i) for i in (error == error.max()).nonzero()[0]) if error.numel() else ()
            shown = (f"got {float(got_x[at]):.9g}, expected {float(want[at]):.9g} (float64); "
                     if at else "")
            print(f"  {what}: worst element {at}: {shown}error {big:.3g} (bound "
                  f"{float(bound[0]):.3g}), mean error {mean:.3g} (bound {float(bound[1]):.3g})")
            failed = failed or big > float(bound[0]) or mean > float(bound[1])
    if failed:
        print("FAIL: the bug shows")
        return 1
    print("pass: within the bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


SIGNATURE = (
    "fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, "
    "use_qk_l2norm_in_kernel=False, cu_seqlens=None) -> (o, final_state)"
)

# ---------------------------------------------------------------- the bench


def _prefill_workload(case: ServingCase) -> Workload:
    """One packed prefill of a hybrid model's linear-attention layer: ``B`` sequences
    whose lengths spread evenly from ``seq`` down to ``seq / 2``, packed by ``cu_seqlens``
    (one sequence: no pack), ``g`` query/key heads and ``h`` value heads of ``K = V =
    Dh``, q and k L2-normed in the kernel (Qwen3-Next's call), decays and write strengths
    as a model's (`build_call`), no initial state, the final states returned; every token
    of the pack a call."""
    lengths = spread_lengths(case)
    dtype = DTYPES[case.dtype]

    def draw(seed: int) -> Arguments:
        drawn = Case(
            "bench", batch=(1,), h=case.h, g=case.g, Tq=lengths[0], Tk=lengths[0],
            Dh=case.Dh, Dv=case.Dh, seed=seed,
            seqlens=tuple((t, t) for t in lengths) if len(lengths) > 1 else (),
            options=(("l2norm", True), ("initial", False)),
        )  # fmt: skip
        return arguments(build_call(drawn, dtype, case.device, FLA_CHUNK))

    def refused(caps: Capabilities) -> str | None:
        if caps.linear_gate != "head":
            return "a decay a key channel (KDA, linear_gate='key') is not benched yet"
        if not caps.qk_l2norm:
            return "use_qk_l2norm_in_kernel not declared (qk_l2norm)"
        if len(lengths) > 1 and not caps.linear_packed:
            return (
                "packed sequences (cu_seqlens) not declared (linear_packed); run it with --batch 1"
            )
        return None

    label = f"H={case.g} HV={case.h} K=V={case.Dh} B={case.B} longest={case.seq} {case.dtype}"
    return Workload(label, sum(lengths), draw, oracle="gated-delta-reference",
                    output=_first, refused=refused)  # fmt: skip


def _first(result: object) -> object:
    """A call's output, ``o`` of ``(o, final_state)`` (the result itself otherwise, for
    the bench to refuse)."""
    return result[0] if isinstance(result, tuple | list) and result else result


FAMILY = ApiFamily(
    name=NAME,
    alignments=(),
    summary="linear attention by the gated delta rule (Qwen3-Next, Qwen3.5), as fla's "
    "chunk_gated_delta_rule: q, k (B, T, H, K), v (B, T, HV, V), log decays g and write "
    "strengths beta (B, T, HV), initial and final states (N, HV, K, V), packed sequences",
    signature=SIGNATURE,
    positional=5,
    keywords=("scale", "output_final_state"),
    defaults=FLA_CHUNK,
    build=no_dense,
    read=no_read,
    to_layout=flash_layout,
    from_layout=flash_back,
    native_causal=no_causal,
    dropout=False,
    dense=False,
    repro_script=_repro_script,
    repro_shape=_repro_shape,
    builtins=_builtins,
    properties=PROPERTIES,
    mutants=MUTANTS,
    mutant_fn=_mutant_fn,
    bench_backends=("gated-delta-reference", "gated-delta-recurrent"),
    workload=_prefill_workload,
)
