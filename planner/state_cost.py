"""What model states cost in time: exposed data-parallel gradient reduction and parameter gathers,
the optimizer step, and how the states are stored (the storage options `costmodel.memory` takes).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from costmodel import memory as memory_model
from costmodel.comm import Collective, CommGroup, collective_time_s
from costmodel.hardware import DeviceSpec, NodeSpec
from costmodel.offload import offload_step_s
from planner.config import ParallelConfig
from planner.mesh import expert_data_group

# Mixed-precision Adam touches, per parameter and step, fp32 master weight, two fp32 moments and
# the fp32 gradient (read 16 B) and writes master + moments + the bf16 weight copy (14 B).
# Counted from torch.optim.AdamW's fused update; bandwidth bound.
OPTIMIZER_BYTES_PER_PARAM = 30
# fp32 Adam: reads weight, gradient and both moments (16 B), writes weight and moments (12 B).
FP32_OPTIMIZER_BYTES_PER_PARAM = 28

# Gradients are reduced in fp32: Megatron-LM accumulates and all-reduces main_grad in fp32 for
# bf16 training (`accumulate_allreduce_grads_in_fp32`), and torchtitan's FSDP2 mixed precision
# uses reduce_dtype=float32.
GRAD_REDUCE_BYTES_PER_PARAM = 4

# Gradients are also kept in fp32 (Megatron's main_grad buffer; FSDP2 gradients on the fp32
# sharded parameters): 2 + 4 + 12 = 18 bytes per parameter with mixed-precision Adam, the figure
# behind Korthikanti et al. 2022, Figure 1.
GRAD_BYTES_PER_PARAM = memory_model.FP32_GRAD_BYTES_PER_PARAM

# Parameter bytes per second one device fetched under DeepSpeed ZeRO-3 v0.3 (PyTorch 1.8): on one
# 8 x A100 NVSwitch node (p4d.24xlarge) a 5.1B-parameter BERT's forward took 470-480 ms under ZeRO-3
# against 60 ms under ZeRO-2 (DeepSpeed issue #1174 and PR #1188, June 2021), i.e. 10.2 GB of fp16
# parameters in about 415 ms. NCCL all-gathers on that node run about ten times faster: the bound was
# the implementation (every all_gather synchronised the device; gathered parameters were copied out
# from Python), so it holds whatever the links.
BLOCKING_FETCH_BYTES_PER_S = 2 * 5.12e9 / 0.415


# FSDP2, which `Plan.apply` runs data parallelism with, moves parameters and gradients through flat
# communication buffers (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). On the compute
# stream, where they delay compute on any device: each gather copies the gathered parameters out of
# its buffer (`foreach_all_gather_copy_out`: read and write, weight dtype), and each reduction copies
# the gradients into its buffer, cast to the fp32 reduce dtype (`foreach_reduce_scatter_copy_in`:
# weight dtype read, 4 B written). On its side streams, hidden where communication overlaps compute:
# each gather copies the shard in, cast from the fp32 master (`all_gather_copy_in`: 4 B read,
# weight dtype written), and each reduction's fp32 output shard is read and written once more
# (division by the group size or accumulation into the gradient).
MASTER_BYTES_PER_PARAM = 4
REDUCED_SHARD_PASS_BYTES_PER_PARAM = 8


class Zero3Fetch(StrEnum):
    """How the training code fetches ZeRO-3 (FSDP) parameters.

    PREFETCH: FSDP, FSDP2 and later DeepSpeed: the next layer's all-gather runs beside the current
    layer's compute, and one gather serves a layer's recomputed forward and its backward.
    BLOCKING: DeepSpeed ZeRO-3 before PR #1188 (spring 2021): every fetch stalls compute and moves
    at most `BLOCKING_FETCH_BYTES_PER_S`; a fully recomputed layer is fetched again for its
    recomputed forward. Gradient reduce-scatters overlap the backward in both.
    """

    PREFETCH = "prefetch"
    BLOCKING = "blocking"

    @property
    def gathered_layers(self) -> int:
        """Layers whose whole parameters are gathered at once: the one computing and, when
        prefetching, the next (FSDP2's default forward prefetch of one layer)."""
        return 2 if self is Zero3Fetch.PREFETCH else 1


class DpSync(StrEnum):
    """How the training code synchronises data-parallel model states below ZeRO-3.

    OVERLAPPED: the gradients reduce bucket by bucket during the last micro-batch's backward, and
    ZeRO-1/2 gather the updated parameters ahead of the next forward (FSDP2, DDP, Megatron-Core's
    overlapped gradient reduction and parameter gather).
    BLOCKING: after the last backward the whole fp32 gradients are all-reduced, under ZeRO-1 too
    (and ZeRO-2 under pipelining, which reduces once per step as ZeRO-1 does: DeepSpeed's pipeline
    engine runs no stage above 1), and ZeRO-1 all-gathers the updated parameters after the optimizer
    step; nothing overlaps.
    DeepSpeed's pipeline engine with its BF16_Optimizer (Megatron-DeepSpeed, BLOOM): its
    `ReduceGrads` step runs after the schedule and all-reduces `get_grads_for_reduction()`, the
    fp32 gradient buffers, and `step()` then gathers the bf16 partitions (`all_gather_dp_groups`).
    """

    OVERLAPPED = "overlapped"
    BLOCKING = "blocking"


@dataclass(frozen=True)
class Precision:
    """How training in one dtype stores and moves model states.

    Attributes:
        weight_bytes: bytes per working weight (what ZeRO all-gathers and what a device computes with).
        optimizer: the state layout `costmodel.memory` prices.
        optimizer_step_bytes: bytes the Adam update reads and writes per owned parameter.
    """

    weight_bytes: float
    optimizer: memory_model.Optimizer
    optimizer_step_bytes: float


# bf16/fp16 weights with fp32 master weights, gradients and moments; fp8 recipes keep bf16 weights.
MIXED_PRECISION = Precision(2, memory_model.Optimizer.ADAM_MIXED, OPTIMIZER_BYTES_PER_PARAM)
# fp32 weights, gradients and moments, no master copy.
FP32_PRECISION = Precision(4, memory_model.Optimizer.ADAM_FP32, FP32_OPTIMIZER_BYTES_PER_PARAM)


def precision_of(dtype: str) -> Precision:
    """The model-state precision of training in `dtype` ("fp32": plain fp32; others: mixed precision)."""
    return FP32_PRECISION if dtype == "fp32" else MIXED_PRECISION


def fsdp2_copy_s(precision: Precision, device: DeviceSpec, params: float, shard_params: float, gathers: int,
                 reductions: int, trainable_fraction: float = 1.0) -> float:
    """Seconds of FSDP2's buffer copies on one device for `gathers` parameter gathers and `reductions`
    gradient reductions of `params` parameters, of which it holds `shard_params` (see
    MASTER_BYTES_PER_PARAM) and `trainable_fraction` take gradients (only those are reduced): the
    compute-stream copies always, the side-stream ones where the device does not overlap
    communication with compute; at the device's memory bandwidth."""
    reduced = reductions * trainable_fraction
    on_compute = params * (gathers * 2 * precision.weight_bytes + reduced * (precision.weight_bytes + GRAD_REDUCE_BYTES_PER_PARAM))
    on_side = shard_params * (gathers * (MASTER_BYTES_PER_PARAM + precision.weight_bytes)
                              + reduced * REDUCED_SHARD_PASS_BYTES_PER_PARAM)
    moved = on_compute + (0.0 if device.comm_overlaps_compute else on_side)
    return moved / (device.mem_bw_bytes_per_s * device.mem_bw_efficiency)


def dp_exposed_s(config: ParallelConfig, precision: Precision, node: NodeSpec, groups, dense: float, expert: float,
                 fwd_s: float, bwd_s: float, oversubscription: float, sync: DpSync = DpSync.OVERLAPPED,
                 frozen: float = 0.0, first_gathered: tuple[float, float] = (0.0, 0.0),
                 last_reduced: tuple[float, float] = (0.0, 0.0)) -> float:
    """Data-parallel traffic not hidden behind compute, per step, and FSDP2's buffer copies.

    The gradient reduction (all-reduce, or reduce-scatter under ZeRO-1/2) runs bucket by bucket
    during the backward of the last micro-batch; ZeRO-2 keeps only its shard of the gradients, so
    without pipelining it reduces during every micro-batch's backward (DeepSpeed's ZeRO-2, FSDP
    with gradient sync on; `planner.apply`), while pipeline stages reduce once after the schedule.
    The ZeRO-1/2 parameter all-gather runs bucket by bucket ahead of the next step's first forward
    (Megatron-Core's overlapped param gather, FSDP's prefetch). Each is exposed by what exceeds its
    one-micro-batch window. The parameters stay gathered over the micro-batches, so FSDP2 copies
    them out of its buffer once per step (`fsdp2_copy_s`), and the gradients in once per reduction.
    Without data parallelism there is no traffic, but mixed precision still runs through FSDP2, on
    a one-rank mesh (`planner.apply`), and so do its copies. Under `DpSync.BLOCKING` nothing hides
    the traffic and ZeRO-1 reduces with an all-reduce. ZeRO-3 pipeline stages gather and reduce
    like ZeRO-2 once per step, and re-gather once per micro-batch (`zero3_exposed_s`); without
    pipelining ZeRO-3's traffic is all per micro-batch. The `frozen` part of the dense parameters
    takes no gradient: it is gathered, never reduced.

    Hybrid sharding (`ParallelConfig.dp_replicate`): gathers and reduce-scatters run inside a
    replica's shard group, and the reduced shards are all-reduced across replicas once per step,
    in the last backward (FSDP2's `set_requires_all_reduce`, `planner.apply`), ZeRO-3's too.

    Every layer is its own communication unit (`planner.apply.data_parallel`), so whatever the
    windows, two units are exposed: `first_gathered`, the (dense, expert) parameters of the stage's
    first layer that has any, gathered before the forward's first kernel, and `last_reduced`, the
    trainable (dense, expert) parameters of its first layer that has such, whose gradients are the
    backward's last, reduced after it. Without them (0s) the result is a floor (`planner.bounds`).
    """
    blocking = sync is DpSync.BLOCKING and config.zero < 3
    if blocking or not node.device.comm_overlaps_compute:
        fwd_s = bwd_s = 0.0  # nothing hides the traffic
    replica_s = replica_all_reduce_s(dense - frozen + expert, groups, node, oversubscription)
    first_replica_s = replica_all_reduce_s(sum(last_reduced), groups, node, oversubscription)
    if config.zero == 3 and config.pp == 1:
        return max(first_replica_s, replica_s - bwd_s)
    reductions = config.num_microbatches if config.zero == 2 and config.pp == 1 else 1
    expert_group = expert_data_group(config, node)
    shard = dense / groups.shard.size + expert / expert_group.size if config.zero else dense + expert
    copies_s = fsdp2_copy_s(precision, node.device, dense + expert, shard, gathers=1, reductions=reductions,
                            trainable_fraction=_trainable_fraction(dense, expert, frozen))
    if config.dp * config.cp == 1:
        return 0.0 if precision is FP32_PRECISION else copies_s
    once_per_step = config.zero == 1 or (config.zero == 2 and config.pp > 1)
    kind = Collective.ALL_REDUCE if config.zero == 0 or (blocking and once_per_step) else Collective.REDUCE_SCATTER
    def reduce_s(params: float, experts: float) -> float:
        return state_collective_s(kind, GRAD_REDUCE_BYTES_PER_PARAM, params, experts, groups.shard, expert_group, node,
                                  oversubscription)

    def gather_s(params: float, experts: float) -> float:
        if config.zero == 0:
            return 0.0
        return state_collective_s(Collective.ALL_GATHER, precision.weight_bytes, params, experts, groups.shard,
                                  expert_group, node, oversubscription)

    step_reduce_s = reduce_s(dense - frozen, expert)
    last_reduce_s = reduce_s(*last_reduced) + first_replica_s
    return ((reductions - 1) * max(0.0, step_reduce_s - bwd_s) + max(last_reduce_s, step_reduce_s + replica_s - bwd_s)
            + max(gather_s(*first_gathered), gather_s(dense, expert) - fwd_s) + copies_s)


def replica_all_reduce_s(trainable: float, groups, node: NodeSpec, oversubscription: float) -> float:
    """Seconds of hybrid sharding's all-reduce of the reduced fp32 gradient shards of `trainable`
    parameters across the replicas (0 without replicas; experts, only without expert parallelism,
    shard as the dense parameters do)."""
    if groups.replicate.size == 1 or trainable <= 0:
        return 0.0
    return collective_time_s(Collective.ALL_REDUCE, trainable * GRAD_REDUCE_BYTES_PER_PARAM / groups.shard.size,
                             groups.replicate, node, oversubscription)


def zero3_exposed_s(fetch: Zero3Fetch, precision: Precision, dense: float, expert: float, groups, expert_group: CommGroup,
                    node: NodeSpec, oversubscription: float, fwd_window_s: float, bwd_window_s: float,
                    refetch: bool, pipelined: bool, frozen: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's ZeRO-3 traffic per micro-batch that its compute does
    not hide: the all-gather of its `dense` and `expert` parameters and the reduce-scatter of their
    gradients, against its forward and backward (with recompute) compute windows, and under
    prefetch (FSDP2) the buffer copies of its gather in each pass and of its reduction
    (`fsdp2_copy_s`). `refetch`: the layer is recomputed whole, which a blocking fetch gathers again
    (`Zero3Fetch`).

    `pipelined`: the layer is in a pipeline stage of `torch.distributed.pipelining`, which keeps
    its parameters gathered from each backward to the next forward and defers the reduce-scatter
    to the step's end. A layer's parameters are then gathered by every forward that follows a
    forward or starts the step, and by every backward that follows a forward: m + 1 times per step
    in any schedule (each run of k forwards gathers k times and the backward after it once, plus
    one for the step's first forward). Here one gather per micro-batch, in the backward; the extra
    gather and the reduce-scatter are ZeRO-2's once-per-step traffic (`dp_exposed_s`). The `frozen`
    part of the dense parameters is gathered, never reduced. Under hybrid sharding the gathers and
    reduce-scatters stay inside the shard group; the replicas' all-reduce is `dp_exposed_s`'s."""
    gather_s = state_collective_s(Collective.ALL_GATHER, precision.weight_bytes, dense, expert, groups.shard, expert_group,
                                  node, oversubscription)
    scatter_s = 0.0 if pipelined else state_collective_s(Collective.REDUCE_SCATTER, GRAD_REDUCE_BYTES_PER_PARAM,
                                                         dense - frozen, expert, groups.shard, expert_group, node,
                                                         oversubscription)
    if fetch is Zero3Fetch.BLOCKING:  # a group of one rank has nothing to fetch
        fetched = dense * (groups.shard.size > 1) + expert * (expert_group.size > 1)
        fetch_s = max(gather_s, fetched * precision.weight_bytes / BLOCKING_FETCH_BYTES_PER_S)
        if pipelined:
            return 0.0, fetch_s
        return fetch_s, fetch_s * (2 if refetch else 1) + max(0.0, scatter_s - bwd_window_s)
    shard = dense / groups.shard.size + expert / expert_group.size
    fwd_copy_s = fsdp2_copy_s(precision, node.device, dense + expert, shard, 1, 0)
    if pipelined:
        return 0.0, max(0.0, gather_s - bwd_window_s) + fwd_copy_s
    return (max(0.0, gather_s - fwd_window_s) + fwd_copy_s,
            max(0.0, gather_s + scatter_s - bwd_window_s)
            + fsdp2_copy_s(precision, node.device, dense + expert, shard, 1, 1, _trainable_fraction(dense, expert, frozen)))


def _trainable_fraction(dense: float, expert: float, frozen: float) -> float:
    """The share of the parameters that take gradients, `frozen` of the `dense` ones not."""
    total = dense + expert
    return (total - frozen) / total if total > 0 else 1.0


def tied_gradient_sum_s(config: ParallelConfig, copied_params: float, node: NodeSpec, oversubscription: float) -> float:
    """The step's sum of tied-weight gradients between the first and last pipeline stages, which hold
    copies of `copied_params` parameters (`planner.apply.tied`): an all-reduce of their fp32 gradients
    (split by tp, and by dp x cp under ZeRO-3) over two ranks (pp-1) stages apart, exposed after
    the schedule. Under ZeRO-1 Megatron-LM and DeepSpeed sum the whole gradients, as priced, and
    so under ZeRO-2, which pipeline stages run as ZeRO-1 (`state_options`); `Plan.apply`'s ZeRO-1
    and ZeRO-2 (FSDP2) have reduce-scattered them by then and sum their shard. Rank i of
    the first stage pairs with rank i + (pp-1) x tp x cp x dp: every pair shares a node when the
    whole pipeline does, and otherwise at least one pair crosses nodes."""
    if config.pp == 1 or not copied_params:
        return 0.0
    shards = config.tp * (config.shard_ranks if config.zero == 3 else 1)
    inner = config.tp * config.cp * config.dp
    if config.devices <= node.devices_per_node:
        group = CommGroup(size=2, ranks_per_node=2, concurrent_per_node=inner)
    else:
        group = CommGroup(size=2, ranks_per_node=1, concurrent_per_node=node.devices_per_node)
    return collective_time_s(Collective.ALL_REDUCE, copied_params * GRAD_REDUCE_BYTES_PER_PARAM / shards, group, node,
                             oversubscription)


def optimizer_step_s(config: ParallelConfig, precision: Precision, device: DeviceSpec, owned_params: float) -> float:
    """Seconds of the optimizer update over the trainable `owned_params` whose states one device holds (linear in them)."""
    if config.offload_optimizer:
        return offload_step_s(owned_params, precision.weight_bytes, precision.optimizer_step_bytes)
    return owned_params * precision.optimizer_step_bytes / (device.mem_bw_bytes_per_s * device.mem_bw_efficiency)


def owned_params(config: ParallelConfig, node: NodeSpec, dense, expert, frozen):
    """Trainable parameters whose optimizer states one device owns (its ZeRO shards of the dense and
    expert ones), from the parameters it holds; numbers or per-layer arrays."""
    dense_shard, expert_shard = (config.shard_ranks, expert_data_group(config, node).size) if config.zero >= 1 else (1, 1)
    return (dense - frozen) / dense_shard + expert / expert_shard


def state_collective_s(kind: Collective, bytes_per_param: float, dense: float, expert: float, dense_group: CommGroup,
                       expert_group: CommGroup, node: NodeSpec, oversubscription: float) -> float:
    """One collective over the dense parameters' group and one over the experts' group (none for
    a part without parameters: nothing is issued)."""
    return sum(collective_time_s(kind, params * bytes_per_param, group, node, oversubscription)
               for params, group in ((dense, dense_group), (expert, expert_group)) if params > 0)


def state_zero(config: ParallelConfig) -> int:
    """The ZeRO stage whose division of the model states `Plan.apply` reaches. FSDP2 has no
    optimizer-only mode: ZeRO-1 runs as ZeRO-2 that reduce-scatters on the last micro-batch only
    (`planner.apply.data_parallel`), so with one micro-batch and no pipeline (whose stages defer the
    sync anyway) it shards the gradients as ZeRO-2 does."""
    return 2 if config.zero == 1 and config.num_microbatches == 1 and config.pp == 1 else config.zero


def grads_pooled(config: ParallelConfig) -> bool:
    """Whether the gradients come from the data-parallel wrapper's reduce stream, whose blocks stay
    reserved between steps (`costmodel.memory.stage_memory`'s `grads_pooled`): any FSDP2 wrapper
    (dp x cp above 1) that keeps its gradients on the device."""
    return config.dp * config.cp > 1 and not config.offload_optimizer


def state_options(config: ParallelConfig, precision: Precision) -> dict:
    """How model states are stored: fp32 gradients and device-side Adam, or ZeRO-Offload (working
    weights and gradients on the device). Data parallelism runs as FSDP2 (what `Plan.apply` uses:
    `replicate` or `fully_shard`), which computes with unsharded parameters apart from its sharded
    ones, so its sharded fp32 parameters are a master copy even in fp32 training (under ZeRO-3 the
    unsharded ones exist only while gathered). Pipeline stages defer the gradient sync to the last
    micro-batch (`zero3_exposed_s`), so their gradients accumulate whole."""
    deferred = config.pp > 1
    if config.offload_optimizer:
        return {"optimizer": memory_model.Optimizer.ADAM_MIXED_OFFLOAD, "shard_is_master": True,
                "weight_bytes_per_param": precision.weight_bytes, "grad_bytes_per_param": precision.weight_bytes,
                "deferred_grad_sync": deferred}
    wrapped = config.dp * config.cp > 1
    optimizer = memory_model.Optimizer.ADAM_MIXED if wrapped else precision.optimizer
    return {"optimizer": optimizer, "weight_bytes_per_param": precision.weight_bytes,
            "grad_bytes_per_param": GRAD_BYTES_PER_PARAM, "shard_is_master": True, "deferred_grad_sync": deferred}
