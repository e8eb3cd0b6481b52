"""Sweep files and flags: which (model, cluster, global batch, sequence length) points to plan.

A sweep file is YAML; `paraplan sweep` flags give the same keys (`--cluster-sizes` for
`cluster_sizes`, lists comma-separated) and override the file's. Every combination of the grid
keys is a point; explicit `points` follow:

    models: [gpt3-1.3b, llama3-8b]          # zoo names, spec files or package.module:factory
    devices: [h100-sxm, a100-80g]           # device profiles, each crossed with cluster_sizes
    cluster_sizes: [8, 16, 32]              # devices per cluster (see below)
    clusters: [dgx-h100-su, h100-sxm:4x8]   # optional: cluster names, files or DEVICE:NODESxGPUS
    global_batches: [512]                   # sequences per optimizer step
    seq_lens: [2048, 4096]                  # tokens per sequence
    dtype: bf16                             # optional: bf16 (default), fp16, fp8 or fp32
    attention: flash                        # optional: flash (default), flash2, flash1 or unfused
    loss: torch                             # optional: torch (default) or fused (cross-entropy kernel)
    tp_overlap: none                        # optional: none (default), full or forward (as --tp-comm-overlap)
    zero3_fetch: prefetch                   # optional: prefetch (default) or blocking (as --zero3-fetch)
    dp_sync: overlapped                     # optional: overlapped (default) or blocking (as --dp-sync)
    elementwise: eager                      # optional: eager (default) or fused (as --elementwise)
    pp_buffers: preallocated                # optional: preallocated (default) or transient (as --pp-buffers)
    pp_outputs: dropped                     # optional: dropped (default) or kept (as --pp-outputs)
    cp_comm: all_gather                     # optional: all_gather (default) or a2a (as --cp-comm)
    sp_gather: kept                         # optional: kept (default) or regathered (as --sp-gather)
    constraints: {zero: 1}                  # optional: fixed choices or bounds, as `paraplan plan` takes
    points:                                 # optional: explicit points
      - {model: llama3-70b, cluster: h100-sxm:8x8, global_batch: 1024, seq_len: 8192}

Cluster sizes count devices: a size up to the device's usual node (`devices_per_node` of its
profile) is one node of that many devices, a larger size is whole nodes of the usual size (the
`DEVICE:N` shorthand of `costmodel.profile_loader.load_cluster`); a size that is not a whole number of
nodes is rejected. A point names its cluster `DEVICE:NODESxGPUS` (device and size, or shorthand),
by its built-in name, or by its file's absolute path (the same from any working directory).
Relative file paths in a sweep file are relative to the file.

Every entry is checked before any planning starts; an error names the file, line and field.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path

import yaml

from costmodel.errors import ProfileError
from costmodel.hardware import Cluster
from costmodel.profile_files import PROFILE_SUFFIXES
from costmodel.profile_loader import load_cluster, load_device
from planner.config import TRAINING_DTYPES
from planner.errors import PlannerError, invalid
from planner.training_code import TrainingCode, unswitched

GRID_LIST_KEYS = ("models", "devices", "cluster_sizes", "clusters", "global_batches", "seq_lens")
CODE_KEYS = tuple(TrainingCode().options())
SETTING_KEYS = ("dtype", *CODE_KEYS, "constraints")
SPEC_KEYS = (*GRID_LIST_KEYS, *SETTING_KEYS, "points")
POINT_KEYS = ("model", "cluster", "global_batch", "seq_len")
# Keys `plan` itself takes from a sweep's settings, not from `constraints`.
RESERVED_CONSTRAINTS = ("top",)


@dataclass(frozen=True, order=True)
class SweepPoint:
    """One planning problem of a sweep; also the key of its row in the results file."""

    model: str
    cluster: str
    global_batch: int
    seq_len: int


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep: its points, their clusters and the settings every point is planned with.

    Attributes:
        points: in order, without repeats.
        clusters: the Cluster behind each point's `cluster` name.
        dtype, code, constraints: passed to `planner.plan` for every point.
    """

    points: tuple[SweepPoint, ...]
    clusters: dict[str, Cluster] = field(compare=False)
    dtype: str = "bf16"
    code: TrainingCode = TrainingCode()
    constraints: dict = field(default_factory=dict)

    @property
    def settings(self) -> str:
        """The planning settings as one string, stored in each row so a resume can check them."""
        flags = [f"{key}={value}" for key, value in self.code.changed().items() if key != "attention"]
        extra = " ".join(flags + [f"{key}={self.constraints[key]}" for key in sorted(self.constraints)])
        return f"dtype={self.dtype} attention={self.code.attention.value}" + (f" {extra}" if extra else "")


