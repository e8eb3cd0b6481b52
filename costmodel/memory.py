"""Bytes per device for one pipeline stage: model states under ZeRO, activations, buffers, overhead.

Model states follow Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", §3.1 and §5): mixed-precision Adam keeps 2 bytes of half-precision weights,
2 bytes of half-precision gradients and K = 12 bytes of fp32 optimizer state (master weights,
momentum, variance) per parameter. ZeRO stage 1 shards the optimizer states over the data-parallel
group, stage 2 also the gradients, stage 3 (FSDP) also the weights. DeepSpeed's ZeRO-3 keeps a
half-precision shard beside the fp32 master shard; FSDP2 (`fully_shard` with a mixed-precision
policy) keeps only the fp32 shard, which is the master copy, and has half-precision weights only
while gathered (`shard_is_master`).

The peak of a step is the larger of two moments: the end of the forward (weights, optimizer
states, every activation in flight and the loss's temporaries) and the optimizer step (weights,
gradients, optimizer states). Gradients are alive at the first only when they accumulate over
micro-batches, or when the framework keeps a persistent gradient buffer (Megatron-LM); PyTorch's
`zero_grad(set_to_none=True)` frees them between steps. Freed is not released, though, where a
data-parallel wrapper wrote them on its reduce stream (`stage_memory`'s `grads_pooled`): the caching
allocator keeps their blocks reserved for that stream, so the forward's end holds their bytes as
overhead. A ZeRO-3 pipeline stage whose gradient
sync is deferred to the last micro-batch has a third: the end of a backward, with every parameter
of the stage gathered (`stage_memory`'s `deferred_grad_sync`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import NamedTuple

MIB = 1024**2

# Measured elsewhere, not on this project's machines. CUDA context of one PyTorch process: a tiny
# tensor makes a process use 723 MiB with eager module loading (discuss.pytorch.org/t/73021);
# lazy loading (CUDA >= 11.7, torch >= 2.0 default) brings it to about 0.3-0.6 GiB on A100/H100.
# Rerun on a GPU: `torch.zeros(1, device="cuda")`, then compare `nvidia-smi --query-compute-apps=
# used_memory` with `torch.cuda.memory_reserved()`.
CUDA_CONTEXT_BYTES = 512 * MIB

# Empirical. The caching allocator rounds and splits blocks, so reserved memory exceeds allocated
# memory; in steady-state LLM training `max_memory_reserved / max_memory_allocated` is typically
# 1.02-1.10 (PyTorch "CUDA memory management" notes; larger without `expandable_segments`). Rerun:
# the ratio of `torch.cuda.max_memory_reserved()` to `torch.cuda.max_memory_allocated()` after a
# few training steps.
ALLOCATOR_FRAGMENTATION_FRACTION = 0.05

# Megatron-LM accumulates bf16 gradients in an fp32 `main_grad` buffer
# (`accumulate_allreduce_grads_in_fp32`, forced on with `--bf16`): 4 bytes per parameter instead of
# the ZeRO paper's 2, i.e. 18 bytes of model state per parameter without ZeRO.
FP32_GRAD_BYTES_PER_PARAM = 4


class Optimizer(StrEnum):
    ADAM_MIXED = "adam-mixed"
    ADAM_FP32 = "adam-fp32"
    ADAM_MIXED_OFFLOAD = "adam-mixed-offload"


# Optimizers whose states hold an fp32 master copy of the weights (on the device or in host memory).
MASTER_COPY_OPTIMIZERS = frozenset({Optimizer.ADAM_MIXED, Optimizer.ADAM_MIXED_OFFLOAD})


class StateBytes(NamedTuple):
    """Model-state bytes on one device (or per parameter, in `STATE_BYTES_PER_PARAM`)."""

    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float


STATE_BYTES_PER_PARAM = {
    # ZeRO paper §3.1: bf16/fp16 weights 2 + grads 2 + fp32 master, momentum, variance 4 + 4 + 4.
    Optimizer.ADAM_MIXED: StateBytes(2.0, 2.0, 12.0),
    # fp32 training: weights 4 + grads 4 + momentum and variance 4 + 4 (no separate master copy).
    Optimizer.ADAM_FP32: StateBytes(4.0, 4.0, 8.0),
    # ZeRO-Offload (Ren et al. 2021): the fp32 master weights and both moments live in host
    # memory and the update runs on the CPU; the device keeps bf16 weights and bf16 gradients.
    Optimizer.ADAM_MIXED_OFFLOAD: StateBytes(2.0, 2.0, 0.0),
}


# Bytes a frozen parameter (one that takes no gradient) keeps on top of its working weights, per
# optimizer: none of the optimizer's moments or gradients, but under mixed precision FSDP2 keeps every
# parameter in its fp32 original, trainable or not, and casts it for compute (`planner.apply`), so
# a frozen one keeps the 4 B a master copy would (sharded as the optimizer states are).
FROZEN_KEPT_BYTES_PER_PARAM = {Optimizer.ADAM_MIXED: 4.0, Optimizer.ADAM_FP32: 0.0, Optimizer.ADAM_MIXED_OFFLOAD: 0.0}
# Relative slack when checking frozen against all parameters: both arrive as sums of per-layer shares.
FROZEN_ROUNDING = 1e-9


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device, by category.

    Attributes:
        weights_bytes: parameters (ZeRO-3: the local shard plus the gathered working copies).
        grads_bytes: gradients.
        optimizer_bytes: optimizer states (for mixed precision, the fp32 master weights too).
        activations_bytes: activations saved for backward, over all micro-batches in flight.
        comm_buffers_bytes: communication buffers (gradient buckets, all-gather outputs, NCCL) and a
            pipeline's buffers (received tensors, kept outputs).
        temp_bytes: transient workspace at the peak (e.g. logits, attention scratch).
        overhead_bytes: CUDA context, allocator fragmentation, the gradient blocks reserved for a
            data-parallel reduce stream while the gradients are freed (`grads_pooled`) and other
            blocks held reserved (`held_bytes`).
    """

    weights_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activations_bytes: float = 0.0
    comm_buffers_bytes: float = 0.0
    temp_bytes: float = 0.0
    overhead_bytes: float = 0.0

    @functools.cached_property
    def total_bytes(self) -> float:
        # cached: a search reads it several times per stage of every priced candidate
        return sum(getattr(self, f.name) for f in fields(self))

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def to_dict(self) -> dict[str, float]:
        """The categories and `total_bytes`, in bytes (JSON-ready)."""
        # direct field reads: `asdict` deep-copies and is a measurable share of a search
        out = {f.name: float(getattr(self, f.name)) for f in fields(self)}
        out["total_bytes"] = float(self.total_bytes)
        return out


