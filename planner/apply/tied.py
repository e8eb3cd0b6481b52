"""Weights tied across pipeline stages (a GPT's embedding and output head), as Megatron-LM ties them.

Every pipeline rank builds the whole model, so each rank whose stage uses a tied weight holds its own
copy of it. The copies start equal (broadcast from the earliest stage that holds one), and after
every step's backward their gradients are summed over the stages that hold one: the gradient of the
shared weight is the sum over its uses, so every copy takes the same optimizer update. The group of
a copy is the pipeline ranks that hold one at the rank's own (dp, cp, tp) coordinate, where FSDP and
tensor parallelism shard the copies alike.

Within a stage, a weight tied between modules stays one parameter through tensor parallelism
(`shared_parameters` before `parallelize_module`, `retie` after it).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from planner.apply.validate import owner_unit
from planner.result import Plan


@dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of a weight tied across pipeline stages.

    Attributes:
        param: the copy, as this rank's chunk holds it (after tensor parallelism and FSDP).
        group: the pipeline ranks holding a copy at this rank's (dp, cp, tp) coordinate.
        source: global rank of the earliest stage's copy in `group`.
    """

    param: nn.Parameter
    group: dist.ProcessGroup
    source: int


def tie_across_stages(plan: Plan, mesh: DeviceMesh, shared: tuple[tuple[str, ...], ...], units: tuple[str, ...],
                      chunks: list[tuple[int, nn.Module, tuple[str, ...]]]) -> tuple[TiedCopy, ...]:
    """Groups and copies of every shared parameter whose users lie in more than one pipeline stage;
    the copies are made equal (see the module docstring). Every rank must call it (it creates groups).

    Args:
        plan: the plan (its stages name the units of each pipeline rank).
        mesh: the (pp, dp, cp, tp) mesh.
        shared: for each shared parameter, its names in the model (`validate.ModelMatch.tied_params`).
        units: the model's pipeline-cut units.
        chunks: (stage index, chunk module, unit FQNs) of this rank.
    """
    pp_rank_of = {fqn: stage.index for stage in plan.stages for fqn in stage.fqns}
    grid = mesh.mesh
    coordinate = tuple(int(i) for i in (grid == dist.get_rank()).nonzero()[0][1:])
    pp_rank = mesh["pp"].get_local_rank()
    copies = []
    for names in shared:
        holders = sorted({pp_rank_of[owner_unit(name, units)] for name in names})
        if len(holders) < 2:
            continue
        groups = {}
        for other in itertools.product(*(range(size) for size in grid.shape[1:])):
            ranks = [int(grid[(pp, *other)]) for pp in holders]
            groups[other] = (dist.new_group(ranks), ranks[0])
        if pp_rank not in holders:
            continue
        group, source = groups[coordinate]
        name = next(n for n in names if pp_rank_of[owner_unit(n, units)] == pp_rank)
        module = next(m for _, m, chunk_units in chunks if owner_unit(name, units) in chunk_units)
        copy = TiedCopy(module.get_parameter(name), group, source)
        with torch.no_grad():
            dist.broadcast(_local(copy.param), src=copy.source, group=copy.group)
        copies.append(copy)
    return tuple(copies)


def shared_parameters(module: nn.Module) -> list[list[tuple[str, str]]]:
    """(module FQN, parameter name) of each user of every parameter `module` holds under more than one
    name (tied weights, e.g. an input embedding and the output head)."""
    users: dict[int, list[tuple[str, str]]] = {}
    for fqn, child in module.named_modules():
        for name, param in child.named_parameters(recurse=False):
            users.setdefault(id(param), []).append((fqn, name))
    return [names for names in users.values() if len(names) > 1]


def retie(module: nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """Points every user of a tied parameter at the first user's again. `parallelize_module`
    distributes each module's parameters on its own, which unties them; the plan splits a tied weight
    the same way in every user (`validate`), so one DTensor serves them all."""
    for (first_fqn, first_name), *others in tied:
        param = module.get_submodule(first_fqn).get_parameter(first_name)
        for fqn, name in others:
            setattr(module.get_submodule(fqn), name, param)


def sum_tied_gradients(copies: tuple[TiedCopy, ...]) -> None:
    """Sums each copy's gradient over the stages holding a copy (after a step's backward)."""
    for copy in copies:
        grad = copy.param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor) and grad.placements != copy.param.placements:
            # A vocab-parallel embedding's weight gradient comes back replicated; every copy sums the
            # same shard, so put it in its weight's placement first.
            grad = copy.param.grad = grad.redistribute(grad.device_mesh, copy.param.placements)
        dist.all_reduce(_local(grad), group=copy.group)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
