"""Which pipeline split a configuration is priced at when none is given.

The exact memory-aware DP's split (`planner.stages.split_dp`; where no split fits, the one that only
balances time), and that split refined by where the schedule puts the heavy stages
(`planner.stage_polish`), which the evaluator prices in full beside it (`Evaluator.estimate`,
`planner.memory_plan`): the refinement's closed form leaves out transfers and per-stage sync.

Where memory keeps the split from balancing time, `memory_shaped_note` says what the split that
balances time alone would take and need.
"""
from __future__ import annotations

import numpy as np

from planner.config import ParallelConfig
from planner.errors import PlannerError
from planner.graph import Recompute
from planner.report.units import fmt_bytes
from planner.result import Estimate
from planner.stage_polish import refine, refines
from planner.stage_problem import StageProblem
from planner.stages import split_dp, split_time_only


def solver_split(evaluator, config: ParallelConfig, policies: tuple[Recompute, ...],
                 headroom: float = 0.0, problem: StageProblem | None = None) -> tuple[tuple[int, ...], bool]:
    """Layer cut points of the pp*vpp pipeline chunks of `config` from the exact memory-aware DP
    under `evaluator` (a `planner.estimate.Evaluator`), on `problem` when it is built already.

    Returns:
        (boundaries, memory_aware): memory_aware is False when no split fits and the split
        returned only balances time.
    """
    if config.pp * config.vpp == 1:
        return (0, len(evaluator.graph.layers)), True
    problem = problem or evaluator.stage_problem(config, [policies], headroom)
    try:
        return split_dp(problem, explain=False).boundaries, True
    except PlannerError:
        return split_time_only(problem).boundaries, False


def refined_split(evaluator, config: ParallelConfig, policy_sets: list[tuple[Recompute, ...]], boundaries: tuple[int, ...],
                  headroom: float = 0.0, choices: tuple[int, ...] | None = None,
                  problem: StageProblem | None = None) -> tuple[int, ...]:
    """`boundaries` refined by where the schedule puts the heavy stages, with per-layer `choices`
    among `policy_sets` (default: the first set), on `problem` when it is built already;
    `boundaries` itself while the evaluator's `schedule_splits` is off or refinement can move nothing."""
    if not evaluator.schedule_splits or not refines(config.pp * config.vpp, config.pp):
        return tuple(boundaries)
    problem = problem or evaluator.stage_problem(config, policy_sets, headroom)
    picked = np.zeros(problem.num_layers, dtype=int) if choices is None else np.asarray(choices)
    return tuple(int(b) for b in refine(problem, np.asarray(boundaries), picked))


def default_splits(evaluator, config: ParallelConfig, policies: tuple[Recompute, ...],
                   headroom: float = 0.0) -> tuple[tuple[int, ...], ...]:
    """The splits `config` is priced at when none is given: the solver's, and its refinement where it differs."""
    if config.pp * config.vpp == 1:
        return solver_split(evaluator, config, policies, headroom)[:1]
    problem = evaluator.stage_problem(config, [policies], headroom)
    boundaries, memory_aware = solver_split(evaluator, config, policies, headroom, problem)
    refined = refined_split(evaluator, config, [policies], boundaries, headroom, problem=problem) if memory_aware else boundaries
    return (boundaries,) if refined == boundaries else (boundaries, refined)


def chunk_boundaries(estimate: Estimate) -> np.ndarray:
    """The pp*vpp+1 layer cut points of the estimate's pipeline chunks, in chunk order."""
    runs = sorted(run for stage in estimate.stages for run in (stage.chunks or ((stage.first_layer, stage.last_layer),)))
    return np.array([first for first, _ in runs] + [runs[-1][1] + 1])


# Gap (a fraction of the step) beyond which a note says memory shaped the split.
MEMORY_SHAPED_NOTE_GAP = 0.01


def memory_shaped_note(evaluator, config: ParallelConfig, estimate: Estimate, global_batch: int) -> tuple[str, ...]:
    """A note when `estimate` (priced at the default split) fits only because memory moved layers off
    some stages: the split that balances time alone is faster by over `MEMORY_SHAPED_NOTE_GAP` and
    does not fit."""
    if config.pp * config.vpp == 1 or not estimate.fits:
        return ()
    chosen = tuple(int(b) for b in chunk_boundaries(estimate))
    problem = evaluator.stage_problem(config, [evaluator.policies(config, None)])
    balanced = tuple(int(b) for b in split_time_only(problem).boundaries)
    if balanced == chosen:
        return ()
    even = evaluator.estimate(config, global_batch, boundaries=balanced)
    if even.fits or even.step_time_s > estimate.step_time_s * (1 - MEMORY_SHAPED_NOTE_GAP):
        return ()
    row = max(even.memory, key=lambda r: r["total_bytes"] / r["capacity_bytes"])
    return (f"memory shapes the stage split: the split that balances time alone would take {even.step_time_s:.4g} s "
            f"({1 - even.step_time_s / estimate.step_time_s:.0%} less) but needs {fmt_bytes(row['total_bytes'])} on "
            f"stage {row['stage']} of {fmt_bytes(row['capacity_bytes'])}; less activation memory there (recompute, a "
            f"smaller micro-batch, fewer micro-batches in flight) lets the layers spread evenly",)
