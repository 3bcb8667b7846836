"""The variants of the reference (docs/variants.md): sliding windows, softcap, ALiBi,
sinks, the log-sum-exp and the merge law, over Hypothesis-drawn cases."""

import math
from typing import Any

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnref import functional as F
from attnref.masks import sliding_window_mask
from attnref.tolerances import attention_atol, tolerance
from tests.naive import f64, naive_variants
from tests.property.strategies import HALF, AttnCase, attention_cases

WINDOW_SIDES = st.sampled_from((0, 1, 2, 3, 5, -1))


@st.composite
def variants(draw: st.DrawFn, case: AttnCase, *, positional: bool = True) -> dict[str, Any]:
    """Some of window, softcap, ALiBi and sinks for ``case`` (each on or off)."""
    h = case.query.shape[-3]
    batch = case.query.shape[:-3]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    out: dict[str, Any] = {}
    if positional and draw(st.booleans()):
        out["window"] = (draw(WINDOW_SIDES), draw(WINDOW_SIDES))
    if draw(st.booleans()):
        out["softcap"] = draw(st.sampled_from((0.5, 2.0, 30.0)))
    if positional and draw(st.booleans()):
        shape = draw(st.sampled_from(((h,), (*batch, h))))
        out["alibi_slopes"] = torch.rand(shape, generator=gen)
    if draw(st.booleans()):
        out["sinks"] = 2 * torch.randn(h, generator=gen)
    return out


def atol_for(case: AttnCase, extra: dict[str, Any]) -> float:
    atol = attention_atol(case.query, case.key, case.value, case.scale)
    slopes = extra.get("alibi_slopes")
    if slopes is not None and case.value.numel():  # the rounding of a large ALiBi bias
        Tq, Tk = case.query.shape[-2], case.key.shape[-2]
        eps = torch.finfo(torch.float32).eps
        atol += eps * float(slopes.max()) * (Tq + Tk) * float(case.value.abs().max())
    return atol


@given(attention_cases(dtypes=(torch.float32, torch.float64, *HALF)), st.data())
def test_variants_agree_with_independent_float64(case: AttnCase, data: st.DataObject) -> None:
    extra = data.draw(variants(case), label="variants")
    out, lse = F.scaled_dot_product_attention(
        case.query, case.key, case.value, **case.kwargs(), **extra, return_lse=True
    )
    want, want_lse = naive_variants(case, **extra)
    rtol = tolerance(case.query.dtype).rtol
    np.testing.assert_allclose(f64(out), want, atol=atol_for(case, extra), rtol=rtol)
    assert lse.dtype == (torch.float64 if case.query.dtype == torch.float64 else torch.float32)
    np.testing.assert_allclose(f64(lse), want_lse, atol=1e-4, rtol=1e-5)


@given(attention_cases(dtypes=(torch.float64, torch.float32)), st.data())
def test_chunked_equals_materialised_with_every_variant(
    case: AttnCase, data: st.DataObject
) -> None:
    extra = data.draw(variants(case), label="variants")
    block = data.draw(st.integers(1, case.key.shape[-2] + 2), label="block_size")
    out, lse = F.scaled_dot_product_attention(
        case.query, case.key, case.value, **case.kwargs(), **extra, return_lse=True
    )
    c_out, c_lse = F.chunked_attention(
        case.query, case.key, case.value, **case.kwargs(), **extra, return_lse=True,
        block_size=block,
    )  # fmt: skip
    rtol = tolerance(case.query.dtype).rtol
    torch.testing.assert_close(c_out, out, atol=atol_for(case, extra), rtol=rtol)
    torch.testing.assert_close(c_lse, lse, atol=1e-5, rtol=rtol)


@given(attention_cases(dtypes=(torch.float64,)), WINDOW_SIDES, WINDOW_SIDES)
def test_a_window_is_its_mask_and_minus_one_is_none(case: AttnCase, left: int, right: int) -> None:
    Tq, Tk = case.query.shape[-2], case.key.shape[-2]
    kwargs = case.kwargs()
    out = F.scaled_dot_product_attention(
        case.query, case.key, case.value, **kwargs, window=(left, right)
    )
    band = sliding_window_mask(Tq, Tk, (left, right), case.alignment)  # type: ignore[arg-type]
    mask = kwargs.pop("attn_mask")
    if mask is None:
        both = band
    elif mask.dtype == torch.bool:
        both = mask & band
    else:
        both = mask.masked_fill(~band, -math.inf)
    masked = F.scaled_dot_product_attention(case.query, case.key, case.value, both, **kwargs)
    torch.testing.assert_close(out, masked, atol=0, rtol=0)
    plain = F.scaled_dot_product_attention(case.query, case.key, case.value, **case.kwargs())
    none = F.scaled_dot_product_attention(
        case.query, case.key, case.value, **case.kwargs(), window=(-1, -1)
    )
    torch.testing.assert_close(none, plain, atol=0, rtol=0)


