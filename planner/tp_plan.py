"""Tensor-parallel plan of a layer: the sharding ILP's layout turned into what the cost model needs.

The layout holds the fewest parameters per device any layout reaches, and among those is the
fastest. Weights it cannot split (a vocabulary tp does not divide) stay whole on every rank, and
the memory model counts them so (`TpPlan.whole_params`).

One layout is solved per (layer signature, tp, device, dtype) and reused by every identical block
and every configuration of the search. Costs handed to the ILP are those of the traced micro-batch
on the tp group inside one node (tp is innermost on the mesh).
"""
from __future__ import annotations

import dataclasses
import math

from costmodel.comm import Collective, collective_time_s
from costmodel.hardware import DeviceSpec, NodeSpec
from planner.apply_pins import apply_pins
from planner.graph import EXPERTS_MODULE, Layer, LayerKind, ModelGraph, Op, OpKind
from planner.layer_cost import TpPlan
from planner.op_works import op_time_s
from planner.mesh import axis_group
from planner.sharding import Layout, solve_layout
from planner.tp_strategies import Placement, TensorLayout, weight_split_dim

# Solver limits for one layer's layout (a block has 20-60 ops; HiGHS solves it in well under 1 s).
LAYOUT_TIME_LIMIT_S = 10.0
LAYOUT_REL_GAP = 1e-4


def solve_layer_layout(layer: Layer, tp: int, device: DeviceSpec, node: NodeSpec, dtype: str, shard_params: bool = True,
                       pins: dict[str, frozenset[Placement]] | None = None, boundary: TensorLayout | None = None,
                       input_bytes: float | None = None, sequence_parallel: bool = True) -> Layout:
    """The sharding ILP's layout of `layer` at degree `tp`, priced on `device` in a tp group inside `node`.

    Args:
        shard_params: hold the fewest parameters per device first (the planner's layouts); False
            lets time alone decide.
        pins: placements allowed to modules sharing a weight with an earlier layer (`tied_pins`) or
            run whole by Plan.apply (`planner.apply_pins`).
        boundary, input_bytes: the layout and bytes of the activation entering the layer, when the
            layers around it fix them (`stream_boundary`).
        sequence_parallel: offer S(sequence) layouts (`planner.config.sequence_parallel_for`).
    """
    group = axis_group(tp, 1, node.devices_per_node)

    def compute_time_s(op: Op, shards: int) -> float:
        return op_time_s(op, device, dtype, shards)

    def comm_time_s(kind, size_bytes: float) -> float:
        return collective_time_s(Collective(str(kind)), size_bytes, group, node)

    return solve_layout(layer.ops, tp, compute_time_s, comm_time_s, sequence_parallel=sequence_parallel, boundary=boundary,
                        input_bytes=input_bytes, shard_params=shard_params, pins=pins, time_limit_s=LAYOUT_TIME_LIMIT_S,
                        rel_gap=LAYOUT_REL_GAP)


def layout_for(layer: Layer, tp: int, device: DeviceSpec, node: NodeSpec, dtype: str, cache: dict,
               graph: ModelGraph, sequence_parallel: bool = True) -> Layout:
    """`solve_layer_layout` of `layer` (a layer of `graph`), kept in `cache` by layer signature (the
    caller's cache lives as long as its device profiles, so a device name is a safe key)."""
    pins = tied_pins(graph, layer, tp, device, node, dtype, cache, sequence_parallel)
    for fqn, allowed in apply_pins(graph, layer).items():
        pins[fqn] = pins.get(fqn, allowed) & allowed
    boundary, input_bytes = stream_boundary(graph, layer, tp, device, node, dtype, cache, sequence_parallel)
    key = (layer.signature or layer.name, tp, device.name, node.devices_per_node, dtype, tuple(sorted(pins.items())),
           boundary, input_bytes, sequence_parallel)
    if key not in cache:
        cache[key] = solve_layer_layout(layer, tp, device, node, dtype, pins=pins, boundary=boundary, input_bytes=input_bytes,
                                        sequence_parallel=sequence_parallel)
    return cache[key]


