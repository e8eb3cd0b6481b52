"""torchtitan's op-level selective activation checkpointing, shared by the tracer and `Plan.apply`.

torchtitan (`activation_checkpoint.mode = "selective"`, `selective_ac_option = "op"`;
torchtitan/models/llama/parallelize_llama.py, 2024) checkpoints each block and, inside it, keeps
the outputs of the attention kernels and of every other `aten.mm` (the 1st, 3rd, ... of the block's
forward), recomputing everything else: norms, activations, rotary embeddings and the other half of
the matmuls. The tracer measures what this keeps (`planner.measure`), the cost model prices the
recomputed forward (`planner.layer_cost`), and `planner.apply.recompute` runs it.
"""
from __future__ import annotations

import torch

_aten = torch.ops.aten

# Attention kernels whose outputs are kept (CUDA flash, memory-efficient and cuDNN, and the CPU
# flash kernel that stands for them when the tracer measures on the CPU device).
ATTENTION_OPS = frozenset({
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
})
MATMUL_OP = _aten.mm.default


class OpSacCounter:
    """Decides, op by op through one forward of a checkpointed block, whether its output is kept."""

    def __init__(self) -> None:
        self.matmuls = 0

    def keeps(self, func) -> bool:
        """True for attention kernels and for the odd-numbered `aten.mm` calls."""
        if func == MATMUL_OP:
            self.matmuls += 1
            return self.matmuls % 2 == 1
        return func in ATTENTION_OPS
