"""Hardware as data: devices, links, nodes and clusters (heterogeneous node groups allowed).

Profiles live in `profiles/devices/*.yaml`, `profiles/links/*.yaml` and `profiles/clusters/*.yaml`;
every number there carries its source (schema: `profiles/README.md`); `costmodel.profile_loader`
loads and validates them into these types. Bandwidths are per device and per direction, in bytes/s.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path


class Dtype(StrEnum):
    """Numeric formats a device profile may give a dense peak for."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"


class LinkKind(StrEnum):
    """Physical kind of a link tier."""

    NVSWITCH = "nvswitch"
    NVLINK_RING = "nvlink-ring"      # NVLink without a switch (e.g. the DGX-1 hybrid cube-mesh)
    PCIE = "pcie"
    INFINITY_FABRIC = "infinity-fabric"
    LOOPBACK = "loopback"            # processes on one host talking through shared memory
    IB = "ib"
    ROCE = "roce"
    EFA = "efa"
    SLINGSHOT = "slingshot"
    ETHERNET = "ethernet"
    OMNIPATH = "omnipath"            # Intel Omni-Path Architecture


INTRA_NODE_KINDS = frozenset({LinkKind.NVSWITCH, LinkKind.NVLINK_RING, LinkKind.PCIE,
                              LinkKind.INFINITY_FABRIC, LinkKind.LOOPBACK})
INTER_NODE_KINDS = frozenset({LinkKind.IB, LinkKind.ROCE, LinkKind.EFA, LinkKind.SLINGSHOT,
                              LinkKind.ETHERNET, LinkKind.OMNIPATH})