def stream_boundary(graph: ModelGraph, layer: Layer, tp: int, device: DeviceSpec, node: NodeSpec, dtype: str,
                    cache: dict, sequence_parallel: bool = True) -> tuple[TensorLayout | None, float | None]:
    """(layout, bytes) of the activation entering `layer`, or (None, None) for the solver to choose.

    The blocks choose the residual stream's layout (S(sequence) under sequence parallelism), and
    `Plan.apply` runs every layer on that one stream layout: a layer outside the blocks (embedding,
    head) gets the first block's boundary, and the bytes it receives are the previous layer's
    output (the solver's default, the layer's largest output, would be the head's logits)."""
    if layer.kind == LayerKind.BLOCK:  # every block's layout call comes here first: no scan of the layers
        return None, None
    block = next((other for other in graph.layers if other.kind == LayerKind.BLOCK and other.ops), None)
    if block is None:
        return None, None
    index = next(i for i, own in enumerate(graph.layers) if own is layer)
    boundary = layout_for(block, tp, device, node, dtype, cache, graph, sequence_parallel).boundary
    return boundary, (float(graph.layers[index - 1].out_bytes) or None if index > 0 else None)


def tied_pins(graph: ModelGraph, layer: Layer, tp: int, device: DeviceSpec, node: NodeSpec, dtype: str,
              cache: dict, sequence_parallel: bool = True) -> dict[str, frozenset[Placement]]:
    """Placements allowed to each module of `layer` that shares its weight with a module of an earlier
    layer (a head tied to the embedding): those splitting the weight along the dimension the earlier
    module's layout splits it (or keeping it whole when that one does), as one parameter must be."""
    fqns = {op.fqn for op in layer.ops}
    pins = {}
    for users in graph.tied_users:
        reusing = [op for index, op in users[1:] if index > users[0][0] and op.fqn in fqns]
        if not reusing:
            continue
        owner_index, owner = users[0]
        owner_layout = layout_for(graph.layers[owner_index], tp, device, node, dtype, cache, graph, sequence_parallel)
        dim = weight_split_dim(owner.kind, owner_layout.per_fqn.get(owner.fqn, Placement.REPLICATE))
        for op in reusing:
            pins[op.fqn] = frozenset(p for p in Placement if weight_split_dim(op.kind, p) == dim)
    return pins


def tp_plan_for(layer: Layer, tp: int, device: DeviceSpec, node: NodeSpec, dtype: str, cache: dict,
                graph: ModelGraph, sequence_parallel: bool = True) -> TpPlan:
    """The TpPlan of `layer` (a layer of `graph`) at degree `tp` (replicated at tp=1 or for layers without ops)."""
    if tp == 1 or not layer.ops:
        return TpPlan(tp)
    layout = layout_for(layer, tp, device, node, dtype, cache, graph, sequence_parallel)
    # The layout is kept by signature, so it may have been solved on another layer of the same
    # structure: its choices (in op order, the boundary last) name that layer's ops.
    own = dict(zip((choice.name for choice in layout.choices), (op.name for op in layer.ops)))
    split_ops = frozenset(own[choice.name] for choice in layout.choices if choice.strategy.compute_shards > 1 and choice.name in own)
    return TpPlan(
        tp=tp,
        split_ops=split_ops,
        collectives=tuple((Collective(str(call.kind)), call.bytes, own.get(call.producer, call.producer)) for call in layout.collectives),
        whole_params=whole_params(layer, layout),
    )


