"""Tests for planner.space: the degree tuples and configurations the search may consider.

Models here are fake ModelGraphs built from dimensions (no tracing): `enumerate_degrees` reads only
the heads, key/value heads, experts, layer count, sequence length and whether layers carry an op
graph. The expected degree sets are derived independently from the rules stated in the
`planner.space` docstring, by filtering every divisor product with itertools.
"""
from __future__ import annotations

from itertools import product

import pytest
from hypothesis import given
from hypothesis import strategies as st

from costmodel.profile_loader import load_cluster
from planner.config import Schedule
from planner.errors import PlannerError
from planner.mesh import stage_devices
from planner.graph import Layer, LayerKind, ModelDims, ModelGraph, Op, OpKind, Recompute
from planner.space import CP_MIN_SEQ_LEN, MAX_MICRO_BATCH, VPP_CHOICES, configs_for, divisors, enumerate_degrees

# Mixtral 8x7B (planner/zoo/specs/mixtral-8x7b.yaml): 32 blocks, 32 heads, 8 key/value heads, 8 experts.
MIXTRAL_8X7B = ModelDims(hidden=4096, heads=32, kv_heads=8, layers=32, vocab=32000, ffn_hidden=14336, experts=8, top_k=2)
# Largest context-parallel degree space.py offers (its `c <= 32` filter).
CP_MAX = 32


def fake_graph(dims: ModelDims, *, seq_len: int = 2048, with_ops: bool = True) -> ModelGraph:
    """Embedding + dims.layers identical blocks + head, each with one matmul op (or none: a module-level trace)."""
    ops = (Op(name="mm", fqn="", target="linear", kind=OpKind.MATMUL),) if with_ops else ()

    def layer(name: str, kind: LayerKind) -> Layer:
        return Layer(name=name, kind=kind, fqns=(name,), params=1000, param_bytes=2000, fwd_flops=1e9, bwd_flops=2e9,
                     saved_bytes={policy: 1000 for policy in Recompute}, out_bytes=100, ops=ops)

    layers = (layer("embed", LayerKind.EMBEDDING),) + tuple(layer(f"layers.{i}", LayerKind.BLOCK) for i in range(dims.layers))
    return ModelGraph(name="fake", seq_len=seq_len, micro_batch=1, dtype="bf16", trace_method="fx" if with_ops else "module",
                      layers=layers + (layer("head", LayerKind.HEAD),), dims=dims)


def refusal(dims: ModelDims, cluster: str, constraints: dict, seq_len: int = 2048) -> str:
    """The message with which `enumerate_degrees` refuses `constraints` on `cluster`."""
    with pytest.raises(PlannerError) as error:
        enumerate_degrees(fake_graph(dims, seq_len=seq_len), load_cluster(cluster), constraints)
    return error.value.message


def expected_degrees(dims: ModelDims, num_layers: int, seq_len: int, devices: int, per_node: int,
                     global_batch: int | None = None) -> set[tuple]:
    """Every (dp, tp, pp, cp, ep) the space rules allow, by brute force over divisor products: cp
    below CP_MIN_SEQ_LEN tokens only where the global batch leaves more than a node beside dp."""
    batch_dp = max(d for d in range(1, devices + 1) if devices % d == 0 and global_batch % d == 0) if global_batch else devices
    short_cp = batch_dp * per_node < devices
    out = set()
    for tp, cp, pp in product(divisors(devices), repeat=3):
        if devices % (tp * cp * pp):
            continue
        dp = devices // (tp * cp * pp)
        tp_ok = tp <= per_node and dims.heads % tp == 0 and (tp == 1 or dims.kv_heads % tp == 0 or tp % dims.kv_heads == 0)
        cp_ok = (cp == 1 or seq_len % (2 * cp) == 0) and cp <= CP_MAX and (cp == 1 or seq_len >= CP_MIN_SEQ_LEN or short_cp)
        split_ok = seq_len % cp == 0  # each cp rank's share is whole tokens (tp keeps the stream whole where it cannot split it)
        if not (tp_ok and cp_ok and split_ok and pp <= num_layers):
            continue
        eps = [e for e in divisors(dp * cp) if dims.experts % e == 0] if dims.experts else [1]  # groups inside dp x cp
        out |= {(dp, tp, pp, cp, ep) for ep in eps}
    return out