@given(attention_cases(dtypes=(torch.float64,)), st.data())
def test_a_sink_scales_each_row_by_a_sigmoid(case: AttnCase, data: st.DataObject) -> None:
    extra = data.draw(variants(case), label="variants")
    extra.pop("sinks", None)
    sinks = 3 * torch.randn(case.query.shape[-3], dtype=torch.float64)
    out, lse = F.scaled_dot_product_attention(
        case.query, case.key, case.value, **case.kwargs(), **extra, return_lse=True
    )
    sunk = F.scaled_dot_product_attention(
        case.query, case.key, case.value, **case.kwargs(), **extra, sinks=sinks
    )
    torch.testing.assert_close(sunk, F.apply_sinks(out, lse, sinks), atol=1e-12, rtol=1e-10)
    none = F.scaled_dot_product_attention(
        case.query, case.key, case.value, **case.kwargs(), **extra,
        sinks=torch.full_like(sinks, -math.inf),
    )  # fmt: skip
    torch.testing.assert_close(none, out, atol=0, rtol=0)


@given(attention_cases(dtypes=(torch.float64,), mask_kinds=("none", "bool", "float", "padding")),
       st.data())  # fmt: skip
def test_merging_two_parts_of_the_keys_equals_attending_all(
    case: AttnCase, data: st.DataObject
) -> None:
    """The merge law over a random split of the keys, either part possibly empty for a
    row or for every row; a sink applied once after the merge."""
    extra = data.draw(variants(case, positional=False), label="variants")
    sinks = extra.pop("sinks", None)
    Tk = case.key.shape[-2]
    first = torch.tensor(data.draw(st.lists(st.booleans(), min_size=Tk, max_size=Tk)))
    kwargs = case.kwargs()
    mask = kwargs.pop("attn_mask")
    shape = (*case.query.shape[:-1], case.value.shape[-1])
    merged = torch.zeros(shape, dtype=torch.float64)
    merged_lse = torch.full(shape[:-1], -math.inf, dtype=torch.float64)
    for part in (first, ~first):
        keep = part.nonzero().squeeze(-1)
        m = mask[..., keep] if mask is not None and mask.shape[-1] == Tk else mask
        out, lse = F.scaled_dot_product_attention(
            case.query, case.key[..., keep, :], case.value[..., keep, :], m, **kwargs,
            **extra, return_lse=True,
        )  # fmt: skip
        merged, merged_lse = F.merge_attention(merged, merged_lse, out, lse)
    full, full_lse = F.scaled_dot_product_attention(
        case.query, case.key, case.value, mask, **kwargs, **extra, return_lse=True
    )
    torch.testing.assert_close(merged_lse, full_lse, atol=1e-10, rtol=1e-10)
    if sinks is not None:
        merged = F.apply_sinks(merged, merged_lse, sinks)
        full = F.scaled_dot_product_attention(
            case.query, case.key, case.value, mask, **kwargs, **extra, sinks=sinks
        )
    torch.testing.assert_close(merged, full, atol=1e-10, rtol=1e-10)


@given(attention_cases(dtypes=(torch.float32,), mask_kinds=("none", "bool", "padding"),
                       hot=False), st.sampled_from((0.25, 1.0, 3.0)))  # fmt: skip
def test_softcapped_scores_lie_within_the_cap(case: AttnCase, cap: float) -> None:
    q = case.query * 20  # far beyond the cap before capping
    _, w = F.scaled_dot_product_attention(
        q, case.key, case.value, **case.kwargs(), softcap=cap, return_weights=True
    )
    visible = case.visible()
    n = np.maximum(visible.sum(axis=-1, keepdims=True), 1)
    w64 = f64(w)
    lo, hi = np.exp(-2 * cap) / n * (1 - 1e-5), np.exp(2 * cap) / n * (1 + 1e-5)
    assert ((w64 >= lo) | ~visible).all()
    assert ((w64 <= hi) | ~visible).all()


def test_gradients_flow_through_every_variant_to_the_sinks() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 7, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(4, generator=gen, dtype=torch.float64)

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, causal_alignment="bottom_right",
            window=(2, 0), softcap=1.5, alibi_slopes=slopes, sinks=sinks, return_lse=True,
        )  # fmt: skip
        return out, lse

    assert torch.autograd.gradcheck(attend, (q, k, v, sinks))
    out, _ = attend(q, k, v, sinks)
    out.sum().backward()  # type: ignore[no-untyped-call]
    assert sinks.grad is not None
    assert bool((sinks.grad != 0).all())
