"""Worked examples and edge cases of the functional API, and its errors on bad input."""

import math
from typing import Any

import pytest
import torch

from attnref import functional as F


def test_d2l_masked_softmax_example() -> None:
    torch.manual_seed(0)
    X = torch.rand(2, 2, 4)
    out = F.masked_softmax(X, torch.tensor([2, 3]))
    assert (out[0, :, 2:] < 1e-6).all()
    assert (out[1, :, 3:] < 1e-6).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 2))
    out2 = F.masked_softmax(X, torch.tensor([[1, 3], [2, 4]]))
    assert (out2[0, 0, 1:] < 1e-6).all()
    assert (out2[1, 0, 2:] < 1e-6).all()
    torch.testing.assert_close(out2[1, 1], torch.softmax(X[1, 1], -1))


def test_d2l_masked_softmax_empty_row_is_uniform_but_safe_softmax_is_zero() -> None:
    X = torch.randn(1, 2, 5)
    lens = torch.tensor([[0, 2]])
    torch.testing.assert_close(F.masked_softmax(X, lens)[0, 0], torch.full((5,), 0.2))
    mask = torch.arange(5) < lens.unsqueeze(-1)
    assert torch.equal(F.safe_softmax(X, mask)[0, 0], torch.zeros(5))


def test_d2l_transpose_qkv_example() -> None:
    X = torch.randn(2, 4, 8)
    assert F.transpose_qkv(X, 2).shape == (4, 4, 4)
    assert F.transpose_output(F.transpose_qkv(X, 2), 2).shape == (2, 4, 8)


def test_sdpa_returns_zeros_for_a_query_with_no_visible_key() -> None:
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 2)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    q.requires_grad_()
    k.requires_grad_()
    out, w = F.scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    assert torch.equal(out[0, 0, 1], torch.zeros(2))
    assert torch.equal(w[0, 0, 1], torch.zeros(5))
    assert torch.isfinite(out).all()
    out.sum().backward()  # type: ignore[no-untyped-call]
    assert q.grad is not None
    assert k.grad is not None
    assert torch.isfinite(q.grad).all()
    assert torch.isfinite(k.grad).all()
    assert torch.equal(q.grad[0, 0, 1], torch.zeros(4))


def test_safe_softmax_gradient_is_finite_with_an_empty_row() -> None:
    X = torch.randn(2, 4, requires_grad=True)
    additive = torch.tensor([[0.0, float("-inf"), 0.0, 0.0], [float("-inf")] * 4])
    w = F.safe_softmax(X + additive)
    assert torch.equal(w[1], torch.zeros(4))
    (w * torch.randn(2, 4)).sum().backward()  # type: ignore[no-untyped-call]
    assert X.grad is not None
    assert torch.isfinite(X.grad).all()
    assert torch.equal(X.grad[1], torch.zeros(4))


def test_sdpa_is_causal_with_mask_requires_both() -> None:
    q = k = v = torch.randn(1, 1, 3, 4)
    mask = torch.tensor([True, False, True])
    _, w = F.scaled_dot_product_attention(q, k, v, mask, is_causal=True, return_weights=True)
    visible = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 0, 1]], dtype=torch.bool)
    assert torch.equal(w[0, 0] > 0, visible)


def test_sdpa_half_precision_is_computed_in_float32() -> None:
    # scores of 300 * 300 overflow float16 (max 65504); float32 keeps them
    q = torch.full((1, 1, 1, 1), 300.0, dtype=torch.float16)
    k = torch.tensor([[[[300.0], [299.0]]]], dtype=torch.float16)
    v = torch.tensor([[[[1.0], [0.0]]]], dtype=torch.float16)
    out = F.scaled_dot_product_attention(q, k, v)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()
    assert out.item() == 1.0


def test_sdpa_default_scale_and_zero_head_dim() -> None:
    q, k, v = torch.randn(1, 1, 2, 9), torch.randn(1, 1, 3, 9), torch.randn(1, 1, 3, 2)
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v),
        F.scaled_dot_product_attention(q, k, v, scale=1 / 3),
    )
    empty = torch.randn(1, 1, 2, 0)
    out = F.scaled_dot_product_attention(empty, torch.randn(1, 1, 3, 0), v)
    torch.testing.assert_close(out, v.mean(dim=-2, keepdim=True).expand(1, 1, 2, 2))


def test_sdpa_dropout_is_replayable_and_zero_p_is_identity() -> None:
    q, k, v = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 6, 5), torch.randn(2, 3, 6, 5)
    plain = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, dropout_p=0.0), plain)
    a = F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.5, generator=torch.Generator().manual_seed(3)
    )
    b = F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.5, generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(a, b)
    assert not torch.allclose(a, plain)
    keep = torch.rand(2, 3, 4, 6) > 0.5
    _, w = F.scaled_dot_product_attention(q, k, v, return_weights=True)
    by_mask = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, dropout_mask=keep)
    torch.testing.assert_close(by_mask, (w * keep / 0.5) @ v)