@dataclass(frozen=True)
class _Entry:
    """One key's value and where it was written, for error messages."""

    value: object
    where: str
    item_where: tuple[str, ...] = ()

    def item(self, index: int) -> str:
        return self.item_where[index] if index < len(self.item_where) else f"{self.where}[{index}]"


def load_sweep_spec(path: str | Path | None = None, overrides: dict | None = None) -> SweepSpec:
    """Read a sweep file, apply flag overrides, and validate everything.

    Args:
        path: a YAML sweep file, or None to take everything from `overrides`.
        overrides: spec keys given as command-line flags; they replace the file's.

    Returns:
        The validated SweepSpec.

    Raises:
        PlannerError: INVALID_INPUT naming the file and line (or the flag) and the field at fault.
    """
    entries, base = ({}, Path.cwd()) if path is None else (_file_entries(Path(path)), Path(path).parent)
    for key, value in (overrides or {}).items():
        if value is not None:
            flag = "--" + key.replace("_", "-")
            items = value if isinstance(value, list) else []
            entries[key] = _Entry(value, flag, tuple(f"{flag} {item!r}" for item in items))
    if not entries:
        raise invalid("sweep: nothing to plan; give a sweep file or --models, --devices, --cluster-sizes, --global-batches, --seq-lens")
    return _validate(entries, base)


def sweep_spec_from_dict(data: dict) -> SweepSpec:
    """Validate a sweep given as a dict with the sweep file's keys (paths relative to the working directory)."""
    if not isinstance(data, dict):
        raise invalid(f"sweep: expected a mapping of {', '.join(SPEC_KEYS)}, got {type(data).__name__}")
    return _validate({key: _Entry(value, f"sweep[{key!r}]") for key, value in data.items()}, Path.cwd())


def _file_entries(path: Path) -> dict[str, _Entry]:
    if path.is_dir():
        raise invalid(f"sweep file {path}: is a directory; give the sweep's YAML file")
    if not path.is_file():
        raise invalid(f"sweep file {path}: not found; check the path")
    try:
        text = path.read_text()
    except UnicodeDecodeError as error:
        raise invalid(f"sweep file {path}: not UTF-8 text (byte {error.start}); save it as UTF-8 YAML") from None
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            raise invalid(f"{path}: empty sweep file; give at least models, devices, cluster_sizes, global_batches, seq_lens")
        if not isinstance(root, yaml.MappingNode):
            raise invalid(f"{path}:{root.start_mark.line + 1}: a sweep file is a mapping of {', '.join(SPEC_KEYS)}")
        entries: dict[str, _Entry] = {}
        for key_node, value_node in root.value:
            key, line = str(key_node.value), key_node.start_mark.line + 1
            if key in entries:
                raise invalid(f"{path}:{line}: {key}: given twice")
            items = value_node.value if isinstance(value_node, yaml.SequenceNode) else ()
            entries[key] = _Entry(
                loader.construct_object(value_node, deep=True), f"{path}:{line}: {key}",
                tuple(f"{path}:{node.start_mark.line + 1}: {key}[{i}]" for i, node in enumerate(items)),
            )
        return entries
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise invalid(f"{path}{line}: not valid YAML: {getattr(error, 'problem', None) or error}") from None
    finally:
        loader.dispose()


