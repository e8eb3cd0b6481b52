"""Pipeline stages from the plan's layer ranges, and the schedule the plan chose.

Stage `s` of the plan (pipeline rank `s`) holds `vpp` chunks: with the interleaved schedule,
chunk `c` of the model runs on rank `c % pp`, so the rank's units split into `vpp` contiguous runs,
chunk `c` being pipeline stage `c` of `pp * vpp`. Each chunk is a `StageModule` that keeps the
model's FQNs (`layers.3.attn.q_proj.weight` stays that name) and runs its units in order; the
loss module, which needs the targets, becomes the schedule's `loss_fn`.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from planner.config import MULTI_STAGE_SCHEDULES, Schedule, check_zero_bubble_sharding, pipeline_rounds, torch_runs_rounds
from planner.errors import invalid, unsupported
from planner.result import Plan, contiguous_runs

# The schedule class of each plan schedule. torch's zero-bubble schedule for one or more stages per
# rank is ZB1P (Qi et al. 2024), the schedule the cost model prices as "zb".
SCHEDULE_CLASSES = {
    Schedule.GPIPE: ScheduleGPipe,
    Schedule.ONE_F_ONE_B: Schedule1F1B,
    Schedule.INTERLEAVED: ScheduleInterleaved1F1B,
    Schedule.ZERO_BUBBLE: ScheduleInterleavedZeroBubble,
}


class StageModule(nn.Module):
    """Some units of a model, run in order, under the model's own FQNs.

    Args:
        model: the full model.
        units: unit FQNs of this chunk in forward order ("embed", "layers.0", ...).
    """

    def __init__(self, model: nn.Module, units: tuple[str, ...]):
        super().__init__()
        self.units = units
        for unit in units:
            parent, _, name = unit.rpartition(".")
            if parent:
                if parent not in self._modules:
                    self.add_module(parent, nn.ModuleDict())
                self.get_submodule(parent)[name] = model.get_submodule(unit)
            else:
                self.add_module(name, model.get_submodule(unit))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = self.get_submodule(unit)(x)
        return x


class _UnitTracer(torch.fx.Tracer):
    """Traces a model's own forward with its units (and their insides) as leaves."""

    def __init__(self, units: tuple[str, ...]):
        super().__init__()
        self.units = units

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.units or super().is_leaf_module(m, module_qualified_name)


def check_runs_in_order(model: nn.Module, units: tuple[str, ...]) -> None:
    """Raises PlannerError unless `model`'s forward passes its input to the first of `units` and each
    unit's output to the next alone, as the stage modules run them (`StageModule`): a residual add,
    a scale or an extra argument between units would be lost, training another model. After the
    last unit only reshapes, casts and a loss module may follow: the schedule's `loss_fn` computes
    the loss from the last unit's output, so anything else there (a logit cap, a z-loss, shifted
    targets, a head written as a function of the embedding's weight) would be lost too."""
    try:
        graph = _UnitTracer(units).trace(model)
    except Exception as error:  # noqa: BLE001 - any tracing failure: the forward cannot be checked
        raise unsupported(f"pipeline stages run the model's units in order, and torch.fx cannot trace its forward to check "
                          f"that it does no more ({type(error).__name__}); plan with --pp 1 to apply it") from None
    calls = [node for node in graph.nodes if node.op == "call_module" and node.target in units]
    first = next((node for node in graph.nodes if node.op == "placeholder"), None)
    previous = first
    for expected, node in zip(units, calls + [None] * len(units)):
        if node is None or node.target != expected or node.args != (previous,) or node.kwargs or (
                previous is not first and len(previous.users) != 1):
            raise unsupported(f"pipeline stages run the model's units in order, each on the previous one's output alone, and "
                              f"its forward does more around {expected} (a residual, a scale or another argument); move "
                              f"that into the units or plan with --pp 1 to apply it")
        previous = node
    tail = _descendants(previous)
    extra = next((node for node in tail if not _reshapes_or_loss(model, node)), None)
    if extra is not None:
        raise unsupported(f"pipeline stages compute the loss from {units[-1]}'s output, and the model's forward does more "
                          f"after it ({extra.op} {getattr(extra.target, '__name__', extra.target)}); move that into "
                          f"{units[-1]} or plan with --pp 1 to apply it")


