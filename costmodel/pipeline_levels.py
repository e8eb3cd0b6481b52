"""The event simulation of a pipeline step (`pipeline_sim`), recorded once per shape and run level by level.

The simulation is a fixed program of max and + whose shape depends only on
(schedule, pp, m, vpp): an op starts at the later of its device's previous end and its dependency's
arrival and ends a duration later, and a result sent to a neighbour arrives at the later of its
end and the device's link becoming free, plus the hop. Only the durations and hops change between
calls. So the program is recorded once per shape (`record`: every op starts once the previous op
on its device and its dependency end, each at its depth in the dependency graph, its level), and
`run` times it: consecutive ops of a device are chained, so a level holds at most one op per
device and a device's sends keep their order, and each level is one vectorised step over its
devices. An op-by-op loop over the same max and + gives the same times bit for bit, about 25 times
slower for the search's long pipelines (pp 128, 1024 micro-batches: 260k ops).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

_FORWARD, _BACKWARD = 0, 1  # `pipeline_sim`'s op codes (2: weight gradient)


@dataclass(frozen=True)
class _Level:
    """The ops of one level: their index in the devices' orders laid end to end, their devices and
    duration indices (device * 3 + op code), the arrival slot each waits on, and of those that send
    (`sends`, positions in the level) and those that do not (`keeps`), the device, hop index and
    arrival slot they write."""

    ops: np.ndarray
    devices: np.ndarray
    costs: np.ndarray
    waits: np.ndarray
    sends: np.ndarray
    send_devices: np.ndarray
    send_hops: np.ndarray
    send_slots: np.ndarray
    keeps: np.ndarray
    keep_slots: np.ndarray


@dataclass(frozen=True)
class Program:
    """The recorded walk of one pipeline shape, level by level."""

    levels: tuple[_Level, ...]
    slots: int  # arrival slots: forwards, backwards, then the always-zero one and a sink
    num_ops: int


def run(program: Program, durations: Sequence[tuple[float, float, float]], hops_s: Sequence[float],
        times: bool = False) -> tuple[float, np.ndarray | None, np.ndarray | None]:
    """(step time, starts, ends) that `pipeline_sim`'s simulation gives for the orders `program`
    recorded, with each device's forward, backward and weight-gradient op times (`durations`) and
    transfer times (`hops_s`, `pipeline.hop_times`); with `times`, every op's start and end in the
    devices' orders laid end to end, else None for both."""
    cost = np.asarray(durations, dtype=float).ravel()
    hops = np.asarray(hops_s, dtype=float)
    arrival = np.zeros(program.slots)
    device_end = np.zeros(len(durations))
    link_free = np.zeros(len(durations))
    starts = np.zeros(program.num_ops) if times else None
    ends = np.zeros(program.num_ops) if times else None
    for level in program.levels:
        start = np.maximum(device_end[level.devices], arrival[level.waits])
        end = start + cost[level.costs]
        device_end[level.devices] = end
        if times:
            starts[level.ops], ends[level.ops] = start, end
        if len(level.sends):
            arrived = np.maximum(end[level.sends], link_free[level.send_devices]) + hops[level.send_hops]
            link_free[level.send_devices] = arrived
            arrival[level.send_slots] = arrived
        if len(level.keeps):
            arrival[level.keep_slots] = end[level.keeps]
    return float(device_end.max()), starts, ends


def record(orders: Sequence[Sequence[tuple[int, int, int]]], m: int, vpp: int) -> Program:
    """The program of the per-device `orders` (`pipeline_sim._device_order`'s (op code, micro-batch,
    chunk) lists). A device advances until its next op waits on a result not yet produced and notes
    which; producing it puts the device back on the work stack. A forward of virtual stage s > 0
    waits on stage s - 1's forward of its micro-batch, a backward of stage s below the last on
    stage s + 1's backward; weight gradients wait on nothing else."""
    pp = len(orders)
    last_stage = vpp * pp - 1
    results = (last_stage + 1) * m
    zero, sink = 2 * results, 2 * results + 1
    forward_level, backward_level = [-1] * results, [-1] * results
    waits_forward, waits_backward = [-1] * pp, [-1] * pp
    cursor, device_level = [0] * pp, [0] * pp
    offsets = np.cumsum([0, *map(len, orders)]).tolist()
    ops: list[tuple[int, int, int, int, int, int, bool, int]] = []  # level, op, device, cost, wait, slot, sends, hop
    pending = list(range(pp))
    while pending:
        device = pending.pop()
        order, position, level = orders[device], cursor[device], device_level[device]
        next_device, previous_device = (device + 1) % pp, (device - 1) % pp
        while position < len(order):
            code, mb, chunk = order[position]
            stage = chunk * pp + device
            ready, wait = 0, zero
            if code == _FORWARD and stage > 0:
                key = (stage - 1) * m + mb
                if forward_level[key] < 0:
                    waits_forward[device] = key
                    break
                ready, wait = forward_level[key], key
            elif code == _BACKWARD and stage < last_stage:
                key = (stage + 1) * m + mb
                if backward_level[key] < 0:
                    waits_backward[device] = key
                    break
                ready, wait = backward_level[key], results + key
            level = max(level, ready) + 1
            position += 1
            slot, sends, hop = sink, False, 0
            if code == _FORWARD:
                key = stage * m + mb
                forward_level[key] = level
                slot, sends, hop = key, stage < last_stage, device
                if waits_forward[next_device] == key:
                    waits_forward[next_device] = -1
                    pending.append(next_device)
            elif code == _BACKWARD:
                key = stage * m + mb
                backward_level[key] = level
                slot, sends, hop = results + key, stage > 0, previous_device
                if waits_backward[previous_device] == key:
                    waits_backward[previous_device] = -1
                    pending.append(previous_device)
            ops.append((level, offsets[device] + position - 1, device, device * 3 + code, wait, slot, sends, hop))
        cursor[device], device_level[device] = position, level
    if any(cursor[d] < len(orders[d]) for d in range(pp)):
        raise RuntimeError("pipeline schedule deadlocked: the per-device orders are inconsistent")
    columns = np.array(sorted(ops, key=lambda op: op[0]), dtype=np.int64).T
    bounds = np.flatnonzero(np.diff(columns[0])) + 1
    return Program(levels=tuple(_levels(columns, bounds)), slots=2 * results + 2, num_ops=offsets[-1])


def _levels(columns: np.ndarray, bounds: np.ndarray) -> list[_Level]:
    """One `_Level` per run of equal levels in the level-sorted op columns."""
    levels = []
    for _, ops, devices, costs, waits, slots, sends, hops in zip(*(np.split(column, bounds) for column in columns)):
        sending = sends.astype(bool)
        levels.append(_Level(ops=ops, devices=devices, costs=costs, waits=waits, sends=np.flatnonzero(sending),
                             send_devices=devices[sending], send_hops=hops[sending], send_slots=slots[sending],
                             keeps=np.flatnonzero(~sending), keep_slots=slots[~sending]))
    return levels
