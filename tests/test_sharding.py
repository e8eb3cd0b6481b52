"""Tests for planner.sharding: Megatron layouts from the ILP, degenerate cases, brute-force agreement.

Costs come from a stated roofline, not from the cost model:
- compute: forward+backward = 3 x forward, at max(FLOPs / 400 TFLOP/s, 2 x output bytes / 3 TB/s),
  divided by the ways the work is split;
- collectives on a ring of tp ranks over 450 GB/s links: all-reduce moves 2 (tp-1)/tp of the tensor,
  all-gather and reduce-scatter (tp-1)/tp, all-to-all (tp-1)/tp^2.
"""
from __future__ import annotations

import math
from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.apply_pins import apply_pins
from planner.errors import PlannerError, PlannerErrorKind
from planner.graph import Op, OpKind
from planner.milp import SolveStatus
from planner.sharding import ParamBudget, solve_layout
from planner.tracing import trace
from planner.tp_strategies import BOUNDARY, Collective, Placement, TensorLayout, op_strategies

PEAK_FLOPS_PER_S = 400e12
HBM_BYTES_PER_S = 3e12
LINK_BYTES_PER_S = 450e9
BF16_BYTES = 2

R, F, Q, P = TensorLayout.REPLICATE, TensorLayout.SHARD_FEATURE, TensorLayout.SHARD_SEQUENCE, TensorLayout.PARTIAL
# The conversions the layout model allows, restated independently of the module.
EXPECTED_COLLECTIVE = {
    (P, R): Collective.ALL_REDUCE,
    (P, Q): Collective.REDUCE_SCATTER,
    (F, R): Collective.ALL_GATHER,
    (Q, R): Collective.ALL_GATHER,
    (F, Q): Collective.ALL_TO_ALL,
    (Q, F): Collective.ALL_TO_ALL,
}
FREE = {(R, Q)}


def roofline_compute_s(op: Op, shards: int) -> float:
    return 3 * max(op.fwd_flops / PEAK_FLOPS_PER_S, 2 * op.out_bytes / HBM_BYTES_PER_S) / shards


def ring_comm_s(tp: int, link_bytes_per_s: float = LINK_BYTES_PER_S):
    share = {
        Collective.ALL_REDUCE: 2 * (tp - 1) / tp,
        Collective.ALL_GATHER: (tp - 1) / tp,
        Collective.REDUCE_SCATTER: (tp - 1) / tp,
        Collective.ALL_TO_ALL: (tp - 1) / tp**2,
    }
    return lambda kind, nbytes: share[kind] * nbytes / link_bytes_per_s


def linear(name: str, source: str, tokens: int, in_features: int, out_features: int, fqn: str | None = None) -> Op:
    return Op(
        name=name, fqn=fqn or f"block.{name}", target="linear", kind=OpKind.MATMUL, inputs=(source,),
        out_shape=(tokens, out_features), out_bytes=tokens * out_features * BF16_BYTES,
        fwd_flops=2.0 * tokens * in_features * out_features, param_shapes=((out_features, in_features),),
        attrs={"in_features": in_features, "out_features": out_features},
    )


def pointwise(name: str, kind: OpKind, inputs: tuple[str, ...], tokens: int, width: int, flops_per_element: float, params=()) -> Op:
    return Op(
        name=name, fqn=f"block.{name}" if params else "block", target=name, kind=kind, inputs=inputs,
        out_shape=(tokens, width), out_bytes=tokens * width * BF16_BYTES, fwd_flops=flops_per_element * tokens * width,
        param_shapes=params,
    )


