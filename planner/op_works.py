"""The cost-model work of one traced op: matmuls and attention by their FLOPs (attention by the
kernel the training code runs), everything else by the bytes it moves.

`planner.layer_cost` prices a layer from these works under its tensor- and context-parallel split.
"""
from __future__ import annotations

from enum import StrEnum

from costmodel.compute import (ATTENTION_BWD_WORK_RATIO, CAUSAL_WORK_FRACTION, MEMORY_BWD_TRAFFIC_RATIO, OpWork, WorkKind,
                               layer_time_s)
from costmodel.hardware import DeviceSpec
from costmodel.op_table import OpTable
from planner.graph import Layer, Op, OpKind
from planner.op_kinds import VIEW_TARGETS


class AttentionKernel(StrEnum):
    """How the attention core runs: fused (scores stay on chip) with the device's own flash kernels
    (FlashAttention-2 on Ampere; cuDNN or FlashAttention-3 on Hopper), FlashAttention-2's, at the
    device's `flash2_attention_ratio` of those, or the first FlashAttention's, at
    FLASH1_TO_FLASH2_RATE of FlashAttention-2's; or unfused (QK^T and AV as batched GEMMs with the
    a*s*s scores in device memory through scale/mask/softmax/dropout kernels: Megatron-LM before
    FlashAttention). README's `--attention` says which training code runs which."""

    FLASH = "flash"
    FLASH2 = "flash2"
    FLASH1 = "flash1"
    UNFUSED = "unfused"


# The (forward, backward) work kinds of each fused attention kernel.
_FUSED_ATTENTION_WORKS = {AttentionKernel.FLASH: (WorkKind.ATTENTION, WorkKind.ATTENTION_BWD),
                          AttentionKernel.FLASH2: (WorkKind.FLASH2_ATTENTION, WorkKind.FLASH2_ATTENTION_BWD),
                          AttentionKernel.FLASH1: (WorkKind.FLASH1_ATTENTION, WorkKind.FLASH1_ATTENTION_BWD)}


# Unfused attention, bytes of device-memory traffic per score element (b*a*s*s) in the forward:
# QK^T writes the scores (2), the fused scale-mask-softmax reads and writes them (4), dropout reads
# them and writes its output and mask (2 + 2 + 1), AV reads the dropped-out probabilities (2).
UNFUSED_FWD_BYTES_PER_SCORE = 13
# The backward of each of those kernels moves about twice its forward bytes.
UNFUSED_BWD_BYTES_PER_SCORE = 26
# Bytes kept for backward per score element: softmax output (2), dropout mask (1) and dropout
# output (2): the 5*a*s/h term of Korthikanti et al. 2022, Table 2.
UNFUSED_SAVED_BYTES_PER_SCORE = 5

# Backward of a matmul is two GEMMs (input gradient and weight gradient) of the forward's FLOPs.
MATMUL_BWD_GEMMS = 2


def score_elements(op: Op) -> float:
    """Elements of the attention score tensor (b * heads * s * s) of an attention op."""
    return float(op.out_shape[0] * op.out_shape[1] * op.out_shape[2] ** 2)


def input_bytes_of(layer: Layer) -> dict[str, float]:
    """Bytes each op of `layer` reads: its producers' outputs (an input from outside: its own output's size)."""
    produced = {op.name: op.out_bytes for op in layer.ops}
    return {op.name: float(sum(produced.get(name, op.out_bytes) for name in op.inputs)) for op in layer.ops}


def op_works(op: Op, share: float, input_bytes: float | None = None, cp: int = 1,
             attention: AttentionKernel = AttentionKernel.FLASH) -> tuple[list[OpWork], list[OpWork]]:
    """Forward and backward work of `share` of one op of the traced micro-batch.

    `input_bytes` is what the op reads (its producers' outputs); when unknown each input is taken
    to be the size of the output. Reductions such as the loss read far more than they write.
    Attention runs on `attention`'s kernels; a fused kernel's unit is one head of one sequence,
    whose queries context parallelism divides by `cp`. An elementwise op's work is keyed by its name
    for a measured rate (`OpTable`). An op whose output takes no gradient (`Op.takes_grad`) has no
    backward.
    """
    if op.kind == OpKind.ATTENTION and attention == AttentionKernel.UNFUSED:
        scores = score_elements(op) * share
        flops = op.fwd_flops * share
        fwd = [OpWork(WorkKind.MATMUL, flops, 0.0), OpWork(WorkKind.MEMORY, 0.0, UNFUSED_FWD_BYTES_PER_SCORE * scores)]
        bwd = [OpWork(WorkKind.MATMUL, 2 * flops, 0.0), OpWork(WorkKind.MEMORY, 0.0, UNFUSED_BWD_BYTES_PER_SCORE * scores)]
        return fwd, bwd
    fwd, bwd = _fwd_bwd_works(op, share, input_bytes, cp, attention)
    return (fwd, bwd) if op.takes_grad else (fwd, [])


def _fwd_bwd_works(op: Op, share: float, input_bytes: float | None, cp: int,
                   attention: AttentionKernel) -> tuple[list[OpWork], list[OpWork]]:
    """`op_works` of an op whose output takes a gradient."""
    if op.target in VIEW_TARGETS and op.fwd_flops == 0:
        return [], []
    flops = op.fwd_flops * share
    if op.kind == OpKind.ATTENTION:
        work = CAUSAL_WORK_FRACTION if op.attrs.get("causal") else 1.0  # the trace counts the full score matrix
        flops *= work
        head_flops = work * op.fwd_flops / (op.out_shape[0] * op.out_shape[1] * cp)
        fwd_kind, bwd_kind = _FUSED_ATTENTION_WORKS[attention]
        return ([OpWork(fwd_kind, flops, 0.0, unit_flops=head_flops)],
                [OpWork(bwd_kind, ATTENTION_BWD_WORK_RATIO * flops, 0.0, unit_flops=ATTENTION_BWD_WORK_RATIO * head_flops)])
    if op.kind == OpKind.MATMUL or (flops > 0 and op.kind == OpKind.OTHER):
        io_bytes = op.out_bytes * share
        gemm = OpWork(WorkKind.MATMUL, flops, io_bytes)
        return [gemm], [gemm] * MATMUL_BWD_GEMMS
    read = op.out_bytes * len(op.inputs) if input_bytes is None else input_bytes
    traffic = (op.out_bytes + read) * share
    kind = WorkKind.LOSS if op.kind == OpKind.LOSS else WorkKind.MEMORY
    return ([OpWork(kind, 0.0, traffic, op.target)],
            [OpWork(kind, 0.0, MEMORY_BWD_TRAFFIC_RATIO * traffic, f"{op.target}:bwd")])


def op_time_s(op: Op, device: DeviceSpec, dtype: str, shards: int, table: OpTable | None = None) -> float:
    """Forward+backward seconds of one op of the traced micro-batch with its work split `shards` ways."""
    fwd, bwd = op_works(op, 1.0 / shards)
    return layer_time_s(fwd + bwd, device, dtype, table) if fwd or bwd else 0.0
