"""Heatmaps are written as PNG files, one per layer and attention kind."""

from pathlib import Path

import pytest
import torch

from attnref.layers import make_model
from attnref.viz import plot_alignment, plot_heads, save_transformer_heatmaps

PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_heads_writes_a_png(tmp_path: Path) -> None:
    weights = torch.softmax(torch.randn(3, 4, 5), dim=-1)
    path = plot_heads(weights, tmp_path / "sub" / "w.png", title="t", xlabels=list("abcde"))
    assert path.read_bytes()[:8] == PNG
    alignment = plot_alignment(weights[0], tmp_path / "a.png")
    assert alignment.read_bytes()[:8] == PNG


def test_every_layer_and_kind_gets_a_heatmap(tmp_path: Path) -> None:
    model = make_model(7, 7, num_layers=2, num_hiddens=8, ffn_hiddens=8, num_heads=2)
    src = torch.tensor([[1, 3, 4, 0], [1, 2, 5, 6]])
    paths = save_transformer_heatmaps(model, src, src[:, :3], tmp_path, sample=1)
    names = sorted(p.name for p in paths)
    expected = [f"{kind}-L{i}.png" for kind in ("decoder-cross", "decoder-self") for i in (0, 1)]
    assert names == sorted([*expected, "encoder-self-L0.png", "encoder-self-L1.png"])
    assert all(p.read_bytes()[:8] == PNG for p in paths)
    with pytest.raises(ValueError, match=r"sample must lie in \[0, 2\), got 2"):
        save_transformer_heatmaps(model, src, src, tmp_path, sample=2)


def test_weights_of_the_wrong_rank_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="weights"):
        plot_heads(torch.rand(4, 5), tmp_path / "w.png")
