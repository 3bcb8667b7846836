"""Attention heatmaps, saved as PNG (matplotlib, the ``viz`` extra).

- `plot_heads`: one figure of ``(h, Tq, Tk)`` weights, one panel per head (D2L's
  ``show_heatmaps``), for one layer of one sample.
- `save_transformer_heatmaps`: runs an `EncoderDecoder` once and saves every layer's
  encoder self-attention, decoder self-attention and cross-attention.
- `plot_alignment`: a Bahdanau alignment ``(T, Ts)``: where the decoder looked to emit
  each target token.

Rows are queries, columns keys; a row of a softmax sums to 1, so every panel shares the
colour scale ``[0, 1]``.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from attnref._checking import checked
from attnref.layers.transformer import DecoderBlock, EncoderDecoder
from attnref.masks import make_std_mask, padding_mask

__all__ = ["plot_alignment", "plot_heads", "save_transformer_heatmaps"]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - the dev and viz extras install it
        raise ImportError("attnref.viz needs matplotlib: pip install 'attnref[viz]'") from err
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _labels(ax: Any, xlabels: Sequence[str] | None, ylabels: Sequence[str] | None) -> None:
    if xlabels is not None:
        ax.set_xticks(range(len(xlabels)), list(xlabels), fontsize=7)
    if ylabels is not None:
        ax.set_yticks(range(len(ylabels)), list(ylabels), fontsize=7)


@checked
def plot_heads(
    weights: Float[Tensor, "h Tq Tk"],
    path: str | Path,
    *,
    title: str = "",
    xlabels: Sequence[str] | None = None,
    ylabels: Sequence[str] | None = None,
    xlabel: str = "key",
    ylabel: str = "query",
) -> Path:
    """Save one panel per head of ``weights`` to ``path`` (PNG); returns the path.

    ``xlabels``/``ylabels`` name the keys and queries (tokens, say)."""
    plt = _pyplot()
    heads = weights.shape[0]
    fig, axes = plt.subplots(
        1, heads, figsize=(2.4 * heads + 0.8, 3.0), squeeze=False, constrained_layout=True
    )
    image = None
    for i, ax in enumerate(axes[0]):
        image = ax.imshow(weights[i].detach().float().cpu().numpy(), cmap="Reds", vmin=0, vmax=1)
        if heads > 1:
            ax.set_title(f"head {i}", fontsize=8)
        ax.set_xlabel(xlabel, fontsize=8)
        if i == 0:
            ax.set_ylabel(ylabel, fontsize=8)
        _labels(ax, xlabels, ylabels if i == 0 else None)
        if i:
            ax.set_yticks([])
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    if title:
        fig.suptitle(title, fontsize=9)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


@checked
def plot_alignment(
    weights: Float[Tensor, "T Ts"],
    path: str | Path,
    *,
    title: str = "Bahdanau alignment",
    xlabels: Sequence[str] | None = None,
    ylabels: Sequence[str] | None = None,
) -> Path:
    """Save a Bahdanau alignment (target steps x source positions) to ``path``.

    ``ylabels``: the token each step emitted; ``xlabels``: the source tokens."""
    return plot_heads(
        weights.unsqueeze(0),
        path,
        title=title,
        xlabels=xlabels,
        ylabels=ylabels,
        xlabel="source token",
        ylabel="token emitted",
    )


@checked
@torch.no_grad()
def save_transformer_heatmaps(
    model: EncoderDecoder,
    src: Int[Tensor, "B Ts"],
    tgt: Int[Tensor, "B T"],
    out_dir: str | Path,
    *,
    pad: int = 0,
    sample: int = 0,
) -> list[Path]:
    """Run ``model`` on ``src``/``tgt`` (teacher forcing) and save, for sample
    ``sample``, one PNG per layer and attention kind: ``encoder-self-L{i}.png``,
    ``decoder-self-L{i}.png`` and ``decoder-cross-L{i}.png``. Returns the paths.

    Raises:
        ValueError: ``sample`` outside the batch.
    """
    if not 0 <= sample < src.shape[0]:
        raise ValueError(f"sample must lie in [0, {src.shape[0]}), got {sample}")
    model.eval()
    src_mask = padding_mask(src, pad)
    tgt_mask = make_std_mask(tgt, pad)
    model(src, tgt, src_mask, tgt_mask)
    src_labels = [str(int(t)) for t in src[sample]]
    tgt_labels = [str(int(t)) for t in tgt[sample]]
    out = Path(out_dir)
    paths: list[Path] = []
    for i, weights in enumerate(model.encoder.attention_weights):
        assert weights is not None
        paths.append(
            plot_heads(
                weights[sample],
                out / f"encoder-self-L{i}.png",
                title=f"encoder self-attention, layer {i}",
                xlabels=src_labels,
                ylabels=src_labels,
            )
        )
    for i, block in enumerate(model.decoder.blocks):
        assert isinstance(block, DecoderBlock)
        for kind, attention, xlabels in (
            ("self", block.self_attention, tgt_labels),
            ("cross", block.cross_attention, src_labels),
        ):
            weights = attention.attention_weights
            assert weights is not None
            paths.append(
                plot_heads(
                    weights[sample],
                    out / f"decoder-{kind}-L{i}.png",
                    title=f"decoder {kind}-attention, layer {i}",
                    xlabels=xlabels,
                    ylabels=tgt_labels,
                )
            )
    return paths