def gpt_block(tokens=8192, hidden=4096, heads=32, kv_heads=None, ffn=16384, seq_len=2048) -> list[Op]:
    kv_heads = kv_heads or heads
    kv_width = hidden // heads * kv_heads
    attention = Op(
        "attn", "block.attn", "scaled_dot_product_attention", OpKind.ATTENTION, ("q", "k", "v"), (tokens, hidden),
        tokens * hidden * BF16_BYTES, 4.0 * tokens * seq_len * hidden, (), {"heads": heads, "kv_heads": kv_heads},
    )
    return [
        pointwise("ln1", OpKind.NORM, ("x",), tokens, hidden, 5, ((hidden,), (hidden,))),
        linear("q", "ln1", tokens, hidden, hidden),
        linear("k", "ln1", tokens, hidden, kv_width),
        linear("v", "ln1", tokens, hidden, kv_width),
        attention,
        linear("o_proj", "attn", tokens, hidden, hidden),
        pointwise("add1", OpKind.ELEMENTWISE, ("x", "o_proj"), tokens, hidden, 1),
        pointwise("ln2", OpKind.NORM, ("add1",), tokens, hidden, 5, ((hidden,), (hidden,))),
        linear("fc1", "ln2", tokens, hidden, ffn),
        pointwise("gelu", OpKind.ELEMENTWISE, ("fc1",), tokens, ffn, 8),
        linear("fc2", "gelu", tokens, ffn, hidden),
        pointwise("add2", OpKind.ELEMENTWISE, ("add1", "fc2"), tokens, hidden, 1),
    ]


def assert_consistent(layout, ops: list[Op]) -> None:
    """Every op has one placement; every edge either matches, is a free slice or has its collective."""
    assert set(layout.per_op) == {op.name for op in ops}
    strategy = {choice.name: choice.strategy for choice in layout.choices}
    calls = {(call.producer, call.layout): call.kind for call in layout.collectives}
    names = {op.name for op in ops}
    outside = [name for op in ops for name in op.inputs if name not in names][:1]
    consumed = {name for op in ops for name in op.inputs}
    edges = [
        (name if name in names else BOUNDARY, strategy[op.name].input_layouts[k])
        for op in ops for k, name in enumerate(op.inputs) if name in names or name in outside
    ]
    edges += [(op.name, layout.boundary) for op in ops if op.name not in consumed]
    for producer, needed in edges:
        produced = strategy[producer].output_layout
        if needed is None or produced == needed or (produced, needed) in FREE:
            continue
        assert calls[producer, needed] == EXPECTED_COLLECTIVE[produced, needed]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_gpt_block_gets_megatron_layout(tp):
    # Sharding q, k, v, o_proj, fc1, fc2 splits 24 T h^2 of 24 T h^2 + 4 T s h forward FLOPs tp ways,
    # and the only conversions this needs are the partial sums after the two rowwise linears.
    # Without sequence parallelism those become two all-reduces of T x h bf16 activations.
    ops = gpt_block()
    layout = solve_layout(ops, tp, roofline_compute_s, ring_comm_s(tp), sequence_parallel=False)
    expected = {"q": Placement.COLWISE, "k": Placement.COLWISE, "v": Placement.COLWISE, "attn": Placement.HEADS,
                "o_proj": Placement.ROWWISE, "fc1": Placement.COLWISE, "gelu": Placement.FEATURE, "fc2": Placement.ROWWISE}
    assert {name: layout.per_op[name] for name in expected} == expected
    assert layout.per_fqn["block.o_proj"] == Placement.ROWWISE and layout.per_fqn["block.attn"] == Placement.HEADS
    activation_bytes = 8192 * 4096 * BF16_BYTES
    assert sorted((call.kind, call.bytes, call.producer) for call in layout.collectives) == [
        (Collective.ALL_REDUCE, activation_bytes, "fc2"), (Collective.ALL_REDUCE, activation_bytes, "o_proj"),
    ]
    assert layout.boundary == R and layout.status == SolveStatus.OPTIMAL
    assert layout.comm_s == pytest.approx(2 * 2 * ring_comm_s(tp)(Collective.ALL_REDUCE, activation_bytes))
    assert_consistent(layout, ops)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_gpt_block_with_sequence_parallelism(tp):
    # Each all-reduce splits into a reduce-scatter (into the sequence-split residual stream) and an
    # all-gather (before the next colwise linears), the same ring bytes; norms and adds then run on a
    # tp-th of the tokens, so the sequence-split boundary wins.
    ops = gpt_block()
    layout = solve_layout(ops, tp, roofline_compute_s, ring_comm_s(tp), sequence_parallel=True)
    assert layout.boundary == Q
    assert layout.per_op["ln1"] == layout.per_op["ln2"] == Placement.SEQUENCE
    assert (layout.per_op["o_proj"], layout.per_op["fc2"]) == (Placement.ROWWISE, Placement.ROWWISE)
    assert sorted((call.kind, call.producer) for call in layout.collectives) == [
        (Collective.ALL_GATHER, "ln1"), (Collective.ALL_GATHER, "ln2"),
        (Collective.REDUCE_SCATTER, "fc2"), (Collective.REDUCE_SCATTER, "o_proj"),
    ]
    assert_consistent(layout, ops)


