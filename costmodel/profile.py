"""Measures the machine it runs on and writes a profile the cost model reads (`paraplan profile`).

Run once per process layout you will train with: alone it measures compute; under `torchrun` every
rank measures at the same time (so compute is measured under the load of all ranks sharing the
machine, and `matmul_sustained_fraction` is 1) and the ranks also time collectives (gloo on CPUs,
NCCL on GPUs). Measured:

- training GEMMs (a Linear's forward, input- and weight-gradient GEMMs) across sizes per dtype ->
  the device's efficiency curve and peak, and the op table's `matmul_times_s` (the compute model
  interpolates a GEMM's time from its nearest measured sizes);
- streaming copy bandwidth -> `mem_bw_bytes_per_s`; the elementwise and norm ops of the zoo's
  models (`ELEMENTWISE_OPS`), forward and backward -> the op table's `elementwise_bytes_per_s`, by
  which the compute model prices those ops, and the median forward bandwidth of add, GELU and
  LayerNorm relative to the copy, `mem_bw_efficiency` (for the ops not measured);
- causal scaled-dot-product attention forward and forward+backward at two shapes -> the op table's
  `attention_head_times_s`, per head of one sequence (the compute model interpolates an attention op's
  time from them at its per-head size, as for GEMMs at theirs);
- cross-entropy forward and backward over fp32 logits -> the op table's `loss_bytes_per_s`;
- the host work a tensor-parallel linear adds (DTensor dispatch), forward and backward, on a mesh of
  each rank alone -> the op table's `tp_linear_host_s`; under torchrun with an even number of
  ranks, how long pairs of ranks wait for each other at a tensor-parallel linear's collectives per
  second of its GEMMs -> the op table's `sync_wait_fraction`;
- all-reduce, all-gather, reduce-scatter and p2p across sizes -> the intra-node link's bandwidth
  and latency, fitted to the cost model's ring formulas (`costmodel.profile_collectives`).

Output, next to `--out my-cluster.yaml`: `my-cluster-device.yaml` (a device profile naming its op
tables in `op_tables`), `my-cluster-ops-<dtype>.json` (one `OpTable` per dtype) and the cluster file
itself (one node of the measured ranks). Fields not measured (the NIC, and the intra-node link when
run alone) come from a base device profile (`--like`). `--cluster my-cluster.yaml` then plans with
the measurements; `--cluster my-cluster-device.yaml:NODESxRANKS` other layouts of the same device.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from costmodel.op_table import OpTable
from costmodel.errors import ProfileError
from costmodel.hardware import DeviceSpec, LinkTier
from costmodel.profile_collectives import (COLLECTIVE_BYTES, COLLECTIVE_ITERATIONS, QUICK_COLLECTIVE_BYTES,
                                          QUICK_COLLECTIVE_ITERATIONS, collective_factors, fit_link,
                                          measure_collectives)
from costmodel.profile_files import op_table_name
from costmodel.profile_ops import (ELEMENTWISE_OPS, QUICK_TP_SYNC_ITERATIONS, QUICK_TP_SYNC_SHAPE, TP_SYNC_GROUP,
                                   TP_SYNC_ITERATIONS, TP_SYNC_SHAPE, measure_attention, measure_loss, measure_matmuls,
                                   measure_memory, measure_sync_wait, measure_tp_dispatch)

# Matrix sizes n of the n x n x n GEMMs timed, per device type and mode: from launch-bound to the
# plateau of one CPU core (about 1 GFLOP/s-scale ops) or one GPU (about 1 TFLOP ops).
MATMUL_SIZES = {"cpu": (64, 128, 256, 512, 1024, 2048), "cuda": (256, 512, 1024, 2048, 4096, 8192)}
QUICK_MATMUL_SIZES = {"cpu": (64, 256), "cuda": (512, 4096)}
DTYPES = {"cpu": ("fp32", "bf16"), "cuda": ("bf16", "fp16", "fp32")}
# Bytes of each tensor of the streaming copy: well past the last-level cache.
STREAM_BYTES = {"cpu": 64 * 2**20, "cuda": 1 * 2**30}
QUICK_STREAM_BYTES = {"cpu": 4 * 2**20, "cuda": 64 * 2**20}
# The ops whose median forward bandwidth over the copy's is `mem_bw_efficiency`.
EFFICIENCY_OPS = ("add", "gelu", "layer_norm")
# (tokens, vocabulary) of the cross-entropy measurement: fp32 logits of `profile_ops.ELEMENTWISE_BYTES`.
LOSS_SHAPES = {"cpu": (512, 4096), "cuda": (8192, 32768)}
QUICK_LOSS_SHAPES = {"cpu": (64, 1024), "cuda": (1024, 32768)}
# (batch, heads, seq, head_dim) of the attention measurements: a small and a GPT-2-sized layer.
ATTENTION_SHAPES = {"cpu": ((1, 8, 256, 64), (1, 12, 1024, 64)), "cuda": ((4, 16, 2048, 128), (1, 32, 8192, 128))}
QUICK_ATTENTION_SHAPES = {"cpu": ((1, 4, 128, 32),), "cuda": ((1, 16, 2048, 128),)}
# Minimum measuring time per op (torch.utils.benchmark blocked_autorange).
MIN_RUN_TIME_S = 0.2
QUICK_MIN_RUN_TIME_S = 0.01
# A CPU "device" is one core: the cost model's cpu profile runs one rank per core, and so do the
# gloo jobs that apply plans (torch.set_num_threads(1) per rank; torchrun's default OMP_NUM_THREADS).
CPU_THREADS_PER_RANK = 1
# Built-in device whose unmeasured fields a profile inherits, per device type.
DEFAULT_BASE = {"cpu": "cpu", "cuda": "h100-sxm"}
# Link kind written for a measured intra-node link (the kind is not measurable; it only decides
# whether the link may serve inside a node).
MEASURED_LINK_KIND = {"cpu": "loopback", "cuda": "pcie"}

@dataclass
class Measurements:
    """What one profiling run measured (rank-wise maxima under torchrun)."""

    device_type: str
    device_name: str
    world_size: int
    mem_bytes: float
    matmul_times_s: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    stream_bytes_per_s: float = 0.0
    elementwise_bytes_per_s: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> op -> bytes/s
    attention_times_s: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    loss_bytes_per_s: float = 0.0
    tp_linear_host_s: tuple[float, float] = (0.0, 0.0)
    sync_wait_fraction: float = 0.0
    link: tuple[float, float] | None = None  # (bytes/s, latency s)
    link_factors: dict[str, float] = field(default_factory=dict)  # collective -> measured / ring formula
    collective_samples: list[dict] = field(default_factory=list)
    quick: bool = False  # small sizes and short timings: a smoke check, not figures to plan with


def _mem_bytes(device, world_on_host: int) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / world_on_host


def process_group_backend(kind: str) -> str:
    """The profile's process-group backend: gloo on CPUs; on GPUs NCCL for device tensors and gloo for
    the host tensors in which the ranks compare their timings (`profile_collectives.rank_max`)."""
    return "cpu:gloo,cuda:nccl" if kind == "cuda" else "gloo"


@contextlib.contextmanager
def _own_mesh(kind: str):
    """A DeviceMesh of this rank alone: under torchrun from a one-rank group per rank (every rank
    creates all of them, as `new_group` requires); alone, over a one-rank process group made for it."""
    if dist.is_available() and dist.is_initialized():
        groups = [dist.new_group([rank]) for rank in range(dist.get_world_size())]
        yield DeviceMesh.from_group(groups[dist.get_rank()], kind)
        return
    dist.init_process_group(process_group_backend(kind), store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh(kind, (1,))
    finally:
        dist.destroy_process_group()


def measure(*, quick: bool = False, progress=None) -> Measurements:
    """Measures this machine (see the module docstring); call on every rank under torchrun.

    Args:
        quick: small sizes and short timings (seconds, for tests and smoke checks).
        progress: a rich Progress to report on, or None.
    """
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind = device.type
    if kind == "cpu":
        torch.set_num_threads(CPU_THREADS_PER_RANK)
    dtypes = DTYPES[kind]
    sizes = (QUICK_MATMUL_SIZES if quick else MATMUL_SIZES)[kind]
    shapes = (QUICK_ATTENTION_SHAPES if quick else ATTENTION_SHAPES)[kind]
    collective_sizes = (QUICK_COLLECTIVE_BYTES if quick else COLLECTIVE_BYTES)[kind]
    run_time_s = QUICK_MIN_RUN_TIME_S if quick else MIN_RUN_TIME_S
    world = dist.get_world_size() if distributed else 1
    pairs = world > 1 and world % TP_SYNC_GROUP == 0
    steps = (len(dtypes) * (len(sizes) + len(ELEMENTWISE_OPS) + len(shapes)) + 3 + int(pairs)
             + (4 * len(collective_sizes) if world > 1 else 0))
    task = progress.add_task(f"profiling {kind} x{world}", total=steps) if progress is not None else None

    def advance() -> None:
        if progress is not None:
            progress.advance(task)

    name = torch.cuda.get_device_name(device) if kind == "cuda" else platform.processor() or platform.machine()
    result = Measurements(kind, name, world, _mem_bytes(device, int(os.environ.get("LOCAL_WORLD_SIZE", world))), quick=quick)
    result.matmul_times_s = measure_matmuls(device, dtypes, sizes, run_time_s, advance)
    result.stream_bytes_per_s, result.elementwise_bytes_per_s = measure_memory(
        device, dtypes, (QUICK_STREAM_BYTES if quick else STREAM_BYTES)[kind], run_time_s, advance)
    result.attention_times_s = measure_attention(device, dtypes, shapes, run_time_s, advance)
    loss_shape = (QUICK_LOSS_SHAPES if quick else LOSS_SHAPES)[kind]
    result.loss_bytes_per_s = measure_loss(device, loss_shape, run_time_s, advance)
    with _own_mesh(kind) as mesh:
        result.tp_linear_host_s = measure_tp_dispatch(mesh, run_time_s, advance)
    if pairs:
        mesh = init_device_mesh(kind, (world // TP_SYNC_GROUP, TP_SYNC_GROUP), mesh_dim_names=("pair", "tp"))
        shape = (QUICK_TP_SYNC_SHAPE if quick else TP_SYNC_SHAPE)[kind]
        iterations = QUICK_TP_SYNC_ITERATIONS if quick else TP_SYNC_ITERATIONS
        result.sync_wait_fraction = measure_sync_wait(mesh["tp"], shape, result.tp_linear_host_s, iterations, advance)
    if world > 1:
        iterations = QUICK_COLLECTIVE_ITERATIONS if quick else COLLECTIVE_ITERATIONS
        result.collective_samples = measure_collectives(device, collective_sizes, iterations, advance)
        result.link = fit_link(result.collective_samples, world)
        result.link_factors = collective_factors(result.collective_samples, world, result.link)
    return result


def _link_mapping(link: LinkTier, base_name: str) -> dict:
    """An inline copy of a base profile's link, its sources kept."""
    mapping = {"name": link.name, "kind": str(link.kind), "bw_bytes_per_s": link.bw_bytes_per_s,
               "latency_s": link.latency_s, "efficiency": link.efficiency,
               "sources": {"bw_bytes_per_s": f"from {base_name} ({link.source or 'no source given'})"}}
    if link.collective_factors:
        mapping["collective_factors"] = dict(link.collective_factors)
    return mapping


