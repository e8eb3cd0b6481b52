"""Rendering of an Estimate: the time and memory breakdown tables `paraplan evaluate` prints."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table

from planner.result import Estimate
from planner.report.units import GIB, bar, fmt_bytes, fmt_seconds

def estimate_json(estimate: Estimate) -> dict:
    """The `evaluate --json` object (DESIGN.md contract)."""
    return estimate.to_dict()


def summary_table(estimate: Estimate, title: str) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    if estimate.config is not None:
        table.add_row("config", estimate.config.short())
    table.add_row("step time", fmt_seconds(estimate.step_time_s))
    table.add_row("throughput", f"{estimate.tokens_per_s:,.0f} tokens/s")
    table.add_row("model TFLOP/s per device", f"{estimate.tflops_per_gpu:.1f}")
    table.add_row("MFU", f"{estimate.mfu:.1%}")
    capacity = max(row["capacity_bytes"] for row in estimate.memory)
    table.add_row("peak memory", f"{fmt_bytes(estimate.peak_memory_bytes)} of {fmt_bytes(capacity)}  {bar(estimate.peak_memory_bytes / capacity)}")
    table.add_row("fits", "[green]yes[/green]" if estimate.fits else "[red]no[/red]")
    return table


def time_table(estimate: Estimate) -> Table:
    table = Table(title="Step time breakdown (critical stage)", title_justify="left")
    table.add_column("part")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    for key, value in estimate.time_breakdown.items():
        if value <= 0:
            continue
        table.add_row(key.removesuffix("_s").replace("_", " "), fmt_seconds(value), f"{value / estimate.step_time_s:.1%}")
    return table


def memory_table(estimate: Estimate) -> Table:
    table = Table(title="Memory per device by pipeline stage (GiB)", title_justify="left")
    for name in ("stage", "weights", "grads", "optim", "activ", "other", "total"):
        table.add_column(name, justify="right")
    table.add_column("of capacity")
    for row in estimate.memory:
        other = sum(row.get(part, 0.0) for part in ("comm_buffers_bytes", "temp_bytes", "overhead_bytes"))
        values = (row["weights_bytes"], row["grads_bytes"], row["optimizer_bytes"], row["activations_bytes"], other, row["total_bytes"])
        table.add_row(str(row["stage"]), *(f"{v / GIB:.1f}" for v in values), bar(row["total_bytes"] / row["capacity_bytes"], 10))
    priced = ", ".join(dict.fromkeys(f"{row['dtype']} on {row['device']}" for row in estimate.memory if "dtype" in row))
    table.caption = ("other = communication buffers + temporaries + CUDA context and allocator fragmentation"
                     + (f"; priced in {priced}" if priced else ""))
    return table


def render_estimate(estimate: Estimate, title: str = "Estimate") -> Group:
    return Group(summary_table(estimate, title), time_table(estimate), memory_table(estimate))
