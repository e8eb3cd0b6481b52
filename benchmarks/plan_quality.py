"""Plan quality against published configurations, under paraplan's own cost model.

For each distinct (model, cluster, global batch, sequence length, attention kernel, TP overlap) among the usable
rows of shared/reference/published-runs.json (`benchmarks/published_rows.load_rows`), plan the same
job and compare predicted throughput (tokens/s) with:

- the published configuration (each row's own, priced with the memory-aware stage split). The
  ratio planner / published is >= 1 whenever the published configuration fits and lies inside the
  search space, since the search is exact; rows outside the space say why;
- Megatron's rule of thumb: tp = GPUs per node (the largest divisor of the heads up to that), the
  smallest pp that fits (at each pp trying recompute none, selective, full), dp the rest,
  micro-batch 1, ZeRO 0, 1F1B, priced with the memory-aware split;
- the published configuration with a uniform stage split (equal layer counts per stage).

Baselines that do not fit in memory have no throughput; they are counted, not ratioed.

Run from the repository root (about 40 cases; progress is printed per case):

    .venv/bin/python benchmarks/plan_quality.py [--max-cases 40] [--groups g1,g2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from itertools import zip_longest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.published_rows import Row, load_rows, row_policies, spec_key  # noqa: E402
from costmodel import load_cluster  # noqa: E402
from planner.api import make_config, plan  # noqa: E402
from planner.config import ParallelConfig, Schedule  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.estimate import Evaluator  # noqa: E402
from planner.graph import Recompute  # noqa: E402
from planner.models import resolve_model  # noqa: E402
from planner.space import configs_for, divisors, enumerate_degrees, recompute_options  # noqa: E402
from planner.stages import split_uniform  # noqa: E402
from planner.tracing import trace  # noqa: E402
from planner.training_code import TrainingCode  # noqa: E402
from planner.zoo.spec import parse_spec  # noqa: E402

DEFAULT_MAX_CASES = 40
COMPARED_FIELDS = ("dp", "tp", "pp", "cp", "vpp", "micro_batch", "zero", "recompute", "schedule")


def distinct_cases(rows: list[Row], max_cases: int) -> list[list[Row]]:
    """Rows grouped by job (model, cluster and its NIC, batch, sequence, attention, TP overlap, loss, ZeRO-3 fetch, DP sync), taken round-robin over the
    source groups (smallest cluster first within a group) so every source is represented."""
    jobs: dict[tuple, list[Row]] = defaultdict(list)
    for row in rows:
        jobs[(spec_key(row.spec), row.cluster, row.nic, row.global_batch, row.seq_len, row.attention, row.tp_overlap, row.loss,
              row.zero3_fetch, row.dp_sync)].append(row)
    by_group: dict[str, list[list[Row]]] = defaultdict(list)
    for job in jobs.values():
        by_group[job[0].group].append(job)
    for group_jobs in by_group.values():
        group_jobs.sort(key=lambda job: load_cluster(job[0].cluster_spec()).num_devices)
    ordered = [job for batch in zip_longest(*by_group.values()) for job in batch if job is not None]
    return ordered[:max_cases]


def outside_space(evaluator: Evaluator, config: ParallelConfig, global_batch: int) -> str:
    """Why `config` is not among the configurations the search enumerates ("" when it is)."""
    space = enumerate_degrees(evaluator.graph, evaluator.cluster, {})
    degrees = (config.dp, config.tp, config.pp, config.cp, config.ep)
    if degrees not in space.degrees:
        named = [r for r in space.rejected if r.what in (f"tp={config.tp}", f"pp={config.pp}", "cp>1")]
        return f"degrees {degrees} not enumerated" + (f" ({named[0].what}: {named[0].reason})" if named else "")
    if config.recompute not in recompute_options({}, evaluator.graph.recompute_policies):
        return f"recompute={config.recompute} was not measured for this model"
    if config not in set(configs_for(degrees, evaluator.graph, global_batch, {})):
        return f"micro_batch={config.micro_batch}, schedule={config.schedule}, vpp={config.vpp} not enumerated"
    return ""


def uniform_split(evaluator: Evaluator, config: ParallelConfig, global_batch: int, policies=None):
    """The estimate of `config` (with `policies` per layer when given) with equal layer counts per pipeline chunk."""
    problem = evaluator.stage_problem(config, [evaluator.policies(config, policies)])
    return evaluator.estimate(config, global_batch, boundaries=split_uniform(problem).boundaries, recompute_per_layer=policies)


def megatron_rule(evaluator: Evaluator, global_batch: int):
    """Megatron's rule of thumb (see the module docstring); None when nothing of that shape fits."""
    cluster, dims = evaluator.cluster, evaluator.graph.dims
    per_node = min(group.node.devices_per_node for group in cluster.groups)
    tp = max(d for d in divisors(per_node) if not dims.heads or dims.heads % d == 0)
    for pp in divisors(cluster.num_devices // tp):
        dp = cluster.num_devices // (tp * pp)
        if pp > len(evaluator.graph.layers) or global_batch % dp:
            continue
        for recompute in Recompute:
            config = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch=1, num_microbatches=global_batch // dp, zero=0,
                                    recompute=recompute, schedule=Schedule.ONE_F_ONE_B)
            try:
                estimate = evaluator.estimate(config, global_batch)
            except PlannerError:
                break
            if estimate.fits:
                return estimate
    return None


