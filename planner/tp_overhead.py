"""What tensor parallelism costs a layer beyond its GEMMs and its collectives' transfers, priced from
the op table's measurements (`paraplan profile`): the host work of the ops the apply runs on
DTensors, and the time the group's ranks wait for each other at its blocking collectives.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from costmodel.compute import OpWork, layer_time_s
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


def tp_sync_wait_s(split_gemms: tuple[list[OpWork], list[OpWork]], plan: TpPlan, ctx: LayerContext) -> tuple[float, float]:
    """(forward, backward) seconds the tensor-parallel ranks wait for each other at the layer's
    collectives: the op table's measured `tp_sync_fraction` of the split GEMMs' time between them
    (`split_gemms`: their forward and backward works); 0 without a measurement or collectives."""
    if plan.tp == 1 or not plan.collectives or ctx.table is None or not ctx.table.tp_sync_fraction:
        return 0.0, 0.0
    return tuple(ctx.table.tp_sync_fraction * layer_time_s(works, ctx.device, ctx.dtype, ctx.table) if works else 0.0
                 for works in split_gemms)
