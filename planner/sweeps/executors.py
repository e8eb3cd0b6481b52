"""Planning sweep points: in this process, in local worker processes, or as Ray tasks.

Every executor gets the traced graphs and the clusters once (worker processes through their
initializer, Ray through its object store), so a point ships only its key and workers never
trace or read profile files; they do not even import torch. Each `run_*` function yields one row
per finished point, in completion order, and `None` when a poll interval passes without one; once
`stop` is set it dispatches nothing more and yields the rows of the points already running.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import multiprocessing
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Callable, Iterable, Iterator

from costmodel.errors import ProfileError
from costmodel.hardware import Cluster
from costmodel.profile_files import PROFILE_SUFFIXES
from planner.api import plan
from planner.errors import PlannerError, PlannerErrorKind, invalid
from planner.graph import ModelGraph
from planner.models import SPEC_SUFFIXES
from planner.sweeps.results import COLUMN_TYPES, PointStatus
from planner.sweeps.spec import SweepPoint
from planner.training_code import TrainingCode

# Seconds between checks of the stop flag while waiting for a worker.
POLL_S = 0.2
SECONDS_PER_HOUR = 3600.0
TOKENS_PER_MILLION = 1e6
INFEASIBLE_KINDS = (PlannerErrorKind.INSUFFICIENT_MEMORY, PlannerErrorKind.SOLVER_LIMIT)


class ExecutorKind(StrEnum):
    LOCAL = "local"
    RAY = "ray"


@dataclass(frozen=True)
class PlanSettings:
    """What every point of one sweep is planned with (see `SweepSpec`)."""

    dtype: str
    code: TrainingCode
    constraints: dict
    settings: str
    plan_dir: str | None = None


GraphKey = tuple[str, int]  # (model, seq_len)


def plan_point(point: SweepPoint, graph: ModelGraph, cluster: Cluster, settings: PlanSettings) -> dict:
    """Plan one point and return its results row.

    A failure becomes the row's status and reason (`failure`): planner errors (nothing fits, bad
    input) and, so that one bad point never ends a sweep, any other exception too.
    """
    started = time.perf_counter()
    row = base_row(point, cluster, settings)
    try:
        result = plan(graph, cluster, global_batch=point.global_batch, dtype=settings.dtype, **settings.code.options(),
                      **settings.constraints)
    except Exception as error:  # noqa: BLE001 - a failed point is a row, never the end of a sweep
        row.update(failure(error))
    else:
        estimate, price = result.estimate, row["cluster_usd_per_hour"]
        config = {key: value for key, value in result.config.to_dict().items() if key in COLUMN_TYPES}
        row.update(config, status=str(PointStatus.OK), config=result.config.short(),
                   step_time_s=estimate.step_time_s, tokens_per_s=estimate.tokens_per_s,
                   tflops_per_gpu=estimate.tflops_per_gpu, mfu=estimate.mfu,
                   peak_memory_bytes=estimate.peak_memory_bytes,
                   # the capacity of the device holding the peak (on a mixed cluster, not the largest one)
                   capacity_bytes=max(estimate.memory, key=lambda stage: stage["total_bytes"])["capacity_bytes"],
                   host_bytes=max(stage.get("host_bytes", 0.0) for stage in estimate.memory),
                   notes="; ".join(estimate.notes) or None)  # e.g. bf16 priced as fp16 on a device without it
        if price is not None:
            row["usd_per_million_tokens"] = price / SECONDS_PER_HOUR / estimate.tokens_per_s * TOKENS_PER_MILLION
        if settings.plan_dir is not None:
            # absolute, as the point's own model and cluster files are (`planner.sweeps.spec`), so that
            # `evaluate --plan` and a later run from elsewhere find them again
            path = Path(settings.plan_dir).absolute() / plan_file_name(point)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                dataclasses.replace(result, model=point.model, cluster=point.cluster).save(path)
                row["plan_path"] = str(path)
            except (OSError, PlannerError) as error:  # the point's results stand; its plan file is missing
                reason = error.message if isinstance(error, PlannerError) else error.strerror
                row["notes"] = "; ".join(filter(None, (row["notes"], f"--plan-dir: plan not saved to {path} ({reason})")))
    row["plan_time_s"] = time.perf_counter() - started
    return row


def failure(error: Exception) -> dict:
    """The status and reason columns of a point that failed with `error`."""
    if isinstance(error, PlannerError):
        status = PointStatus.INFEASIBLE if error.kind in INFEASIBLE_KINDS else PointStatus.INVALID
        return {"status": str(status), "reason": error.message}
    if isinstance(error, ProfileError):
        return {"status": str(PointStatus.INVALID), "reason": str(error)}
    return {"status": str(PointStatus.ERROR), "reason": f"{type(error).__name__}: {error}"}


def base_row(point: SweepPoint, cluster: Cluster, settings: PlanSettings) -> dict:
    """A row with every column, those known whatever happens to the point filled in: the point,
    its hardware and price."""
    prices = [group.node.device.price_per_hour for group in cluster.groups]
    return {
        **dict.fromkeys(COLUMN_TYPES),
        "model": point.model, "cluster": point.cluster, "global_batch": point.global_batch, "seq_len": point.seq_len,
        "settings": settings.settings,
        "device": _device_label(point, cluster),
        "devices": cluster.num_devices, "nodes": cluster.num_nodes, "fingerprint": point_fingerprint(point, cluster),
        # The cluster's price, when every device type in it has one (0 means unknown in profiles).
        "cluster_usd_per_hour": (sum(g.count * g.node.devices_per_node * g.node.device.price_per_hour for g in cluster.groups)
                                 if all(prices) else None),
    }


def point_fingerprint(point: SweepPoint, cluster: Cluster) -> str:
    """12 hex digits that change with what a point's row was priced from and a file can change: the
    hardware's priced fields (`Cluster.fingerprint`) and a model spec file's text. A sweep resumes
    into a row only while this stays the same."""
    model = Path(point.model)
    text = model.read_bytes() if point.model.lower().endswith(SPEC_SUFFIXES) and model.is_file() else b""
    return hashlib.sha256(cluster.fingerprint.encode() + text).hexdigest()[:12]


def _device_label(point: SweepPoint, cluster: Cluster) -> str:
    """The `device` column: the device file of a `FILE:NODESxGPUS` point as written (its profile may
    reuse a built-in's name, and the charts group rows by this column), else the device names."""
    device_file = point.cluster.rpartition(":")[0]
    if device_file.lower().endswith(PROFILE_SUFFIXES):
        return device_file
    return "+".join(dict.fromkeys(group.node.device.name for group in cluster.groups))


def plan_file_name(point: SweepPoint) -> str:
    """A file name for the plan of `point`: its fields joined (a spec file by its stem and a digest of
    its path; a built-in
    name or factory whole, dots kept: llama3.1-8b and llama3.1-70b stay apart), anything but
    [A-Za-z0-9.-] made '_'."""
    model = point.model
    if model.lower().endswith(SPEC_SUFFIXES):  # a spec file: its stem and its path's digest (a/tiny.yaml, b/tiny.yaml)
        model = f"{Path(model).stem}-{hashlib.sha1(model.encode()).hexdigest()[:8]}"
    text = f"{model}__{point.cluster}__gb{point.global_batch}__s{point.seq_len}"
    return re.sub(r"[^A-Za-z0-9.-]+", "_", text) + ".json"


Tables = tuple[dict[GraphKey, ModelGraph], dict[str, Cluster], PlanSettings]


def run_inline(points: Iterable[SweepPoint], tables: Tables, stop: threading.Event) -> Iterator[dict | None]:
    """Plan the points one after another in this process."""
    graphs, clusters, settings = tables
    for point in points:
        if stop.is_set():
            return
        yield plan_point(point, graphs[point.model, point.seq_len], clusters[point.cluster], settings)


_WORKER_TABLES: Tables | None = None
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _init_worker(tables: Tables) -> None:
    global _WORKER_TABLES
    _WORKER_TABLES = tables
    # Ctrl-C at a terminal, `timeout` and batch schedulers signal the whole process group; the
    # parent decides how to stop (it lets the running points finish).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """Ends this worker once its parent is gone (killed outright, so it could not stop the pool):
    the worker ignores the stop signals, and would otherwise outlive it holding its output open."""
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)


def _plan_in_worker(point: SweepPoint) -> dict:
    graphs, clusters, settings = _WORKER_TABLES
    return plan_point(point, graphs[point.model, point.seq_len], clusters[point.cluster], settings)


def run_processes(points: Iterable[SweepPoint], tables: Tables, stop: threading.Event, workers: int) -> Iterator[dict | None]:
    """Plan the points in `workers` fresh worker processes (spawned: no state forked from the parent)."""
    if stop.is_set():  # stopped while tracing: start no workers
        return
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_init_worker, initargs=(tables,))

    def wait(pending):
        done, _ = concurrent.futures.wait(pending, timeout=POLL_S, return_when=concurrent.futures.FIRST_COMPLETED)
        return done

    def submit(point: SweepPoint):
        # With SIGINT and SIGTERM blocked: a worker spawned now inherits the mask, so a signal sent to
        # the whole process group reaches only the parent (delivered as soon as they are unblocked).
        if not hasattr(signal, "pthread_sigmask"):  # no signal masks (Windows)
            return pool.submit(_plan_in_worker, point)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            return pool.submit(_plan_in_worker, point)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    try:
        yield from _windowed(points, stop, workers, submit, wait, lambda future: future.result())
    except concurrent.futures.BrokenExecutor:
        if not stop.is_set():  # a signal that reached a worker before it could ignore it also reached us
            raise invalid("sweep: a worker process ended unexpectedly (killed, or out of memory); the finished points "
                          "are kept: re-run the same command to resume") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def run_ray(points: Iterable[SweepPoint], tables: Tables, stop: threading.Event, address: str | None) -> Iterator[dict | None]:
    """Plan the points as Ray tasks on the cluster at `address` (or the Ray already initialised).

    When this call starts Ray, it ships the `planner` and `costmodel` packages to the workers
    (`runtime_env` py_modules); the workers need numpy and OR-Tools installed.
    """
    try:
        import ray
    except ImportError:
        raise invalid("--executor ray: Ray is not installed; pip install 'paraplan[ray]'") from None
    import costmodel
    import planner

    if not ray.is_initialized():
        ray.init(address=address, runtime_env={"py_modules": [planner, costmodel]}, log_to_driver=False)
    graphs, clusters, settings = tables
    graph_refs = {key: ray.put(graph) for key, graph in graphs.items()}
    remote = ray.remote(num_cpus=1)(plan_point)
    window = max(1, int(ray.cluster_resources().get("CPU", 1)))

    def submit(point: SweepPoint):
        return remote.remote(point, graph_refs[point.model, point.seq_len], clusters[point.cluster], settings)

    def wait(pending):
        done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        return done

    yield from _windowed(points, stop, window, submit, wait, ray.get)


def _windowed(points: Iterable[SweepPoint], stop: threading.Event, window: int, submit: Callable,
              wait: Callable, result: Callable) -> Iterator[dict | None]:
    """Keep `window` points in flight; yield each row as it finishes, None on an idle poll."""
    remaining = iter(points)
    pending: set = set()
    while True:
        while not stop.is_set() and len(pending) < window:
            point = next(remaining, None)
            if point is None:
                break
            pending.add(submit(point))
        if not pending:
            return
        done = wait(pending)
        if not done:
            yield None
        for handle in done:
            pending.discard(handle)
            yield result(handle)