@given(
    nodes=st.sampled_from([1, 2, 3, 4, 8]),
    per_node=st.sampled_from([1, 2, 4, 8]),
    heads=st.sampled_from([4, 6, 12, 16, 32, 40, 96]),
    kv_ratio=st.sampled_from([1, 2, 4, 8]),
    blocks=st.integers(1, 24),
    experts=st.sampled_from([0, 4, 6, 8, 64]),
    seq_len=st.sampled_from([197, 512, 2048, 8192, 12288, 32768]),
    global_batch=st.sampled_from([None, 1, 7, 16, 97, 256]),
)
def test_degrees_are_exactly_the_valid_tuples(nodes, per_node, heads, kv_ratio, blocks, experts, seq_len, global_batch):
    kv_heads = heads // kv_ratio if heads % kv_ratio == 0 else heads
    dims = ModelDims(hidden=heads * 64, heads=heads, kv_heads=kv_heads, layers=blocks, experts=experts, top_k=min(2, experts))
    graph = fake_graph(dims, seq_len=seq_len)
    cluster = load_cluster(f"a100-80g:{nodes}x{per_node}")
    space = enumerate_degrees(graph, cluster, {}, global_batch)
    got = set(space.degrees)
    assert len(got) == len(space.degrees), "duplicate degree tuples"
    assert got == expected_degrees(dims, len(graph.layers), seq_len, nodes * per_node, per_node, global_batch)
    for dp, tp, pp, cp, ep in got:
        assert dp * tp * pp * cp == cluster.num_devices


def test_tp_stays_inside_a_node_unless_allowed():
    # gpt3-350m-like: 16 heads; on 2 nodes of 8 the only tp beyond a node that divides the heads is 16.
    dims = ModelDims(hidden=1024, heads=16, kv_heads=16, layers=24)
    graph, cluster = fake_graph(dims), load_cluster("a100-80g:2x8")
    default = enumerate_degrees(graph, cluster, {})
    assert {tp for _, tp, *_ in default.degrees} == {1, 2, 4, 8}
    assert any(r.what == "tp=16" and "8 devices of a node" in r.reason for r in default.rejected)
    across = enumerate_degrees(graph, cluster, {"allow_tp_across_nodes": True})
    assert {tp for _, tp, *_ in across.degrees} == {1, 2, 4, 8, 16}
    # A tp the user fixes is taken as given (DESIGN.md: a flag given to plan fixes that choice).
    fixed = enumerate_degrees(graph, cluster, {"tp": 16})
    assert {tp for _, tp, *_ in fixed.degrees} == {16}


def test_tp_must_divide_heads_with_a_reason():
    # gpt3-125m: 12 heads on 8 devices: tp=8 does not divide 12, so tp is 1, 2 or 4.
    dims = ModelDims(hidden=768, heads=12, kv_heads=12, layers=12)
    space = enumerate_degrees(fake_graph(dims), load_cluster("a100-80g:1x8"), {})
    assert {tp for _, tp, *_ in space.degrees} == {1, 2, 4}
    assert any(r.what == "tp=8" and "12 attention heads" in r.reason for r in space.rejected)


def test_grouped_query_heads_allow_tp_that_divides_or_is_a_multiple_of_kv_heads():
    # 24 heads, 8 kv heads on 8 devices: tp=1,2,4,8 all divide 24; 2, 4 and 8 divide 8 -> all allowed.
    # 24 heads, 3 kv heads: tp=2 and 4 neither divide 3 nor are multiples of it; tp=1 and (24 % 8 == 0, 8 % 3 != 0) so 8 is out too.
    devices = load_cluster("a100-80g:1x8")
    gqa = enumerate_degrees(fake_graph(ModelDims(hidden=3072, heads=24, kv_heads=8, layers=4)), devices, {})
    assert {tp for _, tp, *_ in gqa.degrees} == {1, 2, 4, 8}
    odd = enumerate_degrees(fake_graph(ModelDims(hidden=3072, heads=24, kv_heads=3, layers=4)), devices, {})
    assert {tp for _, tp, *_ in odd.degrees} == {1}
    assert any(r.what == "tp=2" and "3 key/value heads" in r.reason for r in odd.rejected)


