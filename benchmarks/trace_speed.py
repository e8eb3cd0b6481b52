"""Wall time and peak resident memory of tracing large built-in models.

Each model is traced in a fresh Python process, so the peak RSS is that model's alone and the
process time includes what `paraplan inspect` pays on start-up (importing torch and the zoo).
The goal on a 2-core machine: llama3-405b at seq 8192 in under 15 s and under 2 GB RSS. The
trace method of each is printed too.

Run from the repository root:

    .venv/bin/python benchmarks/trace_speed.py
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

# (model, sequence length) pairs, micro-batch 1. The last is captured by neither fx nor export
# (`benchmarks/routed_moe.py`): the module-level run, on real weights in bf16.
CASES = (("llama3-405b", 8192), ("gpt3-175b", 2048), ("mixtral-8x22b", 4096),
         ("benchmarks.routed_moe:routed_moe_lm", 2048))
REPO_ROOT = Path(__file__).resolve().parent.parent
# ru_maxrss is reported in KiB on Linux.
RU_MAXRSS_BYTES = 1024


def measure_one(model: str, seq_len: int) -> dict:
    """Traces one model in this process; returns its timings and peak RSS."""
    start = time.perf_counter()
    from planner.tracing import trace
    imported = time.perf_counter()
    graph = trace(model, seq_len=seq_len)
    done = time.perf_counter()
    return {
        "model": model,
        "seq_len": seq_len,
        "trace_method": graph.trace_method,
        "layers": len(graph.layers),
        "params": graph.params,
        "import_s": imported - start,
        "trace_s": done - imported,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RU_MAXRSS_BYTES,
    }


def main() -> None:
    if len(sys.argv) == 3:
        print(json.dumps(measure_one(sys.argv[1], int(sys.argv[2]))))
        return
    print(f"{'model':<36}{'seq':>6}{'method':>8}{'layers':>8}{'params':>10}{'import s':>10}{'trace s':>9}"
          f"{'process s':>11}{'peak RSS':>11}")
    for model, seq_len in CASES:
        start = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, model, str(seq_len)], cwd=REPO_ROOT,
                             check=True, capture_output=True, text=True).stdout
        process_s = time.perf_counter() - start
        row = json.loads(out)
        print(f"{model:<36}{seq_len:>6}{row['trace_method']:>8}{row['layers']:>8}{row['params'] / 1e9:>9.2f}B"
              f"{row['import_s']:>10.2f}{row['trace_s']:>9.2f}{process_s:>11.2f}"
              f"{row['peak_rss_bytes'] / 2**30:>8.2f} GiB")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    main()
