"""`sweep()`: plan every point of a sweep into one results file, in parallel and resumably.

Each (model, sequence length) is traced once, here; the graphs go to the workers (see
`planner.sweeps.executors`). Rows are appended to the results file as points finish. On start,
the points already in the file are skipped, so re-running an interrupted sweep finishes it and
never plans a point twice. The first SIGINT or SIGTERM stops dispatching, waits for the points
already running and writes their rows, then raises `SweepInterrupted`. A second signal gets the
default behaviour: SIGTERM ends the process at once, SIGINT raises KeyboardInterrupt (once the
running worker tasks end); the rows written so far are whole either way. A finished sweep
leaves its rows in the sweep's point order, so a resumed run's file matches an uninterrupted
one's (except `plan_time_s`).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Column
from rich.text import Text

from planner.api import model_graph
from planner.errors import check_positive_int, invalid
from planner.report.units import fmt_number_of
from planner.sweeps.executors import (ExecutorKind, PlanSettings, Tables, base_row, failure, point_fingerprint, run_inline,
                                      run_processes, run_ray)
from planner.sweeps.results import PointStatus, ResultsFile, results_format, row_point
from planner.sweeps.spec import SweepPoint, SweepSpec, load_sweep_spec, sweep_spec_from_dict

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A stop signal this soon after the first is the same request delivered again (`timeout` sends it to
# the process and to its group), not a second one asking to quit at once.
REPEAT_WINDOW_S = 1.0
# The progress line shows a rate once this much time has passed: before it, a few points planned
# in milliseconds (rows of a model that failed to trace) read as thousands of points per second.
RATE_MIN_ELAPSED_S = 1.0
# Columns of the progress line's bar: the rest goes to the point's description, cut to fit.
PROGRESS_BAR_WIDTH = 16


@dataclass(frozen=True)
class SweepSummary:
    """What a finished sweep did.

    Attributes:
        path: the results file.
        points: points in the sweep.
        planned: points planned by this run (the others were already in the file).
        status_counts: rows per status over all the sweep's points.
        elapsed_s: wall time of this run, tracing included.
        planning_s: wall time from the first dispatched point to the last row.
    """

    path: Path
    points: int
    planned: int
    status_counts: dict[str, int]
    elapsed_s: float
    planning_s: float

    @property
    def points_per_s(self) -> float:
        return self.planned / self.planning_s if self.planning_s > 0 else 0.0


class SweepInterrupted(Exception):
    """A sweep stopped by a signal; its finished rows are in the results file."""

    def __init__(self, signum: int, finished: int, total: int, path: Path):
        self.signum, self.finished, self.total, self.path = signum, finished, total, path
        super().__init__(f"sweep stopped by {signal.Signals(signum).name} with {finished} of {fmt_number_of(total, 'point')} in {path}; "
                         f"re-run the same command to resume")

    @property
    def exit_code(self) -> int:
        """The shell convention for death by a signal: 128 + its number."""
        return 128 + self.signum


def sweep(spec: SweepSpec | str | Path | dict, out: str | Path, *, workers: int | None = None,
          executor: ExecutorKind | str = ExecutorKind.LOCAL, address: str | None = None,
          plan_dir: str | Path | None = None, progress: bool = False) -> SweepSummary:
    """Plan every point of a sweep and stream one row per point to `out`.

    Args:
        spec: a SweepSpec, a sweep file path, or a dict with the sweep file's keys.
        out: results file, `.csv` or `.jsonl`; rows already in it are kept and their points skipped.
        workers: local worker processes (default: one per CPU; 1 plans in this process).
        executor: "local" (worker processes) or "ray" (Ray tasks).
        address: the Ray cluster to connect to (default: a Ray already initialised, else a local one).
        plan_dir: a folder to save each found plan to (as JSON; its path goes in `plan_path`).
        progress: show a progress bar on stderr (where stderr is not a terminal, one line per
            point planned), and say when a run resumes a results file.

    Returns:
        The summary; the rows are in `out` (`planner.sweeps.results.read_results`).

    Raises:
        PlannerError: INVALID_INPUT for a bad sweep, before any point is planned.
        SweepInterrupted: a SIGINT or SIGTERM stopped the sweep.

    Example::

        >>> summary = sweep({"models": ["gpt3-125m"], "devices": ["a100-80g"], "cluster_sizes": [8],
        ...                  "global_batches": [64], "seq_lens": [1024]}, "results.csv", workers=1)
        >>> summary.points, summary.status_counts
        (1, {'ok': 1})
    """
    started = time.perf_counter()
    spec = _as_spec(spec)
    results_format(out)
    kind = _executor_kind(executor)
    if address is not None and kind != ExecutorKind.RAY:
        raise invalid(f"--address {address}: only with --executor ray")
    if workers is not None:
        check_positive_int("--workers", workers)
    settings = PlanSettings(spec.dtype, spec.code, spec.constraints, spec.settings, None if plan_dir is None else str(plan_dir))
    with ResultsFile.open(out) as results, _StopOnSignal() as stop, _progress_bar(progress) as bar:
        todo = _unfinished(spec, results)
        resumed = len(spec.points) - len(todo)
        task = bar.add_task("tracing", total=len(spec.points), completed=resumed, resumed=resumed)
        if progress and resumed:
            bar.console.print(f"resuming {out}: {resumed} of {len(spec.points)} points planned before", markup=False, highlight=False,
                              soft_wrap=True)
        graphs, plannable = _trace(todo, spec, settings, results, stop.event, bar, task)
        planning_started = time.perf_counter()
        for row in _rows(kind, plannable, (graphs, spec.clusters, settings), stop.event, workers, address):
            if row is not None:
                results.append(row)
                bar.update(task, advance=1, description=_describe(row))
                if progress and not bar.console.is_terminal:  # a log, where no bar can redraw: one line a point
                    bar.console.print(f"[{int(bar.tasks[0].completed)}/{len(spec.points)}] {_describe(row)}", markup=False,
                                      highlight=False, soft_wrap=True)
            elif stop.event.is_set():
                bar.update(task, description="stopping: finishing the running points")
        planning_s = time.perf_counter() - planning_started
        done = _in_sweep_order(spec, results.rows)
        if stop.signum is not None and len(done) < len(spec.points):  # a stop after the last point stops nothing
            raise SweepInterrupted(stop.signum, len(done), len(spec.points), results.path)
        if len(done) == len(spec.points) and results.rows[: len(done)] != done:
            wanted = frozenset(spec.points)
            results.rewrite(done + [row for row in results.rows if row_point(row) not in wanted])
    return SweepSummary(path=Path(out), points=len(spec.points), planned=len(todo),
                        status_counts=dict(Counter(row["status"] for row in done)),
                        elapsed_s=time.perf_counter() - started, planning_s=planning_s)


def _as_spec(spec: SweepSpec | str | Path | dict) -> SweepSpec:
    if isinstance(spec, SweepSpec):
        return spec
    if isinstance(spec, dict):
        return sweep_spec_from_dict(spec)
    return load_sweep_spec(spec)


def _rows(kind: ExecutorKind, points: list[SweepPoint], tables: Tables, stop: threading.Event, workers: int | None,
          address: str | None) -> Iterator[dict | None]:
    """The rows of `points` from the chosen executor (nothing, without starting one, when there is nothing to do)."""
    processes = min(workers or _usable_cpus(), len(points))
    if not points or stop.is_set():
        return iter(())
    if kind == ExecutorKind.RAY:
        return run_ray(points, tables, stop, address)
    if processes == 1:
        return run_inline(points, tables, stop)
    return run_processes(points, tables, stop, processes)


def _executor_kind(executor: ExecutorKind | str) -> ExecutorKind:
    try:
        return ExecutorKind(executor)
    except ValueError:
        raise invalid(f"--executor {executor!r}: use one of {', '.join(ExecutorKind)}") from None


def _unfinished(spec: SweepSpec, results: ResultsFile) -> list[SweepPoint]:
    """The sweep's points without a row yet, or whose rows are all `error` (an unexpected exception
    is no answer about the point: a re-run plans it again). Rows planned with other settings (any
    row: a report compares a file's rows as planned alike), or this sweep's rows priced from files
    changed since, are an error."""
    wanted = frozenset(spec.points)
    finished = set()
    for row in results.rows:
        point = row_point(row)
        if row["settings"] != spec.settings:
            raise invalid(f"{results.path}: {point.model} on {point.cluster} was planned with {row['settings']!r}, this sweep uses "
                          f"{spec.settings!r}; write to a new --out file or use the same settings")
        if point in wanted and row["fingerprint"] is not None:  # a cluster, device or spec file edited since: stale rows
            now = point_fingerprint(point, spec.clusters[point.cluster])
            if row["fingerprint"] != now:
                raise invalid(f"{results.path}: {point.model} on {point.cluster} was planned from other hardware or model "
                              f"data (fingerprint {row['fingerprint']}, now {now}: its cluster, device, op-table or model spec "
                              f"file changed since, or the built-in profile it names); write to a new --out file, or restore "
                              f"the files")
        if row["status"] != PointStatus.ERROR:
            finished.add(point)
    return [point for point in spec.points if point not in finished]


def _trace(todo: list[SweepPoint], spec: SweepSpec, settings: PlanSettings, results: ResultsFile,
           stop: threading.Event, bar: Progress, task) -> tuple[dict, list[SweepPoint]]:
    """Trace each (model, seq_len) the unfinished points need, once (or load it from the on-disk
    graph cache, as `planner.plan` does); a model that fails to trace gets its rows here.
    Returns the graphs and the points left to plan."""
    graphs = {}
    for model, seq_len in dict.fromkeys((point.model, point.seq_len) for point in todo):
        if stop.is_set():
            break
        bar.update(task, description=f"tracing {model} at {seq_len} tokens")
        try:
            graphs[model, seq_len] = model_graph(model, seq_len, dtype=settings.dtype)
        except Exception as error:  # noqa: BLE001 - the model's points become rows with the reason
            for point in todo:
                if (point.model, point.seq_len) == (model, seq_len):
                    results.append({**base_row(point, spec.clusters[point.cluster], settings), **failure(error)})
                    bar.advance(task)
    return graphs, [point for point in todo if (point.model, point.seq_len) in graphs]


def _usable_cpus() -> int:
    """The CPUs this process may run on (a batch job's share of its node), where the OS says so."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _in_sweep_order(spec: SweepSpec, rows: list[dict]) -> list[dict]:
    """The rows of the sweep's points, in the sweep's point order: a point's last row, as
    `results.read_results` (and so `paraplan report`) reads it, but an `error` row only where the
    point has no other (it was planned again)."""
    by_point: dict[SweepPoint, dict] = {}
    for row in rows:
        point = row_point(row)
        if point not in by_point or row["status"] != PointStatus.ERROR or by_point[point]["status"] == PointStatus.ERROR:
            by_point[point] = row
    return [by_point[point] for point in spec.points if point in by_point]


def _describe(row: dict) -> str:
    return f"{row['model']} on {row['cluster']} gb{row['global_batch']} s{row['seq_len']}: {row['status']}"


class _PaceColumn(ProgressColumn):
    """Points per second and the time left, from the average since this run started (the points a
    resumed run found done are not counted); rich's own speed, over its last few updates, swings
    by orders of magnitude when several points end together."""

    def render(self, task) -> Text:
        planned = task.completed - task.fields["resumed"]
        if not planned or not task.elapsed or task.elapsed < RATE_MIN_ELAPSED_S:
            return Text("- points/s", style="progress.data.speed")
        rate = planned / task.elapsed
        left_s = int((task.total - task.completed) / rate)
        return Text(f"{rate:.2f} points/s, {left_s // 60}:{left_s % 60:02d} left", style="progress.data.speed")


def _progress_bar(enabled: bool) -> Progress:
    description = Column(ratio=1, no_wrap=True, overflow="ellipsis")
    return Progress(TextColumn("{task.description}", table_column=description), BarColumn(bar_width=PROGRESS_BAR_WIDTH),
                    MofNCompleteColumn(), _PaceColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                    disable=not enabled, expand=True)


class _StopOnSignal:
    """Sets `event` on the first SIGINT or SIGTERM; a second one, unless it comes within
    `REPEAT_WINDOW_S` of the first (one request delivered twice: `timeout` signals the process and
    its group), goes to the previous handlers, restored then. Installs nothing outside the main
    thread (signals go there)."""

    def __init__(self):
        self.event = threading.Event()
        self.signum: int | None = None
        self._first_s = 0.0
        self._previous: dict = {}

    def __enter__(self) -> "_StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum, self._first_s = signum, time.monotonic()
            self.event.set()
            return
        if time.monotonic() - self._first_s < REPEAT_WINDOW_S:
            return
        previous = self._previous.get(signum)
        self._restore()
        if callable(previous):
            previous(signum, frame)
        else:
            signal.raise_signal(signum)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous = {}
