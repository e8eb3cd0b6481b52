"""The memory choices a caller of `evaluate` leaves open: the ZeRO stage and the recompute policy.

Published runs and users asking "how fast, and will it fit?" often give the degrees and not these
two (NVIDIA's and Meta's tables state neither). Priced at ZeRO 0 without recompute, such a run
either does not fit, or fits only at a stage split memory has pushed far from balance, where no
framework would run it. So `evaluate` prices the defaults first and keeps them where they fit at a
split memory did not shape (`default_split.memory_shaped_note`); otherwise it prices every ZeRO
stage that shards (the data-parallel and context-parallel ranks) and every recompute policy the
trace measured, for the choices left open, and keeps the fastest that fits (on equal times, the one
saving less memory: the earlier in that order). When none fits, the defaults are priced, with the
changes that would fit (`planner.fit_fixes`). A choice the caller gives is never changed.
"""
from __future__ import annotations

import dataclasses

from planner.config import ParallelConfig
from planner.errors import PlannerError
from planner.estimate import Evaluator
from planner.graph import Recompute
from planner.result import Estimate
from planner.report.units import fmt_bytes

# The keys of the degrees a caller gives that this module fills when left out, with their defaults.
OPEN_DEFAULTS = {"zero": 0, "recompute": Recompute.NONE}


def open_keys(degrees: dict) -> tuple[str, ...]:
    """The memory choices absent from `degrees` (the mapping a caller gave)."""
    return tuple(key for key in OPEN_DEFAULTS if key not in degrees)


def fastest_fitting(evaluator: Evaluator, config: ParallelConfig, estimate: Estimate, global_batch: int,
                    keys: tuple[str, ...], shaped: tuple[str, ...]) -> tuple[ParallelConfig, Estimate, tuple[str, ...]]:
    """`config` (priced as `estimate`, with `memory_shaped_note`'s `shaped`) with its open `keys` set
    to the fastest choice that fits, its estimate and a note saying what was chosen over what;
    `config` itself, `estimate` and () where its defaults fit at a split memory did not shape, or
    where no choice fits."""
    if not keys or (estimate.fits and not shaped):
        return config, estimate, ()
    best = (config, estimate) if estimate.fits else None
    for variant in _variants(evaluator, config, keys):
        if variant == config:
            continue
        try:
            priced = evaluator.estimate(variant, global_batch)
        except PlannerError:
            continue
        if priced.fits and (best is None or priced.step_time_s < best[1].step_time_s):
            best = (variant, priced)
    if best is None or best[0] == config:
        return config, estimate, ()
    chosen, chosen_estimate = best
    picked = ", ".join(f"{key} {getattr(chosen, key)}" for key in keys)
    defaults = " and ".join(f"{key} {getattr(config, key)}" for key in keys)
    if estimate.fits:
        why = f"fits only at a stage split that memory shapes, taking {estimate.step_time_s:.4g} s a step"
    else:
        row = max(estimate.memory, key=lambda r: r["total_bytes"] / r["capacity_bytes"])
        why = f"needs {fmt_bytes(row['total_bytes'])} on stage {row['stage']} of {fmt_bytes(row['capacity_bytes'])}"
    flags = " and ".join(f"--{key}" for key in keys)
    note = (f"{flags} not given: priced at the fastest choice that fits, {picked}; with {defaults} the run {why} "
            f"(give {flags} to price another)")
    return chosen, chosen_estimate, (note,)


def _variants(evaluator: Evaluator, config: ParallelConfig, keys: tuple[str, ...]):
    """`config` with each combination of choices for the open `keys`, the least memory-saving first:
    ZeRO 0..3 (where the states have ranks to shard over), then each measured recompute policy."""
    zeros = range(4) if "zero" in keys and config.shard_ranks > 1 else (config.zero,)
    graph = evaluator.graph
    policies = (sorted(graph.recompute_policies, key=lambda p: -sum(layer.saved_bytes[p] for layer in graph.layers))
                if "recompute" in keys else (config.recompute,))
    for policy in policies:
        for zero in zeros:
            yield dataclasses.replace(config, zero=zero, recompute=policy)
