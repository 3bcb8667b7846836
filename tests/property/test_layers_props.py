"""Invariants of the attention modules, positional encodings and Nadaraya-Watson."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.autograd import gradcheck

from attnref import functional as F
from attnref.layers import (
    AdditiveAttention,
    MultiHeadAttention,
    NadarayaWatson,
    sinusoidal_encoding,
)
from attnref.tolerances import tolerance
from tests.property.strategies import AttnCase, attention_cases, divisors

TOL32 = tolerance(torch.float32)

# the default tier checks a random projection of each Jacobian (fast_mode, about 100x
# cheaper); the slow tier checks every entry
GRADCHECK_MODES = pytest.mark.parametrize(
    "fast_mode", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["fast", "full"]
)


@st.composite
def mha_configs(draw: st.DrawFn) -> tuple[MultiHeadAttention, int, int]:
    """A seeded MultiHeadAttention (possibly GQA/MQA, with or without bias), B and T."""
    h = draw(st.sampled_from([1, 2, 3, 4, 6]))
    Dh = draw(st.integers(1, 5))
    g = draw(st.sampled_from(divisors(h)))
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    mha = MultiHeadAttention(
        num_hiddens=h * Dh, num_heads=h, num_kv_heads=g, bias=draw(st.booleans())
    )
    return mha.eval(), draw(st.integers(1, 3)), draw(st.integers(1, 11))


@given(mha_configs(), st.data())
def test_self_attention_is_permutation_equivariant(
    config: tuple[MultiHeadAttention, int, int], data: st.DataObject
) -> None:
    """Without positions, permuting the tokens permutes the outputs the same way."""
    mha, B, T = config
    X = torch.randn(B, T, mha.num_hiddens)
    perm = torch.tensor(data.draw(st.permutations(range(T))))
    out = mha(X, X, X)
    Xp = X[:, perm]
    torch.testing.assert_close(mha(Xp, Xp, Xp), out[:, perm], atol=TOL32.atol, rtol=TOL32.rtol)


@given(mha_configs(), st.data())
def test_mha_permuting_key_value_pairs_changes_nothing(
    config: tuple[MultiHeadAttention, int, int], data: st.DataObject
) -> None:
    mha, B, Tq = config
    Tk = data.draw(st.integers(1, 11))
    Q, K, V = (torch.randn(B, T, mha.num_hiddens) for T in (Tq, Tk, Tk))
    lens = torch.randint(1, Tk + 1, (B,))
    perm = torch.tensor(data.draw(st.permutations(range(Tk))))
    mask = (torch.arange(Tk) < lens.unsqueeze(-1)).unsqueeze(1)  # (B, 1, Tk)
    out = mha(Q, K, V, mask)
    permuted = mha(Q, K[:, perm], V[:, perm], mask[..., perm])
    torch.testing.assert_close(permuted, out, atol=TOL32.atol, rtol=TOL32.rtol)


@given(mha_configs(), st.data())
def test_mha_equals_heads_one_by_one(
    config: tuple[MultiHeadAttention, int, int], data: st.DataObject
) -> None:
    """MultiHead = Concat(head_1..head_h) W_o with head_i = softmax(q_i k_j^T / sqrt(Dh)) v_j,
    j = i // (h // g), computed here head by head from the projection weights."""
    mha, B, Tq = config
    Tk = data.draw(st.integers(1, 11))
    Q, K, V = (torch.randn(B, T, mha.num_hiddens) for T in (Tq, Tk, Tk))
    h, g, Dh = mha.num_heads, mha.num_kv_heads, mha.head_dim

    def rows(proj: torch.nn.Linear, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        sl = slice(i * Dh, (i + 1) * Dh)
        return proj.weight[sl], None if proj.bias is None else proj.bias[sl]

    heads = []
    for i in range(h):
        j = i // (h // g)
        q = torch.nn.functional.linear(Q, *rows(mha.query_proj, i))  # (B, Tq, Dh)
        k = torch.nn.functional.linear(K, *rows(mha.key_proj, j))  # (B, Tk, Dh)
        v = torch.nn.functional.linear(V, *rows(mha.value_proj, j))  # (B, Tk, Dh)
        w = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(Dh), dim=-1)
        heads.append(w @ v)
    expected = mha.output_proj(torch.cat(heads, dim=-1))
    torch.testing.assert_close(mha(Q, K, V), expected, atol=TOL32.atol, rtol=TOL32.rtol)


