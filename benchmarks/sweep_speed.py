"""Sweep speed: points per second with 1 and 2 local workers, and the whole example sweep's time.

    python benchmarks/sweep_speed.py            # a 24-point sample, with 1 and with 2 workers
    python benchmarks/sweep_speed.py --full     # all 144 points of examples/sweep.yaml, with 1 and with 2 workers

The sample takes every k-th point of the sweep, so it spans its models, devices and sizes. Every
graph is traced before the timed runs, so they time planning. CPU seconds per point (this process
and its workers, worker start-up included) show what idle cores would do: a loaded machine gives
each worker less than a core, which is why the load average is printed first.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.sweeps.runner import sweep  # noqa: E402
from planner.sweeps.spec import SweepSpec, load_sweep_spec  # noqa: E402
from planner.tracing import trace  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sweep.yaml"


def cpu_s() -> float:
    """User + system CPU seconds of this process and of its reaped children (the workers)."""
    return sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for field in ("ru_utime", "ru_stime"))


def timed_sweep(spec: SweepSpec, workers: int) -> tuple[float, float, float, int]:
    """(points/s of planning, wall s including tracing, CPU s per point, points) of one fresh run."""
    with tempfile.TemporaryDirectory() as folder:
        before = cpu_s()
        summary = sweep(spec, Path(folder) / "results.csv", workers=workers)
        return summary.points_per_s, summary.elapsed_s, (cpu_s() - before) / summary.planned, summary.planned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", default=str(EXAMPLE), help="sweep file (default: examples/sweep.yaml)")
    parser.add_argument("--points", type=int, default=24, help="sample size for the 1- and 2-worker runs")
    parser.add_argument("--full", action="store_true", help="run every point of the sweep, not a sample")
    args = parser.parse_args()
    spec = load_sweep_spec(args.sweep)
    stride = max(1, len(spec.points) // args.points)
    sample = dataclasses.replace(spec, points=spec.points[::stride][: args.points])
    print(f"{len(spec.points)} points in {args.sweep}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    for model, seq_len in dict.fromkeys((point.model, point.seq_len) for point in spec.points):
        trace(model, seq_len=seq_len)  # cached from here on: the runs below time planning
    points = spec if args.full else sample
    for workers in (1, 2):
        rate, wall_s, per_point_s, count = timed_sweep(points, workers)
        print(f"{workers} worker{'s' if workers > 1 else ' '}: {rate:5.2f} points/s over {count} points, {wall_s:.1f} s wall; "
              f"{per_point_s:.2f} CPU s per point (on {workers} idle core{'s' if workers > 1 else ''}: "
              f"about {per_point_s * count / workers:.0f} s)")

if __name__ == "__main__":
    main()
