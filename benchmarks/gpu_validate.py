"""Predicted vs measured step time and peak memory of a 1.3B GPT on one GPU, with and without recompute.

    python benchmarks/gpu_validate.py             # one H100/H200: profile + 2 runs, under 10 minutes
    python benchmarks/gpu_validate.py --dry-run   # the same flow on the CPU with a tiny GPT (seconds)

1. Profiles the device (`costmodel.profile`: training GEMMs per dtype, memory bandwidth, attention),
   writing a one-device cluster whose op tables the cost model then uses.
2. For recompute none and full: the plan for that configuration on the profiled cluster (`planner.plan`
   for none; the evaluator's estimate of uniform full recompute, applied to every block, for full).
3. Applies each plan (FSDP2 mixed precision: bf16 compute, fp32 master weights and gradients, AdamW:
   the 18 bytes per parameter the cost model assumes), trains on random tokens, and measures the
   median step time after warm-up and `torch.cuda.max_memory_allocated` over the timed steps (on the
   CPU: the profiler-based peak of `benchmarks/fidelity.py`), against the predicted peak without the
   CUDA context, allocator fragmentation and the gradient blocks reserved for FSDP2's reduce stream,
   which `max_memory_allocated` does not count.

On a GPU the table is also written to `benchmarks/results/gpu-validate-<device>.txt`.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import planner  # noqa: E402
from benchmarks.fidelity import peak_step_bytes, predicted_allocated_bytes, train_step  # noqa: E402
from costmodel.profile import run_profile  # noqa: E402
from planner.apply import mixed_precision_policy  # noqa: E402
from planner.models import resolve_model  # noqa: E402

# The run: GPT-3 XL (1.3B, Brown et al. 2020) at its published context, 2 micro-batches of 4.
MODEL = "gpt3-1.3b"
SEQ_LEN = 2048
MICRO_BATCH = 4
GLOBAL_BATCH = 8
STEPS = 10
WARMUP_STEPS = 3
# The dry run: the same flow at CPU scale.
DRY_RUN_SPEC = "arch: gpt\nlayers: 2\nhidden: 128\nheads: 4\nvocab: 512\nmax_seq_len: 64\ntie_embeddings: false\n"
DRY_RUN_SEQ_LEN = 64
DRY_RUN_MICRO_BATCH = 2
DRY_RUN_GLOBAL_BATCH = 4
DRY_RUN_STEPS = 2
DRY_RUN_WARMUP_STEPS = 1
DTYPE = "bf16"
LEARNING_RATE = 1e-4
SEED = 0
RESULTS_DIR = ROOT / "benchmarks" / "results"


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    seq_len: int
    micro_batch: int
    global_batch: int
    steps: int
    warmup_steps: int


def make_plans(run: Run, cluster: str) -> dict:
    """{recompute policy: Plan} for one device, no recompute and full recompute of every block."""
    base = planner.plan(run.model, cluster, global_batch=run.global_batch, seq_len=run.seq_len, dtype=DTYPE,
                        tp=1, pp=1, dp=1, micro_batch=run.micro_batch, recompute="none")
    full = planner.evaluate(run.model, cluster, {"tp": 1, "pp": 1, "micro_batch": run.micro_batch, "recompute": "full"},
                            global_batch=run.global_batch, seq_len=run.seq_len, dtype=DTYPE)
    blocks = [name for name in base.layer_names if "." in name]
    recompute_all = {**base.memory_plan, "recompute": {"none": [n for n in base.layer_names if n not in blocks], "full": blocks}}
    return {"none": base, "full": dataclasses.replace(base, config=full.config, estimate=full, memory_plan=recompute_all)}


def measure(plan, run: Run) -> tuple[float, float]:
    """(median step seconds, peak allocated bytes) of training under `plan` in this process."""
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    torch.manual_seed(SEED)
    source = resolve_model(run.model)
    with torch.device(device):
        model = source.build(seq_len=run.seq_len)
    applied = plan.apply(model, device=device, mp_policy=mixed_precision_policy(plan.dtype))
    # Fused AdamW on the GPU (as torchtitan and Megatron run it): the single pass the cost model prices.
    optimizer = torch.optim.AdamW(list(applied.parameters()), lr=LEARNING_RATE, fused=gpu)
    tokens = torch.randint(0, source.dims.vocab, (run.global_batch, run.seq_len), device=device)
    times_s = []
    for step in range(run.warmup_steps + run.steps):
        if step == run.warmup_steps and gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        train_step(applied, optimizer, tokens)
        if gpu:
            torch.cuda.synchronize()
        if step >= run.warmup_steps:
            times_s.append(time.perf_counter() - start)
    peak_bytes = torch.cuda.max_memory_allocated() if gpu else peak_step_bytes(applied, optimizer, tokens)
    dist.destroy_process_group()
    del applied, optimizer, model
    if gpu:
        torch.cuda.empty_cache()
    return statistics.median(times_s), float(peak_bytes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, quick profile")
    parser.add_argument("--like", help="device profile for the unmeasured fields (default: h100-sxm on GPUs)")
    parser.add_argument("--out", help="write the table here (default on a GPU: benchmarks/results/gpu-validate-<device>.txt)")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.stderr.write("gpu_validate.py: no GPU; use --dry-run to check the flow on the CPU\n")
        return 2
    lines = []

    def report(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        if args.dry_run:
            torch.set_num_threads(1)
            spec = Path(scratch) / "dry-run-gpt.yaml"
            spec.write_text(DRY_RUN_SPEC)
            run = Run(str(spec), DRY_RUN_SEQ_LEN, DRY_RUN_MICRO_BATCH, DRY_RUN_GLOBAL_BATCH, DRY_RUN_STEPS,
                      DRY_RUN_WARMUP_STEPS)
        else:
            run = Run(MODEL, SEQ_LEN, MICRO_BATCH, GLOBAL_BATCH, STEPS, WARMUP_STEPS)
        cluster = Path(scratch) / "this-device.yaml"
        started = time.perf_counter()
        run_profile(cluster, like=args.like, quick=args.dry_run, show_progress=sys.stderr.isatty())
        device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        report(f"{device_name}: profiled in {time.perf_counter() - started:.0f} s; {run.model}, seq {run.seq_len}, "
               f"micro-batch {run.micro_batch} x {run.global_batch // run.micro_batch}, {DTYPE}")
        report("recompute  pred step s  meas step s   error   pred GiB   meas GiB   error")
        for policy, plan in make_plans(run, str(cluster)).items():
            step_s, peak_bytes = measure(plan, run)
            predicted_bytes = predicted_allocated_bytes(plan)
            report(f"{policy:<9} {plan.estimate.step_time_s:11.4f} {step_s:12.4f} {plan.estimate.step_time_s / step_s - 1:+7.1%}"
                   f" {predicted_bytes / 2**30:10.3f} {peak_bytes / 2**30:10.3f} {predicted_bytes / peak_bytes - 1:+7.1%}")
    out = args.out or (RESULTS_DIR / f"gpu-validate-{device_name.lower().replace(' ', '-')}.txt"
                       if torch.cuda.is_available() else None)
    if out:
        Path(out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
