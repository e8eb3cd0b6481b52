"""The search: enumerate configurations, bound, price, solve the split and layout, keep the best.

Candidates are priced in order of a lower bound on their step time (every device busy with its
share of the layer work plus the pipeline fill its schedule cannot avoid, no exposed reduction;
`pipeline_bound_s`); once the bound of the next candidate is no better than the best plan found,
no later one can win, so the search stops there. The
result is the same optimum as pricing every configuration (tests check this against exhaustive
enumeration), found after pricing a small fraction of them.
"""
from __future__ import annotations

import time
from collections import Counter

from costmodel.hardware import Cluster
from planner.config import ParallelConfig, Schedule
from planner.errors import PlannerError, PlannerErrorKind, invalid
from planner.estimate import Evaluator
from planner.graph import ModelGraph
from planner.memory_plan import memory_plan
from planner.result import Alternative, Plan
from planner.space import Rejection, configs_for, enumerate_degrees

# Constraint keys `plan` accepts besides the fixed choices; anything else is a typo.
BOUND_KEYS = {f"{bound}_{axis}" for bound in ("min", "max") for axis in ("tp", "pp", "dp", "cp", "ep")}
FIXED_KEYS = {"tp", "pp", "dp", "cp", "ep", "vpp", "micro_batch", "zero", "recompute", "schedule"}
OTHER_KEYS = {"schedules", "allow_tp_across_nodes", "mem_headroom", "top", "exhaustive"}

# Examples of each rejection reason kept for `--explain`.
EXPLAIN_EXAMPLES_PER_REASON = 3


