"""The ``gated-delta-decode`` family: the gated delta rule's serving form, one or a few
tokens a request against a pool of recurrent states (docs/linear.md).

``fn(q, k, v, g, beta, scale, initial_state, inplace_final_state=True, cu_seqlens=None,
ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False) -> (o,
final_state)``, as fla's ``fused_recurrent_gated_delta_rule`` in the copy vLLM serves
Qwen3-Next with (``vllm/model_executor/layers/fla/ops/fused_recurrent.py``): the
requests' tokens packed by ``cu_seqlens`` (``B = 1``), ``initial_state`` the pool of
states ``(slots, HV, K, V)``, read and written in place at each request's slots:

- decode (``ssm_state_indices (N,)``, one token a request): request ``n`` starts from
  ``pool[indices[n]]`` and leaves its new state there;
- speculative decoding (``ssm_state_indices (N, T)``, ``T`` the drafted tokens plus one,
  and ``num_accepted_tokens (N,)``): request ``n`` starts from ``pool[indices[n, a - 1]]``,
  ``a`` its tokens accepted at the step before (the state after the last of them), and
  leaves the state after its token ``t`` at ``pool[indices[n, t]]``, one slot a drafted
  token, so that the next step can start from whichever was accepted.

Every slot no request names is never read or written: the audit fills those with NaN and
holds the backend to leaving them bit for bit. The pool comes back as the backend left
it (``final_state`` is the pool itself in vLLM); the audit reads the pool argument.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from hypothesis import strategies as st
from jaxtyping import Float, Integer
from torch import Tensor

from attnref._checking import checked_internal
from attnref.conformance.calls import invoke, note_failed_call, note_reading
from attnref.conformance.cases import Case
from attnref.conformance.checks import Context
from attnref.conformance.declarations import Backend, Capabilities
from attnref.conformance.families.flash import flash_back, flash_layout
from attnref.conformance.families.gated_delta import (
    FLA_CHUNK,
    LINEAR,
    GdnCall,
    build_call,
    expected,
    no_causal,
    no_dense,
    no_read,
    requiring,
    state_dtype,
)
from attnref.conformance.family import ApiFamily, Arguments
from attnref.conformance.jobs import Job
from attnref.conformance.mutants import Mutant
from attnref.conformance.oracle import close
from attnref.conformance.profiles import Profile
from attnref.conformance.properties import Property
from attnref.conformance.verdicts import Failure, Skip
from attnref.linear import gated_delta_rule

__all__ = ["FAMILY", "VLLM_FUSED_RECURRENT", "plain_pool_decode"]

NAME = "gated-delta-decode"

#: what vLLM's copy of fla's fused recurrent kernel takes: the pool, decode and
#: speculative decoding, the in-kernel L2 norm, GVA
VLLM_FUSED_RECURRENT = replace(FLA_CHUNK, family=NAME)


@dataclass(frozen=True)
class PoolCall:
    """One serving call: the requests' tokens (``call``, packed), the pool, the slots each
    request names (``indices (N,)`` or ``(N, T)``), and the tokens accepted (or None)."""

    call: GdnCall
    pool: Tensor
    indices: Tensor
    accepted: Tensor | None

    def arguments(self) -> Arguments:
        c = self.call
        kwargs: dict[str, Any] = {
            "inplace_final_state": True,
            "cu_seqlens": c.cu_seqlens,
            "ssm_state_indices": self.indices,
        }
        if self.accepted is not None:
            kwargs["num_accepted_tokens"] = self.accepted
        if c.l2norm:
            kwargs["use_qk_l2norm_in_kernel"] = True
        return (c.q, c.k, c.v, c.g, c.beta, c.scale, self.pool), kwargs


def _pool_call(case: Case, dtype: torch.dtype, device: str, caps: Capabilities) -> PoolCall:
    """``case.seqlens`` requests (each ``(T, T)``: its tokens this step, all equal for a
    speculative step), a pool of ``option("slots")`` slots, NaN but for the named ones
    (random states), shuffled with ``option("shuffle")``; a speculative step
    (``option("spec")``) names ``T`` slots a request and its tokens accepted."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    call = build_call(case, dtype, device, caps)
    N = len(case.seqlens)
    T = case.seqlens[0][0]
    spec = bool(case.option("spec", False))
    per = T if spec else 1
    slots = max(int(case.option("slots", 2 * N * per + 3)), N * per)
    order = torch.randperm(slots, generator=gen)[: N * per]
    if not case.option("shuffle", True):
        order = torch.arange(N * per)
    indices = order.reshape(N, per) if spec else order
    HV, K, V = call.v.shape[2], call.k.shape[3], call.v.shape[3]
    pool = torch.full((slots, HV, K, V), math.nan, dtype=torch.float64)
    pool[order] = 0.5 * torch.randn((N * per, HV, K, V), generator=gen, dtype=torch.float64)
    accepted = None
    if spec:
        accepted = torch.randint(1, T + 1, (N,), generator=gen, dtype=torch.int32)
    sd = state_dtype(dtype)
    return PoolCall(
        replace(call, initial_state=None),
        pool.to(device, sd),
        indices.to(device, torch.int32),
        None if accepted is None else accepted.to(device),
    )


