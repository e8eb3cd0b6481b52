"""Time of one op on one device: a roofline with a size-dependent matmul efficiency, or a measured table.

An op is reduced to `OpWork`: its kind, FLOPs and device-memory bytes. Its time is

    max(flops / (peak[dtype] * efficiency), bytes / (mem_bw * mem_bw_efficiency)) + LAUNCH_OVERHEAD_S

where `efficiency` is the device's matmul efficiency curve at the op's FLOPs (scaled for attention),
and memory-kind ops (elementwise, norms, embedding lookups) have no compute term. Under fp8 only the
matmuls run in fp8, each with the cast of its operand; the rest runs in bf16 (`GEMM_ONLY_DTYPES`).
An `OpTable` (`costmodel.op_table`) of measured times, when given, overrides the roofline for the ops it
covers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import TYPE_CHECKING

from costmodel.curves import interp_log_log, log_curve
from costmodel.errors import ProfileError
from costmodel.hardware import DeviceSpec

if TYPE_CHECKING:  # costmodel.op_table builds on OpWork
    from costmodel.op_table import OpTable

# Per-kernel launch cost added to every op. Eager PyTorch pays the CUDA kernel launch path on every
# op; the commonly quoted end-to-end figure is about 4-6 us per launch (NVIDIA developer blog
# "Getting Started with CUDA Graphs", 2019, measures launch-bound kernels at several us each).
# We take the middle of that range. Charging it on every op is conservative: asynchronous launches
# hide it whenever the GPU is busy. A measured `OpTable` replaces it for the ops it covers.
LAUNCH_OVERHEAD_S = 5e-6

# Matmul efficiency curve used when a device profile has none: (op FLOPs, fraction of peak).
# Source: Calculon (calculon-ai/calculon, systems/a100_80g.json, matrix.gflops_efficiency.float16):
# >=1 GFLOP 0.60, >=16 GFLOP 0.90, >=128 GFLOP 0.95. Calculon steps between thresholds; we
# interpolate as a power law between the points and clamp outside them.
DEFAULT_MATMUL_EFFICIENCY_CURVE: tuple[tuple[float, float], ...] = (
    (1e9, 0.60),
    (16e9, 0.90),
    (128e9, 0.95),
)

# Flash attention reaches a lower fraction of peak than a GEMM of the same FLOPs. FlashAttention-2
# (Dao 2023, arXiv 2307.08691) reports up to 73% of A100 peak in the forward pass and up to 63% in
# the backward pass, against the 80-90% that optimised GEMMs reach (midpoint 85%). Ratios to the
# matmul efficiency at the same FLOPs: forward 0.73 / 0.85 = 0.86, backward 0.63 / 0.85 = 0.74.
ATTENTION_FWD_EFFICIENCY_RATIO = 0.86
ATTENTION_BWD_EFFICIENCY_RATIO = 0.74

# What those rates count, as FlashAttention's benchmarks count it (flash-attention
# benchmarks/benchmark_flash_attention.py, `flops`): the backward does 2.5 times the forward's
# FLOPs (five s x s x d products: the scores recomputed, dV, dP, dQ and dK, against the forward's
# two), and a causal mask halves both, since the kernels skip the score blocks above the diagonal
# (the diagonal blocks, computed whole, are in the measured rates).
ATTENTION_BWD_WORK_RATIO = 2.5
CAUSAL_WORK_FRACTION = 0.5

# The first FlashAttention's kernels (flash-attn 1.x and its Triton port, which MosaicML's MPT code
# ran as `attn_impl: triton`) reach about half of FlashAttention-2's rates: FlashAttention-2 is
# "around 2x" faster (Dao 2023, arXiv 2307.08691, abstract; Section 4.1: 1.7-3.0x FlashAttention,
# 1.3-2.5x its Triton version on A100).
FLASH1_TO_FLASH2_RATE = 0.5

# Float8 training (torchao's Float8Linear, NVIDIA Transformer Engine) runs the GEMMs of the linear
# layers in fp8 and everything else (attention, norms, elementwise, communication buffers) in the
# base dtype named here. Matmul works are not told apart further: the score GEMMs of unfused
# attention, rare beside fp8 training, are priced in fp8 too.
GEMM_ONLY_DTYPES = {"fp8": "bf16"}

# fp8 GEMMs reach a lower fraction of their peak than bf16 GEMMs on the same device: H100 SXM MAMF
# fp8 1402.6 / 1978.9 = 0.709 of peak against bf16 794.5 / 989.4 = 0.803 (stas00/ml-engineering
# compute/accelerator MAMF tables), a ratio of 0.883 applied to the device's bf16 curve.
FP8_MATMUL_EFFICIENCY_RATIO = 0.883

# Dynamic tensorwise scaling of each fp8 GEMM operand: one pass reads the bf16 tensor for its amax
# (2 B per element), the cast reads it again and writes fp8 (3 B): 5 B per element, 2.5 times the
# operand's bf16 bytes. One activation-sized operand is cast per GEMM (the input in the forward, the
# output gradient in the backward), taken to be the size of the GEMM's output; weights are small
# beside activations at training batch sizes and are not counted.
FP8_CAST_TRAFFIC_RATIO = 2.5

# Memory-bound ops read their inputs and write their output; a backward elementwise op reads the
# output gradient and the saved input and writes the input gradient: twice the forward traffic.
MEMORY_BWD_TRAFFIC_RATIO = 2.0

# Distinct (work, device, dtype) prices kept by the roofline cache; a search over thousands of
# configs touches a few thousand distinct ops.
_CACHE_SIZE = 1 << 16


class WorkKind(StrEnum):
    """How an op uses the device.

    MATMUL: GEMM on the tensor cores. ATTENTION / ATTENTION_BWD: fused (flash) attention forward /
    backward, priced as a matmul at a lower efficiency; callers give forward and backward FLOPs as
    separate works. FLASH2_ATTENTION / FLASH2_ATTENTION_BWD: the same run by FlashAttention-2's
    kernels, at the device's `flash2_attention_ratio` of those rates (below 1 where the device has
    newer attention kernels than FlashAttention-2 uses, as Hopper has). FLASH1_ATTENTION /
    FLASH1_ATTENTION_BWD: the same run by the first FlashAttention's kernels, at
    FLASH1_TO_FLASH2_RATE of FlashAttention-2's. MEMORY: elementwise, norm, embedding lookup: bound
    by memory bandwidth. LOSS: a loss over the logits, priced as MEMORY unless an op table measured
    it (on CPUs cross-entropy's exp and log over every logit, not the bytes, set its time).
    """

    MATMUL = "matmul"
    ATTENTION = "attention"
    ATTENTION_BWD = "attention_bwd"
    FLASH2_ATTENTION = "flash2_attention"
    FLASH2_ATTENTION_BWD = "flash2_attention_bwd"
    FLASH1_ATTENTION = "flash1_attention"
    FLASH1_ATTENTION_BWD = "flash1_attention_bwd"
    MEMORY = "memory"
    LOSS = "loss"


_EFFICIENCY_RATIO = {
    WorkKind.MATMUL: 1.0,
    WorkKind.ATTENTION: ATTENTION_FWD_EFFICIENCY_RATIO,
    WorkKind.ATTENTION_BWD: ATTENTION_BWD_EFFICIENCY_RATIO,
    WorkKind.FLASH2_ATTENTION: ATTENTION_FWD_EFFICIENCY_RATIO,
    WorkKind.FLASH2_ATTENTION_BWD: ATTENTION_BWD_EFFICIENCY_RATIO,
    WorkKind.FLASH1_ATTENTION: ATTENTION_FWD_EFFICIENCY_RATIO,
    WorkKind.FLASH1_ATTENTION_BWD: ATTENTION_BWD_EFFICIENCY_RATIO,
}

# What the works of named flash kernels are, where a measured op table has timed the machine's
# attention kernel.
FLASH_MEASURED_AS = {WorkKind.FLASH2_ATTENTION: WorkKind.ATTENTION, WorkKind.FLASH2_ATTENTION_BWD: WorkKind.ATTENTION_BWD,
                     WorkKind.FLASH1_ATTENTION: WorkKind.ATTENTION, WorkKind.FLASH1_ATTENTION_BWD: WorkKind.ATTENTION_BWD}

# Which of `flash2_attention_ratio`'s (forward, backward) sets the rate of each named flash kernel's work.
_FLASH2_RATIO_INDEX = {WorkKind.FLASH2_ATTENTION: 0, WorkKind.FLASH2_ATTENTION_BWD: 1,
                       WorkKind.FLASH1_ATTENTION: 0, WorkKind.FLASH1_ATTENTION_BWD: 1}


def kernel_fraction(kind: WorkKind, device: DeviceSpec) -> float:
    """The fraction of the device's rate for `kind` that its kernels reach: the device's
    `flash2_attention_ratio` (forward, backward) for FlashAttention-2 works, FLASH1_TO_FLASH2_RATE of
    that for the first FlashAttention's, else 1."""
    if kind not in _FLASH2_RATIO_INDEX:
        return 1.0
    fraction = device.flash2_attention_ratio[_FLASH2_RATIO_INDEX[kind]]
    first_generation = kind in (WorkKind.FLASH1_ATTENTION, WorkKind.FLASH1_ATTENTION_BWD)
    return fraction * FLASH1_TO_FLASH2_RATE if first_generation else fraction


@dataclass(frozen=True)
class OpWork:
    """The work of one op, hardware-free.

    Attributes:
        kind: how the op uses the device.
        flops: FLOPs of the op.
        bytes: bytes read plus written from device memory.
        key: optional identity for a measured-table lookup: an exact work ("matmul:4096x4096x4096:bf16",
            `OpTable.times_s_by_key`) or an elementwise op's name ("gelu_tanh"; "gelu_tanh:bwd" for its
            backward, `OpTable.elementwise_bytes_per_s`).
        unit_flops: FLOPs of one independent unit of the op whose size sets its kernel's efficiency
            (attention: one head of one sequence, whatever the batch and head count); 0 means the
            whole op.
    """

    kind: WorkKind
    flops: float
    bytes: float
    key: str = ""
    unit_flops: float = 0.0

    def __post_init__(self) -> None:
        if self.flops < 0 or self.bytes < 0:
            raise ValueError(f"OpWork {self.key or self.kind}: flops and bytes must be >= 0, "
                             f"got flops={self.flops}, bytes={self.bytes}")


def peak_flops_per_s(device: DeviceSpec, dtype: str) -> float:
    """Dense peak of `device` for `dtype`.

    Raises:
        ProfileError: the device profile has no peak for that dtype.
    """
    try:
        return device.peak_flops_per_s[dtype]
    except KeyError:
        available = ", ".join(sorted(device.peak_flops_per_s)) or "none"
        raise ProfileError(f"device {device.name} has no peak_flops_per_s for dtype '{dtype}' "
                           f"(available: {available}); pick one of those or add it to the profile") from None


@lru_cache(maxsize=256)
def _checked_efficiency_curve(curve: tuple[tuple[float, float], ...],
                              device_name: str) -> tuple[tuple[float, float], ...]:
    """Returns `curve` after checking that its sizes ascend and its efficiencies lie in (0, 1]."""
    log_curve(curve, f"device {device_name} matmul_efficiency")
    for _, efficiency in curve:
        if not 0 < efficiency <= 1:
            raise ProfileError(f"device {device_name}: matmul_efficiency values must be in (0, 1], got {efficiency}")
    return curve


def _device_curve(device: DeviceSpec) -> tuple[tuple[float, float], ...]:
    """The device's validated efficiency curve, or DEFAULT_MATMUL_EFFICIENCY_CURVE when it has none."""
    return _checked_efficiency_curve(device.matmul_efficiency or DEFAULT_MATMUL_EFFICIENCY_CURVE, device.name)


def matmul_efficiency(device: DeviceSpec, flops: float) -> float:
    """Achievable fraction of peak for a GEMM of `flops` FLOPs on `device`.

    Interpolates `device.matmul_efficiency` as a power law of flops and clamps at its end points;
    uses DEFAULT_MATMUL_EFFICIENCY_CURVE when the device has no curve.

    Raises:
        ProfileError: the curve is empty, has a size <= 0, is not strictly ascending, or has an
            efficiency outside (0, 1].
    """
    return device.matmul_sustained_fraction * interp_log_log(flops, _device_curve(device), f"device {device.name} matmul_efficiency")


@lru_cache(maxsize=_CACHE_SIZE)
def _roofline_time_s(work: OpWork, device_name: str, peak_flops_per_s: float, mem_bytes_per_s: float,
                     curve: tuple[tuple[float, float], ...], sustained: float) -> float:
    """Roofline time of `work`; every argument that changes the answer is part of the cache key."""
    compute_s = 0.0
    if work.kind is not WorkKind.MEMORY and work.flops > 0:
        efficiency = sustained * interp_log_log(work.flops, curve, f"device {device_name} matmul_efficiency")
        compute_s = work.flops / (peak_flops_per_s * efficiency * _EFFICIENCY_RATIO[work.kind])
    return max(compute_s, work.bytes / mem_bytes_per_s) + LAUNCH_OVERHEAD_S


def _check_table(table: OpTable, device: DeviceSpec, dtype: str) -> None:
    if (table.device, table.dtype) != (device.name, dtype):
        raise ProfileError(f"op table was measured on {table.device}/{table.dtype} but is used for "
                           f"{device.name}/{dtype}; pass the table measured on that device and dtype")


def op_time_s(work: OpWork, device: DeviceSpec, dtype: str = "bf16", table: OpTable | None = None) -> float:
    """Time of one op on one device in seconds.

    Args:
        work: the op's kind, FLOPs and bytes.
        device: the device it runs on.
        dtype: compute dtype, a key of `device.peak_flops_per_s`.
        table: measured times for this device and dtype; they win over the roofline where they apply.

    Returns:
        The measured time when `table` covers the op, else the roofline time plus LAUNCH_OVERHEAD_S.

    Raises:
        ProfileError: unknown dtype, a malformed efficiency curve, or a table from another device/dtype.
    """
    return layer_time_s((work,), device, dtype, table)


def base_dtype(dtype: str) -> str:
    """The dtype of everything but the linear layers' GEMMs: bf16 under fp8 training, else `dtype`."""
    return GEMM_ONLY_DTYPES.get(dtype, dtype)


def bytes_per_element(dtype: str) -> int:
    """Bytes of one element of `dtype`."""
    return {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}[dtype]


def layer_time_s(works: Sequence[OpWork], device: DeviceSpec, dtype: str = "bf16",
                 table: OpTable | None = None, cast_traffic_ratio: float = FP8_CAST_TRAFFIC_RATIO) -> float:
    """Sum of `op_time_s` over `works`, resolving the device's rates once (the search's hot path).

    Under fp8 (`GEMM_ONLY_DTYPES`) matmul works run at the fp8 peak, at FP8_MATMUL_EFFICIENCY_RATIO of
    the curve taken at the FLOPs that last as long at the base peak (the curve's saturation is a matter
    of time), and each pays the cast of one operand (`cast_traffic_ratio` times its bf16 bytes,
    FP8_CAST_TRAFFIC_RATIO when the cast runs as its own passes); attention runs in the base dtype.

    Raises:
        ProfileError: as `op_time_s`.
    """
    peak = peak_flops_per_s(device, dtype)
    mem_bytes_per_s = device.mem_bw_bytes_per_s * device.mem_bw_efficiency
    curve = _device_curve(device)
    if table is not None:
        _check_table(table, device, dtype)
    base = base_dtype(dtype)
    base_peak = peak_flops_per_s(device, base) if base != dtype else peak
    total_s = 0.0
    for work in works:
        op_s = table.lookup(work) if table is not None else None
        if op_s is None and base != dtype and work.kind is WorkKind.MATMUL:
            gemm = OpWork(work.kind, work.flops * base_peak / peak, work.bytes, work.key)
            op_s = (_roofline_time_s(gemm, device.name, base_peak, mem_bytes_per_s, curve,
                                     device.matmul_sustained_fraction * FP8_MATMUL_EFFICIENCY_RATIO)
                    + _roofline_time_s(OpWork(WorkKind.MEMORY, 0.0, cast_traffic_ratio * work.bytes), device.name,
                                       peak, mem_bytes_per_s, curve, device.matmul_sustained_fraction))
        elif op_s is None:
            op_s = _roofline_time_s(work, device.name, base_peak, mem_bytes_per_s, curve,
                                    device.matmul_sustained_fraction * kernel_fraction(work.kind, device))
        total_s += op_s
    return total_s
