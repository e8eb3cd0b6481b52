"""Memory per device by pipeline stage: stacked bars of what fills it, against the device's capacity."""
from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from planner.report.figures import COLOURS, new_figure, save_figure, set_titles
from planner.report.units import GIB
from planner.result import Estimate, Plan

# (colour key, legend text, breakdown keys summed into the segment), bottom to top.
SEGMENTS = (
    ("weights", "weights", ("weights_bytes",)),
    ("grads", "gradients", ("grads_bytes",)),
    ("optimizer_states", "optimizer states", ("optimizer_bytes",)),
    ("activations", "activations", ("activations_bytes",)),
    ("other_memory", "buffers, temporaries, CUDA context, allocator reserve", ("comm_buffers_bytes", "temp_bytes", "overhead_bytes")),
)
BAR_WIDTH = 0.6
# Room above the tallest bar or capacity line for the value labels.
TOP_MARGIN = 1.18
MIN_WIDTH_IN = 8.0
WIDTH_PER_STAGE_IN = 0.75
HEIGHT_IN = 5.0


def memory_figure(estimate: Estimate, subtitle: str) -> Figure:
    """Stacked memory bars per pipeline stage (GiB), each with its device's capacity as a dashed line.

    Each bar is the largest device of its stage; activations are counted at the schedule's peak
    of micro-batches in flight.

    The bars carry gids "<colour key>:<stage>", the capacity lines "capacity:<stage>".
    """
    stages = estimate.memory
    figure = new_figure(max(MIN_WIDTH_IN, 2.5 + WIDTH_PER_STAGE_IN * len(stages)), HEIGHT_IN)
    axes = figure.add_subplot()
    bottoms = [0.0] * len(stages)
    for key, _, parts in SEGMENTS:
        heights = [sum(row.get(part, 0.0) for part in parts) / GIB for row in stages]
        bars = axes.bar(range(len(stages)), heights, BAR_WIDTH, bottom=bottoms, color=COLOURS[key], edgecolor="white", linewidth=0.5)
        for index, bar in enumerate(bars):
            bar.set_gid(f"{key}:{stages[index]['stage']}")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    capacities = {row["capacity_bytes"] for row in stages}
    for index, row in enumerate(stages):
        line = axes.hlines(row["capacity_bytes"] / GIB, index - BAR_WIDTH * 0.7, index + BAR_WIDTH * 0.7,
                           colors=COLOURS["capacity"], linestyles="--", linewidth=1.6)
        line.set_gid(f"capacity:{row['stage']}")
        share = row["total_bytes"] / row["capacity_bytes"]
        axes.annotate(f"{row['total_bytes'] / GIB:.1f} GiB\n{share:.0%}", (index, row["total_bytes"] / GIB), xytext=(0, 2),
                      textcoords="offset points", ha="center", va="bottom", fontsize=8,
                      color=COLOURS["capacity"] if share > 1 else "black")
    devices = list(dict.fromkeys(row["device"] for row in stages))
    one_device = len(devices) == 1
    axes.set_xticks(range(len(stages)), [f"{row['stage']}" if one_device else f"{row['stage']}\n{row['device']}" for row in stages])
    axes.set_xlabel(f"pipeline stage ({devices[0]})" if one_device else "pipeline stage (device)")
    axes.set_ylim(0, max(max(row["total_bytes"], row["capacity_bytes"]) for row in stages) / GIB * TOP_MARGIN)
    axes.set_ylabel("memory per device (GiB)")
    axes.grid(axis="y", alpha=0.3)
    axes.set_axisbelow(True)
    capacity_text = f"device memory ({next(iter(capacities)) / GIB:.1f} GiB)" if len(capacities) == 1 else "device memory"
    handles = [Patch(facecolor=COLOURS[key], label=text) for key, text, _ in reversed(SEGMENTS)]
    handles.append(Line2D([], [], color=COLOURS["capacity"], linestyle="--", label=capacity_text))
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    set_titles(figure, "Memory per device by pipeline stage", subtitle, axes)
    return figure


def save_memory_chart(plan: Plan, path: str | Path) -> Path:
    """Write the per-stage memory chart of `plan` to a .png or .svg file."""
    subtitle = f"{plan.model} on {plan.cluster}, {plan.config.short()}"
    return save_figure(memory_figure(plan.estimate, subtitle), path, "--memory-chart")
