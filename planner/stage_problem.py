"""The pipeline stage-split problem (`StageProblem`) and its answer (`StageSplit`).

Cut L layers into S contiguous stages that fit memory and minimise 1F1B step time. Inputs are plain
numpy arrays; nothing here knows about torch or hardware.

Model. Stage s holds layers [b_s, b_{s+1}) and, per layer l, one choice c_l (e.g. a recompute policy;
a single choice when the arrays are 1-D). With t, w, a the per-layer time, static bytes and activation
bytes of one micro-batch::

    T_s   = sum_{l in s} t[l, c_l] / speed_s                                   (stage time)
    M_s   = sum_{l in s} (w[l, c_l] + in_flight_s * a[l, c_l]) + overhead_s    (stage memory)
    step  = (m - 1) * max_s T_s + sum_s T_s                                    (1F1B with unequal stages)
    subject to M_s <= cap_s (`split_ilp`: summed over the chunks of one device) and every stage holding
    at least one layer.

Solvers: `planner.stages` (`split_dp`, exact with one choice per layer; `split_uniform`, the
baseline) and `planner.stage_ilp` (`split_ilp`, per-layer choices).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.errors import invalid
from planner.milp import SolveStatus


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
            s % D, whose chunks share their summed capacity (`split_ilp`; the DPs keep each chunk
            under its own, which implies it). None: every stage has a device of its own.
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

    def __post_init__(self):
        if not isinstance(self.num_stages, (int, np.integer)) or self.num_stages < 1:
            raise invalid(f"num_stages={self.num_stages!r}: must be a positive integer")
        if not isinstance(self.num_microbatches, (int, np.integer)) or self.num_microbatches < 1:
            raise invalid(f"num_microbatches={self.num_microbatches!r}: must be a positive integer")
        time_s = _per_layer("layer_time_s", self.layer_time_s)
        for name in ("layer_time_s", "layer_static_bytes", "layer_act_bytes"):
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

    def stage_layer_mem_bytes(self, choices: np.ndarray) -> np.ndarray:
        """[S, L] bytes layer l would add to stage s with the given per-layer choice indices."""
        rows = np.arange(self.num_layers)
        static = self.layer_static_bytes[rows, choices]
        act = self.layer_act_bytes[rows, choices]
        return static[None, :] + self.in_flight[:, None] * act[None, :]


@dataclass(frozen=True)
class StageSplit:
    """A stage split and what it costs.

    Attributes:
        boundaries: S+1 cut points from 0 to L; stage s holds layers [boundaries[s], boundaries[s+1]).
        choices: per-layer choice index (all 0 when the problem has one choice).
        stage_time_s: T_s per stage (layer times / stage speed).
        stage_mem_bytes: memory per device of each stage.
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
    mem_bytes = problem.stage_layer_mem_bytes(choices)[stage_of, rows]
    stage_mem_bytes = np.bincount(stage_of, mem_bytes, problem.num_stages) + problem.stage_overhead_bytes
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
