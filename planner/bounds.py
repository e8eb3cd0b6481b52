"""Lower bounds on a configuration's step time and memory, whatever its stage split.

The search (`planner.search`) prices candidates in the order of these bounds and stops once the
next bound cannot beat the plans it keeps; a candidate over `memory_floor_bytes` is rejected
unpriced. Every bound is at most the priced estimate of any split (tests check it on every
configuration of the exhaustive cases): `pipeline_bound_s` (every device busy with its share of the
layer work, plus the pipeline fill and transfers its schedule cannot avoid) + `tail_bound_s`
(gradient reduction and optimizer step of the average stage).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from costmodel import pipeline
from costmodel.comm import Collective, collective_time_s
from costmodel.hardware import Cluster
from planner.config import ParallelConfig, Schedule
from planner.estimate import COL, Evaluator
from planner.mesh import mesh_groups, stage_devices
from planner.state_cost import dp_exposed_s, grads_pooled, optimizer_step_s, owned_params

# Search effort of `least_slowest_stage_s`: rounds of evenly spaced probes; each round narrows the
# bracket (at most the largest layer's time) 15-fold, so 3 rounds leave it under 0.03% of that
# layer. The bound stays sound at any precision; these only set how tight it is.
MIN_MAX_PROBES = 16
MIN_MAX_ROUNDS = 3
# Distinct (per-layer time vector, stage count) bounds kept; a search touches a few thousand.
MIN_MAX_CACHE_SIZE = 1 << 14


class WorkBound(NamedTuple):
    """Schedule-free parts of a step-time bound per micro-batch, shared by every candidate with the same `work_bound_key`.

    Per layer, t_l and f_l are its time (forward + backward of one micro-batch, exposed communication
    included) and forward time on the device type where each is least, W = sum_l t_l, and r_s >= 1
    the least ratio of a layer's time on stage s's device type to t_l. A step runs m micro-batches.

    Attributes:
        microbatch_s: W, one micro-batch through every layer.
        microbatch_fwd_s: sum_l f_l, the forward part of W.
        fwd_share: phi, the least forward share (f_2 + ... + f_k) / (t_2 + ... + t_k) of the layers after
            the first over any k (the first layer is left out: under ZeRO-3 its backward carries the
            embedding's exposed gathers, which would make phi useless).
        first_layer_s: t_1.
        balanced_s: W / sum_s (1 / r_s): the devices' work per micro-batch T_s >= r_s (their layers'
            t) cannot all be below it; W / pp on a homogeneous cluster.
        slowest_stage_s: M, a lower bound on the least max_s T_s over every contiguous split of the
            t_l into pp stages (layers are indivisible, so some stage holds more than W / pp):
            max(max_l t_l, W / pp) when not `refined`, `least_slowest_stage_s` when refined (on
            stages of different device types, `least_slowest_split_s` over each stage's own times).
        refined: whether slowest_stage_s is the tight bound.
        p2p_s: the least time of one pipeline transfer: the smallest output of a layer that can end
            a stage before the last, sent between stages of the fastest device type (a transfer's
            time grows with its size).
        type_totals: per device type (`Evaluator.device_types` order), the whole model's forward
            and backward seconds and dense, expert and frozen dense parameters per device, for `tail_bound_s`.
    """

    microbatch_s: float
    microbatch_fwd_s: float
    fwd_share: float
    first_layer_s: float
    balanced_s: float
    slowest_stage_s: float
    refined: bool
    p2p_s: float
    type_totals: tuple[tuple[float, float, float, float, float], ...]


def work_bound_key(config: ParallelConfig) -> tuple:
    """What the `WorkBound` of `config` depends on; many candidates share it.

    The work bound sums per-layer compute and exposed communication of one micro-batch, which
    depend neither on the schedule, the micro-batch count or optimizer offload, nor on ZeRO stages
    0-2 (they differ only in memory and in the gradient reduction after the backward); only
    ZeRO-3's parameter gathers add per-layer time (over its shard group, `dp_replicate`). Pricing
    the bound once per key instead of once per candidate saves most of the bound's cost.
    """
    return (config.dp, config.tp, config.pp, config.cp, config.ep, config.micro_batch, config.recompute,
            config.zero == 3, config.dp_replicate if config.zero == 3 else 1, config.sequence_parallel)


def work_bound(evaluator: Evaluator, config: ParallelConfig, refine: bool = True) -> WorkBound:
    """The `WorkBound` of `config` (only the fields `work_bound_key` keeps matter).

    Args:
        refine: compute the tight `slowest_stage_s` (a search over splits) instead of its floor.
    """
    policies = evaluator.policies(config)
    per_stage = evaluator.stage_devices(config.pp)
    types = evaluator.device_types(config.pp)
    tables = {node: evaluator.time_table(config, device, node, policies) for device, node in types}
    layer_s = {node: table[:, COL["fwd_s"]] + table[:, COL["bwd_s"]] for node, table in tables.items()}
    fastest_s = np.min(list(layer_s.values()), axis=0)
    fastest_fwd_s = np.min([table[:, COL["fwd_s"]] for table in tables.values()], axis=0)
    timed = fastest_s > 0
    slowdown = {node: float(np.min(times[timed] / fastest_s[timed])) if timed.any() else 1.0 for node, times in layer_s.items()}
    later_s, later_fwd_s = np.cumsum(fastest_s[1:]), np.cumsum(fastest_fwd_s[1:])
    microbatch_s = float(fastest_s.sum())
    refined = refine or config.pp == 1
    return WorkBound(
        microbatch_s=microbatch_s,
        microbatch_fwd_s=float(fastest_fwd_s.sum()),
        fwd_share=float(np.min(later_fwd_s[later_s > 0] / later_s[later_s > 0])) if np.any(later_s > 0) else 0.0,
        first_layer_s=float(fastest_s[0]),
        balanced_s=microbatch_s / sum(1 / slowdown[node] for _, node in per_stage),
        slowest_stage_s=_slowest_stage_s(fastest_s, layer_s, per_stage, config, refined),
        refined=refined,
        p2p_s=min(collective_time_s(Collective.P2P, float(tables[node][:-1, COL["out_bytes"]].min()) / config.seq_split,
                                    mesh_groups(config, node.devices_per_node).pp, node, evaluator.cluster.oversubscription)
                  for device, node in types) if config.pp > 1 else 0.0,
        type_totals=tuple((float(total[COL["fwd_s"]]), float(total[COL["bwd_s"]]), float(total[COL["dense_params"]]),
                           float(total[COL["expert_params"]]), float(total[COL["frozen_params"]]))
                          for total in (tables[node].sum(axis=0) for _, node in types)),
    )


def _slowest_stage_s(fastest_s: np.ndarray, layer_s: dict, per_stage: list, config: ParallelConfig,
                     refined: bool) -> float:
    """`WorkBound.slowest_stage_s`: its floor, or the least slowest stage over contiguous splits into
    pp stages, with each stage's own device times (`layer_s` by node kind) when the stages sit on
    several node kinds (`pipeline_bound_s` uses it only when vpp = 1)."""
    if not refined:
        return max(float(fastest_s.max()), float(fastest_s.sum()) / config.pp)
    if config.pp > 1 and len(layer_s) > 1:
        return least_slowest_split_s(np.stack([layer_s[node] for _, node in per_stage]))
    return least_slowest_stage_s(fastest_s, config.pp)


def tail_bound_s(evaluator: Evaluator, config: ParallelConfig, bound: WorkBound) -> float:
    """A floor on what follows the pipeline: exposed data-parallel traffic and the optimizer step.

    Both are maxima over stages of a function of the stage's share x_s of the parameters (and its
    compute y_s, which hides the traffic). A collective's time t(x) is concave in its size with
    t(0) >= 0 (min of affine ring and tree terms, plus latency), so t(x) >= x t(X) / X below the
    whole model's X; max(0, x t(X) / X - y) is convex, so the maximum over stages is at least its
    value at the average stage, (exposure of the whole model in one stage) / pp. With several
    device types: the least such value, with the slowest type's compute. The optimizer step is
    linear in the owned parameters; the average stage bounds it the same way. The totals come from
    `bound` (the `WorkBound` of the same key: they depend on neither the ZeRO stage 0-2 nor offload).
    """
    fwd_s = max(totals[0] for totals in bound.type_totals)
    bwd_s = max(totals[1] for totals in bound.type_totals)
    floors = []
    for (device, node), (_, _, dense, expert, frozen) in zip(evaluator.device_types(config.pp), bound.type_totals):
        exposed_s = dp_exposed_s(config, evaluator.precision, node, mesh_groups(config, node.devices_per_node), dense, expert, fwd_s, bwd_s,
                                 evaluator.cluster.oversubscription, evaluator.code.dp_sync, frozen)
        floors.append(exposed_s + optimizer_step_s(config, evaluator.precision, device,
                                                   owned_params(config, node, dense, expert, frozen)))
    return min(floors) / config.pp


def least_slowest_stage_s(layer_s: np.ndarray, stages: int) -> float:
    """Cached `_least_slowest_stage_s`: many candidates share one per-layer time vector."""
    return _least_slowest_cached(np.ascontiguousarray(layer_s, dtype=float).tobytes(), stages)


@functools.lru_cache(maxsize=MIN_MAX_CACHE_SIZE)
def _least_slowest_cached(layer_bytes: bytes, stages: int) -> float:
    return _least_slowest_stage_s(np.frombuffer(layer_bytes), stages)


def _least_slowest_stage_s(layer_s: np.ndarray, stages: int) -> float:
    """A lower bound on max_s T_s over every split of `layer_s` into `stages` contiguous parts.

    The optimum lies in [low, low + max_l t_l] with low = max(max_l t_l, W / stages): packing layers
    left to right under low + max_l t_l closes every part above W / stages, so it needs at most
    `stages` parts. `_least_passing_limit` narrows the bracket with that greedy test (exact for
    contiguous splits) and returns its lower end, which is never above the optimum.
    """
    prefix = np.concatenate([[0.0], np.cumsum(layer_s)])
    if stages == 1:
        return float(prefix[-1])
    low = max(float(layer_s.max()), float(prefix[-1]) / stages)
    return _least_passing_limit(low, low + float(layer_s.max()), lambda limits: _parts_needed(prefix, limits, stages) <= stages)


def least_slowest_split_s(stage_layer_s: np.ndarray) -> float:
    """A lower bound on max_s T_s over every contiguous split when layer l costs stage_layer_s[s, l]
    on stage s (stages on device types of different speeds).

    Greedy packing, each stage in order taking as many layers as fit under a limit, finds a split
    under that limit whenever one exists (a stage that ends later leaves a shorter suffix to the
    rest); letting a stage take no layer only relaxes the problem, so the bound stays sound. The
    bracket runs from the least cost any split can have per stage to everything on the slowest stage.
    """
    stages, _ = stage_layer_s.shape
    prefixes = np.concatenate([np.zeros((stages, 1)), np.cumsum(stage_layer_s, axis=1)], axis=1)
    cheapest = stage_layer_s.min(axis=0)
    low = max(float(cheapest.max()), float(cheapest.sum()) / stages)
    return _least_passing_limit(low, float(prefixes[:, -1].max()), lambda limits: _packs(prefixes, limits))


def _least_passing_limit(low: float, high: float, passes) -> float:
    """Lower end of the bracket [low, high] around the least limit that `passes` (vectorised over
    limits, monotone): each of MIN_MAX_ROUNDS rounds probes MIN_MAX_PROBES evenly spaced limits and
    keeps the sub-bracket where they start to pass."""
    for _ in range(MIN_MAX_ROUNDS):
        limits = np.linspace(low, high, MIN_MAX_PROBES)
        passing = passes(limits)
        first = int(np.argmax(passing))
        if first == 0:
            return float(limits[0]) if passing[0] else low
        low, high = float(limits[first - 1]), float(limits[first])
    return low


def _packs(prefixes: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """Per limit, whether greedy packing with stage-specific layer costs (prefix sums per stage) places every layer."""
    num_layers = prefixes.shape[1] - 1
    ends = np.zeros(len(limits), dtype=int)
    for prefix in prefixes:
        ends = np.maximum(ends, np.searchsorted(prefix, prefix[ends] + limits, side="right") - 1)
    return ends >= num_layers


def _parts_needed(prefix: np.ndarray, limits: np.ndarray, stages: int) -> np.ndarray:
    """Per limit, the parts greedy packing under it takes (capped at stages + 1)."""
    num_layers = len(prefix) - 1
    ends = np.zeros(len(limits), dtype=int)
    parts = np.zeros(len(limits), dtype=int)
    for _ in range(stages + 1):
        open_ = ends < num_layers
        if not open_.any():
            break
        reach = np.searchsorted(prefix, prefix[ends] + limits, side="right") - 1
        ends = np.where(open_, np.maximum(ends + 1, reach), ends)
        parts += open_
    return np.where(ends < num_layers, stages + 1, parts)


def fill_bound_s(microbatch_s: float, m: int, pp: int, share: float) -> float:
    """min over T >= 0 with sum_d T_d = W of max_d (m T_d + share * sum_{d' < d} T_d').

    All terms are equal at the optimum, T_{d+1} = T_d (1 - share / m), which gives
    W share / (1 - (1 - share / m)^pp); m W / pp when share is 0.
    """
    if share <= 0:
        return m * microbatch_s / pp
    # 1 - (1 - share / m)^pp, which rounds to 0 for share / m below 1e-16 when written so
    filled = 1.0 if share >= m else -math.expm1(pp * math.log1p(-share / m))
    return microbatch_s * share / filled


def pipeline_bound_s(config: ParallelConfig, bound: WorkBound) -> float:
    """A step time `config` cannot beat: its `WorkBound` plus the pipeline fill of its schedule.

    With T_d the work per micro-batch of device d, every schedule keeps some device busy
    m max_d T_d >= m max(balanced_s, M) (M only for vpp = 1: the chunks of an interleaved device are
    not contiguous). The fill comes from the "device work" paths `costmodel.pipeline.step_time_s`
    takes the longest of: device d starts once the first forward has crossed the devices before it.

    - 1F1B and interleaved: its last backward must also cross them back, so step >= m T_d +
      sum_{d' < d} T_d' / vpp for every d; over every split, `fill_bound_s` with share 1 / vpp.
      Point-to-point transfers count only on one micro-batch's trip through every chunk and back
      (`critical_transfers` of one micro-batch): the steady state's hide in the slack of stages
      faster than the slowest, which the bound cannot rule out.
    - Zero bubble: the deferred weight gradients end each device's work, so step >= m T_d + F_{<d}
      (the forward time of the devices before d) >= m T_d + phi (sum_{d' < d} T_d' - t_1), i.e.
      `fill_bound_s` with share phi, minus phi t_1; and the first forward crosses every device.
    - GPipe: every forward runs before any backward, step >= sum_d T_d + (m - 1) max_d T_d.
    """
    m, pp, vpp = config.num_microbatches, config.pp, config.vpp
    busy_s = m * max(bound.balanced_s, bound.slowest_stage_s if vpp == 1 else 0.0)
    if pp == 1:
        return busy_s
    transfers_s = pipeline.critical_transfers(config.schedule, pp, m, vpp) * bound.p2p_s
    if config.schedule == Schedule.ZERO_BUBBLE:
        fill_s = fill_bound_s(bound.microbatch_s, m, pp, bound.fwd_share) - bound.fwd_share * bound.first_layer_s
        return max(busy_s, bound.microbatch_fwd_s, fill_s) + transfers_s
    if config.schedule == Schedule.GPIPE:
        return bound.microbatch_s + (m - 1) * busy_s / m + transfers_s
    latency_s = bound.microbatch_s + pipeline.critical_transfers(config.schedule, pp, 1, vpp) * bound.p2p_s
    return max(busy_s, fill_bound_s(bound.microbatch_s, m, pp, 1 / vpp), latency_s)


def memory_floor_bytes(evaluator: Evaluator, config: ParallelConfig) -> float:
    """Bytes the average device of `config` holds at least, whatever the stage split.

    A stage's estimate holds its layers' model states and `in_flight` micro-batches of their
    activations, plus buffers and overhead (left out here). Over all pp stages that is at least
    every layer's states plus the least in-flight count times every layer's activations (each on
    the device type where it is smallest); the fullest stage holds at least the average. Without
    gradient accumulation the gradients are left out (they are not alive at the forward's end,
    where the loss's temporaries are, which count), unless a data-parallel reduce stream keeps their
    blocks reserved (`grads_pooled`). Pipelined ZeRO-3 stages hold all their layers
    gathered only at a backward's end, one chunk's micro-batch of activations fewer
    (`costmodel.memory.stage_memory`): the floor counts that moment.
    """
    policies = evaluator.policies(config)
    tables = [evaluator.layer_table(config, device, node, policies) for device, node in evaluator.device_types(config.pp)]
    grads_held = config.num_microbatches > 1 or grads_pooled(config)
    states = min(float(table[:, COL["static_bytes"]].sum() + table[:, COL["temp_bytes"]].sum()
                       - (0.0 if grads_held else table[:, COL["grad_bytes"]].sum())) for table in tables)
    activations = min(float(table[:, COL["act_bytes"]].sum()) for table in tables)
    in_flight = min(pipeline.in_flight_microbatches(str(config.schedule), config.pp, stage, config.num_microbatches, config.vpp)
                    for stage in range(config.pp)) if config.pp > 1 else 1.0
    if config.zero == 3 and config.pp > 1:
        in_flight = max(0.0, in_flight - 1 / config.vpp)
    return (states + in_flight * activations) / config.pp


def mean_capacity_bytes(cluster: Cluster, pp: int) -> float:
    """Device memory averaged over the pp pipeline stages (the stages may sit on different device types)."""
    return sum(device.mem_bytes for device, _ in stage_devices(cluster, pp)) / pp