def test_chunked_attention_handles_any_block_size() -> None:
    q, k, v = torch.randn(1, 2, 7, 4), torch.randn(1, 2, 13, 4), torch.randn(1, 2, 13, 3)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
    for block in (1, 2, 5, 13, 64):
        chunked = F.chunked_attention(
            q, k, v, is_causal=True, causal_alignment="bottom_right", block_size=block
        )
        torch.testing.assert_close(chunked, full)


def test_nadaraya_watson_nonparametric_is_a_weighted_average() -> None:
    x_train = torch.tensor([0.0, 1.0, 2.0])
    y_train = torch.tensor([1.0, 2.0, 3.0])
    y_hat, w = F.nadaraya_watson(torch.tensor([1.0]), x_train, y_train)
    e = torch.tensor([math.exp(-0.5), 1.0, math.exp(-0.5)])
    torch.testing.assert_close(w[0], e / e.sum())
    torch.testing.assert_close(y_hat, torch.tensor([2.0]))


def test_additive_scores_shape_with_different_widths() -> None:
    s = F.additive_scores(
        torch.randn(2, 1, 20),
        torch.randn(2, 10, 2),
        torch.randn(8, 20),
        torch.randn(8, 2),
        torch.randn(1, 8),
    )
    assert s.shape == (2, 1, 10)


# ---------------------------------------------------------------------- bad input

QKV = (torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))


def test_gqa_needs_enable_gqa() -> None:
    with pytest.raises(
        ValueError, match=r"key and value have 2 heads \(dim -3\) but query has 4; pass enable_gqa"
    ):
        F.scaled_dot_product_attention(*QKV)


def test_a_flash_layout_gets_a_hint_not_a_gqa_suggestion() -> None:
    """(B, T, h, Dh) tensors put T where the heads belong: 7 "heads" against 5."""
    q, k = torch.randn(2, 7, 4, 8), torch.randn(2, 5, 4, 8)
    with pytest.raises(ValueError, match=r"has 7; tensors in \(B, T, h, Dh\) layout") as e:
        F.scaled_dot_product_attention(q, k, k)
    assert "enable_gqa" not in str(e.value)


def test_gqa_heads_must_divide() -> None:
    q = torch.randn(2, 3, 3, 8)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be divisible .* heads \(2\)"):
        F.scaled_dot_product_attention(q, QKV[1], QKV[2], enable_gqa=True)


def test_mask_must_broadcast() -> None:
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 2, 3, 5\) does not broadcast"):
        F.scaled_dot_product_attention(
            *QKV, torch.ones(3, 2, 3, 5, dtype=torch.bool), enable_gqa=True
        )


def test_mask_with_wrong_key_length_names_the_argument() -> None:
    with pytest.raises(TypeError, match="attn_mask"):
        F.scaled_dot_product_attention(*QKV, torch.ones(3, 4, dtype=torch.bool), enable_gqa=True)


def test_unknown_alignment_and_bad_dropout() -> None:
    with pytest.raises(TypeError, match="causal_alignment"):
        F.scaled_dot_product_attention(*QKV, enable_gqa=True, causal_alignment="middle")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match=r"dropout_p must lie in \[0, 1\], got 1.5"):
        F.scaled_dot_product_attention(*QKV, dropout_p=1.5, enable_gqa=True)


def test_mixed_dtypes() -> None:
    with pytest.raises(ValueError, match="must share a dtype"):
        F.scaled_dot_product_attention(QKV[0].double(), QKV[1], QKV[2], enable_gqa=True)


def test_wrong_rank() -> None:
    with pytest.raises(TypeError, match="parameter 'query'"):
        F.scaled_dot_product_attention(torch.randn(8), torch.randn(5, 8), torch.randn(5, 8))


def test_chunked_rejects_bad_block_and_dropout() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        F.chunked_attention(*QKV, enable_gqa=True, block_size=0)
    with pytest.raises(ValueError, match="does not implement dropout"):
        F.chunked_attention(*QKV, dropout_p=0.1, enable_gqa=True)


def test_head_split_errors() -> None:
    with pytest.raises(ValueError, match=r"width \(10\) must be divisible by num_heads \(4\)"):
        F.split_heads(torch.randn(1, 2, 10), 4)
    with pytest.raises(
        ValueError, match=r"leading dim \(6\) must be a multiple of num_heads \(4\)"
    ):
        F.transpose_output(torch.randn(6, 2, 3), 4)


