"""The audit as one self-contained HTML page (docs/reports.md): no network, no script
library, every picture inline.

- the verdict, what was audited (backend, family, device, profile, seed, versions), what
  confined the backend, whether it ran interpreted;
- the property x dtype grid, each cell coloured by its verdict and linking to its result;
- each finding: its cause, message, shrunk case, a heatmap of where its values were
  wrong (the error over the bound, rows against queries; the sampled rows of a large
  case) and the reproducer;
- coverage: for each property, what its judged cases covered (query and key lengths,
  head dims, batch x heads, masks, causal alignments, variants), and what the
  declaration leaves untested or skipped.

The pictures are drawn with matplotlib (the ``viz`` extra), as PNG in ``data:`` URLs.
"""

import base64
import html
import io
from pathlib import Path
from typing import Any

from attnref.conformance.coverage import FEATURES
from attnref.conformance.declarations import not_tested
from attnref.conformance.report import (
    AuditReport,
    Finding,
    PropertyResult,
    interpreted_lines,
    sandbox_line,
)
from attnref.devices import dtype_name

__all__ = ["html_report", "write_html"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1200px; }
h1 { font-size: 1.5em; } h2 { margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; } td, th { padding: 3px 8px; border: 1px solid #ddd; }
th { background: #f4f4f4; text-align: left; }
td.pass { background: #d7f0d4; } td.fail { background: #f6c6c2; font-weight: bold; }
td.thin { background: #fbeeb8; } td.skip { background: #eee; color: #777; }
td a { color: inherit; text-decoration: none; display: block; }
.verdict { display: inline-block; padding: 2px 10px; border-radius: 4px; color: white; }
.ok { background: #2e7d32; } .bad { background: #c62828; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; font-size: 0.85em; }
.finding { border-left: 4px solid #c62828; padding-left: 1em; margin: 1.5em 0; }
.meta td:first-child { font-weight: bold; }
img { max-width: 100%; }
"""


def _png(figure: Any) -> str:
    """A matplotlib figure as an inline ``<img>``."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(figure)
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img alt="plot" src="data:image/png;base64,{data}">'


def heatmap(errors: dict[str, Any], title: str) -> str:
    """A finding's error map (`attnref.conformance.oracle.error_map`) as a picture: the
    error over the bound, the bound drawn as a contour (1), values that should have
    been finite marked x, the worst value circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    bound = float(errors.get("bound") or 0.0) or 1.0
    raw = np.array(
        [[np.nan if x is None else x for x in row] for row in errors["map"]], dtype=float
    )
    ratio = raw / bound
    top = float(np.nanmax(ratio)) if np.isfinite(ratio).any() else 1.0
    shown = np.where(np.isnan(ratio), max(top, 1.0) * 1.1, ratio)
    rows, cols = shown.shape
    figure, ax = plt.subplots(figsize=(min(12, 3 + cols * 0.15), min(6, 1.5 + rows * 0.3)))
    image = ax.imshow(shown, aspect="auto", cmap="magma", interpolation="nearest",
                      vmin=0.0, vmax=max(top, 1.0) * 1.1)  # fmt: skip
    if rows > 1 and cols > 1 and (shown > 1).any() and (shown <= 1).any():
        ax.contour(shown, levels=[1.0], colors="cyan", linewidths=1.0)
    bad = np.argwhere(np.isnan(ratio))
    if len(bad):
        ax.scatter(bad[:, 1], bad[:, 0], marker="x", color="cyan", s=12)
    if rows <= 16:
        ax.set_yticks(range(rows))
    if errors.get("worst"):
        r, c = errors["worst"]
        ax.scatter([c], [r], s=80, facecolors="none", edgecolors="lime", linewidths=1.5)
    labels = errors.get("column_labels")
    if labels:  # a long case's sampled rows: label the columns with the queries they are
        step = max(1, len(labels) // 12)
        ax.set_xticks(range(0, len(labels), step), [str(x) for x in labels[::step]],
                      rotation=60, fontsize=7)  # fmt: skip
    pooled = errors.get("pooled") or [1, 1]
    columns = errors.get("columns", "") + (" (the rows sampled)" if labels else "")
    ax.set_xlabel(columns + (f" (max over {pooled[1]})" if pooled[1] > 1 else ""))
    ax.set_ylabel(errors.get("rows", "") + (f" (max over {pooled[0]})" if pooled[0] > 1 else ""))
    ax.set_title(title, fontsize=9)
    bar = figure.colorbar(image, ax=ax)
    bar.set_label(f"error / bound (bound {bound:.3g})")
    bar.ax.axhline(1.0, color="cyan", linewidth=1.0)
    return _png(figure)


def coverage_plot(name: str, results: list[PropertyResult]) -> str:
    """A property's coverage over its dtypes: one bar chart a feature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    merged: dict[str, dict[str, int]] = {}
    for r in results:
        for feature, counts in r.coverage.items():
            into = merged.setdefault(feature, {})
            for value, n in counts.items():
                into[value] = into.get(value, 0) + n
    shown = [f for f in FEATURES if merged.get(f)]
    if not shown:
        return ""
    figure, axes = plt.subplots(1, len(shown), figsize=(2.2 * len(shown), 1.9), squeeze=False)
    for ax, feature in zip(axes[0], shown, strict=True):
        counts = merged[feature]
        keys = sorted(counts, key=_order)
        ax.bar(range(len(keys)), [counts[k] for k in keys], color="#4a78b5")
        ax.set_xticks(range(len(keys)), keys, rotation=60, fontsize=6, ha="right")
        ax.tick_params(axis="y", labelsize=6)
        ax.set_title(feature, fontsize=8)
    figure.suptitle(f"{name}: judged cases", fontsize=9, y=1.08)
    return _png(figure)


def _order(value: str) -> tuple[int, float, str]:
    """Numbers (and ``2-3`` bins) in numeric order, words after them."""
    head = value.split("-")[0].split("/")[0]
    try:
        return (0, float(head), value)
    except ValueError:
        return (1, 0.0, value)


def _cell(r: PropertyResult | None) -> tuple[str, str]:
    if r is None:
        return "skip", ""
    if r.status == "fail":
        return "fail", "FAIL"
    if r.status == "skip":
        return "skip", "skip"
    if r.thin:
        return "thin", f"thin {r.judged}"
    return "pass", f"ok {r.judged}"


def _anchor(r: PropertyResult) -> str:
    return f"r-{r.property}-{dtype_name(r.dtype)}"


def _finding_html(r: PropertyResult, finding: Finding) -> str:
    e = html.escape
    parts = [f'<div class="finding" id="{_anchor(r)}">',
             f"<h3>{e(r.property)} [{e(dtype_name(r.dtype))}]</h3>",
             f"<p><b>cause</b>: {e(finding.cause or finding.message)}</p>",
             f"<p>{e(finding.message)}</p>"]  # fmt: skip
    if finding.errors and finding.errors.get("map"):
        shape = "x".join(str(n) for n in finding.errors.get("shape", []))
        title = f"{r.property} [{dtype_name(r.dtype)}]: where the values were wrong ({shape})"
        parts.append(heatmap(finding.errors, title))
    parts.append(f"<p><b>shrunk case</b></p><pre>{e(repr(finding.case))}</pre>")
    parts.append(f"<p><b>reproducer</b> (copy and run)</p><pre>{e(finding.reproducer)}</pre>")
    parts.append("</div>")
    return "\n".join(parts)


def html_report(report: AuditReport) -> str:
    """The whole report as one HTML page (module docstring)."""
    e = html.escape
    attnref_version, torch_version = report.versions
    verdict = report.verdict()
    good = "ok" if report.ok else "bad"
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>attnref audit: {e(report.backend)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>attnref audit: {e(report.backend)} "
        f'<span class="verdict {good}" id="verdict">{e(verdict)}</span></h1>',
        '<table class="meta">',
    ]
    meta = [
        ("API family", report.api),
        ("device", report.device),
        ("profile", f"{report.profile} ({report.examples} cases a search)"),
        ("seed", str(report.seed)),
        ("versions", f"attnref {attnref_version}, torch {torch_version}"),
        ("started", report.started),
        ("seconds", f"{report.seconds:.1f} (judges: {report.judges})"),
        ("sandbox", sandbox_line(report.sandbox) if report.sandbox else "in-process"),
    ]
    if report.shard is not None:
        meta.append(("shard", f"{report.shard[0]} of {report.shard[1]}"))
    if report.incomplete:
        meta.append(("incomplete", report.incomplete))
    out += [f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in meta]
    out.append("</table>")
    for line in interpreted_lines(report.interpreted):
        out.append(f"<p>{e(line)}</p>")

    names, cells = report.grid()
    out.append('<h2>Properties</h2><table id="grid"><tr><th>property</th>')
    out += [f"<th>{e(d)}</th>" for d in report.dtypes]
    out.append("</tr>")
    for name in names:
        out.append(f"<tr><th>{e(name)}</th>")
        for d in report.dtypes:
            cell = cells.get((name, d))
            kind, text = _cell(cell)
            link = f'<a href="#{_anchor(cell)}">{e(text)}</a>' if cell is not None else ""
            out.append(f'<td class="{kind}">{link}</td>')
        out.append("</tr>")
    out.append("</table>")
    summary = report.coverage()
    out.append(
        f"<p>{report.count('pass')} passed, {report.count('fail')} failed, "
        f"{report.count('skip')} skipped; {summary['judged']} cases judged "
        f"({summary['cases_skipped']} skipped, {summary['cases_refused']} refused).</p>"
    )

    findings = report.findings()
    out.append(f"<h2>Findings ({len(findings)})</h2>")
    shown: set[str] = set()
    for cause, members in findings:
        listed = ", ".join(f"{m.property} [{dtype_name(m.dtype)}]" for m in members)
        out.append(f"<h3>{e(cause)}</h3><p>{len(members)}: {e(listed)}</p>")
        for m in members:
            if m.finding is not None and _anchor(m) not in shown:
                shown.add(_anchor(m))
                out.append(_finding_html(m, m.finding))

    out.append("<h2>Coverage</h2>")
    out.append("<p>What each property's judged cases covered, over its dtypes.</p>")
    by_property: dict[str, list[PropertyResult]] = {}
    for r in report.results:
        by_property.setdefault(r.property, []).append(r)
    for name, results in by_property.items():
        for r in results:
            if _anchor(r) not in shown:
                kind, text = _cell(r)
                why = f": {r.message}" if r.message else ""
                out.append(f'<p id="{_anchor(r)}">{e(name)} [{e(dtype_name(r.dtype))}]: '
                           f"{e(text or kind)}{e(why)}</p>")  # fmt: skip
        plot = coverage_plot(name, results)
        if plot:
            out.append(plot)
    untested = not_tested(report.capabilities)
    if untested:
        out.append("<h2>Not tested, as declared</h2><ul>")
        out += [f"<li>{e(x)}</li>" for x in untested]
        out.append("</ul>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_html(report: AuditReport, path: str | Path) -> Path:
    """Write `html_report` to ``path``."""
    path = Path(path)
    path.write_text(html_report(report))
    return path
