"""The audit as one self-contained HTML page (docs/reports.md): no network, no script
library, every picture inline.

- the verdict, what was audited (backend, family, device, profile, seed, versions), what
  confined the backend, whether it ran interpreted;
- the property x dtype grid, each cell coloured by its verdict and linking to its result;
- each finding (one bug): its cause, the smallest trigger's message, shrunk case, a
  heatmap of where its values were wrong (the error over the bound, rows against
  queries; the sampled rows of a large case; one query's error drawn against its
  columns), what the backend printed, and the reproducer, once; its variations (the
  same bug in other properties and dtypes) folded under it, a line and a case each;
- coverage: what the judged cases covered (query and key lengths, head dims, batch x
  heads, masks, causal alignments, variants), the whole audit's as bars and each
  property's as a table, and what the declaration leaves untested or skipped.

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
    cell_text,
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
pre { background: #f7f7f7; padding: 8px; font-size: 0.85em; white-space: pre-wrap;
      overflow-wrap: anywhere; }
details { margin: 0.5em 0; } summary { cursor: pointer; }
.variation { margin: 0.4em 0 0.8em 1em; }
.finding { border-left: 4px solid #c62828; padding-left: 1em; margin: 1.5em 0; }
.meta td:first-child { font-weight: bold; }
table.coverage th { width: 9em; } table.coverage { font-size: 0.85em; margin-bottom: 1em; }
img { max-width: 100%; }
div.bars { display: flex; flex-wrap: wrap; align-items: flex-start; gap: 1em; margin-bottom: 1em; }
table.bars { font-size: 0.8em; width: 16em; border: none; }
table.bars caption { font-weight: bold; text-align: left; }
table.bars th { width: 6em; text-align: right; font-weight: normal; border: none; background: none;
                 white-space: nowrap; }
table.bars td { border: none; white-space: nowrap; }
span.bar { display: inline-block; height: 0.8em; background: #4a78b5; margin-right: 0.3em; }
"""


def _png(figure: Any, dpi: int = 80) -> str:
    """A matplotlib figure as an inline ``<img>``."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
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
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = raw / bound
    # an infinite error (the map keeps it as the largest float): marked x, off the scale
    ratio = np.where(np.isfinite(ratio) & (np.abs(raw) < 1e300), ratio, np.nan)
    finite = np.isfinite(ratio)
    top = float(ratio[finite].max()) if finite.any() else 1.0
    shown = np.where(finite, ratio, max(top, 1.0) * 1.1)
    rows, cols = shown.shape
    if rows == 1 and cols > 1:  # one query: its error against its columns, not one strip
        return _line(ratio[0], errors, title)
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


def _line(ratio: Any, errors: dict[str, Any], title: str) -> str:
    """One row of an error map as a line over its columns (a one-query case): the error
    over the bound, the bound at 1, non-finite values marked x on the top edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    finite = np.isfinite(ratio)
    top = float(np.nanmax(np.where(finite, ratio, np.nan))) if finite.any() else 1.0
    figure, ax = plt.subplots(figsize=(8, 2.6))
    ax.plot(np.where(finite, ratio, np.nan), marker=".", color="#7b2cbf")
    bad = np.flatnonzero(~finite)
    if len(bad):
        ax.scatter(bad, [max(top, 1.0) * 1.05] * len(bad), marker="x", color="#c62828")
    ax.axhline(1.0, color="#0097a7", linewidth=1.0, label="the bound")
    ax.set_xlabel(errors.get("columns", "") or "column")
    ax.set_ylabel("error / bound")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _png(figure)


def _merged(results: list[PropertyResult]) -> dict[str, dict[str, int]]:
    """The coverage of ``results`` added up: each feature's values and their cases."""
    merged: dict[str, dict[str, int]] = {}
    for r in results:
        for feature, counts in r.coverage.items():
            into = merged.setdefault(feature, {})
            for value, n in counts.items():
                into[value] = into.get(value, 0) + n
    return merged


def coverage_table(results: list[PropertyResult]) -> str:
    """A property's coverage over its dtypes as a table: a feature a row, its values with
    their cases (text a reader can search and copy, a few hundred bytes)."""
    e = html.escape
    merged = _merged(results)
    rows = []
    for feature in FEATURES:
        counts = merged.get(feature)
        if counts:
            values = ", ".join(f"{k}: {counts[k]}" for k in sorted(counts, key=_order))
            rows.append(f"<tr><th>{e(feature)}</th><td>{e(values)}</td></tr>")
    return f'<table class="coverage">{"".join(rows)}</table>' if rows else ""


def coverage_bars(name: str, results: list[PropertyResult]) -> str:
    """The coverage of ``results`` (the whole audit's) as bars drawn in HTML: a block a
    feature, a bar a value, as long as its share of the feature's largest count. Text a
    reader can search and copy; matplotlib drew it as a picture in 5-15 s, most of a
    page's time (its tick labels laid out twice), where this takes milliseconds."""
    e = html.escape
    merged = _merged(results)
    blocks = []
    for feature in FEATURES:
        counts = merged.get(feature)
        if not counts:
            continue
        most = max(counts.values()) or 1
        bars = "".join(
            f'<tr><th>{e(k)}</th><td><span class="bar" style="width:{9 * n / most:.1f}em">'
            f"</span>{n}</td></tr>"
            for k, n in sorted(counts.items(), key=lambda kv: _order(kv[0]))
        )
        blocks.append(f'<table class="bars"><caption>{e(feature)}</caption>{bars}</table>')
    if not blocks:
        return ""
    return f'<div class="bars" title="{e(name)}: judged cases">{"".join(blocks)}</div>'