def test_tp_on_tokens_it_does_not_divide_runs_without_sequence_parallelism():
    # ViT-L/16 at 224 px: 196 patches and the class token, 197 tokens, which no tp > 1 divides:
    # sequence parallelism would leave ranks uneven shares of the stream, so those configurations keep
    # the stream whole on the tp ranks (Megatron-LM's tensor parallelism without SP).
    dims = ModelDims(hidden=1024, heads=16, kv_heads=16, layers=24)
    graph = fake_graph(dims, seq_len=197)
    space = enumerate_degrees(graph, load_cluster("a100-80g:1x8"), {})
    assert {tp for _, tp, *_ in space.degrees} == {1, 2, 4, 8}
    configs = [config for degrees in space.degrees for config in configs_for(degrees, graph, 64, {})]
    assert configs and all(config.sequence_parallel == (config.tp == 1) for config in configs)
    assert all(("no-sp" in config.short()) == (config.tp > 1) for config in configs)  # the tables say so


def test_module_level_trace_allows_only_tp1():
    dims = ModelDims(hidden=1024, heads=16, kv_heads=16, layers=24)
    space = enumerate_degrees(fake_graph(dims, with_ops=False), load_cluster("a100-80g:1x8"), {})
    assert {tp for _, tp, *_ in space.degrees} == {1}
    assert any("op graph" in r.reason for r in space.rejected)


def test_expert_parallelism_divides_experts_and_the_data_parallel_group():
    # Mixtral 8x7B on 32 devices: every ep divides the 8 experts and dp*cp, and ep=8 is reachable.
    cluster = load_cluster("a100-80g:4x8")
    space = enumerate_degrees(fake_graph(MIXTRAL_8X7B, seq_len=4096), cluster, {})
    eps = set()
    for dp, tp, pp, cp, ep in space.degrees:
        assert MIXTRAL_8X7B.experts % ep == 0 and dp % ep == 0, (dp, tp, pp, cp, ep)
        eps.add(ep)
    assert eps == {1, 2, 4, 8}
    # dp=4 (tp=8, pp=1) leaves ep in {1, 2, 4}; ep=8 would need 8 data-parallel ranks.
    assert {ep for dp, tp, pp, cp, ep in space.degrees if (dp, tp, pp) == (4, 8, 1)} == {1, 2, 4}


def test_dense_models_have_ep1_only_and_fixed_ep_is_rejected():
    dims = ModelDims(hidden=1024, heads=16, kv_heads=16, layers=24)
    space = enumerate_degrees(fake_graph(dims), load_cluster("a100-80g:1x8"), {})
    assert {ep for *_, ep in space.degrees} == {1}
    # The message names what blocks the fixed degree (once, however many tuples it blocked), not
    # rejections of other degrees.
    assert refusal(dims, "a100-80g:1x8", {"ep": 2}) == ("no parallel degrees fit the constraints ep 2: ep=2: not possible: "
                                   "the model has no experts; options are [1]; relax one of them")


def test_a_fixed_pipeline_degree_that_cannot_be_says_why():
    # 8 devices with tp=8 leave one device per tensor-parallel group: pp=2 cannot be, nor can the
    # tp=2 and cp=2 of a 2-device cluster; the fixed degrees' product says so.
    dims = ModelDims(hidden=1024, heads=16, kv_heads=16, layers=24)
    assert refusal(dims, "a100-80g:1x8", {"tp": 8, "pp": 2}) == ("tp=8 x pp=2 = 16 devices: does not divide the cluster's 8; "
                                                                 "fix degrees whose product divides 8")
    assert refusal(dims, "a100-80g:1x2", {"tp": 2, "cp": 2}, seq_len=1024).startswith("tp=2 x cp=2 = 4 devices")
    # A product that divides the devices, leaving cp = 2 to fill them: cp is not searched at 2048 tokens.
    assert "give --cp to price it" in refusal(dims, "a100-80g:1x8", {"tp": 2, "pp": 2, "dp": 1})


def test_a_fixed_tensor_degree_is_refused_for_its_own_reason_only():
    # 12 heads and 4 key/value heads on 6 devices: tp=3 divides the heads and fits the node, so the
    # key/value heads alone refuse it; the message must not blame the node or the heads.
    dims = ModelDims(hidden=768, heads=12, kv_heads=4, layers=12)
    assert refusal(dims, "h100-sxm:1x6", {"tp": 3}) == ("no parallel degrees fit the constraints tp 3: tp=3: neither divides nor is a "
                                   "multiple of the 4 key/value heads; tp=3: options are [1, 2]; relax one of them")