def test_tp1_is_all_replicated():
    ops = gpt_block()
    layout = solve_layout(ops, 1, roofline_compute_s, ring_comm_s(1))
    assert set(layout.per_op.values()) == {Placement.REPLICATE}
    assert layout.collectives == ()
    assert layout.objective_s == pytest.approx(sum(roofline_compute_s(op, 1) for op in ops))


@pytest.mark.parametrize(("heads", "kv_heads"), [(12, 12), (24, 6)])
def test_attention_replicated_when_heads_do_not_divide(heads, kv_heads):
    # tp = 8 divides neither 12 heads nor 6 kv heads (nor is a multiple of 6), so the attention core
    # cannot be head-split.
    ops = gpt_block(hidden=128 * heads, heads=heads, kv_heads=kv_heads, ffn=512 * heads)
    layout = solve_layout(ops, 8, roofline_compute_s, ring_comm_s(8), sequence_parallel=False)
    assert layout.per_op["attn"] == Placement.REPLICATE
    assert layout.per_op["fc1"] == Placement.COLWISE and layout.per_op["fc2"] == Placement.ROWWISE
    assert_consistent(layout, ops)


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 1), (8, 1), (8, 4)])
def test_fewer_key_value_heads_than_tp_split_query_heads(tp, kv_heads):
    # One key/value head (or 4 over 8 ranks) cannot split, but the 32 query heads can, each rank
    # attending with the key/value head its queries share (gathered or computed whole: 2 T h x 128
    # FLOPs per head, small): the attention core, q and o_proj split tp ways, as with more heads.
    ops = gpt_block(heads=32, kv_heads=kv_heads)
    layout = solve_layout(ops, tp, roofline_compute_s, ring_comm_s(tp), sequence_parallel=False)
    assert (layout.per_op["attn"], layout.per_op["q"], layout.per_op["o_proj"]) == (
        Placement.HEADS, Placement.COLWISE, Placement.ROWWISE)
    assert layout.per_op["k"] in (Placement.COLWISE, Placement.REPLICATE)
    assert_consistent(layout, ops)


def mlp_chain(tokens=4096, widths=(1024, 4096, 4096, 1024)) -> list[Op]:
    ops, source = [], "x"
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        ops.append(linear(f"fc{i}", source, tokens, fan_in, fan_out, fqn=f"net.{2 * i}"))
        ops.append(pointwise(f"relu{i}", OpKind.ELEMENTWISE, (f"fc{i}",), tokens, fan_out, 1))
        source = f"relu{i}"
    return ops


def cnn_like(batch=64) -> list[Op]:
    # conv (4-D weight: the ILP knows no split for it), batch norm, relu, pooling, flatten, classifier.
    conv = Op("conv", "features.0", "conv2d", OpKind.OTHER, ("x",), (batch, 64, 56, 56), batch * 64 * 56 * 56 * BF16_BYTES,
              2.0 * batch * 64 * 56 * 56 * 3 * 49, ((64, 3, 7, 7),))
    bn = Op("bn", "features.1", "batch_norm", OpKind.NORM, ("conv",), conv.out_shape, conv.out_bytes, 5.0 * conv.out_bytes,
            ((64,), (64,)))
    relu = Op("relu", "features.2", "relu", OpKind.ELEMENTWISE, ("bn",), conv.out_shape, conv.out_bytes, conv.out_bytes / 2)
    pool = Op("pool", "avgpool", "adaptive_avg_pool2d", OpKind.OTHER, ("relu",), (batch, 64, 1, 1), batch * 64 * BF16_BYTES,
              conv.out_bytes / 2)
    flat = Op("flat", "", "flatten", OpKind.OTHER, ("pool",), (batch, 64), batch * 64 * BF16_BYTES, 0.0)
    head = linear("fc", "flat", batch, 64, 1000, fqn="fc")
    return [conv, bn, relu, pool, flat, head]


