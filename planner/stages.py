"""Pipeline stage split by exact DP, the uniform baseline, and the exact memory-feasibility check.

Problem and result types: `planner.stage_problem`; the MILP with per-layer choices: `planner.stage_ilp`.

* `split_dp` (exact, one choice per layer). A DP over (stage, end layer) on prefix-sum segment
  arrays finds, for a bound B, the split of least sum_s T_s whose stage times are all < B. The
  optimum has some largest stage time T*; no split with max in [M, B) beats a split of max M and
  least sum G below B. So the search walks the (max, sum) Pareto front downwards: start from the
  better of the least-sum and least-max splits; a better split must have max < (best - G_min)/(m-1)
  (its sum is at least G_min, the unbounded least sum); each DP returns a split of max M, after which
  the bound drops below M; stop when the bound reaches the least possible max. Equal speeds make
  every sum equal, so it ends after two or three O(S L^2) numpy DPs.
  Where the slowest stage sits is left to `planner.stage_polish`, which the evaluator runs after.
* `split_uniform`: equal layer counts, the baseline a user would otherwise write by hand.

Memory feasibility is exact too: the split of least memory pressure (a min-max DP over the segments'
memory) fits iff any split fits (`raise_if_no_split_fits`). Where nothing fits,
`StageProblem.no_split_fits` says so in O(S L), before the S x L x L tables are built.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from planner.errors import PlannerError, PlannerErrorKind, invalid
from planner.milp import SolveStatus
from planner.stage_problem import StageProblem, StageSplit, make_split, pipeline_step_time_s, segment_sums

GIB_BYTES = 2**30  # only for rendering error messages
# Memory cap standing for "no limit" when a split only balances time (finite, as StageProblem requires).
UNBOUNDED_BYTES = 1e30


def split_dp(problem: StageProblem, explain: bool = True) -> StageSplit:
    """Exact optimal split for one choice per layer (see the module docstring for the method).

    Args:
        problem: a StageProblem with C == 1.
        explain: where no split fits, name the memory the least-pressured split needs (an S x L x L
            table); without, `StageProblem.no_split_fits` may say only that none fits, in O(S L).

    Returns:
        The optimal StageSplit (status "optimal", gap 0).

    Raises:
        PlannerError: INVALID_INPUT when C > 1 (use `split_ilp`); INSUFFICIENT_MEMORY when no split fits.
    """
    start_s = time.perf_counter()
    if problem.num_choices != 1:
        raise invalid(f"layer_time_s: {problem.num_choices} choices per layer; split_dp takes one, use split_ilp")
    choices = np.zeros(problem.num_layers, dtype=int)
    if problem.num_stages == problem.num_layers:
        return _one_layer_per_stage(problem, choices, start_s)
    fast = _balanced_split_if_it_fits(problem, choices)
    if fast is not None:
        return make_split(problem, fast, choices, "dp", SolveStatus.OPTIMAL, 0.0, time.perf_counter() - start_s)
    if not explain and problem.no_split_fits():
        raise PlannerError(PlannerErrorKind.INSUFFICIENT_MEMORY,
                           f"no split of {problem.num_layers} layers into {problem.num_stages} stages fits memory")
    segment_mem_bytes = problem.segment_mem_bytes(choices)
    raise_if_no_split_fits(problem, segment_mem_bytes)
    segment_time_s = segment_sums(problem.layer_time_s[:, 0][None, :] / problem.stage_speed[:, None])
    segment_time_s[segment_mem_bytes > problem.mem_cap_bytes[:, None, None]] = np.inf
    m = problem.num_microbatches

    def objective_s(boundaries: np.ndarray) -> float:
        return pipeline_step_time_s(_segment_values(segment_time_s, boundaries), m)

    best = _best_split(segment_time_s, np.add)
    if m > 1:
        min_sum_s = float(_segment_values(segment_time_s, best).sum())
        least_max = _best_split(segment_time_s, np.maximum)
        least_max_s = float(_segment_values(segment_time_s, least_max).max())
        best = min(best, least_max, key=objective_s)
        # Walk down the (max, sum) front: every split better than `best` has max stage time < bound_s.
        bound_s = (objective_s(best) - min_sum_s) / (m - 1)
        while bound_s > least_max_s and (candidate := _best_split(_below(segment_time_s, bound_s), np.add)) is not None:
            best = min(best, candidate, key=objective_s)
            bound_s = min(float(_segment_values(segment_time_s, candidate).max()), (objective_s(best) - min_sum_s) / (m - 1))
    return make_split(problem, best, choices, "dp", SolveStatus.OPTIMAL, 0.0, time.perf_counter() - start_s)


def split_time_only(problem: StageProblem) -> StageSplit:
    """`split_dp` with no memory caps: the split that only balances time."""
    return split_dp(replace(problem, mem_cap_bytes=np.full(problem.num_stages, UNBOUNDED_BYTES)))


def _balanced_split_if_it_fits(problem: StageProblem, choices: np.ndarray) -> np.ndarray | None:
    """On equally fast stages, the least-max split when it also fits memory; None otherwise.

    With equal speeds sum_s T_s is the same for every split, so the objective (m - 1) max + sum is
    least exactly where max is; if that split fits, it is optimal. One [L+1, L+1] segment table is
    shared by every stage (a broadcast view), instead of the S x L x L tables the full DP builds.
    """
    speed = problem.stage_speed
    if not np.all(speed == speed[0]):
        return None
    segment_time_s = segment_sums(problem.layer_time_s[:, 0][None, :] / speed[0])[0]
    shape = (problem.num_stages, *segment_time_s.shape)
    boundaries = _best_split(np.broadcast_to(segment_time_s, shape), np.maximum)
    return boundaries if np.all(problem.stage_mem_bytes(boundaries, choices) <= problem.mem_cap_bytes) else None


def _one_layer_per_stage(problem: StageProblem, choices: np.ndarray, start_s: float) -> StageSplit:
    """The only contiguous split when there are as many stages as layers (no O(S L^2) DP needed)."""
    boundaries = np.arange(problem.num_layers + 1)
    need_bytes = problem.stage_mem_bytes(boundaries, choices)
    if np.any(need_bytes > problem.mem_cap_bytes):
        raise _no_split_fits(problem, need_bytes)
    return make_split(problem, boundaries, choices, "dp", SolveStatus.OPTIMAL, 0.0, time.perf_counter() - start_s)


def split_uniform(problem: StageProblem) -> StageSplit:
    """Equal layer counts per stage (the first L mod S stages take one extra layer), choice 0 everywhere.

    This is the baseline, not a solver: it never raises for memory. When a stage overflows its cap the
    result has status "infeasible" and `stage_mem_bytes` shows by how much.

    Args:
        problem: a StageProblem.

    Returns:
        The uniform StageSplit, status "feasible" or "infeasible", gap nan.
    """
    start_s = time.perf_counter()
    sizes = [len(part) for part in np.array_split(np.arange(problem.num_layers), problem.num_stages)]
    boundaries = np.concatenate([[0], np.cumsum(sizes)])
    choices = np.zeros(problem.num_layers, dtype=int)
    split = make_split(problem, boundaries, choices, "uniform", SolveStatus.FEASIBLE, float("nan"), 0.0)
    if np.any(np.asarray(split.stage_mem_bytes) > problem.mem_cap_bytes):
        split = replace(split, status=SolveStatus.INFEASIBLE)
    return replace(split, solve_time_s=time.perf_counter() - start_s)


def _best_split(segments: np.ndarray, combine: np.ufunc) -> np.ndarray | None:
    """Boundaries minimising the stage values combined by `combine` (np.add: sum, np.maximum: max).

    A DP over (stage, end): best[s][j] = min_i combine(best[s-1][i], segments[s, j, i]); inf segments
    are forbidden. Returns None when every split contains one.
    """
    num_stages, num_points, _ = segments.shape
    best = np.full(num_points, np.inf)
    best[0] = 0.0
    start = np.empty((num_stages, num_points), dtype=int)
    ends = np.arange(num_points)
    for s in range(num_stages):
        candidates = combine(segments[s], best[None, :])
        start[s] = np.argmin(candidates, axis=1)
        best = candidates[ends, start[s]]
    if not np.isfinite(best[-1]):
        return None
    boundaries = np.empty(num_stages + 1, dtype=int)
    boundaries[-1] = num_points - 1
    for s in range(num_stages - 1, -1, -1):
        boundaries[s] = start[s, boundaries[s + 1]]
    return boundaries


def _below(segment_time_s: np.ndarray, bound_s: float) -> np.ndarray:
    """Segment times with every segment of time >= bound_s forbidden (inf)."""
    return np.where(segment_time_s < bound_s, segment_time_s, np.inf)


def _segment_values(segments: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """[S] values segments[s, b_{s+1}, b_s] of a split."""
    return segments[np.arange(len(boundaries) - 1), boundaries[1:], boundaries[:-1]]


def least_pressure_split(problem: StageProblem, segment_mem_bytes: np.ndarray) -> np.ndarray:
    """[S] bytes per stage of the split minimising max_s M_s / cap_s (a min-max DP over
    `StageProblem.segment_mem_bytes`).

    This split fits iff any split fits; with per-layer choices, pass the segments' least memory
    (`segment_mem_bytes()`), a lower bound: nothing fits when even it does not.
    """
    boundaries = _best_split(segment_mem_bytes / problem.mem_cap_bytes[:, None, None], np.maximum)
    return _segment_values(segment_mem_bytes, boundaries)


def raise_if_no_split_fits(problem: StageProblem, segment_mem_bytes: np.ndarray) -> None:
    """Raise INSUFFICIENT_MEMORY, naming how much memory the least-pressured split needs, if nothing fits."""
    stage_need_bytes = least_pressure_split(problem, segment_mem_bytes)
    if np.all(stage_need_bytes <= problem.mem_cap_bytes):
        return
    raise _no_split_fits(problem, stage_need_bytes)


def _no_split_fits(problem: StageProblem, stage_need_bytes: np.ndarray) -> PlannerError:
    """INSUFFICIENT_MEMORY naming the stage under most pressure in the least-pressured split."""
    worst = int(np.argmax(stage_need_bytes / problem.mem_cap_bytes))
    need, cap = stage_need_bytes[worst], problem.mem_cap_bytes[worst]
    return PlannerError(
        PlannerErrorKind.INSUFFICIENT_MEMORY,
        f"no split of {problem.num_layers} layers into {problem.num_stages} stages fits memory: the best needs "
        f"{need / GIB_BYTES:.2f} GiB on stage {worst} (cap {cap / GIB_BYTES:.2f} GiB, {need / cap:.2f}x); "
        "add pipeline stages, recompute activations or shard optimizer state",
    )
