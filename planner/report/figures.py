"""Matplotlib figures saved to files: the format comes from the extension, one look for every chart.

Figures are built with `matplotlib.figure.Figure` directly (no pyplot): no global state, no GUI
backend, safe in worker processes and tests.
"""
from __future__ import annotations

import io
from pathlib import Path

from matplotlib.figure import Figure

from planner.errors import invalid

IMAGE_SUFFIXES = (".png", ".svg")
# PNG resolution: sharp on a laptop screen at 100% zoom and in a printed report.
PNG_DPI = 150
TITLE_SIZE = 13
SUBTITLE_SIZE = 10
NOTE_SIZE = 8.5

# One colour per kind of work, shared by the timeline and memory charts (colour-blind-safe
# "deep" palette of seaborn).
COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "weight_grad": "#55A868",
    "p2p": "#5F5F5F",
    "dp_comm": "#C44E52",
    "optimizer": "#8172B3",
    "weights": "#4C72B0",
    "grads": "#DD8452",
    "optimizer_states": "#8172B3",
    "activations": "#55A868",
    "other_memory": "#937860",
    "capacity": "#C44E52",
}


def check_image_path(path: str | Path, option: str) -> Path:
    """`path` as a Path once its extension is one matplotlib writes here.

    Raises:
        PlannerError: INVALID_INPUT naming `option` for any other extension.
    """
    path = Path(path)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise invalid(f"{option} {path}: unknown image extension {path.suffix!r}; use .png or .svg")
    return path


def new_figure(width_in: float, height_in: float) -> Figure:
    """A blank figure with constrained layout (titles, labels and legends never overlap)."""
    return Figure(figsize=(width_in, height_in), layout="constrained")


def save_figure(figure: Figure, path: str | Path, option: str = "image") -> Path:
    """Write `figure` as PNG or SVG by the extension of `path`; creates missing folders.

    Raises:
        PlannerError: INVALID_INPUT for an extension other than .png or .svg.
    """
    path = check_image_path(path, option)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=PNG_DPI)
    return path


def png_bytes(figure: Figure) -> bytes:
    """`figure` as PNG data (for embedding in a report)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=PNG_DPI)
    return buffer.getvalue()


def set_titles(figure: Figure, title: str, subtitle: str = "", axes=None) -> None:
    """A bold figure title and, over `axes` from its left edge, a smaller line of detail (a long one
    runs on over the legend's column rather than off the figure's left edge)."""
    figure.suptitle(title, fontsize=TITLE_SIZE, fontweight="bold")
    if subtitle and axes is not None:
        axes.set_title(subtitle, fontsize=SUBTITLE_SIZE, color="#333333", loc="left")


def time_unit(span_s: float) -> tuple[float, str]:
    """(scale, unit) that show `span_s` in readable numbers: seconds, or milliseconds below 1 s."""
    return (1.0, "s") if span_s >= 1.0 else (1e3, "ms")
