"""Label smoothing and the Noam schedule, over random sizes."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnref.training import LabelSmoothing, rate


@given(
    st.integers(3, 40),
    st.data(),
    st.floats(0.0, 0.99, allow_nan=False),
    st.integers(0, 30),
)
def test_smoothed_targets_sum_to_one_on_real_rows_and_zero_on_padding(
    V: int, data: st.DataObject, smoothing: float, N: int
) -> None:
    pad = data.draw(st.integers(0, V - 1))
    target = torch.tensor(data.draw(st.lists(st.integers(0, V - 1), min_size=N, max_size=N)))
    target = target.long().reshape(N)
    dist = LabelSmoothing(V, pad, smoothing).target_distribution(target)
    real = target != pad
    torch.testing.assert_close(dist.sum(-1)[real], torch.ones(int(real.sum())))
    assert bool((dist[~real] == 0).all())
    assert bool((dist[:, pad] == 0).all())  # never predict padding
    assert bool((dist >= 0).all())
    if real.any():  # the true label keeps 1 - smoothing, the rest share the mass evenly
        rows = dist[real]
        labels = target[real]
        assert torch.allclose(rows.gather(1, labels.unsqueeze(1)), torch.tensor(1 - smoothing))
        others = rows.clone()
        others.scatter_(1, labels.unsqueeze(1), 0.0)
        others[:, pad] = 0.0
        assert torch.allclose(others.sum(-1), torch.tensor(smoothing), atol=1e-5)


@given(st.integers(1, 4096), st.integers(1, 2000), st.floats(0.01, 10.0))
def test_noam_peaks_at_warmup_and_follows_its_formula(
    model_size: int, warmup: int, factor: float
) -> None:
    steps = range(1, 3 * warmup + 2)
    rates = [rate(s, model_size, factor, warmup) for s in steps]
    assert max(range(len(rates)), key=rates.__getitem__) + 1 == warmup
    peak = factor * model_size**-0.5 * warmup**-0.5
    assert rates[warmup - 1] == pytest.approx(peak)
    for s in (1, max(warmup // 2, 1), warmup, 2 * warmup, 3 * warmup):
        expected = factor * model_size**-0.5 * min(s**-0.5, s * warmup**-1.5)
        assert math.isclose(rate(s, model_size, factor, warmup), expected, rel_tol=1e-12)
    rising, falling = rates[:warmup], rates[warmup - 1 :]
    assert all(a <= b for a, b in itertools.pairwise(rising))
    assert all(a >= b for a, b in itertools.pairwise(falling))