def test_a_fixed_degree_names_its_own_reason_before_the_options_of_each_combination():
    # pp=3 on 8 devices: its own reason (it does not divide them) leads, then what pp can be for
    # each tp, labelled by that tp: lists for different tp are not contradictions.
    dims = ModelDims(hidden=1024, heads=16, kv_heads=16, layers=24)
    assert refusal(dims, "a100-80g:1x8", {"pp": 3}) == ("no parallel degrees fit the constraints pp 3: pp=3: does not divide the "
                                   "cluster's 8 devices; pp=3: options with tp=1 and cp=1 are [1, 2, 4, 8]; "
                                   "pp=3: options with tp=2 and cp=1 are [1, 2, 4]; relax one of them")
    # A cp the sequence rules out says which rule.
    assert "cp=8: not possible (cp divides the 8 devices, 2 x cp the 1000 tokens, and cp <= 32)" in refusal(
        dims, "a100-80g:1x8", {"cp": 8}, seq_len=1000)


def test_a_bound_that_leaves_no_degree_is_named_with_the_values_each_reason_rules_out():
    # hetero-a100-v100-8n: 4 A100 and 4 V100 nodes, so every stage keeps to one device type only
    # with pp >= 2; max_pp=1 leaves nothing, for a reason of pp=1's own and the bound's.
    dims = ModelDims(hidden=1024, heads=16, kv_heads=16, layers=24)
    assert refusal(dims, "hetero-a100-v100-8n", {"max_pp": 1}) == (
        "no parallel degrees fit the constraints max-pp 1: pp=1: a pipeline stage would span node groups of "
        "different device types; pp=2, pp=4, pp=8, pp=16: outside the user bound max_pp=1 on pipeline parallelism; relax one of them")


def test_data_parallel_bounds_are_kept():
    # dp is what the other degrees leave; min_dp and max_dp bound it as min_tp and max_tp bound tp.
    dims = ModelDims(hidden=1024, heads=16, kv_heads=16, layers=24)
    graph, cluster = fake_graph(dims), load_cluster("a100-80g:1x8")
    assert {dp for dp, *_ in enumerate_degrees(graph, cluster, {"max_dp": 2}).degrees} == {1, 2}
    assert {dp for dp, *_ in enumerate_degrees(graph, cluster, {"min_dp": 4}).degrees} == {4, 8}
    assert "dp=8: outside the user bound min_dp=16 on data parallelism" in refusal(dims, "a100-80g:1x8", {"min_dp": 16})


def test_a_fixed_expert_degree_says_once_what_refuses_it():
    # Mixtral's 8 experts on 32 devices: ep=16 divides no expert count, whatever dp is (said once,
    # not once per dp); ep=8 with tp=1 pp=1 on 4 devices divides the experts but not dp x cp=4.
    assert refusal(MIXTRAL_8X7B, "h100-sxm:4x8", {"ep": 16}) == ("no parallel degrees fit the constraints ep 16: ep=16: does not divide the 8 experts; "
                                   "ep=16: options with dp x cp=32 are [1, 2, 4, 8]; ep=16: options with dp x cp=16 are [1, 2, 4, 8]; relax one of them")
    assert refusal(MIXTRAL_8X7B, "h100-sxm:1x4", {"ep": 8, "tp": 1, "pp": 1}).endswith(
        "ep=8: not possible with dp x cp=4 (8 experts; ep divides them and dp x cp); options are [1, 2, 4]; relax one of them")


def test_context_parallelism_only_for_long_sequences():
    dims = ModelDims(hidden=4096, heads=32, kv_heads=8, layers=32)
    cluster = load_cluster("h100-sxm:2x8")
    short = enumerate_degrees(fake_graph(dims, seq_len=4096), cluster, {})
    assert {cp for *_, cp, _ in short.degrees} == {1}
    assert any(r.what == "cp>1" for r in short.rejected)
    long = enumerate_degrees(fake_graph(dims, seq_len=CP_MIN_SEQ_LEN), cluster, {})
    assert {cp for *_, cp, _ in long.degrees} == {1, 2, 4, 8, 16}
    # A fixed cp is honoured below the threshold (the user asked for it).
    forced = enumerate_degrees(fake_graph(dims, seq_len=4096), cluster, {"cp": 2})
    assert {cp for *_, cp, _ in forced.degrees} == {2}


