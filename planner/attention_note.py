"""A note where the attention kernel the training code runs would move the step by more than the
cost model's error.

On Hopper the device's own flash kernels (cuDNN's, FlashAttention-3's) run attention about twice as
fast as FlashAttention-2's (`flash2_attention_ratio`), and which one runs depends on the training
code and its PyTorch version (README, `--attention`). The default prices the device's own; where
the model's attention is a large part of the step (long sequences), FlashAttention-2's kernels
would change the answer, so the estimate says by how much.
"""
from __future__ import annotations

import dataclasses

from planner.config import ParallelConfig
from planner.estimate import Evaluator
from planner.graph import OpKind, Recompute
from planner.op_works import AttentionKernel
from planner.result import PUBLISHED_MAPE, Estimate

# Step-time changes below this fraction go unnoted: the cost model's error over the published runs.
ATTENTION_NOTE_FRACTION = PUBLISHED_MAPE


def attention_kernel_note(evaluator: Evaluator, config: ParallelConfig, estimate: Estimate, global_batch: int,
                          boundaries: tuple[int, ...] | None = None,
                          recompute_per_layer: tuple[Recompute, ...] | None = None) -> tuple[str, ...]:
    """A note where `estimate` (of `config` with the given split and recompute) prices the device's
    own flash kernels, FlashAttention-2's are slower on some device of the cluster, and they would
    lengthen the step, as `--attention flash2` prices it, by ATTENTION_NOTE_FRACTION or more; ()
    otherwise."""
    if evaluator.code.attention is not AttentionKernel.FLASH:
        return ()
    if all(group.node.device.flash2_attention_ratio == (1.0, 1.0) for group in evaluator.cluster.groups):
        return ()
    if not any(op.kind == OpKind.ATTENTION for layer in evaluator.graph.layers for op in layer.ops):
        return ()
    flash2 = Evaluator(evaluator.graph, evaluator.cluster, evaluator.dtype, evaluator.table,
                       code=dataclasses.replace(evaluator.code, attention=AttentionKernel.FLASH2))
    slower = flash2.estimate(config, global_batch, boundaries=boundaries, recompute_per_layer=recompute_per_layer)
    if slower.step_time_s < estimate.step_time_s * (1 + ATTENTION_NOTE_FRACTION):
        return ()
    return (f"attention is priced at the device's own flash kernels (cuDNN's or FlashAttention-3's on Hopper); "
            f"with FlashAttention-2's (--attention flash2: the flash-attn 2 package, or PyTorch's SDPA on Hopper up "
            f"to torch 2.10) the step takes {slower.step_time_s:.4g} s, "
            f"{slower.step_time_s / estimate.step_time_s - 1:+.0%}",)