# ---------------------------------------------------------------- variants: bad input


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": (-2, 0)}, r"window must be \(left, right\), two ints >= -1"),
        ({"softcap": -1.0}, r"softcap must be a finite number >= 0 \(0: off\), got -1.0"),
        ({"softcap": math.inf}, r"softcap must be a finite number >= 0"),
        ({"alibi_slopes": torch.ones(3, dtype=torch.float16)}, "alibi_slopes must be float32"),
    ],
)
def test_bad_variant_values_are_named(kwargs: dict[str, Any], message: str) -> None:
    q = torch.randn(2, 3, 5, 4)
    with pytest.raises(ValueError, match=message):
        F.scaled_dot_product_attention(q, q, q, **kwargs)
    with pytest.raises(ValueError, match=message):
        F.chunked_attention(q, q, q, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alibi_slopes": torch.ones(4)},
        {"alibi_slopes": torch.ones(2, 5)},
        {"sinks": torch.ones(2)},
        {"window": (3,)},
        {"window": (1.5, 0)},
    ],
)
def test_variant_arguments_of_the_wrong_type_or_shape_are_refused(
    kwargs: dict[str, Any],
) -> None:
    """The annotations (jaxtyping, beartype) refuse these, naming the argument."""
    q = torch.randn(2, 3, 5, 4)
    with pytest.raises(Exception, match=r"alibi_slopes|sinks|window"):
        F.scaled_dot_product_attention(q, q, q, **kwargs)


def test_merge_refuses_flash_attention_2s_plus_inf() -> None:
    out = torch.zeros(1, 2, 3, 4)
    lse = torch.zeros(1, 2, 3)
    bad = lse.clone()
    bad[0, 0, 0] = math.inf
    with pytest.raises(ValueError, match=r"lse2 holds 1 NaN or \+inf values"):
        F.merge_attention(out, lse, out, bad)


def test_an_empty_part_drops_out_of_a_merge_even_as_nan() -> None:
    out = torch.randn(1, 2, 3, 4)
    lse = torch.randn(1, 2, 3)
    nan = torch.full_like(out, math.nan)
    empty = torch.full_like(lse, -math.inf)
    merged, merged_lse = F.merge_attention(out, lse, nan, empty)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse)
    none, none_lse = F.merge_attention(nan, empty, nan, empty)
    assert bool((none == 0).all())
    assert bool(torch.isneginf(none_lse).all())


def test_a_row_with_no_visible_key_has_lse_minus_inf_and_output_zero_with_a_sink() -> None:
    q = torch.randn(1, 2, 4, 3)
    k = torch.randn(1, 2, 2, 3)
    # bottom-right with Tq > Tk: the first two queries see no key
    out, lse = F.scaled_dot_product_attention(
        q, k, k, is_causal=True, causal_alignment="bottom_right", sinks=torch.ones(2),
        return_lse=True,
    )  # fmt: skip
    assert bool((out[..., :2, :] == 0).all())
    assert bool(torch.isneginf(lse[..., :2]).all())
    assert bool(torch.isfinite(lse[..., 2:]).all())


@pytest.mark.parametrize("fn", [F.scaled_dot_product_attention, F.chunked_attention])
def test_a_sink_far_above_every_score_gives_finite_gradients(fn: object) -> None:
    """A sink 200 above every score (past float32's exp range) takes nearly all the
    weight: outputs and gradients are finite and match float64's (which are near zero).
    The chunked path once added exp(sink - max) = inf to its denominator: output 0,
    gradients 0 * inf = NaN."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen) for _ in range(3))
    sinks = torch.tensor([200.0, 0.0])  # head 0's sink dominates, head 1's does not

    def grads(dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, sinks=sinks.to(dtype))  # type: ignore[operator]
        out.sum().backward()
        return [out.detach(), *(t.grad for t in leaves)]

    for got, want in zip(grads(torch.float32), grads(torch.float64), strict=True):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fn", [F.scaled_dot_product_attention, F.chunked_attention])
def test_a_nan_value_reaches_only_the_query_heads_that_see_its_key(fn: object) -> None:
    """GQA reads each key/value head once for its whole group; a NaN value at a key that
    one head of the group hides and another sees still gives that other head NaN only:
    the head that hides it gets exactly what it gets with any finite value there."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 8, generator=gen)  # 4 query heads
    k = torch.randn(1, 2, 5, 8, generator=gen)  # 2 kv heads: query heads 0, 1 read kv head 0
    v = torch.randn(1, 2, 5, 8, generator=gen)
    mask = torch.ones(1, 4, 3, 5, dtype=torch.bool)
    mask[:, 0, :, 2] = False  # query head 0 hides key 2; head 1 (same group) sees it
    call = fn
    finite = call(q, k, v, mask, enable_gqa=True)  # type: ignore[operator]
    poisoned = v.clone()
    poisoned[:, 0, 2] = math.nan
    out = call(q, k, poisoned, mask, enable_gqa=True)  # type: ignore[operator]
    torch.testing.assert_close(out[:, 0], finite[:, 0], atol=0, rtol=0)
    assert out[:, 1].isnan().all()  # it sees the NaN
    torch.testing.assert_close(out[:, 2:], finite[:, 2:], atol=0, rtol=0)  # the other group