def differences(chosen: ParallelConfig, published: ParallelConfig) -> str:
    changed = [f"{name} {getattr(published, name)}->{getattr(chosen, name)}" for name in COMPARED_FIELDS
               if str(getattr(published, name)) != str(getattr(chosen, name))]
    return ", ".join(changed) or "same"


def run_case(job: list[Row]) -> dict:
    first = job[0]
    graph = trace(resolve_model(parse_spec(first.spec, f"{first.id}.yaml")), seq_len=first.seq_len)
    kernels = {"attention": first.attention, "tp_overlap": first.tp_overlap, "loss": first.loss,
               "zero3_fetch": first.zero3_fetch, "dp_sync": first.dp_sync, "pp_buffers": first.pp_buffers,
               "sp_gather": first.sp_gather}
    evaluator = Evaluator(graph, load_cluster(first.cluster_spec()), code=TrainingCode.of(**kernels))
    started = time.perf_counter()
    best = plan(graph, first.cluster_spec(), global_batch=first.global_batch, **kernels)
    out = {"id": first.id, "plan_s": time.perf_counter() - started, "plan": best, "rows": [],
           "megatron": megatron_rule(evaluator, first.global_batch)}
    for row in job:
        try:
            config = make_config(row.config, evaluator.cluster.num_devices, row.global_batch)
            policies = row_policies(graph, row)
            published = evaluator.estimate(config, row.global_batch, recompute_per_layer=policies)
        except PlannerError as error:
            out["rows"].append({"id": row.id, "error": error.message})
            continue
        out["rows"].append({"id": row.id, "config": config, "published": published,
                            "uniform": uniform_split(evaluator, config, row.global_batch, policies),
                            "outside": outside_space(evaluator, config, row.global_batch)})
    return out


def ratio_text(tokens_per_s: float, baseline) -> str:
    if baseline is None or not baseline.fits:
        return "   OOM"
    return f"{tokens_per_s / baseline.tokens_per_s:6.3f}"


def summary(name: str, values: list[float]) -> str:
    if not values:
        return f"{name:34s} no fitting baseline"
    return (f"{name:34s} n={len(values):3d}  min {min(values):.3f}  median {statistics.median(values):.3f}  "
            f"max {max(values):.3f}  below 1: {sum(v < 1 for v in values)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-cases", type=int, default=DEFAULT_MAX_CASES, help="distinct jobs to plan")
    parser.add_argument("--groups", help="comma-separated source groups (default: all)")
    args = parser.parse_args()
    rows, _ = load_rows(tuple(args.groups.split(",")) if args.groups else None)
    jobs = distinct_cases(rows, args.max_cases)
    ratios: dict[str, list[float]] = defaultdict(list)
    notes = []
    print(f"{len(jobs)} distinct jobs from {len(rows)} usable rows")
    print(f"{'#':>3} {'run':44s} {'plan s':>7} {'vs pub':>6} {'vs meg':>6} {'vs uni':>6}  planner choice (published -> planner)")
    for index, job in enumerate(jobs, 1):
        try:
            case = run_case(job)
        except PlannerError as error:
            print(f"{index:3d} {job[0].id[:44]:44s} skipped: {error.message}", flush=True)
            continue
        best = case["plan"]
        tokens = best.estimate.tokens_per_s
        if case["megatron"] is not None:
            ratios["planner / Megatron rule"].append(tokens / case["megatron"].tokens_per_s)
        for row in case["rows"]:
            if "error" in row:
                print(f"{index:3d} {row['id'][:44]:44s} published config invalid: {row['error']}", flush=True)
                continue
            published, uniform = row["published"], row["uniform"]
            if published.fits:
                ratio = tokens / published.tokens_per_s
                ratios["planner / published"].append(ratio)
                if not row["outside"]:
                    ratios["planner / published (in space)"].append(ratio)
                if ratio < 1:
                    notes.append(f"{row['id']}: ratio {ratio:.3f}; {row['outside'] or 'published config is in the space'}")
            if uniform.fits:
                ratios["planner / published, uniform split"].append(tokens / uniform.tokens_per_s)
            flags = [] if published.fits else [f"published OOM {published.peak_memory_bytes / 2**30:.0f} GiB"]
            flags += [f"outside space: {row['outside']}"] if row["outside"] else []
            print(f"{index:3d} {row['id'][:44]:44s} {case['plan_s']:7.1f} {ratio_text(tokens, published)} "
                  f"{ratio_text(tokens, case['megatron'])} {ratio_text(tokens, uniform)}  "
                  f"{differences(best.config, row['config'])}" + (f"  [{'; '.join(flags)}]" if flags else ""), flush=True)
    print()
    for name, values in ratios.items():
        print(summary(name, values))
    for note in notes:
        print(f"below 1: {note}")


if __name__ == "__main__":
    main()