def _validate(entries: dict[str, _Entry], base: Path) -> SweepSpec:
    for key, entry in entries.items():
        if key not in SPEC_KEYS:
            near = difflib.get_close_matches(key, SPEC_KEYS, n=1)
            hint = f"did you mean {near[0]}?" if near else f"use {', '.join(SPEC_KEYS)}"
            raise invalid(f"{entry.where}: unknown key; {hint}")
    dtype = _choice(entries, "dtype", TRAINING_DTYPES)
    code = TrainingCode.of(**{key: _choice(entries, key, TrainingCode.choices(key)) for key in CODE_KEYS})
    constraints = _constraints(entries.get("constraints"))
    clusters: dict[str, Cluster] = {}
    points = _grid_points(entries, base, clusters)
    if "points" in entries:
        points += _explicit_points(entries["points"], base, clusters)
    if not points:
        raise invalid("sweep: no points; give models, devices with cluster_sizes (or clusters), global_batches and seq_lens, or points")
    return SweepSpec(points=tuple(dict.fromkeys(points)), clusters=clusters, dtype=dtype, code=code, constraints=constraints)


def _grid_points(entries: dict[str, _Entry], base: Path, clusters: dict[str, Cluster]) -> list[SweepPoint]:
    given = [key for key in GRID_LIST_KEYS if key in entries]
    if not given:
        return []
    lists = {key: _list(entries, key) for key in given}
    for key in ("models", "global_batches", "seq_lens"):
        if key not in lists:
            raise invalid(f"sweep: {key}: missing; the grid needs models, global_batches, seq_lens and devices with cluster_sizes or clusters")
    if ("devices" in lists) != ("cluster_sizes" in lists):
        missing, present = ("cluster_sizes", "devices") if "devices" in lists else ("devices", "cluster_sizes")
        raise invalid(f"{entries[present].where}: needs {missing} too (each device is crossed with each cluster size)")
    if "devices" not in lists and "clusters" not in lists:
        raise invalid("sweep: devices with cluster_sizes, or clusters: missing; say which hardware to plan for")
    models = [_model(entries["models"], i, value, base) for i, value in enumerate(lists["models"])]
    batches = [_positive(entries["global_batches"], i, value) for i, value in enumerate(lists["global_batches"])]
    seq_lens = [_positive(entries["seq_lens"], i, value) for i, value in enumerate(lists["seq_lens"])]
    names: list[str] = []
    if "devices" in lists:
        devices = [_device(entries["devices"], i, value, base) for i, value in enumerate(lists["devices"])]
        sizes = [_positive(entries["cluster_sizes"], i, value) for i, value in enumerate(lists["cluster_sizes"])]
        for device, (j, size) in product(devices, enumerate(sizes)):
            names.append(_cluster(entries["cluster_sizes"].item(j), f"{device}:{size}", base, clusters))
    for i, value in enumerate(lists.get("clusters", [])):
        names.append(_cluster(entries["clusters"].item(i), _text(entries["clusters"], i, value), base, clusters))
    return [SweepPoint(model, cluster, batch, seq_len)
            for model, seq_len, batch, cluster in product(models, seq_lens, batches, names)]


def _explicit_points(entry: _Entry, base: Path, clusters: dict[str, Cluster]) -> list[SweepPoint]:
    if not isinstance(entry.value, list) or not entry.value:
        raise invalid(f"{entry.where}: expected a non-empty list of {{model, cluster, global_batch, seq_len}}")
    points = []
    for i, item in enumerate(entry.value):
        where = entry.item(i)
        if not isinstance(item, dict):
            raise invalid(f"{where}: expected a mapping with {', '.join(POINT_KEYS)}")
        for key in item:
            if key not in POINT_KEYS:
                near = difflib.get_close_matches(str(key), POINT_KEYS, n=1)
                raise invalid(f"{where}: {key}: unknown key" + (f"; did you mean {near[0]}?" if near else ""))
        for key in POINT_KEYS:
            if key not in item:
                raise invalid(f"{where}: {key}: missing")
        one = _Entry(None, where, (f"{where}.model", f"{where}.cluster", f"{where}.global_batch", f"{where}.seq_len"))
        points.append(SweepPoint(
            model=_model(one, 0, item["model"], base),
            cluster=_cluster(one.item(1), _text(one, 1, item["cluster"]), base, clusters),
            global_batch=_positive(one, 2, item["global_batch"]),
            seq_len=_positive(one, 3, item["seq_len"]),
        ))
    return points


def _list(entries: dict[str, _Entry], key: str) -> list:
    entry = entries[key]
    values = entry.value if isinstance(entry.value, list) else [entry.value]
    if entry.value is None or not values:
        raise invalid(f"{entry.where}: empty; list at least one value")
    seen: dict = {}
    for i, value in enumerate(values):
        if isinstance(value, (dict, list)):
            raise invalid(f"{entry.item(i)}: expected a single value, got a {type(value).__name__}")
        if value in seen:
            raise invalid(f"{entry.item(i)}: {value!r} is listed twice (also item {seen[value]})")
        seen[value] = i
    return values


