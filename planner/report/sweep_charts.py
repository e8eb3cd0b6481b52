"""Charts of a sweep: throughput and MFU against cluster size per device, and cost per million tokens.

One panel per (model, sequence length, global batch); in it, one line (or bar group) per
device. Only points with a plan are drawn; the caption lists what is missing and why.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, FixedLocator, NullLocator, PercentFormatter, StrMethodFormatter

from planner.report.figures import NOTE_SIZE, new_figure, save_figure, set_titles
from planner.sweeps.results import PointStatus

PANEL_COLUMNS = 3
PANEL_WIDTH_IN = 5.2
PANEL_HEIGHT_IN = 3.6
# Colours of the devices, in order of first appearance (matplotlib's tab10, then tab20).
DEVICE_CMAP = "tab10"
MARKERS = "osD^vP*Xh<>p"
# Room above the highest point of a line chart, as a fraction of it.
Y_HEADROOM = 0.08
CHART_NAMES = ("throughput", "mfu", "cost")

PanelKey = tuple[str, int, int]  # (model, seq_len, global_batch)


def throughput_figure(rows: list[dict]) -> Figure:
    """Tokens per second of the whole cluster against its size, one line per device."""
    return _lines(rows, "tokens_per_s", "throughput (tokens/s, whole cluster)", "Training throughput by cluster size",
                  EngFormatter(sep=""))


def mfu_figure(rows: list[dict]) -> Figure:
    """Model FLOPs utilisation against cluster size, one line per device."""
    return _lines(rows, "mfu", "MFU (model FLOP/s / peak)", "Model FLOPs utilisation by cluster size",
                  PercentFormatter(1.0, decimals=0))


def cost_figure(rows: list[dict]) -> Figure:
    """USD per million training tokens, grouped bars: one group per device, one bar per cluster size."""
    panels = _panels(rows)
    figure, grid = _grid(len(panels))
    colours = _colours(sorted({row["devices"] for row in rows}))
    for axes, (key, panel_rows) in zip(grid, panels.items()):
        priced = [row for row in panel_rows if _ok(row) and row["usd_per_million_tokens"] is not None]
        devices = list(dict.fromkeys(row["device"] for row in priced))
        sizes = sorted({row["devices"] for row in priced})
        width = 0.8 / max(1, len(sizes))
        for offset, size in enumerate(sizes):
            cells = {row["device"]: row["usd_per_million_tokens"] for row in priced if row["devices"] == size}
            xs = [index + (offset - (len(sizes) - 1) / 2) * width for index, device in enumerate(devices) if device in cells]
            axes.bar(xs, [cells[d] for d in devices if d in cells], width, color=colours[size], label=f"{size} devices")
        axes.set_xticks(range(len(devices)), devices, rotation=30, ha="right")
        axes.set_ylabel("USD per million tokens")
        axes.yaxis.set_major_formatter(StrMethodFormatter("${x:,.4g}"))  # cents would round $0.009 to $0.01
        axes.set_title(_panel_title(key), fontsize=10)
        axes.grid(axis="y", alpha=0.3)
        axes.set_axisbelow(True)
        if not priced:
            axes.text(0.5, 0.5, "no priced device with a plan", transform=axes.transAxes, ha="center", color="#666666")
    _hide_unused(grid, len(panels))
    _legend(figure, grid, "cluster size")
    unpriced = sorted({row["device"] for row in rows if row["cluster_usd_per_hour"] is None})
    note = "price: on-demand USD per device-hour from the device profile x devices"
    if unpriced:
        note += f"; no price in the profile: {', '.join(unpriced)}"
    set_titles(figure, "Training cost per million tokens")
    figure.supxlabel(_missing_note(rows, note), fontsize=NOTE_SIZE)
    return figure


def save_sweep_charts(rows: list[dict], folder: str | Path, suffix: str = ".png") -> list[Path]:
    """Write throughput, MFU and cost charts (`CHART_NAMES`) of a sweep's rows into `folder`."""
    folder = Path(folder)
    figures = (throughput_figure(rows), mfu_figure(rows), cost_figure(rows))
    return [save_figure(figure, folder / f"{name}{suffix}") for name, figure in zip(CHART_NAMES, figures)]