def model_state_bytes(
    params: float,
    zero: int,
    shard_group: int,
    *,
    optimizer: Optimizer | str = Optimizer.ADAM_MIXED,
    weight_bytes_per_param: float | None = None,
    grad_bytes_per_param: float | None = None,
    gathered_params: float = 0.0,
    shard_is_master: bool = False,
    deferred_grad_sync: bool = False,
    frozen_params: float = 0.0,
) -> StateBytes:
    """Weights, gradients and optimizer states on one device under a ZeRO stage.

    Rajbhandari et al. 2020 §5: ZeRO-1 divides the optimizer states by the shard group, ZeRO-2 also
    the gradients, ZeRO-3 also the weights. Under ZeRO-3 each device also holds the unsharded
    copies of the parameters it is computing with (FSDP all-gathers a layer, and prefetches the
    next one): `gathered_params` of them, at `weight_bytes_per_param`, counted with the weights.
    The unsharded gradient bucket waiting for its reduce-scatter (ZeRO-2/3) is a communication
    buffer, which `stage_memory` takes separately.

    Args:
        params: parameters held by this device before ZeRO (already divided by TP/EP).
        zero: ZeRO stage, 0-3.
        shard_group: devices the states are sharded over (the data-parallel group, or the
            expert-data-parallel group for expert parameters).
        optimizer: which optimizer and precision; sets the default bytes per parameter.
        weight_bytes_per_param: overrides the optimizer's weight bytes (e.g. 1 for fp8 weights).
        grad_bytes_per_param: overrides the optimizer's gradient bytes (`FP32_GRAD_BYTES_PER_PARAM`
            for Megatron-style fp32 gradient accumulation).
        gathered_params: ZeRO-3 only: parameters all-gathered at once on this device.
        shard_is_master: ZeRO-3 with a master-copy optimizer: the sharded parameters are the
            master copy (FSDP2), so no half-precision shard is kept; False is the ZeRO paper's
            (DeepSpeed's) accounting.
        deferred_grad_sync: the gradients accumulate unsharded over the micro-batches and are
            reduce-scattered once, after the last (`stage_memory`), so ZeRO-2/3 hold them whole.
        frozen_params: the part of `params` that takes no gradient (`requires_grad=False`): its
            weights only, plus `FROZEN_KEPT_BYTES_PER_PARAM` in place of optimizer states.

    Returns:
        `StateBytes(weights_bytes, grads_bytes, optimizer_bytes)`.

    Raises:
        ValueError: on a negative count, an unknown ZeRO stage or optimizer, a shard group below 1,
            or `gathered_params` without ZeRO-3.

    Example::

        >>> model_state_bytes(7e9, zero=1, shard_group=8)
        StateBytes(weights_bytes=14000000000.0, grads_bytes=14000000000.0, optimizer_bytes=10500000000.0)
    """
    per_param = STATE_BYTES_PER_PARAM[_optimizer(optimizer)]
    weight_bytes = per_param.weights_bytes if weight_bytes_per_param is None else weight_bytes_per_param
    grad_bytes = per_param.grads_bytes if grad_bytes_per_param is None else grad_bytes_per_param
    _check_non_negative(
        params=params, gathered_params=gathered_params, weight_bytes_per_param=weight_bytes,
        grad_bytes_per_param=grad_bytes, frozen_params=frozen_params,
    )
    if frozen_params > params * (1 + FROZEN_ROUNDING):
        raise ValueError(f"frozen_params={frozen_params}: must not exceed params={params}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero!r}: must be 0, 1, 2 or 3")
    if not isinstance(shard_group, int) or shard_group < 1:
        raise ValueError(f"shard_group={shard_group!r}: must be a positive integer (the data-parallel group size)")
    if gathered_params and zero != 3:
        raise ValueError(f"gathered_params={gathered_params}: only ZeRO-3 gathers parameters; pass 0 for zero={zero}")
    master_only = shard_is_master and zero >= 3 and _optimizer(optimizer) in MASTER_COPY_OPTIMIZERS
    sharded_weights = 0.0 if master_only else params * weight_bytes / (shard_group if zero >= 3 else 1)
    trainable = max(0.0, params - frozen_params)
    kept = trainable * per_param.optimizer_bytes + frozen_params * FROZEN_KEPT_BYTES_PER_PARAM[_optimizer(optimizer)]
    return StateBytes(
        weights_bytes=sharded_weights + gathered_params * weight_bytes,
        grads_bytes=trainable * grad_bytes / (shard_group if zero >= 2 and not deferred_grad_sync else 1),
        optimizer_bytes=kept / (shard_group if zero >= 1 else 1),
    )


