"""Wall time of the plan search on large clusters, with the trace time reported separately.

For each case: trace time, search time, configurations in the space (`candidates_total`) and how
many were priced before the lower bound stopped the search (`candidates_evaluated`). The goal on a
2-core machine is under 5 s of search per case. `--profile` prints the cProfile hot spots of each
search.

Run from the repository root:

    .venv/bin/python benchmarks/search_speed.py [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import planner  # noqa: E402

# (model, cluster, global batch, sequence length)
CASES = (
    ("gpt3-175b", "a100-80g:128x8", 1536, 2048),
    ("llama3-405b", "h100-sxm:2048x8", 2048, 8192),
    ("mixtral-8x22b", "h100-sxm:64x8", 1024, 4096),
    ("gpt3-13b", "hetero-a100-v100-8n", 512, 2048),
)
GOAL_S = 5.0
PROFILE_LINES = 15


def run_case(model: str, cluster: str, global_batch: int, seq_len: int, profile: bool) -> dict:
    started = time.perf_counter()
    graph = planner.trace(model, seq_len=seq_len)
    traced = time.perf_counter()
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    plan = planner.plan(graph, cluster, global_batch=global_batch)
    if profiler:
        profiler.disable()
    searched = time.perf_counter()
    out = {
        "case": f"{model} on {cluster} (gb {global_batch}, seq {seq_len})",
        "trace_s": traced - started,
        "search_s": searched - traced,
        "total": plan.search["candidates_total"],
        "evaluated": plan.search["candidates_evaluated"],
        "config": plan.config.short(),
        "mfu": plan.estimate.mfu,
    }
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(PROFILE_LINES)
        out["profile"] = text.getvalue()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="print cProfile hot spots of each search")
    args = parser.parse_args()
    print(f"{'case':<58}{'trace s':>8}{'search s':>9}{'total':>7}{'priced':>8}  plan")
    for case in CASES:
        row = run_case(*case, profile=args.profile)
        flag = "" if row["search_s"] < GOAL_S else f"  <-- over {GOAL_S:.0f} s"
        print(f"{row['case']:<58}{row['trace_s']:8.2f}{row['search_s']:9.2f}{row['total']:7d}{row['evaluated']:8d}  "
              f"{row['config']} (MFU {row['mfu']:.1%}){flag}", flush=True)
        if args.profile:
            print(row["profile"])


if __name__ == "__main__":
    main()
