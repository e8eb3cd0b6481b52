"""Placements `Plan.apply` can run for the modules outside the repeated blocks, as layout pins.

Inside the blocks Plan.apply splits each module as the layout says; outside them it follows fixed
rules (`planner.apply.tensor_parallel.tensor_parallel_plan`):

- the input embedding (the first unit before the blocks that is an embedding or holds one as a
  direct child) splits that embedding and its direct Linear children; everything else in it (a
  norm, the sum of the token and position embeddings, dropout) runs on whole tensors;
- any other unit with parameters before the blocks runs whole (a ViT's patch projection);
- after the blocks a unit that is one module (a Linear head, a norm) takes its layout, and a
  container with parameters (BERT's masked-LM head: a transform, a norm and the decoder) runs whole.

The layout ILP takes these as pins, so the layout priced is the one that runs; a weight shared with
a module that runs whole stays whole in every module sharing it.
"""
from __future__ import annotations

from planner.graph import Layer, LayerKind, ModelGraph, Op, OpKind
from planner.tp_strategies import Placement

WHOLE = frozenset({Placement.REPLICATE})


def apply_pins(graph: ModelGraph, layer: Layer) -> dict[str, frozenset[Placement]]:
    """Module FQN -> {REPLICATE} for each module of `layer` (a layer of `graph`) that Plan.apply runs
    whole; blocks get none."""
    if layer.kind == LayerKind.BLOCK:
        return {}
    index = next(i for i, own in enumerate(graph.layers) if own is layer)
    pins = {op.fqn: WHOLE for op in layer.ops if _runs_whole(graph, index, op)}
    own = {op.fqn for op in layer.ops}
    for users in graph.tied_users:
        if any(op.fqn in own for _, op in users) and any(_runs_whole(graph, i, op) for i, op in users):
            pins.update({op.fqn: WHOLE for _, op in users if op.fqn in own})
    return pins


def _runs_whole(graph: ModelGraph, index: int, op: Op) -> bool:
    layer = graph.layers[index]
    if layer.kind == LayerKind.BLOCK:
        return False
    unit = _unit_of(layer, op.fqn)
    if unit is None:  # the root's own ops (a flatten before the loss) follow their inputs
        return False
    ops = [other for other in layer.ops if _unit_of(layer, other.fqn) == unit]
    if not any(other.param_shapes for other in ops):
        return False  # no parameters: runs on whatever layout reaches it
    one_module = all(other.fqn == unit for other in ops)
    first_block = next((i for i, other in enumerate(graph.layers) if other.kind == LayerKind.BLOCK), len(graph.layers))
    if index > first_block:
        return not one_module
    if unit == _embedding_unit(graph, first_block):
        splittable = (op.kind == OpKind.EMBEDDING and op.fqn == unit) or (
            op.kind in (OpKind.EMBEDDING, OpKind.MATMUL) and op.param_shapes and _parent(op.fqn) == unit)
        return not splittable
    return not (one_module and all(other.kind == OpKind.NORM for other in ops))


def _embedding_unit(graph: ModelGraph, first_block: int) -> str | None:
    """The first unit before the blocks that is an embedding or holds one as a direct child."""
    for layer in graph.layers[:first_block]:
        for unit in layer.fqns:
            if any(op.kind == OpKind.EMBEDDING and op.param_shapes and unit in (op.fqn, _parent(op.fqn)) for op in layer.ops):
                return unit
    return None


def _unit_of(layer: Layer, fqn: str) -> str | None:
    return next((unit for unit in layer.fqns if fqn == unit or fqn.startswith(unit + ".")), None)


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]
