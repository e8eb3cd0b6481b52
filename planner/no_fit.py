"""What would fit when no configuration does: the closest miss and the levers the search could not pull.

When nothing fits, the search has priced or screened every configuration. The closest miss is the
one with the smallest peak per device. A screened candidate has only its memory floor, which never
exceeds its peak, so the screened ones whose floor is below the closest priced peak are priced in
floor order (at most `CLOSEST_MISS_PRICINGS` of them) and the closest named is always priced.

A remedy is named only where it can help: more devices can unless the fixed tp, pp (and ep) and a
fixed ZeRO-0 leave every device the same model states, which alone overflow it; every micro-batch size,
ZeRO stage, recompute policy and (unless forbidden) optimizer offload were tried already, so those
are named only when a fixed choice held them back, each with what the closest miss then needs
(priced), and not where that is no less. ZeRO-3 shards over the data-parallel ranks, which the
closest miss may not have: that remedy is searched again with it fixed, over every degree the
constraints allow, and names the configuration that then fits or comes closest.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from typing import Callable

from costmodel import memory as memory_model
from costmodel.hardware import Cluster
from costmodel.offload import host_state_bytes
from planner.config import ParallelConfig
from planner.errors import PlannerError, PlannerErrorKind, invalid
from planner.estimate import Evaluator
from planner.graph import Recompute
from planner.config_check import check_config
from planner.space import Rejection
from planner.state_cost import state_options

# Screened candidates priced at most to find the closest miss (each costs one estimate).
CLOSEST_MISS_PRICINGS = 16

GIB = 2**30


def batch_reason(global_batch: int) -> str:
    return f"global_batch={global_batch} is not a multiple of dp"


def closest_miss(evaluator: Evaluator, priced: tuple[float, ParallelConfig] | None,
                 screened: list[tuple[float, ParallelConfig]], global_batch: int,
                 headroom: float) -> tuple[float, ParallelConfig] | None:
    """(peak bytes, config) of the configuration that came closest to fitting (module docstring).

    Args:
        priced: the priced miss with the smallest peak, if any.
        screened: (memory floor, config) of the candidates rejected on their floor alone.
    """
    best = priced
    for floor_bytes, config in sorted(screened, key=lambda miss: miss[0])[:CLOSEST_MISS_PRICINGS]:
        if best is not None and floor_bytes >= best[0]:
            break
        peak_bytes = evaluator.estimate(config, global_batch, headroom=headroom).peak_memory_bytes
        if best is None or peak_bytes < best[0]:
            best = (peak_bytes, config)
    return best


def devices_for_states(evaluator: Evaluator, config: ParallelConfig, offload: bool) -> int:
    """The fewest devices whose memory holds the model states sharded over all of them (ZeRO-3), and
    with `offload` whose hosts hold the offloaded states too (where the host memory is known)."""
    graph, cluster = evaluator.graph, evaluator.cluster
    frozen = sum(layer.frozen_params for layer in graph.layers)
    sharded = dataclasses.replace(config, zero=3, offload_optimizer=offload)
    states = sum(memory_model.model_state_bytes(graph.params, 3, 1, frozen_params=frozen,
                                                **state_options(sharded, evaluator.precision)))
    devices = math.ceil(states / min(g.node.device.mem_bytes for g in cluster.groups))
    host = min(g.node.host_mem_bytes_per_device for g in cluster.groups)
    if offload and host:
        devices = max(devices, math.ceil(host_state_bytes(graph.params - frozen, frozen) / host))
    return devices


def _lever(evaluator: Evaluator, label: str, variant: ParallelConfig, need_bytes: float, usable_bytes: float,
           global_batch: int, headroom: float) -> str | None:
    """The remedy `label` with what the closest miss, changed to `variant`, then needs; None where
    that holds no less. Unpriced where the variant cannot run (other configurations may)."""
    try:
        check_config(evaluator.graph, evaluator.cluster, variant, global_batch, evaluator.code.cp_comm)
    except PlannerError:
        return label
    estimate = evaluator.estimate(variant, global_batch, headroom=headroom)
    verdict = _verdict(label, "the closest", estimate.peak_memory_bytes, need_bytes, usable_bytes)
    row = estimate.host_overflow()
    if verdict is None or row is None:
        return verdict
    devices = math.ceil(evaluator.cluster.num_devices * row["host_bytes"] / row["host_capacity_bytes"])
    return (f"{verdict[:-1]}, but its offloaded states then need {row['host_bytes'] / GIB:.1f} GiB of host memory per "
            f"device of {row['host_capacity_bytes'] / GIB:.1f} GiB: with nodes of more host memory or about {devices}+ devices)")


def _verdict(label: str, what: str, peak_bytes: float, need_bytes: float, usable_bytes: float) -> str | None:
    """`label` with what `what` then holds; None where that is no less than `need_bytes`."""
    if peak_bytes >= need_bytes:
        return None
    return f"{label} ({what} then {'fits at' if peak_bytes <= usable_bytes else 'needs'} {peak_bytes / GIB:.1f} GiB)"


def _whole_nodes(cluster: Cluster, devices: int) -> str:
    """`devices`, rounded up to whole nodes of the devices' usual size beyond one node (what the
    `DEVICE:NODESxGPUS` shorthand builds)."""
    per_node = max(group.node.device.devices_per_node for group in cluster.groups)
    if devices <= per_node:
        return f"{devices} devices"
    nodes = math.ceil(devices / per_node)
    return f"{nodes * per_node} devices in {nodes} nodes of {per_node}"


def nothing_fits(evaluator: Evaluator, global_batch: int, closest: tuple[float, ParallelConfig] | None, evaluated: int,
                 rejected: list[Rejection], host_miss=None, constraints: dict | None = None,
                 headroom: float = 0.0, retry: Callable[[dict], tuple[float, ParallelConfig] | None] = lambda extra: None) -> PlannerError:
    """INSUFFICIENT_MEMORY naming the `closest` miss and what would fit: more devices, and the levers
    a fixed choice held back (module docstring). When offloading the optimizer made a configuration
    fit the devices but not the host's memory (`host_miss`), that leads: more host memory, or more
    devices to shard the states over (unless ZeRO is fixed at 0). INVALID_INPUT with the commonest
    reasons when no configuration was valid at all (`rejected`). `constraints`: the user's fixed choices;
    `retry(extra)`: (peak, config) of the search with `extra` fixed too, its best fit or its closest
    miss (None when nothing was valid).

    The devices named are at least what the model states need, sharded whole (ZeRO-3, offloaded
    where allowed), and at least the closest miss's peak scaled to the capacity."""
    graph, cluster = evaluator.graph, evaluator.cluster
    constraints = constraints or {}
    replicas = (f" or without the fixed --dp-replicate {constraints['dp_replicate']} (its replicas each hold the states)"
                if constraints.get("dp_replicate", 1) > 1 else "")
    capacity = min(g.node.device.mem_bytes for g in cluster.groups)
    candidates = f"{evaluated} candidate" + ("" if evaluated == 1 else "s")
    if host_miss is not None:
        host_bytes, share, host_config = host_miss
        more = (f" or about {math.ceil(cluster.num_devices * host_bytes / share)}+ devices (ZeRO shards the states over "
                f"them)" if constraints.get("zero") != 0 else "")
        return PlannerError(PlannerErrorKind.INSUFFICIENT_MEMORY, (
            f"no plan fits after {candidates}: {host_config.short()} fits the devices with its optimizer states "
            f"offloaded, but they need {host_bytes / GIB:.1f} GiB of host memory per device of {share / GIB:.1f} "
            f"GiB; try nodes with more host memory{more}{replicas}"))
    if closest is None:
        distinct = sorted({(r.what, r.reason) for r in rejected},  # a second pass (offload) rejects the same again
                          key=lambda item: [int(n) for n in re.findall(r"\d+", item[0])], reverse=True)
        by_reason = Counter(reason for _, reason in distinct)
        example = {reason: what for what, reason in distinct}  # the smallest degrees of each reason
        reasons = "; ".join(f"{example[reason]}: {reason}" + (f" (and {count - 1} more)" if count > 1 else "")
                            for reason, count in by_reason.most_common(3))
        fix = "relax the fixed choices or change the global batch"
        splits = [int(what.split("=")[1]) for what, reason in distinct if reason == batch_reason(global_batch)]
        if splits and len(splits) == len(distinct):
            batch, dp = min((math.ceil(global_batch / dp) * dp, dp) for dp in splits)
            fix = f"global_batch={batch} (a multiple of dp={dp}) would split, or relax the fixed choices"
        return invalid(f"no configuration of {graph.name} on {cluster.num_devices} devices is valid: {reasons}; fix: {fix}")
    need, config = closest
    usable = capacity * (1 - headroom)
    offload_tried = constraints.get("allow_offload", True) and "offload_optimizer" not in constraints
    least = min(devices_for_states(evaluator, config, offload) for offload in {False, offload_tried})
    scaled = math.ceil(cluster.num_devices * need / usable)
    remedies = [f"at least {_whole_nodes(cluster, max(least, scaled))} ({scaled} to spread the closest's peak within capacity; "
                f"the model states alone, fully sharded, need {least})"] if _devices_can_help(evaluator, config, constraints, global_batch, usable) else []
    levers = []
    if constraints.get("micro_batch", 1) > 1:
        levers.append(("micro_batch=1", dataclasses.replace(
            config, micro_batch=1, num_microbatches=config.num_microbatches * config.micro_batch)))
    # ZeRO needs data-parallel ranks to shard over: none when the fixed tp and pp take every device.
    shardable = cluster.num_devices // ((constraints.get("tp") or 1) * (constraints.get("pp") or 1)) > 1 and constraints.get("dp") != 1
    saver = {"zero": 3} if "zero" in constraints and config.zero < 3 and shardable else {}
    if constraints.get("recompute", Recompute.FULL) != Recompute.FULL:
        saver["recompute"] = Recompute.FULL
    if not offload_tried and not config.offload_optimizer:
        levers.append(("allowing optimizer offload", dataclasses.replace(config, offload_optimizer=True)))
    remedies += [_lever(evaluator, label, variant, need, usable, global_batch, headroom) for label, variant in levers]
    if saver:
        label = "allowing " + " with ".join(f"{name}={value}" for name, value in saver.items())
        found = retry(saver)
        remedies.append(found and _verdict(label, found[1].short(), found[0], need, usable))
    of = f"{capacity / GIB:.1f} GiB" + (f" ({usable / GIB:.1f} GiB under the {headroom:.0%} headroom)" if headroom else "")
    tries = " or ".join(r for r in remedies if r) or "relaxing the fixed " + ", ".join(
        f"{name}={constraints[name]}" for name in ("tp", "pp", "ep", "zero") if name in constraints)
    return PlannerError(
        PlannerErrorKind.INSUFFICIENT_MEMORY,
        f"no plan fits: the closest ({config.short()}) needs {need / GIB:.1f} GiB per device of {of} "
        f"after {candidates}; try {tries}{replicas}",
    )


def _devices_can_help(evaluator: Evaluator, config: ParallelConfig, constraints: dict, global_batch: int,
                      usable_bytes: float) -> bool:
    """Whether more devices could lower the closest miss's peak: not when the fixed tp and pp (and
    ep, for a model with experts) and a fixed ZeRO-0 give every device the same model states and
    those alone exceed `usable_bytes` (more devices only add replicas then)."""
    experts = any(layer.expert_params for layer in evaluator.graph.layers)
    fixed = all(name in constraints for name in ("tp", "pp")) and (not experts or "ep" in constraints)
    if not fixed or constraints.get("zero") != 0:
        return True
    memory = evaluator.estimate(config, global_batch).memory
    return max(row["weights_bytes"] + row["grads_bytes"] + row["optimizer_bytes"] for row in memory) < usable_bytes