def _starts(pc: PoolCall) -> Tensor:
    """The state each request starts from: ``pool[indices[n]]``, or the slot of its last
    accepted token in a speculative step."""
    idx = pc.indices.cpu().long()
    if pc.accepted is None:
        return pc.pool.cpu()[idx]
    a = pc.accepted.cpu().long() - 1
    return pc.pool.cpu()[idx[torch.arange(len(idx)), a]]


def _declared(caps: Capabilities, pc: PoolCall) -> None:
    if not caps.state_pool:
        raise Skip("a pool of states (ssm_state_indices) not declared (state_pool)")
    if pc.accepted is not None and not caps.speculative:
        raise Skip("speculative decoding (num_accepted_tokens) not declared (speculative)")
    if pc.call.l2norm and not caps.qk_l2norm:
        raise Skip("use_qk_l2norm_in_kernel not declared (qk_l2norm)")
    if pc.call.q.dtype not in caps.dtypes:
        raise Skip(f"{pc.call.q.dtype} not declared")


def _run(
    ctx: Context, pc: PoolCall, answer: Callable[[], None] | None = None
) -> tuple[Tensor, Tensor]:
    """The backend's output (float64) and the pool as it left it (float64). ``answer``
    keeps, for a bug report, what the call is judged against (`_answer`), once where
    its parts lie is noted: in what it returned, or where a well-formed result would
    hold them where it failed."""
    _declared(ctx.caps, pc)
    args, kwargs = pc.arguments()
    o_shape, pool_shape = tuple(pc.call.v.shape), tuple(pc.pool.shape)

    def well_formed(malformed: str | None = None) -> None:
        def make() -> object:  # (o, final_state) and the pool it may write
            return (torch.zeros(o_shape), torch.zeros(pool_shape)), (torch.zeros(pool_shape),)

        note_failed_call(ctx.executor, make, lambda r: [], malformed=malformed)
        if answer is not None:
            answer()

    try:
        raw = invoke(ctx.backend, Job(args, kwargs, writable=(6,)), ctx.timeout, ctx.executor)
    except Failure:
        well_formed()
        raise
    try:
        if not isinstance(raw, tuple | list) or len(raw) != 2:
            raise Failure(f"the audit's call returned {type(raw).__name__}")
        result, (pool,) = raw
        if not isinstance(result, tuple | list) or len(result) != 2:
            raise Failure(
                "fused_recurrent_gated_delta_rule returns (o, final_state), returned "
                f"{type(result).__name__}"
            )
        o = result[0]
        if not isinstance(o, Tensor) or tuple(o.shape) != o_shape:
            shape = tuple(o.shape) if isinstance(o, Tensor) else type(o).__name__
            raise Failure(f"returned o of shape {shape}, expected {o_shape}")
        if not isinstance(pool, Tensor) or tuple(pool.shape) != pool_shape:
            raise Failure("the pool (initial_state) came back reshaped")
    except Failure as f:
        well_formed(str(f))
        raise
    note_reading(ctx.executor, raw, lambda r: [])
    if answer is not None:
        answer()
    return o.detach().cpu().double(), pool.detach().cpu().double()


@checked_internal
def _answer(
    ctx: Context, output: Float[Tensor, "1 T HV V"], bounds: tuple[float, float],
    pool: Float[Tensor, "slots HV K V"] | None = None,
    pool_bounds: tuple[float, float] = (0.0, 0.0),
) -> None:  # fmt: skip
    """Keep the output a call is judged against, and the pool (NaN in every slot it
    must leave alone), where they lie in its result, for a bug report's repro.py."""
    ctx.answer_part("output", lambda r: cast(Any, r)[0][0], output, bounds)
    if pool is not None:
        ctx.answer_part("pool", lambda r: cast(Any, r)[1][0], pool, pool_bounds)


