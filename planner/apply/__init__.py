"""Plan -> torch.distributed: DeviceMesh, DTensor tensor parallelism, FSDP2, checkpointing, pipelining.

`apply_plan(plan, model)` (also `plan.apply(model)`) runs inside every process of a `torchrun`
job and returns an `AppliedPlan` holding what a training loop needs. Order of application:

1. validation, before any process-group work: the world size equals the plan's device count, and
   the model has the plan's units, parameter counts per stage and the modules its layouts name
   (`validate`);
2. the DeviceMesh with axes (pp, dp, cp, tp), row-major, tp innermost as the planner laid ranks out
   (the default process group is created when missing: NCCL on GPUs, gloo on CPUs; a one-rank
   group when a one-device plan runs without torchrun);
3. pipeline split: this rank's chunks of the plan's stages (`pipeline.StageModule`, model FQNs kept);
4. tensor parallelism on the `tp` axis (`parallelize_module` with the plan's per-module layouts),
   then expert parallelism over `ep` consecutive ranks of the flattened dp x cp axes (`expert_parallel`) and
   context parallelism over the `cp` axis (`context_parallel`: each rank two chunks of every sequence);
5. activation checkpointing on the layers the memory plan names (after TP, so recomputation
   replays the TP collectives; before FSDP, so FSDP wraps the checkpointed blocks);
6. data parallelism on the `dp` axis (the flattened dp x cp axes with context parallelism; with
   hybrid sharding a (replicas, shard group) mesh) by ZeRO stage (`data_parallel`), per block then
   the root; the experts of an expert-parallel plan first,
   over the `dp * cp / ep` ranks holding the same experts;
7. weights tied across pipeline stages (a GPT's embedding and head): each holding stage keeps a
   copy, made equal at once and summed in gradient after every step (`tied`, as Megatron-LM ties them);
8. the pipeline schedule over this rank's stages with the plan's micro-batch count.

Example (one process per device, e.g. `torchrun --nproc-per-node 4 train.py`)::

    plan = planner.Plan.load("plan.json")
    applied = plan.apply(model)
    optimizer = torch.optim.AdamW(applied.parameters())
    loss = applied.forward_backward(applied.local_batch(tokens))
    optimizer.step()
"""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from planner.apply.context_parallel import apply_context_parallel, token_positions
from planner.apply.data_parallel import apply_data_parallel, data_parallel_mesh, mixed_precision_policy
from planner.apply.expert_parallel import apply_expert_parallel, expert_mesh
from planner.apply.head_counts import check_head_counts, localize_head_counts
from planner.apply.pipeline import StageModule, build_schedule, check_runs_in_order, check_schedule, chunk_units
from planner.apply.recompute import apply_recompute, check_recompute
from planner.apply.tensor_parallel import TensorParallelPlan, tensor_parallel_plan
from planner.apply.tied import TiedCopy, retie, shared_parameters, sum_tied_gradients, tie_across_stages
from planner.apply.validate import (APPLIED_MARK, ModelMatch, check_arguments, check_one_input, check_world_size,
                                   default_device, hardware_note, match_model, precision_note, world_size)
from planner.config import Schedule
from planner.errors import PlannerError, invalid, unsupported
from planner.graph import Recompute
from planner.result import Plan
from planner.training_code import TrainingCode
from planner.zoo.layers import Attention
from planner.zoo.moe import GroupedLinear

MESH_AXES = ("pp", "dp", "cp", "tp")

__all__ = ["AppliedPlan", "MESH_AXES", "apply_plan", "default_device", "language_model_loss", "mixed_precision_policy"]


