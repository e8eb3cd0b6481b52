"""Run a mixed-integer program the one way the planner does: HiGHS through OR-Tools MathOpt.

Both solvers (`planner.stage_ilp`, `planner.sharding`) build a `mathopt.Model` and hand it here, so time
limits, gap tolerance and the mapping of solver outcomes to `SolveStatus` / `PlannerError` live in one
place. HiGHS takes float coefficients, so costs stay in seconds and bytes with no integer scaling
(TOOLCHAIN.md: HiGHS solves the 96x8 stage split in 0.06 s and 200 ops x 4 strategies in 0.3 s).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Mapping

from ortools.math_opt.python import mathopt

from planner.errors import PlannerError, PlannerErrorKind

GAP_DENOMINATOR_FLOOR = 1e-12  # keeps the relative gap finite when the objective is 0 (e.g. tp=1 layouts)


class SolveStatus(StrEnum):
    """Outcome of a solve, recorded on every solver result."""

    OPTIMAL = "optimal"          # proven optimal within the requested relative gap (exact methods: gap 0)
    TIME_LIMIT = "time_limit"    # stopped at the time limit with a feasible solution; `gap` says how far from proven
    FEASIBLE = "feasible"        # a valid answer that no solver optimised (e.g. the uniform baseline split)
    INFEASIBLE = "infeasible"    # no assignment satisfies the constraints


@dataclass(frozen=True)
class MilpResult:
    """What one MILP solve returned.

    Attributes:
        status: OPTIMAL, TIME_LIMIT or INFEASIBLE.
        objective: objective of the returned solution (inf when infeasible).
        gap: relative gap |primal - dual| / |primal| of the returned solution.
        solve_time_s: wall time of the solve call.
        values: variable -> value of the returned solution (empty when infeasible).
    """

    status: SolveStatus
    objective: float
    gap: float
    solve_time_s: float
    values: Mapping[mathopt.Variable, float] = field(default_factory=dict)


def solve_milp(
    model: mathopt.Model,
    *,
    time_limit_s: float,
    rel_gap: float,
    what: str,
    hint: Mapping[mathopt.Variable, float] | None = None,
) -> MilpResult:
    """Solve `model` with HiGHS under an explicit time limit and relative gap.

    Args:
        model: a minimisation model.
        time_limit_s: wall-clock limit for the solver.
        rel_gap: relative optimality gap at which the solver may stop and call the solution optimal.
        what: short name of the problem for error messages, e.g. "stage split".
        hint: values of a known feasible solution, the solver's first incumbent.

    Returns:
        The solution, with status OPTIMAL, TIME_LIMIT (feasible, gap > rel_gap possible) or INFEASIBLE.

    Raises:
        PlannerError: SOLVER_LIMIT when the limit passed with no feasible solution, or the solver failed.
    """
    params = mathopt.SolveParameters(
        time_limit=timedelta(seconds=time_limit_s), relative_gap_tolerance=rel_gap, absolute_gap_tolerance=0.0
    )
    hints = [] if hint is None else [mathopt.SolutionHint(variable_values=dict(hint))]
    start_s = time.perf_counter()
    with _c_stdout_silenced():
        result = mathopt.solve(
            model, mathopt.SolverType.HIGHS, params=params, model_params=mathopt.ModelSolveParameters(solution_hints=hints)
        )
    solve_time_s = time.perf_counter() - start_s
    reason = result.termination.reason
    if reason == mathopt.TerminationReason.INFEASIBLE:
        return MilpResult(SolveStatus.INFEASIBLE, float("inf"), float("inf"), solve_time_s)
    if reason not in (mathopt.TerminationReason.OPTIMAL, mathopt.TerminationReason.FEASIBLE):
        raise PlannerError(
            PlannerErrorKind.SOLVER_LIMIT,
            f"{what}: solver stopped with {reason.name.lower()} after {solve_time_s:.1f} s "
            f"({result.termination.detail or 'no detail'}); raise time_limit_s={time_limit_s}",
        )
    bounds = result.termination.objective_bounds
    objective = result.objective_value()
    gap = abs(bounds.primal_bound - bounds.dual_bound) / max(abs(bounds.primal_bound), GAP_DENOMINATOR_FLOOR)
    status = SolveStatus.OPTIMAL if reason == mathopt.TerminationReason.OPTIMAL else SolveStatus.TIME_LIMIT
    return MilpResult(status, objective, gap, solve_time_s, result.variable_values())


@contextlib.contextmanager
def _c_stdout_silenced():
    """The process's C-level stdout sent to the null device: HiGHS prints a debugging line there
    whenever it repairs a solution of its presolved problem ("HighsMipSolverData::
    transformNewIntegerFeasibleSolution tmpSolver.run();", ERGO-Code/HiGHS#2783, in the HiGHS that
    OR-Tools bundles), whatever its output options; a solve writes nothing of ours there. Where
    the process has no stdout to silence, nothing is redirected."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
