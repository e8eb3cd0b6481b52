"""What the training code's cross-entropy keeps on the device: saved bytes and temporaries.

The trace measures the zoo's loss, which upcasts the logits to fp32 and calls `F.cross_entropy`
(as torchtitan does). A fused kernel changes what that loss keeps; `layer_cost`
applies these rules to the layer holding the loss.
"""
from __future__ import annotations

from enum import StrEnum

from planner.graph import Layer, Op, OpKind, Recompute


class LossKernel(StrEnum):
    """How the cross-entropy runs: "torch" upcasts the logits to fp32 and calls `F.cross_entropy`
    (torchtitan, the zoo's models: what the trace measures); "inplace" upcasts them too but works
    in place on that fp32 copy, keeping it as the softmax for backward and turning it into the
    logits gradient in place (Megatron-LM's and Megatron-Core's vocab-parallel cross-entropy,
    `_VocabParallelCrossEntropy`); "fused" is one kernel over the half-precision logits that keeps
    them and a log-sum-exp per row for backward and writes a half-precision logits gradient
    (flash-attn's xentropy `CrossEntropyLoss`, the default `fused_crossentropy` loss of llm-foundry's MPT;
    also a cross-entropy under `torch.compile`, which Inductor fuses with the upcast, as torchtitan
    compiles its loss when compiling the model)."""

    TORCH = "torch"
    INPLACE = "inplace"
    FUSED = "fused"


# Cross-entropy over fp32 logits holds two transient logits-sized fp32 tensors beyond what it saves
# (the log-probabilities) when its backward starts, right after the forward (the step's peak): the
# gradient with respect to the log-probabilities and the logits' gradient. Measured: the TEMP category of PyTorch's
# MemTracker at the peak of one step of benchmarks/fidelity.py's GPT, dp=2 and ZeRO-0 or -3 at
# micro-batch 4: 32.0 MiB = 2 x (4 x 256 x 4096 fp32 logits); rerun: `python
# benchmarks/fidelity.py --worlds 2` reports the step peak (the categories come from MemTracker's
# `get_tracker_snapshot("peak")`).
LOSS_TEMP_INPUT_COPIES = 2
# Vocabulary-parallel cross-entropy (DTensor `loss_parallel`) holds one more: the same measurement at
# tp=2, micro-batch 8 gives 48.1 MiB = 3 x (8 x 256 x 2048 fp32 logits per rank).
LOSS_PARALLEL_TEMP_INPUT_COPIES = 3


def loss_temp_copies(op: Op, layer: Layer, kernel: LossKernel, split: int, activation_bytes: int) -> float:
    """Transient bytes of loss `op` at the step's peak, in copies of its input: `LOSS_TEMP_INPUT_COPIES`
    (`LOSS_PARALLEL_TEMP_INPUT_COPIES` when vocabulary-parallel, `split` > 1); a fused or in-place
    loss holds only the half-precision logits gradient (the in-place one computes it in the fp32
    copy it saved, counted with the saved bytes as the torch loss's log-probabilities are)."""
    if kernel in (LossKernel.FUSED, LossKernel.INPLACE):
        return _half_precision_logits_fraction(op, layer, activation_bytes)
    return LOSS_PARALLEL_TEMP_INPUT_COPIES if split > 1 else LOSS_TEMP_INPUT_COPIES


def loss_held_copies(op: Op, layer: Layer, kernel: LossKernel, activation_bytes: int) -> float:
    """Bytes of loss `op`'s input, in copies of it, that the CUDA caching allocator keeps reserved but
    unallocated at the step's peak. The torch loss upcasts half-precision logits; the training step
    drops them before backward (torchtitan's `del pred`; `Plan.apply` holds no reference), and the
    loss backward's allocations, fp32 and logits-sized, are each larger than their freed block,
    which stays reserved beside them until the logits' gradient (half precision again) reuses it:
    the half-precision logits' bytes. None in fp32 (the upcast is the logits themselves) or with a
    fused or in-place loss (its half-precision gradient reuses the block at once)."""
    fraction = _half_precision_logits_fraction(op, layer, activation_bytes)
    return fraction if kernel is LossKernel.TORCH and fraction < 1.0 else 0.0


def fused_loss_saving(layer: Layer, kernel: LossKernel, recompute: Recompute, reads: dict[str, float],
                      activation_bytes: int) -> float:
    """Saved bytes (traced micro-batch) a fused loss keeps fewer than the traced torch loss: the fp32
    log-probabilities (one loss input, `reads`) replaced by the half-precision logits. Only where the
    loss's own saved tensors are kept (no recompute or attention-only recompute); op-level
    checkpointing keeps the logits already and full recompute keeps neither."""
    if kernel != LossKernel.FUSED or recompute not in (Recompute.NONE, Recompute.SELECTIVE):
        return 0.0
    return sum((1.0 - _half_precision_logits_fraction(op, layer, activation_bytes)) * reads[op.name]
               for op in layer.ops if op.kind == OpKind.LOSS)


def _half_precision_logits_fraction(op: Op, layer: Layer, activation_bytes: int) -> float:
    """Bytes of the half-precision logits over the bytes of the loss's input (the logits as the trace
    feeds them to the loss: fp32 after the upcast, so 1/2 in bf16 training, 1 in fp32)."""
    produced = {o.name: o for o in layer.ops}
    source = produced.get(op.inputs[0]) if op.inputs else None
    if source is None or not source.out_shape or not source.out_bytes:
        return 1.0
    elements = 1
    for size in source.out_shape:
        elements *= size
    return min(1.0, activation_bytes * elements / source.out_bytes)
