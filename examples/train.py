"""Train a few steps of a model under a paraplan plan, one process per device.

    paraplan plan --model examples/tiny-llama.yaml --cluster cpu:1x2 --global-batch 8 --seq-len 128 --tp 2 --dtype fp32 --out plan.json
    torchrun --nproc-per-node 2 examples/train.py --plan plan.json --model examples/tiny-llama.yaml --steps 5

The world size and the model are checked against the plan first, the model built on the meta
device (`check_applicable`, as `Plan.apply` checks it), so a plan for another model or world size
fails in one line before any rank holds weights. The model is then built from the plan's model
name (or --model) with the same seed on every rank, the plan is applied with `Plan.apply` (mesh,
tensor, expert and context parallelism, checkpointing, FSDP2, pipeline), and each step trains on
one global batch of random tokens of the model's vocabulary (a zoo or spec model's, else the one
the planner's trace reads). A model that returns logits over it rather than its loss trains with
the loss the planner prices after it (`planner/lm_loss.py`: fp32 cross-entropy, targets the input
tokens). Steps run in the plan's dtype: fp32 plans in plain float32, bf16/fp16 plans through
FSDP2 mixed precision (fp32 master weights and gradient reduction; fp8 plans run their GEMMs in
bf16 here, as torchao's Float8Linear is not applied). GPUs use NCCL; CPUs use gloo, one thread per
rank (plan CPU runs with `--dtype fp32` where the cores lack bf16 GEMM instructions).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from costmodel.errors import ProfileError  # noqa: E402
from costmodel.profile_files import PROFILES_DIR  # noqa: E402
from costmodel.profile_loader import load_cluster, load_device  # noqa: E402
from planner.apply import check_applicable, check_world_size, language_model_loss, mixed_precision_policy  # noqa: E402
from planner.capture_context import autocast_meta_as_cpu  # noqa: E402
from planner.errors import PlannerError, invalid  # noqa: E402
from planner.lm_loss import with_language_model_loss  # noqa: E402
from planner.models import resolve_model  # noqa: E402
from planner.result import Plan  # noqa: E402
from planner.source import ModelSource  # noqa: E402
from planner.tracing import trace  # noqa: E402

LEARNING_RATE = 3e-4
SEED = 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="plan file from `paraplan plan --out`")
    parser.add_argument("--model", help="model to build (default: the plan's model name)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be at least 1")
    try:
        return train(args.plan, args.model, args.steps)
    except PlannerError as error:
        sys.stderr.write(f"train.py: {error.message}\n")
        return 2


def train(plan_path: str, model_name: str | None, steps: int) -> int:
    plan = Plan.load(plan_path)
    check_world_size(plan)
    source = resolve_model(model_name or plan.model)
    with torch.device("meta"):  # checked against the plan before every rank builds the weights
        meta_model = source.build(seq_len=plan.seq_len)
    check_applicable(plan, meta_model)
    vocab = source.dims.vocab or trace(source, seq_len=plan.seq_len, dtype=plan.dtype).dims.vocab
    if not vocab:
        raise invalid(f"--model {model_name or plan.model}: no token vocabulary is known for it, so this example cannot "
                      f"make its batches; train it in your own loop with Plan.apply and its own data")
    loss_fn = logits_loss(source, meta_model, plan)
    gpu = torch.cuda.is_available()
    if not gpu:
        torch.set_num_threads(1)
    torch.manual_seed(SEED)
    with torch.device("cpu"):
        model = source.build(seq_len=plan.seq_len)
    applied = plan.apply(model.cuda() if gpu else model, loss_fn=loss_fn, mp_policy=mixed_precision_policy(plan.dtype))
    del model  # with pipelining, the other stages' modules are freed
    optimizer = torch.optim.AdamW(list(applied.parameters()), lr=LEARNING_RATE)
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    generator = torch.Generator().manual_seed(SEED + 1)
    rank = dist.get_rank()
    times_s = []
    for step in range(steps):
        tokens = torch.randint(0, vocab, (plan.global_batch, plan.seq_len), generator=generator).to(device)
        dist.barrier()
        start = time.perf_counter()
        loss = applied.forward_backward(applied.local_batch(tokens))
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        times_s.append(time.perf_counter() - start)
        if loss is not None:
            for axis in ("dp", "cp"):  # the step's loss: the mean over the ranks that split the batch
                group = applied.mesh[axis]
                dist.all_reduce(loss, group=group.get_group())  # gloo has no AVG
                loss /= group.size()
            if all(applied.mesh[axis].get_local_rank() == 0 for axis in ("dp", "cp", "tp")):
                print(f"step {step}: loss {loss.item():.4f} ({times_s[-1]:.3f} s)", flush=True)
    if rank == 0:
        measured = times_s[1:] or times_s  # the first step warms up (allocations, kernel selection)
        which = f"steps 2-{len(times_s)}" if len(times_s) > 1 else "step 1"
        print(f"median step time {statistics.median(measured):.3f} s ({which}); predicted {plan.estimate.step_time_s:.3f} s "
              f"on {plan.cluster}{placeholder_note(plan.cluster)}")
    dist.destroy_process_group()
    return 0


def logits_loss(source: ModelSource, meta_model: torch.nn.Module, plan: Plan):
    """Plan.apply's loss_fn for a model that returns logits over its vocabulary, the loss the
    planner adds after it (`with_language_model_loss`, on the model built on meta); None for a
    model that returns its loss."""
    inputs = source.example_inputs(plan.config.micro_batch, plan.seq_len, torch.device("meta"))
    with autocast_meta_as_cpu():
        returns_logits = with_language_model_loss(meta_model, inputs, []) is not meta_model
    return language_model_loss(torch.nn.CrossEntropyLoss()) if returns_logits else None


def placeholder_note(cluster: str) -> str:
    """A caveat for the step-time line when the plan was priced on the built-in cpu device profile,
    whose figures are placeholders; "" otherwise."""
    try:
        devices = [group.node.device for group in load_cluster(cluster).groups]
    except ProfileError:  # a cluster file of another machine
        return ""
    if load_device(PROFILES_DIR / "devices" / "cpu.yaml") not in devices:
        return ""
    return (", the built-in cpu profile's placeholder figures; `paraplan profile` measures this machine, and ranks "
            "that share cores run slower than the separate devices the plan counts")


if __name__ == "__main__":
    code = main()
    # Leave without finalising the interpreter: gloo's worker threads can still hold tensors then and
    # abort a rank whose work is done ("terminate called without an active exception",
    # pytorch/pytorch#179291), which torchrun reports as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
