"""Invariants of the gated delta rule (`attnref.linear`, docs/linear.md).

The chunked form (the prefill kernels' WY representation) equals the recurrence for
every chunk size, packing, GVA, per-channel decay, initial state and L2 norm; the
recurrence equals a hand-worked two-token example; and the laws a serving stack relies
on hold: a sequence split anywhere, its first part's final state passed on, equals one
call; each packed sequence equals itself alone; GVA equals the heads repeated; a decay
far below 0 forgets everything before it; ``beta = 0`` leaves the state as it was.
"""

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from attnref.linear import chunked_gated_delta_rule, gated_delta_rule, l2norm

Inputs = dict[str, Tensor | None]
Options = dict[str, Any]
F64 = torch.float64


@st.composite
def problems(draw: st.DrawFn, max_t: int = 70) -> tuple[Inputs, Options]:
    """Float64 inputs of fla's convention: GVA heads, a decay per head or per key
    channel (or none), an initial state or none, packed sequences or a batch."""
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    H = draw(st.integers(1, 2))
    HV = H * draw(st.integers(1, 3))
    K, V = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    packed = draw(st.booleans())
    if packed:
        lengths = draw(st.lists(st.integers(0, max_t // 2), min_size=1, max_size=4))
        B, T = 1, sum(lengths) + draw(st.integers(0, 3))  # padding after the last
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        cu: Tensor | None = torch.tensor(offsets, dtype=torch.int64)
        N = len(lengths)
    else:
        B, T, cu = draw(st.integers(1, 2)), draw(st.integers(1, max_t)), None
        N = B
    decay = draw(st.sampled_from(["g", "gk", "none", "both"]))
    inputs: Inputs = {
        "q": torch.randn(B, T, H, K, dtype=F64),
        "k": torch.randn(B, T, H, K, dtype=F64) * 0.5,
        "v": torch.randn(B, T, HV, V, dtype=F64),
        "g": -torch.rand(B, T, HV, dtype=F64) * 2 if decay in ("g", "both") else None,
        "beta": torch.rand(B, T, HV, dtype=F64),
    }
    options: Options = {
        "gk": -torch.rand(B, T, HV, K, dtype=F64) if decay in ("gk", "both") else None,
        "initial_state": torch.randn(N, HV, K, V, dtype=F64) if draw(st.booleans()) else None,
        "cu_seqlens": cu,
        "l2norm_qk": draw(st.booleans()),
        "scale": draw(st.sampled_from([None, 0.3])),
    }
    return inputs, options


def call(fn: Any, inputs: Inputs, **options: Any) -> tuple[Tensor, Tensor]:
    out: tuple[Tensor, Tensor] = fn(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], **options
    )
    return out


def shape(inputs: Inputs) -> tuple[int, ...]:
    """The queries' shape, ``(B, T, H, K)``."""
    q = inputs["q"]
    assert q is not None
    return tuple(q.shape)


def tokens(x: Tensor | None, a: int, b: int | None = None) -> Tensor | None:
    """Tokens ``a:b`` of a ``(B, T, ...)`` tensor, or None."""
    return None if x is None else x[:, a:b]


@given(problems(), st.sampled_from([1, 3, 16, 64]))
def test_the_chunked_form_equals_the_recurrence(
    problem: tuple[Inputs, Options], chunk: int
) -> None:
    inputs, options = problem
    o, s = call(gated_delta_rule, inputs, **options)
    oc, sc = call(chunked_gated_delta_rule, inputs, chunk=chunk, **options)
    torch.testing.assert_close(oc, o, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(sc, s, rtol=1e-9, atol=1e-9)


def test_a_hand_worked_two_token_example() -> None:
    """docs/linear.md's example: one head, K = V = 1, scale 1, decays of 1/2, beta 1/2.
    Token 1: S = 0, u = 1/2 (2 - 0) = 1, S = 1, o = 1. Token 2: S = 1/2, u = 1/2 (3 -
    1/2) = 5/4, S = 7/4, o = 7/4 * 2 = 7/2 (undecayed, the state would be 2 and o 4)."""
    half = torch.tensor(0.5, dtype=torch.float64).log()
    inputs: Inputs = {
        "q": torch.tensor([1.0, 2.0], dtype=torch.float64).view(1, 2, 1, 1),
        "k": torch.ones(1, 2, 1, 1, dtype=torch.float64),
        "v": torch.tensor([2.0, 3.0], dtype=torch.float64).view(1, 2, 1, 1),
        "g": torch.stack([half, half]).view(1, 2, 1),
        "beta": torch.tensor([0.5, 0.5], dtype=torch.float64).view(1, 2, 1),
    }
    for fn in (gated_delta_rule, chunked_gated_delta_rule):
        o, s = call(fn, inputs, scale=1.0)
        assert o.flatten().tolist() == pytest.approx([1.0, 3.5])
        assert s.flatten().tolist() == pytest.approx([1.75])


@given(problems(), st.data())
def test_a_sequence_split_anywhere_continues_from_its_state(
    problem: tuple[Inputs, Options], data: st.DataObject
) -> None:
    """The prefill/decode hand-off: the first part's final state, passed as the second
    part's initial state, gives the output and state of one call."""
    inputs, options = problem
    if options["cu_seqlens"] is not None:
        return  # a batch here; packing has its own law below
    cut = data.draw(st.integers(0, shape(inputs)[1]))
    whole, final = call(gated_delta_rule, inputs, **options)
    first = {n: tokens(x, 0, cut) for n, x in inputs.items()}
    second = {n: tokens(x, cut) for n, x in inputs.items()}
    gk = options["gk"]
    o1, s1 = call(gated_delta_rule, first, **{**options, "gk": tokens(gk, 0, cut)})
    on = {**options, "gk": tokens(gk, cut), "initial_state": s1}
    o2, s2 = call(chunked_gated_delta_rule, second, **on)
    torch.testing.assert_close(torch.cat([o1, o2], 1), whole, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s2, final, rtol=1e-9, atol=1e-9)


@given(problems())
def test_each_packed_sequence_equals_itself_alone(
    problem: tuple[Inputs, Options],
) -> None:
    inputs, options = problem
    cu = options["cu_seqlens"]
    if cu is None:
        return
    o, s = call(chunked_gated_delta_rule, inputs, **options)
    offsets = [int(x) for x in cu.tolist()]
    gk, h0 = options["gk"], options["initial_state"]
    for n, (a, b) in enumerate(itertools.pairwise(offsets)):
        alone = {name: tokens(x, a, b) for name, x in inputs.items()}
        on = {**options, "cu_seqlens": None, "gk": tokens(gk, a, b),
              "initial_state": None if h0 is None else h0[n : n + 1]}  # fmt: skip
        oa, sa = call(gated_delta_rule, alone, **on)
        torch.testing.assert_close(o[:, a:b], oa, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(s[n : n + 1], sa, rtol=1e-9, atol=1e-9)
    assert not o[:, offsets[-1] :].any()  # padding after the last sequence: 0


@given(problems())
def test_gva_equals_the_query_and_key_heads_repeated(
    problem: tuple[Inputs, Options],
) -> None:
    inputs, options = problem
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    assert q is not None
    assert k is not None
    assert v is not None
    group = v.shape[2] // q.shape[2]
    repeated = {**inputs, "q": q.repeat_interleave(group, 2), "k": k.repeat_interleave(group, 2)}
    o, s = call(chunked_gated_delta_rule, inputs, **options)
    o2, s2 = call(gated_delta_rule, repeated, **options)
    torch.testing.assert_close(o, o2, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s, s2, rtol=1e-9, atol=1e-9)


@given(problems(), st.data())
def test_a_decay_far_below_zero_forgets_everything_before_it(
    problem: tuple[Inputs, Options], data: st.DataObject
) -> None:
    """A model's ``-exp(A) * softplus(...)`` reaches decays of -1e4 and below: from
    there on, the outputs are those of a fresh start (no state) at that token, in the
    chunked form too (a ratio of decays would be 0 / 0 there)."""
    inputs, options = problem
    if options["cu_seqlens"] is not None or inputs["g"] is None:
        return
    at = data.draw(st.integers(0, shape(inputs)[1] - 1))
    g = inputs["g"].clone()
    g[:, at] = -1e4
    forget = {**inputs, "g": g}
    o, s = call(chunked_gated_delta_rule, forget, **options)
    fresh = {n: tokens(x, at) for n, x in forget.items()}
    on = {**options, "initial_state": None, "gk": tokens(options["gk"], at)}
    o2, s2 = call(gated_delta_rule, fresh, **on)
    torch.testing.assert_close(o[:, at:], o2, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s, s2, rtol=1e-9, atol=1e-9)


@given(problems())
def test_beta_zero_leaves_the_state_as_it_was(problem: tuple[Inputs, Options]) -> None:
    """With no decay and ``beta = 0`` nothing is written: the final state is the initial
    one, and every output reads it."""
    inputs, options = problem
    if options["cu_seqlens"] is not None:
        return
    beta = inputs["beta"]
    assert beta is not None
    still = {**inputs, "g": None, "beta": torch.zeros_like(beta)}
    h0 = options["initial_state"]
    o, s = call(chunked_gated_delta_rule, still, **{**options, "gk": None})
    q = inputs["q"]
    assert q is not None
    if h0 is None:
        assert not o.any()
        assert not s.any()
        return
    torch.testing.assert_close(s, h0, rtol=0, atol=0)
    v = inputs["v"]
    assert v is not None
    group = v.shape[2] // q.shape[2]
    qn = l2norm(q) if options["l2norm_qk"] else q
    scale = options["scale"] or q.shape[-1] ** -0.5
    reads = torch.einsum("bthk,bhkv->bthv", qn.repeat_interleave(group, 2) * scale, h0)
    torch.testing.assert_close(o, reads, rtol=1e-9, atol=1e-9)


def test_bad_shapes_and_offsets_are_named() -> None:
    q = torch.randn(1, 4, 2, 3, dtype=torch.float64)
    v = torch.randn(1, 4, 3, 2, dtype=torch.float64)  # 3 value heads on 2 query heads
    g = beta = torch.zeros(1, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"HV = 3\) must be a multiple of .*H = 2"):
        gated_delta_rule(q, q, v, g, beta)
    v = torch.randn(1, 4, 2, 2, dtype=torch.float64)
    g = beta = torch.zeros(1, 4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to at most T = 4"):
        gated_delta_rule(q, q, v, g, beta, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="initial_state must have shape"):
        gated_delta_rule(
            q, q, v, g, beta, initial_state=torch.zeros(2, 2, 3, 2, dtype=torch.float64)
        )
