"""Where the mesh lands on the topology: the device of each pipeline stage and the communication
groups of each mesh axis, as the cost model prices them.

Ranks are laid out row-major over the mesh (pp, dp, cp, tp): tp is innermost, so a tp group is a
run of consecutive ranks inside one node; cp, then dp, then pp take larger strides. Expert
parallelism shards experts over the innermost `ep` ranks of the dp x cp span (stride tp). Hybrid
sharding splits dp into (replicas, ranks per replica), replicas outer: a ZeRO shard group is the
inner dp / dp_replicate ranks times cp (stride tp), and a replica group strides over it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from math import gcd

from costmodel.comm import Collective, CommGroup, collective_time_s
from costmodel.hardware import Cluster, DeviceSpec, LinkTier, NodeSpec
from planner.config import ParallelConfig
from planner.errors import invalid

# Distinct (degrees, node size) meshes kept; a search over 16k devices touches a few hundred.
MESH_GROUPS_CACHE_SIZE = 4096


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
    pp: CommGroup
    shard: CommGroup  # the ranks one ZeRO shard of the dense states spans (dp x cp without hybrid sharding)
    replicate: CommGroup  # the replicas of one shard under hybrid sharding (size 1 without)


def mesh_groups(config: ParallelConfig, devices_per_node: int) -> MeshGroups:
    """Communication groups of every axis of `config` on nodes of `devices_per_node` devices."""
    return _mesh_groups(config.tp, config.cp, config.dp, config.ep, config.dp_replicate, devices_per_node, config.ep_folds_tp)


@functools.lru_cache(maxsize=MESH_GROUPS_CACHE_SIZE)
def _mesh_groups(tp: int, cp: int, dp: int, ep: int, replicas: int, devices_per_node: int, ep_folds_tp: bool) -> MeshGroups:
    shard = dp * cp // replicas
    return MeshGroups(
        tp=axis_group(tp, 1, devices_per_node),
        cp=axis_group(cp, tp, devices_per_node),
        dp=axis_group(dp, tp * cp, devices_per_node),
        ep=axis_group(ep, 1 if ep_folds_tp else tp, devices_per_node),  # folded over tp: consecutive ranks
        pp=axis_group(2, tp * cp * dp, devices_per_node),
        shard=axis_group(shard, tp, devices_per_node),
        replicate=axis_group(replicas, tp * shard, devices_per_node),
    )


def expert_data_group(config: ParallelConfig, node: NodeSpec) -> CommGroup:
    """The group that shares the same experts and shards their ZeRO states: dp*cp/ep ranks, ep*tp
    apart (ep folded over tp: dp*cp*tp/ep ranks, ep apart); under hybrid sharding (ep 1) a replica's
    shard group, as for the dense states."""
    split = config.ep_over_data
    return axis_group(max(1, config.dp * config.cp // (split * config.dp_replicate)), config.tp * split, node.devices_per_node)


def stage_devices(cluster: Cluster, pp: int) -> list[tuple[DeviceSpec, NodeSpec]]:
    """The device and node of each pipeline stage (pp is the outermost mesh axis). A stage spanning
    node groups of one device type runs at its slowest group (`slowest_node`): in group order or
    not, its collectives wait for the slowest link and the smallest node.

    Raises:
        PlannerError: a stage would span node groups of different device types.
    """
    per_stage = cluster.num_devices // pp
    bounds = []
    start = 0
    for group in cluster.groups:
        size = group.count * group.node.devices_per_node
        bounds.append((start, start + size, group.node))
        start += size
    out = []
    for stage in range(pp):
        first, last = stage * per_stage, (stage + 1) * per_stage - 1
        nodes = list(dict.fromkeys(node for lo, hi, node in bounds
                                   if lo <= first < hi or lo <= last < hi or (first < lo and hi <= last + 1)))
        devices = {node.device.name for node in nodes}
        if len(devices) > 1:
            raise invalid(f"pp={pp}: stage {stage} spans device types {sorted(devices)}; choose pp so each stage sits on one node group "
                          f"(for a saved plan: plan again on this cluster)")
        node = next(node for lo, hi, node in bounds if lo <= first < hi)
        node = slowest_node(nodes) if len(nodes) > 1 else node
        out.append((node.device, node))
    return out


def hops_cross_nodes(cluster: Cluster, pp: int) -> tuple[bool, ...]:
    """Whether the transfer from each pipeline stage to the next (the last stage's to the first: an
    interleaved schedule's wrap) leaves a node. Each rank of a stage sends to the rank one stage's
    width on; stages are runs of consecutive ranks, so a stage boundary inside a node can still
    have a pair of ranks on two nodes (8 stages of one device on two nodes of 4: stage 3 to 4)."""
    return _hops_cross_nodes(tuple(group.node.devices_per_node for group in cluster.groups for _ in range(group.count)), pp)


@functools.lru_cache(maxsize=MESH_GROUPS_CACHE_SIZE)
def _hops_cross_nodes(node_sizes: tuple[int, ...], pp: int) -> tuple[bool, ...]:
    node_of = [node for node, size in enumerate(node_sizes) for _ in range(size)]
    devices = len(node_of)
    per_stage = devices // pp
    return tuple(any(node_of[rank] != node_of[(rank + per_stage) % devices] for rank in range(stage * per_stage, (stage + 1) * per_stage))
                 for stage in range(pp))


def pipeline_hop_times(cluster: Cluster, config: ParallelConfig, per_device: list[tuple[DeviceSpec, NodeSpec]],
                       chunk_out_bytes: list[float]) -> tuple[float, ...]:
    """Seconds of one micro-batch's transfer from each stage's device to the next (the last
    device's: to the first, for the chunks an interleaved schedule wraps round), the slowest of its
    chunks' transfers (`chunk_out_bytes[k]`: what chunk k sends on, per rank). Over the NICs where
    a pair of the two stages' ranks sits on two nodes (`hops_cross_nodes`), at the slower end's
    links. Empty without pipelining."""
    if config.pp == 1:
        return ()
    crossing = hops_cross_nodes(cluster, config.pp)
    hops = [0.0] * config.pp
    for chunk, out_bytes in enumerate(chunk_out_bytes):
        device = chunk % config.pp
        group = CommGroup(2, 1 if crossing[device] else 2)
        ends = (per_device[device][1], per_device[(device + 1) % config.pp][1])
        hops[device] = max(hops[device], *(collective_time_s(Collective.P2P, out_bytes, group, end, cluster.oversubscription)
                                           for end in ends))
    return tuple(hops)


def slowest_node(nodes: list[NodeSpec]) -> NodeSpec:
    """One node standing for node groups of one device type that a stage spans: the fewest devices
    per node, the slowest intra-node link and NIC (lowest bandwidth reached, then highest latency)
    and the smallest host-memory share of any of them."""
    def slowest(links: list[LinkTier]) -> LinkTier:
        return min(links, key=lambda link: (link.bw_bytes_per_s * link.efficiency, -link.latency_s, link.name))

    per_node = min(node.devices_per_node for node in nodes)
    host_share = min(node.host_mem_bytes_per_device for node in nodes)
    return NodeSpec(device=nodes[0].device, devices_per_node=per_node,
                    intra_link=slowest([node.intra_link for node in nodes]), nic=slowest([node.nic for node in nodes]),
                    host_mem_bytes=host_share * per_node)


def cp_shares_shard_links(groups: MeshGroups) -> bool:
    """Whether the context-parallel exchange and the data-parallel (ZeRO) traffic run over the same
    links: both inside nodes (each device's NVLink or PCIe port) or both between nodes (its NIC)."""
    return groups.cp.size > 1 and (groups.cp.num_nodes > 1) == (groups.shard.num_nodes > 1)
