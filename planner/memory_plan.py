"""The memory plan of a chosen configuration: which layers recompute, the ZeRO stage, headroom.

A uniform recompute policy is the search's unit; once a configuration wins, the stage-split ILP
re-decides the policy per layer together with the split (`stage_ilp.split_ilp` with one column per
policy), so only as many layers recompute as memory requires, e.g. full recompute on the first
pipeline stage (which holds the most micro-batches in flight) and none on the last.
"""
from __future__ import annotations

from planner.config import ParallelConfig, Schedule
from planner.errors import PlannerError
from planner.estimate import Evaluator
from planner.graph import LayerKind, Recompute
from planner.result import Estimate
from planner.space import ZERO_BUBBLE_RECOMPUTE
from planner.stage_ilp import split_ilp

# Wall-clock limit and relative gap of the per-layer recompute ILP.
MEMORY_ILP_TIME_LIMIT_S = 5.0
MEMORY_ILP_REL_GAP = 1e-3


def _uniform(evaluator: Evaluator, policy: Recompute) -> tuple[Recompute, ...]:
    return tuple(policy if layer.kind == LayerKind.BLOCK else Recompute.NONE for layer in evaluator.graph.layers)


def refine_recompute(evaluator: Evaluator, config: ParallelConfig, estimate: Estimate, global_batch: int,
                     headroom: float, fixed: bool = False) -> tuple[Estimate, dict]:
    """Per-layer recompute choices that beat the uniform policy of `config`, when any do and the
    policy was not `fixed` by the user."""
    if fixed:
        return estimate, {"method": "uniform", "status": "fixed by the constraints"}
    if config.recompute == Recompute.NONE:
        return estimate, {"method": "uniform", "status": "not needed"}
    order = evaluator.graph.recompute_policies
    if config.schedule == Schedule.ZERO_BUBBLE and config.pp > 1:
        order = tuple(p for p in order if p in ZERO_BUBBLE_RECOMPUTE)
    policy_sets = [_uniform(evaluator, p) for p in order]
    problem = evaluator.stage_problem(config, policy_sets, headroom)
    try:
        split = split_ilp(problem, time_limit_s=MEMORY_ILP_TIME_LIMIT_S, rel_gap=MEMORY_ILP_REL_GAP)
    except PlannerError:
        return estimate, {"method": "uniform", "status": "ilp infeasible"}
    chosen = tuple(order[c] if evaluator.graph.layers[i].kind == LayerKind.BLOCK else Recompute.NONE
                   for i, c in enumerate(split.choices))
    refined = evaluator.estimate(config, global_batch, recompute_per_layer=chosen, boundaries=split.boundaries, headroom=headroom)
    info = {"method": split.method, "status": str(split.status), "gap": split.gap, "solve_time_s": split.solve_time_s}
    if refined.fits and refined.step_time_s < estimate.step_time_s:
        return refined, {**info, "per_layer": [str(p) for p in chosen]}
    return estimate, info


def memory_plan(evaluator: Evaluator, config: ParallelConfig, estimate: Estimate, global_batch: int,
                headroom: float, recompute_fixed: bool = False) -> tuple[dict, Estimate]:
    """The memory plan (recompute per layer, ZeRO stage, offload, headroom per stage) and the
    refined estimate; a `recompute_fixed` policy stays uniform."""
    estimate, solver = refine_recompute(evaluator, config, estimate, global_batch, headroom, recompute_fixed)
    per_layer = solver.get("per_layer") or [str(p) for p in _uniform(evaluator, config.recompute)]
    recompute = {str(p): [evaluator.graph.layers[i].name for i, q in enumerate(per_layer) if q == str(p)] for p in Recompute}
    stages = [
        {"stage": row["stage"], "total_bytes": row["total_bytes"], "capacity_bytes": row["capacity_bytes"],
         "headroom_bytes": row["capacity_bytes"] - row["total_bytes"]}
        for row in estimate.memory
    ]
    return {
        "zero": config.zero,
        "zero_shard_ranks": config.shard_ranks if config.zero else 1,
        "recompute": {k: v for k, v in recompute.items() if v},
        "offload": "optimizer states in host memory (ZeRO-Offload)" if config.offload_optimizer else "none",
        "mem_headroom": headroom,
        "recompute_solver": solver,
        "stages": stages,
    }, estimate
