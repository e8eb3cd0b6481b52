"""The search: enumerate configurations, bound, price, solve the split and layout, keep the best.

Candidates are priced in order of a lower bound on their step time: every device busy with its
share of the layer work, the pipeline fill and transfers its schedule cannot avoid
(`pipeline_bound_s`), and what the average stage's gradient reduction and optimizer step add after
the pipeline (`tail_bound_s`). A cheap form of the bound orders the heap; a candidate that reaches
the front gets the tight one (a search over stage splits) before it is priced. Once the bound of
the next candidate is no better than the best plans found, no later one can win, so the search
stops there. A candidate whose devices cannot even hold their share of the model states and
activations (`memory_floor_bytes`) is rejected without pricing (the bounds live in `planner.bounds`).
The result is the same optimum as
pricing every configuration (tests check this against exhaustive enumeration), found after pricing
a small fraction of them; the per-layer recompute refinement of the front that follows is exact
within `RUNNER_UP_REFINE_BUDGET_S` (`planner.search_front`).
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import time
from collections import Counter

from costmodel.hardware import Cluster
from planner.bounds import (WorkBound, mean_capacity_bytes, memory_floor_bytes, pipeline_bound_s, tail_bound_s, work_bound,
                            work_bound_key)
from planner.config import ParallelConfig, Schedule
from planner.constraints import check_constraints
from planner.errors import PlannerError, check_positive_int
from planner.estimate import Evaluator
from planner.graph import ModelGraph, Recompute
from planner.no_fit import batch_reason, closest_miss, nothing_fits
from planner.result import Plan
from planner.search_front import distinct_alternatives, refine_front, with_schedule_splits
from planner.config_check import check_config
from planner.space import Rejection, configs_for, divisors, enumerate_degrees, max_micro_batch, why_no_configs
from planner.training_code import TrainingCode

# Examples of each rejection reason kept for `--explain`.
EXPLAIN_EXAMPLES_PER_REASON = 3

# How far over memory (a fraction of capacity) a pipelined candidate without recompute may be for its
# recompute twin to be refined per layer at the candidate's bound (`Search.run`). A search-speed
# choice, measured (this machine, `python benchmarks/search_speed.py`): with no limit the four cases
# took 6.5-23 s instead of 2.9-7.5 s for the same plans; mixtral-8x7b on 2 x 8 H100 at 4K tokens, 16
# sequences at tp 2, missed by 1.0% a plan (one layer recomputed) whose candidate was 0.1% over (since
# its MoE tokens move by gathers that candidate fits; `tests/test_search.py` takes 4608 tokens, 2.5% over).
PIPELINED_TWIN_OVERSHOOT = 0.05


def _reason_key(reason: str) -> str:
    return reason.split(":")[0]


class _Pass:
    """Candidates of one pass over the space, priced in bound order; tallies what was rejected and why."""

    def __init__(self, reasons: Counter, examples: dict, rejected: list):
        self.reasons, self.examples, self.rejected = reasons, examples, rejected
        self.total = self.evaluated = self.screened = 0
        self.closest_miss = None  # (peak bytes, config): the priced configuration closest to fitting
        self.screened_misses: list[tuple[float, ParallelConfig]] = []  # (memory floor, config)
        self.host_miss = None  # (host bytes, host share, config): the offload plan closest to its host memory
        self.work_bounds: dict[tuple, WorkBound] = {}
        self.tail_bounds: dict[tuple, float] = {}
        self.twins: dict[tuple, tuple[tuple, ParallelConfig]] = {}

    def candidates(self, evaluator: Evaluator, space, graph: ModelGraph, global_batch: int, constraints: dict) -> list:
        """A heap of (bound, order, config) over every valid configuration, with floor work bounds."""
        heap: list[tuple[float, int, ParallelConfig]] = []
        per_node = min(group.node.devices_per_node for group in evaluator.cluster.groups)
        for degrees in space.degrees:
            if global_batch % degrees[0]:
                self.rejected.append(Rejection(f"dp={degrees[0]}", batch_reason(global_batch)))
                continue
            produced = 0
            for config in configs_for(degrees, graph, global_batch, constraints, per_node):
                produced += 1
                try:
                    check_config(graph, evaluator.cluster, config, global_batch, evaluator.code.cp_comm)
                except PlannerError as error:
                    self.rejected.append(Rejection(config.short(), error.message))
                    continue
                heap.append((self._bound_s(evaluator, config, refine=False), len(heap), config))
            if not produced:
                dp, tp, pp, cp, ep = degrees
                self.rejected.append(Rejection(f"dp={dp} tp={tp} pp={pp} cp={cp} ep={ep}",
                                               why_no_configs(degrees, graph, global_batch, constraints)))
        cap = max_micro_batch(graph.stream_tokens)
        above = sorted({b for dp in {degrees[0] for degrees in space.degrees} if global_batch % dp == 0
                        for b in divisors(global_batch // dp) if b > cap})
        if above and "micro_batch" not in constraints:
            self.rejected.append(Rejection(f"micro_batch={','.join(map(str, above[:4]))}{',...' if len(above) > 4 else ''}",
                                           f"above {cap} sequences of {graph.stream_tokens} tokens: GEMMs are saturated by "
                                           f"then and activation memory only grows (fix --micro-batch to price one)"))
        heapq.heapify(heap)
        self.total += len(heap)
        return heap

    def _bound_s(self, evaluator: Evaluator, config: ParallelConfig, refine: bool) -> float:
        """`pipeline_bound_s` + `tail_bound_s` of `config`, from bounds cached per key.

        The floor of a ZeRO-3 candidate is priced on its twin without ZeRO-3: the parameter gathers
        only add time and ZeRO-3 leaves no data-parallel traffic after the backward, so the twin's
        work bound is a floor too, and the floors need no table per data-parallel degree.
        """
        key = work_bound_key(config)
        priced = config
        if not refine and config.zero == 3:
            if key not in self.twins:
                twin = dataclasses.replace(config, zero=2)
                self.twins[key] = (work_bound_key(twin), twin)
            key, priced = self.twins[key]
        bound = self.work_bounds.get(key)
        if bound is None or (refine and not bound.refined):
            bound = self.work_bounds[key] = work_bound(evaluator, priced, refine=refine)
        tail_key = (key, config.zero, config.dp_replicate, config.offload_optimizer)
        if tail_key not in self.tail_bounds:
            self.tail_bounds[tail_key] = tail_bound_s(evaluator, config, bound)
        return pipeline_bound_s(config, bound) + self.tail_bounds[tail_key]

    def run(self, evaluator: Evaluator, space, graph: ModelGraph, global_batch: int, constraints: dict,
            headroom: float, top: int, exhaustive: bool, beat_s: float = math.inf) -> list:
        """The `top` fitting configurations, best first, as (step time, config, estimate), of those
        faster than `beat_s` (a plan another pass found).

        Candidates leave the heap in bound order. The first time one comes out, its floor bound is
        replaced by the tight one and it goes back in; only the few that reach the front ever pay
        for the tight bound.
        """
        heap = self.candidates(evaluator, space, graph, global_batch, constraints)
        # Each candidate without recompute and pipelining, with the one of its recompute twins that
        # saves the most memory (full recompute where allowed): where the candidate does not fit,
        # the per-layer memory plan (`search_front.refine_front`) can take that twin's recompute away
        # layer by layer, down to the candidate's own time, so the twin goes back in at the candidate's
        # bound. The memory plan chooses among the same per-layer policies from any twin, so one is
        # enough. A pipelined twin goes back in only where its candidate misses by a few percent
        # (`PIPELINED_TWIN_OVERSHOOT`): its memory plan also re-splits the stages and takes seconds
        # (interleaved), which every such candidate of a large model would pay for.
        saver: dict[ParallelConfig, tuple[int, ParallelConfig]] = {}
        if "recompute" not in constraints:
            for _, order, config in sorted(heap, key=lambda item: item[1]):
                if config.recompute != Recompute.NONE:
                    twin = dataclasses.replace(config, recompute=Recompute.NONE)
                    if twin not in saver or config.recompute == Recompute.FULL:
                        saver[twin] = (order, config)
        ranked: list[tuple[float, ParallelConfig, object]] = []
        tight: set[int] = set()
        done: set[int] = set()
        while heap:
            bound_s, order, config = heapq.heappop(heap)
            if order in done:
                continue
            threshold_s = min(beat_s, ranked[top - 1][0] if len(ranked) >= top else math.inf)
            if not exhaustive and bound_s >= threshold_s:
                pruned = len(heap) + 1
                self.reasons["bound"] += pruned
                self.examples.setdefault("bound", []).append(
                    {"what": f"{pruned} configurations", "reason": f"lower bound >= {threshold_s:.3f} s of the plans kept"})
                break
            if order not in tight:
                tight.add(order)
                heapq.heappush(heap, (self._bound_s(evaluator, config, refine=True), order, config))
                continue
            done.add(order)
            floor_bytes = memory_floor_bytes(evaluator, config)
            if floor_bytes > mean_capacity_bytes(evaluator.cluster, config.pp) * (1 - headroom):
                self.screened += 1
                estimate = None
            else:
                self.evaluated += 1
                estimate = evaluator.estimate(config, global_batch, headroom=headroom)
            host = None if estimate is None else estimate.host_overflow()
            if host is not None and all(row["total_bytes"] <= row["capacity_bytes"] * (1 - headroom) for row in estimate.memory):
                self.reasons["host memory"] += 1
                if self.host_miss is None or host["host_bytes"] < self.host_miss[0]:
                    self.host_miss = (host["host_bytes"], host["host_capacity_bytes"], config)
                if len(self.examples.setdefault("host memory", [])) < EXPLAIN_EXAMPLES_PER_REASON:
                    self.examples["host memory"].append({"what": config.short(), "reason": (
                        f"offloaded optimizer states need {host['host_bytes'] / 2**30:.1f} GiB of host memory per device, "
                        f"over its {host['host_capacity_bytes'] / 2**30:.1f} GiB share")})
                continue
            if estimate is None or not estimate.fits:
                if config in saver and saver[config][0] not in done and (config.pp == 1 or _just_over(estimate, headroom)):
                    tight.add(saver[config][0])
                    heapq.heappush(heap, (bound_s, *saver[config]))
                need = floor_bytes if estimate is None else estimate.peak_memory_bytes
                at_least = "at least " if estimate is None else ""
                if estimate is None:
                    self.screened_misses.append((floor_bytes, config))
                elif self.closest_miss is None or need < self.closest_miss[0]:
                    self.closest_miss = (need, config)
                self.reasons["memory"] += 1
                if len(self.examples.setdefault("memory", [])) < EXPLAIN_EXAMPLES_PER_REASON:
                    self.examples["memory"].append({"what": config.short(), "reason": f"out of memory: needs {at_least}{need / 2**30:.1f} GiB per device"})
                continue
            if config.schedule == Schedule.ZERO_BUBBLE and config.pp > 1 and _first_chunk_frozen(graph, estimate):
                self.rejected.append(Rejection(config.short(), "schedule=zb with a first stage frozen whole: torch's split "
                                                                "backward gives the next stages' weights no gradient; use "
                                                                "another schedule"))
                continue
            # equal times: the one needing less memory first
            bisect.insort(ranked, (estimate.step_time_s, config, estimate), key=lambda item: (item[0], item[2].peak_memory_bytes))
        return ranked


def _just_over(estimate, headroom: float) -> bool:
    """Whether a priced configuration misses memory by at most `PIPELINED_TWIN_OVERSHOOT`."""
    return estimate is not None and max(row["total_bytes"] / (row["capacity_bytes"] * (1 - headroom))
                                        for row in estimate.memory) <= 1 + PIPELINED_TWIN_OVERSHOOT


def search(graph: ModelGraph, cluster: Cluster, *, global_batch: int, dtype: str = "bf16", code: TrainingCode = TrainingCode(),
           cluster_name: str = "", **constraints) -> Plan:
    """Best plan for `graph` on `cluster` (see the module docstring for how candidates are pruned).

    Raises:
        PlannerError: INVALID_INPUT for impossible constraints; INSUFFICIENT_MEMORY when no
            configuration fits, with what would.
    """
    started = time.perf_counter()
    constraints = {k: v for k, v in constraints.items() if v is not None}
    check_constraints(constraints)
    headroom = constraints.get("mem_headroom", 0.0)
    top = constraints.get("top", 5)
    exhaustive = constraints.get("exhaustive", False)
    check_positive_int("global_batch", global_batch)
    evaluator = Evaluator(graph, cluster, dtype, code=code)
    space = enumerate_degrees(graph, cluster, constraints, global_batch)
    rejected: list[Rejection] = list(space.rejected)
    reasons: Counter = Counter()
    examples: dict[str, list[dict]] = {}
    tally = _Pass(reasons, examples, rejected)
    kept = top + 1  # the plan and `top` alternatives
    evaluator.schedule_splits = False
    ranked = tally.run(evaluator, space, graph, global_batch, constraints, headroom, kept, exhaustive)
    may_offload = constraints.get("allow_offload", True) and "offload_optimizer" not in constraints
    if may_offload and (not ranked or ranked[0][1].recompute != Recompute.NONE):
        # Offloading the optimizer states frees device memory for less recompute: tried where memory
        # forced recompute on the best plan (or nothing fits), against that plan's time.
        offloaded = tally.run(evaluator, space, graph, global_batch, {**constraints, "offload_optimizer": True}, headroom,
                              kept, exhaustive, beat_s=ranked[0][0] if ranked and not exhaustive else math.inf)
        ranked = sorted(ranked + offloaded[:kept], key=lambda entry: (entry[0], entry[2].peak_memory_bytes))
    evaluator.schedule_splits = True
    ranked = with_schedule_splits(evaluator, ranked, global_batch, headroom, kept)
    candidates_total, evaluated, screened = tally.total, tally.evaluated, tally.screened

    if not ranked:
        def retry(extra: dict) -> tuple[float, ParallelConfig] | None:
            """(peak bytes, config) of the best plan under the constraints with `extra` fixed (with the
            optimizer states offloaded too where the search may offload), else of its closest miss."""
            misses = []
            for offload in (False, True) if may_offload else (False,):
                again = _Pass(Counter(), {}, [])
                fixed = {**constraints, **extra, **({"offload_optimizer": True} if offload else {})}
                found = again.run(evaluator, space, graph, global_batch, fixed, headroom, 1, False)
                if found:
                    return found[0][2].peak_memory_bytes, found[0][1]
                misses.append(closest_miss(evaluator, again.closest_miss, again.screened_misses, global_batch, headroom))
            return min((miss for miss in misses if miss), key=lambda miss: miss[0], default=None)

        closest = closest_miss(evaluator, tally.closest_miss, tally.screened_misses, global_batch, headroom)
        raise nothing_fits(evaluator, global_batch, closest, evaluated + screened,
                           rejected[len(space.rejected):] or rejected, tally.host_miss, constraints, headroom, retry)

    ranked, plan_memory, unrefined = refine_front(evaluator, ranked, global_batch, headroom, fixed="recompute" in constraints)
    best_config, best_estimate = ranked[0][1:3]
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
        estimate=dataclasses.replace(best_estimate, training_code=code.options()),
        layouts=layouts_for(evaluator, best_config),
        memory_plan=plan_memory,
        search={
            "time_s": time.perf_counter() - started,
            "candidates_total": candidates_total,
            "candidates_evaluated": evaluated,
            "screened_by_memory_floor": screened,
            "pruned_by_bound": reasons.get("bound", 0),
            "status": "optimal" if not unrefined else "best found",
            "runner_ups_unrefined": unrefined,
            "not_searched": list(space.not_searched),
            "rejected_counts": dict(reasons),
        },
        alternatives=distinct_alternatives(evaluator, ranked, top),
        rejected=tuple(example for group in examples.values() for example in group),
        layer_names=tuple(layer.name for layer in graph.layers),
        training_code=code.options(),
    )


def _first_chunk_frozen(graph: ModelGraph, estimate) -> bool:
    """Whether the pipeline's first chunk has no parameter that takes a gradient."""
    first, last = estimate.stages[0].chunks[0]
    return all(layer.params == layer.frozen_params for layer in graph.layers[first:last + 1])
