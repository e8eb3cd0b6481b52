"""Expert parallelism on the data-parallel axis (GShard, Lepikhin et al. 2021).

The `dp` ranks split into groups of `ep` consecutive ranks. Each rank of a group keeps `experts / ep`
of every MoE layer's experts (their `GroupedLinear` weights become DTensors sharded on dim 0 over the
`ep` mesh axis) and exchanges its routed tokens with the group by all-to-all: its capacity slots of
each expert go to that expert's owner, which runs them together with the slots every other rank of
the group routed there, and the outputs come back the same way. The `dp / ep` ranks that hold the
same experts (the `edp` axis) reduce the experts' gradients. An expert's gradient already sums what
the tokens of its whole ep group contributed, so that reduction divides by the whole dp, as the
dense gradients' reduction does: both end as the mean over the dp ranks.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from planner.config import ParallelConfig
from planner.zoo.moe import GroupedLinear

# The expert mesh: the plan's (pp, dp, cp, tp) mesh with dp split into (edp, ep), ep innermost, so
# both meshes give every rank the same coordinates.
EXPERT_MESH_AXES = ("pp", "edp", "ep", "cp", "tp")


def expert_mesh(device_type: str, config: ParallelConfig) -> DeviceMesh:
    """The mesh whose `ep` axis shards the experts and whose `edp` axis reduces their gradients."""
    shape = (config.pp, config.dp // config.ep, config.ep, config.cp, config.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_AXES)


def expert_modules(module: nn.Module) -> list[nn.Module]:
    """The modules inside `module` whose children are `GroupedLinear` expert projections."""
    return [m for m in module.modules() if any(isinstance(child, GroupedLinear) for child in m.children())]


def apply_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Shards the experts inside `module` over `ep_mesh` and routes their tokens by all-to-all.

    Returns:
        The expert modules, for the caller to reduce their gradients over the `edp` axis.
    """
    experts = expert_modules(module)
    for expert in experts:
        for projection in expert.children():
            projection.weight = nn.Parameter(distribute_tensor(projection.weight.detach(), ep_mesh, [Shard(0)]))
        expert.register_forward_pre_hook(functools.partial(_dispatch, ep_mesh))
        expert.register_forward_hook(functools.partial(_combine, ep_mesh))
    return experts


def _dispatch(mesh: DeviceMesh, module: nn.Module, args: tuple) -> tuple:
    """(experts, capacity, hidden) slots of this rank -> this rank's experts' slots from the whole group."""
    slots = args[0]
    experts, capacity, hidden = slots.shape
    ep = mesh.size()
    received = all_to_all_single_autograd(slots.reshape(experts * capacity, hidden).contiguous(), None, None,
                                          mesh.get_group())
    local = received.view(ep, experts // ep, capacity, hidden).transpose(0, 1).reshape(experts // ep, ep * capacity, hidden)
    return (DTensor.from_local(local, mesh, [Shard(0)], run_check=False), *args[1:])


def _combine(mesh: DeviceMesh, module: nn.Module, args: tuple, output: DTensor) -> torch.Tensor:
    """The local experts' outputs -> each source rank's (experts, capacity, hidden) slots, sent back."""
    out = output.to_local()
    local_experts, slots, hidden = out.shape
    ep = mesh.size()
    capacity = slots // ep
    back = out.view(local_experts, ep, capacity, hidden).transpose(0, 1).reshape(ep * local_experts * capacity, hidden)
    returned = all_to_all_single_autograd(back.contiguous(), None, None, mesh.get_group())
    return returned.view(ep * local_experts, capacity, hidden)
