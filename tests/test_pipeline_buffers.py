"""planner.pipeline_buffers: the receive buffers and kept outputs torch.distributed.pipelining holds per stage."""
from __future__ import annotations

import dataclasses

import pytest

from costmodel.profile_loader import load_cluster
from planner.config import ParallelConfig, Schedule
from planner.estimate import Evaluator
from planner.pipeline_buffers import PipeBuffers, PipeOutputs, kept_output_bytes, recv_buffer_bytes
from planner.tracing import trace
from planner.training_code import TrainingCode

# Layer i's output is 10 * (i + 1) bytes per micro-batch: distinct, so each term is traceable.
OUT_BYTES = [10.0 * (i + 1) for i in range(12)]


def test_each_chunk_receives_its_input_and_its_output_gradient_for_every_micro_batch():
    # 4 chunks of 3 layers on 2 devices (interleaved): device 0 holds chunks 0 and 2, device 1
    # chunks 1 and 3. Chunk 0 receives only the gradient of layer 2's output (30 B); chunk 2 the
    # output of layer 5 (60) and the gradient of layer 8's (90); chunk 1 layer 2's output (30) and
    # layer 5's gradient (60); chunk 3, the last, only layer 8's output (90). 8 micro-batches, the
    # sequence split 2 ways.
    boundaries = (0, 3, 6, 9, 12)
    device0 = recv_buffer_bytes(PipeBuffers.PREALLOCATED, boundaries, OUT_BYTES, 0, 2, 8, 2)
    device1 = recv_buffer_bytes(PipeBuffers.PREALLOCATED, boundaries, OUT_BYTES, 1, 2, 8, 2)
    assert (device0, device1) == (8 * (30 + 60 + 90) / 2, 8 * (30 + 60 + 90) / 2)
    one_chunk = recv_buffer_bytes(PipeBuffers.PREALLOCATED, (0, 6, 12), OUT_BYTES, 1, 2, 4, 1)
    assert one_chunk == 4 * 60  # the last stage receives the first's output, no gradient
    assert recv_buffer_bytes(PipeBuffers.TRANSIENT, boundaries, OUT_BYTES, 0, 2, 8, 2) == 0.0
    assert recv_buffer_bytes(PipeBuffers.PREALLOCATED, (0, 12), OUT_BYTES, 0, 1, 8, 1) == 0.0


def test_preallocated_buffers_grow_with_the_micro_batch_count_and_only_under_pipelining():
    graph = trace("gpt3-350m", seq_len=256)
    cluster = load_cluster("a100-80g:1x8")
    config = ParallelConfig(dp=2, tp=2, pp=2, micro_batch=1, num_microbatches=8, schedule=Schedule.ONE_F_ONE_B)
    memory = {kind: [row["comm_buffers_bytes"] for row in Evaluator(graph, cluster, code=TrainingCode(pp_buffers=kind))
                     .estimate(config, 16).memory] for kind in PipeBuffers}
    assert memory[PipeBuffers.TRANSIENT] == [0.0, 0.0]
    boundary = graph.layers[0].out_bytes / config.seq_split  # every block's output has the embedding's size
    assert memory[PipeBuffers.PREALLOCATED] == pytest.approx([8 * boundary, 8 * boundary], rel=1e-9)
    doubled = Evaluator(graph, cluster).estimate(dataclasses.replace(config, num_microbatches=16), 32).memory
    assert [row["comm_buffers_bytes"] for row in doubled] == pytest.approx([16 * boundary] * 2, rel=1e-9)
    flat = Evaluator(graph, cluster).estimate(dataclasses.replace(config, pp=1, dp=4), 32).memory
    assert flat[0]["comm_buffers_bytes"] == 0.0


