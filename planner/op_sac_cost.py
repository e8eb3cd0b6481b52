"""What op-level selective checkpointing (`planner.op_sac`, torchtitan's policy) keeps of a traced
layer, and which of its tensor-parallel collectives the recomputed forward runs again: the cost
model's side of that policy (`planner.layer_cost` prices the rerun)."""
from __future__ import annotations

from costmodel.comm import Collective
from planner.graph import Layer, OpKind


def op_sac_kept(layer: Layer) -> set[str]:
    """Ops whose outputs op-level selective checkpointing keeps (`planner.op_sac`): the attention
    cores and every other matmul that runs as one `aten.mm` (a Linear without bias, or `mm`), in
    graph order; the others run again in backward (`op_sac_reruns_collectives` for the tensor-
    parallel collectives the rerun repeats)."""
    kept, matmuls = set(), 0
    for op in layer.ops:
        if op.kind == OpKind.ATTENTION:
            kept.add(op.name)
        elif op.kind == OpKind.MATMUL and (op.target == "mm" or (op.target == "linear" and len(op.param_shapes) == 1)):
            matmuls += 1
            if matmuls % 2 == 1:
                kept.add(op.name)
    return kept


def op_sac_reruns_collectives(layer: Layer, collectives: tuple[tuple[Collective, float, str], ...]) -> list[bool]:
    """Per collective of a tensor-parallel layout's `collectives` ((kind, bytes, producer)), whether
    op-level checkpointing's rerun repeats it: its output (a collective's output is not kept) feeds a
    matmul that is recomputed, e.g. the sequence-parallel all-gather before k_proj when only q_proj
    and v_proj outputs are kept."""
    kept = op_sac_kept(layer)
    rerun_inputs = {name for op in layer.ops if op.kind == OpKind.MATMUL and op.name not in kept for name in op.inputs}
    return [producer in rerun_inputs for _, _, producer in collectives]
