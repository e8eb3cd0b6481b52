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


def sync_wait_s(layer: Layer, plan: TpPlan, ctx: LayerContext, fwd_s: float, bwd_s: float) -> tuple[float, float]:
    """(forward, backward) seconds the layer's ranks wait for each other at its blocking collectives:
    the op table's measured `sync_wait_fraction` of the compute between them, which is the layer's
    whole compute (`fwd_s`, `bwd_s`) once any collective splits it (tensor-parallel collectives,
    context parallelism's gathers of keys and values, expert parallelism's all-to-alls); 0 without
    a measurement or a collective."""
    fraction = ctx.table.sync_wait_fraction if ctx.table is not None else 0.0
    synced = ((plan.tp > 1 and bool(plan.collectives)) or (ctx.cp > 1 and any(op.kind == OpKind.ATTENTION for op in layer.ops))
              or (ctx.ep > 1 and layer.expert_params > 0))
    return (fraction * fwd_s, fraction * bwd_s) if synced else (0.0, 0.0)