def test_the_stage_split_leaves_room_for_the_receive_buffers():
    # The split runs before its cuts are known, so each chunk's memory cap is lowered by its buffers
    # at the largest boundary a cut can have (a block's output; the head's logits are never sent).
    graph = trace("gpt3-350m", seq_len=256)
    cluster = load_cluster("a100-80g:1x8")
    config = ParallelConfig(dp=2, tp=2, pp=2, micro_batch=1, num_microbatches=8, schedule=Schedule.ONE_F_ONE_B)
    caps = {kind: _stage_caps(graph, cluster, config, pp_buffers=kind) for kind in PipeBuffers}
    boundary = graph.layers[0].out_bytes / config.seq_split
    assert caps[PipeBuffers.TRANSIENT] - caps[PipeBuffers.PREALLOCATED] == pytest.approx([8 * boundary] * 2, rel=1e-9)


def test_buffers_that_fill_a_device_make_the_plan_not_fit_instead_of_failing():
    # gpt3-1.3b at 4096 tokens, 512 micro-batches of one sequence over 8 stages x 3 chunks: each chunk
    # keeps 2 x 512 x 16 MiB = 16 GiB of buffers, more than its third of a 40 GB device.
    graph = trace("gpt3-1.3b", seq_len=4096)
    config = ParallelConfig(pp=8, vpp=3, micro_batch=1, num_microbatches=512, schedule=Schedule.INTERLEAVED)
    estimate = Evaluator(graph, load_cluster("a100-40g:1x8")).estimate(config, 512)
    assert not estimate.fits
    assert max(row["comm_buffers_bytes"] for row in estimate.memory) > 40e9


def test_kept_outputs_hold_every_micro_batch_s_fp32_logits_on_the_last_stage_only():
    # gpt3-350m (vocabulary 51,200) at 256 tokens, micro-batches of one sequence, 8 of them, tp 1.
    # torchtitan's model hands the loss fp32 logits and torch's `step()` keeps each micro-batch's:
    # 8 x 256 x 51,200 x 4 B = 400 MiB on the last stage, nothing on the first.
    graph = trace("gpt3-350m", seq_len=256)
    cluster = load_cluster("a100-80g:1x8")
    config = ParallelConfig(dp=4, pp=2, micro_batch=1, num_microbatches=8, schedule=Schedule.ONE_F_ONE_B)
    buffers = {kind: [row["comm_buffers_bytes"] for row in Evaluator(graph, cluster, code=TrainingCode(pp_outputs=kind))
                      .estimate(config, 32, boundaries=(0, 13, 26)).memory] for kind in PipeOutputs}
    logits_bytes = 256 * graph.dims.vocab * 4
    assert buffers[PipeOutputs.KEPT][0] == buffers[PipeOutputs.DROPPED][0]
    assert buffers[PipeOutputs.KEPT][1] - buffers[PipeOutputs.DROPPED][1] == pytest.approx(8 * logits_bytes, rel=1e-9)
    assert kept_output_bytes(PipeOutputs.KEPT, 1, 8, logits_bytes) == 0.0  # no schedule keeps them without pipelining
    assert kept_output_bytes(PipeOutputs.DROPPED, 2, 8, logits_bytes) == 0.0


def test_the_stage_split_leaves_the_last_chunk_room_for_the_kept_outputs():
    graph = trace("gpt3-350m", seq_len=256)
    cluster = load_cluster("a100-80g:1x8")
    config = ParallelConfig(dp=2, pp=2, vpp=2, micro_batch=1, num_microbatches=8, schedule=Schedule.INTERLEAVED)
    caps = {kind: _stage_caps(graph, cluster, config, pp_outputs=kind) for kind in PipeOutputs}
    logits_bytes = 256 * graph.dims.vocab * 4
    assert caps[PipeOutputs.DROPPED] - caps[PipeOutputs.KEPT] == pytest.approx([0, 0, 0, 8 * logits_bytes], rel=1e-9)


def _stage_caps(graph, cluster, config: ParallelConfig, **code):
    """Each chunk's memory cap in the stage-split problem of `config` under training code `code`."""
    evaluator = Evaluator(graph, cluster, code=TrainingCode(**code))
    return evaluator.stage_problem(config, [evaluator.policies(config)]).mem_cap_bytes
