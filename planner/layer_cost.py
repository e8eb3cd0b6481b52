"""Price one layer for one micro-batch on one device, under a tensor- and context-parallel split.

The traced op graph is turned into cost-model work (`planner.op_works`). Tensor parallelism divides the ops its layout shards
(`TpPlan`) and adds the layout's collectives; context parallelism divides every op by `cp` and adds
the ring exchange of keys and values, overlapped with the attention kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from costmodel.comm import Collective, CommGroup, collective_time_s
from costmodel.compute import OpWork, WorkKind, base_dtype, bytes_per_element, layer_time_s
from costmodel.hardware import DeviceSpec, NodeSpec
from costmodel.op_table import OpTable
from planner.fusion import ElementwiseKernels, fused_works
from planner.graph import Layer, Op, OpKind, Recompute
from planner.layer_comm import CpComm, TpOverlap, cp_exposed_s, ep_all_to_all_fwd_s, overlapped_tp_comm_s
from planner.loss_cost import LossKernel, fused_loss_saving, loss_held_copies, loss_temp_copies
from planner.op_sac_cost import op_sac_kept, op_sac_reruns_collectives
from planner.op_works import (MATMUL_BWD_GEMMS, UNFUSED_SAVED_BYTES_PER_SCORE, AttentionKernel, input_bytes_of, op_works,
                              score_elements)
from planner.parallel_overhead import blocking_collective_kind, sync_wait_s, tp_host_s
from planner.sp_gather import SpGather, kept_gathered_bytes

# Megatron-style tensor parallelism without sequence parallelism leaves the layer norms, dropouts
# and residual adds replicated: Korthikanti et al. 2022, Table 2 gives s*b*h*(10 + 24/t) of the
# 34*s*b*h a GPT layer saves, i.e. 10/34 of the activations are not divided by t.
UNSPLIT_ACTIVATION_FRACTION_WITHOUT_SP = 10 / 34

@dataclass(frozen=True)
class TpPlan:
    """How tensor parallelism splits one layer.

    Attributes:
        tp: the tensor-parallel degree.
        split_ops: names of ops whose FLOPs and bytes are divided by tp.
        collectives: (collective, bytes, producer op converted) per forward at the traced micro-batch;
            backward runs the conjugate collectives of the same sizes.
        whole_params: parameters outside the experts every tp rank holds whole (replicated norms, an
            embedding whose vocabulary tp does not divide).
    """

    tp: int
    split_ops: frozenset[str] = frozenset()
    collectives: tuple[tuple[Collective, float, str], ...] = ()
    whole_params: int = 0


@dataclass(frozen=True)
class LayerCost:
    """Seconds and bytes of one micro-batch of one layer on one device."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float
    act_bytes: float
    temp_bytes: float = 0.0
    work_bytes: float = 0.0  # `_recompute_work_bytes`: a stage's peak holds its largest, not their sum
    held_bytes: float = 0.0  # reserved beside the loss's temporaries (`_loss_bytes`)
    loss_input_bytes: float = 0.0  # the loss's logits (`_loss_bytes`), which a pipeline may keep (`PipeOutputs`)
    cp_fwd_comm_s: float = 0.0  # the forward's part of cp_comm_s
    # (forward, backward with recompute) seconds of the context-parallel exchange hidden behind the
    # layer's compute: its links are busy then, for whatever else would hide there (`planner.estimate`)
    cp_hidden_s: tuple[float, float] = (0.0, 0.0)

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.recompute_s + self.tp_comm_s + self.cp_comm_s + self.ep_comm_s

    def windows_s(self, beside_cp: bool) -> tuple[float, float]:
        """(forward, backward with recompute) seconds other traffic can hide in: beside the cp exchange
        on its links, the compute it leaves; else the compute and the exchange's exposed time too."""
        if beside_cp:
            hidden_fwd_s, hidden_bwd_s = self.cp_hidden_s
            return max(0.0, self.fwd_s - hidden_fwd_s), max(0.0, self.bwd_s + self.recompute_s - hidden_bwd_s)
        return self.fwd_s + self.cp_fwd_comm_s, self.bwd_s + self.recompute_s + self.cp_comm_s - self.cp_fwd_comm_s