@pytest.mark.parametrize("build", [mlp_chain, cnn_like])
@pytest.mark.parametrize("tp", [2, 4])
def test_non_transformer_models_get_valid_layouts(build, tp):
    ops = build()
    layout = solve_layout(ops, tp, roofline_compute_s, ring_comm_s(tp))
    assert_consistent(layout, ops)
    assert layout.status == SolveStatus.OPTIMAL
    assert len(layout.explain()) == len(ops) + 1


def test_two_layer_mlp_goes_colwise_then_rowwise():
    # fc0 (1024 -> 4096) and fc1 (4096 -> 1024) on 4096 tokens, tp = 4: each linear is
    # 3 * 2 * 4096 * 1024 * 4096 / 400e12 = 0.258 ms replicated; splitting both saves 0.387 ms and
    # costs one all-reduce of 8 MiB forward and backward, 2 * 2 * (3/4) * 8 MiB / 450 GB/s = 0.056 ms.
    layout = solve_layout(mlp_chain(widths=(1024, 4096, 1024)), 4, roofline_compute_s, ring_comm_s(4), sequence_parallel=False)
    assert (layout.per_op["fc0"], layout.per_op["fc1"]) == (Placement.COLWISE, Placement.ROWWISE)
    assert layout.per_fqn == {"net.0": Placement.COLWISE, "net.2": Placement.ROWWISE}
    assert [(call.kind, call.bytes) for call in layout.collectives] == [(Collective.ALL_REDUCE, 4096 * 1024 * BF16_BYTES)]


def grouped_linear(name: str, source: str, experts: int, slots: int, in_features: int, out_features: int) -> Op:
    """x (experts, slots, in) @ w (experts, in, out): one expert projection of the zoo's MoE layer."""
    return Op(
        name=name, fqn=f"moe.experts.{name}", target="bmm", kind=OpKind.MATMUL, inputs=(source,),
        out_shape=(experts, slots, out_features), out_bytes=experts * slots * out_features * BF16_BYTES,
        fwd_flops=2.0 * experts * slots * in_features * out_features, param_shapes=((experts, in_features, out_features),),
    )


@pytest.mark.parametrize("tp", [2, 4])
def test_expert_projections_shard_like_a_megatron_mlp(tp):
    # 8 experts of 512 slots each (4096 tokens, top-2), hidden 2048, expert ffn 8192: the dispatch
    # gather and the combine's index_add run replicated (axis-coupled); between them the gate and
    # up projections split by output features and the down projection by input features, which
    # costs one all-reduce of the (experts, slots, hidden) output before the combine.
    experts, slots, hidden, ffn = 8, 512, 2048, 8192
    width = experts * slots
    ops = [
        Op("dispatch", "moe", "index_select", OpKind.OTHER, ("x",), (experts, slots, hidden), width * hidden * BF16_BYTES),
        grouped_linear("gate_proj", "dispatch", experts, slots, hidden, ffn),
        grouped_linear("up_proj", "dispatch", experts, slots, hidden, ffn),
        Op("silu", "moe.experts", "silu", OpKind.ELEMENTWISE, ("gate_proj",), (experts, slots, ffn), width * ffn * BF16_BYTES,
           8.0 * width * ffn),
        Op("mul", "moe.experts", "mul", OpKind.ELEMENTWISE, ("silu", "up_proj"), (experts, slots, ffn), width * ffn * BF16_BYTES,
           1.0 * width * ffn),
        grouped_linear("down_proj", "mul", experts, slots, ffn, hidden),
        Op("combine", "moe", "index_add", OpKind.OTHER, ("down_proj",), (4096, hidden), 4096 * hidden * BF16_BYTES),
    ]
    layout = solve_layout(ops, tp, roofline_compute_s, ring_comm_s(tp), sequence_parallel=False)
    assert {name: layout.per_op[name] for name in ("gate_proj", "up_proj", "down_proj")} == {
        "gate_proj": Placement.COLWISE, "up_proj": Placement.COLWISE, "down_proj": Placement.ROWWISE}
    assert [(call.kind, call.producer, call.bytes) for call in layout.collectives] == [
        (Collective.ALL_REDUCE, "down_proj", width * hidden * BF16_BYTES)]
    assert_consistent(layout, ops)


