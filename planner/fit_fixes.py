"""What the memory choices of an evaluated configuration buy, and what makes one that does not fit, fit.

Selective recompute reruns the attention core to drop what it keeps for backward: the scores of an
unfused attention. A fused (flash) kernel keeps no scores, so there it drops almost nothing and
costs the rerun: `idle_recompute_note` says so.

`evaluate` prices the configuration a user gives. When it does not fit, each single change that can
only lower its memory is priced too, with the stage split chosen for it:

- a recompute policy the trace measured that keeps fewer bytes per layer than the given one;
- each higher ZeRO stage, where the states have data-parallel ranks to shard over;
- each smaller micro-batch that divides the given one (the step keeps its global batch);
- optimizer offload;
- a pipeline's received tensors in transient buffers (training code such as Megatron-LM), where
  the given training code preallocates one per micro-batch.

The changes that fit are returned fastest first; when none does, the changes of the configuration
all made at once, if that fits. A change that cannot exist for the model and cluster is left out.
"""
from __future__ import annotations

import dataclasses

from planner.config import ParallelConfig
from planner.config_check import check_config
from planner.errors import PlannerError
from planner.estimate import Evaluator
from planner.graph import Recompute
from planner.pipeline_buffers import PipeBuffers
from planner.result import Estimate, Fix

# Fitting changes named at most; the rest are slower than these.
MAX_FIXES = 3

# Selective recompute that drops less than this fraction of the bytes the layers keep without
# recompute, and costs a tenth of it or more of the step, is noted as buying nothing.
IDLE_RECOMPUTE_FRACTION = 0.01


def idle_recompute_note(evaluator: Evaluator, config: ParallelConfig, estimate: Estimate,
                        global_batch: int) -> tuple[str, ...]:
    """A note where `config` recomputes selectively, its stages' activations (`estimate`) are within
    IDLE_RECOMPUTE_FRACTION of those without recompute and the rerun costs time (module docstring);
    () otherwise."""
    if config.recompute is not Recompute.SELECTIVE:
        return ()
    kept = evaluator.estimate(dataclasses.replace(config, recompute=Recompute.NONE), global_batch)
    kept_bytes = sum(row["activations_bytes"] for row in kept.memory)
    dropped = kept_bytes - sum(row["activations_bytes"] for row in estimate.memory)
    if (not kept_bytes or dropped >= IDLE_RECOMPUTE_FRACTION * kept_bytes
            or estimate.step_time_s <= kept.step_time_s * (1 + IDLE_RECOMPUTE_FRACTION / 10)):
        return ()
    op_level = (", and torchtitan's op-level selective checkpointing is --recompute selective_op"
                if Recompute.SELECTIVE_OP in evaluator.graph.recompute_policies else "")
    return (f"--recompute selective drops {dropped / kept_bytes:.1%} of the activations: the attention cores it "
            f"reruns keep no scores (fused kernels); without it the step takes {kept.step_time_s:.4g} s, not "
            f"{estimate.step_time_s:.4g} s{op_level}",)


def _kept_bytes(evaluator: Evaluator, policy: Recompute) -> int:
    """Bytes every layer keeps for backward under `policy`, summed (one micro-batch)."""
    return sum(layer.saved_bytes[policy] for layer in evaluator.graph.layers)


def fit_fixes(evaluator: Evaluator, config: ParallelConfig, estimate: Estimate, global_batch: int) -> tuple[Fix, ...]:
    """The priced changes of `config` (whose `estimate` does not fit) that fit, fastest first, at
    most MAX_FIXES; else the one made of all its configuration changes together, if that fits; else ()."""
    if estimate.fits:
        return ()
    priced = [fix for change, variant, code_evaluator in _changes(evaluator, config)
              if (fix := _priced(code_evaluator, change, variant, global_batch)) is not None]
    fitting = sorted((fix for fix in priced if fix.fits), key=lambda fix: fix.step_time_s)
    if fitting:
        return tuple(fitting[:MAX_FIXES])
    together = _all_at_once(evaluator, config)
    if together is None:
        return ()
    change, variant = together
    fix = _priced(evaluator, change, variant, global_batch, combined=True)
    return (fix,) if fix is not None and fix.fits else ()


def _changes(evaluator: Evaluator, config: ParallelConfig) -> list[tuple[str, ParallelConfig, Evaluator]]:
    """(flags, variant, evaluator pricing it) of every single change (module docstring)."""
    changes = [(f"--recompute {policy}", dataclasses.replace(config, recompute=policy), evaluator)
               for policy in _leaner_policies(evaluator, config.recompute)]
    if config.shard_ranks > 1:
        changes += [(f"--zero {zero}", dataclasses.replace(config, zero=zero), evaluator)
                    for zero in range(config.zero + 1, 4)]
    changes += [(f"--micro-batch {micro_batch}", dataclasses.replace(
                    config, micro_batch=micro_batch, num_microbatches=config.num_microbatches * config.micro_batch // micro_batch),
                 evaluator)
                for micro_batch in range(config.micro_batch - 1, 0, -1) if config.micro_batch % micro_batch == 0]
    if not config.offload_optimizer:
        changes.append(("--offload-optimizer", dataclasses.replace(config, offload_optimizer=True), evaluator))
    if config.pp > 1 and evaluator.code.pp_buffers is PipeBuffers.PREALLOCATED:
        transient = Evaluator(evaluator.graph, evaluator.cluster, evaluator.dtype, evaluator.table,
                              code=dataclasses.replace(evaluator.code, pp_buffers=PipeBuffers.TRANSIENT))
        changes.append(("--pp-buffers transient", config, transient))
    return changes


def _leaner_policies(evaluator: Evaluator, given: Recompute) -> list[Recompute]:
    """The measured recompute policies whose layers keep fewer bytes than `given`'s."""
    kept = {policy: _kept_bytes(evaluator, policy) for policy in evaluator.graph.recompute_policies}
    return [policy for policy in kept if kept[policy] < kept.get(given, 0)]


def _all_at_once(evaluator: Evaluator, config: ParallelConfig) -> tuple[str, ParallelConfig] | None:
    """The leanest recompute, ZeRO-3 (where it shards), micro-batch 1 and optimizer offload together,
    where that changes more than one choice of `config`."""
    leanest = min(_leaner_policies(evaluator, config.recompute), key=lambda policy: _kept_bytes(evaluator, policy),
                  default=config.recompute)
    variant = dataclasses.replace(
        config, recompute=leanest, zero=3 if config.shard_ranks > 1 else config.zero, micro_batch=1,
        num_microbatches=config.num_microbatches * config.micro_batch, offload_optimizer=True)
    flags = [flag for flag, changed in (
        (f"--recompute {variant.recompute}", variant.recompute != config.recompute),
        (f"--zero {variant.zero}", variant.zero != config.zero),
        ("--micro-batch 1", config.micro_batch > 1),
        ("--offload-optimizer", not config.offload_optimizer)) if changed]
    return (" ".join(flags), variant) if len(flags) > 1 else None


def _priced(evaluator: Evaluator, change: str, variant: ParallelConfig, global_batch: int,
            combined: bool = False) -> Fix | None:
    """`variant` priced as a Fix named `change`; None where it cannot exist."""
    try:
        check_config(evaluator.graph, evaluator.cluster, variant, global_batch, evaluator.code.cp_comm)
        estimate = evaluator.estimate(variant, global_batch)
    except PlannerError:
        return None
    return Fix(change=change, step_time_s=estimate.step_time_s, peak_memory_bytes=estimate.peak_memory_bytes,
               fits=estimate.fits, combined=combined)
