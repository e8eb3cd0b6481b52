"""What a sequence-parallel layer keeps of the inputs it all-gathers for its column-parallel matmuls.

Under Megatron sequence parallelism (Korthikanti et al. 2022, §4.2.2) a block's norm output is
split by sequence; the q/k/v (or fc1) projections need it whole, so it is all-gathered first, and
the matmuls' weight gradients need it again in backward. Training codes differ in what they keep
for that:

- "kept": autograd saves the gathered tensor itself, whole on every tp rank. PyTorch's DTensor
  styles run so (`ColwiseParallel` behind a `PrepareModuleInput`, as torchtitan and `Plan.apply`
  use them): the layer keeps (tp - 1) / tp of each gathered input more than Korthikanti's
  34 s b h / t. For a GPT block that is s b h (4 + 30 / t), 11.8% over 34 / t at tp 2 and 35% at
  tp 4; measured per block with `Plan.apply` on gloo ranks, 12.5% and 37% (a saved-tensor probe
  outside the repository; the step's peak at tp 2 then came within 0.1 MiB of the price).
- "regathered": the matmul saves its sequence-split input and all-gathers it again in backward,
  overlapped with the input-gradient GEMM (Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication`,
  Megatron-Core, Megatron-DeepSpeed): the layer keeps 34 s b h / t.

Full recompute and op-level checkpointing keep no gathered tensor between forward and backward
(the checkpoint reruns the all-gather); a full-recompute layer's rerun holds them while it runs
(`layer_cost._recompute_work_bytes`).
"""
from __future__ import annotations

from enum import StrEnum

from costmodel.comm import Collective
from planner.graph import Layer, OpKind, Recompute


class SpGather(StrEnum):
    """What the training code keeps of a sequence-parallel all-gathered matmul input (module docstring)."""

    KEPT = "kept"
    REGATHERED = "regathered"


# Policies under which a layer's matmul inputs stay saved until its backward.
_SAVING_POLICIES = (Recompute.NONE, Recompute.SELECTIVE)


def kept_gathered_bytes(layer: Layer, collectives: tuple[tuple[Collective, float, str], ...], tp: int,
                        recompute: Recompute, sp_gather: SpGather) -> float:
    """Bytes (traced micro-batch) one tp rank keeps beyond a 1/tp share of the tensors its layout
    all-gathers for matmuls with weights: (tp - 1) / tp of each such tensor, once however many
    matmuls read it, under "kept" and a policy that saves matmul inputs.

    Args:
        layer: the traced layer.
        collectives: its tensor-parallel layout's forward collectives, (kind, bytes, producer).
        tp: the tensor-parallel degree.
        recompute: the layer's recompute policy.
        sp_gather: what the training code keeps.
    """
    if tp == 1 or sp_gather is SpGather.REGATHERED or recompute not in _SAVING_POLICIES:
        return 0.0
    gathered = {producer for kind, _, producer in collectives if kind is Collective.ALL_GATHER}
    read_by_weights = {name for op in layer.ops if op.kind == OpKind.MATMUL and op.param_shapes for name in op.inputs}
    return sum(op.out_bytes for op in layer.ops if op.name in gathered & read_by_weights) * (tp - 1) / tp
