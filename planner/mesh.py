"""Where each mesh axis lands on the topology, as the communication groups the cost model prices.

Ranks are laid out row-major over the mesh (pp, dp, cp, tp): tp is innermost, so a tp group is a
run of consecutive ranks inside one node; cp, then dp, then pp take larger strides. Expert
parallelism shards experts over the innermost `ep` ranks of the dp x cp span (stride tp).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from costmodel.comm import CommGroup
from planner.config import ParallelConfig


def axis_group(size: int, stride: int, devices_per_node: int) -> CommGroup:
    """The communication group of a mesh axis of `size` ranks whose members are `stride` ranks apart.

    Args:
        size: ranks in one group of this axis.
        stride: distance in global rank between neighbours of the group (product of inner axes).
        devices_per_node: devices in one node.

    Returns:
        CommGroup with how many members share a node and how many such groups share a node's NICs.
    """
    if stride >= devices_per_node:
        return CommGroup(size=size, ranks_per_node=1, concurrent_per_node=devices_per_node)
    ranks_per_node = gcd(size, devices_per_node // stride)
    return CommGroup(size=size, ranks_per_node=ranks_per_node, concurrent_per_node=stride)


@dataclass(frozen=True)
class MeshGroups:
    tp: CommGroup
    cp: CommGroup
    dp: CommGroup
    ep: CommGroup
    dp_cp: CommGroup
    pp: CommGroup


def mesh_groups(config: ParallelConfig, devices_per_node: int) -> MeshGroups:
    """Communication groups of every axis of `config` on nodes of `devices_per_node` devices."""
    tp, cp, dp = config.tp, config.cp, config.dp
    return MeshGroups(
        tp=axis_group(tp, 1, devices_per_node),
        cp=axis_group(cp, tp, devices_per_node),
        dp=axis_group(dp, tp * cp, devices_per_node),
        ep=axis_group(config.ep, tp, devices_per_node),
        dp_cp=axis_group(dp * cp, tp, devices_per_node),
        pp=axis_group(2, tp * cp * dp, devices_per_node),
    )
