"""Tensor-parallel strategies: activation layouts, what each op can do, and a layer's strategy graph.

Tensor layouts (`TensorLayout`, over the tp ranks): R replicated; S(feature) split along the
feature/head axis; S(sequence) split along the sequence axis (sequence parallelism); P partial sums.
Each op offers strategies (`op_strategies`): a placement (what `parallelize_module` applies to its
module), the layout it needs for each input, the layout of its output, and how many ways its work
and parameters are split. Linear: R -> R (replicate), R -> S(feature) (colwise), S(feature) -> P
(rowwise). Attention core: R -> R, or S(feature) -> S(feature) on a slice of the heads (with fewer
key/value heads than tp ranks, tp a multiple of them: a slice of the query heads, the keys and values
R on every rank, each rank attending with the one head its queries share). Norm: R or
S(sequence). Elementwise and shape ops follow their input, except reductions, softmax, top-k and
index scatter/gather (`AXIS_COUPLED_TARGETS`), which run replicated. Embedding: replicate or vocab-parallel
(-> P). Loss: replicate or vocab-parallel on S(feature) logits.

`StrategyGraph` collects one layer's ops, their strategies and the edges between them, plus a
boundary pseudo-op (`BOUNDARY`) holding the layout of the activation entering and leaving the
layer; `planner.sharding` chooses one strategy per op over it. Nothing here knows about devices.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from enum import StrEnum

from planner.errors import invalid
from planner.graph import Op, OpKind

BOUNDARY = "<boundary>"  # name of the pseudo-op holding the layout of the layer's input/output activation


class TensorLayout(StrEnum):
    """How an activation lies across the tp ranks."""

    REPLICATE = "R"
    SHARD_FEATURE = "S(feature)"
    SHARD_SEQUENCE = "S(sequence)"
    PARTIAL = "P"


class Placement(StrEnum):
    """What an op does under tensor parallelism (for modules: the `parallelize_module` style to apply)."""

    REPLICATE = "replicate"          # full weights, full work on every rank
    COLWISE = "colwise"              # linear split by output features (ColwiseParallel)
    ROWWISE = "rowwise"              # linear split by input features / embedding split by vocab (RowwiseParallel)
    SEQUENCE = "sequence"            # norm / elementwise on sequence-split activations (SequenceParallel)
    HEADS = "heads"                  # attention core on tp-th of the heads
    FEATURE = "feature"              # elementwise / shape op on feature-split activations
    LOSS_PARALLEL = "loss_parallel"  # cross-entropy on vocab-split logits


# The weight dimension a placement shards (torch's ColwiseParallel / RowwiseParallel): a Linear's
# (out, in) weight by rows when colwise, by columns when rowwise; an Embedding's (vocab, dim) weight
# by rows (vocabulary) when rowwise, by columns when colwise. Modules sharing one weight must
# shard it along the same dimension, or all replicate it.
_WEIGHT_SPLIT_DIM = {(OpKind.MATMUL, Placement.COLWISE): 0, (OpKind.MATMUL, Placement.ROWWISE): 1,
                     (OpKind.EMBEDDING, Placement.ROWWISE): 0, (OpKind.EMBEDDING, Placement.COLWISE): 1}


def weight_split_dim(kind: OpKind, placement: Placement) -> int | None:
    """The weight dimension `placement` splits on an op of `kind`; None when the weight stays whole."""
    return _WEIGHT_SPLIT_DIM.get((kind, placement))


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"


R, F, Q, P = TensorLayout.REPLICATE, TensorLayout.SHARD_FEATURE, TensorLayout.SHARD_SEQUENCE, TensorLayout.PARTIAL

# (produced layout, needed layout) -> the collective that converts it. P -> S(feature) is left out:
# RowwiseParallel ends in R (all-reduce) or S(sequence) (reduce-scatter), and no module style resumes
# from a feature-split partial sum. Pairs in neither table (and not equal) are impossible.
CONVERSIONS: dict[tuple[TensorLayout, TensorLayout], Collective] = {
    (P, R): Collective.ALL_REDUCE,
    (P, Q): Collective.REDUCE_SCATTER,
    (F, R): Collective.ALL_GATHER,
    (Q, R): Collective.ALL_GATHER,
    (F, Q): Collective.ALL_TO_ALL,
    (Q, F): Collective.ALL_TO_ALL,
}
# Free conversion: each rank keeps its sequence slice of a replicated activation (entering sequence
# parallelism). R -> S(feature) is impossible: feature-split activations only come out of colwise
# linears and head-split attention, so the residual stream stays R or S(sequence) as in Megatron-LM.
SLICES = {(R, Q)}

# Targets that combine or move elements along an axis (reductions, softmax, top-k, scans, index
# scatter/gather as in MoE token dispatch): on a split tensor they would need communication the
# strategy does not price, or give wrong results, so they run replicated. Other elementwise and
# shape ops follow their input's layout.
AXIS_COUPLED_TARGETS = frozenset({
    "softmax", "log_softmax", "logsumexp", "topk", "sort", "argsort", "argmax", "argmin", "max", "min", "amax",
    "amin", "sum", "mean", "prod", "std", "var", "norm", "all", "any", "cumsum", "cumprod", "index_add",
    "index_select", "index_put", "scatter", "scatter_add", "scatter_reduce", "gather", "nonzero", "bincount",
    "one_hot", "masked_select", "unique",
})


@dataclass(frozen=True)
class Strategy:
    """One way to run an op.

    Attributes:
        placement: what the op does.
        input_layouts: layout needed for each input, in `Op.inputs` order; None for index inputs
            (token ids, labels, masks) whose layout costs nothing to change.
        output_layout: layout of the output.
        compute_shards: ways the op's work is split (1 replicated, tp sharded).
        param_shards: ways the op's parameters are split.
    """

    placement: Placement
    input_layouts: tuple[TensorLayout | None, ...]
    output_layout: TensorLayout
    compute_shards: int
    param_shards: int


def op_strategies(op: Op, tp: int, *, sequence_parallel: bool, classes: int = 0) -> tuple[Strategy, ...]:
    """Strategies op `op` can run at tensor-parallel degree `tp` (only REPLICATE when tp == 1).

    Args:
        op: the op.
        tp: tensor-parallel degree.
        sequence_parallel: offer S(sequence) layouts for norms, elementwise and shape ops.
        classes: a loss's classes (its logits' last dimension; 0 if unknown): it runs vocabulary-
            parallel only where tp divides them, as only a colwise head hands it split logits
            (`planner.apply`).

    Returns:
        The op's strategies, REPLICATE first.
    """
    activation = (R,) + ((F,) if tp > 1 else ()) + ((Q,) if tp > 1 and sequence_parallel else ())
    if op.kind == OpKind.MATMUL and op.param_shapes:
        return _linear_strategies(op, tp)
    if op.kind == OpKind.ATTENTION:
        return _attention_strategies(op, tp)
    if op.kind == OpKind.EMBEDDING:
        return _embedding_strategies(op, tp)
    if op.kind == OpKind.LOSS:
        return _loss_strategies(op, tp, classes)
    if op.kind == OpKind.NORM:
        return tuple(_follow(op, layout, tp) for layout in activation if layout != F)
    if op.kind in (OpKind.ELEMENTWISE, OpKind.OTHER) and not op.param_shapes and op.target not in AXIS_COUPLED_TARGETS:
        return tuple(_follow(op, layout, tp) for layout in activation)
    return (_follow(op, R, tp),)


@dataclass(frozen=True)
class StrategyGraph:
    """The ops, their strategies and the edges, with the boundary pseudo-op (no work, no parameters) added last."""

    ops: dict[str, Op]
    strategies: dict[str, tuple[Strategy, ...]]
    edges: tuple[tuple[str, str, int], ...]  # (producer, consumer, input index); BOUNDARY consumes index 0
    out_bytes: dict[str, float]
    params: dict[str, int]
    tp: int

    @classmethod
    def build(
        cls, ops: tuple[Op, ...], tp: int, sequence_parallel: bool, boundary: TensorLayout | None, input_bytes: float | None
    ) -> StrategyGraph:
        """The graph of `ops` at degree `tp` (arguments as in `planner.sharding.solve_layout`).

        Raises:
            PlannerError: INVALID_INPUT for a bad tp, an empty or ambiguous op list, or a boundary
                layout the options do not allow.
        """
        if not isinstance(tp, int) or tp < 1:
            raise invalid(f"tp={tp!r}: must be a positive integer")
        if not ops:
            raise invalid("ops: the layer has no ops; pass the ops of one traced layer")
        names = [op.name for op in ops]
        if len(set(names)) != len(names) or BOUNDARY in names:
            raise invalid(f"ops: op names must be unique and not {BOUNDARY!r}")
        boundary_layouts = (R, Q) if sequence_parallel and tp > 1 else (R,)
        if boundary is not None:
            if boundary not in boundary_layouts:
                allowed = ", ".join(boundary_layouts)
                raise invalid(f"boundary={boundary}: must be one of {allowed} (S(sequence) needs sequence_parallel and tp > 1)")
            boundary_layouts = (boundary,)
        consumed = {name for op in ops for name in op.inputs}
        outputs = [op for op in ops if op.name not in consumed]
        outside = [name for op in ops for name in op.inputs if name not in names]
        edges = [
            (name if name in names else BOUNDARY, op.name, k)
            for op in ops
            for k, name in enumerate(op.inputs)
            if name in names or name in outside[:1]
        ]
        edges += [(op.name, BOUNDARY, 0) for op in outputs]
        out_bytes = {op.name: float(op.out_bytes) for op in ops}
        out_bytes[BOUNDARY] = float(input_bytes if input_bytes is not None else max(op.out_bytes for op in outputs))
        shapes = {op.name: op.out_shape for op in ops}
        strategies = {op.name: op_strategies(op, tp, sequence_parallel=sequence_parallel,
                                             classes=(shapes.get(op.inputs[0]) or (0,))[-1] if op.inputs else 0) for op in ops}
        strategies[BOUNDARY] = tuple(
            Strategy(Placement.SEQUENCE if layout == Q else Placement.REPLICATE, (layout,), layout, 1, 1)
            for layout in boundary_layouts
        )
        return cls(
            ops={op.name: op for op in ops} | {BOUNDARY: Op(BOUNDARY, "", "boundary", OpKind.OTHER)},
            strategies=strategies,
            edges=tuple(edges),
            out_bytes=out_bytes,
            params={op.name: sum(math.prod(shape) for shape in op.param_shapes) for op in ops} | {BOUNDARY: 0},
            tp=tp,
        )

    @staticmethod
    def required_layout(consumer: str, strategy: Strategy, index: int) -> TensorLayout | None:
        """Layout `consumer` running `strategy` needs on input `index` (the boundary needs its own layout)."""
        return strategy.output_layout if consumer == BOUNDARY else strategy.input_layouts[index]

    def needed_layouts(self) -> list[tuple[str, TensorLayout]]:
        """Every (producer, layout) some consumer strategy may ask for."""
        pairs = {
            (producer, layout)
            for producer, consumer, index in self.edges
            for strategy in self.strategies[consumer]
            if (layout := self.required_layout(consumer, strategy, index)) is not None
        }
        return sorted(pairs)

    def modules(self) -> dict[str, list[str]]:
        """FQN -> names of its ops that carry a module placement (parameters or attention), when more than one."""
        by_fqn = defaultdict(list)
        for name, op in self.ops.items():
            if op.fqn and (op.param_shapes or op.kind == OpKind.ATTENTION):
                by_fqn[op.fqn].append(name)
        return {fqn: names for fqn, names in by_fqn.items() if len(names) > 1}


def _follow(op: Op, layout: TensorLayout, tp: int) -> Strategy:
    placement = {R: Placement.REPLICATE, F: Placement.FEATURE, Q: Placement.SEQUENCE}[layout]
    return Strategy(placement, (layout,) * len(op.inputs), layout, 1 if layout == R else tp, 1)


def _replicate(op: Op, first_inputs: int) -> Strategy:
    """All inputs R up to `first_inputs`, the rest index inputs; output R."""
    return Strategy(Placement.REPLICATE, _inputs(op, R, first_inputs), R, 1, 1)


def _inputs(op: Op, layout: TensorLayout, first_inputs: int) -> tuple[TensorLayout | None, ...]:
    return tuple(layout if k < first_inputs else None for k in range(len(op.inputs)))


def _linear_strategies(op: Op, tp: int) -> tuple[Strategy, ...]:
    strategies = [_replicate(op, 1)]
    features = _linear_features(op)
    if tp > 1 and features is not None:
        in_features, out_features = features
        if out_features % tp == 0:
            strategies.append(Strategy(Placement.COLWISE, _inputs(op, R, 1), F, tp, tp))
        if in_features % tp == 0:
            strategies.append(Strategy(Placement.ROWWISE, _inputs(op, F, 1), P, tp, tp))
    return tuple(strategies)


def _linear_features(op: Op) -> tuple[int, int] | None:
    """(in_features, out_features) from attrs, else from a 2-D weight [out, in] or the stacked
    expert weight [experts, in, out] of a batched matmul x @ w; None if unknown."""
    if "in_features" in op.attrs and "out_features" in op.attrs:
        return int(op.attrs["in_features"]), int(op.attrs["out_features"])
    shape = op.param_shapes[0]
    if len(shape) == 2:
        out_features, in_features = shape
        return in_features, out_features
    if len(shape) == 3 and op.target == "bmm" and op.out_shape and op.out_shape[-1] == shape[2]:
        return shape[1], shape[2]
    return None


def _attention_strategies(op: Op, tp: int) -> tuple[Strategy, ...]:
    qkv = min(3, len(op.inputs))
    strategies = [_replicate(op, qkv)]
    heads = op.attrs.get("heads")
    kv_heads = op.attrs.get("kv_heads", heads)
    if tp > 1 and heads and heads % tp == 0 and kv_heads % tp == 0:
        strategies.append(Strategy(Placement.HEADS, _inputs(op, F, qkv), F, tp, 1))
    elif tp > 1 and heads and heads % tp == 0 and kv_heads and tp % kv_heads == 0 and qkv == 3:
        strategies.append(Strategy(Placement.HEADS, (F, R, R) + _inputs(op, R, 0)[3:], F, tp, 1))
    return tuple(strategies)


def _embedding_strategies(op: Op, tp: int) -> tuple[Strategy, ...]:
    strategies = [Strategy(Placement.REPLICATE, _inputs(op, R, 0), R, 1, 1)]
    vocab = op.attrs.get("num_embeddings") or (op.param_shapes[0][0] if op.param_shapes else 0)
    if tp > 1 and vocab and vocab % tp == 0:
        strategies.append(Strategy(Placement.ROWWISE, _inputs(op, R, 0), P, 1, tp))
    return tuple(strategies)


def _loss_strategies(op: Op, tp: int, classes: int) -> tuple[Strategy, ...]:
    strategies = [_replicate(op, 1)]
    if tp > 1 and classes % tp == 0:
        strategies.append(Strategy(Placement.LOSS_PARALLEL, _inputs(op, F, 1), R, tp, 1))
    return tuple(strategies)
