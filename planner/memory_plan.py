"""The memory plan of a chosen configuration: which layers recompute, the ZeRO stage, headroom.

A uniform recompute policy is the search's unit; once a configuration wins, the stage-split ILP
re-decides the policy per layer together with the split (`stage_ilp.split_ilp` with one column per
policy), so only as many layers recompute as memory requires, e.g. full recompute on the first
pipeline stage (which holds the most micro-batches in flight) and none on the last.

The ILP's stage memory is one moment's: the states, the activations in flight and the larger of the
transients and the largest recompute working set; the estimate's peak is not always that moment
(with one micro-batch the gradients and the activations peak at different moments, a pipelined
ZeRO-3 stage peaks at one of two moments). So each answer is priced by the estimate, and the ILP is solved again
with capacities that give it the room the estimate found, for a few rounds, starting once from the
ILP's own capacities and once from capacities calibrated on the uniform policy: the best answer
that the estimate says fits is kept.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from costmodel.memory import ALLOCATOR_FRAGMENTATION_FRACTION
from planner.config import ParallelConfig
from planner.default_split import chunk_boundaries, refined_split
from planner.errors import PlannerError
from planner.estimate import Evaluator
from planner.graph import LayerKind, Recompute
from planner.milp import SolveStatus
from planner.result import Estimate
from planner.space import per_layer_recompute
from planner.stage_ilp import split_ilp
from planner.stage_problem import make_split

# Wall-clock limit of the per-layer recompute ILP's solves from each start, its relative gap, and
# how many times it is solved from each start (the module docstring).
MEMORY_ILP_TIME_LIMIT_S = 5.0
MEMORY_ILP_REL_GAP = 1e-3
MEMORY_ILP_ROUNDS = 4


def uniform_recompute(evaluator: Evaluator, policy: Recompute) -> tuple[Recompute, ...]:
    return tuple(policy if layer.kind == LayerKind.BLOCK else Recompute.NONE for layer in evaluator.graph.layers)


def refine_recompute(evaluator: Evaluator, config: ParallelConfig, estimate: Estimate, global_batch: int,
                     headroom: float, fixed: bool = False,
                     time_limit_s: float = MEMORY_ILP_TIME_LIMIT_S) -> tuple[Estimate, dict]:
    """Per-layer recompute choices that beat the uniform policy of `config`, when any do and the
    policy was not `fixed` by the user; the ILP's rounds from each start get `time_limit_s`."""
    if fixed:
        return estimate, {"method": "uniform", "status": "fixed by the constraints"}
    if config.recompute == Recompute.NONE:
        return estimate, {"method": "uniform", "status": "not needed"}
    order = per_layer_recompute(evaluator.graph, config)
    policy_sets = [uniform_recompute(evaluator, p) for p in order]
    problem = evaluator.stage_problem(config, policy_sets, headroom)
    # From the ILP's own capacities, then from capacities calibrated on the uniform policy, which the
    # estimate has priced already.
    uniform = make_split(problem, chunk_boundaries(estimate), np.full(problem.num_layers, order.index(config.recompute)),
                         "uniform", SolveStatus.FEASIBLE, float("nan"), 0.0)
    starts = (problem.mem_cap_bytes, _corrected_caps(problem.mem_cap_bytes, uniform.stage_mem_bytes, estimate, headroom, config))
    best, best_info, info = estimate, None, {"method": "uniform", "status": "ilp infeasible"}
    for caps in starts:
        start_deadline_s = time.perf_counter() + time_limit_s
        for _ in range(MEMORY_ILP_ROUNDS):
            left_s = start_deadline_s - time.perf_counter()
            if left_s <= 0:
                break
            try:
                split = split_ilp(dataclasses.replace(problem, mem_cap_bytes=caps), time_limit_s=left_s,
                                  rel_gap=MEMORY_ILP_REL_GAP)
            except PlannerError:
                break
            chosen = tuple(order[c] if evaluator.graph.layers[i].kind == LayerKind.BLOCK else Recompute.NONE
                           for i, c in enumerate(split.choices))
            at_split = refined = evaluator.estimate(config, global_batch, recompute_per_layer=chosen, boundaries=split.boundaries,
                                                    headroom=headroom)
            # the split refined by where the schedule puts the heavy stages (`planner.stage_polish`), where faster
            moved = refined_split(evaluator, config, policy_sets, split.boundaries, headroom, split.choices)
            if moved != split.boundaries:
                other = evaluator.estimate(config, global_batch, recompute_per_layer=chosen, boundaries=moved, headroom=headroom)
                if (not other.fits, other.step_time_s) < (not at_split.fits, at_split.step_time_s):
                    refined = other
            info = {"method": split.method, "status": str(split.status), "gap": split.gap, "solve_time_s": split.solve_time_s}
            if refined.fits and refined.step_time_s < best.step_time_s:
                best, best_info = refined, {**info, "per_layer": [str(p) for p in chosen]}
            corrected = _corrected_caps(caps, split.stage_mem_bytes, at_split, headroom, config)
            if np.allclose(corrected, caps, rtol=0.0, atol=1.0):
                break
            caps = corrected
    return best, best_info or info


def _corrected_caps(caps: np.ndarray, ilp_bytes, estimate: Estimate, headroom: float, config: ParallelConfig) -> np.ndarray:
    """Per pipeline chunk, the ILP's memory for its answer (`ilp_bytes`) plus the estimate's room on
    the chunk's stage (before fragmentation, shared by its vpp chunks): capacities under which the
    ILP sees the room the estimate sees. They may pass the device's capacity where the ILP counts
    more than the estimate does. A stage whose peak holds no activations (the optimizer step, or a
    pipelined ZeRO-3 backward's end) bounds them only from below: its capacities `caps` may grow."""
    room = np.array([(row["capacity_bytes"] * (1 - headroom) - row["total_bytes"]) / (1 + ALLOCATOR_FRAGMENTATION_FRACTION)
                     for row in estimate.memory])
    stage_of_chunk = np.arange(len(caps)) % config.pp
    alive = np.array([row["activations_bytes"] > 0 for row in estimate.memory])[stage_of_chunk]
    moved = np.asarray(ilp_bytes) + (room / config.vpp)[stage_of_chunk]
    return np.maximum(0.0, np.where(alive, moved, np.maximum(moved, caps)))


def memory_plan(evaluator: Evaluator, config: ParallelConfig, estimate: Estimate, global_batch: int,
                headroom: float, recompute_fixed: bool = False,
                time_limit_s: float = MEMORY_ILP_TIME_LIMIT_S) -> tuple[dict, Estimate]:
    """The memory plan (recompute per layer, ZeRO stage, offload, headroom per stage) and the
    refined estimate; a `recompute_fixed` policy stays uniform."""
    estimate, solver = refine_recompute(evaluator, config, estimate, global_batch, headroom, recompute_fixed, time_limit_s)
    uniform = [str(p) for p in uniform_recompute(evaluator, config.recompute)]
    per_layer = solver.get("per_layer") or uniform
    recompute = {str(p): [evaluator.graph.layers[i].name for i, q in enumerate(per_layer) if q == str(p)] for p in Recompute}
    if list(per_layer) != uniform:
        counts = ", ".join(f"{policy} on {len(names)}" for policy, names in recompute.items() if names)
        estimate = dataclasses.replace(estimate, notes=estimate.notes + (
            f"recompute is chosen per layer ({counts} layers): the config's recompute={config.recompute} is the uniform "
            f"policy it was refined from, so evaluate with the config's flags prices another plan; "
            f"`paraplan evaluate --plan FILE` prices this one",))
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
