"""Loads hardware profiles into the `costmodel.hardware` types: devices, clusters, shorthands (links: `profile_links`).

Files are found and read by `costmodel.profile_files` and checked field by field by
`costmodel.profile_fields`. Parsed files are cached per process and parsed again after they change.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

from costmodel import profile_fields as fields
from costmodel.compute import GEMM_ONLY_DTYPES
from costmodel.errors import ProfileError
from costmodel.hardware import INTER_NODE_KINDS, INTRA_NODE_KINDS, Cluster, DeviceSpec, Dtype, NodeGroup, NodeSpec
from costmodel.profile_fields import Origin
from costmodel.profile_files import (SHORTHAND_EXAMPLE, check_kind, is_file, load_op_table, looks_like_path, profile_dirs,
                                     read_mapping, relative_to, resolve)
from costmodel.profile_links import link_field

# Time a GEMM would take at its plateau throughput when it reaches only half that throughput:
# kernel launch, prologue and the last partial wave of tiles, a few microseconds per GEMM
# (CUDA launch overhead is ~3-5 us; wave quantization: NVIDIA "Matrix Multiplication Background"
# user guide). An assumption that sets the shape of the shipped efficiency curves; replace it with
# a measured curve from `paraplan profile`.
MATMUL_HALF_EFFICIENCY_TIME_S = 5.0e-6

# Fraction of HBM peak bandwidth that bandwidth-bound training kernels (elementwise, norms,
# softmax, optimizer) sustain, used when a profile gives no measured `mem_bw_efficiency`.
# Fitted with DEFAULT_MATMUL_SUSTAINED_FRACTION by `python benchmarks/calibrate.py` (all goal groups
# of the published runs, each group weighing the same, never per row; benchmarks/results/calibrate.txt).
# Below the 85% of peak that a pure streaming kernel reaches (BabelStream triad on A100-80GB:
# about 1.7 of 2.0 TB/s): training's short kernels of a few MB do not reach streaming speed.
DEFAULT_MEM_BW_EFFICIENCY = 0.7

# Fraction of the matmul efficiency curve that GEMMs sustain inside a whole training step, used
# when a profile gives no measured `matmul_sustained_fraction`. The curves are maximum achievable
# matmul FLOP/s (MAMF: the best of a sweep of isolated GEMM shapes on an idle GPU); in training
# every GPU of a node runs at once under its power limit, so clocks drop, and a step's GEMM shapes
# sit off the best-shape optimum. Fitted with DEFAULT_MEM_BW_EFFICIENCY by benchmarks/calibrate.py
# (one value for every device and source, never per row; the objective is flat within 0.4 points
# of MAPE from 0.78 to 0.82); it puts A100 large GEMMs at 0.87 x 0.82 = 71% of peak. A profile
# measured by `paraplan profile` under load sets 1.0.
DEFAULT_MATMUL_SUSTAINED_FRACTION = 0.82
# The generated curve has points from 1 MFLOP to 100 TFLOP, two per decade.
MATMUL_CURVE_MIN_FLOPS_LOG10 = 6
MATMUL_CURVE_MAX_FLOPS_LOG10 = 14
MATMUL_CURVE_POINTS_PER_DECADE = 2
# Dtypes whose peak anchors the matmul efficiency curve, in order of preference.
MATMUL_REFERENCE_DTYPES = (Dtype.BF16, Dtype.FP16, Dtype.FP32)

_SHORTHAND = re.compile(r"(?P<device>[^:]+):(?P<nodes>[0-9]+)(?:[xX](?P<gpus>[0-9]+))?", re.ASCII)

_DEVICE_KEYS = ("name", "description", "peak_flops_per_s", "mem_bytes", "mem_bw_bytes_per_s", "matmul_efficiency",
                "mem_bw_efficiency", "matmul_sustained_fraction", "flash2_attention_ratio", "comm_overlaps_compute", "node",
                "nic", "price_per_hour", "power_w", "op_tables", "sources")
_DEVICE_REQUIRED = ("peak_flops_per_s", "mem_bytes", "mem_bw_bytes_per_s", "node", "nic")
_SAME_RATE = {"fwd": 1.0, "bwd": 1.0}  # flash2_attention_ratio where FlashAttention-2 is the device's flash kernel
_NODE_KEYS = ("devices_per_node", "intra_link", "host_mem_bytes", "spans_hosts")
_NODE_REQUIRED = ("devices_per_node", "intra_link")
# `sources` may also name the node's host memory.
_DEVICE_SOURCE_KEYS = (*_DEVICE_KEYS, "host_mem_bytes")
_CURVE_KEYS = ("plateau",)
_CLUSTER_KEYS = ("name", "description", "groups", "oversubscription", "sources")
_GROUP_KEYS = ("device", "nodes", "devices_per_node", "intra_link", "nic", "host_mem_bytes")


def load_device(name_or_path: str | Path) -> DeviceSpec:
    """Load a device profile by name or by file path.

    Args:
        name_or_path: a device name from `profile_files.list_devices()` (case-insensitive) or a `.yaml`/`.json` file.

    Returns:
        The validated DeviceSpec (cached: loading the same profile twice returns the same object).

    Raises:
        ProfileError: unknown name, missing file, or invalid profile; the message names the fix.
    """
    dirs = profile_dirs()
    path = resolve("devices", "device", name_or_path, dirs)
    return _load_device_file(str(path), path.stat().st_mtime_ns, dirs)


def load_cluster(spec: str | Path | dict | Cluster) -> Cluster:
    """Build a Cluster from any of the accepted spellings.

    Args:
        spec: a Cluster (returned unchanged); a dict in the cluster-file schema; a built-in cluster
            name; a cluster `.yaml`/`.json` path; `DEVICE:NODESxGPUS` (NODES nodes of GPUS devices,
            with the device's usual links even when GPUS differs from its usual node size; where that
            node is an NVLink domain across hosts, `DeviceSpec.node_spans_hosts`, nodes of fewer
            devices are joined into domains: the most devices, up to the usual node, that whole
            nodes fill and that divide the cluster, e.g. gb200:32x8 is 4 domains of 64); or
            `DEVICE:N` (N devices: one node when N fits in the device's usual node, otherwise
            N / devices_per_node full nodes, which must divide evenly). DEVICE may be a device
            file path.

    Returns:
        The validated Cluster. Profile files are parsed once per process, and again after they change.

    Raises:
        ProfileError: malformed shorthand, unknown name, missing file or invalid profile.

    Example::

        >>> load_cluster("h100-sxm:16x8").num_devices
        128
    """
    if isinstance(spec, Cluster):
        return spec
    dirs = profile_dirs()
    if isinstance(spec, dict):
        return _parse_cluster(Origin("cluster dict"), spec, "custom", dirs, Path.cwd())
    text = str(spec).strip()
    if not isinstance(spec, Path) and _SHORTHAND.fullmatch(text):
        return _load_shorthand(text)
    if not isinstance(spec, Path) and ":" in text and not looks_like_path(text):
        raise ProfileError(f"cluster {text!r}: expected DEVICE:NODESxGPUS, e.g. {SHORTHAND_EXAMPLE}"
                           " (or DEVICE:N for N devices)")
    path = resolve("clusters", "cluster", spec if isinstance(spec, Path) else text, dirs)
    return _load_cluster_file(str(path), path.stat().st_mtime_ns, dirs)


@functools.lru_cache(maxsize=256)
def _load_device_file(path: str, mtime_ns: int, dirs: tuple[Path, ...]) -> DeviceSpec:
    return _parse_device(Origin(path), read_mapping(Path(path)), Path(path).stem, dirs, Path(path).parent)


@functools.lru_cache(maxsize=256)
def _load_cluster_file(path: str, mtime_ns: int, dirs: tuple[Path, ...]) -> Cluster:
    return _parse_cluster(Origin(path), read_mapping(Path(path)), Path(path).stem, dirs, Path(path).parent)


def _load_shorthand(text: str) -> Cluster:
    match = _SHORTHAND.fullmatch(text)
    origin = Origin(f"cluster {text!r}")
    try:
        device = load_device(match["device"])
    except ProfileError as exc:
        raise origin.error("DEVICE", str(exc)) from None
    if match["gpus"] is not None:
        nodes, gpus = int(match["nodes"]), int(match["gpus"])
        if nodes < 1:
            raise origin.error("NODES", f"needs at least 1 node, e.g. {SHORTHAND_EXAMPLE}")
        if gpus < 1:
            raise origin.error("GPUS", f"needs at least 1 device per node, e.g. {SHORTHAND_EXAMPLE}")
        fields.node_devices(origin, "GPUS", gpus)
    else:
        total, per_node = int(match["nodes"]), device.devices_per_node
        if total < 1:
            raise origin.error("N", "needs at least 1 device")
        if total > per_node and total % per_node:
            domain = max(size for size in range(1, per_node + 1) if total % size == 0)
            joined = (f", e.g. {device.name}:{total // domain}x{domain} ({device.name} nodes of fewer devices are parts of "
                      f"NVLink domains)" if device.node_spans_hosts and domain > 1 else "")
            raise origin.error("N", f"{total} devices do not fill whole {per_node}-device {device.name} nodes;"
                               f" use a multiple of {per_node} or write NODESxGPUS explicitly{joined}")
        nodes, gpus = (1, total) if total <= per_node else (total // per_node, per_node)
    fields.cluster_devices(origin, "NODES", nodes * gpus)
    given = f"{nodes} x {gpus}"
    if device.node_spans_hosts and gpus < device.devices_per_node:
        domain = max(size for size in range(gpus, min(device.devices_per_node, nodes * gpus) + 1, gpus)
                     if nodes * gpus % size == 0)
        nodes, gpus = nodes * gpus // domain, domain
    node = NodeSpec(device, gpus, device.intra_link, device.nic, usual_host_share(device, gpus))
    joined = f" (the {given} nodes joined into NVLink domains of {gpus})" if given != f"{nodes} x {gpus}" else ""
    return Cluster(f"{device.name}:{nodes}x{gpus}", (NodeGroup(node, nodes),),
                   description=f"{nodes} x {gpus} {device.description or device.name}{joined}")


def _parse_device(origin: Origin, data: dict, default_name: str, dirs: tuple[Path, ...], base: Path) -> DeviceSpec:
    check_kind(origin, data, "device")
    if "host_mem_bytes" in data:
        raise origin.error("host_mem_bytes", "belongs to the node: write it as node.host_mem_bytes")
    fields.check_keys(origin, "", data, _DEVICE_KEYS, _DEVICE_REQUIRED)
    peaks = _peaks(origin, data["peak_flops_per_s"])
    node = data["node"]
    if not isinstance(node, dict):
        raise origin.error("node", "must be a mapping with devices_per_node and intra_link")
    fields.check_keys(origin, "node.", node, _NODE_KEYS, _NODE_REQUIRED)
    name = fields.text(origin, "name", data.get("name", default_name))
    return DeviceSpec(
        name=name,
        peak_flops_per_s=peaks,
        mem_bytes=fields.physical(origin, "mem_bytes", data["mem_bytes"], fields.MEMORY),
        mem_bw_bytes_per_s=fields.physical(origin, "mem_bw_bytes_per_s", data["mem_bw_bytes_per_s"], fields.MEMORY_BANDWIDTH),
        devices_per_node=fields.node_devices(origin, "node.devices_per_node", node["devices_per_node"]),
        intra_link=link_field(origin, "node.intra_link", node["intra_link"], dirs, base, INTRA_NODE_KINDS),
        nic=link_field(origin, "nic", data["nic"], dirs, base, INTER_NODE_KINDS),
        matmul_efficiency=_matmul_curve(origin, data["matmul_efficiency"], peaks) if "matmul_efficiency" in data else (),
        mem_bw_efficiency=fields.fraction(origin, "mem_bw_efficiency",
                                          data.get("mem_bw_efficiency", DEFAULT_MEM_BW_EFFICIENCY)),
        matmul_sustained_fraction=fields.fraction(origin, "matmul_sustained_fraction",
                                                  data.get("matmul_sustained_fraction", DEFAULT_MATMUL_SUSTAINED_FRACTION)),
        flash2_attention_ratio=fields.fractions(origin, "flash2_attention_ratio",
                                                data.get("flash2_attention_ratio", _SAME_RATE), ("fwd", "bwd")),
        comm_overlaps_compute=fields.boolean(origin, "comm_overlaps_compute", data.get("comm_overlaps_compute", True)),
        price_per_hour=fields.optional_positive(origin, "price_per_hour", data),
        power_w=fields.optional_positive(origin, "power_w", data),
        host_mem_bytes=_host_bytes(origin, "node.host_mem_bytes", node),
        node_spans_hosts=fields.boolean(origin, "node.spans_hosts", node.get("spans_hosts", False)),
        op_tables=_op_tables(origin, data.get("op_tables", {}), base, name),
        source=fields.sources(origin, "", data.get("sources", {}), _DEVICE_SOURCE_KEYS),
        description=fields.text(origin, "description", data.get("description", "")),
    )


def _parse_cluster(origin: Origin, data: dict, default_name: str, dirs: tuple[Path, ...], base: Path) -> Cluster:
    check_kind(origin, data, "cluster")
    if "host_mem_bytes" in data:
        raise origin.error("host_mem_bytes", "belongs to a node group: write it in groups[i] (host memory of one node)")
    fields.check_keys(origin, "", data, _CLUSTER_KEYS, ("groups",))
    groups = data["groups"]
    if not isinstance(groups, list) or not groups:
        raise origin.error("groups", "must be a non-empty list of {device, nodes} mappings")
    oversubscription = fields.positive(origin, "oversubscription", data.get("oversubscription", 1.0))
    if not 1.0 <= oversubscription <= fields.MAX_OVERSUBSCRIPTION:
        raise origin.error("oversubscription", f"{oversubscription!r} is {'below 1' if oversubscription < 1 else 'implausible'}"
                           f"; use 1.0 for a full-bisection fabric or N (up to {fields.MAX_OVERSUBSCRIPTION:g}) for N:1 "
                           "oversubscription")
    parsed = tuple(_parse_group(origin, f"groups[{i}]", g, dirs, base) for i, g in enumerate(groups))
    fields.cluster_devices(origin, "groups[].nodes", sum(g.count * g.node.devices_per_node for g in parsed))
    for i, group in enumerate(parsed):  # the cost model keys devices by name
        same_name = next((j for j, other in enumerate(parsed[:i]) if other.node.device.name == group.node.device.name
                          and other.node.device != group.node.device), None)
        if same_name is not None:
            raise origin.error(f"groups[{i}].device", f"a different profile than groups[{same_name}]'s is also named "
                               f"{group.node.device.name!r}; give one of them its own `name:`")
    return Cluster(
        name=fields.text(origin, "name", data.get("name", default_name)),
        groups=parsed,
        oversubscription=oversubscription,
        description=fields.text(origin, "description", data.get("description", "")),
        source=fields.sources(origin, "", data.get("sources", {}), _CLUSTER_KEYS),
    )


def _parse_group(origin: Origin, prefix: str, data, dirs: tuple[Path, ...], base: Path) -> NodeGroup:
    if not isinstance(data, dict):
        raise origin.error(prefix, "must be a mapping with device and nodes")
    fields.check_keys(origin, f"{prefix}.", data, _GROUP_KEYS, ("device", "nodes"))
    device_ref = relative_to(base, fields.text(origin, f"{prefix}.device", data["device"]))
    try:
        device = load_device(device_ref)
    except ProfileError as exc:
        raise origin.error(f"{prefix}.device", str(exc)) from None
    node = NodeSpec(
        device=device,
        devices_per_node=fields.node_devices(origin, f"{prefix}.devices_per_node",
                                             data.get("devices_per_node", device.devices_per_node)),
        intra_link=link_field(origin, f"{prefix}.intra_link", data["intra_link"], dirs, base, INTRA_NODE_KINDS)
        if "intra_link" in data else device.intra_link,
        nic=link_field(origin, f"{prefix}.nic", data["nic"], dirs, base, INTER_NODE_KINDS)
        if "nic" in data else device.nic,
        host_mem_bytes=_host_bytes(origin, f"{prefix}.host_mem_bytes", data)
        or usual_host_share(device, data.get("devices_per_node", device.devices_per_node)),
    )
    return NodeGroup(node, fields.count(origin, f"{prefix}.nodes", data["nodes"]))


def _host_bytes(origin: Origin, field_name: str, data: dict) -> float:
    """A node's `host_mem_bytes` where given (positive), else 0 (unknown)."""
    if "host_mem_bytes" not in data:
        return 0.0
    if data["host_mem_bytes"] == 0:
        raise origin.error(field_name, "0 bytes; leave the key out where the host memory is unknown")
    return fields.physical(origin, field_name, data["host_mem_bytes"], fields.MEMORY)