@dataclass
class AppliedPlan:
    """What a training loop needs after `apply_plan`.

    Attributes:
        plan: the plan applied.
        mesh: the DeviceMesh with axes MESH_AXES.
        modules: this rank's model chunks (the model itself without pipelining).
        stages: this rank's PipelineStages (empty without pipelining).
        schedule: the pipeline schedule, or None without pipelining.
        loss_fn: (logits, targets) -> loss: the last pipeline stage's; without pipelining the user's,
            or None when the model returns its loss itself.
        recomputed: unit FQN -> recompute policy applied on this rank.
        loss_parallel: the loss is vocab-parallel: run forward and backward inside
            `torch.distributed.tensor.parallel.loss_parallel()` (forward_backward does).
        tied: this rank's copies of weights tied across pipeline stages (forward_backward sums
            their gradients over the stages holding them).
    """

    plan: Plan
    mesh: DeviceMesh
    modules: tuple[nn.Module, ...]
    stages: tuple
    schedule: object | None
    loss_fn: Callable | None
    recomputed: dict[str, Recompute]
    loss_parallel: bool = False
    tied: tuple[TiedCopy, ...] = ()

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def has_loss(self) -> bool:
        """True on ranks that compute the loss (all ranks without pipelining, the last stage with it)."""
        return self.schedule is None or any(stage.is_last for stage in self.stages)

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (local shards are DTensors under TP/FSDP), for the optimizer."""
        for module in self.modules:
            yield from module.parameters()

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a global batch: rows split evenly over dp, and with context
        parallelism its tokens of every sequence (`context_parallel.token_positions`).

        Raises:
            PlannerError: the batch is not a tensor of (sequences, tokens, ...) with the plan's
                global batch, or (with cp) its sequences are not the plan's length.
        """
        config = self.plan.config
        if not isinstance(batch, torch.Tensor) or batch.dim() < 2:
            shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
            raise invalid(f"batch of {shape}: expected a tensor of (sequences, tokens, ...)")
        if batch.shape[0] != self.plan.global_batch:
            raise invalid(f"batch of {batch.shape[0]} sequences: the plan's step takes global_batch="
                          f"{self.plan.global_batch}; give that many, or re-plan with --global-batch {batch.shape[0]}")
        if config.cp > 1 and batch.shape[1] != self.plan.seq_len:
            raise invalid(f"sequences of {batch.shape[1]} tokens: the plan splits seq_len={self.plan.seq_len} over "
                          f"cp={config.cp}; give sequences of that length or re-plan with --seq-len {batch.shape[1]}")
        rows = batch.chunk(config.dp)[self.dp_rank]
        if config.cp == 1:
            return rows
        return rows[:, token_positions(batch.shape[1], config.cp, self.mesh["cp"].get_local_rank()).to(rows.device)]

    def forward_backward(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """One step's forward and backward over `tokens` (this rank's slice) in the plan's micro-batches.

        Gradients are averaged over micro-batches, so they equal those of the mean loss of the slice.
        Under ZeRO-2/3 gradients are reduce-scattered after every micro-batch, so they stay sharded
        as the plan's memory assumes; under ZeRO-0/1 the whole gradients accumulate (as ZeRO-1 and
        Megatron's distributed optimizer keep them) and are reduced once, after the last; hybrid
        sharding all-reduces the shards across replicas once, after the last, at every stage. Below
        ZeRO-3 the gathered parameters stay from the first micro-batch to the last one's backward,
        so they are gathered (and copied out of FSDP2's buffer) once per step, as priced. Pipeline
        stages run torch's schedule instead, which reduces once, after the last micro-batch, at
        every ZeRO stage (`planner.apply.data_parallel`).

        Returns:
            The mean loss of this rank's slice where `has_loss`, else None.
        """
        config = self.plan.config
        if isinstance(tokens, torch.Tensor) and tokens.dim() and tokens.shape[0] != self.plan.global_batch // config.dp:
            raise invalid(f"tokens of {tokens.shape[0]} sequences: forward_backward takes this rank's "
                          f"{self.plan.global_batch // config.dp} of the global batch; pass applied.local_batch(batch)")
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            first = any(stage.is_first for stage in self.stages)
            args = (tokens,) if first else ()
            # return_outputs=False: the last stage would otherwise keep every micro-batch's output (the
            # logits) until the step ends, to merge them; a training step needs only the losses.
            with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
                self.schedule.step(*args, target=tokens if self.has_loss else None, losses=losses, return_outputs=False)
            sum_tied_gradients(self.tied)
            losses = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]
            return torch.stack(losses).mean().detach() if self.has_loss else None
        (model,) = self.modules
        chunks = tokens.chunk(config.num_microbatches)
        total = torch.zeros((), device=tokens.device)
        for index, chunk in enumerate(chunks):
            if isinstance(model, FSDPModule):
                last = index == len(chunks) - 1
                model.set_requires_gradient_sync(config.zero >= 2 or last)
                model.set_requires_all_reduce(last)
                model.set_reshard_after_backward(config.zero == 3 or last)
            with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
                out = model(chunk)
                if self.loss_fn is not None and isinstance(out, torch.Tensor) and not out.dim():
                    raise invalid("loss_fn: the model already returns its loss (a scalar); apply the plan without loss_fn")
                loss = self.loss_fn(out, chunk) if self.loss_fn is not None else out
                if not isinstance(loss, torch.Tensor) or loss.dim():
                    what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
                    raise invalid(f"forward_backward: the {'loss_fn' if self.loss_fn is not None else 'model'} returned {what}, "
                                  f"not a scalar loss; pass loss_fn=(outputs, tokens) -> loss to Plan.apply")
                loss = loss / len(chunks)
                loss.backward()
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()  # a partial sum is summed
        return total


def language_model_loss(loss_module: nn.Module) -> Callable:
    """The zoo's LanguageModel loss as a function of (logits, tokens): float32 cross entropy."""
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_module(logits.flatten(0, 1).float(), targets.flatten())

    return loss_fn


