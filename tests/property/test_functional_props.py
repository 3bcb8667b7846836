"""Invariants of the attention primitives, over Hypothesis-drawn cases."""

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnref import functional as F
from attnref.masks import valid_lens_to_mask
from attnref.tolerances import attention_atol, tolerance
from tests.naive import f64, naive_attention
from tests.property.strategies import HALF, MASK_KINDS, AttnCase, attention_cases


def atol_for(case: AttnCase) -> float:
    """The dtype's atol, or the rounding bound of the scores on "hot" inputs if larger."""
    return attention_atol(case.query, case.key, case.value, case.scale)


def assert_close_np(actual: np.ndarray, expected: np.ndarray, case: AttnCase) -> None:
    rtol = tolerance(case.query.dtype).rtol
    np.testing.assert_allclose(actual, expected, atol=atol_for(case), rtol=rtol)


@given(attention_cases())
def test_weights_are_probabilities_over_visible_keys(case: AttnCase) -> None:
    _, weights = F.scaled_dot_product_attention(
        case.query, case.key, case.value, **case.kwargs(), return_weights=True
    )
    w = f64(weights)
    visible = case.visible()
    assert (w >= 0).all()
    assert (w[~visible] == 0).all(), "a hidden key got a non-zero weight"
    sums = w.sum(axis=-1)
    rows = np.asarray(visible.any(axis=-1))
    np.testing.assert_allclose(sums[rows], 1.0, atol=1e-5)
    assert (sums[~rows] == 0).all(), "a query with no visible key must get all-zero weights"


@given(attention_cases(), st.sampled_from([1.0, float("nan"), float("inf")]), st.integers(0, 99))
def test_hidden_keys_and_values_never_matter(case: AttnCase, fill: float, seed: int) -> None:
    """Changing K and V at keys no query sees (even to NaN or inf) leaves the output alone;
    changing K and V at keys hidden from one query leaves that query's row alone.

    Equality is exact, so every call gets contiguous inputs: a different memory layout
    may take another BLAS path and round the visible keys' sums differently.
    """
    q, key, value = (t.contiguous() for t in (case.query, case.key, case.value))
    out = F.scaled_dot_product_attention(q, key, value, **case.kwargs())
    visible = case.visible()  # (*batch, h, Tq, Tk)
    group = case.query.shape[-3] // case.key.shape[-3]
    # a kv head is hidden from a (query, key) pair only if hidden from all heads reading it
    grouped = visible.reshape(*visible.shape[:-3], -1, group, *visible.shape[-2:])
    vis_kv = np.asarray(grouped.any(axis=-3))
    gen = torch.Generator().manual_seed(seed)
    noise = fill * (1 + torch.randn(case.key.shape, generator=gen)).to(case.key.dtype)
    hidden_for_all = torch.from_numpy(~np.asarray(vis_kv.any(axis=-2)))[
        ..., None
    ]  # (*batch, g, Tk, 1)
    k2 = torch.where(hidden_for_all, noise, key)
    v2 = torch.where(hidden_for_all, fill, value)
    out2 = F.scaled_dot_product_attention(q, k2, v2, **case.kwargs())
    torch.testing.assert_close(out2, out, atol=0, rtol=0)
    if fill != 1.0:
        return
    # one query row: perturb every key that row cannot see, finite values
    i = seed % case.query.shape[-2]
    hidden_for_i = torch.from_numpy(~vis_kv[..., i, :].copy())[..., None]  # (*batch, g, Tk, 1)
    k3 = torch.where(hidden_for_i, noise, key)
    v3 = torch.where(hidden_for_i, -value - 3, value)
    out3 = F.scaled_dot_product_attention(q, k3, v3, **case.kwargs())
    torch.testing.assert_close(out3[..., i, :], out[..., i, :], atol=0, rtol=0)


