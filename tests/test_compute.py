"""Op times on hand-built devices; every expected number is derived in the comments."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, strategies as st

from costmodel.compute import (
    ATTENTION_BWD_EFFICIENCY_RATIO,
    ATTENTION_FWD_EFFICIENCY_RATIO,
    FP8_CAST_TRAFFIC_RATIO,
    FP8_MATMUL_EFFICIENCY_RATIO,
    LAUNCH_OVERHEAD_S,
    OpWork,
    WorkKind,
    layer_time_s,
    matmul_efficiency,
    op_time_s,
)
from costmodel.errors import ProfileError
from costmodel.hardware import DeviceSpec, LinkTier
from costmodel.op_table import OpTable
from costmodel.profile_files import list_devices
from costmodel.profile_loader import load_device

LINK = LinkTier("test-link", "nvswitch", bw_bytes_per_s=400e9, latency_s=1e-6)
NIC = LinkTier("test-nic", "ib", bw_bytes_per_s=50e9, latency_s=5e-6)
# Efficiency 0.5 at 1 GFLOP rising to 0.9 at 100 GFLOP (a power law of FLOPs in between).
DEVICE = DeviceSpec(name="test-gpu", peak_flops_per_s={"bf16": 1e15, "fp32": 5e14}, mem_bytes=80e9,
                    mem_bw_bytes_per_s=2.5e12, mem_bw_efficiency=0.8, devices_per_node=8, intra_link=LINK,
                    nic=NIC, matmul_efficiency=((1e9, 0.5), (1e11, 0.9)))
# Flat efficiency 1 and full memory bandwidth 2e12 B/s: ridge at 1e15 / 2e12 = 500 FLOP/byte.
IDEAL = dataclasses.replace(DEVICE, name="ideal-gpu", mem_bw_bytes_per_s=2e12, mem_bw_efficiency=1.0,
                            matmul_efficiency=((1.0, 1.0),))


@pytest.mark.parametrize(("intensity", "expected_s"), [
    (250.0, 4e9 / 2e12),    # 1e12 FLOPs, 4e9 bytes: memory 2e-3 s > compute 1e-3 s
    (500.0, 1e-3),          # the ridge: both 1e-3 s
    (1000.0, 1e-3),         # 1e9 bytes take 5e-4 s < compute 1e-3 s
    (1e6, 1e-3),
])
def test_roofline_switches_at_ridge(intensity, expected_s):
    work = OpWork(WorkKind.MATMUL, flops=1e12, bytes=1e12 / intensity)
    assert op_time_s(work, IDEAL) == pytest.approx(expected_s + LAUNCH_OVERHEAD_S)


@given(st.floats(1.0, 1e4))
def test_roofline_flat_above_and_linear_below_ridge(intensity):
    t = op_time_s(OpWork(WorkKind.MATMUL, flops=1e12, bytes=1e12 / intensity), IDEAL) - LAUNCH_OVERHEAD_S
    if intensity >= 500:
        assert t == pytest.approx(1e-3)
    else:
        assert t == pytest.approx(1e-3 * 500 / intensity)


@pytest.mark.parametrize(("flops", "expected"), [
    (1e9, 0.5), (1e11, 0.9),          # the curve points exactly
    (1e10, (0.5 * 0.9) ** 0.5),       # log10 midpoint -> geometric mean (a power law between points)
    (1e8, 0.5), (1e13, 0.9), (0.0, 0.5),   # clamped outside
])
def test_efficiency_interpolation(flops, expected):
    assert matmul_efficiency(DEVICE, flops) == pytest.approx(expected)


def test_default_curve_when_device_has_none():
    # DEFAULT_MATMUL_EFFICIENCY_CURVE (Calculon A100): 0.6 at 1e9, 0.9 at 16e9; 4e9 is the log midpoint.
    bare = dataclasses.replace(DEVICE, matmul_efficiency=())
    assert matmul_efficiency(bare, 16e9) == pytest.approx(0.9)
    assert matmul_efficiency(bare, 4e9) == pytest.approx((0.6 * 0.9) ** 0.5)


@given(st.lists(st.floats(1.0, 1e15, allow_nan=False), min_size=2, max_size=2))
def test_efficiency_monotone(flops_pair):
    small, large = sorted(flops_pair)
    assert matmul_efficiency(DEVICE, small) <= matmul_efficiency(DEVICE, large)


@pytest.mark.parametrize("name", list_devices())
def test_a_bigger_matmul_never_takes_less_time(name):
    # Between curve points the efficiency is a power law of FLOPs, so a GEMM's time cannot fall
    # where the curve's own points do not (every built-in curve's time rises point to point).
    device = load_device(name)
    for dtype in device.peak_flops_per_s:
        sizes = np.logspace(3, 15, 601)
        times = [op_time_s(OpWork(WorkKind.MATMUL, flops, 0.0), device, dtype) for flops in sizes]
        assert all(b >= a for a, b in zip(times, times[1:])), (name, dtype)


def test_matmul_uses_efficiency_and_dtype_peak():
    # 1e10 FLOPs at efficiency sqrt(0.5 * 0.9): bf16 1e10 / (1e15 * that); fp32 peak is half -> twice the time.
    work = OpWork(WorkKind.MATMUL, flops=1e10, bytes=1e6)
    efficiency = (0.5 * 0.9) ** 0.5
    assert op_time_s(work, DEVICE) == pytest.approx(1e10 / (1e15 * efficiency) + LAUNCH_OVERHEAD_S)
    assert op_time_s(work, DEVICE, "fp32") == pytest.approx(2e10 / (1e15 * efficiency) + LAUNCH_OVERHEAD_S)


FP8_DEVICE = dataclasses.replace(DEVICE, name="fp8-gpu", peak_flops_per_s={"bf16": 1e15, "fp8": 2e15})


def test_fp8_gemm_runs_at_fp8_peak_and_pays_its_cast():
    # 2e10 FLOPs at the fp8 peak 2e15 last as long as 1e10 FLOPs at the bf16 peak, where the curve
    # gives sqrt(0.5 * 0.9); fp8 reaches FP8_MATMUL_EFFICIENCY_RATIO of that. The cast moves 2.5 x 1e6 bytes at
    # 2.5e12 * 0.8 = 2e12 B/s, one more kernel.
    work = OpWork(WorkKind.MATMUL, flops=2e10, bytes=1e6)
    gemm_s = 2e10 / (2e15 * (0.5 * 0.9) ** 0.5 * FP8_MATMUL_EFFICIENCY_RATIO) + LAUNCH_OVERHEAD_S
    cast_s = FP8_CAST_TRAFFIC_RATIO * 1e6 / 2e12 + LAUNCH_OVERHEAD_S
    assert op_time_s(work, FP8_DEVICE, "fp8") == pytest.approx(gemm_s + cast_s)
    assert op_time_s(work, FP8_DEVICE, "fp8") < op_time_s(work, FP8_DEVICE, "bf16")


@pytest.mark.parametrize("kind", [WorkKind.ATTENTION, WorkKind.ATTENTION_BWD, WorkKind.MEMORY])
def test_fp8_leaves_attention_and_memory_ops_in_bf16(kind):
    work = OpWork(kind, flops=1e11, bytes=1e8)
    assert op_time_s(work, FP8_DEVICE, "fp8") == op_time_s(work, FP8_DEVICE, "bf16")


@pytest.mark.parametrize(("kind", "ratio"), [
    (WorkKind.ATTENTION, ATTENTION_FWD_EFFICIENCY_RATIO),
    (WorkKind.ATTENTION_BWD, ATTENTION_BWD_EFFICIENCY_RATIO),
])
def test_attention_is_a_slower_matmul(kind, ratio):
    # Same 1e11 FLOPs (efficiency 0.9): 1e11 / (1e15 * 0.9 * ratio).
    t = op_time_s(OpWork(kind, flops=1e11, bytes=1e6), DEVICE)
    assert t == pytest.approx(1e11 / (1e15 * 0.9 * ratio) + LAUNCH_OVERHEAD_S)
    assert ATTENTION_BWD_EFFICIENCY_RATIO < ATTENTION_FWD_EFFICIENCY_RATIO < 1


@pytest.mark.parametrize(("kind", "ratio", "device_fraction"), [
    (WorkKind.FLASH2_ATTENTION, ATTENTION_FWD_EFFICIENCY_RATIO, 0.5),
    (WorkKind.FLASH2_ATTENTION_BWD, ATTENTION_BWD_EFFICIENCY_RATIO, 0.25),
])
def test_flash2_attention_runs_at_the_devices_fraction_of_flash(kind, ratio, device_fraction):
    # A device whose FlashAttention-2 reaches 0.5 of its flash forward and 0.25 of its backward:
    # 1e11 / (1e15 * 0.9 * ratio * fraction). Where FlashAttention-2 is the flash kernel (the
    # default (1, 1)), both price the same.
    slower = dataclasses.replace(DEVICE, flash2_attention_ratio=(0.5, 0.25))
    work = OpWork(kind, flops=1e11, bytes=1e6)
    assert op_time_s(work, slower) == pytest.approx(1e11 / (1e15 * 0.9 * ratio * device_fraction) + LAUNCH_OVERHEAD_S)
    flash = OpWork(WorkKind.ATTENTION if kind is WorkKind.FLASH2_ATTENTION else WorkKind.ATTENTION_BWD, 1e11, 1e6)
    assert op_time_s(work, DEVICE) == op_time_s(flash, DEVICE) == op_time_s(flash, slower)


@pytest.mark.parametrize(("flash1", "flash2"), [
    (WorkKind.FLASH1_ATTENTION, WorkKind.FLASH2_ATTENTION),
    (WorkKind.FLASH1_ATTENTION_BWD, WorkKind.FLASH2_ATTENTION_BWD),
])
def test_the_first_flash_attention_runs_at_half_of_flash2(flash1, flash2):
    # FlashAttention-2 is "around 2x" faster than the first FlashAttention: the same 1e11 FLOPs take
    # twice FlashAttention-2's compute time, on a device where FlashAttention-2 is the flash kernel
    # and on one where it reaches only a fraction of it.
    for device in (DEVICE, dataclasses.replace(DEVICE, flash2_attention_ratio=(0.5, 0.25))):
        fast, slow = (op_time_s(OpWork(kind, flops=1e11, bytes=1e6), device) - LAUNCH_OVERHEAD_S for kind in (flash2, flash1))
        assert slow == pytest.approx(2 * fast)


def test_hopper_profiles_price_flash2_at_the_measured_fractions():
    # FlashAttention-2 on H100: 329.5 / 631.8 TFLOP/s forward (tritonbench), 322 / 561 backward
    # (FlashAttention-3 paper): 0.52 and 0.57 of the Hopper-native kernels. A100: its own kernel.
    for name in ("h100-sxm", "h100-pcie", "h100-hbm2e", "h800", "h200"):
        assert load_device(name).flash2_attention_ratio == (pytest.approx(329.5 / 631.8, abs=0.005),
                                                            pytest.approx(322 / 561, abs=0.005))
    assert load_device("a100-80g").flash2_attention_ratio == (1.0, 1.0)


def test_memory_kind_is_bandwidth_bound():
    # 1e9 bytes at 2.5e12 * 0.8 = 2e12 B/s = 5e-4 s; its FLOPs do not count.
    assert op_time_s(OpWork(WorkKind.MEMORY, flops=1e13, bytes=1e9), DEVICE) == \
        pytest.approx(5e-4 + LAUNCH_OVERHEAD_S)


def test_launch_overhead_alone_for_empty_op():
    assert op_time_s(OpWork(WorkKind.MATMUL, flops=0.0, bytes=0.0), DEVICE) == LAUNCH_OVERHEAD_S
    assert 4e-6 <= LAUNCH_OVERHEAD_S <= 6e-6


def test_layer_time_is_sum_of_ops():
    works = [OpWork(WorkKind.MATMUL, 1e10, 1e6), OpWork(WorkKind.ATTENTION, 1e11, 1e7),
             OpWork(WorkKind.MEMORY, 0.0, 1e9)]
    assert layer_time_s(works, DEVICE) == pytest.approx(sum(op_time_s(w, DEVICE) for w in works))


TABLE = OpTable(device="test-gpu", dtype="bf16", times_s_by_key={"matmul:4096x4096x4096:bf16": 1.23e-3},
                matmul_times_s=((1e9, 1e-5), (1e11, 5e-4)),   # achieved 1e14 and 2e14 FLOP/s
                tp_linear_host_s=(2e-5, 5e-5), sync_wait_fraction=0.1)


def test_table_key_overrides_roofline():
    work = OpWork(WorkKind.MATMUL, flops=2 * 4096**3, bytes=3 * 2 * 4096**2, key="matmul:4096x4096x4096:bf16")
    assert op_time_s(work, DEVICE, table=TABLE) == 1.23e-3
    assert op_time_s(work, DEVICE) != pytest.approx(1.23e-3)


@pytest.mark.parametrize(("flops", "expected_s"), [
    (1e10, 1e10 / (1e14 * 2e14) ** 0.5),   # log10 midpoint: the geometric mean of the achieved rates
    (1e11, 5e-4),            # a measured point
    (1e12, 1e12 / 2e14),     # beyond the largest: its rate
])
def test_table_interpolates_matmul_rate(flops, expected_s):
    assert op_time_s(OpWork(WorkKind.MATMUL, flops, 1e6), DEVICE, table=TABLE) == pytest.approx(expected_s)


def test_table_misses_fall_back_to_roofline():
    work = OpWork(WorkKind.MEMORY, 0.0, 1e9, key="unmeasured")
    assert TABLE.lookup(work) is None
    assert op_time_s(work, DEVICE, table=TABLE) == op_time_s(work, DEVICE)


def test_table_round_trip():
    assert OpTable.from_dict(TABLE.to_dict()) == TABLE


@pytest.mark.parametrize("data", [
    {"dtype": "bf16"},
    {"device": "x", "dtype": "bf16", "matmul_times_s": [{"flops": 1e9}]},
    {"device": "x", "dtype": "bf16", "times_s_by_key": {"k": -1.0}},
    {"device": "x", "dtype": "bf16", "matmul_times_s": [{"flops": 1e10, "time_s": 1.0}, {"flops": 1e9, "time_s": 1.0}]},
    {"device": "x", "dtype": "bf16", "elementwise_bytes_per_s": {"gelu": 0.0}},
    {"device": "x", "dtype": "bf16", "tp_linear_host_s": [1e-4]},
    {"device": "x", "dtype": "bf16", "tp_linear_host_s": [-1e-4, 1e-4]},
    {"device": "x", "dtype": "bf16", "sync_wait_fraction": -0.1},
    {"device": "x", "dtype": "bf16", "sync_wait_fraction": "nan"},
    # An older profile's whole-call attention times would price per-head attention batch x heads too slow.
    {"device": "x", "dtype": "bf16", "attention_times_s": [{"flops": 1e9, "fwd_s": 1e-3, "bwd_s": 2e-3}]},
])
def test_bad_table_is_rejected(data):
    with pytest.raises(ProfileError):
        OpTable.from_dict(data)


def test_table_from_another_device_is_rejected():
    with pytest.raises(ProfileError, match="measured on test-gpu/bf16 but is used for ideal-gpu/bf16"):
        op_time_s(OpWork(WorkKind.MATMUL, 1e9, 1e6), IDEAL, table=TABLE)


def test_unknown_dtype_names_device_and_choices():
    with pytest.raises(ProfileError, match=r"test-gpu .*'fp8'.*available: bf16, fp32"):
        op_time_s(OpWork(WorkKind.MATMUL, 1e9, 1e6), DEVICE, "fp8")


@pytest.mark.parametrize("curve", [((1e11, 0.9), (1e9, 0.5)), ((1e9, 1.5),), ((0.0, 0.5),)])
def test_bad_efficiency_curve_is_rejected(curve):
    with pytest.raises(ProfileError, match="matmul_efficiency"):
        matmul_efficiency(dataclasses.replace(DEVICE, name=f"bad-{curve}", matmul_efficiency=curve), 1e9)


def test_negative_work_is_rejected():
    with pytest.raises(ValueError, match="flops and bytes must be >= 0"):
        OpWork(WorkKind.MATMUL, flops=-1.0, bytes=0.0)