def _judge_pool(ctx: Context, pc: PoolCall, what: str) -> None:
    """Each request's outputs from the state it must start from, each named slot's new
    state, and every other slot untouched (NaN, as the audit left it)."""
    c = pc.call
    starts = _starts(pc).to(state_dtype(c.q.dtype))
    call = replace(c, initial_state=starts.to(c.q.device))
    exp = expected(call)
    # the states after each token, each request's named slots; NaN in every other
    idx = pc.indices.cpu().long()
    N = idx.shape[0]
    cu = [int(x) for x in c.cu_seqlens.cpu().tolist()]  # type: ignore[union-attr]
    named = torch.zeros(pc.pool.shape[0], dtype=torch.bool)
    left = torch.full(tuple(pc.pool.shape), math.nan, dtype=torch.float64)  # as it must be
    slots, want = [], []
    for n in range(N):
        lengths = range(1, cu[n + 1] - cu[n] + 1) if idx.dim() == 2 else [cu[n + 1] - cu[n]]
        for t, upto in enumerate(lengths):
            slot = int(idx[n, t]) if idx.dim() == 2 else int(idx[n])
            _, s = _prefix(call, n, upto)
            named[slot] = True
            slots.append(slot)
            want.append(s[0])
            left[slot] = s[0]
    o, pool = _run(ctx, pc, lambda: _answer(ctx, exp.output.value, exp.output.bounds(), left,
                                            exp.state.bounds()))  # fmt: skip
    close(o, exp.output.value, *exp.output.bounds(), f"{what}: output")
    if slots:
        got = torch.stack([pool[slot] for slot in slots])
        bounds = exp.state.bounds()
        close(got, torch.stack(want), *bounds, f"{what}: the named slots' states")
    untouched = pool[~named]
    if untouched.numel() and not bool(untouched.isnan().all()):
        bad = int((~untouched.isnan()).flatten(1).any(1).nonzero()[0])
        slot = int((~named).nonzero()[bad])
        raise Failure(f"a pool slot no request names was written: slot {slot} ({what})")


def _prefix(call: GdnCall, n: int, upto: int) -> tuple[Tensor, Tensor]:
    """The float64 recurrence over request ``n``'s first ``upto`` tokens from its start
    state: their outputs and the state after them (the slot's)."""
    cu = [int(x) for x in call.cu_seqlens.cpu().tolist()]  # type: ignore[union-attr]
    a = cu[n]
    q, k, v, g, beta = (x.cpu().double()[:, a : a + upto] for x in
                        (call.q, call.k, call.v, call.g, call.beta))  # fmt: skip
    s0 = call.initial_state
    assert s0 is not None
    return _rule(q, k, v, g, beta, scale=call.scale, initial_state=s0.cpu().double()[n : n + 1],
                 l2norm_qk=call.l2norm)  # fmt: skip


@checked_internal
def _rule(
    q: Float[Tensor, "B T H K"],
    k: Float[Tensor, "B T H K"],
    v: Float[Tensor, "B T HV V"],
    g: Float[Tensor, "B T HV"] | Float[Tensor, "B T HV K"],
    beta: Float[Tensor, "B T HV"],
    **kwargs: Any,
) -> tuple[Float[Tensor, "B T HV V"], Float[Tensor, "N HV K V"]]:
    """`attnref.linear.gated_delta_rule` with the serving form's ``g``: a decay a value
    head ``(B, T, HV)``, or (KDA, ``linear_gate="key"``) one a key channel ``(B, T, HV,
    K)``, which the reference takes as ``gk``."""
    if g.dim() == 4:
        return gated_delta_rule(q, k, v, None, beta, gk=g, **kwargs)
    return gated_delta_rule(q, k, v, g, beta, **kwargs)


def _decode(ctx: Context, case: Case) -> None:
    pc = _pool_call(case, ctx.dtype, ctx.device, ctx.caps)
    _judge_pool(ctx, pc, f"{len(case.seqlens)} requests in a pool of {pc.pool.shape[0]} slots")


