"""Reports of a sweep: the summary `paraplan sweep` prints, and an HTML or Markdown report of a results file.

The report bundles the sweep charts (`planner.report.sweep_charts`), the best plan of each
workload (fastest and cheapest), every point's row and the points without a plan with the
reason. HTML embeds the charts; Markdown writes them as PNG files next to the report.
"""
from __future__ import annotations

import base64
import html
from collections import Counter
from pathlib import Path

from rich.table import Table

from planner.errors import invalid
from planner.report.figures import png_bytes, save_figure
from planner.report.sweep_charts import CHART_NAMES, cost_figure, mfu_figure, throughput_figure
from planner.report.units import fmt_bytes, fmt_number_of, fmt_seconds
from planner.sweeps.results import PointStatus, read_results
from planner.sweeps.runner import SweepSummary

REPORT_SUFFIXES = (".html", ".htm", ".md")
CHART_TITLES = ("Throughput", "MFU", "Cost per million tokens")
HTML_STYLE = """body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f0f0f0; } td.num { text-align: right; }
img { max-width: 100%; margin: 1em 0; }"""
ALL_POINT_COLUMNS = ("model", "cluster", "global batch", "seq len", "status", "config", "tokens/s", "MFU", "step time",
                     "peak memory", "USD / M tokens", "notes")


