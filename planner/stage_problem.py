"""The pipeline stage-split problem (`StageProblem`) and its answer (`StageSplit`).

Cut L layers into S contiguous stages that fit memory and minimise 1F1B step time. Inputs are plain
numpy arrays; nothing here knows about torch or hardware.

Model. Stage s holds layers [b_s, b_{s+1}) and, per layer l, one choice c_l (e.g. a recompute policy;
a single choice when the arrays are 1-D). With t, w, a the per-layer time, static bytes and activation
bytes of one micro-batch, and e, r its transient bytes (alive at one moment of the step, so summed:
the loss's temporaries) and its recompute working set (alive only while that layer's backward runs,
so only the stage's largest counts)::

    T_s   = sum_{l in s} t[l, c_l] / speed_s                                   (stage time)
    M_s   = sum_{l in s} (w[l, c_l] + in_flight_s * a[l, c_l])
            + max(sum_{l in s} e[l, c_l], max_{l in s} r[l, c_l]) + overhead_s  (stage memory)
    step  = (m - 1) * max_s T_s + sum_s T_s                                    (1F1B with unequal stages)
    subject to M_s <= cap_s (`split_ilp`: over the chunks of one device, with the device's transient
    term) and every stage holding at least one layer.

That step is blind to where the slowest stage sits, which the schedule is not: with a problem's
`schedule` and forward times, `schedule_step_s` prices a split by the schedule's own closed form
(`costmodel.pipeline.step_time_s`), which `planner.stage_polish` lowers from the solvers' answer.

Solvers: `planner.stages` (`split_dp`, exact with one choice per layer; `split_uniform`, the
baseline) and `planner.stage_ilp` (`split_ilp`, per-layer choices).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from costmodel import pipeline
from planner.errors import invalid
from planner.milp import SolveStatus


# How far above its caps `StageProblem.no_split_fits` must find every split before it answers: its
# prefix-sum differences and the DP's segment sums round apart by a few units in the last place.
PROOF_MARGIN = 1e-9
# The per-layer arrays of a `StageProblem`, [L, C] each.
LAYER_ARRAYS = ("layer_time_s", "layer_static_bytes", "layer_act_bytes", "layer_transient_bytes", "layer_work_bytes")


@dataclass(frozen=True)
class StageProblem:
    """One stage-split instance. Per-layer arrays are [L] (one choice) or [L, C] (C choices per layer).

    Arrays are converted on creation: per-layer arrays to float [L, C], per-stage arrays to float [S].

    Attributes:
        layer_time_s: forward+backward time of one micro-batch per layer on a reference device.
        layer_static_bytes: weights + grads + optimizer bytes per device of each layer (plus the
            loss's temporaries on the layer holding the loss).
        layer_act_bytes: activation bytes one micro-batch of each layer keeps until its backward.
        num_stages: S.
        in_flight: [S] micro-batches in flight on each stage (1F1B: min(S - s, m)).
        mem_cap_bytes: [S] memory available per device of each stage.
        stage_speed: [S] relative speed of each stage's devices (1.0 = the reference device).
        num_microbatches: m, micro-batches per step.
        stage_overhead_bytes: [S] fixed bytes per stage (buffers, communication scratch); zeros if None.
        devices: D, when the S stages are chunks of an interleaved pipeline: stage s runs on device
            s % D, whose chunks share their summed capacity (`split_ilp`, whose transient term is the
            device's; the DPs keep each chunk under its own, which implies it). None: every stage has
            a device of its own.
        layer_transient_bytes: bytes each layer holds at one moment of the step beside its stage's
            other transients (the loss's temporaries and the blocks the allocator keeps with them);
            zeros if None.
        layer_work_bytes: bytes each layer holds again while its backward recomputes it; a stage
            recomputes one layer at a time, so only its largest counts (against the transients,
            whose blocks it can reuse); zeros if None.
        layer_fwd_s: the forward part of `layer_time_s`, with `schedule`; None: no schedule price.
        schedule: the pipeline schedule (`costmodel.pipeline.PipeSchedule`) `schedule_step_s` prices.
        layer_tail_s: seconds each layer adds to its device's work after the pipeline (its share of
            the optimizer update), of which the step waits for the slowest device's; zeros if None.
    """

    layer_time_s: np.ndarray
    layer_static_bytes: np.ndarray
    layer_act_bytes: np.ndarray
    num_stages: int
    in_flight: np.ndarray
    mem_cap_bytes: np.ndarray
    stage_speed: np.ndarray
    num_microbatches: int
    stage_overhead_bytes: np.ndarray | None = None
    devices: int | None = None
    layer_transient_bytes: np.ndarray | None = None
    layer_work_bytes: np.ndarray | None = None
    layer_fwd_s: np.ndarray | None = None
    schedule: str | None = None
    layer_tail_s: np.ndarray | None = None

    def __post_init__(self):
        if not isinstance(self.num_stages, (int, np.integer)) or self.num_stages < 1:
            raise invalid(f"num_stages={self.num_stages!r}: must be a positive integer")
        if not isinstance(self.num_microbatches, (int, np.integer)) or self.num_microbatches < 1:
            raise invalid(f"num_microbatches={self.num_microbatches!r}: must be a positive integer")
        time_s = _per_layer("layer_time_s", self.layer_time_s)
        for name in ("layer_transient_bytes", "layer_work_bytes"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros_like(time_s))
        optional = tuple(name for name in ("layer_fwd_s", "layer_tail_s") if getattr(self, name) is not None)
        for name in LAYER_ARRAYS + optional:
            value = _per_layer(name, getattr(self, name))
            if value.shape != time_s.shape:
                raise invalid(
                    f"{name}: shape {value.shape} differs from layer_time_s {time_s.shape}; "
                    "give one row per layer, one column per choice"
                )
            object.__setattr__(self, name, value)
        if time_s.shape[0] < self.num_stages:
            layers = time_s.shape[0]
            raise invalid(f"num_stages={self.num_stages}: more stages than the {layers} layers; use at most {layers} stages")
        if self.stage_overhead_bytes is None:
            object.__setattr__(self, "stage_overhead_bytes", np.zeros(self.num_stages))
        if self.devices is None:
            object.__setattr__(self, "devices", self.num_stages)
        if not isinstance(self.devices, (int, np.integer)) or self.devices < 1 or self.num_stages % self.devices:
            raise invalid(f"devices={self.devices!r}: must be a positive integer dividing num_stages={self.num_stages}")
        for name in ("in_flight", "mem_cap_bytes", "stage_speed", "stage_overhead_bytes"):
            value = np.asarray(getattr(self, name), dtype=float)
            if value.shape != (self.num_stages,):
                raise invalid(f"{name}: shape {value.shape}, expected ({self.num_stages},), one value per stage")
            if not np.all(np.isfinite(value)) or np.any(value < 0):
                raise invalid(f"{name}: values must be finite and >= 0")
            object.__setattr__(self, name, value)
        if np.any(self.stage_speed <= 0):
            raise invalid("stage_speed: every stage needs a speed > 0 (1.0 = the reference device)")
        if np.any(self.mem_cap_bytes <= 0):
            raise invalid("mem_cap_bytes: every stage needs memory > 0")

    @property
    def num_layers(self) -> int:
        return self.layer_time_s.shape[0]

    @property
    def num_choices(self) -> int:
        return self.layer_time_s.shape[1]

    def objective_s(self, stage_time_s) -> float:
        """(m - 1) max_d T_d + sum_s T_s / v over the devices' summed stage times T_d, v = S / D
        stages per device: `pipeline_step_time_s` with a device per stage (`split_ilp`)."""
        stage_time_s = np.asarray(stage_time_s, dtype=float)
        device_time_s = np.bincount(np.arange(self.num_stages) % self.devices, weights=stage_time_s)
        return (self.num_microbatches - 1) * float(device_time_s.max()) + float(stage_time_s.sum()) * self.devices / self.num_stages

    def one_choice(self, choice: int) -> StageProblem:
        """The problem with every layer taking choice `choice`."""
        optional = {name: getattr(self, name)[:, choice] for name in ("layer_fwd_s", "layer_tail_s") if getattr(self, name) is not None}
        return replace(self, **{name: getattr(self, name)[:, choice] for name in LAYER_ARRAYS}, **optional)

    @property
    def schedule_priced(self) -> bool:
        """Whether `schedule_step_s` can price a split (a schedule and forward times are given)."""
        return self.schedule is not None and self.layer_fwd_s is not None

    def stage_times_s(self, boundaries, choices: np.ndarray, layer_s: np.ndarray | None = None) -> np.ndarray:
        """[S] seconds of each stage of a split: its layers' `layer_s` (default `layer_time_s`) over its speed."""
        layer_s = self.layer_time_s if layer_s is None else layer_s
        stage_of = np.repeat(np.arange(self.num_stages), np.diff(np.asarray(boundaries)))
        return np.bincount(stage_of, layer_s[np.arange(self.num_layers), choices], self.num_stages) / self.stage_speed

    def schedule_step_s(self, boundaries, choices: np.ndarray) -> float:
        """The schedule's step time of a split (`costmodel.pipeline.step_time_s`, no transfers): each
        device's forward and backward summed over its chunks, so unlike `objective_s` it sees where
        the slowest stage sits; then the slowest device's `layer_tail_s`."""
        total_s = self.stage_times_s(boundaries, choices)
        fwd_s = self.stage_times_s(boundaries, choices, self.layer_fwd_s)
        device = np.arange(self.num_stages) % self.devices
        device_fwd_s = np.bincount(device, fwd_s, self.devices)
        device_bwd_s = np.bincount(device, total_s - fwd_s, self.devices)
        tail_s = 0.0
        if self.layer_tail_s is not None:
            stage_of = np.repeat(np.arange(self.num_stages), np.diff(np.asarray(boundaries)))
            stage_tail_s = np.bincount(stage_of, self.layer_tail_s[np.arange(self.num_layers), choices], self.num_stages)
            tail_s = float(np.bincount(device, stage_tail_s, self.devices).max())
        return tail_s + pipeline.step_time_s(self.schedule, device_fwd_s.tolist(), device_bwd_s.tolist(),
                                             self.num_microbatches, self.num_stages // self.devices)

    def _layer_values(self, choices: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """([S, L] additive bytes of layer l on stage s, [L] transient bytes, [L] recompute working
        set) with the given per-layer choice indices; None: each at its least over the choices."""
        per_choice = self.layer_static_bytes[None, :, :] + self.in_flight[:, None, None] * self.layer_act_bytes[None, :, :]
        if choices is None:
            return per_choice.min(axis=2), self.layer_transient_bytes.min(axis=1), self.layer_work_bytes.min(axis=1)
        rows = np.arange(self.num_layers)
        return per_choice[:, rows, choices], self.layer_transient_bytes[rows, choices], self.layer_work_bytes[rows, choices]

    def segment_mem_bytes(self, choices: np.ndarray | None = None) -> np.ndarray:
        """[s, j, i]: memory of stage s holding layers [i, j) on its own (inf where j <= i), with the
        given per-layer choice indices. None: every value at its least over the choices, a lower
        bound on any choice vector's (exact with one choice). Chunks sharing a device are each
        charged `_chunk_work_bytes`."""
        additive, transient, work = self._layer_values(choices)
        transient_sum = segment_sums(transient[None, :])[0]
        largest_work = segment_maxima(work) if self.devices == self.num_stages else self._chunk_work_bytes(work)
        return segment_sums(additive) + np.maximum(transient_sum, largest_work)[None] + self.stage_overhead_bytes[:, None, None]

    def no_split_fits(self) -> bool:
        """True only when no split (with choice 0 on every layer) fits memory, found in O(S L).

        A segment's memory never falls when it takes one more layer at either end (sums of
        non-negative bytes and a running maximum), so of the ends stage s-1 can reach below j the
        last one gives stage s its lightest segment ending at j: the ends each stage can reach
        follow from that one segment each. False where the last layer is reachable with the caps
        raised by PROOF_MARGIN: some split may fit, which the exact DP decides.
        """
        additive, transient, work = self._layer_values(np.zeros(self.num_layers, dtype=int))
        prefix = np.concatenate([np.zeros((self.num_stages, 1)), np.cumsum(additive, axis=1)], axis=1)
        transient_prefix = np.concatenate([[0.0], np.cumsum(transient)])
        ends, positions = np.arange(1, self.num_layers + 1), np.arange(self.num_layers + 1)
        largest_work = segment_maxima(work) if self.devices == self.num_stages else None
        reached = positions == 0
        for stage in range(self.num_stages):
            last = np.maximum.accumulate(np.where(reached, positions, -1))[:-1]  # last end reached below each end
            start = np.maximum(last, 0)
            work_bytes = largest_work[ends, start] if largest_work is not None else self._chunk_work_bytes(work)
            segment_bytes = (prefix[stage, ends] - prefix[stage, start] + self.stage_overhead_bytes[stage]
                             + np.maximum(transient_prefix[ends] - transient_prefix[start], work_bytes))
            reached = np.concatenate([[False], (last >= 0) & (segment_bytes <= self.mem_cap_bytes[stage] * (1 + PROOF_MARGIN))])
            if not reached.any():
                return True
        return not reached[self.num_layers]

    def stage_mem_bytes(self, boundaries, choices: np.ndarray) -> np.ndarray:
        """[S] memory of each stage of the split `boundaries` (every stage holding a layer) on its
        own, with the given per-layer choice indices (`segment_mem_bytes`)."""
        additive, transient, work = self._layer_values(choices)
        starts, ends = np.asarray(boundaries[:-1]), np.asarray(boundaries[1:])
        prefix = np.concatenate([np.zeros((self.num_stages, 1)), np.cumsum(additive, axis=1)], axis=1)
        stages = np.arange(self.num_stages)
        largest_work = np.maximum.reduceat(work, starts) if self.devices == self.num_stages else self._chunk_work_bytes(work)
        return (prefix[stages, ends] - prefix[stages, starts] + self.stage_overhead_bytes
                + np.maximum(np.add.reduceat(transient, starts), largest_work))

    def _chunk_work_bytes(self, work: np.ndarray) -> float:
        """The working set a chunk is charged where v chunks share a device, each under its own cap:
        1/v of the model's largest. Over the device's chunks that is at least the device's
        max(transients, largest working set), where charging each chunk its own largest would count
        it v times."""
        return float(work.max()) * self.devices / self.num_stages


@dataclass(frozen=True)
class StageSplit:
    """A stage split and what it costs.

    Attributes:
        boundaries: S+1 cut points from 0 to L; stage s holds layers [boundaries[s], boundaries[s+1]).
        choices: per-layer choice index (all 0 when the problem has one choice).
        stage_time_s: T_s per stage (layer times / stage speed).
        stage_mem_bytes: memory of each stage on its own (chunks sharing a device each count their transients).
        objective_s: (m - 1) * max(T_s) + sum(T_s) (`StageProblem.objective_s` when stages share devices).
        method: "dp", "ilp" or "uniform".
        status: a `SolveStatus`; "infeasible" only from `split_uniform` (the split overflows memory).
        gap: relative optimality gap (0 for the exact DP; nan for the uniform baseline, which is not optimised).
        solve_time_s: wall time spent.
    """

    boundaries: tuple[int, ...]
    choices: tuple[int, ...]
    stage_time_s: tuple[float, ...]
    stage_mem_bytes: tuple[float, ...]
    objective_s: float
    method: str
    status: SolveStatus
    gap: float
    solve_time_s: float

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(int(n) for n in np.diff(self.boundaries))


def pipeline_step_time_s(stage_time_s, num_microbatches: int) -> float:
    """1F1B step time with unequal stages: (m - 1) * max_s T_s + sum_s T_s."""
    return (num_microbatches - 1) * float(np.max(stage_time_s)) + float(np.sum(stage_time_s))


def _per_layer(name: str, value) -> np.ndarray:
    array = np.asarray(value, dtype=float)
    if array.ndim == 1:
        array = array[:, None]
    if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
        raise invalid(f"{name}: shape {np.shape(value)}, expected [L] or [L, C] with L, C >= 1")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise invalid(f"{name}: values must be finite and >= 0")
    return array


def make_split(problem, boundaries, choices, method, status, gap, solve_time_s) -> StageSplit:
    """The StageSplit of `boundaries` and per-layer `choices`, its stage times, memory and objective computed."""
    boundaries = np.asarray(boundaries, dtype=int)
    rows = np.arange(problem.num_layers)
    stage_of = np.repeat(np.arange(problem.num_stages), np.diff(boundaries))
    time_s = np.bincount(stage_of, problem.layer_time_s[rows, choices], problem.num_stages) / problem.stage_speed
    stage_mem_bytes = problem.stage_mem_bytes(boundaries, choices)
    return StageSplit(
        boundaries=tuple(int(b) for b in boundaries),
        choices=tuple(int(c) for c in choices),
        stage_time_s=tuple(float(t) for t in time_s),
        stage_mem_bytes=tuple(float(b) for b in stage_mem_bytes),
        objective_s=problem.objective_s(time_s),
        method=method,
        status=status,
        gap=float(gap),
        solve_time_s=solve_time_s,
    )


def segment_sums(stage_layer_values: np.ndarray) -> np.ndarray:
    """[S, L] per-stage layer values -> segment array: [s, j, i] = sum over layers [i, j), inf where j <= i.

    Segment arrays are indexed [stage, end, start] so the DPs reduce over contiguous memory.
    """
    num_stages, num_layers = stage_layer_values.shape
    prefix = np.concatenate([np.zeros((num_stages, 1)), np.cumsum(stage_layer_values, axis=1)], axis=1)
    sums = prefix[:, :, None] - prefix[:, None, :]
    return np.where(_nonempty(num_layers)[None, :, :], sums, np.inf)


def segment_maxima(layer_values: np.ndarray) -> np.ndarray:
    """[L] layer values -> [j, i] = max over layers [i, j), -inf where j <= i."""
    num_layers = len(layer_values)
    from_start = np.where(np.triu(np.ones((num_layers, num_layers), dtype=bool)), layer_values[None, :], -np.inf)
    running = np.maximum.accumulate(from_start, axis=1)  # [i, k] = max over layers [i, k]
    maxima = np.full((num_layers + 1, num_layers + 1), -np.inf)
    maxima[1:, :-1] = running.T
    return np.where(_nonempty(num_layers), maxima, -np.inf)


def _nonempty(num_layers: int) -> np.ndarray:
    """[j, i]: True where the segment [i, j) holds a layer."""
    return np.tril(np.ones((num_layers + 1, num_layers + 1), dtype=bool), k=-1)