def _steps(ctx: Context, case: Case) -> None:
    """Decode equals prefill: the requests decoded ``steps`` tokens, one call a token,
    each from the pool the call before left (the backend's own states), against the
    float64 recurrence over all of them from the first states."""
    steps = int(case.option("steps", 3))
    pc = _pool_call(case, ctx.dtype, ctx.device, ctx.caps)
    N = len(case.seqlens)
    whole = build_call(replace(case, seqlens=((steps, steps),) * N), ctx.dtype, ctx.device,
                       ctx.caps)  # fmt: skip
    idx = pc.indices.cpu().long()
    starts = pc.pool.cpu()[idx]
    full = replace(whole, initial_state=starts.to(whole.q.device))
    exp = expected(full)
    pool = pc.pool
    cu = [steps * n for n in range(N + 1)]
    for t in range(steps):
        at = torch.tensor([cu[n] + t for n in range(N)])
        q, k, v, g, beta = (x[:, at] for x in (whole.q, whole.k, whole.v, whole.g, whole.beta))
        one = GdnCall(q, k, v, g, beta, whole.scale, None,
                      torch.arange(N + 1, device=whole.q.device), whole.l2norm)  # fmt: skip
        step = replace(pc, call=one, pool=pool)
        want = exp.output.value[:, at]

        def answer(want: Tensor = want) -> None:
            _answer(ctx, want, exp.output.bounds())

        o, left = _run(ctx, step, answer)
        close(o, want, *exp.output.bounds(), f"decode step {t + 1} of {steps} ({N} requests, "
              "each from the state the step before left): output")  # fmt: skip
        pool = left.to(pc.pool.device, pc.pool.dtype)
    final = pool.cpu().double()[idx]
    close(final, exp.state.value, *exp.state.bounds(),
          f"after {steps} decode steps: the requests' slots")  # fmt: skip