@given(attention_cases(dtypes=(torch.float32, torch.float64, *HALF)))
def test_agrees_with_independent_float64(case: AttnCase) -> None:
    out, weights = F.scaled_dot_product_attention(
        case.query, case.key, case.value, **case.kwargs(), return_weights=True
    )
    expected_out, expected_w = naive_attention(case)
    assert out.dtype == case.query.dtype
    assert out.shape == (*case.query.shape[:-1], case.value.shape[-1])
    assert_close_np(f64(out), expected_out, case)
    assert_close_np(f64(weights), expected_w, case)


@given(attention_cases(dtypes=(torch.float32, *HALF)))
def test_agrees_with_torch_sdpa(case: AttnCase) -> None:
    ours = F.scaled_dot_product_attention(case.query, case.key, case.value, **case.kwargs())
    theirs = torch.nn.functional.scaled_dot_product_attention(
        case.query, case.key, case.value, **case.torch_kwargs()
    )
    tol = tolerance(case.query.dtype)
    # both round once to the output dtype: allow twice the one-rounding tolerance
    torch.testing.assert_close(ours, theirs, atol=2 * atol_for(case), rtol=2 * tol.rtol)


@given(attention_cases(dtypes=(torch.float64, torch.float32)), st.data())
def test_chunked_equals_materialised_for_every_block_size(
    case: AttnCase, data: st.DataObject
) -> None:
    Tk = case.key.shape[-2]
    block = data.draw(st.integers(1, Tk + 2), label="block_size")
    full = F.scaled_dot_product_attention(case.query, case.key, case.value, **case.kwargs())
    chunked = F.chunked_attention(
        case.query, case.key, case.value, **case.kwargs(), block_size=block
    )
    tol = tolerance(case.query.dtype)
    torch.testing.assert_close(chunked, full, atol=atol_for(case), rtol=tol.rtol)


@given(
    attention_cases(mask_kinds=("none",), max_batch_dims=0, gqa=False, layouts=("contiguous",)),
    st.data(),
)
def test_valid_lens_forms_and_masks_agree(case: AttnCase, data: st.DataObject) -> None:
    """valid_lens (B,), its (B, Tq) repetition, the bool mask and the -inf mask agree.

    Here the head axis of the drawn case plays D2L's batch axis ``B``.
    """
    q, k, v = case.query, case.key, case.value  # (B, Tq, Dh) ...
    B, Tq, Tk = q.shape[0], q.shape[1], k.shape[1]
    lens = torch.tensor(data.draw(st.lists(st.integers(0, Tk), min_size=B, max_size=B)))
    lens_2d = lens.unsqueeze(-1).expand(B, Tq)
    mask = valid_lens_to_mask(lens, Tq, Tk)
    assert torch.equal(mask, valid_lens_to_mask(lens_2d, Tq, Tk))
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    by_mask = F.scaled_dot_product_attention(q, k, v, mask)
    by_additive = F.scaled_dot_product_attention(q, k, v, additive)
    torch.testing.assert_close(by_additive, by_mask, atol=0, rtol=0)
    scores = F.dot_product_scores(q, k)
    nonempty = (lens > 0).reshape(B, 1, 1)
    d2l_1d = F.masked_softmax(scores, lens)
    d2l_2d = F.masked_softmax(scores, lens_2d)
    safe = F.safe_softmax(scores, mask)
    torch.testing.assert_close(d2l_2d, d2l_1d)
    # D2L's finite fill agrees with the safe softmax wherever a row has a visible key...
    torch.testing.assert_close(torch.where(nonempty, d2l_1d, safe), safe)
    # ...and is uniform where it has none
    uniform = torch.full_like(scores, 1 / Tk)
    torch.testing.assert_close(torch.where(nonempty, uniform, d2l_1d), uniform)


