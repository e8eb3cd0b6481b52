"""What a layer's parallelism costs beyond its compute and its collectives' transfers, priced from
the op table's measurements (`paraplan profile`): the host work of the ops the apply runs on
DTensors under tensor parallelism, and the time the layer's ranks wait for each other at its
blocking collectives (tensor-, context- or expert-parallel).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from planner.graph import Layer, OpKind

if TYPE_CHECKING:
    from planner.layer_cost import LayerContext, TpPlan


def tp_host_s(layer: Layer, plan: TpPlan, ctx: LayerContext) -> tuple[float, float]:
    """(forward, backward) host seconds of the layer's tensor-parallel ops per micro-batch: the ops
    the apply runs on DTensors (split linears, embeddings and losses; norms under sequence
    parallelism) times the op table's measured `tp_linear_host_s`; 0 without a measurement."""
    if plan.tp == 1 or ctx.table is None or not ctx.table.tp_linear_host_s:
        return 0.0, 0.0
    on_dtensors = sum(1 for op in layer.ops if (op.name in plan.split_ops and op.kind in (OpKind.MATMUL, OpKind.EMBEDDING, OpKind.LOSS))
                      or (op.kind == OpKind.NORM and ctx.sequence_parallel))
    return tuple(on_dtensors * t for t in ctx.table.tp_linear_host_s)


def blocking_collective_kind(layer: Layer, plan: TpPlan, ctx: LayerContext) -> str | None:
    """The first kind of blocking collective that splits the layer's compute ("tp", "cp" or "ep"):
    tensor-parallel collectives, context parallelism's gathers of keys and values, expert
    parallelism's all-to-alls; None when the layer has none."""
    if plan.tp > 1 and plan.collectives:
        return "tp"
    if ctx.cp > 1 and any(op.kind == OpKind.ATTENTION for op in layer.ops):
        return "cp"
    if ctx.ep > 1 and layer.expert_params > 0:
        return "ep"
    return None


def sync_wait_s(ctx: LayerContext, fwd_s: float, bwd_s: float) -> tuple[float, float]:
    """(forward, backward) seconds a layer's ranks wait for each other at its blocking collectives
    (`blocking_collective_kind`): the op table's measured `sync_wait_fraction` of the compute between
    them, which is the layer's whole compute (`fwd_s`, `bwd_s`); 0 without a measurement."""
    fraction = ctx.table.sync_wait_fraction if ctx.table is not None else 0.0
    return fraction * fwd_s, fraction * bwd_s