def _lines(rows: list[dict], column: str, ylabel: str, title: str, formatter) -> Figure:
    panels = _panels(rows)
    figure, grid = _grid(len(panels))
    devices = list(dict.fromkeys(row["device"] for row in rows))
    colours = _colours(devices)
    for axes, (key, panel_rows) in zip(grid, panels.items()):
        sizes = sorted({row["devices"] for row in panel_rows})
        for index, device in enumerate(devices):
            points = sorted((row["devices"], row[column]) for row in panel_rows if row["device"] == device and _ok(row))
            if points:
                axes.plot(*zip(*points), marker=MARKERS[index % len(MARKERS)], color=colours[device], label=device)
        axes.set_xscale("log", base=2)
        axes.xaxis.set_major_locator(FixedLocator(sizes))
        axes.xaxis.set_minor_locator(NullLocator())
        axes.xaxis.set_major_formatter(EngFormatter(places=0, sep=""))
        axes.yaxis.set_major_formatter(formatter)
        highest = max((y for line in axes.get_lines() for y in line.get_ydata()), default=0)
        axes.set_ylim(bottom=0, top=highest * (1 + Y_HEADROOM) if highest else None)  # no marker cut by the frame
        axes.set_xlabel("cluster size (devices)")
        axes.set_ylabel(ylabel)
        axes.set_title(_panel_title(key), fontsize=10)
        axes.grid(alpha=0.3)
        if not any(_ok(row) for row in panel_rows):
            axes.set_yticks([])
            axes.text(0.5, 0.5, "no plan on any cluster\n(see the results' reasons)", transform=axes.transAxes,
                      ha="center", va="center", fontsize=NOTE_SIZE)
    _hide_unused(grid, len(panels))
    _legend(figure, grid, "device")
    set_titles(figure, title)
    figure.supxlabel(_missing_note(rows, "each point is the best plan found for that cluster"), fontsize=NOTE_SIZE)
    return figure


def _ok(row: dict) -> bool:
    return row["status"] == PointStatus.OK


def _panels(rows: list[dict]) -> dict[PanelKey, list[dict]]:
    panels: dict[PanelKey, list[dict]] = defaultdict(list)
    for row in rows:
        panels[row["model"], row["seq_len"], row["global_batch"]].append(row)
    return dict(panels)


def _panel_title(key: PanelKey) -> str:
    model, seq_len, global_batch = key
    return f"{model}, {seq_len} tokens x {global_batch} sequences"


def _grid(count: int) -> tuple[Figure, list]:
    columns = min(PANEL_COLUMNS, max(1, count))
    rows = max(1, math.ceil(count / columns))
    figure = new_figure(PANEL_WIDTH_IN * columns + 1.6, PANEL_HEIGHT_IN * rows + 1.0)
    return figure, list(figure.subplots(rows, columns, squeeze=False).flat)


def _hide_unused(grid: list, used: int) -> None:
    for axes in grid[used:]:
        axes.set_visible(False)


def _colours(keys: list) -> dict:
    from matplotlib import colormaps

    palette = colormaps[DEVICE_CMAP if len(keys) <= 10 else "tab20"]
    return {key: palette(index % palette.N) for index, key in enumerate(keys)}


def _legend(figure: Figure, grid: list, title: str) -> None:
    labelled = {}
    for axes in grid:
        for handle, label in zip(*axes.get_legend_handles_labels()):
            labelled.setdefault(label, handle)
    if labelled:
        figure.legend(labelled.values(), labelled.keys(), title=title, loc="outside right upper", frameon=False)


def _missing_note(rows: list[dict], note: str) -> str:
    missing = Counter(row["status"] for row in rows if not _ok(row))
    if not missing:
        return note
    counts = ", ".join(f"{count} {status}" for status, count in sorted(missing.items()))
    return f"{note}\nnot drawn: {counts} (no plan; the results file's reason column says why)"
