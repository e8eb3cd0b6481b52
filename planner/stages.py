"""Pipeline stage split: cut L layers into S contiguous stages that fit memory and minimise 1F1B step time.

Inputs are plain numpy arrays (`StageProblem`); nothing here knows about torch or hardware.

Model. Stage s holds layers [b_s, b_{s+1}) and, per layer l, one choice c_l (e.g. a recompute policy;
a single choice when the arrays are 1-D). With t, w, a the per-layer time, static bytes and activation
bytes of one micro-batch::

    T_s   = sum_{l in s} t[l, c_l] / speed_s                                   (stage time)
    M_s   = sum_{l in s} (w[l, c_l] + in_flight_s * a[l, c_l]) + overhead_s    (stage memory)
    step  = (m - 1) * max_s T_s + sum_s T_s                                    (1F1B with unequal stages)
    subject to M_s <= cap_s and every stage holding at least one layer.

Three ways to solve it:

* `split_dp` (exact, one choice per layer). A DP over (stage, end layer) on prefix-sum segment
  arrays finds, for a bound B, the split of least sum_s T_s whose stage times are all < B. The
  optimum has some largest stage time T*; no split with max in [M, B) beats a split of max M and
  least sum G below B. So the search walks the (max, sum) Pareto front downwards: start from the
  better of the least-sum and least-max splits; a better split must have max < (best - G_min)/(m-1)
  (its sum is at least G_min, the unbounded least sum); each DP returns a split of max M, after which
  the bound drops below M; stop when the bound reaches the least possible max. Equal speeds make
  every sum equal, so it ends after two or three O(S L^2) numpy DPs.
* `split_ilp` (per-layer choices). A MILP solved by HiGHS (`planner.milp`) over runs of identical
  consecutive layers (repeated blocks form one run): integers u[r, s] (layers of run r on stages
  <= s) and n[r, s, c] (layers of run r on stage s with choice c) instead of one binary per layer,
  stage and choice, which removes the symmetry of repeated blocks (96 identical blocks x 8 stages x
  3 choices: optimal in under 1 s, where per-layer binaries stall at a 10% gap after 10 s). It starts
  from the best `split_dp` split that uses one choice for every layer, so it never returns worse.
  Memory feasibility is decided before the MILP, exactly, by the min-max DP on each layer's
  least-memory choice.
* `split_uniform`: equal layer counts, the baseline a user would otherwise write by hand.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
from ortools.math_opt.python import mathopt

from planner.errors import PlannerError, PlannerErrorKind, invalid
from planner.milp import SolveStatus, solve_milp

GIB_BYTES = 2**30  # only for rendering error messages
TIME_UNIT_FLOOR_S = 1e-12  # keeps the MILP's time normalisation finite when every layer time is 0


@dataclass(frozen=True)
class StageProblem:
    """One stage-split instance. Per-layer arrays are [L] (one choice) or [L, C] (C choices per layer).

    Arrays are converted on creation: per-layer arrays to float [L, C], per-stage arrays to float [S].

    Attributes:
        layer_time_s: forward+backward time of one micro-batch per layer on a reference device.
        layer_static_bytes: weights + grads + optimizer bytes per device of each layer.
        layer_act_bytes: activation bytes one micro-batch of each layer keeps until its backward.
        num_stages: S.
        in_flight: [S] micro-batches in flight on each stage (1F1B: min(S - s, m)).
        mem_cap_bytes: [S] memory available per device of each stage.
        stage_speed: [S] relative speed of each stage's devices (1.0 = the reference device).
        num_microbatches: m, micro-batches per step.
        stage_overhead_bytes: [S] fixed bytes per stage (buffers, communication scratch); zeros if None.
    """

    layer_time_s: np.ndarray
    layer_static_bytes: np.ndarray
    layer_act_bytes: np.ndarray
    num_stages: int
    in_flight: np.ndarray
    mem_cap_bytes: np.ndarray
    stage_speed: np.ndarray
    num_microbatches: int
    stage_overhead_bytes: np.ndarray | None = None

    def __post_init__(self):
        if not isinstance(self.num_stages, (int, np.integer)) or self.num_stages < 1:
            raise invalid(f"num_stages={self.num_stages!r}: must be a positive integer")
        if not isinstance(self.num_microbatches, (int, np.integer)) or self.num_microbatches < 1:
            raise invalid(f"num_microbatches={self.num_microbatches!r}: must be a positive integer")
        time_s = _per_layer("layer_time_s", self.layer_time_s)
        for name in ("layer_time_s", "layer_static_bytes", "layer_act_bytes"):
            value = _per_layer(name, getattr(self, name))
            if value.shape != time_s.shape:
                raise invalid(
                    f"{name}: shape {value.shape} differs from layer_time_s {time_s.shape}; "
                    "give one row per layer, one column per choice"
                )
            object.__setattr__(self, name, value)
        if time_s.shape[0] < self.num_stages:
            layers = time_s.shape[0]
            raise invalid(f"num_stages={self.num_stages}: more stages than the {layers} layers; use at most {layers} stages")
        if self.stage_overhead_bytes is None:
            object.__setattr__(self, "stage_overhead_bytes", np.zeros(self.num_stages))
        for name in ("in_flight", "mem_cap_bytes", "stage_speed", "stage_overhead_bytes"):
            value = np.asarray(getattr(self, name), dtype=float)
            if value.shape != (self.num_stages,):
                raise invalid(f"{name}: shape {value.shape}, expected ({self.num_stages},), one value per stage")
            if not np.all(np.isfinite(value)) or np.any(value < 0):
                raise invalid(f"{name}: values must be finite and >= 0")
            object.__setattr__(self, name, value)
        if np.any(self.stage_speed <= 0):
            raise invalid("stage_speed: every stage needs a speed > 0 (1.0 = the reference device)")
        if np.any(self.mem_cap_bytes <= 0):
            raise invalid("mem_cap_bytes: every stage needs memory > 0")

    @property
    def num_layers(self) -> int:
        return self.layer_time_s.shape[0]

    @property
    def num_choices(self) -> int:
        return self.layer_time_s.shape[1]

    def stage_layer_mem_bytes(self, choices: np.ndarray) -> np.ndarray:
        """[S, L] bytes layer l would add to stage s with the given per-layer choice indices."""
        rows = np.arange(self.num_layers)
        static = self.layer_static_bytes[rows, choices]
        act = self.layer_act_bytes[rows, choices]
        return static[None, :] + self.in_flight[:, None] * act[None, :]


@dataclass(frozen=True)
class StageSplit:
    """A stage split and what it costs.

    Attributes:
        boundaries: S+1 cut points from 0 to L; stage s holds layers [boundaries[s], boundaries[s+1]).
        choices: per-layer choice index (all 0 when the problem has one choice).
        stage_time_s: T_s per stage (layer times / stage speed).
        stage_mem_bytes: memory per device of each stage.
        objective_s: (m - 1) * max(T_s) + sum(T_s).
        method: "dp", "ilp" or "uniform".
        status: a `SolveStatus`; "infeasible" only from `split_uniform` (the split overflows memory).
        gap: relative optimality gap (0 for the exact DP; nan for the uniform baseline, which is not optimised).
        solve_time_s: wall time spent.
    """

    boundaries: tuple[int, ...]
    choices: tuple[int, ...]
    stage_time_s: tuple[float, ...]
    stage_mem_bytes: tuple[float, ...]
    objective_s: float
    method: str
    status: SolveStatus
    gap: float
    solve_time_s: float

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(int(n) for n in np.diff(self.boundaries))


def pipeline_step_time_s(stage_time_s, num_microbatches: int) -> float:
    """1F1B step time with unequal stages: (m - 1) * max_s T_s + sum_s T_s."""
    return (num_microbatches - 1) * float(np.max(stage_time_s)) + float(np.sum(stage_time_s))


def split_dp(problem: StageProblem) -> StageSplit:
    """Exact optimal split for one choice per layer (see the module docstring for the method).

    Args:
        problem: a StageProblem with C == 1.

    Returns:
        The optimal StageSplit (status "optimal", gap 0).

    Raises:
        PlannerError: INVALID_INPUT when C > 1 (use `split_ilp`); INSUFFICIENT_MEMORY when no split fits.
    """
    start_s = time.perf_counter()
    if problem.num_choices != 1:
        raise invalid(f"layer_time_s: {problem.num_choices} choices per layer; split_dp takes one, use split_ilp")
    choices = np.zeros(problem.num_layers, dtype=int)
    stage_layer_mem_bytes = problem.stage_layer_mem_bytes(choices)
    _raise_if_no_split_fits(problem, stage_layer_mem_bytes)
    segment_mem_bytes = _segment_sums(stage_layer_mem_bytes) + problem.stage_overhead_bytes[:, None, None]
    segment_time_s = _segment_sums(problem.layer_time_s[:, 0][None, :] / problem.stage_speed[:, None])
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
    return _make_split(problem, best, choices, "dp", SolveStatus.OPTIMAL, 0.0, time.perf_counter() - start_s)


def split_ilp(problem: StageProblem, time_limit_s: float = 10.0, rel_gap: float = 1e-4) -> StageSplit:
    """Optimal split with per-layer choices, as a MILP solved by HiGHS.

    Runs r of identical consecutive layers (start a_r, length len_r) are placed by counts:
        u[r, s] in [0, len_r], integer: layers of run r on stages <= s (u[r, S-1] = len_r)
        n[r, s, c] >= 0, integer:       layers of run r on stage s with choice c
        f[r, s] in {0, 1}:              run r lies wholly on stages <= s
        t_max:                          the slowest stage's time
    Constraints (one `_add_*` function each, named):
        count[r,s]      sum_c n[r, s, c] = u[r, s] - u[r, s-1]
        complete/order  u[r, s] >= len_r f[r, s];  u[r+1, s] <= len_{r+1} f[r, s]  (stages <= s hold a layer prefix)
        nonempty[s]     sum_{r,c} n[r, s, c] >= 1
        memory[s]       sum_{r,c} (w[r, c] + in_flight_s a[r, c]) n[r, s, c] + overhead_s <= cap_s
        t_max[s]        t_max >= T_s = sum_{r,c} t[r, c] n[r, s, c] / speed_s
    Objective: (m - 1) t_max + sum_s T_s. A run's layers on one stage take their choices in sorted
    order (identical layers, so any order costs the same).

    Args:
        problem: a StageProblem with any number of choices per layer.
        time_limit_s: solver wall-clock limit.
        rel_gap: relative gap at which the solver stops.

    Returns:
        The best StageSplit found: status "optimal" (within rel_gap) or "time_limit" with its gap.

    Raises:
        PlannerError: INSUFFICIENT_MEMORY when no split fits even with the least-memory choice for
            every layer; SOLVER_LIMIT when the time limit passed before any feasible split was found.
    """
    start_s = time.perf_counter()
    _raise_if_no_split_fits(problem, _least_stage_layer_mem_bytes(problem))
    runs = _Runs.of(problem)
    model = mathopt.Model(name="stage_split")
    # time_unit_s: stage times enter the model divided by it, so the solver sees coefficients of order 1
    time_unit_s = max(float(problem.layer_time_s.max(axis=1).sum() / problem.stage_speed.min()), TIME_UNIT_FLOOR_S)
    variables = _RunVariables.add(model, runs, problem)
    _add_count_constraints(model, variables, runs, problem)
    _add_order_constraints(model, variables, runs, problem)
    _add_nonempty_constraints(model, variables, runs, problem)
    _add_memory_constraints(model, variables, runs, problem)
    stage_time = _add_stage_time_constraints(model, variables, runs, problem, time_unit_s)
    model.minimize((problem.num_microbatches - 1) * variables.t_max + mathopt.fast_sum(stage_time))
    hint = _best_single_choice_split(problem)
    result = solve_milp(
        model,
        time_limit_s=time_limit_s,
        rel_gap=rel_gap,
        what="stage split",
        hint=None if hint is None else variables.values_of(hint, runs, time_unit_s),
    )
    if result.status == SolveStatus.INFEASIBLE:
        raise PlannerError(PlannerErrorKind.INSUFFICIENT_MEMORY, "stage split: the MILP found no split that fits memory")
    boundaries, choices = variables.decode(result.values, runs, problem)
    return _make_split(problem, boundaries, choices, "ilp", result.status, result.gap, time.perf_counter() - start_s)


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
    split = _make_split(problem, boundaries, choices, "uniform", SolveStatus.FEASIBLE, float("nan"), 0.0)
    if np.any(np.asarray(split.stage_mem_bytes) > problem.mem_cap_bytes):
        split = replace(split, status=SolveStatus.INFEASIBLE)
    return replace(split, solve_time_s=time.perf_counter() - start_s)


def _per_layer(name: str, value) -> np.ndarray:
    array = np.asarray(value, dtype=float)
    if array.ndim == 1:
        array = array[:, None]
    if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
        raise invalid(f"{name}: shape {np.shape(value)}, expected [L] or [L, C] with L, C >= 1")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise invalid(f"{name}: values must be finite and >= 0")
    return array


def _segment_sums(stage_layer_values: np.ndarray) -> np.ndarray:
    """[S, L] per-stage layer values -> segment array: [s, j, i] = sum over layers [i, j), inf where j <= i.

    Segment arrays are indexed [stage, end, start] so the DPs reduce over contiguous memory.
    """
    num_stages, num_layers = stage_layer_values.shape
    prefix = np.concatenate([np.zeros((num_stages, 1)), np.cumsum(stage_layer_values, axis=1)], axis=1)
    sums = prefix[:, :, None] - prefix[:, None, :]
    lower = np.tril(np.ones((num_layers + 1, num_layers + 1), dtype=bool), k=-1)
    return np.where(lower[None, :, :], sums, np.inf)


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


def _least_stage_layer_mem_bytes(problem: StageProblem) -> np.ndarray:
    """[S, L] bytes of layer l on stage s with its least-memory choice for that stage."""
    per_choice = problem.layer_static_bytes[None, :, :] + problem.in_flight[:, None, None] * problem.layer_act_bytes[None, :, :]
    return per_choice.min(axis=2)


def _least_pressure_split(problem: StageProblem, stage_layer_mem_bytes: np.ndarray) -> np.ndarray:
    """[S] bytes per stage of the split minimising max_s M_s / cap_s (a min-max DP).

    Memory is additive per layer, so this split fits iff any split fits; with per-layer choices, pass
    each layer's least-memory choice per stage.
    """
    need_bytes = _segment_sums(stage_layer_mem_bytes) + problem.stage_overhead_bytes[:, None, None]
    boundaries = _best_split(need_bytes / problem.mem_cap_bytes[:, None, None], np.maximum)
    return _segment_values(need_bytes, boundaries)


def _raise_if_no_split_fits(problem: StageProblem, stage_layer_mem_bytes: np.ndarray) -> None:
    """Raise INSUFFICIENT_MEMORY, naming how much memory the least-pressured split needs, if nothing fits."""
    stage_need_bytes = _least_pressure_split(problem, stage_layer_mem_bytes)
    if np.all(stage_need_bytes <= problem.mem_cap_bytes):
        return
    worst = int(np.argmax(stage_need_bytes / problem.mem_cap_bytes))
    need, cap = stage_need_bytes[worst], problem.mem_cap_bytes[worst]
    raise PlannerError(
        PlannerErrorKind.INSUFFICIENT_MEMORY,
        f"no split of {problem.num_layers} layers into {problem.num_stages} stages fits memory: the best needs "
        f"{need / GIB_BYTES:.2f} GiB on stage {worst} (cap {cap / GIB_BYTES:.2f} GiB, {need / cap:.2f}x); "
        "add pipeline stages, recompute activations or shard optimizer state",
    )


def _best_single_choice_split(problem: StageProblem) -> StageSplit | None:
    """The best `split_dp` result over "every layer takes choice c", or None when no such split fits."""
    best = None
    for c in range(problem.num_choices):
        one_choice = replace(
            problem,
            layer_time_s=problem.layer_time_s[:, c],
            layer_static_bytes=problem.layer_static_bytes[:, c],
            layer_act_bytes=problem.layer_act_bytes[:, c],
        )
        choices = np.zeros(problem.num_layers, dtype=int)
        if np.any(_least_pressure_split(one_choice, one_choice.stage_layer_mem_bytes(choices)) > problem.mem_cap_bytes):
            continue
        split = split_dp(one_choice)
        if best is None or split.objective_s < best.objective_s:
            best = replace(split, choices=(c,) * problem.num_layers)
    return best


@dataclass(frozen=True)
class _Runs:
    """Maximal runs of identical consecutive layers (same time, static and activation bytes for every choice)."""

    start: tuple[int, ...]
    length: tuple[int, ...]

    @classmethod
    def of(cls, problem: StageProblem) -> _Runs:
        rows = np.concatenate([problem.layer_time_s, problem.layer_static_bytes, problem.layer_act_bytes], axis=1)
        new_run = np.concatenate([[True], np.any(rows[1:] != rows[:-1], axis=1)])
        start = np.flatnonzero(new_run)
        length = np.diff(np.append(start, problem.num_layers))
        return cls(tuple(int(x) for x in start), tuple(int(x) for x in length))

    def __len__(self) -> int:
        return len(self.start)


@dataclass(frozen=True)
class _RunVariables:
    """MILP variables of the run-count formulation (see `split_ilp`)."""

    prefix: dict  # (r, s) -> u[r, s]: layers of run r on stages <= s (integer; fixed to the run length at s = S-1)
    count: dict  # (r, s, c) -> n[r, s, c]: layers of run r on stage s with choice c (integer)
    full: dict  # (r, s) -> f[r, s]: run r lies wholly on stages <= s (binary; r < R-1, s < S-1)
    t_max: mathopt.Variable  # the slowest stage's time / time_unit_s

    @classmethod
    def add(cls, model: mathopt.Model, runs: _Runs, problem: StageProblem) -> _RunVariables:
        last = problem.num_stages - 1
        prefix = {
            (r, s): model.add_integer_variable(lb=length if s == last else 0, ub=length, name=f"u[{r},{s}]")
            for r, length in enumerate(runs.length)
            for s in range(problem.num_stages)
        }
        count = {
            (r, s, c): model.add_integer_variable(lb=0, ub=length, name=f"n[{r},{s},{c}]")
            for r, length in enumerate(runs.length)
            for s in range(problem.num_stages)
            for c in range(problem.num_choices)
        }
        full = {(r, s): model.add_binary_variable(name=f"f[{r},{s}]") for r in range(len(runs) - 1) for s in range(last)}
        return cls(prefix, count, full, model.add_variable(lb=0.0, name="t_max"))

    def values_of(self, split: StageSplit, runs: _Runs, time_unit_s: float) -> dict:
        """Variable values of a known split (the solver's first incumbent)."""
        values = {self.t_max: max(split.stage_time_s) / time_unit_s}
        stage_of = np.repeat(np.arange(len(split.stage_time_s)), np.diff(split.boundaries))
        for (r, s), var in self.prefix.items():
            values[var] = float(np.clip(split.boundaries[s + 1] - runs.start[r], 0, runs.length[r]))
        for (r, s), var in self.full.items():
            values[var] = float(values[self.prefix[r, s]] == runs.length[r])
        for (r, s, c), var in self.count.items():
            layers = slice(runs.start[r], runs.start[r] + runs.length[r])
            values[var] = float(np.sum((stage_of[layers] == s) & (np.asarray(split.choices)[layers] == c)))
        return values

    def decode(self, values, runs: _Runs, problem: StageProblem) -> tuple[np.ndarray, np.ndarray]:
        """(boundaries, per-layer choices) of a solution; each run's layers on a stage take sorted choices."""
        prefix = np.array([[round(values[self.prefix[r, s]]) for s in range(problem.num_stages)] for r in range(len(runs))])
        boundaries = np.concatenate([[0], prefix.sum(axis=0)])
        choices = np.zeros(problem.num_layers, dtype=int)
        for r, start in enumerate(runs.start):
            counts = [round(values[self.count[r, s, c]]) for s in range(problem.num_stages) for c in range(problem.num_choices)]
            choices[start:start + runs.length[r]] = np.repeat(np.tile(np.arange(problem.num_choices), problem.num_stages), counts)
        return boundaries, choices


def _add_count_constraints(model, variables: _RunVariables, runs: _Runs, problem: StageProblem) -> None:
    """count[r,s]: sum_c n[r, s, c] = u[r, s] - u[r, s-1] (layers of run r on stage s; u[r, -1] = 0)."""
    for r in range(len(runs)):
        for s in range(problem.num_stages):
            on_stage = mathopt.fast_sum(variables.count[r, s, c] for c in range(problem.num_choices))
            before = variables.prefix[r, s - 1] if s > 0 else 0
            model.add_linear_constraint(on_stage == variables.prefix[r, s] - before, name=f"count[{r},{s}]")


def _add_order_constraints(model, variables: _RunVariables, runs: _Runs, problem: StageProblem) -> None:
    """Stages <= s hold a prefix of the layers: run r+1 starts there only once run r is complete.

    order[r,s]: u[r, s] >= len_r * f[r, s] and u[r+1, s] <= len_{r+1} * f[r, s].
    """
    for (r, s), full in variables.full.items():
        model.add_linear_constraint(variables.prefix[r, s] >= runs.length[r] * full, name=f"complete[{r},{s}]")
        model.add_linear_constraint(variables.prefix[r + 1, s] <= runs.length[r + 1] * full, name=f"order[{r},{s}]")


def _add_nonempty_constraints(model, variables: _RunVariables, runs: _Runs, problem: StageProblem) -> None:
    for s in range(problem.num_stages):
        on_stage = mathopt.fast_sum(variables.count[r, s, c] for r in range(len(runs)) for c in range(problem.num_choices))
        model.add_linear_constraint(on_stage >= 1, name=f"nonempty[{s}]")


def _add_memory_constraints(model, variables: _RunVariables, runs: _Runs, problem: StageProblem) -> None:
    """memory[s]: stage memory / cap <= 1 (normalised so every row has coefficients of order 1)."""
    for s in range(problem.num_stages):
        cap = problem.mem_cap_bytes[s]
        terms = [
            (problem.layer_static_bytes[start, c] + problem.in_flight[s] * problem.layer_act_bytes[start, c]) / cap
            * variables.count[r, s, c]
            for r, start in enumerate(runs.start)
            for c in range(problem.num_choices)
        ]
        model.add_linear_constraint(mathopt.fast_sum(terms) <= (cap - problem.stage_overhead_bytes[s]) / cap, name=f"memory[{s}]")


def _add_stage_time_constraints(model, variables: _RunVariables, runs: _Runs, problem: StageProblem, time_unit_s: float) -> list:
    """Returns the stage times T_s / time_unit_s and adds t_max[s]: t_max >= each."""
    stage_time = []
    for s in range(problem.num_stages):
        scale = 1.0 / (problem.stage_speed[s] * time_unit_s)
        stage_time.append(mathopt.fast_sum(
            problem.layer_time_s[start, c] * scale * variables.count[r, s, c]
            for r, start in enumerate(runs.start)
            for c in range(problem.num_choices)
        ))
        model.add_linear_constraint(variables.t_max >= stage_time[-1], name=f"t_max[{s}]")
    return stage_time


def _make_split(problem, boundaries, choices, method, status, gap, solve_time_s) -> StageSplit:
    boundaries = np.asarray(boundaries, dtype=int)
    rows = np.arange(problem.num_layers)
    stage_of = np.repeat(np.arange(problem.num_stages), np.diff(boundaries))
    time_s = np.bincount(stage_of, problem.layer_time_s[rows, choices], problem.num_stages) / problem.stage_speed
    mem_bytes = problem.stage_layer_mem_bytes(choices)[stage_of, rows]
    stage_mem_bytes = np.bincount(stage_of, mem_bytes, problem.num_stages) + problem.stage_overhead_bytes
    return StageSplit(
        boundaries=tuple(int(b) for b in boundaries),
        choices=tuple(int(c) for c in choices),
        stage_time_s=tuple(float(t) for t in time_s),
        stage_mem_bytes=tuple(float(b) for b in stage_mem_bytes),
        objective_s=pipeline_step_time_s(time_s, problem.num_microbatches),
        method=method,
        status=status,
        gap=float(gap),
        solve_time_s=solve_time_s,
    )
