"""Pipeline stage split with per-layer choices (e.g. a recompute policy per layer), as a MILP.

`split_ilp` solves a MILP by HiGHS (`planner.milp`) over runs of identical consecutive layers
(repeated blocks form one run): integers u[r, s] (layers of run r on stages <= s) and n[r, s, c]
(layers of run r on stage s with choice c) instead of one binary per layer, stage and choice, which
removes the symmetry of repeated blocks (96 identical blocks x 8 stages x 3 choices: optimal in
under 1 s, where per-layer binaries stall at a 10% gap after 10 s). It starts from the best
`split_dp` split that uses one choice for every layer, so it never returns worse. Memory
feasibility is decided before the MILP, exactly, by the min-max DP on each layer's least-memory
choice (`planner.stages.raise_if_no_split_fits`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
from ortools.math_opt.python import mathopt

from planner.errors import PlannerError, PlannerErrorKind
from planner.milp import SolveStatus, solve_milp
from planner.stage_problem import LAYER_ARRAYS, StageProblem, StageSplit, make_split
from planner.stages import least_pressure_split, raise_if_no_split_fits, split_dp

TIME_UNIT_FLOOR_S = 1e-12  # keeps the MILP's time normalisation finite when every layer time is 0


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
        memory[d]       sum_{s on d} (sum_{r,c} (w[r, c] + in_flight_s a[r, c]) n[r, s, c] + overhead_s) + z[d]
                        <= sum_{s on d} cap_s   (device d's chunks, `StageProblem.devices`)
        transient[d]    z[d] >= sum_{s on d} sum_{r,c} e[r, c] n[r, s, c]  (transients, summed)
        work[r,s,c]     z[d] >= r[r, c] y[r, s, c],  n[r, s, c] <= len_r y[r, s, c]  (y binary: the
                        largest recompute working set on the device, where r[r, c] > 0)
        t_max[d]        t_max >= sum_{s on d} T_s, T_s = sum_{r,c} t[r, c] n[r, s, c] / speed_s
    Objective: (m - 1) t_max + sum_s T_s / v, with v = S / D chunks per device: 1F1B's with one
    chunk per device, and the interleaved schedule's (m - 1 + p / v) T for p equal devices of time T
    (its bubble is (p - 1) / v of T). A run's layers on one stage take their choices in sorted order
    (identical layers, so any order costs the same).

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
    if problem.devices == problem.num_stages:  # chunks sharing a device: the MILP alone decides
        raise_if_no_split_fits(problem, problem.segment_mem_bytes())
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
    chunks = problem.num_stages // problem.devices
    model.minimize((problem.num_microbatches - 1) * variables.t_max + mathopt.fast_sum(stage_time) / chunks)
    hint = _best_single_choice_split(problem)
    result = solve_milp(
        model,
        time_limit_s=time_limit_s,
        rel_gap=rel_gap,
        what="stage split",
        hint=None if hint is None else variables.values_of(hint, runs, time_unit_s, problem),
    )
    if result.status == SolveStatus.INFEASIBLE:
        raise PlannerError(PlannerErrorKind.INSUFFICIENT_MEMORY, "stage split: the MILP found no split that fits memory")
    boundaries, choices = variables.decode(result.values, runs, problem)
    return make_split(problem, boundaries, choices, "ilp", result.status, result.gap, time.perf_counter() - start_s)


def _best_single_choice_split(problem: StageProblem) -> StageSplit | None:
    """The best `split_dp` result over "every layer takes choice c", or None when no such split fits."""
    best = None
    for c in range(problem.num_choices):
        one_choice = problem.one_choice(c)
        if np.any(least_pressure_split(one_choice, one_choice.segment_mem_bytes()) > problem.mem_cap_bytes):
            continue
        split = split_dp(one_choice)
        if best is None or split.objective_s < best.objective_s:
            best = replace(split, choices=(c,) * problem.num_layers)
    return best


@dataclass(frozen=True)
class _Runs:
    """Maximal runs of identical consecutive layers (the same values in every per-layer array, for every choice)."""

    start: tuple[int, ...]
    length: tuple[int, ...]

    @classmethod
    def of(cls, problem: StageProblem) -> _Runs:
        rows = np.concatenate([getattr(problem, name) for name in LAYER_ARRAYS], axis=1)
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
    transient: dict  # d -> z[d]: device d's transient bytes / its capacity
    used: dict  # (r, s, c) -> y[r, s, c]: stage s holds a layer of run r with choice c (binary; where r[r, c] > 0)

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
        transient = {d: model.add_variable(lb=0.0, name=f"z[{d}]") for d in range(problem.devices)}
        used = {(r, s, c): model.add_binary_variable(name=f"y[{r},{s},{c}]")
                for (r, s, c) in count if problem.layer_work_bytes[runs.start[r], c] > 0}
        return cls(prefix, count, full, model.add_variable(lb=0.0, name="t_max"), transient, used)

    def values_of(self, split: StageSplit, runs: _Runs, time_unit_s: float, problem: StageProblem) -> dict:
        """Variable values of a known split of `problem` (the solver's first incumbent)."""
        devices = problem.devices
        device_time_s = np.bincount(np.arange(len(split.stage_time_s)) % devices, weights=split.stage_time_s)
        values = {self.t_max: float(device_time_s.max()) / time_unit_s}
        stage_of = np.repeat(np.arange(len(split.stage_time_s)), np.diff(split.boundaries))
        for (r, s), var in self.prefix.items():
            values[var] = float(np.clip(split.boundaries[s + 1] - runs.start[r], 0, runs.length[r]))
        for (r, s), var in self.full.items():
            values[var] = float(values[self.prefix[r, s]] == runs.length[r])
        for (r, s, c), var in self.count.items():
            layers = slice(runs.start[r], runs.start[r] + runs.length[r])
            values[var] = float(np.sum((stage_of[layers] == s) & (np.asarray(split.choices)[layers] == c)))
        for key, var in self.used.items():
            values[var] = float(values[self.count[key]] > 0)
        rows, device_of = np.arange(len(split.choices)), stage_of % devices
        transient = np.bincount(device_of, problem.layer_transient_bytes[rows, split.choices], devices)
        work = np.zeros(devices)
        np.maximum.at(work, device_of, problem.layer_work_bytes[rows, split.choices])
        caps = np.bincount(np.arange(problem.num_stages) % devices, problem.mem_cap_bytes, devices)
        for d, var in self.transient.items():
            values[var] = float(max(transient[d], work[d]) / caps[d])
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
    """memory[d]: device memory / cap <= 1 (normalised so every row has coefficients of order 1)."""
    for d in range(problem.devices):
        stages = range(d, problem.num_stages, problem.devices)
        cap = sum(problem.mem_cap_bytes[s] for s in stages)
        terms = [
            (problem.layer_static_bytes[start, c] + problem.in_flight[s] * problem.layer_act_bytes[start, c]) / cap
            * variables.count[r, s, c]
            for s in stages
            for r, start in enumerate(runs.start)
            for c in range(problem.num_choices)
        ]
        overhead = sum(problem.stage_overhead_bytes[s] for s in stages)
        transient = variables.transient[d]
        model.add_linear_constraint(mathopt.fast_sum(terms) + transient <= (cap - overhead) / cap, name=f"memory[{d}]")
        summed = [problem.layer_transient_bytes[start, c] / cap * variables.count[r, s, c]
                  for s in stages for r, start in enumerate(runs.start) for c in range(problem.num_choices)]
        model.add_linear_constraint(transient >= mathopt.fast_sum(summed), name=f"transient[{d}]")
        for (r, s, c), used in variables.used.items():
            if s % problem.devices == d:
                model.add_linear_constraint(variables.count[r, s, c] <= runs.length[r] * used, name=f"used[{r},{s},{c}]")
                model.add_linear_constraint(transient >= problem.layer_work_bytes[runs.start[r], c] / cap * used,
                                            name=f"work[{r},{s},{c}]")


def _add_stage_time_constraints(model, variables: _RunVariables, runs: _Runs, problem: StageProblem, time_unit_s: float) -> list:
    """Returns the stage times T_s / time_unit_s and adds t_max[d]: t_max >= each device's sum of them."""
    stage_time = []
    for s in range(problem.num_stages):
        scale = 1.0 / (problem.stage_speed[s] * time_unit_s)
        stage_time.append(mathopt.fast_sum(
            problem.layer_time_s[start, c] * scale * variables.count[r, s, c]
            for r, start in enumerate(runs.start)
            for c in range(problem.num_choices)
        ))
    for d in range(problem.devices):
        model.add_linear_constraint(variables.t_max >= mathopt.fast_sum(stage_time[d::problem.devices]), name=f"t_max[{d}]")
    return stage_time
