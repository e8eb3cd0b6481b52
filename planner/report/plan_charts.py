"""The charts `paraplan plan` draws on request: the pipeline timeline and the per-stage memory chart."""
from __future__ import annotations

from pathlib import Path

from planner.errors import invalid
from planner.report.figures import check_image_path
from planner.report.memory_chart import save_memory_chart
from planner.report.timeline import save_timeline
from planner.result import Plan


def check_plan_chart_paths(timeline: str | None, memory_chart: str | None) -> None:
    """Reject unknown image extensions before any planning starts.

    Raises:
        PlannerError: INVALID_INPUT naming the option.
    """
    for option, path in (("--timeline", timeline), ("--memory-chart", memory_chart)):
        if path is not None:
            check_image_path(path, option)
    if timeline and memory_chart and Path(timeline).resolve() == Path(memory_chart).resolve():
        raise invalid(f"--memory-chart {memory_chart}: the same file as --timeline; give each chart its own path")


def save_plan_charts(plan: Plan, timeline: str | None = None, memory_chart: str | None = None) -> list[Path]:
    """Write the charts asked for (paths ending .png or .svg); returns their paths."""
    written = []
    if timeline:
        written.append(save_timeline(plan, timeline))
    if memory_chart:
        written.append(save_memory_chart(plan, memory_chart))
    return written
