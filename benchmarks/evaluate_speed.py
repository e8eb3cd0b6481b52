"""Wall time of `paraplan evaluate` for large models, each run a fresh CLI process.

The time is the whole invocation a user waits for. "cold": an empty graph cache, so the process
starts torch and traces the model on meta tensors; "warm": the traced graph comes from the
on-disk cache (planner/graph_cache.py), so torch is never imported and the time is pricing the
configuration. Goal: under 3 s each.

Run from the repository root:

    .venv/bin/python benchmarks/evaluate_speed.py [--repeat N]

To see where the time goes in one case:

    .venv/bin/python -m cProfile -s cumulative cli.py evaluate --model llama3-70b \\
        --cluster h100-sxm:8x8 --global-batch 512 --seq-len 8192 --tp 8 --pp 4 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GOAL_S = 3.0

# (label, evaluate arguments): a dense model with a 8-way pipeline over 64 H100s, GPT-3 175B as in
# Megatron-LM's 1024-GPU runs (tp 8, pp 8, dp 16), and an MoE model with expert parallelism.
CASES = (
    ("llama3-70b h100-sxm:8x8 tp8 pp4",
     ["--model", "llama3-70b", "--cluster", "h100-sxm:8x8", "--global-batch", "512", "--seq-len", "8192",
      "--tp", "8", "--pp", "4"]),
    ("gpt3-175b a100-80g:128x8 tp8 pp8",
     ["--model", "gpt3-175b", "--cluster", "a100-80g:128x8", "--global-batch", "1536", "--seq-len", "2048",
      "--tp", "8", "--pp", "8"]),
    ("mixtral-8x7b h100-sxm:8x8 tp2 pp2 ep8",
     ["--model", "mixtral-8x7b", "--cluster", "h100-sxm:8x8", "--global-batch", "256", "--seq-len", "4096",
      "--tp", "2", "--pp", "2", "--ep", "8"]),
)


# What any trace pays before its first op: importing torch, and torch._dynamo, which torch imports
# lazily the first time a meta-device module runs a Python decomposition (nn.Embedding's init).
FLOOR_CODE = "import torch, torch._dynamo"


def floor_s() -> float:
    """Seconds of a process that only imports what tracing on meta tensors needs."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR_CODE], check=True)
    return time.perf_counter() - start


def run_once(args: list[str], cache_dir: str) -> tuple[float, dict]:
    """Seconds of one `python cli.py evaluate ... --json` process, and its JSON output."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "cli.py", "evaluate", *args, "--json"], cwd=REPO_ROOT,
                            capture_output=True, text=True, env={**os.environ, "PARAPLAN_CACHE_DIR": cache_dir})
    wall_s = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"paraplan evaluate {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
    return wall_s, json.loads(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per case (min and median reported)")
    repeat = parser.parse_args().repeat
    print(f"{'case':<40}{'cold s':>8}{'warm min':>10}{'warm med':>10}{'step s':>9}{'MFU':>7}  goal < {GOAL_S:.0f} s")
    floors = [floor_s() for _ in range(repeat)]
    print(f"{'floor: ' + FLOOR_CODE:<40}{min(floors):>8.2f}")
    for label, args in CASES:
        with tempfile.TemporaryDirectory() as cache_dir:
            cold_s, output = run_once(args, cache_dir)
            warm = [run_once(args, cache_dir)[0] for _ in range(repeat)]
        print(f"{label:<40}{cold_s:>8.2f}{min(warm):>10.2f}{statistics.median(warm):>10.2f}{output['step_time_s']:>9.2f}"
              f"{output['mfu']:>7.1%}  {'ok' if min(warm) < GOAL_S else 'SLOW'} (warm)")


if __name__ == "__main__":
    main()