def write_profile(out: str | Path, measured: Measurements, base: DeviceSpec) -> list[Path]:
    """Writes the cluster file `out`, its device file and one op table per dtype; returns their paths.

    Args:
        out: the cluster file to write (.yaml).
        measured: what `measure` returned.
        base: the device profile whose unmeasured fields (NIC; intra-node link when run alone) are kept.
    """
    out = Path(out)
    stem = out.stem
    device_path = out.with_name(f"{stem}-device.yaml")
    name = device_path.stem
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "paraplan profile --quick` (short timings: check before planning with it)" if measured.quick else "paraplan profile`"
    how = f"measured by `{command} on {platform.node()} ({measured.device_name}), {measured.world_size} rank(s), {when}"
    peaks = {dtype: max(f / t for f, t in points) for dtype, points in measured.matmul_times_s.items()}
    reference = max(peaks, key=peaks.get)  # the curve is anchored at the fastest dtype, the one to train in
    curve = [[f, f / t / peaks[reference]] for f, t in measured.matmul_times_s[reference]]
    elementwise_bw = float(np.median([measured.elementwise_bytes_per_s[reference][op] for op in EFFICIENCY_OPS]))
    tables, texts = {}, {}
    for dtype, points in measured.matmul_times_s.items():
        path = out.with_name(op_table_name(stem, dtype))
        table = OpTable(name, dtype, {}, tuple(points), tuple(measured.attention_times_s.get(dtype, ())),
                        measured.loss_bytes_per_s, measured.elementwise_bytes_per_s.get(dtype, {}), measured.tp_linear_host_s,
                        measured.sync_wait_fraction)
        texts[path] = json.dumps(table.to_dict(), indent=1)
        tables[dtype] = path.name
    if measured.link is not None:
        intra = {"name": f"{stem}-link", "kind": MEASURED_LINK_KIND[measured.device_type],
                 "bw_bytes_per_s": measured.link[0], "latency_s": measured.link[1], "efficiency": 1.0,
                 "collective_factors": measured.link_factors,
                 "sources": {"bw_bytes_per_s": f"{how}: fit of all-reduce/all-gather/reduce-scatter/p2p times",
                             "latency_s": f"{how}: same fit", "efficiency": "bandwidth is the achieved figure",
                             "collective_factors": f"{how}: each collective's time over the fit's, median over bandwidth-bound sizes"}}
    else:
        intra = _link_mapping(base.intra_link, base.name)
    device = {
        "name": name,
        "description": f"{measured.device_name} as measured by paraplan profile",
        "peak_flops_per_s": peaks,
        "mem_bytes": int(measured.mem_bytes),
        "mem_bw_bytes_per_s": measured.stream_bytes_per_s,
        "mem_bw_efficiency": min(1.0, elementwise_bw / measured.stream_bytes_per_s),
        "matmul_efficiency": curve,
        "matmul_sustained_fraction": 1.0,
        "comm_overlaps_compute": measured.device_type != "cpu",
        "node": {"devices_per_node": measured.world_size, "intra_link": intra},
        "nic": _link_mapping(base.nic, base.name),
        "op_tables": tables,
        "sources": {
            "peak_flops_per_s": f"{how}: best training-GEMM throughput per dtype (so MFU is against the measured peak); "
                                f"only measured dtypes (plans in others are refused)",
            "mem_bytes": f"{how}: device memory (CPU: physical memory / ranks on the host)",
            "mem_bw_bytes_per_s": f"{how}: streaming copy",
            "mem_bw_efficiency": f"{how}: median elementwise (add, GELU, LayerNorm) bandwidth in {reference} / copy bandwidth",
            "matmul_efficiency": f"{how}: Linear-layer training GEMMs (forward, input and weight gradient) in "
                                 f"{reference}, the fastest dtype; each dtype's own times are in its op table",
            "matmul_sustained_fraction": f"{how}: all ranks measured at once, so the curve is already sustained",
            "comm_overlaps_compute": "CPU ranks: gloo runs collectives on the cores that compute; GPUs: on their own stream",
            "node": f"{how}" if measured.link is not None else f"ranks {how}; link from {base.name} (run under torchrun to measure it)",
            "nic": f"from {base.name} (not measured: one host)",
            "op_tables": f"{how}",
        },
    }
    texts[device_path] = yaml.safe_dump(device, sort_keys=False)
    cluster = {"name": stem, "description": f"{measured.world_size} x {measured.device_name}, {how}",
               "groups": [{"device": device_path.name, "nodes": 1}]}
    texts[out] = yaml.safe_dump(cluster, sort_keys=False)
    _write_all(texts)
    return [out, device_path, *(out.with_name(t) for t in tables.values())]