@dataclass(frozen=True)
class LinkTier:
    """One level of the interconnect, as seen by one device.

    Attributes:
        name: e.g. "nvlink4-nvswitch", "ib-ndr400".
        kind: a LinkKind ("nvswitch", "nvlink-ring", "pcie", "infinity-fabric", "loopback", "ib",
            "roce", "efa", "slingshot", "ethernet", "omnipath").
        bw_bytes_per_s: unidirectional bandwidth available to one device on this tier.
        latency_s: per-message latency (alpha of the alpha-beta model).
        efficiency: fraction of bw_bytes_per_s that collectives reach (bus bandwidth / link bandwidth).
        source: where the numbers come from.
        collective_factors: (collective, factor) pairs: the collective's measured time over what the
            ring formulas give on this link (`paraplan profile` measures them: gloo's all-gather and
            reduce-scatter run several times slower than its all-reduce implies). Absent: 1.
        peer_bw_bytes_per_s: for links that join every pair of devices directly rather than through a
            switch (MI300X's Infinity Fabric), the bandwidth between one pair; None through a switch.
        nvls_efficiency: for switches that reduce in the switch (NVLink SHARP, NCCL's NVLS all-reduce
            on Hopper and later NVSwitch nodes), the fraction of the ring's bandwidth
            (bw_bytes_per_s x efficiency) a device drives under NVLS; 0 where the switch cannot.
        nvls_latency_s: the per-call latency of an NVLS all-reduce (with nvls_efficiency).
    """

    name: str
    kind: str
    bw_bytes_per_s: float
    latency_s: float
    efficiency: float = 1.0
    source: str = ""
    collective_factors: tuple[tuple[str, float], ...] = ()
    peer_bw_bytes_per_s: float | None = None
    nvls_efficiency: float = 0.0
    nvls_latency_s: float = 0.0

    def group_bytes_per_s(self, ranks: int) -> float:
        """Bandwidth one device drives in a group of `ranks` devices on this link: all of it through a
        switch; over pair links only those to the group's other ranks, which rings over every pair
        (NCCL's and RCCL's channels) use at once: min(bw, (ranks - 1) x peer bw)."""
        if self.peer_bw_bytes_per_s is None:
            return self.bw_bytes_per_s
        return min(self.bw_bytes_per_s, max(1, ranks - 1) * self.peer_bw_bytes_per_s)

    def time_factor(self, collective: str) -> float:
        """How much longer `collective` takes on this link than its ring formula says (1 if unmeasured)."""
        return dict(self.collective_factors).get(collective, 1.0)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator.

    Attributes:
        peak_flops_per_s: dense peak per dtype ("fp32", "tf32", "bf16", "fp16", "fp8"); only the
            dtypes the device computes natively (a V100 has no "bf16"). Treat as read-only.
        mem_bytes: device memory capacity as the framework sees it (torch's total_memory).
        mem_bw_bytes_per_s: device memory bandwidth.
        matmul_efficiency: [(op_flops, fraction of peak)] points, ascending in op_flops; the
            achievable fraction of peak of a GEMM of that many FLOPs (interpolated in log space).
        devices_per_node, intra_link, nic: the usual node this device ships in.
        host_mem_bytes: host (CPU) memory of that usual node, shared by its devices (0 when unknown).
        node_spans_hosts: the usual node is an NVLink domain across several hosts (GB200 NVL72: 18
            trays of 4 GPUs), so smaller nodes of this device share one (`load_cluster`'s shorthand).
        price_per_hour: on-demand price per device-hour in USD (0 when unknown).
        power_w: board power (0 when unknown).
        description: human-readable product name.
        flash2_attention_ratio: (forward, backward) fraction of the device's flash-attention rates
            that FlashAttention-2's kernels reach: 1 where they are the device's flash kernels
            (Ampere), below 1 where newer kernels use instructions they do not (Hopper's wgmma).
        comm_overlaps_compute: collectives run beside compute (GPUs: copy engines or a few SMs on
            their own stream); False where the same cores do both (CPU ranks under gloo), so no
            communication hides behind compute.
        op_tables: dtype -> path of a measured op-time table (`paraplan profile` writes them; JSON
            of `costmodel.op_table.OpTable.to_dict`); the cost model uses it instead of the roofline
            where it has a measurement.
    """

    name: str
    peak_flops_per_s: dict[str, float] = field(hash=False)
    mem_bytes: float
    mem_bw_bytes_per_s: float
    devices_per_node: int
    intra_link: LinkTier
    nic: LinkTier
    matmul_efficiency: tuple[tuple[float, float], ...] = ()
    mem_bw_efficiency: float = 1.0
    matmul_sustained_fraction: float = 1.0
    flash2_attention_ratio: tuple[float, float] = (1.0, 1.0)
    comm_overlaps_compute: bool = True
    price_per_hour: float = 0.0
    power_w: float = 0.0
    host_mem_bytes: float = 0.0
    node_spans_hosts: bool = False
    source: dict = field(default_factory=dict, compare=False, hash=False)
    description: str = field(default="", compare=False)
    op_tables: dict[str, str] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class NodeSpec:
    """A node: `devices_per_node` devices joined by `intra_link`, each with a NIC share `nic`, and
    `host_mem_bytes` of host memory shared by the devices (0 when unknown)."""

    device: DeviceSpec
    devices_per_node: int
    intra_link: LinkTier
    nic: LinkTier
    host_mem_bytes: float = 0.0

    @property
    def host_mem_bytes_per_device(self) -> float:
        """Each device's share of the node's host memory (0 when unknown)."""
        return self.host_mem_bytes / self.devices_per_node

    def __hash__(self) -> int:
        # Computed once: the planner's price caches are keyed by the node a stage sits on.
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.device, self.devices_per_node, self.intra_link, self.nic, self.host_mem_bytes))

    def __getstate__(self) -> dict:
        # A string's hash differs between processes: a pickled node computes its own again.
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}


@dataclass(frozen=True)
class NodeGroup:
    node: NodeSpec
    count: int


@dataclass(frozen=True)
class Cluster:
    """Node groups joined by an inter-node fabric with an oversubscription ratio (1.0 = full bisection).

    Global ranks fill the groups in order, each node in turn.
    """

    name: str
    groups: tuple[NodeGroup, ...]
    oversubscription: float = 1.0
    description: str = field(default="", compare=False)
    source: dict = field(default_factory=dict, compare=False, hash=False)

    @functools.cached_property
    def num_devices(self) -> int:
        return sum(g.count * g.node.devices_per_node for g in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(g.count for g in self.groups)

    @functools.cached_property
    def fingerprint(self) -> str:
        """12 hex digits that change with any priced field of the hardware (groups, devices, links,
        oversubscription) and with the measured op tables its devices name, not with names,
        descriptions, sources or fields added to the schema at their defaults (a sweep's rows record it)."""
        tables = sorted({_file_digest(path) for g in self.groups for path in g.node.device.op_tables.values()})
        return hashlib.sha256(repr((_priced_fields(self.groups), self.oversubscription, tables)).encode()).hexdigest()[:12]

    @property
    def homogeneous(self) -> bool:
        return len({g.node for g in self.groups}) == 1

    @property
    def min_device_mem_bytes(self) -> float:
        return min(g.node.device.mem_bytes for g in self.groups)

    def nodes(self) -> tuple[NodeSpec, ...]:
        """The NodeSpec of every node, in node-index order."""
        return tuple(g.node for g in self.groups for _ in range(g.count))

    def devices(self) -> tuple[DeviceSpec, ...]:
        """The DeviceSpec of every global rank, in rank order."""
        return tuple(node.device for node in self.nodes() for _ in range(node.devices_per_node))


def _priced_fields(value):
    """`value` as nested tuples of its dataclasses' compared fields (those that change a price) that
    differ from their defaults."""
    if dataclasses.is_dataclass(value):
        return tuple((f.name, _priced_fields(getattr(value, f.name))) for f in dataclasses.fields(value)
                     if f.compare and getattr(value, f.name) != f.default)
    if isinstance(value, (tuple, list)):
        return tuple(_priced_fields(item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((str(key), _priced_fields(item)) for key, item in value.items()))
    return value


def _file_digest(path: str) -> str:
    """SHA-256 of a file's bytes ("missing" when it cannot be read)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "missing"
