"""Predicted vs published throughput for every usable row of shared/reference/published-runs.json.

Each run's own configuration is evaluated; the published metric is converted to step time with
the source's FLOP convention (benchmarks/published_rows.py). Prints per-row error and the mean
absolute percentage error (MAPE) of throughput per group and over the goal groups, and each row's
predicted peak memory over the device's capacity: every row ran, so a row over 100% is a memory
prediction proven too high.

With `--contract-flags` each row is priced with only the command-line contract's options (degrees,
micro-batch, ZeRO, recompute, dtype, cluster) as the source states them, the training code's kernels
and overlap at their defaults and a ZeRO stage or recompute the source leaves open left out (`evaluate`
chooses the ZeRO stage, `planner.open_choices`, and recomputes nothing): what a caller that knows
nothing of the row's software gets.

Usage: python benchmarks/published.py [--all-groups] [--contract-flags] [--csv out.csv]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.published_rows import GOAL_GROUPS, Row, fitting_configs, load_rows, row_policies  # noqa: E402
from planner.api import evaluate  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.models import resolve_model  # noqa: E402
from planner.result import Estimate  # noqa: E402
from planner.tracing import trace  # noqa: E402
from planner.zoo.spec import parse_spec  # noqa: E402


def evaluate_row(row: Row, contract_flags: bool = False) -> Estimate:
    """The row's own configuration priced (open choices filled by FILL_RULES); PlannerError if it cannot be.
    `contract_flags`: the training software's options (FILL_RULES attention .. sp_gather) left at their
    defaults, and the ZeRO stage and recompute the source leaves open left out, as a caller passing the
    source's own figures does (`evaluate` chooses the stage, `planner.open_choices`)."""
    source = resolve_model(parse_spec(row.spec, f"{row.id}.yaml"))
    graph = trace(source, seq_len=row.seq_len)
    software = {} if contract_flags else dict(
        attention=row.attention, tp_overlap=row.tp_overlap, loss=row.loss, zero3_fetch=row.zero3_fetch,
        dp_sync=row.dp_sync, pp_buffers=row.pp_buffers, sp_gather=row.sp_gather)
    policies = row_policies(graph, row)
    if contract_flags and policies is None:
        stated = {key: value for key, value in row.config.items() if key not in row.open_choices}
        return evaluate(graph, row.cluster_spec(), stated, global_batch=row.global_batch, dtype=row.dtype, fixes=False)
    for config in fitting_configs(row):
        est = evaluate(graph, row.cluster_spec(), config, global_batch=row.global_batch, dtype=row.dtype, fixes=False,
                       recompute_per_layer=policies, **software)
        if est.fits:
            break
    return est


def throughput_error(row: Row, est: Estimate) -> float:
    """Predicted over published throughput, minus one (positive: the model is optimistic)."""
    return row.published_step_s / est.step_time_s - 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--all-groups", action="store_true", help="also rows outside the goal groups")
    parser.add_argument("--contract-flags", action="store_true",
                        help="price with the contract's options only, the software's kernels and overlap at their defaults")
    parser.add_argument("--csv", help="write the per-row table here")
    args = parser.parse_args()
    rows, skipped = load_rows(None if args.all_groups else GOAL_GROUPS)
    errors: dict[str, list[float]] = {}
    lines = []
    print(f"{'run':58s} {'pred s':>9s} {'pub s':>9s} {'tput err':>9s} {'MFU':>6s} {'mem/cap':>7s} fits")
    over_capacity = []
    for row in rows:
        try:
            est = evaluate_row(row, args.contract_flags)
        except PlannerError as error:
            print(f"{row.id:58s} skipped: {error.message}")
            continue
        err = throughput_error(row, est)
        errors.setdefault(row.group, []).append(abs(err))
        flag = " <-- >25%" if abs(err) > 0.25 else ""
        filled = max(stage["total_bytes"] / stage["capacity_bytes"] for stage in est.memory)
        if not est.fits:
            over_capacity.append(row.id)
        print(f"{row.id:58s} {est.step_time_s:9.3f} {row.published_step_s:9.3f} {err:+9.1%} {est.mfu:6.1%} {filled:7.1%} {est.fits}{flag}")
        lines.append(f"{row.id},{row.group},{est.step_time_s},{row.published_step_s},{err},{est.mfu},{est.fits}")
    print()
    goal = []
    for group, values in errors.items():
        print(f"{group:32s} rows {len(values):3d}  MAPE {statistics.mean(values):6.1%}  max {max(values):6.1%}")
        if group in GOAL_GROUPS:
            goal += values
    if goal:
        print(f"{'goal groups':32s} rows {len(goal):3d}  MAPE {statistics.mean(goal):6.1%}  max {max(goal):6.1%}  over 25%: {sum(v > 0.25 for v in goal)}")
    print(f"rows that ran but are predicted not to fit: {len(over_capacity)}" + (f" ({', '.join(over_capacity)})" if over_capacity else ""))
    for run_id, reason in skipped:
        print(f"skipped {run_id}: {reason}")
    if args.csv:
        Path(args.csv).write_text("id,group,pred_step_s,published_step_s,throughput_error,mfu,fits\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