def _order(value: str) -> tuple[int, float, str]:
    """Numbers (and ``2-3`` bins) in numeric order, words after them."""
    head = value.split("-")[0].split("/")[0]
    try:
        return (0, float(head), value)
    except ValueError:
        return (1, 0.0, value)


def _cell(r: PropertyResult | None) -> tuple[str, str]:
    """The grid's class and text for ``r``: the terminal's text (`cell_text`)."""
    if r is None:
        return "skip", ""
    kind = {"fail": "fail", "skip": "skip"}.get(r.status, "thin" if r.thin else "pass")
    return kind, cell_text(r)


def _anchor(r: PropertyResult) -> str:
    return f"r-{r.property}-{dtype_name(r.dtype)}"


def _finding_html(r: PropertyResult, finding: Finding) -> str:
    """A finding's smallest trigger, whole: its message, heatmap, shrunk case, what the
    backend printed, the precision miss its search also met, and the reproducer."""
    e = html.escape
    parts = [f'<div id="{_anchor(r)}">',
             f"<p><b>smallest trigger</b>: {e(r.property)} [{e(dtype_name(r.dtype))}]</p>",
             f"<pre>{e(finding.message)}</pre>"]  # fmt: skip
    if finding.errors and finding.errors.get("map"):
        shape = "x".join(str(n) for n in finding.errors.get("shape", []))
        title = f"{r.property} [{dtype_name(r.dtype)}]: where the values were wrong ({shape})"
        parts.append(heatmap(finding.errors, title))
    parts.append(f"<p><b>shrunk case</b></p><pre>{e(repr(finding.case))}</pre>")
    if finding.output.strip():
        parts.append(f"<p><b>what the backend printed</b> (its last lines)</p>"
                     f"<pre>{e(finding.output.rstrip())}</pre>")  # fmt: skip
    if r.also is not None:
        parts.append(f"<p><b>also met on another case</b>: {e(r.also.cause)}</p>"
                     f"<pre>{e(r.also.message)}</pre>")  # fmt: skip
    parts.append(f"<p><b>reproducer</b> (copy and run)</p><pre>{e(finding.reproducer)}</pre>")
    parts.append("</div>")
    return "\n".join(parts)


def _variation_html(r: PropertyResult) -> str:
    """Another (property, dtype) of a finding: its message and shrunk case."""
    e = html.escape
    parts = [f'<div class="variation" id="{_anchor(r)}">',
             f"<b>{e(r.property)} [{e(dtype_name(r.dtype))}]</b>",
             f"<pre>{e(r.message)}</pre>"]  # fmt: skip
    if r.finding is not None:
        parts.append(f"<pre>{e(repr(r.finding.case))}</pre>")
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
    meta.append(("dtypes", ", ".join(report.dtypes)))
    meta.append(("judged at least", f"{report.floor} cases a pass (else thin)"))
    meta += [(name, value) for name, value in report.options.items()]
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
    out.append(f"<pre>{e(report.format_table().splitlines()[-1])}</pre>")  # the summary
    out.append(
        "<p>A cell: FAIL, skip, or ok N (thin N: fewer than the floor) with N the cases "
        "judged, sK cases skipped as outside the declaration, rJ refused as declared.</p>"
    )

    findings = report.findings()
    out.append(f"<h2>Findings ({len(findings)})</h2>")
    shown: set[str] = set()
    for n, (cause, members) in enumerate(findings, 1):
        head, rest = members[0], members[1:]
        out.append(f'<div class="finding"><h3>{n}. {e(cause)}</h3>')
        shown.add(_anchor(head))
        if head.finding is not None:
            out.append(_finding_html(head, head.finding))
        else:
            out.append(f'<pre id="{_anchor(head)}">{e(head.message)}</pre>')
        if rest:
            listed = ", ".join(f"{m.property} [{dtype_name(m.dtype)}]" for m in rest)
            out.append(f"<details><summary>{len(rest)} more: the same bug in {e(listed)}"
                       "</summary>")  # fmt: skip
            for m in rest:
                shown.add(_anchor(m))
                out.append(_variation_html(m))
            out.append("</details>")
        out.append("</div>")

    out.append("<h2>Coverage</h2>")
    out.append("<p>What the judged cases covered: the whole audit's, then each property's "
               "over its dtypes (a feature's values, each with its cases).</p>")  # fmt: skip
    out.append(coverage_bars("every property", report.results))
    by_property: dict[str, list[PropertyResult]] = {}
    for r in report.results:
        by_property.setdefault(r.property, []).append(r)
    for name, results in by_property.items():
        out.append(f"<h3>{e(name)}</h3>")
        for r in results:
            if _anchor(r) not in shown:
                kind, text = _cell(r)
                why = f": {r.message}" if r.message else ""
                out.append(f'<p id="{_anchor(r)}">{e(name)} [{e(dtype_name(r.dtype))}]: '
                           f"{e(text or kind)}{e(why)}</p>")  # fmt: skip
        out.append(coverage_table(results))
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