@dataclass(frozen=True)
class LayerContext:
    """Everything about the configuration that changes a layer's price."""

    device: DeviceSpec
    node: NodeSpec
    dtype: str
    tp: int
    cp: int
    ep: int
    batch_scale: float
    recompute: Recompute
    sequence_parallel: bool
    tp_group: CommGroup
    cp_group: CommGroup
    ep_group: CommGroup
    top_k: int = 0
    hidden: int = 0
    table: OpTable | None = None
    attention: AttentionKernel = AttentionKernel.FLASH
    tp_overlap: TpOverlap = TpOverlap.NONE
    loss: LossKernel = LossKernel.TORCH
    elementwise: ElementwiseKernels = ElementwiseKernels.EAGER
    cp_comm: CpComm = CpComm.ALL_GATHER
    sp_gather: SpGather = SpGather.KEPT
    oversubscription: float = 1.0  # the cluster's, for groups that span nodes


def _op_works(op: Op, ctx: LayerContext, split: int, input_bytes: float | None = None) -> tuple[list[OpWork], list[OpWork]]:
    """Forward and backward work of one op, divided by its tensor-parallel split and by cp."""
    return op_works(op, ctx.batch_scale / (split * ctx.cp), input_bytes, ctx.cp, ctx.attention)


def _split_of(op: Op, plan: TpPlan) -> int:
    """How many ways the layout splits `op`'s work: memory-bound ops too only where it runs them on
    split activations (a norm on S(sequence), an activation on S(feature)), as `Plan.apply` does."""
    return plan.tp if op.name in plan.split_ops else 1


def _sequence_split(layer: Layer, plan: TpPlan, ctx: LayerContext) -> bool:
    """Whether the layout keeps the layer's residual stream split by sequence (Megatron-SP): it runs
    every norm of the layer on S(sequence); replicated norms mean a replicated stream."""
    return ctx.sequence_parallel and all(op.name in plan.split_ops for op in layer.ops if op.kind == OpKind.NORM)


def _layer_level_works(layer: Layer, ctx: LayerContext, split: int) -> tuple[list[OpWork], list[OpWork]]:
    """A layer traced without an op graph: its FLOPs priced as one matmul."""
    share = ctx.batch_scale / (split * ctx.cp)
    return [OpWork(WorkKind.MATMUL, layer.fwd_flops * share, 0.0)], [OpWork(WorkKind.MATMUL, layer.bwd_flops * share, 0.0)]


def _unheld_works(layer: Layer, ctx: LayerContext, split: int) -> tuple[list[OpWork], list[OpWork]]:
    """The layer's FLOPs that none of its ops holds, priced as one matmul: a module-level trace's ops
    are its leaf modules, so functional code inside a module (an attention call, a routing einsum)
    is measured in the layer's FLOPs only (op-level checkpointing, which keeps attention's outputs,
    is taken not to rerun them). Graph traces hold every FLOP in an op: nothing then."""
    unheld = layer.fwd_flops - sum(op.fwd_flops for op in layer.ops)
    if unheld <= 0:
        return [], []
    work = OpWork(WorkKind.MATMUL, unheld * ctx.batch_scale / (split * ctx.cp), 0.0)
    return [work], [work] * MATMUL_BWD_GEMMS