def _requests(
    name: str, *, spec: bool = False, steps: bool = False
) -> Callable[[Profile, Capabilities], st.SearchStrategy[Case]]:
    def cases(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
        @st.composite
        def draw(d: st.DrawFn) -> Case:
            H = d(st.integers(1, 2))
            HV = H * d(st.sampled_from((1, 2) if c.gqa else (1,)))
            dims = c.head_dims or (8, 16, 12)
            K, V = d(st.sampled_from(dims)), d(st.sampled_from(dims))
            N = d(st.integers(1, 6))
            T = d(st.integers(2, 5)) if spec else 1
            opts: dict[str, Any] = {
                "l2norm": c.qk_l2norm and d(st.booleans()),
                "spec": spec,
                "shuffle": d(st.booleans()),
                "gate": d(st.sampled_from(("normal", "far", "zero"))),
                "beta": d(st.sampled_from(("random", "edges"))),
            }
            if steps:
                opts["steps"] = d(st.integers(2, 4))
            return Case(name, batch=(1,), h=HV, g=H, Tq=N * T, Tk=N * T, Dh=K, Dv=V,
                        seqlens=((T, T),) * N,
                        scale=d(st.sampled_from((None, 0.5))) if c.explicit_scale else None,
                        seed=d(st.integers(0, 2**16)), options=tuple(opts.items()))  # fmt: skip

        return draw()

    return cases


_POOL = requiring("state_pool", "a pool of states (ssm_state_indices)")
_SPEC = requiring("speculative", "speculative decoding (num_accepted_tokens)")
_FAM = (NAME,)
PROPERTIES: tuple[Property, ...] = (
    Property(
        "gdn_decode_pool",
        "one token a request against a pool of states (ssm_state_indices, shuffled): each "
        "request reads its slot and leaves its new state there; no other slot is read or "
        "written (they hold NaN)",
        (LINEAR,),
        _requests("gdn_decode_pool"),
        _decode,
        requires=_POOL,
        families=_FAM,
    ),
    Property(
        "gdn_decode_steps",
        "decode equals prefill: a few decode steps, each from the pool the step before "
        "left, give the outputs and states of the whole sequence at once",
        (LINEAR,),
        _requests("gdn_decode_steps", steps=True),
        _steps,
        requires=_POOL,
        families=_FAM,
    ),
    Property(
        "gdn_speculative",
        "speculative decoding: each request starts from the slot of its last accepted "
        "token (num_accepted_tokens) and leaves the state after each drafted token in "
        "that token's slot, so a rejected token's state is never the one read next",
        (LINEAR,),
        _requests("gdn_speculative", spec=True),
        _decode,
        requires=_SPEC,
        families=_FAM,
    ),
)


# ---------------------------------------------------- the mutants' plain kernel


@checked_internal
def plain_pool_decode(
    q: Float[Tensor, "1 T H K"], k: Float[Tensor, "1 T H K"], v: Float[Tensor, "1 T HV V"],
    g: Float[Tensor, "1 T HV"] | Float[Tensor, "1 T HV K"], beta: Float[Tensor, "1 T HV"],
    scale: float | None,
    initial_state: Float[Tensor, "slots HV K V"], inplace_final_state: bool = True,
    cu_seqlens: Integer[Tensor, " N1"] | None = None,
    ssm_state_indices: Integer[Tensor, " N *spec"] | None = None,
    num_accepted_tokens: Integer[Tensor, " N"] | None = None,
    use_qk_l2norm_in_kernel: bool = False, *, bugs: frozenset[str] = frozenset(),
) -> tuple[Float[Tensor, "1 T HV V"], Float[Tensor, "slots HV K V"]]:  # fmt: skip
    """vLLM's serving semantics (the module docstring), token by token in float32, written
    apart from `attnref.linear`; the host of the mutants, ``bugs`` of:
    ``slot_by_order`` (request ``n`` reads and writes slot ``n``); ``never_written`` (the
    pool is read, never written); ``accepted_off_by_one`` (the slot of token ``a``, not
    ``a - 1``); ``first_slot_always`` (``num_accepted_tokens`` ignored: slot of token 0);
    ``final_in_every_slot`` (the state after the last drafted token written to each of
    the request's slots: a rejected token's state is read next step); ``neighbour_written``
    (the new state also written to the slot after the request's)."""
    if ssm_state_indices is None or cu_seqlens is None:
        raise ValueError("this kernel takes the serving form only: cu_seqlens and indices")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf, gf, bf = (x.to(work) for x in (q, k, v, g, beta))
    H, K = qf.shape[2], qf.shape[3]
    HV = vf.shape[2]
    heads = [j // (HV // H) for j in range(HV)]
    qf, kf = qf[:, :, heads], kf[:, :, heads]
    if use_qk_l2norm_in_kernel:
        qf = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    scale = K**-0.5 if scale is None else scale
    idx = ssm_state_indices.long()
    cu = [int(x) for x in cu_seqlens.tolist()]
    o = torch.zeros_like(vf)
    writes: list[tuple[int, Tensor]] = []
    for n in range(len(cu) - 1):
        row = idx[n] if idx.dim() == 2 else idx[n : n + 1]
        if "slot_by_order" in bugs:
            row = torch.arange(n * len(row), (n + 1) * len(row))
        first = 0
        if num_accepted_tokens is not None:
            first = int(num_accepted_tokens[n]) - 1
            if "accepted_off_by_one" in bugs:
                first = min(first + 1, len(row) - 1)
            if "first_slot_always" in bugs:
                first = 0
        S = initial_state[int(row[first])].to(work).clone()
        mine = []
        for i, t in enumerate(range(cu[n], cu[n + 1])):
            decay = torch.exp(gf[0, t])  # (HV,), or KDA's (HV, K): a key channel each
            S = S * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
            u = bf[0, t][:, None] * (vf[0, t] - torch.einsum("hkv,hk->hv", S, kf[0, t]))
            S = S + kf[0, t][:, :, None] * u[:, None, :]
            o[0, t] = scale * torch.einsum("hkv,hk->hv", S, qf[0, t])
            mine.append((int(row[min(i, len(row) - 1)]), S.clone()))
        if "final_in_every_slot" in bugs:
            mine = [(slot, S.clone()) for slot, _ in mine]
        if "neighbour_written" in bugs and mine:
            slot = (mine[-1][0] + 1) % initial_state.shape[0]
            mine.append((slot, S.clone()))
        writes.extend(mine)
    if "never_written" not in bugs:
        for slot, S in writes:
            initial_state[slot] = S.to(initial_state.dtype)
    return o.to(q.dtype), initial_state


def _reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
    initial_state: Tensor, inplace_final_state: bool = True, cu_seqlens: Tensor | None = None,
    ssm_state_indices: Tensor | None = None, num_accepted_tokens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """attnref's recurrence (`attnref.linear.gated_delta_rule`) behind the pool: each
    request from its slot, each token's state written to its slot."""
    if ssm_state_indices is None or cu_seqlens is None:
        raise ValueError("this kernel takes the serving form only: cu_seqlens and indices")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    idx = ssm_state_indices.long()
    cu = [int(x) for x in cu_seqlens.tolist()]
    o = torch.zeros_like(v)
    for n in range(len(cu) - 1):
        row = idx[n] if idx.dim() == 2 else idx[n : n + 1]
        first = 0 if num_accepted_tokens is None else int(num_accepted_tokens[n]) - 1
        S = initial_state[int(row[first])][None].to(work)
        for i, t in enumerate(range(cu[n], cu[n + 1])):
            part = (x[:, t : t + 1].to(work) for x in (q, k, v, g, beta))
            out, S = _rule(*part, scale=scale, initial_state=S,
                           l2norm_qk=use_qk_l2norm_in_kernel)  # fmt: skip
            o[:, t : t + 1] = out.to(o.dtype)
            initial_state[int(row[min(i, len(row) - 1)])] = S[0].to(initial_state.dtype)
    return o, initial_state


_OURS = VLLM_FUSED_RECURRENT


def _builtins() -> list[Backend]:
    return [
        Backend("gated-delta-decode-reference", _reference,
                "attnref's gated delta recurrence behind a pool of states, in float32",
                _OURS, api=NAME),
    ]  # fmt: skip


def _mutant_fn(self: Mutant) -> Callable[..., Any]:
    bugs = frozenset(self.switches)

    def fn(
        q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
        initial_state: Tensor, inplace_final_state: bool = True,
        cu_seqlens: Tensor | None = None, ssm_state_indices: Tensor | None = None,
        num_accepted_tokens: Tensor | None = None, use_qk_l2norm_in_kernel: bool = False,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        return plain_pool_decode(q, k, v, g, beta, scale, initial_state, inplace_final_state,
                                 cu_seqlens, ssm_state_indices, num_accepted_tokens,
                                 use_qk_l2norm_in_kernel, bugs=bugs)  # fmt: skip

    fn.__name__ = fn.__qualname__ = self.name
    fn.__doc__ = f"Class {self.bug_class}: {self.summary}"
    fn.capabilities = self.capabilities  # type: ignore[attr-defined]
    return fn


_LIKE: dict[str, Any] = {"api": NAME, "capabilities": _OURS}
MUTANTS: tuple[Mutant, ...] = tuple(
    Mutant(f"gdn_pool_{bug}", LINEAR, summary, {bug: True}, **_LIKE)
    for bug, summary in (
        ("slot_by_order", "request n reads and writes pool slot n, not the slot its index "
         "names (prefill slots read as decode slots)"),
        ("never_written", "the pool read and never written back"),
        ("accepted_off_by_one", "a speculative step starts from the slot of token a, not "
         "a - 1 (a the tokens accepted)"),
        ("first_slot_always", "num_accepted_tokens ignored: every step starts from the "
         "first drafted token's slot"),
        ("final_in_every_slot", "the state after the last drafted token written to every "
         "drafted token's slot (a rejected token's state is read next step)"),
        ("neighbour_written", "the new state also written to the slot after the request's"),
    )
)  # fmt: skip


FAMILY = ApiFamily(
    name=NAME,
    alignments=(),
    summary="the gated delta rule's serving form, as vLLM's copy of fla's "
    "fused_recurrent_gated_delta_rule: requests packed by cu_seqlens against a pool of "
    "states read and written in place at their slots (ssm_state_indices), speculative "
    "decoding with a slot a drafted token (num_accepted_tokens)",
    signature="fn(q, k, v, g, beta, scale, initial_state, inplace_final_state=True, "
    "cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None, "
    "use_qk_l2norm_in_kernel=False) -> (o, final_state)",
    positional=7,
    keywords=("inplace_final_state", "cu_seqlens", "ssm_state_indices"),
    defaults=VLLM_FUSED_RECURRENT,
    build=no_dense,
    read=no_read,
    to_layout=flash_layout,
    from_layout=flash_back,
    native_causal=no_causal,
    dropout=False,
    dense=False,
    builtins=_builtins,
    properties=PROPERTIES,
    mutants=MUTANTS,
    mutant_fn=_mutant_fn,
)
