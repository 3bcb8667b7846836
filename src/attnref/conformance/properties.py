"""The properties an attention backend must have, each with the bug classes it targets.

Two kinds (see docs/conformance.md):

- **agreement**: the backend's output (or gradient) matches the float64 oracle over a
  family of Hypothesis-drawn cases (`forward`, `tails`, `hot`, `layouts`, ...);
- **laws**: a relation between two calls of the backend itself (`key_permutation`,
  `causality`, `value_affine`, `decode`, ...). The oracle only sets the tolerance: the
  two calls may differ by at most the sum of their error bounds, plus the exact change
  the transformation makes to the float64 answer when rounding the transformed inputs
  moves it (``delta``).

A check raises `Failure` (with a one-line message) or `Skip`; it returns on success.
Bug classes are the rows of the catalogue in docs/architecture.md ("Bug classes").
"""

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from hypothesis import strategies as st
from jaxtyping import Bool, Float
from torch import Tensor

from attnref import functional as F
from attnref._checking import checked_internal
from attnref.conformance.backends import Backend, Capabilities
from attnref.conformance.calls import arguments, call, invoke
from attnref.conformance.cases import Case, Inputs, build, fixed_grid
from attnref.conformance.oracle import Expected, close, empty_rows, expect, expect_grads
from attnref.conformance.profiles import Profile
from attnref.conformance.strategies import LAYOUTS, case_strategy, masks_for
from attnref.conformance.verdicts import Failure, Skip

__all__ = ["PROPERTIES", "Context", "Property", "check_case", "get_property"]


