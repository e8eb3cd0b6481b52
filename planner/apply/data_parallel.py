"""Data parallelism over the plan's `dp` mesh axis, by ZeRO stage.

| ZeRO | applied as | what is sharded over dp |
|------|------------|-------------------------|
| 0 | FSDP2-based `replicate` (DDP semantics) | nothing; gradients all-reduced |
| 1, 2 | `fully_shard(reshard_after_forward=False)` | gradients and optimizer states (parameters stay gathered from forward to backward) |
| 3 | `fully_shard(reshard_after_forward=True)` | parameters, gradients and optimizer states |

FSDP2 has no optimizer-states-only mode, so ZeRO-1 runs as ZeRO-2: gradients are reduce-scattered
too, which needs less memory than the plan budgets for ZeRO-1, never more. Every block is its own
communication unit (parameters gathered and gradients reduced per block, overlapping compute),
then the root takes the rest (embedding, final norm, head).
"""
from __future__ import annotations

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_data_parallel(root: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, zero: int,
                        mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """Wraps each block, then `root`, for data parallelism over `dp_mesh` at ZeRO stage `zero`.

    Args:
        root: the local module (whole model or one pipeline chunk).
        blocks: the repeated blocks inside `root`, each its own FSDP unit.
        dp_mesh: the one-dimensional data-parallel mesh.
        zero: ZeRO stage 0-3 (see the module docstring for what each maps to).
        mp_policy: FSDP2 mixed precision (parameter and reduction dtypes); none keeps the model's dtype.
    """
    policy = mp_policy or MixedPrecisionPolicy()
    if zero == 0:
        for module in [*blocks, root]:
            replicate(module, mesh=dp_mesh, mp_policy=policy)
        return
    for module in [*blocks, root]:
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=zero == 3, mp_policy=policy)
