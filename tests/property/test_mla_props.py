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

from attnref.cache import RepresentationCache
from attnref.layers import MultiHeadLatentAttention, mla_softmax_scale
from attnref.mla import mla_kvcache_attention


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
    cache = RepresentationCache()
    with torch.no_grad():
        full = m(x, absorbed=absorbed)
        steps = [m(x[:, :prompt], cache=cache, absorbed=absorbed)] if prompt else []
        steps += [m(x[:, t : t + 1], cache=cache, absorbed=absorbed) for t in range(prompt, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
    assert cache.history is not None  # one row a token, nothing per head
    assert cache.history.shape == (x.shape[0], T, m.kv_rank + m.rope_head_dim)


def _paged(rows: Tensor, page: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``rows (B, T, D)`` in a paged cache ``(blocks, page, 1, D)`` whose physical pages
    are shuffled, with NaN in every slot no valid token holds (and one spare page), and a
    block table padded with a huge page id: what FlashMLA's own tests do."""
    B, T, D = rows.shape
    per_row = -(-T // page) + 1  # one logical page more than needed: padded with a huge id
    used = -(-T // page)
    blocks = B * used + 1
    cache = torch.full((blocks, page, 1, D), torch.nan, dtype=rows.dtype)
    order = torch.randperm(blocks, generator=gen)[: B * used].reshape(B, used)
    table = torch.full((B, per_row), 2**30, dtype=torch.int32)
    table[:, :used] = order.to(torch.int32)
    for b in range(B):
        for t in range(T):
            cache[order[b, t // page], t % page, 0] = rows[b, t]
    return cache, table


@given(config=mla_configs(), data=st.data())
def test_the_layer_s_absorbed_decode_is_flash_mla_s_call(
    config: tuple[MultiHeadLatentAttention, Tensor], data: st.DataObject
) -> None:
    """The law only MLA has, through FlashMLA's convention: the layer's last ``Tq``
    tokens equal `mla_kvcache_attention` on the absorbed queries against its latent rows
    in a shuffled paged cache (NaN in unused slots, a table padded with huge ids), V the
    cache's first ``kv_rank`` dims, the model's scale, bottom-right causal; then W_UV and
    W_O. With no key for a query (``Tq`` past the cache) the kernel's answer is 0, +inf."""
    m, x = config
    B, T, _ = x.shape
    Tq = data.draw(st.integers(1, T))
    page = data.draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    with torch.no_grad():
        latent, k_pe = m.latent_rows(x)
        q_nope, q_pe = m.queries(x[:, T - Tq :], T - Tq)
        w_uk, w_uv = m.up_projections()
        q = torch.cat((torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk), q_pe), -1)
        cache, table = _paged(torch.cat((latent, k_pe), -1), page, gen)
        seqlens = torch.full((B,), T, dtype=torch.int32)
        out, lse = mla_kvcache_attention(
            q.transpose(1, 2), cache, table, seqlens, m.kv_rank,
            softmax_scale=m.softmax_scale, causal=True,
        )  # fmt: skip
        heads = torch.einsum("bthc,hvc->bhtv", out, w_uv)
        got = m.output_proj(heads.transpose(1, 2).flatten(2))
        torch.testing.assert_close(got, m(x)[:, T - Tq :])
        assert lse.dtype == torch.float64  # float32 for half inputs, as FlashMLA
        assert bool(torch.isfinite(lse).all())
        # a sequence one key shorter than its queries: the first query sees no key
        short = torch.full((B,), Tq - 1, dtype=torch.int32)
        out, lse = mla_kvcache_attention(
            q.transpose(1, 2), cache, table, short, m.kv_rank, causal=True
        )
        assert bool((out[:, 0] == 0).all())
        assert bool(torch.isposinf(lse[:, :, 0]).all())
        assert bool(torch.isfinite(lse[:, :, 1:]).all())


def test_flash_mla_s_default_scale_is_its_head_dim_s() -> None:
    """``softmax_scale=None`` is the kernel's ``D ** -0.5`` (576 in DeepSeek V3), which a
    caller of a model must not rely on."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 2, 12, generator=gen, dtype=torch.float64)
    cache = torch.randn(2, 4, 1, 12, generator=gen, dtype=torch.float64)
    table, lengths = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)
    default, _ = mla_kvcache_attention(q, cache, table, lengths, 8)
    explicit, _ = mla_kvcache_attention(q, cache, table, lengths, 8, softmax_scale=12**-0.5)
    other, _ = mla_kvcache_attention(q, cache, table, lengths, 8, softmax_scale=9**-0.5)
    torch.testing.assert_close(default, explicit)
    assert not torch.allclose(default, other)
    with pytest.raises(ValueError, match=r"head_dim_v must be an int in 1 \.\. 12"):
        mla_kvcache_attention(q, cache, table, lengths, 13)


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