def _write_all(texts: dict[Path, str]) -> None:
    """Writes every file or none: each to a temporary name first, then all renamed into place.

    Raises:
        ProfileError: a file cannot be written (nothing is left behind).
    """
    blocked = next((path for path in texts if path.is_dir()), None)
    if blocked is not None:
        raise ProfileError(f"--out {blocked}: is a folder; remove it or pick another --out")
    written = []
    try:
        for path, text in texts.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.name}.partial")
            written.append(temporary)
            temporary.write_text(text)
        for path, temporary in zip(texts, written):
            os.replace(temporary, path)
    except OSError as error:
        for temporary in written:
            temporary.unlink(missing_ok=True)
        raise ProfileError(f"--out {error.filename}: cannot write ({error.strerror}); pick a writable path") from None


def check_out_path(out: str | Path) -> None:
    """Raises ProfileError, before anything is measured, when the profile files cannot be written at `out`."""
    out = Path(out)
    if out.suffix not in (".yaml", ".yml"):
        raise ProfileError(f"--out {out}: the profile is a cluster file; use a .yaml path")
    folder = next((parent for parent in (out.parent, *out.parent.parents) if parent.exists()), Path("."))
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise ProfileError(f"--out {out}: {folder} is not a writable folder; pick a writable path")
    tables = [out.with_name(op_table_name(out.stem, dtype)) for dtype in sorted({d for ds in DTYPES.values() for d in ds})]
    for path in (out, out.with_name(f"{out.stem}-device.yaml"), *tables):
        if path.is_dir():
            raise ProfileError(f"--out {out}: {path} is a folder; pick another --out")