def usual_host_share(device: DeviceSpec, devices_per_node: int) -> float:
    """Host memory of a node of `devices_per_node` such devices, each with its share of the usual
    node's (0 when unknown)."""
    return device.host_mem_bytes * devices_per_node / device.devices_per_node


def _peaks(origin: Origin, value) -> dict[str, float]:
    if not isinstance(value, dict) or not value:
        raise origin.error("peak_flops_per_s", "must map dtypes (fp32, tf32, bf16, fp16, fp8) to dense FLOP/s")
    peaks = {fields.enum_member(origin, "peak_flops_per_s", key, Dtype).value:
             fields.physical(origin, f"peak_flops_per_s.{key}", v, fields.PEAK_FLOPS) for key, v in value.items()}
    for gemm_only, base in GEMM_ONLY_DTYPES.items():
        if gemm_only in peaks and base not in peaks:
            raise origin.error(f"peak_flops_per_s.{gemm_only}", f"given without a {base} peak, which {gemm_only} training "
                                                                f"runs every op but the GEMMs in; add peak_flops_per_s.{base}")
    return peaks


def _matmul_curve(origin: Origin, value, peaks: dict[str, float]) -> tuple[tuple[float, float], ...]:
    """Explicit [[op_flops, fraction], ...] points, or {plateau} expanded by the saturation model.

    The model: a GEMM of f FLOPs reaches plateau * f / (f + f_half) of peak, where
    f_half = plateau * peak * MATMUL_HALF_EFFICIENCY_TIME_S (peak of the first of
    MATMUL_REFERENCE_DTYPES the device has).
    """
    field_name = "matmul_efficiency"
    if isinstance(value, dict):
        fields.check_keys(origin, f"{field_name}.", value, _CURVE_KEYS, _CURVE_KEYS)
        plateau = fields.fraction(origin, f"{field_name}.plateau", value["plateau"])
        peak = next((peaks[d] for d in MATMUL_REFERENCE_DTYPES if d in peaks), max(peaks.values()))
        half_flops = plateau * peak * MATMUL_HALF_EFFICIENCY_TIME_S
        steps = range(MATMUL_CURVE_MIN_FLOPS_LOG10 * MATMUL_CURVE_POINTS_PER_DECADE,
                      MATMUL_CURVE_MAX_FLOPS_LOG10 * MATMUL_CURVE_POINTS_PER_DECADE + 1)
        flops = [10.0 ** (step / MATMUL_CURVE_POINTS_PER_DECADE) for step in steps]
        return tuple((f, plateau * f / (f + half_flops)) for f in flops)
    if not isinstance(value, (list, tuple)) or not value:
        raise origin.error(field_name, "must be a non-empty list of [op_flops, fraction] points or {plateau: F}; "
                                       "leave it out for the default curve")
    points = []
    for i, point in enumerate(value):
        if not isinstance(point, (list, tuple)) or len(point) != 2:
            raise origin.error(f"{field_name}[{i}]", f"{point!r} is not an [op_flops, fraction] pair")
        flops = fields.positive(origin, f"{field_name}[{i}][0]", point[0])
        fraction = fields.fraction(origin, f"{field_name}[{i}][1]", point[1])
        if points and flops <= points[-1][0]:
            raise origin.error(f"{field_name}[{i}]", f"op_flops {flops:g} does not exceed the previous"
                               f" point's {points[-1][0]:g}; list points in ascending op_flops")
        points.append((flops, fraction))
    return tuple(points)


def _op_tables(origin: Origin, value, base: Path, device: str) -> dict[str, str]:
    """dtype -> op-table file, each path relative to the profile's directory, required to exist and to
    hold the table of that dtype measured on `device`."""
    if not isinstance(value, dict):
        raise origin.error("op_tables", "must map dtypes to op-table files (written by `paraplan profile`)")
    tables = {}
    for dtype, ref in value.items():
        key = fields.enum_member(origin, "op_tables", dtype, Dtype).value
        path = Path(relative_to(base, fields.text(origin, f"op_tables.{dtype}", ref))).expanduser()
        if not is_file(path):
            raise origin.error(f"op_tables.{dtype}", f"file {str(path)!r} not found; re-run `paraplan profile` or remove the key")
        table = load_op_table(str(path))  # a damaged table fails here, naming its file, not while pricing
        if (table.device, table.dtype) != (device, key):
            raise origin.error(f"op_tables.{dtype}", f"{str(path)!r} holds the table of {table.device}/{table.dtype}, "
                                                     f"not {device}/{key}; name the table `paraplan profile` wrote for it")
        tables[key] = str(path)
    return tables
