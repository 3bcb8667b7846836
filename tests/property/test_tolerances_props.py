"""The rounding bounds of `attnref.tolerances` are bounds: never below the exact figure."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from attnref.tolerances import score_condition

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def exact_kappa(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor | None) -> float:
    """``max_ij sum_d |q_id| |k_jd|`` in float64, elementwise (no BLAS), unscaled."""
    q64, k64 = q.double().abs(), k.double().abs()
    group = q.shape[-3] // k.shape[-3]
    k64 = k64.repeat_interleave(group, dim=-3)
    terms = (q64.unsqueeze(-2) * k64.unsqueeze(-3)).sum(-1)  # (*batch, h, Tq, Tk)
    if visible is not None:
        terms = terms.masked_fill(~visible, 0.0)
    return float(terms.max())


@given(
    st.sampled_from(DTYPES),
    st.integers(1, 3),  # g
    st.sampled_from((1, 2)),  # group
    st.integers(1, 9),  # Tq
    st.integers(1, 40),  # Tk
    st.sampled_from((1, 3, 16, 64, 256, 576)),  # Dh
    st.sampled_from((1.0, 1e3, 1e19)),  # amplitude: products past float32 for bfloat16
    st.booleans(),  # a visibility mask
    st.integers(0, 2**16),
)
def test_score_condition_is_never_below_the_exact_kappa(
    dtype: torch.dtype,
    g: int,
    group: int,
    Tq: int,
    Tk: int,
    Dh: int,
    amp: float,
    masked: bool,
    seed: int,
) -> None:
    """Summed in float32 for inputs of at most 32 bits, ``kappa`` is still an upper bound
    of the exact one (and within float32's rounding of it): a smaller one would tighten
    every bound built on it past what a correct kernel can meet."""
    gen = torch.Generator().manual_seed(seed)
    amp = min(amp, torch.finfo(dtype).max ** 0.5)  # the inputs finite, their products not
    # all positive: summed with no cancellation, so the float32 sum's rounding shows
    q = (amp * torch.rand(1, g * group, Tq, Dh, generator=gen) + amp / 8).to(dtype)
    k = (amp * torch.rand(1, g, Tk, Dh, generator=gen) + amp / 8).to(dtype)
    visible = torch.rand(1, 1, Tq, Tk, generator=gen) < 0.7 if masked else None
    exact = exact_kappa(q, k, visible)
    got = score_condition(q, k, 1.0, visible)
    # (the float64 figures, summed in two orders, may differ in their last bits)
    assert got >= exact * (1 - 2 * Dh * 2.0**-53), (got, exact)
    assert got <= exact * (1 + 4 * Dh * 2.0**-24) + 1e-300, (got, exact)