def test_fixed_degrees_and_bounds():
    dims = ModelDims(hidden=1024, heads=16, kv_heads=16, layers=24)
    graph, cluster = fake_graph(dims), load_cluster("a100-80g:4x8")
    fixed = enumerate_degrees(graph, cluster, {"tp": 4, "pp": 2})
    assert {(tp, pp) for _, tp, pp, *_ in fixed.degrees} == {(4, 2)}
    bounded = enumerate_degrees(graph, cluster, {"min_tp": 2, "max_tp": 4, "max_pp": 4})
    assert {tp for _, tp, *_ in bounded.degrees} == {2, 4}
    assert max(pp for _, _, pp, *_ in bounded.degrees) == 4
    assert any(r.what == "tp=8" and "user bound" in r.reason for r in bounded.rejected)
    only_dp8 = enumerate_degrees(graph, cluster, {"dp": 8})
    assert {dp for dp, *_ in only_dp8.degrees} == {8}
    with pytest.raises(PlannerError, match="tp"):
        enumerate_degrees(graph, cluster, {"tp": 3})


def test_heterogeneous_pipeline_stages_sit_on_one_device_type():
    # hetero-a100-v100-8n: 32 a100 then 32 v100 devices; pp=1 would put both types in one stage.
    cluster = load_cluster("hetero-a100-v100-8n")
    dims = ModelDims(hidden=2048, heads=16, kv_heads=16, layers=24)
    space = enumerate_degrees(fake_graph(dims), cluster, {})
    pps = {pp for _, _, pp, *_ in space.degrees}
    assert 1 not in pps and 2 in pps
    for pp in pps:
        stage_devices(cluster, pp)  # raises if a stage spans device types
    assert any(r.what == "pp=1" and "device types" in r.reason for r in space.rejected)


