"""Data parallelism over the plan's `dp` mesh axis, by ZeRO stage.

| ZeRO | applied as | what is sharded over dp |
|------|------------|-------------------------|
| 0 | FSDP2-based `replicate` (DDP semantics) | nothing; gradients all-reduced |
| 1, 2 | `fully_shard(reshard_after_forward=False)` | gradients and optimizer states (parameters stay gathered from forward to backward) |
| 3 | `fully_shard(reshard_after_forward=True)` | parameters, gradients and optimizer states |
| any, with `offload_optimizer` | the above through `fully_shard` with `CPUOffloadPolicy` | as above; the sharded parameters, gradients and optimizer states live in host memory and the optimizer steps there |

With offload, ZeRO-0 runs as ZeRO-2 (FSDP2 offloads sharded state only), which holds less on the
device than the plan budgets. FSDP2 offloads the fp32 parameter shards too, where ZeRO-Offload keeps
the bf16 weights on the device: the device holds at most what the plan budgets.

FSDP2 has no optimizer-states-only mode, so ZeRO-1 runs as ZeRO-2 with gradient sync on the last
micro-batch only: the whole gradients accumulate, as ZeRO-1 budgets them, and are reduce-scattered
once per step; the optimizer then updates its shard. Every layer of the plan
(embedding, each block, final norm, head) is its own communication unit, as the cost model prices
gathers and reductions per layer; units sharing a parameter (tied embeddings) stay with the root.

Hybrid sharding (`dp_replicate` > 1, HSDP) passes `fully_shard` a two-dimensional mesh (replicas,
shard group): each replica shards the states over its dp / dp_replicate ranks (times cp), and the
reduce-scattered gradients are all-reduced across replicas. The replicas are the outer part of the
dp axis (`HYBRID_MESH_AXES`), as the cost model lays them out (`planner.mesh`).

Gradient reduction with micro-batches: without pipelining, ZeRO-2/3 reduce-scatter after every
micro-batch so gradients stay sharded (`AppliedPlan.forward_backward`); ZeRO-0/1 reduce once, and
hybrid sharding all-reduces across replicas once, after the last micro-batch.
Below ZeRO-3 the parameters stay gathered until the last micro-batch's backward (no re-gather).
With pipelining, torch's `PipelineStage` defers the reduction to the last micro-batch, so the
unsharded gradients of the stage accumulate in between, and keeps ZeRO-3 parameters gathered from
each backward to the next forward; the cost model prices both (`planner.state_cost.zero3_exposed_s`,
`costmodel.memory.stage_memory`'s `deferred_grad_sync`).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from planner.config import ParallelConfig


# FSDP2 parameter dtype of each mixed-precision training dtype (fp8 recipes keep bf16 weights and
# cast inside the GEMMs, which applying a plan does not add); fp32 plans need no policy.
MIXED_PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


# The plan's (pp, dp, cp, tp) mesh with dp split into (replicas, ranks of a replica), replicas
# outer, so both meshes give every rank the same coordinates.
HYBRID_MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def data_parallel_mesh(device_type: str, config: ParallelConfig, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 wraps the dense modules over: every rank holding the same parameters (dp, and
    cp's chunks of the sequence), flattened to one axis; under hybrid sharding two axes, the
    replicas and the shard group (`HYBRID_MESH_AXES`). `mesh` is the plan's (pp, dp, cp, tp) mesh."""
    if config.dp_replicate == 1:
        return mesh["dp", "cp"]._flatten("dp_cp") if config.cp > 1 else mesh["dp"]
    shape = (config.pp, config.dp_replicate, config.dp // config.dp_replicate, config.cp, config.tp)
    hybrid = init_device_mesh(device_type, shape, mesh_dim_names=HYBRID_MESH_AXES)
    if config.cp == 1:
        return hybrid["dp_replicate", "dp_shard"]
    hybrid["dp_shard", "cp"]._flatten("dp_shard_cp")
    return hybrid["dp_replicate", "dp_shard_cp"]


def mixed_precision_policy(dtype: str) -> MixedPrecisionPolicy | None:
    """FSDP2 mixed precision of a plan's training dtype (its parameter dtype, fp32 gradient
    reduction: the states the cost model prices); None for fp32, which trains as built."""
    if dtype not in MIXED_PARAM_DTYPES:
        return None
    return MixedPrecisionPolicy(param_dtype=MIXED_PARAM_DTYPES[dtype], reduce_dtype=torch.float32)


def apply_data_parallel(root: nn.Module, units: list[nn.Module], dp_mesh: DeviceMesh, zero: int,
                        mp_policy: MixedPrecisionPolicy | None = None, offload: bool = False,
                        experts: list[nn.Module] = (), edp_mesh: DeviceMesh | None = None) -> None:
    """Wraps each unit, then `root`, for data parallelism over `dp_mesh` at ZeRO stage `zero`.

    Args:
        root: the local module (whole model or one pipeline chunk).
        units: modules inside `root`, each its own FSDP unit (those without parameters are skipped).
        dp_mesh: the data-parallel mesh (`data_parallel_mesh`).
        zero: ZeRO stage 0-3 (see the module docstring for what each maps to).
        mp_policy: FSDP2 mixed precision (parameter and reduction dtypes); none keeps the model's dtype.
        offload: keep optimizer states (and the sharded parameters and gradients) in host memory.
        experts: expert-parallel expert modules (`expert_parallel`), wrapped first, over `edp_mesh`,
            their gradients divided by the whole dp group.
        edp_mesh: the expert-data-parallel mesh, with `experts`.
    """
    policy = mp_policy or MixedPrecisionPolicy()
    for module in experts:
        wrapped = _wrap(module, edp_mesh, zero, policy, offload)
        wrapped.set_gradient_divide_factor(float(dp_mesh.size()))
        if (zero or offload) and edp_mesh.size() > 1 and edp_mesh.device_type == "cpu":
            # a sharded reduction by another divisor than its group's size is a pre-multiplied sum, which gloo lacks
            wrapped.set_force_sum_reduction_for_comms(True)
    for module in [unit for unit in units if any(True for _ in unit.parameters())] + [root]:
        _wrap(module, dp_mesh, zero, policy, offload)


def _wrap(module: nn.Module, mesh: DeviceMesh, zero: int, policy: MixedPrecisionPolicy, offload: bool) -> nn.Module:
    if zero == 0 and not offload:
        return replicate(module, mesh=mesh, mp_policy=policy)
    offload_policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    return fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=policy,
                       offload_policy=offload_policy)
