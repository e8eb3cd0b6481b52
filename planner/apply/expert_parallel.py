"""Expert parallelism on the data-parallel axes (GShard, Lepikhin et al. 2021), composed with tensor parallelism.

The `dp x cp` ranks (flattened, cp innermost, as Megatron-Core takes its expert groups) split into groups
of `ep` consecutive ranks, the groups the cost model prices (`planner.mesh`): with context parallelism a
group spans a sequence's chunks before it spans replicas. Each rank of a group keeps `experts / ep`
of every MoE layer's experts and exchanges its routed tokens with the group by all-to-all: its
capacity slots of each expert go to that expert's owner, which runs them together with the slots
every other rank of the group routed there, and the outputs come back the same way. The experts'
`GroupedLinear` weights become DTensors on the (ep, tp) mesh: sharded on dim 0 (the experts) over
ep and, as the plan's layout says, on their output (colwise) or input (rowwise) features over tp,
like a Megatron MLP; the tokens enter replicated over tp and the outputs leave all-reduced over tp.
The `dp * cp / ep` ranks that hold the same experts (the `edp` axis) reduce the experts' gradients. An
expert's gradient already sums what the tokens of its whole ep group contributed, so that reduction
divides by the whole dp x cp, as the dense gradients' reduction does: both end as the mean over dp x cp.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from planner.config import ParallelConfig
from planner.errors import invalid
from planner.tp_strategies import Placement
from planner.zoo.moe import GroupedLinear

# The expert mesh: the plan's (pp, dp, cp, tp) mesh with dp x cp flattened and split into (edp, ep),
# ep innermost, so both meshes give every rank the same pp and tp coordinates.
EXPERT_MESH_AXES = ("pp", "edp", "ep", "tp")


def expert_mesh(device_type: str, config: ParallelConfig) -> DeviceMesh:
    """The mesh whose `ep` axis shards the experts and whose `edp` axis reduces their gradients."""
    shape = (config.pp, config.dp * config.cp // config.ep, config.ep, config.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_AXES)


# How the tensor-parallel axis splits an expert projection's weight (experts, in, out) per placement.
_TP_WEIGHT_PLACEMENTS = {Placement.COLWISE: Shard(2), Placement.ROWWISE: Shard(1), Placement.REPLICATE: Replicate()}
# Tokens on the (ep, tp) mesh: this rank's experts' slots, replicated over tp.
_TOKENS = (Shard(0), Replicate())


def apply_expert_parallel(module: nn.Module, mesh: DeviceMesh, layouts: dict[str, str]) -> list[nn.Module]:
    """Shards the experts inside `module` over the (ep, tp) `mesh` and routes their tokens by all-to-all.

    Args:
        module: the model or one pipeline chunk (model FQNs kept).
        mesh: the expert mesh's ("ep", "tp") sub-mesh.
        layouts: the plan's placement per module FQN (absent: replicated over tp).

    Returns:
        The expert modules, for the caller to reduce their gradients over the `edp` axis.
    """
    experts = []
    for fqn, expert in module.named_modules():
        projections = {name: child for name, child in expert.named_children() if isinstance(child, GroupedLinear)}
        if not projections:
            continue
        for name, projection in projections.items():
            tp_placement = _TP_WEIGHT_PLACEMENTS.get(Placement(layouts.get(f"{fqn}.{name}", Placement.REPLICATE)))
            if tp_placement is None:
                raise invalid(f"layout {fqn}.{name}: {layouts[f'{fqn}.{name}']!r} cannot split an expert; re-plan")
            weight = distribute_tensor(projection.weight.detach(), mesh, [Shard(0), tp_placement])
            projection.weight = nn.Parameter(weight)
        expert.register_forward_pre_hook(functools.partial(_dispatch, mesh))
        expert.register_forward_hook(functools.partial(_combine, mesh))
        experts.append(expert)
    return experts


def _dispatch(mesh: DeviceMesh, module: nn.Module, args: tuple) -> tuple:
    """(experts, capacity, hidden) slots of this rank -> this rank's experts' slots from the whole group."""
    slots = args[0]
    experts, capacity, hidden = slots.shape
    ep = mesh.size(0)
    received = all_to_all_single_autograd(slots.reshape(experts * capacity, hidden).contiguous(), None, None,
                                          mesh.get_group("ep"))
    local = received.view(ep, experts // ep, capacity, hidden).transpose(0, 1)
    local = local.reshape(experts // ep, ep * capacity, hidden)
    return (DTensor.from_local(local, mesh, _TOKENS, run_check=False), *args[1:])


def _combine(mesh: DeviceMesh, module: nn.Module, args: tuple, output: DTensor) -> torch.Tensor:
    """The local experts' outputs -> each source rank's (experts, capacity, hidden) slots, sent back."""
    out = output.redistribute(mesh, _TOKENS).to_local()
    local_experts, slots, hidden = out.shape
    ep = mesh.size(0)
    capacity = slots // ep
    back = out.view(local_experts, ep, capacity, hidden).transpose(0, 1).reshape(-1, hidden)
    returned = all_to_all_single_autograd(back.contiguous(), None, None, mesh.get_group("ep"))
    return returned.view(ep * local_experts, capacity, hidden)
