"""Time of a collective over a node's real topology: alpha-beta over the intra-node link and the NICs.

A group of `size` ranks with `ranks_per_node` ranks on each of `size / ranks_per_node` nodes runs
hierarchically, as NCCL's multi-node algorithms do (ring inside a node, ring or tree between nodes):

- all-reduce: reduce-scatter inside the node, all-reduce of each rank's 1/ranks_per_node shard
  among the nodes (each local rank with its counterparts, all in parallel), all-gather inside.
- all-gather: all-gather among nodes of each rank's shard, then inside the node;
  reduce-scatter is the mirror image.
- all-to-all: the intra-node part and the part leaving the node run at the same time on their links.
- p2p: one message, over the intra-node link or over one NIC.

A group inside one node is the one-node case of the same formulas. Per phase over n ranks with
link bandwidth B (bytes/s, times the link's efficiency; over pair links without a switch, only the
links to the group's other ranks, `LinkTier.group_bytes_per_s`) and latency a, each phase's time multiplied
by its link's measured factor for the collective (`LinkTier.time_factor`, 1 unless profiled):

- ring all-gather / reduce-scatter of S bytes: (n-1)/n * S/B + (n-1) * a.
- ring all-reduce: 2(n-1)/n * S/B + 2(n-1) * a. Between nodes NCCL's tuner may instead pick its
  double binary tree, which moves about 2 * S/B but needs only 2 * ceil(log2 n) latency steps; we
  take the faster of the two there. Inside a node NCCL's tree is a chain, so only the ring counts,
  except on switches that reduce in the switch (NVLink SHARP on Hopper and later NVSwitch nodes:
  NCCL's NVLS, `LinkTier.nvls_efficiency`): a group of n >= 3 ranks inside one node takes the
  faster of the ring and NVLS, where each rank sends and receives (n+1)/n * S (the switch reduces
  what every rank sends and multicasts the sums): (n+1)/n * S / (B * nvls_efficiency) + the NVLS
  latency. Groups across nodes keep the ring or tree (NCCL's NVLS across nodes needs IB SHARP
  switches, which the profiles do not describe).
- all-to-all of S bytes per rank (its whole send buffer, own chunk included): one message per peer;
  (r-1)/n of S crosses the intra-node link and (n-r)/n of S leaves through the NICs.

NIC bandwidth per rank: a node has `devices_per_node` NICs of `nic.bw_bytes_per_s` each. The
`concurrent_per_node` groups that run at the same time share that aggregate equally, and each group
spreads its share over its `ranks_per_node` ranks, so one rank gets
nic.bw * devices_per_node / (concurrent_per_node * ranks_per_node). A rank reaches NICs other than
its own through the intra-node fabric (NCCL PXN), so its share is capped at the larger of one NIC
and the intra-node link. P2P uses one NIC: ranks_per_node * concurrent_per_node may not exceed
the node's devices, so every stream has a NIC of its own.
Oversubscription of the inter-node fabric divides every NIC bandwidth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from costmodel.hardware import LinkTier, NodeSpec

# NCCL builds no NVLS communicator for 2 or fewer ranks in a node (src/transport/nvls.cc:
# `gpuCount <= 2` returns before NVLS setup).
NVLS_MIN_RANKS = 3

# Distinct (collective, size, group, node) prices kept; a search prices O(10^5) collectives drawn
# from a few thousand distinct ones.
_CACHE_SIZE = 1 << 16


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    P2P = "p2p"


@dataclass(frozen=True)
class CommGroup:
    """Where the ranks of one communication group sit.

    Attributes:
        size: ranks in the group.
        ranks_per_node: how many of the group's ranks sit in one node (1..size; size when the group
            is inside one node); must divide size.
        concurrent_per_node: groups of this kind running at the same time through the same node's
            NICs (e.g. the 8 dp groups of a node when tp=8 is inside it: each gets one NIC's worth).
    """

    size: int
    ranks_per_node: int
    concurrent_per_node: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 1 <= self.ranks_per_node <= self.size or self.size % self.ranks_per_node:
            raise ValueError(f"CommGroup: ranks_per_node must divide size and lie in 1..size, "
                             f"got size={self.size}, ranks_per_node={self.ranks_per_node}")
        if self.concurrent_per_node < 1:
            raise ValueError(f"CommGroup: concurrent_per_node must be >= 1, got {self.concurrent_per_node}")

    @property
    def num_nodes(self) -> int:
        return self.size // self.ranks_per_node


@dataclass(frozen=True)
class _Path:
    """Effective bandwidth and per-message latency one rank sees on one tier."""

    bytes_per_s: float
    latency_s: float


def _ring_gather_s(n: int, size_bytes: float, path: _Path) -> float:
    """Ring all-gather or reduce-scatter of `size_bytes` (the full buffer) over n ranks."""
    return (n - 1) / n * size_bytes / path.bytes_per_s + (n - 1) * path.latency_s


def _inter_node_all_reduce_s(n: int, size_bytes: float, path: _Path) -> float:
    """All-reduce among n nodes: the faster of NCCL's ring and double binary tree."""
    if n == 1:
        return 0.0
    ring_s = 2 * _ring_gather_s(n, size_bytes, path)
    tree_s = 2 * size_bytes / path.bytes_per_s + 2 * math.ceil(math.log2(n)) * path.latency_s
    return min(ring_s, tree_s)


def _nvls_all_reduce_s(n: int, size_bytes: float, link: LinkTier) -> float:
    """All-reduce of `size_bytes` among n ranks of one node reduced in the switch (NVLS); inf where
    the link cannot or the group is too small for NCCL to build it."""
    if not link.nvls_efficiency or n < NVLS_MIN_RANKS:
        return math.inf
    bytes_per_s = link.group_bytes_per_s(n) * link.efficiency * link.nvls_efficiency
    return link.nvls_latency_s + (n + 1) / n * size_bytes / bytes_per_s


def _link_path(op: Collective, link: LinkTier, bytes_per_s: float) -> _Path:
    """`op`'s path over `link` at `bytes_per_s`, slowed by the link's measured factor for `op`."""
    factor = link.time_factor(op.value)
    return _Path(bytes_per_s / factor, link.latency_s * factor)


def _nic_path(op: Collective, group: CommGroup, intra: LinkTier, nic: LinkTier, devices_per_node: int,
              oversubscription: float) -> _Path:
    """One rank's share of its node's NICs (see the module docstring)."""
    if op is Collective.P2P:
        share_bytes_per_s = nic.bw_bytes_per_s
    else:
        node_nic_bytes_per_s = nic.bw_bytes_per_s * devices_per_node
        share_bytes_per_s = min(node_nic_bytes_per_s / (group.concurrent_per_node * group.ranks_per_node),
                                max(nic.bw_bytes_per_s, intra.bw_bytes_per_s))
    return _link_path(op, nic, share_bytes_per_s * nic.efficiency / oversubscription)


@lru_cache(maxsize=_CACHE_SIZE)
def _collective_time_s(op: Collective, size_bytes: float, group: CommGroup, intra: LinkTier, nic: LinkTier,
                       devices_per_node: int, oversubscription: float) -> float:
    """`collective_time_s` on hashable arguments (NodeSpec holds an unhashable DeviceSpec)."""
    if size_bytes < 0:
        raise ValueError(f"collective {op}: size_bytes must be >= 0, got {size_bytes}")
    if oversubscription < 1:
        raise ValueError(f"oversubscription must be >= 1 (1 = full bisection), got {oversubscription}")
    if group.ranks_per_node * group.concurrent_per_node > devices_per_node:
        raise ValueError(f"CommGroup: ranks_per_node * concurrent_per_node = "
                         f"{group.ranks_per_node * group.concurrent_per_node} exceeds the node's "
                         f"{devices_per_node} devices; lower concurrent_per_node")
    if op is Collective.P2P and group.size > 2:
        raise ValueError(f"p2p is between 2 ranks, got a group of size {group.size}")
    n, r, nodes = group.size, group.ranks_per_node, group.num_nodes
    if n == 1:
        return 0.0
    local = _link_path(op, intra, intra.group_bytes_per_s(r) * intra.efficiency)
    remote = _nic_path(op, group, intra, nic, devices_per_node, oversubscription)
    match op:
        case Collective.ALL_REDUCE if nodes == 1:
            return min(2 * _ring_gather_s(r, size_bytes, local), _nvls_all_reduce_s(r, size_bytes, intra))
        case Collective.ALL_REDUCE:
            return 2 * _ring_gather_s(r, size_bytes, local) + _inter_node_all_reduce_s(nodes, size_bytes / r, remote)
        case Collective.ALL_GATHER | Collective.REDUCE_SCATTER:
            return _ring_gather_s(r, size_bytes, local) + _ring_gather_s(nodes, size_bytes / r, remote)
        case Collective.ALL_TO_ALL:
            local_s = (r - 1) / n * size_bytes / local.bytes_per_s + (r - 1) * local.latency_s
            remote_s = (n - r) / n * size_bytes / remote.bytes_per_s + (n - r) * remote.latency_s
            return max(local_s, remote_s)
        case Collective.P2P:
            path = local if nodes == 1 else remote
            return size_bytes / path.bytes_per_s + path.latency_s


def collective_time_s(op: Collective, size_bytes: float, group: CommGroup, node: NodeSpec,
                      oversubscription: float = 1.0) -> float:
    """Time of one collective in seconds (alpha-beta over the node's topology; see the module docstring).

    Args:
        op: the collective.
        size_bytes: all-reduce: the buffer; all-gather: the full gathered output; reduce-scatter:
            the full input; all-to-all: the bytes each rank sends in total (own chunk included);
            p2p: the message.
        group: where the group's ranks sit and how many such groups share a node's NICs.
        node: the node the ranks sit in (its intra-node link, NICs and device count).
        oversubscription: inter-node fabric oversubscription (1.0 = full bisection); divides NIC bandwidth.

    Returns:
        Seconds; 0 for a group of one rank.

    Raises:
        ValueError: negative size, oversubscription below 1, a group that does not fit the node,
            or p2p over more than 2 ranks.
    """
    return _collective_time_s(op, size_bytes, group, node.intra_link, node.nic, node.devices_per_node,
                              oversubscription)
