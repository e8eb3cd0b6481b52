"""Hardware as data: devices, links, nodes and clusters (heterogeneous node groups allowed).

Profiles live in `profiles/devices/*.yaml`, `profiles/links/*.yaml` and `profiles/clusters/*.yaml`;
every number there carries its source (schema: `profiles/README.md`). Bandwidths are per device and
per direction, in bytes/s.
"""
from __future__ import annotations

import difflib
import functools
import json
import math
import os
import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import yaml

from costmodel.errors import ProfileError


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


INTRA_NODE_KINDS = frozenset({LinkKind.NVSWITCH, LinkKind.NVLINK_RING, LinkKind.PCIE,
                              LinkKind.INFINITY_FABRIC, LinkKind.LOOPBACK})
INTER_NODE_KINDS = frozenset({LinkKind.IB, LinkKind.ROCE, LinkKind.EFA, LinkKind.SLINGSHOT,
                              LinkKind.ETHERNET})


@dataclass(frozen=True)
class LinkTier:
    """One level of the interconnect, as seen by one device.

    Attributes:
        name: e.g. "nvlink4-nvswitch", "ib-ndr400".
        kind: a LinkKind ("nvswitch", "nvlink-ring", "pcie", "infinity-fabric", "loopback", "ib",
            "roce", "efa", "slingshot", "ethernet").
        bw_bytes_per_s: unidirectional bandwidth available to one device on this tier.
        latency_s: per-message latency (alpha of the alpha-beta model).
        efficiency: fraction of bw_bytes_per_s that collectives reach (bus bandwidth / link bandwidth).
        source: where the numbers come from.
    """

    name: str
    kind: str
    bw_bytes_per_s: float
    latency_s: float
    efficiency: float = 1.0
    source: str = ""


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
        price_per_hour: on-demand price per device-hour in USD (0 when unknown).
        power_w: board power (0 when unknown).
        description: human-readable product name.
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
    price_per_hour: float = 0.0
    power_w: float = 0.0
    source: dict = field(default_factory=dict, compare=False, hash=False)
    description: str = field(default="", compare=False)