def stage_memory(
    *,
    params: float,
    activation_bytes_per_microbatch: float,
    in_flight: float,
    expert_params: float = 0.0,
    tp: int = 1,
    ep: int = 1,
    expert_tp: int = 1,
    zero: int = 0,
    dense_shard_group: int = 1,
    expert_shard_group: int = 1,
    gathered_params: float = 0.0,
    comm_buffer_bytes: float = 0.0,
    temp_bytes: float = 0.0,
    work_bytes: float = 0.0,
    optimizer: Optimizer | str = Optimizer.ADAM_MIXED,
    weight_bytes_per_param: float | None = None,
    grad_bytes_per_param: float | None = None,
    context_bytes: float = CUDA_CONTEXT_BYTES,
    fragmentation_fraction: float = ALLOCATOR_FRAGMENTATION_FRACTION,
    grads_at_peak: bool = True,
    grads_pooled: bool = False,
    held_bytes: float = 0.0,
    shard_is_master: bool = False,
    deferred_grad_sync: bool = False,
    chunks: int = 1,
    frozen_params: float = 0.0,
    buffer_bytes: float = 0.0,
) -> MemoryBreakdown:
    """Peak bytes on one device of one pipeline stage.

    Rules:

    - Dense parameters (`params - expert_params`) are divided by `tp` (Megatron tensor
      parallelism shards every large weight; the replicated norms and biases are under 0.1% of a
      transformer's parameters and are divided too).
    - Expert parameters are divided by `ep` and by `expert_tp` when experts are tensor-parallel
      (Megatron-Core `expert_tensor_parallel_size`).
    - ZeRO shards dense states over `dense_shard_group` and expert states over
      `expert_shard_group`; the caller passes both sizes. In Megatron-Core the distributed
      optimizer shards over the data-parallel group including context parallelism (`dp * cp`) and
      expert states over the expert-data-parallel group (`dp * cp * tp / (ep * expert_tp)`).
    - Activations: `activation_bytes_per_microbatch * in_flight`, where the caller's per-micro-batch
      bytes are for this stage's layers, already divided by TP/SP/CP, and `in_flight` comes from
      `costmodel.pipeline.in_flight_microbatches`.
    - Overhead: `context_bytes` (CUDA context, `CUDA_CONTEXT_BYTES`) plus `fragmentation_fraction`
      of everything else (caching-allocator fragmentation, `ALLOCATOR_FRAGMENTATION_FRACTION`).

    Args:
        params: the stage's parameters, experts included, before any sharding.
        activation_bytes_per_microbatch: saved activations of one micro-batch on this device.
        in_flight: micro-batches whose activations are alive at the peak.
        expert_params: the part of `params` in MoE experts.
        tp: tensor-parallel degree.
        ep: expert-parallel degree.
        expert_tp: tensor-parallel degree inside each expert.
        zero: ZeRO stage, 0-3.
        dense_shard_group: devices dense states are sharded over.
        expert_shard_group: devices expert states are sharded over.
        gathered_params: ZeRO-3 only: parameters all-gathered at once on this device.
        comm_buffer_bytes: communication and pipeline buffers at the peak.
        temp_bytes: transient workspace at the peak.
        work_bytes: the largest recompute working set: what a recomputed layer holds again while its
            backward runs. It comes after the forward's end and can reuse the blocks `held_bytes`
            keeps, so the transients at the peak are max(temp_bytes + held_bytes, work_bytes).
        optimizer: optimizer and precision.
        weight_bytes_per_param: overrides the optimizer's weight bytes.
        grad_bytes_per_param: overrides the optimizer's gradient bytes.
        context_bytes: per-process CUDA context.
        fragmentation_fraction: allocator fragmentation as a fraction of all other bytes.
        grads_at_peak: gradients are alive while the activations are (gradient accumulation over
            micro-batches, or a persistent gradient buffer); otherwise the peak is the larger of
            the forward's end and the optimizer step (module docstring).
        grads_pooled: the gradients come from a data-parallel wrapper's reduce stream: FSDP2's
            `foreach_reduce` allocates the reduced gradients under its reduce-scatter stream (DDP
            semantics through `replicate` too), and the CUDA caching allocator reuses a freed block
            only for the stream that allocated it. Without `grads_at_peak`, their bytes then stay
            reserved from `zero_grad` through the next forward: the forward's end holds them as
            overhead (reserved, not allocated).
        held_bytes: bytes the caching allocator keeps reserved, not allocated, at the forward's end:
            blocks freed just before it that its allocations, all larger, cannot reuse (the
            half-precision logits under an fp32 cross-entropy, `planner.loss_cost.loss_held_copies`).
            Counted as overhead there.
        shard_is_master: see `model_state_bytes`.
        deferred_grad_sync: the stage's data-parallel wrapper reduces the gradients once, after the
            last micro-batch, and keeps the parameters gathered from each backward to the next
            forward (`torch.distributed.pipelining`'s stages under FSDP2). ZeRO-2/3 then hold the
            gradients whole, and a ZeRO-3 backward ends with every parameter of the stage
            gathered: its peak is the larger of `in_flight` micro-batches' activations with
            `gathered_params`, and one chunk's micro-batch fewer with all parameters gathered.
        chunks: model chunks on the device (interleaved schedules); a backward frees one chunk's
            micro-batch, `1 / chunks` of `in_flight`'s unit.
        frozen_params: the part of the dense parameters that takes no gradient (see `model_state_bytes`).
        buffer_bytes: the stage's module buffers, counted with the weights: neither tensor
            parallelism nor FSDP2 splits them.

    Returns:
        The per-category breakdown at the peak.

    Raises:
        ValueError: on negative sizes, degrees below 1, or `expert_params > params`.

    Example::

        >>> stage_memory(params=7e9, activation_bytes_per_microbatch=0, in_flight=0,
        ...              context_bytes=0, fragmentation_fraction=0).total_bytes
        112000000000.0
    """
    _check_non_negative(
        params=params, expert_params=expert_params, activation_bytes_per_microbatch=activation_bytes_per_microbatch,
        in_flight=in_flight, comm_buffer_bytes=comm_buffer_bytes, temp_bytes=temp_bytes, context_bytes=context_bytes,
        fragmentation_fraction=fragmentation_fraction, buffer_bytes=buffer_bytes, held_bytes=held_bytes,
        work_bytes=work_bytes,
    )
    temp_bytes, held_bytes = max(temp_bytes, work_bytes), max(0.0, temp_bytes + held_bytes - max(temp_bytes, work_bytes))
    for name, degree in (("tp", tp), ("ep", ep), ("expert_tp", expert_tp), ("chunks", chunks)):
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"{name}={degree!r}: must be a positive integer")
    if expert_params > params:
        raise ValueError(f"expert_params={expert_params}: must not exceed params={params} (params includes experts)")
    precision = {
        "optimizer": optimizer,
        "weight_bytes_per_param": weight_bytes_per_param,
        "grad_bytes_per_param": grad_bytes_per_param,
        "shard_is_master": shard_is_master,
        "deferred_grad_sync": deferred_grad_sync,
    }
    dense_params, local_experts = (params - expert_params) / tp, expert_params / (ep * expert_tp)
    dense = model_state_bytes(dense_params, zero, dense_shard_group, gathered_params=gathered_params,
                              frozen_params=frozen_params / tp, **precision)
    experts = model_state_bytes(local_experts, zero, expert_shard_group, **precision)
    breakdown = MemoryBreakdown(
        weights_bytes=dense.weights_bytes + experts.weights_bytes + buffer_bytes,
        grads_bytes=dense.grads_bytes + experts.grads_bytes,
        optimizer_bytes=dense.optimizer_bytes + experts.optimizer_bytes,
        activations_bytes=activation_bytes_per_microbatch * in_flight,
        comm_buffers_bytes=comm_buffer_bytes,
        temp_bytes=temp_bytes,
    )
    if deferred_grad_sync and zero == 3:
        gathered = (model_state_bytes(dense_params, zero, dense_shard_group, gathered_params=dense_params,
                                      frozen_params=frozen_params / tp, **precision),
                    model_state_bytes(local_experts, zero, expert_shard_group, gathered_params=local_experts, **precision))
        backward_end = replace(breakdown, weights_bytes=sum(part.weights_bytes for part in gathered) + buffer_bytes,
                               activations_bytes=activation_bytes_per_microbatch * max(0.0, in_flight - 1 / chunks))
        breakdown = max(breakdown, backward_end, key=lambda moment: moment.total_bytes)
    moments = [(breakdown, held_bytes)]
    if not grads_at_peak:
        moments = [(replace(breakdown, grads_bytes=0.0), held_bytes + (breakdown.grads_bytes if grads_pooled else 0.0)),
                   (replace(breakdown, activations_bytes=0.0, temp_bytes=0.0), 0.0)]
    return max((moment + MemoryBreakdown(overhead_bytes=context_bytes + fragmentation_fraction * moment.total_bytes + pooled)
                for moment, pooled in moments), key=lambda moment: moment.total_bytes)


def _optimizer(optimizer: Optimizer | str) -> Optimizer:
    try:
        return Optimizer(optimizer)
    except ValueError:
        raise ValueError(f"optimizer={optimizer!r}: use one of {[o.value for o in Optimizer]}") from None


def _check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name}={value}: must be >= 0")