def run_profile(out: str | Path, *, like: str | None = None, quick: bool = False, show_progress: bool = True) -> list[Path]:
    """Measures this machine and writes the profile (rank 0 writes; every rank measures).

    Under torchrun (WORLD_SIZE > 1) the default process group is created (NCCL on GPUs, gloo on
    CPUs) and destroyed afterwards.

    Args:
        out: the cluster file to write (.yaml or .yml).
        like: device profile (name or file) for unmeasured fields; DEFAULT_BASE of the device type when None.
        quick: small sizes and short timings.
        show_progress: draw a rich progress bar on rank 0.

    Returns:
        The files written (empty on ranks other than 0).

    Raises:
        ProfileError: `out` is not a YAML path or cannot be written, or `like` names no device profile.
    """
    from rich.progress import Progress

    from costmodel.profile_loader import load_device

    check_out_path(out)  # on every rank, so that all stop together
    base = load_device(like or DEFAULT_BASE["cuda" if torch.cuda.is_available() else "cpu"])
    started_group = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized()
    if started_group:
        dist.init_process_group(process_group_backend("cuda" if torch.cuda.is_available() else "cpu"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        with Progress(disable=not show_progress or rank != 0, transient=True) as progress:
            measured = measure(quick=quick, progress=progress)
        written, failure = [], None
        if rank == 0:
            try:
                written = write_profile(out, measured, base)
            except ProfileError as error:
                failure = error
        if started_group:
            dist.barrier()  # leave together: a rank tearing gloo down while another still works can abort
        if failure is not None:
            raise failure
        return written
    finally:
        if started_group:
            dist.destroy_process_group()