def folded_expert_plan(plan: TpPlan, layer: Layer, experts: int) -> TpPlan:
    """`plan` with ep folded over tp (`ParallelConfig.ep_folds_tp`): the MoE module's tokens stay split
    by sequence and reach their `experts` through the all-to-all alone, so the tensor-parallel
    collectives of its routing (the module's own ops and its router, the Linear scoring every expert)
    and of its experts do not run (their work per rank is unchanged); a shared expert beside them
    keeps its tensor parallelism."""
    roots = set()
    for op in layer.ops:
        parts = op.fqn.split(".")
        if EXPERTS_MODULE in parts:
            roots.add(".".join(parts[:parts.index(EXPERTS_MODULE)]))

    def routing(op: Op) -> bool:
        parent = op.fqn.rpartition(".")[0]
        return (op.fqn in roots or any(op.fqn.startswith(f"{root}.{EXPERTS_MODULE}") for root in roots)
                or (parent in roots and op.kind == OpKind.MATMUL and op.attrs.get("out_features") == experts))

    inside = {op.name for op in layer.ops if routing(op)}
    return dataclasses.replace(plan, collectives=tuple(call for call in plan.collectives if call[2] not in inside))


def whole_params(layer: Layer, layout: Layout) -> int:
    """Parameters outside the experts of `layer` that `layout` leaves whole on every tp rank: each
    module's weights counted once (its ops share one placement)."""
    whole: dict[str, int] = {}
    for op, choice in zip(layer.ops, layout.choices):  # in op order (the boundary pseudo-op, last, unpaired)
        if op.param_shapes and choice.strategy.param_shards == 1 and EXPERTS_MODULE not in op.fqn.split("."):
            whole[op.fqn] = max(whole.get(op.fqn, 0), sum(math.prod(shape) for shape in op.param_shapes))
    return sum(whole.values())


def layouts_for(evaluator, config) -> dict[str, str]:
    """Module FQN -> placement for one layer of each distinct structure (identical blocks share it)."""
    if config.tp == 1:
        return {}
    device, node = evaluator.stage_devices(config.pp)[0]
    dtype = evaluator.dtype_for(device)
    out: dict[str, str] = {}
    seen = set()
    for layer in evaluator.graph.layers:
        if not layer.ops or layer.signature in seen:
            continue
        seen.add(layer.signature)
        layout = layout_for(layer, config.tp, device, node, dtype, evaluator.layout_cache, evaluator.graph, config.sequence_parallel)
        out.update({fqn: str(p) for fqn, p in layout.per_fqn.items()})
    return out


# Tensor parallelism that leaves more than this share of the blocks' weights whole on every rank is noted.
WHOLE_WEIGHTS_NOTE_FRACTION = 0.5


def whole_weights_note(evaluator, config) -> tuple[str, ...]:
    """A note where `config`'s tensor parallelism leaves most of the blocks' weights (outside the
    experts) whole on every rank: modules the layout cannot split (not nn.Linear-like: a weight read
    by a matrix product it recognises), whose weights, work and activations tp then does not divide."""
    if config.tp == 1:
        return ()
    blocks = [layer for layer in evaluator.graph.layers if layer.kind == LayerKind.BLOCK and layer.ops]
    dense = sum(layer.params - layer.expert_params for layer in blocks)
    if not dense:
        return ()
    device, node = evaluator.stage_devices(config.pp)[0]
    dtype = evaluator.dtype_for(device)
    whole = {layer.signature: whole_params(layer, layout_for(layer, config.tp, device, node, dtype, evaluator.layout_cache,
                                                              evaluator.graph, config.sequence_parallel))
             for layer in {layer.signature: layer for layer in blocks}.values()}
    share = sum(whole[layer.signature] for layer in blocks) / dense
    if share <= WHOLE_WEIGHTS_NOTE_FRACTION:
        return ()
    return (f"tp={config.tp} leaves {share:.0%} of the blocks' weights whole on every rank: the layout splits the "
            f"matrix products it recognises (nn.Linear's and the like) and not these, so tp divides none of their "
            f"weights, work or activations",)