# What may follow the last unit: reshapes and casts of its output, then the loss module.
_TAIL_METHODS = frozenset({"flatten", "view", "reshape", "float", "to", "contiguous", "type"})


def _descendants(node: torch.fx.Node) -> list[torch.fx.Node]:
    found, todo = {}, list(node.users)
    while todo:
        user = todo.pop()
        if user not in found:
            found[user] = None
            todo.extend(user.users)
    return list(found)


def _reshapes_or_loss(model: nn.Module, node: torch.fx.Node) -> bool:
    if node.op == "output" or (node.op == "call_method" and node.target in _TAIL_METHODS):
        return True
    if node.op == "call_function" and node.target is torch.flatten:
        return True
    return node.op == "call_module" and isinstance(model.get_submodule(node.target), nn.modules.loss._Loss)


def chunk_units(plan: Plan, units: tuple[str, ...], pp_rank: int) -> list[tuple[int, tuple[str, ...]]]:
    """(global stage index, unit FQNs) of each chunk pipeline rank `pp_rank` runs, in order.

    Raises:
        PlannerError: the plan's stage does not split into `vpp` contiguous runs of units.
    """
    order = {unit: i for i, unit in enumerate(units)}
    positions = [order[f] for f in plan.stages[pp_rank].fqns if f in order]
    runs = [units[first:last + 1] for first, last in contiguous_runs(positions)]
    vpp, pp = plan.config.vpp, plan.config.pp
    if len(runs) != vpp:
        raise invalid(f"plan stage {pp_rank}: its layers form {len(runs)} contiguous runs, vpp={vpp} expected; re-plan")
    return [(pp_rank + k * pp, tuple(run)) for k, run in enumerate(runs)]


def check_schedule(plan: Plan) -> None:
    """Raises PlannerError when torch's schedule cannot run the plan's micro-batch count or ZeRO stage."""
    config = plan.config
    check_zero_bubble_sharding(config)
    if config.pp == 1 or config.schedule not in MULTI_STAGE_SCHEDULES or torch_runs_rounds(config.num_microbatches, config.pp):
        return
    raise invalid(f"num_microbatches={config.num_microbatches}: schedule {config.schedule} splits them into m // pp = "
                  f"{pipeline_rounds(config.num_microbatches, config.pp)} equal rounds, so needs a multiple of it; "
                  "re-plan with another --micro-batch")


def build_schedule(chunks: list[tuple[int, nn.Module]], plan: Plan, pp_mesh: DeviceMesh, device: torch.device,
                   loss_fn: Callable):
    """PipelineStages of this rank's chunks and the plan's schedule over them.

    Args:
        chunks: (global stage index, chunk module) of this rank.
        plan: the plan (schedule, pp, vpp, micro-batch count).
        pp_mesh: the pipeline mesh axis.
        device: where the chunks run.
        loss_fn: (last stage output, target) -> loss of one micro-batch.

    Returns:
        (stages, schedule). The schedule averages gradients over micro-batches.
    """
    config = plan.config
    num_stages = config.pp * config.vpp
    group = pp_mesh.get_group()
    stages = [PipelineStage(module, index, num_stages, device, group=group) for index, module in chunks]
    schedule_class = SCHEDULE_CLASSES[config.schedule]
    if config.schedule is Schedule.ONE_F_ONE_B and config.num_microbatches < num_stages:
        # torch's Schedule1F1B needs a micro-batch per stage. With fewer, 1F1B's warm-up already holds
        # every micro-batch on the first stage, which then runs as under GPipe (all forwards, then all
        # backwards); later stages differ only in order.
        schedule_class = ScheduleGPipe
    target = stages if config.schedule in MULTI_STAGE_SCHEDULES else stages[0]
    return stages, schedule_class(target, n_microbatches=config.num_microbatches, loss_fn=loss_fn)
