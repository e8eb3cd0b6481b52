"""Exposed communication of one layer besides its tensor-parallel layout's collectives: the
context-parallel exchange (ring of keys and values, or all-to-all of heads), the expert-parallel
all-to-alls, and tensor-parallel collectives overlapped with the GEMMs they feed
(`planner.layer_cost.price_layer`).
"""
from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from costmodel.comm import Collective, collective_time_s
from costmodel.compute import base_dtype, bytes_per_element
from planner.graph import Layer, OpKind

if TYPE_CHECKING:
    from planner.layer_cost import LayerContext


class CpComm(StrEnum):
    """How context parallelism exchanges what attention needs across the cp ranks of a sequence.

    ALL_GATHER: every rank receives the keys and values of the whole sequence and runs its own
    queries against them (ring attention, Megatron-Core `--cp-comm-type p2p` / `all_gather`, torch's
    `context_parallel`, Llama 3's all-gather form, `Plan.apply`); the exchange runs beside
    attention, and the backward returns dK and dV the same way.
    ALL_TO_ALL: DeepSpeed-Ulysses (Jacobs et al. 2023), Megatron-Core `--cp-comm-type a2a`: an
    all-to-all turns the queries, keys and values from sequence shards into head shards, attention
    runs on whole sequences with 1/cp of the heads, and an all-to-all returns the output; the
    backward runs the four in reverse. Nothing overlaps them. Each rank's heads (after tp) must
    divide by cp, keys and values too.
    """

    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "a2a"


def cp_exposed_s(layer: Layer, ctx: LayerContext, attention_fwd_s: float, attention_bwd_s: float) -> tuple[float, float]:
    """(forward, backward) exposed seconds of the layer's context-parallel exchange (`CpComm`)."""
    if ctx.cp == 1:
        return 0.0, 0.0
    if ctx.cp_comm is CpComm.ALL_TO_ALL:
        return cp_all_to_all_s(layer, ctx)
    return cp_ring_exposed_s(layer, ctx, attention_fwd_s, attention_bwd_s)


def cp_all_to_all_s(layer: Layer, ctx: LayerContext) -> tuple[float, float]:
    """The Ulysses all-to-alls of each attention op (`CpComm.ALL_TO_ALL`): queries, keys, values and
    output in the forward, their gradients in the backward, each the rank's local tokens of its
    (tp-split) heads."""
    fwd_s = 0.0
    for op in layer.ops:
        if op.kind != OpKind.ATTENTION:
            continue
        heads = op.attrs.get("heads", 1) or 1
        kv_share = (op.attrs.get("kv_heads", heads) or heads) / heads
        local_bytes = op.out_bytes * ctx.batch_scale / (ctx.tp * ctx.cp)  # queries and output alike
        fwd_s += sum(collective_time_s(Collective.ALL_TO_ALL, local_bytes * share, ctx.cp_group, ctx.node, ctx.oversubscription)
                     for share in (1.0, kv_share, kv_share, 1.0))
    return fwd_s, fwd_s


def cp_ring_exposed_s(layer: Layer, ctx: LayerContext, attention_fwd_s: float, attention_bwd_s: float) -> tuple[float, float]:
    """Exposed ring exchange under context parallelism (`CpComm.ALL_GATHER`): of K and V in the
    forward, and of K, V, dK and dV in the backward."""
    if not ctx.device.comm_overlaps_compute:
        attention_fwd_s = attention_bwd_s = 0.0  # nothing hides the ring
    fwd_s = bwd_s = 0.0
    for op in layer.ops:
        if op.kind != OpKind.ATTENTION:
            continue
        heads = op.attrs.get("heads", 1) or 1
        kv_heads = op.attrs.get("kv_heads", heads) or heads
        kv_bytes = 2 * op.out_bytes * kv_heads / heads * ctx.batch_scale / ctx.tp
        ring_s = collective_time_s(Collective.ALL_GATHER, kv_bytes, ctx.cp_group, ctx.node, ctx.oversubscription)
        fwd_s += max(0.0, ring_s - attention_fwd_s)
        bwd_s += max(0.0, 2 * ring_s - attention_bwd_s)
    return fwd_s, bwd_s


def ep_all_to_all_fwd_s(layer: Layer, ctx: LayerContext) -> float:
    """Exposed all-to-all dispatch and combine of an MoE layer's forward (its backward runs both again)."""
    if ctx.ep == 1 or layer.expert_params == 0:
        return 0.0
    tokens = ctx.batch_scale * layer_tokens(layer) / (ctx.cp * (ctx.tp if ctx.sequence_parallel else 1))
    per_rank_bytes = tokens * ctx.top_k * ctx.hidden * bytes_per_element(base_dtype(ctx.dtype))
    return 2 * collective_time_s(Collective.ALL_TO_ALL, per_rank_bytes, ctx.ep_group, ctx.node, ctx.oversubscription)


def layer_tokens(layer: Layer) -> float:
    """Tokens of the traced micro-batch, read from the layer's first op output shape (batch x seq)."""
    for op in layer.ops:
        if len(op.out_shape) >= 2:
            return float(op.out_shape[0] * op.out_shape[1])
    return 0.0


class TpOverlap(StrEnum):
    """Which tensor-parallel collectives the training code pipelines with the GEMMs beside them
    (`overlapped_tp_comm_s`); the rest wait exposed.

    NONE: none (plain tensor parallelism: PyTorch's DTensor styles, Megatron without the flag).
    FULL: those of the forward, the recomputed forward and the backward (Megatron-Core
    `--tp-comm-overlap`: Transformer Engine's userbuffers overlap the forward's all-gathers and
    reduce-scatters and the backward's dgrad and wgrad collectives).
    FORWARD: those of the forward pass only; the recomputed forward and the backward run theirs
    exposed. PyTorch's async TP of 2024 (torch 2.4-2.6, `enable_async_tp`): its authors measured
    up to 20-29% forward speedups but 8% end to end on Llama 3 8B and 70B ("[Distributed w/
    TorchTitan] Introducing Async Tensor Parallelism in PyTorch", discuss.pytorch.org/t/209487,
    Aug 2024), the gain of a forward-only overlap; the inductor pass of its author's branch then
    returned early on backward graphs' reduce-scatters (yifuwang/pytorch,
    torch/_inductor/fx_passes/micro_pipeline_tp.py, `fuse_matmul_reduce_scatter`).
    """

    NONE = "none"
    FULL = "full"
    FORWARD = "forward"


def overlapped_tp_comm_s(comm_s: float, gemm_s: float, tp: int) -> float:
    """Exposed seconds of tensor-parallel collectives pipelined with the GEMMs they feed or drain.

    Communication-overlapped tensor parallelism (`TpOverlap`; Wang et al. 2023 "Overlap
    communication with dependent computation via decomposition") splits each all-gather /
    reduce-scatter into its tp ring steps and runs each beside one chunk of the GEMM: the collective
    hides behind the GEMMs except for one step that has no chunk beside it, and except where it is
    longer than they are.

    Args:
        comm_s: the collectives' time when exposed.
        gemm_s: the GEMM time they overlap with.
        tp: tensor-parallel degree (ring steps of each collective).
    """
    return max(comm_s / tp, comm_s - gemm_s)