def _text(entry: _Entry, index: int, value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise invalid(f"{entry.item(index)}: expected a name, got {value!r}")
    return value.strip()


def _positive(entry: _Entry, index: int, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"{entry.item(index)}: {value!r}: must be a positive integer")
    return value


def _relative(text: str, base: Path) -> str:
    """A file `text` names, by its absolute path (resolved against the sweep file's folder when
    relative), so that a point names it alike from any working directory; other text unchanged."""
    path = Path(text) if Path(text).is_absolute() else base / text
    if text.lower().endswith(PROFILE_SUFFIXES) and path.is_file():
        return str(path.resolve())
    return text


def _model(entry: _Entry, index: int, value, base: Path) -> str:
    from planner.models import resolve_model  # imports torch; only a sweep that traces needs it

    name = _relative(_text(entry, index, value), base)
    try:
        resolve_model(name)
    except PlannerError as error:
        raise invalid(f"{entry.item(index)}: {error.message}") from None
    return name


def _device(entry: _Entry, index: int, value, base: Path) -> str:
    """A built-in device's name, or a device file's path (a file's profile may reuse a built-in name)."""
    name = _relative(_text(entry, index, value), base)
    try:
        device = load_device(name)
    except ProfileError as error:
        raise invalid(f"{entry.item(index)}: {error}") from None
    return name if name.lower().endswith(PROFILE_SUFFIXES) else device.name


def _cluster(where: str, spelling: str, base: Path, clusters: dict[str, Cluster]) -> str:
    """The point's name for a cluster: a cluster file's absolute path, else the cluster's own name
    (canonical `DEVICE:NODESxGPUS` for shorthands, so `h100-sxm:16` and `h100-sxm:2x8` are one
    cluster), with a device file's absolute path in place of its profile's name (which may be a
    built-in device's)."""
    device, _, size = spelling.rpartition(":")
    device_file = _relative(device, base) if device.lower().endswith(PROFILE_SUFFIXES) else ""
    spelling = f"{device_file}:{size}" if device_file else _relative(spelling, base)
    try:
        cluster = load_cluster(spelling)
    except ProfileError as error:
        raise invalid(f"{where}: {error}") from None
    if spelling.lower().endswith(PROFILE_SUFFIXES):
        name = spelling
    else:
        name = f"{device_file}:{cluster.name.rpartition(':')[2]}" if device_file else cluster.name
    clusters[name] = cluster
    return name


def _choice(entries: dict[str, _Entry], key: str, allowed: tuple[str, ...]) -> str:
    """The key's value, one of `allowed`, or true or false where the key was a switch
    (`training_code.unswitched` names the choices they mean); the first when absent."""
    if key not in entries:
        return allowed[0]
    entry = entries[key]
    value = unswitched(key, entry.value)
    if value not in allowed:
        raise invalid(f"{entry.where}: {entry.value!r}: use one of {', '.join(allowed)}")
    return value


def _constraints(entry: _Entry | None) -> dict:
    if entry is None or entry.value is None:
        return {}
    if not isinstance(entry.value, dict):
        raise invalid(f"{entry.where}: expected a mapping such as {{zero: 1, max_pp: 8}}")
    from planner.constraints import BOUND_KEYS, FIXED_KEYS, OTHER_KEYS, check_constraints

    allowed = sorted((BOUND_KEYS | FIXED_KEYS | OTHER_KEYS) - set(RESERVED_CONSTRAINTS))
    for key in entry.value:
        if key in RESERVED_CONSTRAINTS:
            raise invalid(f"{entry.where}: {key}: not taken in a sweep (each point keeps its best plan alone); remove it")
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=1)
            raise invalid(f"{entry.where}: {key}: unknown constraint" + (f"; did you mean {near[0]}?" if near else f"; use {', '.join(allowed)}"))
    try:
        check_constraints(entry.value)
    except PlannerError as error:
        raise invalid(f"{entry.where}: {error.message}") from None
    return dict(entry.value)