def _gathered_kv_bytes(layer: Layer, ctx: LayerContext) -> float:
    """What attention's context-parallel exchange adds to the activations kept for backward (before
    tp divides them by heads).

    The all-gather form (Plan.apply, Llama 3) gathers the whole sequence's keys and values. Without
    recompute autograd keeps them as attention's inputs instead of the rank's share, (cp-1)/cp of
    them more; selective recompute keeps collective outputs (`planner.apply.recompute.SAVED_OPS`)
    beside the kept projections: all of them more. Full and op-level recompute gather again in
    backward. The all-to-all form's attention inputs are the rank's share (1/cp of the heads over
    the whole sequence); selective recompute keeps what its all-to-alls return."""
    if ctx.cp == 1 or ctx.recompute not in (Recompute.NONE, Recompute.SELECTIVE):
        return 0.0
    reads = input_bytes_of(layer)
    attention = [op for op in layer.ops if op.kind == OpKind.ATTENTION]
    if ctx.cp_comm is CpComm.ALL_TO_ALL:
        kept_inputs = sum(reads[op.name] for op in attention) if ctx.recompute == Recompute.SELECTIVE else 0.0
        return kept_inputs * ctx.batch_scale / ctx.cp
    kept = (ctx.cp - 1) / ctx.cp if ctx.recompute == Recompute.NONE else 1.0
    kv_bytes = sum(reads[op.name] - op.out_bytes for op in attention)
    return kv_bytes * ctx.batch_scale * kept


def _activation_bytes(layer: Layer, ctx: LayerContext, plan: TpPlan, tp: int) -> float:
    saving = fused_loss_saving(layer, ctx.loss, ctx.recompute, input_bytes_of(layer),
                               bytes_per_element(base_dtype(ctx.dtype)))
    saved = (layer.saved_bytes[ctx.recompute] - saving) * ctx.batch_scale / ctx.cp
    # Score tensors and gathered keys and values are split by heads, so tp divides them with or
    # without sequence parallelism. Under cp a rank keeps 1/cp of the scores: its s/cp queries
    # against all s keys (gathered), or its heads/cp over the whole sequence (all-to-all).
    by_heads = _gathered_kv_bytes(layer, ctx)
    if ctx.attention == AttentionKernel.UNFUSED and ctx.recompute == Recompute.NONE:
        by_heads += sum(UNFUSED_SAVED_BYTES_PER_SCORE * score_elements(op) for op in layer.ops
                        if op.kind == OpKind.ATTENTION) * ctx.batch_scale / ctx.cp
    if tp == 1:
        return saved + by_heads
    if _sequence_split(layer, plan, ctx):
        gathered = kept_gathered_bytes(layer, plan.collectives, tp, ctx.recompute, ctx.sp_gather) * ctx.batch_scale / ctx.cp
        return (saved + by_heads) / tp + gathered
    if ctx.recompute == Recompute.FULL:  # the layer's input, on a replicated stream
        return saved + by_heads
    unsplit = UNSPLIT_ACTIVATION_FRACTION_WITHOUT_SP
    return saved * (unsplit + (1 - unsplit) / tp) + by_heads / tp


def _recompute_work_bytes(layer: Layer, ctx: LayerContext, plan: TpPlan, tp: int, kept_bytes: float) -> float:
    """Bytes a recomputed layer holds again in its backward: what no recompute keeps (unfused scores included) less `kept_bytes`."""
    if ctx.recompute == Recompute.NONE or not layer.bwd_work_fraction:
        return 0.0
    return max(0.0, _activation_bytes(layer, replace(ctx, recompute=Recompute.NONE), plan, tp) - kept_bytes)


def _loss_bytes(layer: Layer, plan: TpPlan, ctx: LayerContext) -> tuple[float, float, float]:
    """Transient bytes of the layer's loss at the step's peak, the bytes the allocator holds
    reserved beside them (`loss_cost.loss_temp_copies` and `loss_held_copies` of the local share of
    its input) and the local share of its first input, the logits."""
    reads = input_bytes_of(layer)
    produced = {op.name: op.out_bytes for op in layer.ops}
    activation_bytes = bytes_per_element(base_dtype(ctx.dtype))
    temp = held = inputs = 0.0
    for op in (op for op in layer.ops if op.kind == OpKind.LOSS):
        split = _split_of(op, plan)
        share = reads[op.name] * ctx.batch_scale / (split * ctx.cp)
        temp += loss_temp_copies(op, layer, ctx.loss, split, activation_bytes) * share
        held += loss_held_copies(op, layer, ctx.loss, activation_bytes) * share
        inputs += produced.get(op.inputs[0], reads[op.name]) * ctx.batch_scale / (split * ctx.cp) if op.inputs else 0.0
    return temp, held, inputs


