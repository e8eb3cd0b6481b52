"""Rendering of a Plan: summary, mesh, stages, layout, memory plan, alternatives, rejections."""
from __future__ import annotations

from collections import Counter

from rich.console import Group
from rich.table import Table

from planner.config import ParallelConfig
from planner.result import PUBLISHED_MAPE, Plan
from planner.report.estimate import memory_table, summary_table, throughput_unit, time_table, trace_notes
from planner.report.units import bar, fmt_bytes, fmt_seconds


def mesh_table(plan: Plan) -> Table:
    config = plan.config
    table = Table(title="Device mesh (outermost first; tp innermost, inside a node)", title_justify="left")
    for axis in ("pp", "dp", "cp", "tp"):
        table.add_column(axis, justify="right")
    table.add_column("ep (inside dp x cp)", justify="right")
    table.add_column("micro-batch x count", justify="right")
    table.add_column("schedule")
    table.add_column("ZeRO", justify="right")
    zero = str(config.zero)
    if config.dp_replicate > 1:
        zero += f" hybrid {config.dp_replicate}x{config.shard_ranks}"
    table.add_row(str(config.pp), str(config.dp), str(config.cp), str(config.tp), str(config.ep),
                  f"{config.micro_batch} x {config.num_microbatches}",
                  f"{config.schedule}" + (f" (vpp {config.vpp})" if config.vpp > 1 else ""), zero)
    return table


def _layer_span(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def _stage_layers(stage) -> str:
    """The stage's layers, one span per chunk (an interleaved stage holds vpp apart)."""
    if len(stage.chunks) < 2:
        return _layer_span(stage.layer_names)
    spans, start = [], 0
    for first, last in stage.chunks:
        spans.append(_layer_span(stage.layer_names[start:start + last - first + 1]))
        start += last - first + 1
    return " + ".join(spans)


def stage_table(plan: Plan) -> Table:
    table = Table(title="Pipeline stages", title_justify="left")
    table.add_column("stage", justify="right")
    table.add_column("layers")
    table.add_column("ranks")
    table.add_column("device")
    table.add_column("fwd+bwd / micro-batch", justify="right")
    table.add_column("memory")
    for stage in plan.stages:
        memory = stage.memory
        table.add_row(str(stage.index), _stage_layers(stage), f"{stage.ranks[0]}-{stage.ranks[1]}", stage.device,
                      fmt_seconds(stage.fwd_s + stage.bwd_s),
                      f"{fmt_bytes(memory['total_bytes'])} {bar(memory['total_bytes'] / memory['capacity_bytes'], 12)}")
    return table


def layout_table(plan: Plan) -> Table:
    table = Table(title=f"Tensor-parallel layout (tp={plan.config.tp}, found by the sharding ILP; one block shown per signature)", title_justify="left")
    table.add_column("module")
    table.add_column("placement")
    for fqn, placement in plan.layouts.items():
        table.add_row(fqn, str(placement))
    return table


def memory_plan_table(plan: Plan) -> Table:
    table = Table(title="Memory plan", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    memory = plan.memory_plan
    zero, ranks = memory.get("zero"), memory.get("zero_shard_ranks", 1)
    table.add_row("ZeRO stage", f"{zero}, states sharded over {ranks} ranks" if zero and ranks > 1 else str(zero))
    for policy, layers in memory.get("recompute", {}).items():
        table.add_row(f"recompute {policy}", f"{len(layers)} layers" + (f": {_layer_span(tuple(layers))}" if layers else ""))
    table.add_row("offload", str(memory.get("offload")))
    return table


def parallel_axes(config: ParallelConfig) -> int:
    """How many ways beyond data parallelism a configuration splits the model (tp, pp, cp, ep,
    interleaved stages): the fewer, the simpler to run and to debug."""
    return sum(degree > 1 for degree in (config.tp, config.pp, config.cp, config.ep, config.vpp))


def _splits(config: ParallelConfig) -> str:
    axes = parallel_axes(config)
    return "data parallel only" if axes == 0 else f"{axes} split{'s' * (axes > 1)} beyond data parallelism"


def alternatives_table(plan: Plan) -> Table:
    """The runners-up; a caption names the simplest of those within the cost model's error of the plan."""
    table = Table(title="Top alternatives", title_justify="left")
    table.add_column("config")
    table.add_column("step time", justify="right")
    table.add_column("vs best", justify="right")
    table.add_column("recompute per layer")
    table.add_column("peak memory", justify="right")
    for alt in plan.alternatives:
        per_layer = ", ".join(f"{n} {policy}" for policy, n in Counter(alt.recompute_per_layer).most_common())
        table.add_row(alt.config.short(), fmt_seconds(alt.step_time_s), f"{alt.step_time_s / plan.estimate.step_time_s - 1:+.1%}",
                      per_layer or f"{alt.config.recompute} (every block)", fmt_bytes(alt.peak_memory_bytes))
    close = [alt for alt in plan.alternatives if alt.step_time_s <= plan.estimate.step_time_s * (1 + PUBLISHED_MAPE)]
    simpler = [alt for alt in close if parallel_axes(alt.config) < parallel_axes(plan.config)]
    if simpler:
        simplest = min(simpler, key=lambda alt: (parallel_axes(alt.config), alt.step_time_s))
        table.caption = (f"{len(close)} of these are within {PUBLISHED_MAPE:.1%} of the plan (the cost model's mean error on "
                         f"published runs), closer than the model can rank; the simplest is {simplest.config.short()} "
                         f"({_splits(simplest.config)}, against the plan's {parallel_axes(plan.config)}), "
                         f"{simplest.step_time_s / plan.estimate.step_time_s - 1:+.1%} step time")
    return table


def rejected_table(plan: Plan) -> Table:
    counts = Counter(plan.search.get("rejected_counts", {}))
    table = Table(title="Rejected options (examples per reason)", title_justify="left")
    table.add_column("option")
    table.add_column("why")
    for row in plan.rejected:
        table.add_row(row["what"], row["reason"])
    table.caption = ", ".join(f"{key}: {count}" for key, count in counts.most_common())
    return table


def render_plan(plan: Plan, explain: bool = False) -> Group:
    search = plan.search
    batch = f"{plan.global_batch} samples" if throughput_unit(plan.estimate) == "samples" else f"{plan.global_batch} x {plan.seq_len} tokens"
    title = (f"Plan for {plan.model} on {plan.cluster}: global batch {batch} "
             f"({search.get('candidates_evaluated', 0)} of {search.get('candidates_total', 0)} candidates priced in {search.get('time_s', 0):.2f} s"
             + (f"; {search['runner_ups_unrefined']} runner-ups that might beat it were not refined per layer within the "
                f"time budget" if search.get("runner_ups_unrefined") else "")
             + "".join(f"; not searched: {what}" for what in search.get("not_searched", ())) + ")")
    parts = [summary_table(plan.estimate, title), mesh_table(plan), stage_table(plan), time_table(plan.estimate),
             memory_table(plan.estimate), memory_plan_table(plan)]
    if plan.layouts:
        parts.append(layout_table(plan))
    if plan.alternatives:
        parts.append(alternatives_table(plan))
    if explain:
        parts.append(rejected_table(plan))
    return Group(*parts, *trace_notes(plan.estimate))