@pytest.mark.parametrize("global_batch", [1, 24, 64, 96])
def test_configs_cover_the_batch_and_respect_schedule_rules(global_batch):
    dims = ModelDims(hidden=1024, heads=16, kv_heads=16, layers=6)
    graph, cluster = fake_graph(dims), load_cluster("a100-80g:1x8")
    seen_interleaved = False
    for degrees in enumerate_degrees(graph, cluster, {}).degrees:
        dp, tp, pp, cp, ep = degrees
        configs = list(configs_for(degrees, graph, global_batch, {}))
        if global_batch % dp:
            assert configs == []
            continue
        per_replica = global_batch // dp
        expected_mbs = {b for b in divisors(per_replica) if b <= MAX_MICRO_BATCH}
        assert {c.micro_batch for c in configs} == expected_mbs
        for config in configs:
            assert (config.dp, config.tp, config.pp, config.cp, config.ep) == degrees
            assert config.devices == cluster.num_devices
            assert config.global_batch == global_batch
            assert config.zero == 0 or dp * cp > 1 or (config.zero == 3 and pp == 1)  # one rank: only ZeRO-3 differs
            assert config.zero != 2 or pp == 1  # under pipelining ZeRO-2 runs as ZeRO-1 (test_estimate)
            if config.schedule == Schedule.INTERLEAVED:
                seen_interleaved = True
                assert config.vpp in VPP_CHOICES and config.num_microbatches % pp == 0
                assert pp * config.vpp <= len(graph.layers)
            if config.schedule == Schedule.GPIPE:
                assert config.num_microbatches >= pp
            if config.schedule == Schedule.ZERO_BUBBLE:  # torch splits the micro-batches into m // pp equal rounds
                assert config.num_microbatches < pp or config.num_microbatches % (config.num_microbatches // pp) == 0
            if pp == 1:
                assert config.schedule == Schedule.ONE_F_ONE_B
        assert len(set(configs)) == len(configs)
    assert seen_interleaved == (global_batch >= 2)


@pytest.mark.parametrize("seq_len, largest", [(128, 256), (1024, 32), (2048, 16), (8192, 16)])
def test_micro_batches_go_up_to_16_sequences_or_32k_tokens(seq_len, largest):
    # 16 x 2048 tokens: at 128 tokens a sequence that is 256 sequences, at 8192 still 16.
    graph = fake_graph(ModelDims(hidden=1024, heads=16, kv_heads=16, layers=2), seq_len=seq_len)
    configs = configs_for((1, 1, 1, 1, 1), graph, 1024, {})
    assert {config.micro_batch for config in configs} == {b for b in divisors(1024) if b <= largest}


def test_zero_bubble_is_offered_only_for_micro_batch_counts_torch_runs():
    # ScheduleInterleavedZeroBubble splits m micro-batches into m // pp equal rounds: 16 on 3 stages
    # would be 5 rounds, which 16 is not a multiple of; 15 and 18 are, and 2 (< pp) is one round.
    from planner.space import schedules

    zero_bubble = {m: (Schedule.ZERO_BUBBLE, 1) in schedules(3, 24, m, {}) for m in (2, 15, 16, 18)}
    assert zero_bubble == {2: True, 15: True, 16: False, 18: True}


def test_fixed_choices_narrow_configs():
    dims = ModelDims(hidden=1024, heads=16, kv_heads=16, layers=6)
    graph = fake_graph(dims)
    constraints = {"micro_batch": 2, "zero": 1, "recompute": "full", "schedule": "1f1b"}
    configs = list(configs_for((2, 1, 4, 1, 1), graph, 32, constraints))
    assert configs and all(
        (c.micro_batch, c.zero, c.recompute, c.schedule) == (2, 1, Recompute.FULL, Schedule.ONE_F_ONE_B) for c in configs)
    # Interleaved with vpp=2 only: 8 micro-batches per replica, a multiple of pp=4.
    configs = list(configs_for((2, 1, 4, 1, 1), graph, 32, {"micro_batch": 2, "vpp": 2}))
    assert {(c.schedule, c.vpp) for c in configs} == {(Schedule.INTERLEAVED, 2)}
    # A fixed ZeRO-2 under pipelining is kept (it runs as ZeRO-1, which the search offers instead).
    assert {c.zero for c in configs_for((2, 1, 4, 1, 1), graph, 32, {"zero": 2})} == {2}
    # A micro-batch that does not divide the per-replica batch yields nothing.
    assert list(configs_for((2, 1, 4, 1, 1), graph, 32, {"micro_batch": 3})) == []


def test_hybrid_sharding_is_offered_per_node_for_zero3():
    # 32 devices of 8 per node at tp=2: a node holds 4 data-parallel ranks, so HSDP's usual layout
    # is dp=16 as 4 replicas of one node's 4 ranks. Only ZeRO-3 tries it (its per-micro-batch
    # gathers are what staying on the node's links saves); a fixed value is kept at any ZeRO stage
    # that shards, and refused where it does not divide dp or nothing is sharded.
    graph = fake_graph(ModelDims(hidden=1024, heads=16, kv_heads=16, layers=6))
    configs = list(configs_for((16, 2, 1, 1, 1), graph, 64, {}, devices_per_node=8))
    by_zero = {zero: {c.dp_replicate for c in configs if c.zero == zero} for zero in range(4)}
    assert by_zero == {0: {1}, 1: {1}, 2: {1}, 3: {1, 4}}
    assert all(c.shard_ranks == 4 for c in configs if c.dp_replicate == 4)
    # one node holds the whole data-parallel group: nothing to replicate across
    assert {c.dp_replicate for c in configs_for((4, 2, 1, 1, 1), graph, 64, {}, devices_per_node=8)} == {1}
    fixed = list(configs_for((16, 2, 1, 1, 1), graph, 64, {"dp_replicate": 2}, devices_per_node=8))
    assert {(c.zero, c.dp_replicate) for c in fixed} == {(1, 2), (2, 2), (3, 2)}
    assert list(configs_for((16, 2, 1, 1, 1), graph, 64, {"dp_replicate": 3})) == []
    assert list(configs_for((16, 2, 1, 1, 1), graph, 64, {"dp_replicate": 2, "zero": 0})) == []


@given(st.integers(min_value=1, max_value=5000))
def test_divisors_are_every_divisor_in_order(n):
    assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_divisors_of_a_shorthand_with_1e17_nodes_come_from_its_factors():
    # 8 x 10^17 = 2^20 x 5^17: 21 x 18 divisors, found without trial division up to its square root.
    found = divisors(8 * 10**17)
    assert len(found) == 21 * 18 and found[-1] == 8 * 10**17 and all(8 * 10**17 % d == 0 for d in found)