@contextlib.contextmanager
def _frozen_kept(module: nn.Module) -> Iterator[None]:
    """Freezes again, by name, the parameters of `module` that were frozen before the block: tensor
    and expert parallelism re-register parameters as new `nn.Parameter`s, which take gradients."""
    frozen = {name for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad}
    yield
    for name, param in module.named_parameters(remove_duplicate=False):
        if name in frozen:
            param.requires_grad_(False)


def _is_loss(model: nn.Module, unit: str) -> bool:
    """Whether a unit is the model's loss, which pipeline stages leave to the schedule's `loss_fn`."""
    module = model.get_submodule(unit)
    return module is getattr(model, "loss", None) or isinstance(module, nn.modules.loss._Loss)


def _init_process_group(device: torch.device) -> None:
    """The default process group: torchrun's (env://), or a one-rank group when run without a launcher."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "MASTER_ADDR" not in os.environ and world_size() == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)


def check_applicable(plan: Plan, model: nn.Module) -> tuple[ModelMatch, TensorParallelPlan | None]:
    """What `apply_plan` checks and derives before any process-group work, but the world size: the
    schedule, the model against the plan, and the tensor-parallel styles. Runs on a
    model built on `meta` too (`paraplan plan` checks its plans so).

    Raises:
        PlannerError: INVALID_INPUT / UNSUPPORTED_MODEL with a one-line message.
    """
    check_schedule(plan)
    check_one_input(model)
    match = match_model(plan, model)
    check_recompute(model, plan.memory_plan)
    config = plan.config
    nested = next((unit for unit in match.units if "." in unit.rpartition(".")[0]), None)
    if config.pp > 1 and nested is not None:
        raise unsupported(f"pipeline stages: block {nested} sits in a nested module, which Plan.apply does not cut "
                          f"into stages; plan with --pp 1 to apply it")
    if config.pp > 1:
        check_runs_in_order(model, tuple(unit for unit in match.units if not _is_loss(model, unit)))
        first_chunk = chunk_units(plan, match.units, 0)[0][1]
        if config.schedule == Schedule.ZERO_BUBBLE and not any(
                p.requires_grad for unit in first_chunk for p in model.get_submodule(unit).parameters()):
            raise unsupported(f"schedule=zb: the first pipeline stage ({first_chunk[0]}..{first_chunk[-1]}) is frozen whole, so "
                              f"the next stage's input takes no gradient and torch's split backward gives its weights none; "
                              f"plan with --schedule 1f1b, or with a trainable layer in the first stage")
    if config.ep_folds_tp:
        raise unsupported(f"ep={config.ep}: the expert groups fold tp={config.tp} in (Megatron-Core's parallel folding), "
                          f"which Plan.apply does not build (its expert groups lie inside dp*cp={config.dp * config.cp}); "
                          f"plan with an ep dividing {config.dp * config.cp} to apply it")
    if config.ep > 1 and not any(isinstance(module, GroupedLinear) for module in model.modules()):
        raise unsupported(f"ep={config.ep}: Plan.apply splits experts held as the zoo's GroupedLinear, and this model has "
                          f"none (every rank would keep every expert); plan with --ep 1 to apply it")
    if config.cp > 1 and not any(isinstance(module, Attention) for module in model.modules()):
        raise unsupported(f"cp={config.cp}: Plan.apply splits sequences through the zoo's Attention modules, and this "
                          f"model has none (its attention would see only this rank's tokens); plan with --cp 1 to apply it")
    tp_plan = None
    if config.tp > 1:
        check_head_counts(model, match.layouts)
        tp_plan = tensor_parallel_plan(model, list(match.units), list(match.blocks), match.layouts, config.tp,
                                       expert_parallel=config.ep > 1)
    return match, tp_plan


def apply_note(plan: Plan, model) -> str:
    """Why `apply_plan` would refuse `plan` for `model` (a name, spec file or factory reference,
    built on `meta` for the check), or "" when it would run it. The planner prices any layout and
    stage split; `Plan.apply` runs tensor parallelism on the zoo's module structure, pipelines
    top-level blocks and splits sequences through the zoo's attention (`check_applicable`)."""
    from planner.models import resolve_model

    with torch.device("meta"):
        module = resolve_model(model).build(seq_len=plan.seq_len)
    try:
        check_applicable(plan, module)
    except PlannerError as error:
        return f"Plan.apply cannot run this plan on this model: {error}"
    return ""