# Metamorphic laws are claims about the function, not about rounding: float64 keeps
# rounding (which a different summation order changes) far below the tolerance.
@given(attention_cases(dtypes=(torch.float64,)), st.data())
def test_permuting_key_value_pairs_changes_nothing(case: AttnCase, data: st.DataObject) -> None:
    Tk = case.key.shape[-2]
    perm = torch.tensor(data.draw(st.permutations(range(Tk)), label="perm"))
    mask = case.attn_mask
    if case.is_causal:  # causality depends on key order: carry it in an explicit mask
        mask = torch.from_numpy(case.visible().copy())
    kw = case.kwargs() | {"attn_mask": mask, "is_causal": False}
    out = F.scaled_dot_product_attention(case.query, case.key, case.value, **kw)
    permuted_mask = None
    if mask is not None:
        permuted_mask = mask[..., perm] if mask.shape[-1] == Tk else mask
    out_p = F.scaled_dot_product_attention(
        case.query,
        case.key[..., perm, :],
        case.value[..., perm, :],
        **(kw | {"attn_mask": permuted_mask}),
    )
    tol = tolerance(case.query.dtype)
    torch.testing.assert_close(out_p, out, atol=tol.atol, rtol=tol.rtol)


@given(attention_cases(mask_kinds=("none", "causal_top_left", "causal_bottom_right")))
def test_gqa_equals_expanded_heads(case: AttnCase) -> None:
    """GQA reads each key/value head once, the query heads of its group stacked as the
    rows of one matrix; the expanded call multiplies one head at a time. The same dot
    products in GEMMs of other shapes round alike only up to their last bits (BLAS picks
    its kernels by shape), so the two agree to a few units in the last place of the
    compute dtype, and of the output's where that is half precision. A wrong mapping
    (tiled heads, a group read by the wrong query heads) is off by whole values."""
    h, g = case.query.shape[-3], case.key.shape[-3]
    q, key, value = (t.contiguous() for t in (case.query, case.key, case.value))
    out = F.scaled_dot_product_attention(q, key, value, **case.kwargs())
    k = F.expand_kv_heads(key, h)
    v = F.expand_kv_heads(value, h)
    for i in range(h):  # head i reads kv head i // (h // g), by construction
        assert torch.equal(k[..., i, :, :], key[..., i // (h // g), :, :])
    expanded = F.scaled_dot_product_attention(q, k, v, **case.kwargs())
    eps = torch.finfo(out.dtype).eps
    size = float(value.abs().max()) if value.numel() else 0.0
    torch.testing.assert_close(out, expanded, atol=4 * eps * size, rtol=4 * eps)


@given(
    attention_cases(dtypes=(torch.float64,), mask_kinds=tuple(k for k in MASK_KINDS if k != "none"))
)
def test_rows_depend_only_on_their_own_query(case: AttnCase) -> None:
    """Output row i is a function of query i alone: recomputing it by itself changes nothing."""
    out = F.scaled_dot_product_attention(case.query, case.key, case.value, **case.kwargs())
    visible = torch.from_numpy(case.visible().copy())
    if case.attn_mask is not None and case.attn_mask.is_floating_point():
        # keep the float mask's finite offsets; -inf entries are in `visible` already
        full = case.attn_mask.expand(case.scores_shape)
        mask = full.masked_fill(~visible, float("-inf"))
    else:
        mask = visible
    for i in range(case.query.shape[-2]):
        row = F.scaled_dot_product_attention(
            case.query[..., i : i + 1, :],
            case.key,
            case.value,
            mask[..., i : i + 1, :],
            scale=case.scale,
            enable_gqa=case.enable_gqa,
        )
        tol = tolerance(case.query.dtype)
        torch.testing.assert_close(row[..., 0, :], out[..., i, :], atol=tol.atol, rtol=tol.rtol)


@given(st.integers(1, 4), st.integers(1, 9), st.sampled_from([1, 2, 3, 4]), st.integers(1, 5))
def test_transpose_output_inverts_transpose_qkv(B: int, T: int, h: int, Dh: int) -> None:
    X = torch.randn(B, T, h * Dh)
    heads = F.transpose_qkv(X, h)
    assert heads.shape == (B * h, T, Dh)
    for b in range(B):  # row b * h + i is head i of sample b: a permute, not a bare reshape
        for i in range(h):
            assert torch.equal(heads[b * h + i], X[b, :, i * Dh : (i + 1) * Dh])
    assert torch.equal(F.transpose_output(heads, h), X)
