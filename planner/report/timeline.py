"""The pipeline timeline of a plan: a Gantt chart of one training step, one lane per pipeline stage.

The bars are the events of `costmodel.pipeline_sim.simulate` for the plan's stages (forward,
backward and, under zero bubble, weight-gradient ops of each micro-batch), the point-to-point
transfers between stages, and what follows the pipeline on every device: the exposed
data-parallel gradient reduction and the optimizer step. Every data-parallel replica runs the
same timeline, so one lane stands for all the devices of its stage.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.text import Text

from costmodel import pipeline_sim
from costmodel.pipeline_sim import EventKind, ScheduleResult
from planner.report.figures import COLOURS, new_figure, save_figure, set_titles, time_unit
from planner.result import Plan

# Lane geometry, in lane units (one lane per stage): compute bars, and under them a thin band
# for transfers.
COMPUTE_BAR = (-0.42, 0.62)  # (offset from the lane centre, height)
TRANSFER_BAR = (0.24, 0.16)
# Legend entries per row under the timeline: more run off an 11-inch figure's edges.
TIMELINE_LEGEND_COLUMNS = 4
# A micro-batch number is written in a bar at least this share of the time axis wide.
MIN_LABELLED_BAR_FRACTION = 1 / 70
FIGURE_WIDTH_IN = 13.0
LANE_HEIGHT_IN = 0.55
MIN_FIGURE_HEIGHT_IN = 3.2

EVENT_STYLE = {
    EventKind.FORWARD: ("forward", "forward"),
    EventKind.BACKWARD: ("backward", "backward"),
    EventKind.WEIGHT: ("weight_grad", "weight gradient (zero bubble)"),
}


def simulate_plan(plan: Plan) -> ScheduleResult:
    """The event simulation of the plan's pipeline (one step, every micro-batch)."""
    config = plan.config
    return pipeline_sim.simulate(str(config.schedule), [s.fwd_s for s in plan.stages], [s.bwd_s for s in plan.stages],
                                 config.num_microbatches, config.vpp, plan.estimate.pipeline_p2p_s or 0.0)


def transfers(plan: Plan, schedule: ScheduleResult) -> list[tuple[int, float, float]]:
    """(sending device, start_s, end_s) of each activation and gradient transfer between stages,
    each device's one after another, as the simulation sends them."""
    pp, hops_s = plan.config.pp, plan.estimate.pipeline_p2p_s
    if pp == 1 or not any(hops_s):
        return []
    last_stage = pp * plan.config.vpp - 1
    link_free_s: dict[int, float] = defaultdict(float)
    out = []
    for event in schedule.events:  # each device's events in the order it runs them
        stage = event.chunk * pp + event.device
        if event.kind == EventKind.FORWARD and stage < last_stage:
            hop_s = hops_s[event.device]
        elif event.kind == EventKind.BACKWARD and stage > 0:
            hop_s = hops_s[(event.device - 1) % pp]
        else:
            continue
        start_s = max(event.end_s, link_free_s[event.device])
        link_free_s[event.device] = start_s + hop_s
        out.append((event.device, start_s, start_s + hop_s))
    return out


def timeline_figure(plan: Plan) -> Figure:
    """The Gantt chart of one step of `plan` (see the module docstring).

    Each bar collection carries a gid "<kind>:<stage>" (kind: forward, backward, weight_grad,
    p2p, dp_comm, optimizer) so its bars can be read back.
    """
    schedule = simulate_plan(plan)
    config, breakdown = plan.config, plan.estimate.time_breakdown
    tail = [("dp_comm", "gradient sync (data-parallel, tied weights across stages) and FSDP2 copies (exposed)", breakdown.get("dp_comm_exposed_s", 0.0)),
            ("optimizer", "optimizer step", breakdown.get("optimizer_s", 0.0))]
    end_s = schedule.step_time_s + sum(seconds for _, _, seconds in tail)
    scale, unit = time_unit(end_s)
    figure = new_figure(FIGURE_WIDTH_IN, max(MIN_FIGURE_HEIGHT_IN, 1.9 + LANE_HEIGHT_IN * config.pp))
    axes = figure.add_subplot()

    bars: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for event in schedule.events:
        bars[EVENT_STYLE[event.kind][0], event.device].append((event.start_s * scale, (event.end_s - event.start_s) * scale))
        if (event.end_s - event.start_s) >= MIN_LABELLED_BAR_FRACTION * end_s:
            label = f"{event.microbatch}" + (f".{event.chunk}" if config.vpp > 1 else "")
            axes.text((event.start_s + event.end_s) / 2 * scale, event.device + COMPUTE_BAR[0] + COMPUTE_BAR[1] / 2,
                      label, ha="center", va="center", fontsize=7, color="white")
    for device, start_s, stop_s in transfers(plan, schedule):
        bars["p2p", device].append((start_s * scale, (stop_s - start_s) * scale))
    start_s = schedule.step_time_s
    for kind, _, seconds in tail:
        if seconds > 0:
            for device in range(config.pp):
                bars[kind, device].append((start_s * scale, seconds * scale))
            start_s += seconds

    for (kind, device), ranges in bars.items():
        offset, height = TRANSFER_BAR if kind == "p2p" else COMPUTE_BAR
        # Transfers are often far shorter than a pixel: their edge line keeps each one visible.
        collection = axes.broken_barh(ranges, (device + offset, height), facecolors=COLOURS[kind],
                                      edgecolor=COLOURS[kind] if kind == "p2p" else "white", linewidth=0.4)
        collection.set_gid(f"{kind}:{device}")

    present = {kind for kind, _ in bars}
    legend = [(style, text) for style, text in EVENT_STYLE.values() if style in present]
    legend += [("p2p", "point-to-point transfer")] if "p2p" in present else []
    legend += [(kind, text) for kind, text, _ in tail if kind in present]
    axes.legend(handles=[Patch(facecolor=COLOURS[kind], label=text) for kind, text in legend],
                loc="upper center", bbox_to_anchor=(0.5, -0.16 if config.pp > 2 else -0.3),
                ncols=min(len(legend), TIMELINE_LEGEND_COLUMNS), frameon=False)
    axes.set_yticks(range(config.pp), [_lane_label(plan, stage) for stage in range(config.pp)])
    axes.set_ylim(config.pp - 0.5, -0.5)
    axes.set_xlim(0, end_s * scale * 1.01)
    labelled = any(isinstance(child, Text) for child in axes.texts)
    axes.set_xlabel(f"time into the training step ({unit})"
                    + (f";  numbers in bars: micro-batch{'.chunk' if config.vpp > 1 else ''}" if labelled else ""))
    axes.set_ylabel("pipeline stage (devices)")
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    set_titles(figure, f"Pipeline timeline of one training step: {plan.model} on {plan.cluster}",
               f"{config.short()}  |  {config.num_microbatches} micro-batches, simulated {end_s * scale:.3g} {unit}"
               f" (estimate {plan.estimate.step_time_s * scale:.3g} {unit}), idle {schedule.bubble_fraction:.0%} of device "
               f"time (estimate's bubble {plan.estimate.bubble_fraction:.0%})", axes)
    return figure


def save_timeline(plan: Plan, path: str | Path) -> Path:
    """Write the timeline of `plan` to a .png or .svg file."""
    return save_figure(timeline_figure(plan), path, "--timeline")


def _lane_label(plan: Plan, stage: int) -> str:
    info = plan.stages[stage]
    return f"stage {stage}\n{info.device}, ranks {info.ranks[0]}-{info.ranks[1]}"