def _time_s(works: list[OpWork], ctx: LayerContext) -> float:
    return layer_time_s(works, ctx.device, ctx.dtype, ctx.table, ctx.elementwise.cast_traffic_ratio)


def price_layer(layer: Layer, plan: TpPlan, ctx: LayerContext) -> LayerCost:
    """Seconds and activation bytes of one micro-batch of `layer` under `ctx`: compute split into
    forward, backward and recompute, and the exposed communication of each parallelism.

    Args:
        layer: the traced layer (its numbers are for the traced micro-batch; `ctx.batch_scale`
            rescales them to the priced micro-batch).
        plan: which ops tensor parallelism splits and the collectives it adds.
        ctx: device, dtype, degrees and communication groups.
    """
    if layer.ops:
        fused, fwd_works, bwd_works = (fused_works(layer.ops, ctx.batch_scale / ctx.cp, lambda op: _split_of(op, plan))
                                       if ctx.elementwise == ElementwiseKernels.FUSED else (frozenset(), [], []))
        attention_fwd: list[OpWork] = []
        attention_bwd: list[OpWork] = []
        op_sac_rerun: list[OpWork] = list(fwd_works)  # op-level checkpointing keeps no elementwise output
        kept = op_sac_kept(layer)
        reads = input_bytes_of(layer)
        for op in (op for op in layer.ops if op.name not in fused):
            fwd, bwd = _op_works(op, ctx, _split_of(op, plan), reads[op.name])
            fwd_works += fwd
            bwd_works += bwd
            if op.kind == OpKind.ATTENTION:
                attention_fwd += fwd
                attention_bwd += bwd
            if op.name not in kept:
                op_sac_rerun += fwd
        unheld_fwd, unheld_bwd = _unheld_works(layer, ctx, plan.tp)
        fwd_works += unheld_fwd
        bwd_works += unheld_bwd
    else:
        fwd_works, bwd_works = _layer_level_works(layer, ctx, plan.tp)
        attention_fwd, attention_bwd, op_sac_rerun = [], [], fwd_works
    fwd_s = _time_s(fwd_works, ctx)
    # Op works price a fully trainable backward (frozen parameters or no gradient to pass on run
    # less of it); a layer without ops is priced from its measured backward FLOPs already.
    bwd_s = _time_s(bwd_works, ctx) * (layer.bwd_work_fraction if layer.ops else 1.0)
    # A GPU computes while its host dispatches ahead; a CPU rank's cores do both in turn.
    host_fwd_s, host_bwd_s = tp_host_s(layer, plan, ctx)
    if ctx.device.comm_overlaps_compute:
        fwd_s, bwd_s = max(fwd_s, host_fwd_s), max(bwd_s, host_bwd_s)
    else:
        fwd_s, bwd_s = fwd_s + host_fwd_s, bwd_s + host_bwd_s
    attention_fwd_s = _time_s(attention_fwd, ctx) if attention_fwd else 0.0
    attention_bwd_s = _time_s(attention_bwd, ctx) if attention_bwd else 0.0
    collective_s = [collective_time_s(kind, size * ctx.batch_scale / ctx.cp, ctx.tp_group, ctx.node, ctx.oversubscription)
                    for kind, size, _ in plan.collectives]
    tp_fwd_s = sum(collective_s)
    tp_exposed_fwd_s = tp_exposed_bwd_s = tp_fwd_s
    if ctx.tp_overlap is not TpOverlap.NONE and ctx.device.comm_overlaps_compute and tp_fwd_s > 0:
        gemm_fwd_s, gemm_bwd_s = (_time_s([w for w in works if w.kind == WorkKind.MATMUL], ctx)
                                  for works in (fwd_works, bwd_works))
        tp_exposed_fwd_s = overlapped_tp_comm_s(tp_fwd_s, gemm_fwd_s, plan.tp)
        if ctx.tp_overlap is TpOverlap.FULL:
            tp_exposed_bwd_s = overlapped_tp_comm_s(tp_fwd_s, gemm_bwd_s, plan.tp)
    # the recomputed forward overlaps its collectives as the backward does
    tp_rerun_s = tp_exposed_fwd_s if ctx.tp_overlap is TpOverlap.FULL else tp_fwd_s
    # Waiting at the layer's collectives counts with the first kind of them the layer has.
    cp_fwd_s, cp_bwd_s = cp_exposed_s(layer, ctx, attention_fwd_s, attention_bwd_s)
    ep_fwd_s = ep_all_to_all_fwd_s(layer, ctx)
    if not layer.bwd_work_fraction:  # no backward runs: no backward collectives, nothing to recompute for
        tp_exposed_bwd_s = cp_bwd_s = 0.0
    ep_bwd_s = ep_fwd_s if layer.bwd_work_fraction else 0.0
    cp_comm_s, ep_comm_s = cp_fwd_s + cp_bwd_s, ep_fwd_s + ep_bwd_s
    cp_fwd_comm_s = cp_fwd_s
    busy_fwd_s, busy_bwd_s = cp_exposed_s(layer, ctx, 0.0, 0.0)  # the exchange's whole time
    hidden_fwd_s = busy_fwd_s - cp_fwd_s
    reruns_exchange = ctx.recompute in (Recompute.FULL, Recompute.SELECTIVE_OP)
    hidden_bwd_s = (busy_bwd_s - cp_bwd_s + hidden_fwd_s * reruns_exchange) if layer.bwd_work_fraction else 0.0
    waited_at = blocking_collective_kind(layer, plan, ctx)
    if waited_at is not None:
        wait_fwd_s, wait_bwd_s = sync_wait_s(ctx, fwd_s, bwd_s)
        if waited_at == "tp":
            tp_exposed_fwd_s, tp_exposed_bwd_s = tp_exposed_fwd_s + wait_fwd_s, tp_exposed_bwd_s + wait_bwd_s
            tp_rerun_s += wait_fwd_s
        elif waited_at == "cp":
            cp_comm_s += wait_fwd_s + wait_bwd_s
            cp_fwd_comm_s += wait_fwd_s
        else:
            ep_comm_s += wait_fwd_s + wait_bwd_s
    recompute_s = {
        Recompute.NONE: 0.0,
        Recompute.SELECTIVE: attention_fwd_s,
        Recompute.FULL: fwd_s + tp_rerun_s + cp_fwd_s + ep_fwd_s,  # the forward, its collectives included
        # op-level checkpointing keeps no collective's output: the context-parallel exchange runs again too
        Recompute.SELECTIVE_OP: (_time_s(op_sac_rerun, ctx) if op_sac_rerun else 0.0) + cp_fwd_s
                                + sum(t for t, rerun in zip(collective_s, op_sac_reruns_collectives(layer, plan.collectives)) if rerun),
    }[ctx.recompute] if layer.bwd_work_fraction else 0.0
    # a loss run whole keeps whole logits, most of its layer's saved bytes (the rest is priced whole too)
    act_split = 1 if any(op.kind == OpKind.LOSS and op.name not in plan.split_ops for op in layer.ops) else plan.tp
    act_bytes = _activation_bytes(layer, ctx, plan, act_split)
    temp_bytes, held_bytes, loss_input_bytes = _loss_bytes(layer, plan, ctx)
    return LayerCost(
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        recompute_s=recompute_s,
        tp_comm_s=tp_exposed_fwd_s + tp_exposed_bwd_s,
        cp_comm_s=cp_comm_s,
        ep_comm_s=ep_comm_s,
        cp_fwd_comm_s=cp_fwd_comm_s,
        cp_hidden_s=(hidden_fwd_s, hidden_bwd_s),
        act_bytes=act_bytes,
        temp_bytes=temp_bytes,
        work_bytes=_recompute_work_bytes(layer, ctx, plan, act_split, act_bytes),
        held_bytes=held_bytes,
        loss_input_bytes=loss_input_bytes,
    )
