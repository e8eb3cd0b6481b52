"""Per-device memory: ZeRO arithmetic, sharding rules, published activation figures, monotonicity."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from costmodel.memory import (
    ALLOCATOR_FRAGMENTATION_FRACTION,
    CUDA_CONTEXT_BYTES,
    FP32_GRAD_BYTES_PER_PARAM,
    MemoryBreakdown,
    Optimizer,
    StateBytes,
    model_state_bytes,
    stage_memory,
)
from costmodel.offload import HOST_LINK_BYTES_PER_S, HOST_MEMORY_BYTES_PER_S, offload_step_s
from costmodel.pipeline import in_flight_microbatches

GIB = 1024**3


@pytest.mark.parametrize(
    "zero,expected_gb",
    [
        (0, 120.0),  # 16 bytes x 7.5B
        (1, 31.4),  # (2 + 2) x 7.5B + 12 x 7.5B / 64
        (2, 16.6),  # 2 x 7.5B + (2 + 12) x 7.5B / 64
        (3, 1.9),  # 16 x 7.5B / 64
    ],
)
def test_zero_paper_figure_1(zero, expected_gb):
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, N_d = 64, K = 12.
    total = sum(model_state_bytes(7.5e9, zero, 64))
    assert total / 1e9 == pytest.approx(expected_gb, abs=0.05)


def test_zero_stages_for_7b_on_8_data_parallel_ranks():
    # 7B parameters, dp = 8, mixed-precision Adam (2 + 2 + 12 bytes per parameter):
    # ZeRO-0: 16 B x 7e9 = 112 GB. ZeRO-1: 2 + 2 + 12/8 = 5.5 B -> 38.5 GB.
    # ZeRO-2: 2 + 14/8 = 3.75 B -> 26.25 GB. ZeRO-3: 16/8 = 2 B -> 14 GB.
    assert model_state_bytes(7e9, 0, 8) == StateBytes(14e9, 14e9, 84e9)
    assert model_state_bytes(7e9, 1, 8) == StateBytes(14e9, 14e9, 10.5e9)
    assert model_state_bytes(7e9, 2, 8) == StateBytes(14e9, 1.75e9, 10.5e9)
    assert model_state_bytes(7e9, 3, 8) == StateBytes(1.75e9, 1.75e9, 10.5e9)
    assert [sum(model_state_bytes(7e9, z, 8)) for z in range(4)] == [112e9, 38.5e9, 26.25e9, 14e9]


def test_precision_choices():
    # Megatron-style fp32 gradient accumulation: 2 + 4 + 12 = 18 B/param -> 126 GB for 7B.
    assert sum(model_state_bytes(7e9, 0, 1, grad_bytes_per_param=FP32_GRAD_BYTES_PER_PARAM)) == 126e9
    # fp32 Adam: 4 + 4 + 8 = 16 B/param; ZeRO-1 over 4 ranks: 4 + 4 + 8/4 = 10 B/param.
    assert model_state_bytes(1e9, 1, 4, optimizer=Optimizer.ADAM_FP32) == StateBytes(4e9, 4e9, 2e9)
    assert model_state_bytes(1e9, 0, 1, optimizer="adam-fp32", weight_bytes_per_param=1) == StateBytes(1e9, 4e9, 8e9)


def test_frozen_parameters_keep_weights_and_an_fp32_copy_but_no_gradients_or_moments():
    # 7e9 parameters of which 3e9 frozen, dp = 8, mixed precision: weights 2 B x 7e9 = 14 GB; gradients
    # 2 B x 4e9 = 8 GB (ZeRO-2: / 8 = 1 GB); optimizer 12 B x 4e9 + 4 B x 3e9 (FSDP2's fp32 originals)
    # = 60 GB, / 8 = 7.5 GB under ZeRO-1. fp32 Adam keeps nothing extra for a frozen parameter:
    # 8 B x 4e9 = 32 GB.
    assert model_state_bytes(7e9, 0, 8, frozen_params=3e9) == StateBytes(14e9, 8e9, 60e9)
    assert model_state_bytes(7e9, 2, 8, frozen_params=3e9) == StateBytes(14e9, 1e9, 7.5e9)
    assert model_state_bytes(7e9, 0, 1, optimizer=Optimizer.ADAM_FP32, frozen_params=3e9) == StateBytes(28e9, 16e9, 32e9)
    with pytest.raises(ValueError, match="frozen_params"):
        model_state_bytes(7e9, 0, 8, frozen_params=8e9)


def test_buffers_count_whole_with_the_weights():
    # 1 GB of buffers on a tp 4, ZeRO-3 stage: neither split divides them.
    base = dict(params=8e9, activation_bytes_per_microbatch=0, in_flight=0, tp=4, zero=3, dense_shard_group=8,
                context_bytes=0, fragmentation_fraction=0)
    with_buffers = stage_memory(**base, buffer_bytes=1e9)
    assert with_buffers.weights_bytes - stage_memory(**base).weights_bytes == pytest.approx(1e9)


def test_zero3_counts_the_gathered_working_copy_with_the_weights():
    # 8e9 params over 16 ranks: shard 0.5e9 x 2 B = 1 GB, plus two gathered layers of 0.2e9 x 2 B = 0.8 GB.
    states = model_state_bytes(8e9, 3, 16, gathered_params=4e8)
    assert states.weights_bytes == pytest.approx(1.8e9)
    assert states.grads_bytes == pytest.approx(1e9)
    with pytest.raises(ValueError, match="only ZeRO-3"):
        model_state_bytes(8e9, 2, 16, gathered_params=4e8)


def test_fsdp2_zero3_keeps_no_half_precision_shard():
    # As above, but the fp32 shard is the master copy (FSDP2): weights are the gathered 0.8 GB only;
    # the optimizer still holds master + moments, 12 B x 0.5e9 = 6 GB. Without a master copy (fp32
    # Adam) the shard is the weights and stays.
    states = model_state_bytes(8e9, 3, 16, gathered_params=4e8, shard_is_master=True)
    assert (states.weights_bytes, states.optimizer_bytes) == (pytest.approx(0.8e9), pytest.approx(6e9))
    fp32 = model_state_bytes(8e9, 3, 16, optimizer=Optimizer.ADAM_FP32, shard_is_master=True)
    assert fp32.weights_bytes == pytest.approx(8e9 * 4 / 16)


def test_deferred_gradient_sync_keeps_zero2_and_zero3_gradients_whole():
    # 8e9 params over 16 ranks, 2 B gradients: 1 GB sharded, 16 GB when reduced only after the last
    # micro-batch; ZeRO-1 holds them whole either way.
    for zero in (2, 3):
        assert model_state_bytes(8e9, zero, 16).grads_bytes == pytest.approx(1e9)
        assert model_state_bytes(8e9, zero, 16, deferred_grad_sync=True).grads_bytes == pytest.approx(16e9)
    assert model_state_bytes(8e9, 1, 16, deferred_grad_sync=True) == model_state_bytes(8e9, 1, 16)


@pytest.mark.parametrize("activation_bytes,expected_gb", [(1e9, 63.0), (20e9, 126.0)])
def test_deferred_zero3_stage_peaks_at_the_larger_of_forward_and_backward_end(activation_bytes, expected_gb):
    # An 8e9-parameter ZeRO-3 stage over 8 ranks (FSDP2: the fp32 shard is the master copy), fp32
    # gradients reduced after the last micro-batch, 4 micro-batches in flight, two layers of 0.5e9
    # gathered. Optimizer 12 B x 1e9 = 12 GB, gradients 4 B x 8e9 = 32 GB, then either
    #   forward end: 2 gathered layers 2 GB + 4 x activations, or
    #   backward end: all 8e9 gathered, 16 GB, + 3 x activations (one micro-batch just freed):
    # 1 GB each: max(50, 63) = 63 GB; 20 GB each: max(126, 120) = 126 GB.
    kwargs = dict(params=8e9, activation_bytes_per_microbatch=activation_bytes, in_flight=4, zero=3,
                  dense_shard_group=8, gathered_params=1e9, grad_bytes_per_param=FP32_GRAD_BYTES_PER_PARAM,
                  shard_is_master=True, context_bytes=0, fragmentation_fraction=0)
    assert stage_memory(**kwargs, deferred_grad_sync=True).total_bytes == pytest.approx(expected_gb * 1e9)
    # two interleaved chunks per device: a backward frees half a micro-batch of the device's layers
    backward_end_gb = (16 + 32 + 12) + 3.5 * activation_bytes / 1e9
    assert stage_memory(**kwargs, deferred_grad_sync=True, chunks=2).total_bytes == pytest.approx(
        max(expected_gb, backward_end_gb) * 1e9)
    # reduced every micro-batch: gradients sharded, 4 GB, and only the forward end counts
    assert stage_memory(**kwargs).total_bytes == pytest.approx((2 + 4 + 12) * 1e9 + 4 * activation_bytes)


@pytest.mark.parametrize("activation_bytes,peak_moment", [(30e9, "forward end"), (1e9, "optimizer step")])
def test_without_gradient_accumulation_the_peak_is_the_larger_moment(activation_bytes, peak_moment):
    # 1e9 params, ZeRO-0, fp32 gradients: weights 2 GB, gradients 4 GB, optimizer 12 GB; temporaries 2 GB.
    # Forward end: 2 + 12 + activations + 2; optimizer step: 2 + 4 + 12 = 18 GB.
    common = dict(params=1e9, activation_bytes_per_microbatch=activation_bytes, in_flight=1, temp_bytes=2e9,
                  grad_bytes_per_param=FP32_GRAD_BYTES_PER_PARAM, context_bytes=0, fragmentation_fraction=0)
    held = stage_memory(**common)
    freed = stage_memory(**common, grads_at_peak=False)
    assert held.total_bytes == pytest.approx(2e9 + 4e9 + 12e9 + activation_bytes + 2e9)
    if peak_moment == "forward end":
        assert (freed.grads_bytes, freed.total_bytes) == (0.0, pytest.approx(16e9 + activation_bytes))
    else:
        assert (freed.activations_bytes, freed.temp_bytes, freed.total_bytes) == (0.0, 0.0, pytest.approx(18e9))


@pytest.mark.parametrize("activation_bytes", [30e9, 1e9])
def test_gradients_a_reduce_stream_wrote_stay_reserved_through_the_forward(activation_bytes):
    # The same states as above, gradients freed between steps but their blocks kept for the
    # data-parallel reduce stream: the forward's end holds the 4 GB as overhead (reserved), not as
    # gradients (allocated), at any activation size; a 5% fragmentation share applies to the
    # allocated bytes only.
    common = dict(params=1e9, activation_bytes_per_microbatch=activation_bytes, in_flight=1, temp_bytes=2e9,
                  grad_bytes_per_param=FP32_GRAD_BYTES_PER_PARAM, context_bytes=0, grads_at_peak=False, grads_pooled=True)
    pooled = stage_memory(**common, fragmentation_fraction=0)
    assert (pooled.grads_bytes, pooled.overhead_bytes) == (0.0, pytest.approx(4e9))
    assert pooled.total_bytes == pytest.approx(2e9 + 4e9 + 12e9 + activation_bytes + 2e9)
    fragmented = stage_memory(**common, fragmentation_fraction=0.05)
    assert fragmented.overhead_bytes == pytest.approx(4e9 + 0.05 * (16e9 + activation_bytes))
    # with accumulation the gradients are allocated at the peak, and the pool adds nothing
    assert stage_memory(**{**common, "grads_at_peak": True}, fragmentation_fraction=0).total_bytes == pooled.total_bytes


def test_fsdp_memory_from_8_to_128_ranks_drops_by_the_sharded_states_gradients_included():
    # torchtitan's December 2024 H100 tables 1 and 3 run Llama 3.1 8B under FSDP at 2 x 8K tokens
    # per GPU on 8 and 128 GPUs: the reserved peaks differ by 15.4, 15.0 and 15.0 GiB (eager,
    # compile, compile + Float8). Only the sharded states change: fp32 master weights and two
    # moments (12 B per parameter, allocated, with the allocator's 5% share) and, reserved in the
    # reduce stream's pool, the fp32 gradients (4 B): (12 x 1.05 + 4) x 8.03e9 x (1/8 - 1/128) =
    # 14.5 GiB; without the gradients it would be 11.0 GiB.
    import planner
    graph = planner.trace("llama3-8b", seq_len=4096)  # the difference does not depend on the activations
    config = {"tp": 1, "pp": 1, "micro_batch": 2, "zero": 3, "recompute": "selective_op"}
    small = planner.evaluate(graph, "h100-hbm2e:1x8", {**config, "dp": 8}, global_batch=16)
    large = planner.evaluate(graph, "h100-hbm2e:16x8", {**config, "dp": 128}, global_batch=256)
    drop_bytes = small.peak_memory_bytes - large.peak_memory_bytes
    assert drop_bytes == pytest.approx((12 * (1 + ALLOCATOR_FRAGMENTATION_FRACTION) + 4) * graph.params * (1 / 8 - 1 / 128), rel=1e-6)
    for published_gib in (15.4, 15.0, 15.0):  # within 6% of each; 11.0 GiB would miss by 27-29%
        assert drop_bytes / 2**30 == pytest.approx(published_gib, rel=0.06)


def test_stage_memory_divides_dense_and_expert_parameters_separately():
    # 10e9 params of which 8e9 in experts; tp=2, ep=4, ZeRO-1; dense states sharded over 8 ranks,
    # expert states over 2. Dense per device: 2e9 / 2 = 1e9 -> weights 2 GB, grads 2 GB,
    # optimizer 12 GB / 8 = 1.5 GB. Experts per device: 8e9 / 4 = 2e9 -> 4 GB, 4 GB, 24 GB / 2 = 12 GB.
    memory = stage_memory(
        params=10e9, expert_params=8e9, tp=2, ep=4, zero=1, dense_shard_group=8, expert_shard_group=2,
        activation_bytes_per_microbatch=3e9, in_flight=4, comm_buffer_bytes=0.5e9, temp_bytes=0.25e9,
        context_bytes=0.5e9, fragmentation_fraction=0.1,
    )
    assert memory.weights_bytes == pytest.approx(6e9)
    assert memory.grads_bytes == pytest.approx(6e9)
    assert memory.optimizer_bytes == pytest.approx(13.5e9)
    assert memory.activations_bytes == pytest.approx(12e9)
    # Overhead: 0.5 GB context + 10% of (6 + 6 + 13.5 + 12 + 0.5 + 0.25) GB = 0.5 + 3.825 GB.
    assert memory.overhead_bytes == pytest.approx(4.325e9)
    assert memory.total_bytes == pytest.approx(38.25e9 + 4.325e9)


def test_expert_tensor_parallelism_shards_experts_further():
    plain = stage_memory(params=8e9, expert_params=8e9, ep=4, activation_bytes_per_microbatch=0, in_flight=0,
                         context_bytes=0, fragmentation_fraction=0)
    with_tp = stage_memory(params=8e9, expert_params=8e9, ep=4, expert_tp=2, activation_bytes_per_microbatch=0,
                           in_flight=0, context_bytes=0, fragmentation_fraction=0)
    # 8e9 / 4 = 2e9 experts params per device at 16 B; expert_tp=2 halves it.
    assert plain.total_bytes == pytest.approx(32e9)
    assert with_tp.total_bytes == pytest.approx(16e9)


def test_default_overhead_uses_the_named_constants():
    memory = stage_memory(params=1e9, activation_bytes_per_microbatch=1e9, in_flight=2)
    rest = 16e9 + 2e9
    assert memory.overhead_bytes == pytest.approx(CUDA_CONTEXT_BYTES + ALLOCATOR_FRAGMENTATION_FRACTION * rest)


def _seq_sel_activation_bytes(seq, micro_batch, hidden, tp, layers, pp, vpp):
    """Stage-0 activations with sequence parallelism and selective recompute (Korthikanti Table 2:
    34 s b h / t per layer), through our pipeline and memory functions."""
    per_layer = 34 * seq * micro_batch * hidden / tp
    schedule = "interleaved" if vpp > 1 else "1f1b"
    in_flight = in_flight_microbatches(schedule, pp, 0, 4 * pp, vpp)
    memory = stage_memory(params=0, activation_bytes_per_microbatch=per_layer * layers / pp, in_flight=in_flight,
                          context_bytes=0, fragmentation_fraction=0)
    return memory.activations_bytes, per_layer * layers


@pytest.mark.parametrize(
    "model,seq,micro_batch,hidden,tp,layers,pp,vpp,published_gib",
    [
        # Korthikanti et al. 2022 Figure 1 "seq+sel" bars (GiB per GPU), as transcribed in Calculon's
        # validation (calculon/llm/validation.py seqsel_fig1); configurations from their Table 3.
        ("22B", 2048, 4, 6144, 8, 48, 1, 1, 9.5625),
        ("175B", 2048, 1, 12288, 8, 96, 8, 3, 12.3515625),
        ("530B", 2048, 1, 20480, 8, 105, 35, 3, 23.076171875),
        ("1T", 2048, 1, 25600, 8, 128, 64, 1, 26.5625),
    ],
)
def test_first_stage_activations_reproduce_korthikanti(model, seq, micro_batch, hidden, tp, layers, pp, vpp,
                                                       published_gib):
    # 1F1B's first stage holds p micro-batches of L/p layers = per_layer x L; interleaving adds
    # the factor 1 + (p-1)/(p v). 175B: 34*2048*12288/8 B/layer x 96 layers x (1 + 7/24) = 12.35 GiB.
    stage0, whole_model = _seq_sel_activation_bytes(seq, micro_batch, hidden, tp, layers, pp, vpp)
    assert stage0 / GIB == pytest.approx(published_gib, rel=1e-9)
    assert stage0 == pytest.approx(whole_model * (1 + (pp - 1) / (pp * vpp)) if vpp > 1 else whole_model)


def test_breakdown_arithmetic_and_json():
    a = MemoryBreakdown(weights_bytes=1, grads_bytes=2, optimizer_bytes=3, activations_bytes=4)
    b = MemoryBreakdown(comm_buffers_bytes=5, temp_bytes=6, overhead_bytes=7, weights_bytes=10)
    total = a + b
    assert total.weights_bytes == 11
    assert total.total_bytes == a.total_bytes + b.total_bytes == 38
    assert total.to_dict() == {
        "weights_bytes": 11, "grads_bytes": 2, "optimizer_bytes": 3, "activations_bytes": 4,
        "comm_buffers_bytes": 5, "temp_bytes": 6, "overhead_bytes": 7, "total_bytes": 38,
    }


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"zero": 4}, "zero=4"),
        ({"shard_group": 0}, "shard_group=0"),
        ({"params": -1.0}, "params=-1.0"),
        ({"optimizer": "lion"}, "use one of"),
    ],
)
def test_model_state_bad_arguments_name_the_field(kwargs, message):
    arguments = {"params": 1e9, "zero": 1, "shard_group": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        model_state_bytes(**arguments)


def test_stage_memory_rejects_more_experts_than_parameters():
    with pytest.raises(ValueError, match="expert_params"):
        stage_memory(params=1e9, expert_params=2e9, activation_bytes_per_microbatch=0, in_flight=1)
    with pytest.raises(ValueError, match="tp=0"):
        stage_memory(params=1e9, tp=0, activation_bytes_per_microbatch=0, in_flight=1)


params_st = st.floats(1e6, 1e12)
groups_st = st.integers(1, 4096)


@given(params_st, groups_st, groups_st, st.floats(0.0, 1.0))
def test_more_zero3_ranks_never_raise_weight_memory(params, dp, extra, gathered_share):
    gathered = gathered_share * params / 100
    fewer = model_state_bytes(params, 3, dp, gathered_params=gathered)
    more = model_state_bytes(params, 3, dp + extra, gathered_params=gathered)
    assert more.weights_bytes <= fewer.weights_bytes


@given(st.floats(0.0, 1e11), st.floats(0.0, 1e11), st.floats(0.0, 64.0))
def test_bigger_micro_batch_activations_never_lower_activation_memory(smaller, growth, in_flight):
    common = {"params": 1e9, "in_flight": in_flight}
    low = stage_memory(activation_bytes_per_microbatch=smaller, **common)
    high = stage_memory(activation_bytes_per_microbatch=smaller + growth, **common)
    assert high.activations_bytes >= low.activations_bytes
    assert high.total_bytes >= low.total_bytes


@given(params_st, groups_st, st.integers(0, 2), st.sampled_from(list(Optimizer)))
def test_higher_zero_stage_never_uses_more_memory(params, dp, zero, optimizer):
    lower = sum(model_state_bytes(params, zero, dp, optimizer=optimizer))
    higher = sum(model_state_bytes(params, zero + 1, dp, optimizer=optimizer))
    assert higher <= lower * (1 + 1e-12)


@given(params_st, st.integers(2, 4096), st.floats(0.0, 1.0))
def test_zero3_beats_zero2_while_the_gathered_copy_is_smaller_than_the_saved_shards(params, dp, share):
    # ZeRO-3 saves params * (1 - 1/dp) weights and spends gathered_params on working copies.
    gathered = share * params * (1 - 1 / dp)
    zero2 = sum(model_state_bytes(params, 2, dp))
    zero3 = sum(model_state_bytes(params, 3, dp, gathered_params=gathered))
    assert zero3 <= zero2 * (1 + 1e-12)


@pytest.mark.parametrize("weight_bytes, adam_bytes", [(2.0, 30.0), (4.0, 28.0)])
def test_offloaded_step_moves_gradients_and_weights_at_their_size(weight_bytes, adam_bytes):
    # 1e9 parameters: gradient down and weight up over the 25 GB/s host link at the working weight's
    # size (bf16 2 B: 4 GB; fp32 4 B: 8 GB), then the CPU Adam's host-memory bytes at 25 GB/s.
    expected_s = 2 * weight_bytes * 1e9 / HOST_LINK_BYTES_PER_S + adam_bytes * 1e9 / HOST_MEMORY_BYTES_PER_S
    assert offload_step_s(1e9, weight_bytes, adam_bytes) == pytest.approx(expected_s)