@dataclass(frozen=True)
class NodeSpec:
    """A node: `devices_per_node` devices joined by `intra_link`, each with a NIC share `nic`."""

    device: DeviceSpec
    devices_per_node: int
    intra_link: LinkTier
    nic: LinkTier


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

    @property
    def num_devices(self) -> int:
        return sum(g.count * g.node.devices_per_node for g in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(g.count for g in self.groups)

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


# --- Loading and validation -------------------------------------------------------------------

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
PROFILES_PATH_ENV = "PARAPLAN_PROFILES_PATH"
PROFILE_SUFFIXES = (".yaml", ".yml", ".json")

# Time a GEMM would take at its plateau throughput when it reaches only half that throughput:
# kernel launch, prologue and the last partial wave of tiles, a few microseconds per GEMM
# (CUDA launch overhead is ~3-5 us; wave quantization: NVIDIA "Matrix Multiplication Background"
# user guide). An assumption that sets the shape of the shipped efficiency curves; replace it with
# a measured curve from `paraplan profile`.
MATMUL_HALF_EFFICIENCY_TIME_S = 5.0e-6

# Fraction of HBM peak bandwidth that bandwidth-bound training kernels (elementwise, norms,
# softmax, optimizer) sustain, used when a profile gives no measured `mem_bw_efficiency`.
# Fitted once to the public runs of benchmarks/published.py (all groups together, not per row);
# inside the 70-90% of peak that streaming kernels reach on HBM GPUs (e.g. BabelStream triad on
# A100-80GB: about 1.7 of 2.0 TB/s).
DEFAULT_MEM_BW_EFFICIENCY = 0.8

# Fraction of the matmul efficiency curve that GEMMs sustain inside a whole training step, used
# when a profile gives no measured `matmul_sustained_fraction`. The curves are maximum achievable
# matmul FLOP/s (MAMF: the best of a sweep of isolated GEMM shapes on an idle GPU); in training
# every GPU of a node runs at once under its power limit, so clocks drop, and a step's GEMM shapes
# sit off the best-shape optimum. Fitted once to the public runs of benchmarks/published.py (one
# value for every device and source, never per row); it puts A100 large GEMMs at
# 0.87 x 0.85 = 74% of peak. A profile measured by `paraplan profile` under load sets 1.0.
DEFAULT_MATMUL_SUSTAINED_FRACTION = 0.85
# The generated curve has points from 1 MFLOP to 100 TFLOP, two per decade.
MATMUL_CURVE_MIN_FLOPS_LOG10 = 6
MATMUL_CURVE_MAX_FLOPS_LOG10 = 14
MATMUL_CURVE_POINTS_PER_DECADE = 2
# Dtypes whose peak anchors the matmul efficiency curve, in order of preference.
MATMUL_REFERENCE_DTYPES = (Dtype.BF16, Dtype.FP16, Dtype.FP32)

SHORTHAND_EXAMPLE = "h100-sxm:16x8"
_SHORTHAND = re.compile(r"(?P<device>[^:]+):(?P<nodes>[0-9]+)(?:[xX](?P<gpus>[0-9]+))?", re.ASCII)

_LINK_KEYS = ("name", "kind", "bw_bytes_per_s", "latency_s", "efficiency", "sources")
_LINK_REQUIRED = ("kind", "bw_bytes_per_s", "latency_s")
_DEVICE_KEYS = ("name", "description", "peak_flops_per_s", "mem_bytes", "mem_bw_bytes_per_s",
                "matmul_efficiency", "mem_bw_efficiency", "matmul_sustained_fraction", "node", "nic", "price_per_hour", "power_w",
                "sources")
_DEVICE_REQUIRED = ("peak_flops_per_s", "mem_bytes", "mem_bw_bytes_per_s", "node", "nic")
_NODE_KEYS = ("devices_per_node", "intra_link")
_CURVE_KEYS = ("plateau",)
_CLUSTER_KEYS = ("name", "description", "groups", "oversubscription", "sources")
_GROUP_KEYS = ("device", "nodes", "devices_per_node", "intra_link", "nic")


@dataclass(frozen=True)
class _Origin:
    """Where a piece of profile data comes from; builds the one-line errors about it."""

    label: str

    def error(self, field_name: str, problem: str) -> ProfileError:
        return ProfileError(f"{self.label}: {field_name}: {problem}")


def profile_dirs() -> tuple[Path, ...]:
    """Profile roots searched for names, first match wins.

    Returns:
        The directories of PARAPLAN_PROFILES_PATH (os.pathsep-separated), then PROFILES_DIR. Each
        root may hold `devices/`, `links/` and `clusters/`.
    """
    extra = os.environ.get(PROFILES_PATH_ENV, "")
    return tuple(Path(p).expanduser() for p in extra.split(os.pathsep) if p) + (PROFILES_DIR,)


def list_devices() -> list[str]:
    """Names of the device profiles found in `profile_dirs()`, sorted."""
    return _list_names("devices", profile_dirs())


def list_clusters() -> list[str]:
    """Names of the cluster profiles found in `profile_dirs()`, sorted."""
    return _list_names("clusters", profile_dirs())


def load_device(name_or_path: str | Path) -> DeviceSpec:
    """Load a device profile by name or by file path.

    Args:
        name_or_path: a device name from `list_devices()` (case-insensitive) or a `.yaml`/`.json` file.

    Returns:
        The validated DeviceSpec (cached: loading the same profile twice returns the same object).

    Raises:
        ProfileError: unknown name, missing file, or invalid profile; the message names the fix.
    """
    dirs = profile_dirs()
    path = _resolve("devices", "device", name_or_path, dirs)
    return _load_device_file(str(path), path.stat().st_mtime_ns, dirs)


def load_cluster(spec: str | Path | dict | Cluster) -> Cluster:
    """Build a Cluster from any of the accepted spellings.

    Args:
        spec: a Cluster (returned unchanged); a dict in the cluster-file schema; a built-in cluster
            name; a cluster `.yaml`/`.json` path; `DEVICE:NODESxGPUS` (NODES nodes of GPUS devices,
            with the device's usual links even when GPUS differs from its usual node size); or
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
        return _parse_cluster(_Origin("cluster dict"), spec, "custom", dirs, Path.cwd())
    text = str(spec).strip()
    if not isinstance(spec, Path) and _SHORTHAND.fullmatch(text):
        return _load_shorthand(text)
    if not isinstance(spec, Path) and ":" in text and not _looks_like_path(text):
        raise ProfileError(f"cluster {text!r}: expected DEVICE:NODESxGPUS, e.g. {SHORTHAND_EXAMPLE}"
                           " (or DEVICE:N for N devices)")
    path = _resolve("clusters", "cluster", spec if isinstance(spec, Path) else text, dirs)
    return _load_cluster_file(str(path), path.stat().st_mtime_ns, dirs)


def nearest_names(name: str, candidates: list[str], limit: int = 3) -> list[str]:
    """Candidates that start with `name`, then the closest others by difflib, at most `limit`."""
    prefixed = [c for c in candidates if name and c.startswith(name)]
    similar = difflib.get_close_matches(name, candidates, n=limit, cutoff=0.5)
    return (prefixed + [c for c in similar if c not in prefixed])[:limit]


def _list_names(kind_dir: str, dirs: tuple[Path, ...]) -> list[str]:
    return sorted({p.stem for d in dirs if (d / kind_dir).is_dir()
                   for p in (d / kind_dir).iterdir() if p.suffix in PROFILE_SUFFIXES})


def _looks_like_path(text: str) -> bool:
    return text.lower().endswith(PROFILE_SUFFIXES) or "/" in text or os.sep in text


def _is_file(path: Path) -> bool:
    """Path.is_file that answers False for names the OS rejects (too long, NUL bytes)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _resolve(kind_dir: str, what: str, name_or_path: str | Path, dirs: tuple[Path, ...]) -> Path:
    """Find the file behind a profile name or path, or raise naming the nearest known names."""
    if isinstance(name_or_path, Path) or _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not _is_file(path):
            raise ProfileError(f"{what} file {str(name_or_path)!r}: not found; check the path")
        return path
    name = name_or_path.strip().lower()
    for root in dirs:
        for suffix in PROFILE_SUFFIXES:
            candidate = root / kind_dir / f"{name}{suffix}"
            if _is_file(candidate):
                return candidate
    known = _list_names(kind_dir, dirs)
    close = nearest_names(name, known)
    hint = f"did you mean {', '.join(close)}" if close else f"known: {', '.join(known)}"
    shorthand = f" (or write DEVICE:NODESxGPUS, e.g. {SHORTHAND_EXAMPLE})" if kind_dir == "clusters" else ""
    raise ProfileError(f"{what} {name_or_path!r}: unknown; {hint}{shorthand}")


def _read_mapping(path: Path) -> dict:
    """Parse a YAML or JSON file whose top level is a mapping; errors stay on one line."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read ({exc}); check the file") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "unparseable"
        raise ProfileError(f"{path}{line}: invalid YAML ({problem})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: top level must be a mapping of keys to values (see profiles/README.md)")
    return data


@functools.lru_cache(maxsize=256)
def _load_link_file(path: str, mtime_ns: int) -> LinkTier:
    return _parse_link(_Origin(path), "", _read_mapping(Path(path)), Path(path).stem, allowed=None)


@functools.lru_cache(maxsize=256)
def _load_device_file(path: str, mtime_ns: int, dirs: tuple[Path, ...]) -> DeviceSpec:
    return _parse_device(_Origin(path), _read_mapping(Path(path)), Path(path).stem, dirs, Path(path).parent)


@functools.lru_cache(maxsize=256)
def _load_cluster_file(path: str, mtime_ns: int, dirs: tuple[Path, ...]) -> Cluster:
    return _parse_cluster(_Origin(path), _read_mapping(Path(path)), Path(path).stem, dirs, Path(path).parent)


def _load_shorthand(text: str) -> Cluster:
    match = _SHORTHAND.fullmatch(text)
    origin = _Origin(f"cluster {text!r}")
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
    else:
        total, per_node = int(match["nodes"]), device.devices_per_node
        if total < 1:
            raise origin.error("N", "needs at least 1 device")
        if total > per_node and total % per_node:
            raise origin.error("N", f"{total} devices do not fill whole {per_node}-device {device.name} nodes;"
                               f" use a multiple of {per_node} or write NODESxGPUS explicitly")
        nodes, gpus = (1, total) if total <= per_node else (total // per_node, per_node)
    node = NodeSpec(device, gpus, device.intra_link, device.nic)
    return Cluster(f"{device.name}:{nodes}x{gpus}", (NodeGroup(node, nodes),),
                   description=f"{nodes} x {gpus} {device.description or device.name}")


def _relative_to(base: Path, ref: str) -> str:
    """A file reference inside a profile is relative to that profile's directory."""
    return str(base / ref) if _looks_like_path(ref) and not Path(ref).expanduser().is_absolute() else ref


def _load_link(origin: _Origin, field_name: str, value, dirs: tuple[Path, ...], base: Path, allowed) -> LinkTier:
    """A link given by profile name (`links/NAME.yaml`), by file path, or inline as a mapping."""
    if isinstance(value, dict):
        return _parse_link(origin, f"{field_name}.", value, None, allowed)
    if not isinstance(value, str):
        raise origin.error(field_name, "must be a link name from profiles/links/ or a mapping with kind,"
                           " bw_bytes_per_s and latency_s")
    try:
        path = _resolve("links", "link", _relative_to(base, value), dirs)
    except ProfileError as exc:
        raise origin.error(field_name, str(exc)) from None
    link = _load_link_file(str(path), path.stat().st_mtime_ns)
    if allowed is not None and link.kind not in allowed:
        raise origin.error(field_name, f"link {value!r} is of kind '{link.kind}', which cannot serve here;"
                           f" use one of kinds {', '.join(sorted(allowed))}")
    return link


def _parse_link(origin: _Origin, prefix: str, data: dict, default_name: str | None, allowed) -> LinkTier:
    """A LinkTier from a mapping; an inline link without a name is named after its kind."""
    _check_keys(origin, prefix, data, _LINK_KEYS, _LINK_REQUIRED)
    kind = _enum(origin, f"{prefix}kind", data["kind"], LinkKind)
    if allowed is not None and kind not in allowed:
        raise origin.error(f"{prefix}kind", f"{kind.value!r} cannot serve here; use one of"
                           f" {', '.join(sorted(allowed))}")
    sources = _sources(origin, prefix, data.get("sources", {}), _LINK_KEYS)
    return LinkTier(
        name=_text(origin, f"{prefix}name", data.get("name", default_name or kind.value)),
        kind=kind,
        bw_bytes_per_s=_positive(origin, f"{prefix}bw_bytes_per_s", data["bw_bytes_per_s"]),
        latency_s=_positive(origin, f"{prefix}latency_s", data["latency_s"]),
        efficiency=_fraction(origin, f"{prefix}efficiency", data.get("efficiency", 1.0)),
        source="; ".join(f"{key}: {text}" for key, text in sources.items()),
    )


def _parse_device(origin: _Origin, data: dict, default_name: str, dirs: tuple[Path, ...], base: Path) -> DeviceSpec:
    _check_keys(origin, "", data, _DEVICE_KEYS, _DEVICE_REQUIRED)
    peaks = _peaks(origin, data["peak_flops_per_s"])
    node = data["node"]
    if not isinstance(node, dict):
        raise origin.error("node", "must be a mapping with devices_per_node and intra_link")
    _check_keys(origin, "node.", node, _NODE_KEYS, _NODE_KEYS)
    return DeviceSpec(
        name=_text(origin, "name", data.get("name", default_name)),
        peak_flops_per_s=peaks,
        mem_bytes=_positive(origin, "mem_bytes", data["mem_bytes"]),
        mem_bw_bytes_per_s=_positive(origin, "mem_bw_bytes_per_s", data["mem_bw_bytes_per_s"]),
        devices_per_node=_count(origin, "node.devices_per_node", node["devices_per_node"]),
        intra_link=_load_link(origin, "node.intra_link", node["intra_link"], dirs, base, INTRA_NODE_KINDS),
        nic=_load_link(origin, "nic", data["nic"], dirs, base, INTER_NODE_KINDS),
        matmul_efficiency=_matmul_curve(origin, data.get("matmul_efficiency", ()), peaks),
        mem_bw_efficiency=_fraction(origin, "mem_bw_efficiency", data.get("mem_bw_efficiency", DEFAULT_MEM_BW_EFFICIENCY)),
        matmul_sustained_fraction=_fraction(origin, "matmul_sustained_fraction",
                                            data.get("matmul_sustained_fraction", DEFAULT_MATMUL_SUSTAINED_FRACTION)),
        price_per_hour=_optional_positive(origin, "price_per_hour", data),
        power_w=_optional_positive(origin, "power_w", data),
        source=_sources(origin, "", data.get("sources", {}), _DEVICE_KEYS),
        description=_text(origin, "description", data.get("description", "")),
    )


def _parse_cluster(origin: _Origin, data: dict, default_name: str, dirs: tuple[Path, ...], base: Path) -> Cluster:
    _check_keys(origin, "", data, _CLUSTER_KEYS, ("groups",))
    groups = data["groups"]
    if not isinstance(groups, list) or not groups:
        raise origin.error("groups", "must be a non-empty list of {device, nodes} mappings")
    oversubscription = _positive(origin, "oversubscription", data.get("oversubscription", 1.0))
    if oversubscription < 1.0:
        raise origin.error("oversubscription", f"{oversubscription!r} is below 1; use 1.0 for a full-bisection"
                           " fabric or N for N:1 oversubscription")
    return Cluster(
        name=_text(origin, "name", data.get("name", default_name)),
        groups=tuple(_parse_group(origin, f"groups[{i}]", g, dirs, base) for i, g in enumerate(groups)),
        oversubscription=oversubscription,
        description=_text(origin, "description", data.get("description", "")),
        source=_sources(origin, "", data.get("sources", {}), _CLUSTER_KEYS),
    )


def _parse_group(origin: _Origin, prefix: str, data, dirs: tuple[Path, ...], base: Path) -> NodeGroup:
    if not isinstance(data, dict):
        raise origin.error(prefix, "must be a mapping with device and nodes")
    _check_keys(origin, f"{prefix}.", data, _GROUP_KEYS, ("device", "nodes"))
    device_ref = _relative_to(base, _text(origin, f"{prefix}.device", data["device"]))
    try:
        device = load_device(device_ref)
    except ProfileError as exc:
        raise origin.error(f"{prefix}.device", str(exc)) from None
    node = NodeSpec(
        device=device,
        devices_per_node=_count(origin, f"{prefix}.devices_per_node",
                                data.get("devices_per_node", device.devices_per_node)),
        intra_link=_load_link(origin, f"{prefix}.intra_link", data["intra_link"], dirs, base, INTRA_NODE_KINDS)
        if "intra_link" in data else device.intra_link,
        nic=_load_link(origin, f"{prefix}.nic", data["nic"], dirs, base, INTER_NODE_KINDS)
        if "nic" in data else device.nic,
    )
    return NodeGroup(node, _count(origin, f"{prefix}.nodes", data["nodes"]))


def _peaks(origin: _Origin, value) -> dict[str, float]:
    if not isinstance(value, dict) or not value:
        raise origin.error("peak_flops_per_s", "must map dtypes (fp32, tf32, bf16, fp16, fp8) to dense FLOP/s")
    return {_enum(origin, "peak_flops_per_s", key, Dtype).value: _positive(origin, f"peak_flops_per_s.{key}", v)
            for key, v in value.items()}


def _matmul_curve(origin: _Origin, value, peaks: dict[str, float]) -> tuple[tuple[float, float], ...]:
    """Explicit [[op_flops, fraction], ...] points, or {plateau} expanded by the saturation model.

    The model: a GEMM of f FLOPs reaches plateau * f / (f + f_half) of peak, where
    f_half = plateau * peak * MATMUL_HALF_EFFICIENCY_TIME_S (peak of the first of
    MATMUL_REFERENCE_DTYPES the device has).
    """
    field_name = "matmul_efficiency"
    if isinstance(value, dict):
        _check_keys(origin, f"{field_name}.", value, _CURVE_KEYS, _CURVE_KEYS)
        plateau = _fraction(origin, f"{field_name}.plateau", value["plateau"])
        peak = next((peaks[d] for d in MATMUL_REFERENCE_DTYPES if d in peaks), max(peaks.values()))
        half_flops = plateau * peak * MATMUL_HALF_EFFICIENCY_TIME_S
        steps = range(MATMUL_CURVE_MIN_FLOPS_LOG10 * MATMUL_CURVE_POINTS_PER_DECADE,
                      MATMUL_CURVE_MAX_FLOPS_LOG10 * MATMUL_CURVE_POINTS_PER_DECADE + 1)
        flops = [10.0 ** (step / MATMUL_CURVE_POINTS_PER_DECADE) for step in steps]
        return tuple((f, plateau * f / (f + half_flops)) for f in flops)
    if not isinstance(value, (list, tuple)):
        raise origin.error(field_name, "must be a list of [op_flops, fraction] points or {plateau: F}")
    points = []
    for i, point in enumerate(value):
        if not isinstance(point, (list, tuple)) or len(point) != 2:
            raise origin.error(f"{field_name}[{i}]", f"{point!r} is not an [op_flops, fraction] pair")
        flops = _positive(origin, f"{field_name}[{i}][0]", point[0])
        fraction = _fraction(origin, f"{field_name}[{i}][1]", point[1])
        if points and flops <= points[-1][0]:
            raise origin.error(f"{field_name}[{i}]", f"op_flops {flops:g} does not exceed the previous"
                               f" point's {points[-1][0]:g}; list points in ascending op_flops")
        points.append((flops, fraction))
    return tuple(points)


def _check_keys(origin: _Origin, prefix: str, data: dict, allowed, required) -> None:
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            hint = f"did you mean {prefix}{close[0]!s}?" if close else f"valid keys: {', '.join(allowed)}"
            raise origin.error(f"{prefix}{key}", f"unknown key; {hint}")
    for key in required:
        if key not in data:
            raise origin.error(f"{prefix}{key}", "missing required key; add it (see profiles/README.md)")


def _sources(origin: _Origin, prefix: str, value, allowed) -> dict[str, str]:
    if not isinstance(value, dict):
        raise origin.error(f"{prefix}sources", "must map field names to source strings")
    _check_keys(origin, f"{prefix}sources.", value, allowed, ())
    return {key: _text(origin, f"{prefix}sources.{key}", text) for key, text in value.items()}


def _text(origin: _Origin, field_name: str, value) -> str:
    if not isinstance(value, str):
        raise origin.error(field_name, f"{value!r} must be a string")
    return value


def _enum(origin: _Origin, field_name: str, value, enum: type[StrEnum]):
    try:
        return enum(value)
    except ValueError:
        names = [m.value for m in enum]
        close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(names)}"
        raise origin.error(field_name, f"{value!r} is not a known {enum.__name__}; {hint}") from None


def _number(origin: _Origin, field_name: str, value) -> float:
    """A finite number; numeric strings are accepted because YAML 1.1 reads `450e9` as a string."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise origin.error(field_name, f"{value!r} must be a number")
    try:
        number = float(value)
    except ValueError:
        raise origin.error(field_name, f"{value!r} must be a number, e.g. 4.5e11") from None
    if not math.isfinite(number):
        raise origin.error(field_name, f"{value!r} must be a finite number")
    return number


def _positive(origin: _Origin, field_name: str, value) -> float:
    number = _number(origin, field_name, value)
    if number <= 0:
        raise origin.error(field_name, f"{value!r} must be a positive number")
    return number


def _optional_positive(origin: _Origin, field_name: str, data: dict) -> float:
    """A positive number when the key is present, 0.0 (unknown) when it is absent."""
    return _positive(origin, field_name, data[field_name]) if field_name in data else 0.0


def _fraction(origin: _Origin, field_name: str, value) -> float:
    number = _number(origin, field_name, value)
    if not 0 < number <= 1:
        raise origin.error(field_name, f"{value!r} must be a fraction in (0, 1]")
    return number


def _count(origin: _Origin, field_name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise origin.error(field_name, f"{value!r} must be a positive integer")
    return value
