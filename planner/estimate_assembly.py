"""An Estimate from priced pipeline stages: throughput, MFU, memory rows against each device's
capacity (and host memory share), whether it fits, and the notes that qualify it."""
from __future__ import annotations

import numpy as np

from costmodel.compute import peak_flops_per_s
from costmodel.hardware import DeviceSpec, NodeSpec
from costmodel.memory import MemoryBreakdown
from planner.config import MULTI_STAGE_SCHEDULES, ParallelConfig, pipeline_rounds, torch_runs_rounds
from planner.graph import ModelGraph
from planner.result import Estimate, StagePlan

# One priced stage: its plan, device, node, memory breakdown, host bytes of offloaded states, and
# the dtype it computes in.
PricedStage = tuple[StagePlan, DeviceSpec, NodeSpec, MemoryBreakdown, float, str]


def assemble_estimate(graph: ModelGraph, num_devices: int, dtype: str, config: ParallelConfig, global_batch: int,
                      step_s: float, pipe_s: float, time_breakdown: dict, stages: list[PricedStage],
                      headroom: float, hops_s: tuple[float, ...] = ()) -> Estimate:
    """The Estimate of `config` (`dtype` the one asked for; a stage may compute in another;
    `hops_s` the pipeline's transfer times, `Estimate.pipeline_p2p_s`)."""
    model_flops = (graph.fwd_flops + graph.bwd_flops) * global_batch / graph.micro_batch
    peak = float(np.mean([peak_flops_per_s(device, used) for _, device, _, _, _, used in stages]))
    tflops = model_flops / step_s / num_devices / 1e12
    memory, fits = [], True
    for plan, device, node, breakdown, host_bytes, used in stages:
        host_capacity = node.host_mem_bytes_per_device or None  # unknown: not checked (`_unchecked_host_note`)
        fits &= breakdown.total_bytes <= device.mem_bytes * (1 - headroom) and not (host_capacity and host_bytes > host_capacity)
        memory.append({"stage": plan.index, "device": device.name, "dtype": used,  # fp16 where bf16 is missing
                       "capacity_bytes": device.mem_bytes, **breakdown.to_dict(), "host_bytes": host_bytes,
                       "host_capacity_bytes": host_capacity})
    return Estimate(
        step_time_s=step_s,
        tokens_per_s=global_batch * graph.seq_len / step_s,
        tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / peak,
        peak_memory_bytes=max(breakdown.total_bytes for _, _, _, breakdown, _, _ in stages),
        fits=bool(fits),
        time_breakdown=time_breakdown,
        memory=memory,
        stages=tuple(plan for plan, *_ in stages),
        bubble_fraction=time_breakdown["pp_bubble_s"] / pipe_s if pipe_s > 0 else 0.0,
        config=config,
        pipeline_p2p_s=hops_s,
        seq_len=graph.seq_len,
        global_batch=global_batch,
        notes=(graph.notes + graph.recompute_notes(config.recompute) + _substituted_dtype_note(memory, dtype)
               + _unchecked_host_note(memory) + _partial_round_note(config) + _tp_across_nodes_note(config, stages)
               + _folded_experts_note(config)),
    )


def _folded_experts_note(config: ParallelConfig) -> tuple[str, ...]:
    """A note when ep folds tp into the expert groups (`planner.tp_plan.folded_expert_plan`)."""
    if not config.ep_folds_tp:
        return ()
    return (f"ep={config.ep} folds tp={config.tp} into the expert groups (Megatron-Core's parallel folding, each expert "
            f"whole on its rank): priced with the same expert weights and work per rank as ep={config.ep_over_data} with "
            f"experts split over tp, the all-to-all over {config.ep} consecutive ranks and no tensor-parallel collectives "
            f"in the routing and experts; Plan.apply does not build it",)


def _tp_across_nodes_note(config: ParallelConfig, stages: list[PricedStage]) -> tuple[str, ...]:
    """A note when a tensor-parallel group spans nodes, which the search offers only for a fixed tp."""
    per_node = min(node.devices_per_node for _, _, node, *_ in stages)
    if config.tp > per_node:
        return (f"tp={config.tp} spans nodes of {per_node} devices: its collectives are priced over the NICs (plan keeps "
                f"tp inside a node unless tp is fixed)",)
    if per_node % config.tp:
        return (f"tp={config.tp} does not divide the {per_node} devices of a node: some tensor-parallel groups straddle two "
                f"nodes, and their collectives over the NICs, priced here, set every group's pace; a tp dividing "
                f"{per_node} keeps each group inside a node",)
    return ()


def _partial_round_note(config: ParallelConfig) -> tuple[str, ...]:
    """A note when the schedule is priced for a micro-batch count torch's schedule cannot run
    (`Plan.apply` refuses it; the search never offers it)."""
    m, pp = config.num_microbatches, config.pp
    if pp == 1 or config.schedule not in MULTI_STAGE_SCHEDULES or torch_runs_rounds(m, pp):
        return ()
    return (f"schedule {config.schedule} is priced for {m} micro-batches, but torch's splits them into m // pp = "
            f"{pipeline_rounds(m, pp)} equal rounds on pp={pp}, so Plan.apply refuses it; pick --micro-batch or "
            f"--global-batch so that the micro-batch count is a multiple of its m // pp",)


def _substituted_dtype_note(memory: list[dict], dtype: str) -> tuple[str, ...]:
    """A note when stages compute in another dtype than `dtype` (bf16 asked of a device without it,
    priced in fp16; `Estimate.memory` rows: `device`, `dtype`)."""
    other = {row["device"]: row["dtype"] for row in memory if row["dtype"] != dtype}
    return tuple(f"{device} has no {dtype}: priced in {used}" for device, used in other.items())


def _unchecked_host_note(memory: list[dict]) -> tuple[str, ...]:
    """A note when offloaded states sit in host memory whose size no profile gives (`Estimate.memory`
    rows: `host_bytes`, `host_capacity_bytes` None when unknown, `device`)."""
    unknown = [row for row in memory if row["host_bytes"] > 0 and not row["host_capacity_bytes"]]
    if not unknown:
        return ()
    row = max(unknown, key=lambda r: r["host_bytes"])
    return (f"the host memory of {row['device']} nodes is unknown (no node.host_mem_bytes in its profile), so the "
            f"offloaded optimizer states, {row['host_bytes'] / 2**30:.1f} GiB per device, are not checked against it",)
