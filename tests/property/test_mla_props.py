"""Invariants of multi-head latent attention (`attnref.layers.MultiHeadLatentAttention`).

The module is checked against an oracle written from the equations (docs/mla.md), head
by head, with the rotary turn done through complex numbers as DeepSeek's inference code
does; the two paths (naive, absorbed) against each other; and cached decoding against
the full forward.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from attnref.layers import LatentCache, MultiHeadLatentAttention, mla_softmax_scale


@st.composite
def mla_configs(draw: st.DrawFn) -> tuple[MultiHeadLatentAttention, Tensor]:
    """A seeded float64 MLA (dims small, each possibly 0 where DeepSeek's may be) and its
    input ``(B, T, H)``."""
    h = draw(st.integers(1, 4))
    H = draw(st.sampled_from([4, 8, 12]))
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    rope = draw(st.sampled_from([0, 2, 4]))
    nope = draw(st.integers(0 if rope else 1, 6))  # a query head has a dim at least
    mla = MultiHeadLatentAttention(
        num_hiddens=H,
        num_heads=h,
        q_rank=draw(st.sampled_from([0, 3, 8])),
        kv_rank=draw(st.integers(1, 10)),
        nope_head_dim=nope,
        rope_head_dim=rope,
        v_head_dim=draw(st.integers(1, 6)),
        rope_factor=draw(st.sampled_from([1.0, 4.0, 40.0])),
        mscale=draw(st.sampled_from([0.707, 1.0])),
    ).double()
    with torch.no_grad():  # norms with weights other than 1, as a trained model has
        for norm in (mla.q_norm, mla.kv_norm):
            if isinstance(norm, torch.nn.RMSNorm) and norm.weight is not None:
                norm.weight.uniform_(0.5, 1.5)
    B, T = draw(st.integers(1, 2)), draw(st.integers(1, 7))
    x = torch.randn(B, T, H, dtype=torch.float64)
    return mla.eval(), x


def _turn(x: Tensor, start: int, base: float) -> Tensor:
    """Rotary, interleaved pairs, as DeepSeek writes it: ``x`` as complex numbers of
    consecutive pairs, times ``exp(i * t * theta_j)``."""
    R = x.shape[-1]
    if R == 0:
        return x
    theta = base ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    t = torch.arange(start, start + x.shape[-2], dtype=torch.float64)
    turns = torch.polar(torch.ones(len(t), R // 2, dtype=torch.float64), torch.outer(t, theta))
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], R // 2, 2).clone())
    return torch.view_as_real(pairs * turns).flatten(-2)


def _oracle(m: MultiHeadLatentAttention, x: Tensor, causal: bool) -> Tensor:
    """The equations, head by head and token by token."""
    h, n, r = m.num_heads, m.nope_head_dim, m.rope_head_dim
    base = m.rotary.base
    q_all = m.q_up(m.q_norm(m.q_down(x))).view(*x.shape[:2], h, n + r)
    kv = m.kv_down(x)
    c_kv = m.kv_norm(kv[..., : m.kv_rank])  # (B, T, kv_rank)
    k_pe = _turn(kv[..., m.kv_rank :], 0, base)
    w = m.kv_up.weight.view(h, n + m.v_head_dim, m.kv_rank)
    scale = (n + r) ** -0.5  # YaRN's m ** 2 where the context is stretched
    if m.rope_factor > 1:
        scale *= (0.1 * m.mscale * math.log(m.rope_factor) + 1) ** 2
    B, T, _ = x.shape
    out = torch.zeros(B, T, h, m.v_head_dim, dtype=torch.float64)
    for b in range(B):
        for i in range(h):
            keys = torch.cat((c_kv[b] @ w[i, :n].T, k_pe[b]), dim=-1)  # (T, n + r)
            values = c_kv[b] @ w[i, n:].T  # (T, d_v)
            q = q_all[b, :, i]
            q = torch.cat((q[:, :n], _turn(q[:, n:], 0, base)), dim=-1)
            for t in range(T):
                seen = slice(0, t + 1) if causal else slice(0, T)
                p = torch.softmax(scale * keys[seen] @ q[t], dim=0)
                out[b, t, i] = p @ values[seen]
    result: Tensor = m.output_proj(out.flatten(2))
    return result


@given(config=mla_configs(), causal=st.booleans(), absorbed=st.booleans())
def test_mla_is_the_equations(
    config: tuple[MultiHeadLatentAttention, Tensor], causal: bool, absorbed: bool
) -> None:
    m, x = config
    with torch.no_grad():
        torch.testing.assert_close(m(x, causal=causal, absorbed=absorbed), _oracle(m, x, causal))


@given(config=mla_configs(), causal=st.booleans())
def test_the_absorbed_path_equals_the_naive_one(
    config: tuple[MultiHeadLatentAttention, Tensor], causal: bool
) -> None:
    """Folding W_UK into the query and W_UV into the output, and attending over the
    latent rows with one key/value head, changes nothing (but rounding)."""
    m, x = config
    with torch.no_grad():
        torch.testing.assert_close(m(x, causal=causal, absorbed=True), m(x, causal=causal))


@given(config=mla_configs(), absorbed=st.booleans(), data=st.data())
def test_decoding_with_a_latent_cache_equals_the_full_forward(
    config: tuple[MultiHeadLatentAttention, Tensor], absorbed: bool, data: st.DataObject
) -> None:
    """A prompt of any length, then one token at a time, against a cache of latent rows
    (kv_rank + d_rope numbers a token, nothing per head), equals one causal forward."""
    m, x = config
    T = x.shape[1]
    prompt = data.draw(st.integers(0, T - 1))
    cache = LatentCache()
    with torch.no_grad():
        full = m(x, absorbed=absorbed)
        steps = [m(x[:, :prompt], cache=cache, absorbed=absorbed)] if prompt else []
        steps += [m(x[:, t : t + 1], cache=cache, absorbed=absorbed) for t in range(prompt, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
    assert cache.latent is not None
    assert cache.rope_keys is not None
    assert cache.latent.shape == (x.shape[0], T, m.kv_rank)
    assert cache.rope_keys.shape == (x.shape[0], T, m.rope_head_dim)


def test_the_scale_is_the_qk_head_dims_with_yarn_not_the_latent_rows() -> None:
    """DeepSeek V3's numbers: 192 ** -0.5 times mscale ** 2 (rope_factor 40, mscale 1:
    m = 0.1 ln 40 + 1), not 576 ** -0.5, the absorbed call's head dim."""
    m = MultiHeadLatentAttention(num_hiddens=64, num_heads=2, q_rank=16, kv_rank=512,
                                 nope_head_dim=128, rope_head_dim=64, v_head_dim=128,
                                 rope_factor=40.0, mscale=1.0)  # fmt: skip
    mscale = 0.1 * math.log(40.0) + 1.0
    assert math.isclose(m.softmax_scale, 192**-0.5 * mscale**2)
    assert not math.isclose(m.softmax_scale, 576**-0.5)
    assert math.isclose(mla_softmax_scale(192), 192**-0.5)  # no YaRN: the plain scale


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rope_head_dim": 3}, "rope_head_dim must be even"),
        ({"kv_rank": 0}, "kv_rank must be an int >= 1"),
        ({"q_rank": -1}, "q_rank must be an int >= 0"),
        ({"rope_factor": 0.5}, "rope_factor must be >= 1"),
    ],
)
def test_bad_configurations_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MultiHeadLatentAttention(num_hiddens=8, num_heads=2, **kwargs)  # type: ignore[arg-type]


def test_a_wrong_width_names_the_argument_and_the_dim() -> None:
    m = MultiHeadLatentAttention(num_hiddens=8, num_heads=2, kv_rank=4, nope_head_dim=2,
                                 rope_head_dim=2, v_head_dim=2)  # fmt: skip
    with pytest.raises(Exception, match=r"(?s)parameter 'x'.*f32\[1,3,7\].*num_hiddens"):
        m(torch.randn(1, 3, 7))