@given(mha_configs())
def test_gqa_module_equals_mha_with_repeated_kv_heads(
    config: tuple[MultiHeadAttention, int, int],
) -> None:
    gqa, B, T = config
    h, g, Dh, H = gqa.num_heads, gqa.num_kv_heads, gqa.head_dim, gqa.num_hiddens
    mha = MultiHeadAttention(num_hiddens=H, num_heads=h, bias=gqa.query_proj.bias is not None)
    with torch.no_grad():
        for name in ("query_proj", "output_proj"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("key_proj", "value_proj"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            dst.weight.copy_(src.weight.view(g, Dh, H).repeat_interleave(h // g, 0).view(H, H))
            if src.bias is not None:
                dst.bias.copy_(src.bias.view(g, Dh).repeat_interleave(h // g, 0).view(H))
    X = torch.randn(B, T, H)
    lens = torch.randint(0, T + 1, (B,))
    torch.testing.assert_close(
        gqa(X, X, X, valid_lens=lens), mha(X, X, X, valid_lens=lens), atol=TOL32.atol, rtol=0
    )


@given(st.integers(1, 40), st.sampled_from([2, 4, 8, 16, 32]), st.integers(0, 200))
def test_sinusoidal_offset_is_one_rotation(d: int, H: int, start: int) -> None:
    """For every offset d there is one rotation R_d, the same at every position i, with
    P[i + d] = R_d P[i]: block-diagonal, one 2x2 rotation by d * w_j per frequency."""
    P = sinusoidal_encoding(start + d + 50, H).double()
    freqs = 1.0 / torch.pow(10000.0, torch.arange(0, H, 2, dtype=torch.float64) / H)
    R = torch.zeros(H, H, dtype=torch.float64)
    for j, w in enumerate(freqs):
        c, s = math.cos(d * w), math.sin(d * w)
        # [sin((i+d)w), cos((i+d)w)] = [[c, s], [-s, c]] @ [sin(iw), cos(iw)]
        R[2 * j : 2 * j + 2, 2 * j : 2 * j + 2] = torch.tensor([[c, s], [-s, c]])
    torch.testing.assert_close(R.T @ R, torch.eye(H, dtype=torch.float64))
    rotated = P[start : start + 50] @ R.T  # row i: R @ P[i]
    # P is float32: positions up to ~300 lose ~3e-5 in the angle
    torch.testing.assert_close(rotated, P[start + d : start + d + 50], atol=1e-4, rtol=0)


@given(st.integers(1, 9), st.integers(1, 17), st.integers(0, 2**31 - 1))
def test_nadaraya_watson_predictions_lie_within_targets(Tq: int, Tk: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x_train = 5 * torch.rand(Tk, generator=gen)
    y_train = torch.randn(Tk, generator=gen)
    x = 5 * torch.rand(Tq, generator=gen)
    w = float(torch.rand((), generator=gen) * 10)
    y_hat, weights = F.nadaraya_watson(x, x_train, y_train, w)
    assert weights.shape == (Tq, Tk)
    assert (y_hat >= y_train.min() - 1e-6).all()
    assert (y_hat <= y_train.max() + 1e-6).all()


@given(st.integers(1, 9), st.integers(2, 17), st.integers(0, 2**31 - 1))
def test_nadaraya_watson_large_width_is_nearest_neighbour(Tq: int, Tk: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x_train = torch.randperm(4 * Tk, generator=gen)[:Tk].double()  # distinct integers
    y_train = torch.randn(Tk, generator=gen, dtype=torch.float64)
    x = x_train[torch.randint(0, Tk, (Tq,), generator=gen)] + 0.25  # nearest is unique
    y_hat = NadarayaWatson(w=1e3).double()(x, x_train, y_train)
    nearest = (x.unsqueeze(-1) - x_train).abs().argmin(dim=-1)
    torch.testing.assert_close(y_hat, y_train[nearest], atol=1e-12, rtol=0)


@GRADCHECK_MODES
@given(
    attention_cases(
        dtypes=(torch.float64,),
        layouts=("contiguous",),
        max_len=5,
        max_batch_dims=1,
        hot=False,
        mask_kinds=("none", "bool", "float", "causal_bottom_right", "bool_and_causal"),
    )
)
def test_sdpa_gradcheck(fast_mode: bool, case: AttnCase) -> None:
    q, k, v = (t.detach().requires_grad_() for t in (case.query, case.key, case.value))
    assert gradcheck(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **case.kwargs()),
        (q, k, v),
        fast_mode=fast_mode,
    )


@GRADCHECK_MODES
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.data())
def test_masked_softmax_gradcheck(
    fast_mode: bool, B: int, Tq: int, Tk: int, data: st.DataObject
) -> None:
    X = torch.randn(B, Tq, Tk, dtype=torch.float64, requires_grad=True)
    lens = torch.tensor(data.draw(st.lists(st.integers(0, Tk), min_size=B, max_size=B)))
    visible = torch.arange(Tk) < lens.view(B, 1, 1)
    assert gradcheck(lambda X: F.masked_softmax(X, lens), (X,), fast_mode=fast_mode)
    assert gradcheck(lambda X: F.safe_softmax(X, visible), (X,), fast_mode=fast_mode)


@GRADCHECK_MODES
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_additive_attention_gradcheck(fast_mode: bool, B: int, Tq: int, Tk: int, seed: int) -> None:
    torch.manual_seed(seed)
    attn = AdditiveAttention(query_size=3, key_size=2, num_hiddens=4).double().eval()
    q = torch.randn(B, Tq, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Tk, 2, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Tk, 5, dtype=torch.float64, requires_grad=True)
    lens = torch.randint(1, Tk + 1, (B,))
    assert gradcheck(lambda q, k, v: attn(q, k, v, lens), (q, k, v), fast_mode=fast_mode)
    params = tuple(attn.parameters())
    assert all(p.grad is None for p in params)
    attn(q, k, v, lens).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
