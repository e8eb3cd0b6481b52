"""The search's front: the candidates it kept, priced again, refined per layer and ranked.

`with_schedule_splits` prices the fitting candidates again at their splits refined by the schedule
(`planner.stage_polish`), `refine_front` runs the per-layer memory plan on the leader and on each
runner-up that could overtake it, within `RUNNER_UP_REFINE_BUDGET_S`, and `distinct_alternatives` turns the
ranking into the plan's distinct runners-up.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections import Counter

from planner.config import ParallelConfig
from planner.default_split import chunk_boundaries
from planner.estimate import Evaluator
from planner.graph import Recompute
from planner.memory_plan import MEMORY_ILP_TIME_LIMIT_S, memory_plan, uniform_recompute
from planner.result import Alternative
from planner.stage_polish import refines
from planner.stages import split_time_only

# Wall-clock seconds for refining runner-ups per layer once the leader is refined (`_refine_front`),
# and the per-layer ILP's limit from each of its two starts for one runner-up (the leader's is
# `memory_plan.MEMORY_ILP_TIME_LIMIT_S`). Measured (this machine): qwen3-235b-a22b on 1024 H100
# refined 36 runner-ups in 150 s at the leader's limit, most of them interleaved and stopped by it,
# for a plan its tenth (0.1 s to refine) found; the search speed benchmark's cases refine in seconds.
RUNNER_UP_REFINE_BUDGET_S = 20.0
RUNNER_UP_ILP_TIME_LIMIT_S = 1.0


def with_schedule_splits(evaluator: Evaluator, ranked: list, global_batch: int, headroom: float, kept: int) -> list:
    """The fitting candidates priced again at their splits refined by the schedule (`planner.stage_polish`),
    as `evaluate` prices them, in order. The first `kept` are; a later one only where its step
    without what a refined split can save beats the `kept`-th so priced: its pipeline bubble, and
    under an interleaved schedule whose devices differ by more than a layer's time, also the
    micro-batches' time on the busiest device over the mean (the refinement evens the devices' sums
    of chunks)."""
    priced: list[tuple[float, ParallelConfig, object]] = []
    times: list[float] = []  # of `priced`, ascending
    for step_s, config, estimate in ranked:
        threshold_s = times[kept - 1] if len(times) >= kept else math.inf
        saving_s = estimate.time_breakdown["pp_bubble_s"]
        busy_s = [stage.fwd_s + stage.bwd_s for stage in estimate.stages]
        if config.vpp > 1 and max(busy_s) - min(busy_s) > sum(busy_s) / len(evaluator.graph.layers):
            saving_s += config.num_microbatches * (max(busy_s) - sum(busy_s) / len(busy_s))
        if refines(config.pp * config.vpp, config.pp) and step_s - saving_s < threshold_s:
            estimate = evaluator.estimate(config, global_batch, headroom=headroom)
        priced.append((estimate.step_time_s, config, estimate))
        bisect.insort(times, estimate.step_time_s)
    return sorted(priced, key=lambda entry: (entry[0], entry[2].peak_memory_bytes))


def refine_front(evaluator: Evaluator, ranked: list, global_batch: int, headroom: float,
                  fixed: bool) -> tuple[list, dict, int]:
    """The ranked candidates after the per-layer memory plan (`memory_plan`), each as (step time,
    config, estimate, recompute per layer), the leader's plan, and how many runner-ups that could
    have overtaken it were left unrefined.

    The leader is refined; so is each runner-up that could then overtake it: one whose step time
    with no recompute at all, which no per-layer choice beats (`_could_overtake`), is below the best
    refined so far, in rank order until `RUNNER_UP_REFINE_BUDGET_S` is spent (the rest keep their
    uniform policy).
    """
    memories = {}
    refined = [(step_s, config, estimate, tuple(map(str, uniform_recompute(evaluator, config.recompute))))
               for step_s, config, estimate in ranked]
    best_s, unrefined, deadline_s = math.inf, 0, math.inf
    for index, (step_s, config, estimate) in enumerate(ranked):
        if index and (fixed or config.recompute == Recompute.NONE
                      or not _could_overtake(evaluator, config, global_batch, headroom, best_s)):
            continue
        if time.perf_counter() > deadline_s:
            unrefined += 1
            continue
        memories[index], estimate = memory_plan(evaluator, config, estimate, global_batch, headroom, recompute_fixed=fixed,
                                                time_limit_s=RUNNER_UP_ILP_TIME_LIMIT_S if index else MEMORY_ILP_TIME_LIMIT_S)
        policy_of = {name: policy for policy, names in memories[index]["recompute"].items() for name in names}
        refined[index] = (estimate.step_time_s, config, estimate, tuple(policy_of[layer.name] for layer in evaluator.graph.layers))
        best_s = min(best_s, estimate.step_time_s)
        if not index:
            deadline_s = time.perf_counter() + RUNNER_UP_REFINE_BUDGET_S
    # ties: a refined one leads, then the one needing less memory
    order = sorted(range(len(refined)), key=lambda index: (refined[index][0], index not in memories, refined[index][2].peak_memory_bytes))
    return [refined[index] for index in order], memories[order[0]], unrefined


def _could_overtake(evaluator: Evaluator, config: ParallelConfig, global_batch: int, headroom: float, best_s: float) -> bool:
    """Whether `config` with no layer recomputed is faster than `best_s` at its default split or,
    pipelined, at the split that only balances time: the memory-aware split that no recompute forces
    can be slower than the one a per-layer memory plan then finds (as where a last stage keeps its
    logits)."""
    none = (Recompute.NONE,) * len(evaluator.graph.layers)
    if evaluator.estimate(config, global_batch, recompute_per_layer=none, headroom=headroom).step_time_s < best_s:
        return True
    if config.pp * config.vpp == 1:
        return False
    balanced = split_time_only(evaluator.stage_problem(config, [none], headroom)).boundaries
    return evaluator.estimate(config, global_batch, recompute_per_layer=none, boundaries=balanced,
                              headroom=headroom).step_time_s < best_s


def distinct_alternatives(evaluator: Evaluator, ranked: list, top: int) -> tuple[Alternative, ...]:
    """Up to `top` runners-up of `refine_front`'s ranking, each plan once. Candidates that differ
    only in the uniform recompute policy the memory plan started from, and were refined to the same
    per-layer recompute and stage split as one ranked before them, are the same plan. A runner-up
    whose recompute differs from its config's policy carries it per layer with its stage split, and
    its note counts it."""
    def key(config: ParallelConfig, estimate, per_layer: tuple[str, ...]) -> tuple:
        return dataclasses.replace(config, recompute=Recompute.NONE), per_layer, tuple(chunk_boundaries(estimate))

    best_s = ranked[0][0]
    seen = {key(*ranked[0][1:])}
    alternatives = []
    for step_s, config, estimate, per_layer in ranked[1:]:
        if len(alternatives) == top or key(config, estimate, per_layer) in seen:
            continue
        seen.add(key(config, estimate, per_layer))
        note, boundaries = f"{step_s / best_s - 1:+.1%} step time", ()
        if per_layer == tuple(map(str, uniform_recompute(evaluator, config.recompute))):
            per_layer = ()
        else:
            note += "; recompute per layer: " + ", ".join(f"{n} {policy}" for policy, n in Counter(per_layer).most_common())
            boundaries = tuple(int(b) for b in chunk_boundaries(estimate))
        alternatives.append(Alternative(config, step_s, estimate.tokens_per_s, estimate.peak_memory_bytes, note, per_layer,
                                        boundaries))
    return tuple(alternatives)
