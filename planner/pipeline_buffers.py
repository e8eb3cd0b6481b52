"""Receive buffers of pipeline stages: the activations and gradients a stage receives between chunks.

`torch.distributed.pipelining` (what `Plan.apply` and torchtitan run) gives every stage a receive
buffer for each micro-batch's input activations and for each micro-batch's output gradients when
the schedule first runs, and keeps them (`PipelineStage._prepare_forward_infra` and
`_setup_backward_recv_info`, read in torch 2.13; `tests/test_apply.py` checks the count). Megatron-LM
and DeepSpeed's pipeline engine allocate a received tensor per transfer; it lives while its
micro-batch is in flight, inside the activations the memory model already counts.
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
