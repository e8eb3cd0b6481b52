"""What pipeline stages hold beside their layers: receive buffers and the last stage's kept outputs.

`torch.distributed.pipelining` (what `Plan.apply` and torchtitan run) gives every stage a receive
buffer for each micro-batch's input activations and for each micro-batch's output gradients when
the schedule first runs, and keeps them (`PipelineStage._prepare_forward_infra` and
`_setup_backward_recv_info`, read in torch 2.13; `tests/test_apply.py` checks the count). Megatron-LM
and DeepSpeed's pipeline engine allocate a received tensor per transfer; it lives while its
micro-batch is in flight, inside the activations the memory model already counts.

The schedule's `step()` also keeps the last stage's output of every micro-batch until the step ends,
to merge and return them (`_PipelineStageBase.output_chunks`, read in torch 2.13), unless called with
`return_outputs=False` (added on pytorch/pytorch#159251's request), as `Plan.apply` calls it. torchtitan's Llama
returns its logits upcast to fp32 (`self.output(h).float()`) and passes the loss to the schedule, so
its last stage keeps m fp32 logits tensors: the loss's input, as the trace measures it. Torch before
pytorch/pytorch#153383 (May 2025) kept every stage's outputs; the others are hidden states, s·b·h/t
bytes per micro-batch, which this leaves out.
"""
from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum


class PipeBuffers(StrEnum):
    """How the training code's pipeline holds received tensors (module docstring).

    PREALLOCATED: torch.distributed.pipelining: one buffer per micro-batch for each chunk's input
    activations (every chunk but the model's first) and output gradients (every chunk but the last).
    TRANSIENT: Megatron-LM, DeepSpeed: buffers only for transfers in flight, counted with the
    activations.
    """

    PREALLOCATED = "preallocated"
    TRANSIENT = "transient"


class PipeOutputs(StrEnum):
    """What the training code's pipeline keeps of the last stage's outputs (module docstring).

    DROPPED: `Plan.apply` (`step(return_outputs=False)`), Megatron-LM, DeepSpeed: an output lives
    while its loss does.
    KEPT: `torch.distributed.pipelining`'s `step()` by default (torchtitan): the device of the last
    chunk keeps every micro-batch's output, the loss's input, until the step ends.
    """

    DROPPED = "dropped"
    KEPT = "kept"


def kept_output_bytes(kind: PipeOutputs, pp: int, num_microbatches: int, loss_input_bytes: float) -> float:
    """Bytes of outputs a pipeline device keeps at the step's end: each micro-batch's loss input
    (`loss_input_bytes`, summed over the device's layers, so zero but on the last chunk's device)
    when pipelined (`pp` > 1) and `kind` is KEPT."""
    return num_microbatches * loss_input_bytes if kind is PipeOutputs.KEPT and pp > 1 else 0.0


def recv_buffer_bytes(kind: PipeBuffers, boundaries: Sequence[int], out_bytes: Sequence[float], stage: int, pp: int,
                      num_microbatches: int, seq_split: int) -> float:
    """Bytes of receive buffers on pipeline device `stage`.

    Args:
        kind: how the pipeline holds received tensors.
        boundaries: the pp x vpp + 1 layer cut points of the chunks; device `stage` holds chunks
            stage, stage + pp, ...
        out_bytes: per layer, the bytes of its output for one micro-batch before the sequence split
            (a chunk receives its first layer's input, the previous layer's output, and the
            gradient of its last layer's output).
        stage: the device's pipeline rank.
        pp: pipeline devices.
        num_microbatches: micro-batches per step.
        seq_split: ways a boundary activation's sequence is split (cp, times tp under sequence parallelism).
    """
    chunks = len(boundaries) - 1
    return sum(chunk_recv_bytes(kind, chunk, chunks, out_bytes[boundaries[chunk] - 1], out_bytes[boundaries[chunk + 1] - 1],
                                num_microbatches, seq_split)
               for chunk in range(stage, chunks, pp))


def chunk_recv_bytes(kind: PipeBuffers, chunk: int, chunks: int, in_bytes: float, out_bytes: float, num_microbatches: int,
                     seq_split: int) -> float:
    """Bytes of one chunk's receive buffers: its input (`in_bytes` per micro-batch, unless it is the
    model's first chunk) and its output's gradient (`out_bytes`, unless it is the last), for every
    micro-batch, the sequence split `seq_split` ways."""
    if kind is PipeBuffers.TRANSIENT or chunks == 1:
        return 0.0
    return num_microbatches * (in_bytes * (chunk > 0) + out_bytes * (chunk < chunks - 1)) / seq_split