def _check_constraints(constraints: dict) -> None:
    import difflib

    for key in constraints:
        if key not in BOUND_KEYS | FIXED_KEYS | OTHER_KEYS:
            near = difflib.get_close_matches(key, sorted(BOUND_KEYS | FIXED_KEYS | OTHER_KEYS), n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise invalid(f"constraint {key!r}: unknown{hint}")
    headroom = constraints.get("mem_headroom", 0.0)
    if not 0.0 <= headroom < 0.9:
        raise invalid(f"mem_headroom={headroom}: must be in [0, 0.9)")


def pipeline_bound_s(evaluator: Evaluator, config: ParallelConfig) -> float:
    """A step time `config` cannot beat: `Evaluator.lower_bound_s` plus the pipeline fill of its schedule.

    With W the work of one micro-batch through all layers on the fastest device (the work bound is
    m W / pp) and T_d the work per micro-batch of device d:

    - 1F1B and interleaved: device d starts once the first forward has crossed the devices before
      it and its last backward must cross them back, so step >= m T_d + sum_{d' < d} T_d' / vpp for
      every d (the "device work" paths `costmodel.pipeline.step_time_s` takes the longest of). Over
      every split of W the least max_d is where all terms are equal, T_{d+1} = T_d (1 - 1/(m vpp)):
      W / (vpp (1 - (1 - 1/(m vpp))^pp)), at least m W / pp.
    - GPipe: every forward runs before any backward, step >= W + (m - 1) max_d T_d >= W (m + pp - 1) / pp.
    - Zero bubble fills the fill with weight gradients; it keeps the work bound.
    """
    work_s = evaluator.lower_bound_s(config)
    m, pp, vpp = config.num_microbatches, config.pp, config.vpp
    if pp == 1 or config.schedule == Schedule.ZERO_BUBBLE:
        return work_s
    per_microbatch_s = work_s * pp / m
    if config.schedule == Schedule.GPIPE:
        return per_microbatch_s * (m + pp - 1) / pp
    return per_microbatch_s / (vpp * (1 - (1 - 1 / (m * vpp)) ** pp))


def _reason_key(reason: str) -> str:
    return reason.split(":")[0]


def search(graph: ModelGraph, cluster: Cluster, *, global_batch: int, dtype: str = "bf16", attention: str = "flash",
           cluster_name: str = "", **constraints) -> Plan:
    """Best plan for `graph` on `cluster` (see the module docstring for how candidates are pruned).

    Raises:
        PlannerError: INVALID_INPUT for impossible constraints; INSUFFICIENT_MEMORY when no
            configuration fits, with what would.
    """
    started = time.perf_counter()
    constraints = {k: v for k, v in constraints.items() if v is not None}
    _check_constraints(constraints)
    headroom = constraints.get("mem_headroom", 0.0)
    top = constraints.get("top", 5)
    exhaustive = constraints.get("exhaustive", False)
    if global_batch < 1:
        raise invalid(f"global_batch={global_batch}: must be a positive integer")
    evaluator = Evaluator(graph, cluster, dtype, attention=attention)
    space = enumerate_degrees(graph, cluster, constraints)
    rejected: list[Rejection] = list(space.rejected)
    candidates: list[tuple[float, ParallelConfig]] = []
    for degrees in space.degrees:
        if global_batch % degrees[0]:
            rejected.append(Rejection(f"dp={degrees[0]}", f"global_batch={global_batch} is not a multiple of dp"))
            continue
        for config in configs_for(degrees, graph, global_batch, constraints):
            try:
                evaluator.check(config, global_batch)
            except PlannerError as error:
                rejected.append(Rejection(config.short(), error.message))
                continue
            candidates.append((pipeline_bound_s(evaluator, config), config))
    candidates.sort(key=lambda item: item[0])

    ranked: list[tuple[float, ParallelConfig, object]] = []
    reasons: Counter = Counter()
    examples: dict[str, list[dict]] = {}
    evaluated = 0
    closest_miss = None
    for index, (bound_s, config) in enumerate(candidates):
        if not exhaustive and len(ranked) >= top and bound_s >= ranked[top - 1][0]:
            pruned = len(candidates) - index
            reasons["bound"] += pruned
            examples.setdefault("bound", []).append({"what": f"{pruned} configurations", "reason": f"lower bound >= {ranked[top - 1][0]:.3f} s of the plans kept"})
            break
        evaluated += 1
        estimate = evaluator.estimate(config, global_batch, headroom=headroom)
        if not estimate.fits:
            need = estimate.peak_memory_bytes
            if closest_miss is None or need < closest_miss[0]:
                closest_miss = (need, config)
            reason = f"out of memory: needs {need / 2**30:.1f} GiB per device"
            reasons["memory"] += 1
            if len(examples.setdefault("memory", [])) < EXPLAIN_EXAMPLES_PER_REASON:
                examples["memory"].append({"what": config.short(), "reason": reason})
            continue
        ranked.append((estimate.step_time_s, config, estimate))
        ranked.sort(key=lambda item: item[0])

    if not ranked:
        raise _nothing_fits(graph, cluster, global_batch, closest_miss, evaluated)

    best_s, best_config, best_estimate = ranked[0]
    plan_memory, best_estimate = memory_plan(evaluator, best_config, best_estimate, global_batch, headroom)
    for r in rejected:
        key = _reason_key(r.reason)
        reasons[key] += 1
        if len(examples.setdefault(key, [])) < EXPLAIN_EXAMPLES_PER_REASON:
            examples[key].append(r.to_dict())
    from planner.tp_plan import layouts_for

    return Plan(
        model=graph.name,
        cluster=cluster_name or cluster.name,
        global_batch=global_batch,
        seq_len=graph.seq_len,
        dtype=dtype,
        config=best_config,
        estimate=best_estimate,
        layouts=layouts_for(evaluator, best_config),
        memory_plan=plan_memory,
        search={
            "time_s": time.perf_counter() - started,
            "candidates_total": len(candidates),
            "candidates_evaluated": evaluated,
            "pruned_by_bound": reasons.get("bound", 0),
            "status": "optimal",
            "rejected_counts": dict(reasons),
        },
        alternatives=tuple(
            Alternative(config, step_s, estimate.tokens_per_s, estimate.peak_memory_bytes,
                        note=f"{step_s / best_s - 1:+.1%} step time")
            for step_s, config, estimate in ranked[1:top + 1]
        ),
        rejected=tuple(example for group in examples.values() for example in group),
        layer_names=tuple(layer.name for layer in graph.layers),
    )


def _nothing_fits(graph: ModelGraph, cluster: Cluster, global_batch: int, closest_miss, evaluated: int) -> PlannerError:
    """INSUFFICIENT_MEMORY with what would fit: more devices, smaller micro-batch, or ZeRO-3 + full recompute."""
    capacity = min(g.node.device.mem_bytes for g in cluster.groups)
    if closest_miss is None:
        return invalid(f"no configuration of {graph.name} on {cluster.num_devices} devices is valid with these constraints; relax them")
    need, config = closest_miss
    devices_needed = cluster.num_devices * need / capacity
    return PlannerError(
        PlannerErrorKind.INSUFFICIENT_MEMORY,
        f"no plan fits: the closest ({config.short()}) needs {need / 2**30:.1f} GiB per device of {capacity / 2**30:.1f} GiB "
        f"after {evaluated} candidates; try about {devices_needed:.0f}+ devices, a smaller micro-batch or global batch, "
        f"or allow zero=3 with recompute=full",
    )
