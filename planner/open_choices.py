"""The ZeRO stage a caller of `evaluate` leaves open.

Published runs and users asking "how fast, and will it fit?" often give the degrees and not the ZeRO
stage (NVIDIA's and Meta's tables state none). Priced at ZeRO 0, such a run either does not fit
where sharding its states would let it, or fits only at a stage split memory has pushed far from
balance, where no framework would run it. So `evaluate` prices ZeRO 0 first and keeps it where it
fits at a split memory did not shape (`default_split.memory_shaped_note`); otherwise it prices every
ZeRO stage that shards (over the data-parallel and context-parallel ranks) and keeps the fastest
that fits (on equal times, the lower stage). Sharding the states costs little time; recompute trades
up to a third of the step for memory, so it is never assumed: a configuration that fits only with it
is priced as given, with the recompute that would fit among its priced fixes (`planner.fit_fixes`).
(Assumed where the memory model is high for a run's training code, recompute took NVIDIA's NeMo
24.07 rows, which state neither, from 11.9% to 19.7% off in throughput.) A ZeRO stage the caller
gives is never changed.
"""
from __future__ import annotations

import dataclasses

from planner.config import ParallelConfig
from planner.errors import PlannerError
from planner.estimate import Evaluator
from planner.result import Estimate
from planner.report.units import fmt_bytes

def fastest_fitting_zero(evaluator: Evaluator, config: ParallelConfig, estimate: Estimate, global_batch: int,
                         shaped: tuple[str, ...]) -> tuple[ParallelConfig, Estimate, tuple[str, ...]]:
    """`config` (priced as `estimate`, with `memory_shaped_note`'s `shaped`) at the fastest ZeRO stage
    that fits, its estimate and a note saying what was chosen over what; `config` itself, `estimate`
    and () where its stage fits at a split memory did not shape, or where no stage fits."""
    if estimate.fits and not shaped:
        return config, estimate, ()
    best = (config, estimate) if estimate.fits else None
    for zero in range(1, 4) if config.shard_ranks > 1 else ():
        variant = dataclasses.replace(config, zero=zero)
        try:
            priced = evaluator.estimate(variant, global_batch)
        except PlannerError:
            continue
        if priced.fits and (best is None or priced.step_time_s < best[1].step_time_s):
            best = (variant, priced)
    if best is None or best[0] == config:
        return config, estimate, ()
    if estimate.fits:
        why = f"fits only at a stage split that memory shapes, taking {estimate.step_time_s:.4g} s a step"
    else:
        row = max(estimate.memory, key=lambda r: r["total_bytes"] / r["capacity_bytes"])
        why = f"needs {fmt_bytes(row['total_bytes'])} on stage {row['stage']} of {fmt_bytes(row['capacity_bytes'])}"
    note = (f"--zero not given: priced at the fastest ZeRO stage that fits, {best[0].zero}; with ZeRO {config.zero} "
            f"the run {why} (give --zero to price another)")
    return best[0], best[1], (note,)
