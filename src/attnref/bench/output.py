"""Writing benchmark results: CSV, JSON, a plot of TFLOP/s and a terminal table."""

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnref.bench.runner import BenchResult

__all__ = ["format_table", "plot_results", "write_results"]


def write_results(
    results: Sequence[BenchResult], out_dir: str | Path, *, meta: dict[str, Any]
) -> list[Path]:
    """``bench.csv`` and ``bench.json`` (rows and ``meta``) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.row() for r in results]
    csv_path = out / "bench.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["backend"])
        writer.writeheader()
        writer.writerows(rows)
    json_path = out / "bench.json"
    json_path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    return [csv_path, json_path]


def plot_results(
    results: Sequence[BenchResult],
    path: str | Path,
    *,
    title: str = "",
    references: Sequence[dict[str, Any]] = (),
) -> Path:
    """TFLOP/s against sequence length, one line per backend, one panel per
    (dtype, causal, mask, Dh). ``references``: published figures drawn as dashed lines
    (``{"label", "dtype", "causal", "Dh", "seq", "tflops"}``), for scale.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'attnref[viz]'``).
    """
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("the plot needs matplotlib: pip install 'attnref[viz]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "ok"]
    panels: dict[tuple[str, str, str, int], list[BenchResult]] = {}  # (dtype, causal, mask, Dh)
    for r in ok:
        key = (r.case.dtype, str(r.case.causal or "none"), str(r.case.mask), r.case.Dh)
        panels.setdefault(key, []).append(r)
    keys = sorted(panels) or [("", "", "", 0)]
    cols = min(len(keys), 4)
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False, constrained_layout=True
    )
    for ax, key in zip(axes.flat, keys, strict=False):
        by_backend: dict[str, list[BenchResult]] = {}
        for r in panels.get(key, []):
            by_backend.setdefault(r.backend, []).append(r)
        for name, rs in sorted(by_backend.items()):
            rs.sort(key=lambda r: r.case.Tk)
            ax.plot([r.case.Tk for r in rs], [r.tflops for r in rs], marker="o", label=name)
        dtype, causal, mask, Dh = key
        for ref in references:
            if (ref["dtype"], ref["causal"], ref["Dh"]) == (dtype, causal != "none", Dh):
                ax.plot(ref["seq"], ref["tflops"], linestyle="--", marker="x", label=ref["label"])
        ax.set_xscale("log", base=2)
        seqs = sorted({r.case.Tk for r in panels.get(key, [])})
        ax.set_xticks(seqs, [str(t) for t in seqs], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        causal_text = "non-causal" if causal == "none" else f"causal ({causal})"
        mask_text = "" if mask in ("none", "") else f", {mask}"
        ax.set_title(f"{dtype}, {causal_text}{mask_text}, Dh={Dh}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def format_table(results: Sequence[BenchResult]) -> str:
    """A plain-text table of the results, one line per row."""
    lines = [
        f"{'backend':<22} {'case':<52} {'median ms':>10} {'TFLOP/s':>9} {'of peak':>8} "
        f"{'peak MiB':>9}  note"
    ]
    for r in results:
        med = "" if r.median_s is None else f"{r.median_s * 1e3:.3f}"
        tf = "" if r.tflops is None else f"{r.tflops:.4f}"
        frac = "" if r.peak_fraction is None else f"{r.peak_fraction:.1%}"
        mem = "" if r.peak_mem_bytes is None else f"{r.peak_mem_bytes / 2**20:.1f}"
        note = r.note if r.status == "ok" else f"{r.status}: {r.note}"
        note = note if len(note) <= 90 else note[:87] + "..."
        lines.append(
            f"{r.backend:<22} {r.case.label:<52} {med:>10} {tf:>9} {frac:>8} {mem:>9}  {note}"
        )
    return "\n".join(lines)
