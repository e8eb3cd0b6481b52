"""Pipeline schedule simulation: one training step, event by event, with true dependencies.

Runs the step model and the per-device orders of `costmodel.pipeline` (GPipe, 1F1B, interleaved
1F1B, ZB-H1): every op starts once the previous op on its device and its dependencies end, and
every op comes back as a `PipeEvent`. `priced_step_s` is the pipeline time estimates use: the
closed form where it holds, the simulation where transfers outgrow it.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import repeat

import numpy as np

from costmodel.pipeline import PipeSchedule, check_args, hop_times, step_time_s, warmup_forwards
from costmodel.pipeline_levels import Program, record, run

# Transfers up to this share of a device's shortest op (a chunk's forward or backward, a zero-bubble
# B or W) leave the closed form (`pipeline.step_time_s`) at most 4.8% below the simulation: measured
# on 1500 random pipelines of 2-16 stages within +-25% of each other, every transfer alike (zero
# bubble 4.3%, interleaved 3.0%, 1F1B and GPipe exact; at a tenth, 1.9% and 3.0%), and 1F1B with
# one boundary slower than the rest 4.8%. A quarter keeps the search's simulations to the slow
# links that need them (llama3-405b's 128 one-layer stages).
CLOSED_FORM_HOP_SHARE = 0.25
# Simulated pipelines kept by `priced_step_s`.
SIMULATED_STEPS_CACHE_SIZE = 4096
# Recorded schedule shapes (schedule, pp, m, vpp) kept; a search meets a handful.
RECORDED_SHAPES_CACHE_SIZE = 16


class EventKind(StrEnum):
    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"


@dataclass(frozen=True, slots=True)
class PipeEvent:
    """One op on one device's timeline.

    Attributes:
        device: pipeline rank (0-based).
        kind: F (forward), B (backward; the input gradient only under zero bubble) or W (weight gradient).
        microbatch: micro-batch index (0-based).
        chunk: model chunk on this device (0 unless interleaved); virtual stage `chunk * pp + device`.
        start_s, end_s: when the op runs, from the start of the step.
    """

    device: int
    kind: EventKind
    microbatch: int
    chunk: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class ScheduleResult:
    """Outcome of one simulated step.

    Attributes:
        step_time_s: from the start of the first op to the end of the last.
        bubble_fraction: `1 - sum(busy_s) / (pp * step_time_s)`, the idle share of device time.
        events: every op, grouped by device, each device's in execution order.
        busy_s: seconds each device computes during the step.
    """

    step_time_s: float
    bubble_fraction: float
    events: tuple[PipeEvent, ...]
    busy_s: tuple[float, ...]


# Internal op codes; `_KINDS[code]` is the public kind.
_FORWARD, _BACKWARD, _WEIGHT = 0, 1, 2
_KINDS = (EventKind.FORWARD, EventKind.BACKWARD, EventKind.WEIGHT)
_Op = tuple[int, int, int]  # (op code, micro-batch, chunk)


def simulate(
    schedule: PipeSchedule | str,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    num_microbatches: int,
    vpp: int = 1,
    p2p_s: float | Sequence[float] = 0.0,
    bwd_weight_fraction: float = 0.5,
) -> ScheduleResult:
    """Simulates one step of a pipeline schedule event by event, with true dependencies.

    Every op is timed once (O(pp * m * vpp)); pp=64, m=1000 takes about half a second.

    Args:
        schedule: which schedule (a `PipeSchedule` or its value).
        fwd_s: seconds of one micro-batch forward on each stage (the device's total over its chunks).
        bwd_s: seconds of one micro-batch backward on each stage, weight gradient included.
        num_microbatches: micro-batches per step (`m`).
        vpp: model chunks per device (interleaved only; 1 otherwise).
        p2p_s: seconds from an op's end to the earliest start of its consumer on another device;
            or one per device, for its transfers to and from the next (`pipeline.hop_times`).
        bwd_weight_fraction: share of `bwd_s` that is the weight gradient (used by zero bubble only).

    Returns:
        The step time, bubble fraction, per-device busy seconds and every event.

    Raises:
        ValueError: on inconsistent or out-of-range arguments (the message names the field).

    Example::

        >>> simulate("1f1b", [1.0] * 4, [2.0] * 4, num_microbatches=8).step_time_s
        33.0
    """
    schedule = check_args(schedule, fwd_s, bwd_s, num_microbatches, vpp, p2p_s, bwd_weight_fraction)
    pp, m = len(fwd_s), num_microbatches
    orders, starts, ends = _timeline(schedule, fwd_s, bwd_s, m, vpp, p2p_s, bwd_weight_fraction)
    events: list[PipeEvent] = []
    for d in range(pp):
        codes, microbatches, chunks = zip(*orders[d])
        kinds = map(_KINDS.__getitem__, codes)
        events.extend(map(PipeEvent, repeat(d), kinds, microbatches, chunks, starts[d], ends[d]))
    step = max(device_ends[-1] for device_ends in ends)
    busy = tuple(m * (fwd_s[d] + bwd_s[d]) for d in range(pp))
    bubble = 1.0 - sum(busy) / (pp * step) if step > 0 else 0.0
    return ScheduleResult(step_time_s=step, bubble_fraction=bubble, events=tuple(events), busy_s=busy)


def _timeline(schedule: PipeSchedule, fwd_s: Sequence[float], bwd_s: Sequence[float], m: int, vpp: int,
              p2p_s: float | Sequence[float], bwd_weight_fraction: float) -> tuple[list[list[_Op]], list[list[float]], list[list[float]]]:
    """(orders, starts, ends) per device of a checked `simulate` call: the ops and their times."""
    pp = len(fwd_s)
    orders, program = _recorded(schedule, pp, m, vpp)
    _, starts, ends = run(program, _durations(schedule, fwd_s, bwd_s, vpp, bwd_weight_fraction), _hops(p2p_s, pp), times=True)
    bounds = np.cumsum([len(order) for order in orders])[:-1]
    return orders, [part.tolist() for part in np.split(starts, bounds)], [part.tolist() for part in np.split(ends, bounds)]


def _durations(schedule: PipeSchedule, fwd_s: Sequence[float], bwd_s: Sequence[float], vpp: int,
               bwd_weight_fraction: float) -> list[tuple[float, float, float]]:
    """Each device's forward, backward and weight-gradient op times: a chunk's share of its stage's,
    the weight gradient split from the backward under zero bubble only."""
    split = bwd_weight_fraction if schedule == PipeSchedule.ZERO_BUBBLE else 0.0
    return [(fwd_s[d] / vpp, bwd_s[d] * (1.0 - split) / vpp, bwd_s[d] * split) for d in range(len(fwd_s))]


def _hops(p2p_s: float | Sequence[float], pp: int) -> tuple[float, ...]:
    return hop_times(p2p_s, pp) if pp > 1 else (0.0,)


@functools.lru_cache(maxsize=RECORDED_SHAPES_CACHE_SIZE)
def _recorded(schedule: PipeSchedule, pp: int, m: int, vpp: int) -> tuple[list[list[_Op]], Program]:
    """Every device's order of ops and their recorded program (`pipeline_levels.record`), once per shape."""
    orders = [_device_order(schedule, pp, d, m, vpp) for d in range(pp)]
    return orders, record(orders, m, vpp)


def _device_order(schedule: PipeSchedule, pp: int, device: int, m: int, vpp: int) -> list[_Op]:
    """The ops device `device` runs, in order (see the module docstring)."""
    if schedule == PipeSchedule.GPIPE:
        return [(_FORWARD, j, 0) for j in range(m)] + [(_BACKWARD, j, 0) for j in range(m)]
    total = m * vpp
    warmup = warmup_forwards(schedule, pp, device, m, vpp)

    def forward(k: int) -> _Op:
        group = k // pp
        return _FORWARD, (group // vpp) * pp + k % pp, group % vpp

    def backward(k: int) -> _Op:
        group = k // pp
        return _BACKWARD, (group // vpp) * pp + k % pp, vpp - 1 - group % vpp

    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(forward(warmup + k))
        order.append(backward(k))
    order.extend(backward(k) for k in range(total - warmup, total))
    if schedule != PipeSchedule.ZERO_BUBBLE:
        return order
    with_weights: list[_Op] = []
    for op in order:
        with_weights.append(op)
        if op[0] == _BACKWARD and op[1] >= device:
            with_weights.append((_WEIGHT, op[1] - device, 0))
    with_weights.extend((_WEIGHT, j, 0) for j in range(max(m - device, 0), m))
    return with_weights


def priced_step_s(schedule: PipeSchedule | str, fwd_s: Sequence[float], bwd_s: Sequence[float], num_microbatches: int,
                  vpp: int = 1, p2p_s: float | Sequence[float] = 0.0, bwd_weight_fraction: float = 0.5) -> float:
    """The pipeline time an estimate prices: the closed form (`pipeline.step_time_s`), within 4.8%
    while every transfer is under `CLOSED_FORM_HOP_SHARE` of a device's shortest op, and beyond
    that the simulation, in which transfers queue behind each other and the round trips of the
    schedule wait on them (the closed form falls to half the simulated time on slow links, and
    with unequal stages its transfer count can also put it 9% above). Beyond that share the price is
    never below the closed form at the share's edge (the transfers scaled down to it), so that slower
    links never price a step faster. Same arguments as `simulate`."""
    pp = len(fwd_s)
    split = bwd_weight_fraction if PipeSchedule(schedule) == PipeSchedule.ZERO_BUBBLE else 0.0
    shortest_op_s = min(min(f / vpp, b * (1 - split) / vpp, b * split or math.inf) for f, b in zip(fwd_s, bwd_s))
    hops = hop_times(p2p_s, pp)
    limit_s = CLOSED_FORM_HOP_SHARE * shortest_op_s
    if pp == 1 or max(hops) <= limit_s:
        return step_time_s(schedule, fwd_s, bwd_s, num_microbatches, vpp, p2p_s, bwd_weight_fraction)
    edge = [hop * limit_s / max(hops) for hop in hops]
    return max(_simulated_step_s(str(schedule), tuple(fwd_s), tuple(bwd_s), num_microbatches, vpp, hops, bwd_weight_fraction),
               step_time_s(schedule, fwd_s, bwd_s, num_microbatches, vpp, edge, bwd_weight_fraction))


@functools.lru_cache(maxsize=SIMULATED_STEPS_CACHE_SIZE)
def _simulated_step_s(schedule: str, fwd_s: tuple, bwd_s: tuple, num_microbatches: int, vpp: int, hops: tuple,
                      bwd_weight_fraction: float) -> float:
    """`simulate`'s step time, kept (a search prices the same pipeline under several ZeRO stages), without
    building its events."""
    checked = check_args(schedule, fwd_s, bwd_s, num_microbatches, vpp, hops, bwd_weight_fraction)
    program = _recorded(checked, len(fwd_s), num_microbatches, vpp)[1]
    return run(program, _durations(checked, fwd_s, bwd_s, vpp, bwd_weight_fraction), _hops(hops, len(fwd_s)))[0]