def apply_plan(plan: Plan, model: nn.Module, *, device: torch.device | str | None = None,
               loss_fn: Callable | None = None, mp_policy: MixedPrecisionPolicy | None = None) -> AppliedPlan:
    """Applies `plan` to `model` in this process (see the module docstring for the order).

    Args:
        plan: a plan from `planner.plan` or `Plan.load`.
        model: the model the plan was made for, built identically on every rank (same seed), on
            `device`. Modified in place (TP, checkpointing, FSDP); with pipelining only this
            rank's chunks are kept by the result, so drop other references to free the rest.
        device: where to run; default_device() when None.
        loss_fn: (logits, targets) -> loss, for a model that returns logits. By default the model's
            output is its loss, and pipelining applies the model's `loss` module to the last
            stage's output as the zoo's LanguageModel does.
        mp_policy: FSDP2 mixed precision (e.g. bf16 parameters for compute, fp32 gradient reduction,
            fp32 master weights in the optimizer); when given, the data-parallel wrapping is applied
            even at dp=1 so the policy takes effect. None keeps the model's dtype.

    Returns:
        The AppliedPlan.

    Raises:
        PlannerError: INVALID_INPUT / UNSUPPORTED_MODEL with a one-line message, before any
            process-group work, when the model or world size does not match the plan.
    """
    device = check_arguments(plan, model, device)
    config, code = plan.config, TrainingCode.of(**plan.training_code)
    if other := code.not_applied():
        runs = TrainingCode().options()
        warnings.warn(f"Plan.apply runs {', '.join(f'{name}={runs[name]}' for name in other)}: the plan was priced for "
                      f"training code with {', '.join(f'{name}={value}' for name, value in other.items())}, so this run's time and memory "
                      f"may differ from its estimate", stacklevel=3)
    for note in (hardware_note(plan, device), precision_note(plan, model, mp_policy is not None)):
        if note:
            warnings.warn(note, stacklevel=3)
    check_world_size(plan)
    match, tp_plan = check_applicable(plan, model)
    loss_module = getattr(model, "loss", None)
    if config.pp > 1 and loss_fn is None and not isinstance(loss_module, nn.modules.loss._Loss):
        raise invalid("loss_fn: the model has no `loss` module; pass loss_fn=(logits, targets) -> loss for pipelining")

    setattr(model, APPLIED_MARK, True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _init_process_group(device)
    mesh = init_device_mesh(device.type, (config.pp, config.dp, config.cp, config.tp), mesh_dim_names=MESH_AXES)
    experts_mesh = expert_mesh(device.type, config) if config.ep > 1 else None
    # Gradients are averaged over every rank that holds the same parameters: dp, and cp's chunks
    # (for experts: the dp * cp / ep ranks holding the same experts).
    dp_mesh = data_parallel_mesh(device.type, config, mesh)
    edp_mesh = experts_mesh["edp"] if experts_mesh is not None else None

    if config.pp > 1:
        chunks = []
        for index, units in chunk_units(plan, match.units, mesh["pp"].get_local_rank()):
            units = tuple(u for u in units if not _is_loss(model, u))
            chunks.append((index, StageModule(model, units), units))
    else:
        chunks = [(0, model, match.units)]
    if tp_plan is not None:
        localize_head_counts(model, match.layouts, config.tp)
    recomputed: dict[str, Recompute] = {}
    for _, module, units in chunks:
        with _frozen_kept(module):
            if tp_plan is not None:
                styles = {fqn: style for fqn, style in tp_plan.styles.items()
                          if any(fqn == u or fqn.startswith(u + ".") for u in units)}
                tied = shared_parameters(module)
                parallelize_module(module, mesh["tp"], styles)
                retie(module, tied)
            experts = (apply_expert_parallel(module, experts_mesh["ep", "tp"], match.layouts)
                       if experts_mesh is not None else [])
        if config.cp > 1:
            apply_context_parallel(module, mesh["cp"], plan.seq_len, code.cp_comm)
        recomputed.update(apply_recompute(module, plan.memory_plan, units))
        if config.dp * config.cp > 1 or mp_policy is not None or config.offload_optimizer:
            own_units = [module.get_submodule(u) for u in units if u not in match.tied]
            apply_data_parallel(module, own_units, dp_mesh, config.zero, mp_policy, config.offload_optimizer,
                                experts, edp_mesh)
    if config.pp == 1:
        return AppliedPlan(plan, mesh, (model,), (), None, loss_fn, recomputed, tp_plan is not None and tp_plan.loss_parallel)
    tied = tie_across_stages(plan, mesh, match.tied_params, match.units, chunks)
    loss_fn = loss_fn or language_model_loss(loss_module)
    stages, schedule = build_schedule([(index, module) for index, module, _ in chunks], plan, mesh["pp"], device, loss_fn)
    return AppliedPlan(plan, mesh, tuple(m for _, m, _ in chunks), tuple(stages), schedule, loss_fn, recomputed,
                       tp_plan is not None and tp_plan.loss_parallel, tied=tied)
