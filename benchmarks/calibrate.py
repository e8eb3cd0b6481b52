"""Refit the two global calibration constants against the published runs, and print the fit.

`DEFAULT_MATMUL_SUSTAINED_FRACTION` and `DEFAULT_MEM_BW_EFFICIENCY` (costmodel/profile_loader.py)
are the only constants fitted to published data. This script evaluates every goal row of
benchmarks/published.py for each pair on a grid (one fresh process per pair) and prints the
throughput MAPE of each goal group and their mean, each group weighing the same however many rows
it has (MosaicML MPT has 78 rows, Korthikanti 8). The DeepSpeed ZeRO-3 rows of Megatron-LM 2021
Table 2 count too: their parameter fetches are priced at a rate measured outside these rows
(`planner.state_cost.BLOCKING_FETCH_BYTES_PER_S`), and the rest of their step is compute.

Usage: python benchmarks/calibrate.py [--sustained 0.76,0.78,...] [--mem-bw 0.7,0.8,0.9] [--workers 2]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.published_rows import GOAL_GROUPS, load_rows  # noqa: E402


def _group_errors(pair: tuple[float, float]) -> dict[str, list[float]]:
    """Absolute throughput errors per goal group with the constants set to `pair` (a fresh process)."""
    from benchmarks.published import evaluate_row, throughput_error
    from costmodel import profile_loader
    from planner.errors import PlannerError

    profile_loader.DEFAULT_MATMUL_SUSTAINED_FRACTION, profile_loader.DEFAULT_MEM_BW_EFFICIENCY = pair
    rows, _ = load_rows(GOAL_GROUPS)
    errors: dict[str, list[float]] = {}
    for row in rows:
        try:
            errors.setdefault(row.group, []).append(abs(throughput_error(row, evaluate_row(row))))
        except PlannerError:
            continue
    return errors


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sustained", type=_floats, default=_floats("0.76,0.78,0.80,0.82,0.84,0.86"))
    parser.add_argument("--mem-bw", type=_floats, default=_floats("0.7,0.8,0.9"))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    pairs = list(itertools.product(args.sustained, args.mem_bw))
    print(f"{'sustained':>9s} {'mem_bw':>6s} {'balanced':>8s}  " + "  ".join(f"{g[:14]:>14s}" for g in GOAL_GROUPS))
    best = None
    with ProcessPoolExecutor(max_workers=args.workers, max_tasks_per_child=1) as pool:
        for pair, errors in zip(pairs, pool.map(_group_errors, pairs)):
            group_mape = {group: statistics.mean(values) for group, values in errors.items()}
            balanced = statistics.mean(group_mape.values())
            cells = "  ".join(f"{group_mape.get(g, float('nan')):14.1%}" for g in GOAL_GROUPS)
            print(f"{pair[0]:9.2f} {pair[1]:6.2f} {balanced:8.1%}  {cells}", flush=True)
            if best is None or balanced < best[0]:
                best = (balanced, pair)
    print(f"best: sustained {best[1][0]:.2f}, mem_bw {best[1][1]:.2f} (group-balanced MAPE {best[0]:.1%})")


if __name__ == "__main__":
    main()