@dataclass(frozen=True)
class Context:
    """Everything a check needs besides its case: the backend, dtype, device, timeout."""

    backend: Backend
    dtype: torch.dtype
    device: str
    timeout: float = 60.0
    # the oracle of the inputs a check is working on, by identity: a law compares two
    # calls against the oracles of both, and several laws reuse one base call
    _oracles: dict[int, tuple[Inputs, Expected]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def caps(self) -> Capabilities:
        return self.backend.capabilities

    def build(self, case: Case) -> Inputs:
        self._oracles.clear()  # a new case: the oracles of the last one are not needed
        return build(case, self.dtype, self.device)

    def run(self, inputs: Inputs, **overrides: object) -> Tensor:
        return call(self.backend, inputs, self.timeout, **overrides)

    def expect(self, inputs: Inputs) -> Expected:
        """The oracle of ``inputs``, computed once per check."""
        hit = self._oracles.get(id(inputs))
        if hit is None or hit[0] is not inputs:
            hit = (inputs, expect(inputs, self.caps.empty_row))
            self._oracles[id(inputs)] = hit
        return hit[1]

    def agree(self, inputs: Inputs, what: str = "output") -> Tensor:
        """Call the backend on ``inputs`` and fail unless it matches the oracle."""
        out = self.run(inputs)
        exp = self.expect(inputs)
        close(out.to(torch.float64), exp.value, *exp.bounds(), what)
        return out


Check = Callable[[Context, Case], None]
Cases = Callable[[Profile, Capabilities], st.SearchStrategy[Case]]


def _no_requirement(caps: Capabilities) -> str | None:
    return None


def _no_examples(profile: Profile, caps: Capabilities) -> list[Case]:
    return []


@dataclass(frozen=True)
class Property:
    """One property: an id, what it checks, the bug classes it targets, how to check it."""

    id: str
    summary: str
    classes: tuple[int, ...]
    cases: Cases
    check: Check
    #: why a backend with these capabilities cannot be held to this property, or None
    requires: Callable[[Capabilities], str | None] = field(default=_no_requirement)
    #: explicit cases, run once Hypothesis' own search has found nothing
    examples: Callable[[Profile, Capabilities], list[Case]] = field(default=_no_examples)
    gradient: bool = False


def _gen(case: Case, salt: int) -> torch.Generator:
    """A generator for a check's own random choices, fixed by the case's seed."""
    return torch.Generator().manual_seed(case.seed * 1009 + salt)


def _with(inputs: Inputs, **tensors: Tensor | None) -> Inputs:
    return replace(inputs, **tensors)  # type: ignore[arg-type]


@checked_internal
def _law(
    ctx: Context,
    got: Float[Tensor, "*shape"],
    got_inputs: Inputs,
    base: Float[Tensor, "*base"],
    base_inputs: Inputs,
    what: str,
    *,
    transform: Callable[[Tensor], Tensor] = lambda x: x,
    factor: float = 1.0,
    sel: Bool[Tensor, "*#shape"] | None = None,
) -> None:
    """Fail unless ``got ~ transform(base)`` within both calls' bounds on ``sel``.

    ``factor`` is how much ``transform`` scales an error; ``delta`` covers the change in
    the exact answer that rounding the transformed inputs makes.
    """
    eg, eb = ctx.expect(got_inputs), ctx.expect(base_inputs)
    want = transform(base.to(torch.float64))
    exact = transform(eb.value)
    diff = (eg.value - exact).abs()
    usable = torch.isfinite(diff) if sel is None else torch.isfinite(diff) & sel.expand_as(diff)
    delta = float(diff[usable].max()) if usable.any() else 0.0
    gmax, gmean = eg.bounds(sel)
    bmax, bmean = eb.bounds(sel)
    close(
        got.to(torch.float64),
        want,
        gmax + abs(factor) * bmax + delta,
        gmean + abs(factor) * bmean + delta,
        what,
        sel,
    )


@checked_internal
def _rows(sel: Bool[Tensor, "*rows"]) -> Bool[Tensor, "*rows 1"]:
    """``(..., Tq)`` row selection as a ``(..., Tq, 1)`` mask over an output."""
    return sel.unsqueeze(-1)


# ------------------------------------------------------------------------ agreement


def _forward(ctx: Context, case: Case) -> None:
    ctx.agree(ctx.build(case))


def _gradient(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    if ctx.caps.empty_row != "zero" and bool(empty_rows(inputs).any()):
        raise Skip(f"gradients of rows with no visible key under policy {ctx.caps.empty_row!r}")
    d_out = torch.randn(
        (*inputs.query.shape[:-1], inputs.value.shape[-1]), generator=_gen(case, 1)
    ).to(device=inputs.query.device, dtype=inputs.query.dtype)
    q, k, v = (t.detach().requires_grad_(True) for t in (inputs.query, inputs.key, inputs.value))
    leaves = _with(inputs, query=q, key=k, value=v)
    args, kwargs = arguments(ctx.backend, leaves)

    def forward_backward() -> tuple[Tensor | None, ...]:
        out = ctx.backend(*args, **kwargs)
        if not isinstance(out, Tensor) or not out.requires_grad:
            raise RuntimeError("the output does not require grad: no gradient reaches Q, K, V")
        grads: tuple[Tensor | None, ...] = torch.autograd.grad(
            out, (q, k, v), d_out, allow_unused=True
        )
        return grads

    grads = invoke(ctx.backend, forward_backward, ctx.timeout)
    expected = expect_grads(inputs, d_out)
    for name, g, leaf, exp in zip(("dQ", "dK", "dV"), grads, (q, k, v), expected, strict=True):
        if g is None:
            raise Failure(f"{name} is None: the output does not depend on it")
        if tuple(g.shape) != tuple(leaf.shape):
            raise Failure(f"{name} has shape {tuple(g.shape)}, expected {tuple(leaf.shape)}")
        close(g.detach().to(torch.float64), exp.value, *exp.bounds(), name)


# ------------------------------------------------------------------------------ laws


def _masked_keys(ctx: Context, case: Case) -> None:
    dirty_inputs = ctx.build(case)
    clean_inputs = ctx.build(replace(case, poison="none"))
    clean = ctx.run(clean_inputs)
    dirty = ctx.run(dirty_inputs)
    _law(ctx, dirty, clean_inputs, clean, clean_inputs, f"output with {case.poison} at hidden keys")


def _key_permutation(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    Tk = inputs.key.shape[-2]
    perm = torch.randperm(Tk, generator=_gen(case, 2)).to(inputs.key.device)
    mask = inputs.attn_mask
    if mask is not None and mask.shape[-1] == Tk:
        mask = mask[..., perm]
    permuted = _with(inputs, key=inputs.key[..., perm, :], value=inputs.value[..., perm, :])
    permuted = _with(permuted, attn_mask=mask)
    _law(ctx, ctx.run(permuted), permuted, ctx.run(inputs), inputs, "output with keys permuted")


def _row_independence(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    gen = _gen(case, 3)
    q = inputs.query
    changed = torch.rand(q.shape[-2], generator=gen) < 0.5
    fresh = case.amp * torch.randn(q.shape, generator=gen)
    new_q = torch.where(changed.unsqueeze(-1), fresh, q.detach().cpu().float())
    other = _with(inputs, query=new_q.to(device=q.device, dtype=q.dtype))
    keep = _rows(~changed.to(q.device))
    _law(ctx, ctx.run(other), other, ctx.run(inputs), inputs, "unchanged queries", sel=keep)


def _causality(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    gen = _gen(case, 4)
    Tk = inputs.key.shape[-2]
    cut = int(torch.randint(0, Tk + 1, (), generator=gen))
    k, v = inputs.key, inputs.value
    later = (torch.arange(Tk) >= cut).to(k.device).unsqueeze(-1)
    new_k = torch.where(later, torch.randn(k.shape, generator=gen).to(k), k)
    new_v = torch.where(later, torch.randn(v.shape, generator=gen).to(v), v)
    future = _with(inputs, key=new_k, value=new_v)
    blind = ~inputs.visible()[..., cut:].any(dim=-1)  # rows that see no key at or after cut
    _law(
        ctx,
        ctx.run(future),
        future,
        ctx.run(inputs),
        inputs,
        f"rows that see no key past {cut - 1}",
        sel=_rows(blind),
    )


def _shift_invariance(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    q = inputs.query
    Tq, Tk = q.shape[-2], inputs.key.shape[-2]
    # a float mask on a half-integer grid, so that adding integers below 128 is exact in
    # every dtype: the two calls then have exactly the same answer
    mask = inputs.attn_mask
    base = torch.zeros(Tq, Tk) if mask is None else (mask.cpu().float() * 2).round() / 2
    shift = torch.randint(-100, 101, (Tq, 1), generator=_gen(case, 5)).float()
    plain = _with(inputs, attn_mask=base.to(device=q.device, dtype=q.dtype))
    shifted = _with(inputs, attn_mask=(base + shift).to(device=q.device, dtype=q.dtype))
    _law(ctx, ctx.run(shifted), shifted, ctx.run(plain), plain, "output with row scores shifted")


def _value_affine(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    gen = _gen(case, 6)
    a = float(torch.tensor([-2.0, 0.5, 3.0, -0.75])[torch.randint(0, 4, (), generator=gen)])
    b = float(torch.randn((), generator=gen)) * 3
    v = inputs.value
    moved = _with(inputs, value=(a * v.to(torch.float64) + b).to(v.dtype))
    seen = _rows(~empty_rows(inputs).squeeze(-1))  # rows with no key hold the policy's value
    _law(
        ctx,
        ctx.run(moved),
        moved,
        ctx.run(inputs),
        inputs,
        f"out(q, k, {a:g} v + {b:.3g})",
        transform=lambda out: a * out + b,
        factor=a,
        sel=seen,
    )


def _decode(ctx: Context, case: Case) -> None:
    """Each query alone, against the keys it sees causally (a KV cache), with no mask."""
    inputs = ctx.build(case)
    assert inputs.causal is not None
    full = ctx.run(inputs)
    q, k, v, mask = inputs.query, inputs.key, inputs.value, inputs.attn_mask
    Tq, Tk = q.shape[-2], k.shape[-2]
    offset = 0 if inputs.causal == "top_left" else Tk - Tq
    rows = sorted({0, Tq - 1, int(torch.randint(0, Tq, (), generator=_gen(case, 7)))})
    for i in rows:
        n = min(Tk, i + offset + 1)
        if n <= 0:
            continue  # this query sees nothing: the empty-row property's business
        row_mask = None if mask is None else mask[..., i if mask.shape[-2] > 1 else 0, None, :n]
        step = Inputs(
            q[..., i : i + 1, :], k[..., :n, :], v[..., :n, :], row_mask, None, inputs.scale
        )
        _law(
            ctx,
            ctx.run(step),
            step,
            full,
            inputs,
            f"query {i} decoded alone against {n} keys",
            transform=lambda out, i=i: out[..., i : i + 1, :],  # type: ignore[misc]
        )


def _gqa(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    h = inputs.query.shape[-3]
    expanded = _with(
        inputs, key=F.expand_kv_heads(inputs.key, h), value=F.expand_kv_heads(inputs.value, h)
    )
    _law(ctx, ctx.run(inputs), inputs, ctx.run(expanded), expanded, "GQA against expanded heads")


def _batch(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    full = ctx.run(inputs)
    B = inputs.query.shape[0]
    for b in sorted({0, B - 1}):

        def one(t: Tensor | None, b: int = b) -> Tensor | None:
            if t is None or t.dim() < 4 or t.shape[0] == 1:
                return t
            return t[b : b + 1]

        alone = Inputs(
            one(inputs.query),  # type: ignore[arg-type]
            one(inputs.key),  # type: ignore[arg-type]
            one(inputs.value),  # type: ignore[arg-type]
            one(inputs.attn_mask),
            inputs.causal,
            inputs.scale,
        )
        _law(
            ctx,
            ctx.run(alone),
            alone,
            full,
            inputs,
            f"sample {b} alone",
            transform=lambda out, b=b: out[b : b + 1],  # type: ignore[misc]
        )


def _dropout_zero(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    first = ctx.agree(inputs, "first call with dropout_p=0")
    again = ctx.run(inputs, dropout_p=0.0)
    _law(ctx, again, inputs, first, inputs, "second call with dropout_p=0")


def _mask_kinds(ctx: Context, case: Case) -> None:
    inputs = ctx.build(case)
    mask = inputs.attn_mask
    assert mask is not None
    assert mask.dtype == torch.bool
    additive = torch.zeros(mask.shape, dtype=inputs.query.dtype, device=mask.device)
    as_float = _with(inputs, attn_mask=additive.masked_fill(~mask, float("-inf")))
    _law(ctx, ctx.run(as_float), as_float, ctx.run(inputs), inputs, "float mask against bool mask")


# ------------------------------------------------------------------------ registry


def _needs(flag: str, what: str) -> Callable[[Capabilities], str | None]:
    def requires(caps: Capabilities) -> str | None:
        return None if getattr(caps, flag) else f"{what} not declared"

    return requires


def _masks_and_floats(caps: Capabilities) -> str | None:
    if not (caps.bool_mask and caps.float_mask):
        return "needs both boolean and float masks"
    return None


_HIDING = ("padding", "columns", "bool", "bool_full")


def _poisons(caps: Capabilities) -> st.SearchStrategy[str]:
    return st.sampled_from(
        ("garbage", "nan", "inf") if caps.masked_nan == "contained" else ("garbage",)
    )


def _degenerate(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
    dims = st.sampled_from((0, 1, 2, 8)) if c.zero_head_dim else st.sampled_from((1, 2, 8))
    families = [
        case_strategy("degenerate", p, c, Tq=1),
        case_strategy("degenerate", p, c, Tk=1),
        case_strategy("degenerate", p, c, Dh=dims, Dv=st.sampled_from((1, 3, 16))),
        case_strategy("degenerate", p, c, Dh=dims, Dv=dims, Tq=st.sampled_from((1, 2, 5))),
    ]
    if c.zero_head_dim:
        families.append(case_strategy("degenerate", p, c, Dh=0, Dv=st.sampled_from((8, 1, 3))))
    return st.one_of(*families)


def _large_index(p: Profile, c: Capabilities) -> st.SearchStrategy[Case]:
    @st.composite
    def draw(draw: st.DrawFn) -> Case:
        g = draw(st.integers(1, p.max_kv_heads))
        Tk = draw(st.sampled_from((p.tail_lengths[-1], 97, 160)))
        B = -(-p.large_rows // (g * Tk))  # enough key rows to pass large_rows
        return Case(
            "large_index",
            batch=(B,),
            h=g * draw(st.sampled_from((1, 2)) if c.gqa else st.just(1)),
            g=g,
            Tq=draw(st.sampled_from((1, 2, 3))),
            Tk=Tk,
            Dh=draw(st.sampled_from((1, 2, 4))),
            Dv=draw(st.sampled_from((1, 2))),
            mask=draw(st.sampled_from(masks_for(c, ("none", "padding")))),
            seed=draw(st.integers(0, 2**16)),
        )

    return draw()


PROPERTIES: dict[str, Property] = {
    p.id: p
    for p in [
        Property(
            "forward",
            "output agrees with the float64 oracle over every kind of case",
            (1, 2, 4, 5, 9, 10, 14, 15, 16, 17, 20),
            lambda p, c: case_strategy("forward", p, c),
            _forward,
            examples=lambda p, c: [x for x in fixed_grid() if x.poison == "none"],
        ),
        Property(
            "gradient",
            "dQ, dK and dV agree with the float64 oracle's",
            (11, 12),
            lambda p, c: case_strategy("gradient", p, c),
            _gradient,
            requires=_needs("gradients", "gradients"),
            gradient=True,
        ),
        Property(
            "masked_keys",
            "values (finite, or NaN/inf where the backend contains them) at keys no query "
            "sees never change the output",
            (3, 16),
            lambda p, c: case_strategy(
                "masked_keys",
                p,
                c,
                mask=st.sampled_from(masks_for(c, _HIDING)),
                poison=_poisons(c),
            ),
            _masked_keys,
            examples=lambda p, c: [
                replace(x, poison="nan" if c.masked_nan == "contained" else "garbage")
                for x in fixed_grid()
                if x.poison != "none"
            ],
        ),
        Property(
            "key_permutation",
            "permuting key/value pairs (and mask columns) together changes nothing",
            (6, 12, 13),
            lambda p, c: case_strategy("key_permutation", p, c, causal=None),
            _key_permutation,
        ),
        Property(
            "row_independence",
            "each output row depends only on its own query",
            (15, 17),
            lambda p, c: case_strategy("row_independence", p, c),
            _row_independence,
        ),
        Property(
            "causality",
            "keys after a query's causal diagonal never change its output",
            (4, 5),
            lambda p, c: case_strategy(
                "causality", p, c, causal=st.sampled_from(("top_left", "bottom_right"))
            ),
            _causality,
        ),
        Property(
            "shift_invariance",
            "a constant added to a row of scores (through a float mask) changes nothing",
            (8, 13, 16),
            lambda p, c: case_strategy(
                "shift_invariance",
                p,
                c,
                mask=st.sampled_from(masks_for(c, ("none", "float"))),
                amp=st.sampled_from((1.0, 4.0, 8.0)),
            ),
            _shift_invariance,
            requires=_needs("float_mask", "float masks"),
        ),
        Property(
            "value_affine",
            "out(q, k, a*v + b) = a*out(q, k, v) + b: the weights of a row sum to 1",
            (2, 13, 15),
            lambda p, c: case_strategy("value_affine", p, c),
            _value_affine,
        ),
        Property(
            "decode",
            "one query at a time against its visible prefix equals the causal pass",
            (4, 10, 18),
            lambda p, c: case_strategy(
                "decode",
                p,
                c,
                causal=st.sampled_from(("top_left", "bottom_right")),
                mask=st.sampled_from(masks_for(c, ("none", "padding", "bool", "float"))),
            ),
            _decode,
        ),
        Property(
            "gqa",
            "grouped-query attention equals attention with the KV heads expanded",
            (9, 10),
            lambda p, c: case_strategy("gqa", p, c, group=st.sampled_from((2, 3, 4))),
            _gqa,
            requires=_needs("gqa", "GQA"),
        ),
        Property(
            "batch",
            "each sample of a batch gives the same output alone",
            (6, 7, 17, 21),
            lambda p, c: case_strategy("batch", p, c, batch=st.tuples(st.integers(2, p.max_batch))),
            _batch,
        ),
        Property(
            "dropout_zero",
            "dropout_p = 0 applies no dropout: calls agree with the oracle and each other",
            (19,),
            lambda p, c: case_strategy("dropout_zero", p, c),
            _dropout_zero,
        ),
        Property(
            "empty_rows",
            "a query with no visible key gets the declared policy (zeros by default)",
            (1, 2),
            lambda p, c: st.one_of(
                case_strategy(
                    "empty_rows", p, c, mask=st.sampled_from(masks_for(c, ("empty_rows",)))
                ),
                case_strategy(
                    "empty_rows",
                    p,
                    c,
                    causal="bottom_right",
                    Tq=st.integers(2, p.max_len),
                    Tk=st.integers(1, 8),
                ),
            ),
            _forward,
        ),
        Property(
            "layouts",
            "transposed, sliced (storage offset) and stride-0 broadcast inputs",
            (6, 7),
            lambda p, c: case_strategy("layouts", p, c, layout=st.sampled_from(LAYOUTS)),
            _forward,
        ),
        Property(
            "degenerate",
            "Tq = 1, Tk = 1, Dv != Dqk and Dqk = 0",
            (10, 18, 20),
            _degenerate,
            _forward,
            examples=lambda p, c: [
                *([Case("degenerate_dqk0", Dh=0, Dv=8)] if c.zero_head_dim else []),
                Case("degenerate_tk1_masked", Tk=1, mask="bool", seed=1),
                Case("degenerate_tq1_gqa", h=4, g=2, Tq=1, Tk=9, seed=2),
                Case("degenerate_dv_ne_dqk", Dh=16, Dv=3, seed=3),
            ],
        ),
        Property(
            "tails",
            "lengths that are not multiples of common tile sizes (31, 127, 129, primes)",
            (12, 13),
            lambda p, c: case_strategy(
                "tails",
                p,
                c,
                Tq=st.sampled_from(p.tail_lengths),
                Tk=st.sampled_from(p.tail_lengths),
                Dh=st.sampled_from((64, 80, 128, 16)),
                batch=(1,),
                g=1,
            ),
            _forward,
        ),
        Property(
            "hot",
            "scaled randn queries and keys: peaky softmax, scores far from zero",
            (8, 13),
            lambda p, c: case_strategy("hot", p, c, amp=st.sampled_from((4.0, 8.0, 16.0, 32.0))),
            _forward,
        ),
        Property(
            "scale",
            "the default scale 1/sqrt(Dqk) and explicit scales",
            (14,),
            lambda p, c: case_strategy(
                "scale",
                p,
                c,
                scale=st.sampled_from((None, 0.05, 0.37, 1.0, 3.0)),
                Dh=st.sampled_from((1, 3, 16, 64, 80, 128)),
            ),
            _forward,
        ),
        Property(
            "mask_kinds",
            "a boolean mask and its additive float equivalent (0 / -inf) agree",
            (16,),
            lambda p, c: case_strategy(
                "mask_kinds",
                p,
                c,
                mask=st.sampled_from(("bool", "bool_full", "padding", "columns", "empty_rows")),
            ),
            _mask_kinds,
            requires=_masks_and_floats,
        ),
        Property(
            "large_index",
            "many key rows (batch * g * Tk past 2**15 in the quick profile)",
            (21,),
            _large_index,
            _forward,
        ),
    ]
}


def get_property(pid: str) -> Property:
    """The property called ``pid``; a clear error for an unknown one."""
    try:
        return PROPERTIES[pid]
    except KeyError:
        raise ValueError(f"unknown property {pid!r}: use one of {', '.join(PROPERTIES)}") from None


def check_case(
    pid: str, backend: Backend, case: Case, dtype: torch.dtype, device: str = "cpu"
) -> str:
    """Check one case of property ``pid``: ``"pass"``, ``"skip: why"`` or ``"FAIL: why"``.

    What reproducers call.
    """
    try:
        get_property(pid).check(Context(backend, dtype, device), case)
    except Skip as s:
        return f"skip: {s}"
    except Failure as f:
        return f"FAIL: {f}"
    return "pass"


def property_seed(seed: int, pid: str, dtype: torch.dtype) -> int:
    """The Hypothesis seed of one (property, dtype) run of an audit seeded ``seed``."""
    return zlib.crc32(f"{seed}:{pid}:{dtype}".encode())