def render_sweep_summary(summary: SweepSummary) -> Table:
    """The table `paraplan sweep` prints when a sweep finishes."""
    table = Table(title=f"Sweep: {fmt_number_of(summary.points, 'point')} in {summary.path}", show_header=False,
                  title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    earlier = summary.points - summary.planned
    if not summary.planned:
        table.add_row("planned now", f"none: {'the one point was' if earlier == 1 else f'all {earlier} were'} already in the file")
    else:
        table.add_row("planned now", f"{summary.planned} (the other {earlier} {'was' if earlier == 1 else 'were'} already in the file)"
                      if earlier else str(summary.planned))
    for status in PointStatus:
        if summary.status_counts.get(status):
            table.add_row(str(status), str(summary.status_counts[status]))
    table.add_row("time", f"{fmt_seconds(summary.elapsed_s)}" + (f" ({fmt_seconds(summary.planning_s)} planning, "
                                                                  f"{summary.points_per_s:.2f} points/s)" if summary.planned else ""))
    return table


def write_sweep_report(results_path: str | Path, out: str | Path) -> Path:
    """Write the report of the results file `results_path` to `out` (.html or .md).

    Raises:
        PlannerError: INVALID_INPUT for another extension or a file that is not a sweep's results.
    """
    out = Path(out)
    if out.suffix.lower() not in REPORT_SUFFIXES:
        raise invalid(f"--out {out}: unknown report extension {out.suffix!r}; use .html or .md")
    rows = read_results(results_path)
    if not rows:
        raise invalid(f"results file {results_path}: no rows yet; run the sweep first")
    figures = (throughput_figure(rows), mfu_figure(rows), cost_figure(rows))
    sections = _sections(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    title = f"Sweep report: {Path(results_path).name}"
    if out.suffix.lower() == ".md":
        charts = [save_figure(figure, out.with_name(f"{out.stem}_{name}.png")) for name, figure in zip(CHART_NAMES, figures)]
        out.write_text(_markdown(title, rows, charts, sections))
    else:
        out.write_text(_html(title, rows, [png_bytes(figure) for figure in figures], sections))
    return out


Section = tuple[str, tuple[str, ...], list[tuple[str, ...]]]  # (heading, columns, rows of cells)


def _sections(rows: list[dict]) -> list[Section]:
    ok = [row for row in rows if row["status"] == PointStatus.OK]
    best = []
    for key in dict.fromkeys((row["model"], row["seq_len"], row["global_batch"]) for row in ok):
        group = [row for row in ok if (row["model"], row["seq_len"], row["global_batch"]) == key]
        fastest = max(group, key=lambda row: row["tokens_per_s"])
        priced = [row for row in group if row["usd_per_million_tokens"] is not None]
        cheapest = min(priced, key=lambda row: row["usd_per_million_tokens"]) if priced else None
        best.append((key[0], str(key[1]), str(key[2]), fastest["cluster"], fastest["config"],
                     f"{fastest['tokens_per_s']:,.0f}", f"{fastest['mfu']:.1%}",
                     cheapest["cluster"] if cheapest else "-", _usd(cheapest["usd_per_million_tokens"]) if cheapest else "-"))
    failed = [(row["model"], row["cluster"], str(row["global_batch"]), str(row["seq_len"]), row["status"], row["reason"] or "")
              for row in rows if row["status"] != PointStatus.OK]
    return [
        ("Best plan per workload", ("model", "seq len", "global batch", "fastest cluster", "its config", "tokens/s", "MFU",
                                    "cheapest priced cluster", "USD / M tokens"), best),
        ("Points without a plan", ("model", "cluster", "global batch", "seq len", "status", "reason"), failed),
        ("All points", ALL_POINT_COLUMNS, [_point_cells(row) for row in rows]),
    ]


def _point_cells(row: dict) -> tuple[str, ...]:
    ok = row["status"] == PointStatus.OK
    return (row["model"], row["cluster"], str(row["global_batch"]), str(row["seq_len"]), row["status"],
            row["config"] or "", f"{row['tokens_per_s']:,.0f}" if ok else "", f"{row['mfu']:.1%}" if ok else "",
            fmt_seconds(row["step_time_s"]) if ok else "", fmt_bytes(row["peak_memory_bytes"]) if ok else "",
            _usd(row["usd_per_million_tokens"]) if ok and row["usd_per_million_tokens"] is not None else "",
            row.get("notes") or "")  # e.g. bf16 priced as fp16 on a device without it


def _usd(value: float) -> str:
    return f"${value:,.3f}"


def _overview(rows: list[dict]) -> str:
    """The points per status, and the settings they were planned with (dtype, fixed choices,
    training code: one sweep's, as a results file holds)."""
    counts = Counter(row["status"] for row in rows)
    by_status = ", ".join(f"{counts[status]} {status}" for status in PointStatus if counts[status])
    settings = "; ".join(dict.fromkeys(row["settings"] for row in rows))
    return f"{fmt_number_of(len(rows), 'point')}: {by_status}. Planned with {settings}."


def _html(title: str, rows: list[dict], charts: list[bytes], sections: list[Section]) -> str:
    parts = [f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{HTML_STYLE}</style></head><body>", f"<h1>{html.escape(title)}</h1>", f"<p>{_overview(rows)}</p>"]
    for heading, data in zip(CHART_TITLES, charts):
        parts.append(f"<h2>{heading}</h2><img alt='{heading}' src='data:image/png;base64,{base64.b64encode(data).decode()}'>")
    for heading, columns, cells in sections:
        if not cells:
            continue
        parts.append(f"<h2>{html.escape(heading)}</h2><table><tr>{''.join(f'<th>{html.escape(c)}</th>' for c in columns)}</tr>")
        for line in cells:
            parts.append("<tr>" + "".join(f"<td{_numeric(cell)}>{html.escape(cell)}</td>" for cell in line) + "</tr>")
        parts.append("</table>")
    return "\n".join(parts + ["</body></html>\n"])


def _numeric(cell: str) -> str:
    return " class='num'" if cell[:1].isdigit() or cell[:1] == "$" else ""


def _markdown(title: str, rows: list[dict], charts: list[Path], sections: list[Section]) -> str:
    parts = [f"# {title}", "", _overview(rows), ""]
    for heading, path in zip(CHART_TITLES, charts):
        parts += [f"## {heading}", "", f"![{heading}]({path.name})", ""]
    for heading, columns, cells in sections:
        if not cells:
            continue
        parts += [f"## {heading}", "", _md_row(columns), _md_row(tuple("---" for _ in columns))]
        parts += [_md_row(line) for line in cells] + [""]
    return "\n".join(parts)


def _md_row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"