@pytest.mark.parametrize("vocab,vocab_parallel", [(4096, True), (4099, False)])
def test_a_loss_runs_vocabulary_parallel_only_where_tp_divides_the_vocabulary(vocab, vocab_parallel):
    # Only a colwise head hands the loss vocabulary-split logits (`planner.apply`), and a colwise head
    # needs tp to divide the vocabulary; any other head's logits are whole on every rank.
    tokens = 4096
    head = linear("head", "x", tokens, 1024, vocab, fqn="head")
    upcast = Op("upcast", "", "float", OpKind.ELEMENTWISE, ("head",), (tokens, vocab), tokens * vocab * 4, tokens * vocab)
    loss = Op("loss", "", "cross_entropy", OpKind.LOSS, ("upcast",), (), 4, 4.0 * tokens * vocab)
    layout = solve_layout([head, upcast, loss], 4, roofline_compute_s, ring_comm_s(4))
    assert (layout.per_op["loss"] == Placement.LOSS_PARALLEL) is vocab_parallel
    assert (layout.per_op["head"] == Placement.COLWISE) is vocab_parallel


def test_axis_coupled_ops_run_replicated():
    # An MoE router: softmax and top-k over the expert axis are wrong on an expert-split tensor, so
    # they must run replicated, whatever the router linear does.
    router = linear("router", "x", 4096, 2048, 64, fqn="moe.router")
    softmax = Op("softmax", "moe", "softmax", OpKind.ELEMENTWISE, ("router",), (4096, 64), 4096 * 64 * BF16_BYTES, 5.0 * 4096 * 64)
    topk = Op("topk", "moe", "topk", OpKind.OTHER, ("softmax",), (4096, 6), 4096 * 6 * BF16_BYTES, 4096 * 64.0)
    assert [s.placement for s in op_strategies(softmax, 4, sequence_parallel=True)] == [Placement.REPLICATE]
    ops = [router, softmax, topk]
    layout = solve_layout(ops, 4, roofline_compute_s, ring_comm_s(4))
    assert layout.per_op["softmax"] == layout.per_op["topk"] == Placement.REPLICATE
    assert_consistent(layout, ops)


def brute_force_objective_s(ops: list[Op], tp: int, sequence_parallel: bool, compute, comm) -> float:
    """Least compute + 2 x conversion time over every strategy assignment (conversions counted once per producer and layout)."""
    names = {op.name for op in ops}
    outside = [name for op in ops for name in op.inputs if name not in names][:1]
    consumed = {name for op in ops for name in op.inputs}
    out_bytes = {op.name: op.out_bytes for op in ops} | {BOUNDARY: max(op.out_bytes for op in ops if op.name not in consumed)}
    options = [op_strategies(op, tp, sequence_parallel=sequence_parallel) for op in ops]
    boundaries = (R, Q) if sequence_parallel and tp > 1 else (R,)
    best = math.inf
    for boundary, assignment in product(boundaries, product(*options)):
        produced = {op.name: s.output_layout for op, s in zip(ops, assignment)} | {BOUNDARY: boundary}
        needed = {name: set() for name in produced}
        for op, strategy in zip(ops, assignment):
            for k, name in enumerate(op.inputs):
                if (name in names or name in outside) and strategy.input_layouts[k] is not None:
                    needed[name if name in names else BOUNDARY].add(strategy.input_layouts[k])
            if op.name not in consumed:
                needed[op.name].add(boundary)
        total = sum(compute(op, s.compute_shards) for op, s in zip(ops, assignment))
        for name, layouts in needed.items():
            for layout in layouts - {produced[name]}:
                if (produced[name], layout) in FREE:
                    continue
                if (produced[name], layout) not in EXPECTED_COLLECTIVE:
                    total = math.inf
                    break
                total += 2 * comm(EXPECTED_COLLECTIVE[produced[name], layout], out_bytes[name])
        best = min(best, total)
    return best


