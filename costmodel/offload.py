"""Optimizer offload (ZeRO-Offload, Ren et al. 2021): the step's extra time.

With the optimizer offloaded, each device copies its gradient shard to the host (bf16), the CPU
runs Adam over the fp32 master weights and moments in host memory, and the updated bf16 weights
come back (fp32 training moves fp32 gradients and weights, and its Adam has no master copy).
Memory on the device drops by the optimizer states (`costmodel.memory`,
`Optimizer.ADAM_MIXED_OFFLOAD`); this module prices the copies and the CPU update. Both are
counted as exposed: the update needs every gradient and the next forward needs the weights.
"""
from __future__ import annotations

# Host link of one device: PCIe Gen4 x16 carries 32 GB/s per direction; pinned-memory copies
# reach about 25 GB/s (CUDA samples' bandwidthTest on A100 hosts).
HOST_LINK_BYTES_PER_S = 25e9

# Host memory bandwidth available to the CPU update of one device's shard: a dual-socket server
# with 16 channels of DDR4-3200 has 409.6 GB/s for 8 GPUs (51 GB/s each); a streaming CPU Adam
# reaches about half of it.
HOST_MEMORY_BYTES_PER_S = 25e9

# Host-memory bytes per parameter whose offloaded states a device owns: FSDP2's CPUOffloadPolicy
# (what `Plan.apply` runs) keeps the fp32 parameter shard (4), its fp32 gradient (4) and AdamW's two
# fp32 moments (8) in host memory. ZeRO-Offload's (Ren et al. 2021, §4) fp32 master weights,
# moments and gradients take the same 16 B. A frozen parameter keeps only its fp32 shard (4).
HOST_STATE_BYTES_PER_PARAM = 16
FROZEN_HOST_STATE_BYTES_PER_PARAM = 4

# Host-link copies per parameter: the gradient down and the updated working weight back up, each
# at the working weight's size (2 B in mixed precision).
HOST_LINK_COPIES_PER_PARAM = 2

# Host-memory bytes of the CPU Adam update per parameter: read fp32 master, two moments and the
# gradient (16 B, the gradient upcast from bf16), write master and moments (12 B) and the bf16
# weight copy (2 B).
CPU_ADAM_BYTES_PER_PARAM = 30


def offload_step_s(params: float, weight_bytes: float = 2.0, adam_bytes_per_param: float = CPU_ADAM_BYTES_PER_PARAM,
                   host_link_bytes_per_s: float = HOST_LINK_BYTES_PER_S,
                   host_memory_bytes_per_s: float = HOST_MEMORY_BYTES_PER_S) -> float:
    """Seconds one device spends per step on an offloaded optimizer over `params` parameters.

    Args:
        params: parameters whose optimizer states this device owns (its ZeRO shard).
        weight_bytes: bytes of one working weight (and gradient) crossing the host link.
        adam_bytes_per_param: host-memory bytes of the CPU update per parameter.
        host_link_bytes_per_s: device <-> host bandwidth.
        host_memory_bytes_per_s: host memory bandwidth the CPU update of this shard gets.

    Example::

        >>> round(offload_step_s(1e9), 2)  # 4 GB over 25 GB/s + 30 GB over 25 GB/s
        1.36
    """
    if params < 0:
        raise ValueError(f"params={params}: must be >= 0")
    return (params * HOST_LINK_COPIES_PER_PARAM * weight_bytes / host_link_bytes_per_s
            + params * adam_bytes_per_param / host_memory_bytes_per_s)


def host_state_bytes(trainable_params: float, frozen_params: float = 0.0) -> float:
    """Host-memory bytes of one device's offloaded states: `trainable_params` and `frozen_params`
    are the parameters of its shard (HOST_STATE_BYTES_PER_PARAM).

    Example::

        >>> host_state_bytes(1e9) / 1e9
        16.0
    """
    if trainable_params < 0 or frozen_params < 0:
        raise ValueError(f"params=({trainable_params}, {frozen_params}): must be >= 0")
    return trainable_params * HOST_STATE_BYTES_PER_PARAM + frozen_params * FROZEN_HOST_STATE_BYTES_PER_PARAM