def tiny_block(tokens: int, hidden: int, ffn: int) -> list[Op]:
    return [
        pointwise("ln", OpKind.NORM, ("x",), tokens, hidden, 5, ((hidden,),)),
        linear("up", "ln", tokens, hidden, ffn),
        pointwise("act", OpKind.ELEMENTWISE, ("up",), tokens, ffn, 8),
        linear("down", "act", tokens, ffn, hidden),
        pointwise("add", OpKind.ELEMENTWISE, ("x", "down"), tokens, hidden, 1),
    ]


@settings(max_examples=25, deadline=None)
@given(
    tp=st.sampled_from([2, 4]),
    sequence_parallel=st.booleans(),
    tokens=st.sampled_from([16, 1024, 65536]),
    ffn_ratio=st.sampled_from([1, 4]),
    link_bytes_per_s=st.sampled_from([1e9, 50e9, 450e9, 1e13]),
)
def test_solver_matches_brute_force(tp, sequence_parallel, tokens, ffn_ratio, link_bytes_per_s):
    ops = tiny_block(tokens, 1024, 1024 * ffn_ratio)
    comm = ring_comm_s(tp, link_bytes_per_s)
    layout = solve_layout(ops, tp, roofline_compute_s, comm, sequence_parallel=sequence_parallel)
    expected = brute_force_objective_s(ops, tp, sequence_parallel, roofline_compute_s, comm)
    assert layout.objective_s == pytest.approx(expected, rel=1e-6)
    assert_consistent(layout, ops)


def test_ops_of_one_module_share_a_placement():
    # One Linear applied twice (same FQN): alone, the pair would go colwise then rowwise; tied, both
    # calls must use the same placement.
    ops = [linear("first", "x", 4096, 1024, 1024, fqn="shared"), pointwise("act", OpKind.ELEMENTWISE, ("first",), 4096, 1024, 8),
           linear("second", "act", 4096, 1024, 1024, fqn="shared")]
    layout = solve_layout(ops, 4, roofline_compute_s, ring_comm_s(4), sequence_parallel=False)
    assert layout.per_op["first"] == layout.per_op["second"] == layout.per_fqn["shared"]
    untied = [ops[0], ops[1], linear("second", "act", 4096, 1024, 1024, fqn="other")]
    free = solve_layout(untied, 4, roofline_compute_s, ring_comm_s(4), sequence_parallel=False)
    assert (free.per_op["first"], free.per_op["second"]) == (Placement.COLWISE, Placement.ROWWISE)


def test_pinned_module_takes_only_its_allowed_placements():
    # The chain alone goes colwise then rowwise; pinning fc1 to replicate (a head tied to an
    # embedding that stays whole) keeps it whole and leaves fc0 free.
    ops = mlp_chain(widths=(1024, 4096, 1024))
    layout = solve_layout(ops, 4, roofline_compute_s, ring_comm_s(4), sequence_parallel=False,
                          pins={"net.2": frozenset({Placement.REPLICATE})})
    assert layout.per_op["fc1"] == Placement.REPLICATE
    assert layout.per_fqn.get("net.2", Placement.REPLICATE) == Placement.REPLICATE


def test_param_budget_forces_sharding():
    # With 1 GB/s links any collective costs more than the compute it saves, so the free choice is
    # all-replicated. fc1 and fc2 hold 1024 x 4096 weights each: 2 x 8 MiB at 2 bytes per parameter,
    # 16 MiB + 4 KiB replicated. A 5 MiB budget at tp = 4 fits only with both split (2 x 2 MiB + 4 KiB);
    # colwise fc1 -> rowwise fc2 then needs one all-reduce, the cheapest sharded pairing.
    ops = tiny_block(4096, 1024, 4096)
    slow = ring_comm_s(4, 1e9)
    free = solve_layout(ops, 4, roofline_compute_s, slow, sequence_parallel=False)
    assert set(free.per_op.values()) == {Placement.REPLICATE}
    budget = ParamBudget(cap_bytes=5 * 2**20, bytes_per_param=2)
    capped = solve_layout(ops, 4, roofline_compute_s, slow, sequence_parallel=False, param_budget=budget)
    assert (capped.per_op["up"], capped.per_op["down"]) == (Placement.COLWISE, Placement.ROWWISE)
    assert [call.kind for call in capped.collectives] == [Collective.ALL_REDUCE]
    with pytest.raises(PlannerError) as error:
        solve_layout(ops, 4, roofline_compute_s, slow, param_budget=ParamBudget(cap_bytes=2**20, bytes_per_param=2))
    assert error.value.kind == PlannerErrorKind.INSUFFICIENT_MEMORY and "tp=4" in error.value.message


def test_shard_params_takes_the_least_parameter_layout_then_the_fastest():
    # Same slow links: time alone replicates everything (above). With shard_params the solver first
    # finds the least parameters per device (both weights split four ways, as under the 5 MiB
    # budget above), then the fastest layout holding no more: colwise fc1 -> rowwise fc2 with one
    # all-reduce, the cheapest sharded pairing, found without any budget.
    ops = tiny_block(4096, 1024, 4096)
    slow = ring_comm_s(4, 1e9)
    layout = solve_layout(ops, 4, roofline_compute_s, slow, sequence_parallel=False, shard_params=True)
    assert (layout.per_op["up"], layout.per_op["down"]) == (Placement.COLWISE, Placement.ROWWISE)
    assert [call.kind for call in layout.collectives] == [Collective.ALL_REDUCE]


def test_invalid_inputs_name_the_field():
    ops = tiny_block(16, 64, 64)
    with pytest.raises(PlannerError, match="tp=0"):
        solve_layout(ops, 0, roofline_compute_s, ring_comm_s(2))
    with pytest.raises(PlannerError, match="unique"):
        solve_layout(ops + ops[:1], 2, roofline_compute_s, ring_comm_s(2))
    with pytest.raises(PlannerError, match="boundary"):
        solve_layout(ops, 2, roofline_compute_s, ring_comm_s(2), sequence_parallel=False, boundary=Q)


@pytest.mark.parametrize("spec, whole", [
    # BERT: the embedding container's norm and sums run whole, its embeddings split; the masked-LM
    # head is a container (run whole), and the token embedding is tied to its decoder.
    ("arch: bert\nlayers: 2\nhidden: 64\nheads: 4\nvocab: 128\nmax_seq_len: 32\n",
     {"embed", "embed.norm", "embed.tok", "head.transform", "head.act", "head.norm", "head.decoder"}),
    # GPT: token plus position embeddings summed in the container; the head is one Linear (tied or not).
    ("arch: gpt\nlayers: 2\nhidden: 64\nheads: 4\nvocab: 128\nmax_seq_len: 32\ntie_embeddings: true\n", {"embed"}),
    ("arch: llama\nlayers: 2\nhidden: 64\nheads: 4\nffn_hidden: 128\nvocab: 128\nmax_seq_len: 32\n", set()),
    # A ViT's patch projection before the blocks runs whole; its pooling head is one Linear.
    ("arch: vit\nlayers: 2\nhidden: 64\nheads: 4\nffn_hidden: 128\nimage_size: 32\npatch_size: 8\nclasses: 10\n",
     {"embed", "embed.proj"}),
])
def test_modules_plan_apply_runs_whole_are_pinned_whole(tmp_path, spec, whole):
    # Outside the blocks Plan.apply splits only the input embedding's embeddings and Linear children
    # and a head that is one module; the layout ILP is pinned to that, blocks are left free.
    path = tmp_path / "model.yaml"
    path.write_text(spec)
    graph = trace(str(path), seq_len=None if "vit" in spec else 32)
    pins = {fqn: allowed for layer in graph.layers for fqn, allowed in apply_pins(graph, layer).items()}
    assert set(pins) == whole
    assert all(allowed == {Placement.REPLICATE} for allowed in pins.values())
