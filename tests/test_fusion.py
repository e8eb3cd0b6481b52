"""planner.fusion: fused elementwise kernels priced by the bytes that cross their boundary.

Expected bytes are counted by hand from the op graph (each tensor a kernel reads from outside once,
each output used outside once), never from the roofline's constants.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

import cli
from costmodel.compute import MEMORY_BWD_TRAFFIC_RATIO, OpWork, WorkKind, layer_time_s
from costmodel.profile_loader import load_cluster, load_device
from planner.api import make_config
from planner.errors import PlannerError
from planner.estimate import Evaluator
from planner.fusion import FUSIBLE_KINDS, ElementwiseKernels, fused_regions, fused_works
from planner.graph import Op, OpKind
from planner.op_works import op_time_s
from planner.op_kinds import VIEW_TARGETS
from planner.sweeps.executors import PlanSettings, plan_point
from planner.sweeps.spec import load_sweep_spec
from planner.tracing import trace
from planner.training_code import TrainingCode
from planner.zoo.spec import parse_spec

SEQ, BATCH, HIDDEN, FFN, KV_HEADS, HEADS = 128, 2, 256, 768, 2, 4
BF16 = 2


def _op(name, kind, target, inputs=(), out_bytes=100, flops=0.0):
    return Op(name=name, fqn="", target=target, kind=kind, inputs=inputs, out_shape=(1,), out_bytes=out_bytes,
              fwd_flops=flops)


# x (from outside the layer) -> linear a -> silu(a) * a -> view -> linear b -> b + x.
CHAIN = (
    _op("a", OpKind.MATMUL, "linear", ("x",), 100, flops=1e6),
    _op("s", OpKind.ELEMENTWISE, "silu", ("a",), 100),
    _op("m", OpKind.ELEMENTWISE, "mul", ("s", "a"), 100),
    _op("v", OpKind.OTHER, "view", ("m",), 100),
    _op("b", OpKind.MATMUL, "linear", ("v",), 50, flops=1e6),
    _op("r", OpKind.ELEMENTWISE, "add", ("b", "x"), 50),
)


def test_a_chain_reads_each_outside_tensor_once_and_writes_only_what_leaves_it():
    regions = sorted(fused_regions(CHAIN), key=lambda region: len(region.members))
    assert [sorted(region.members) for region in regions] == [["r"], ["m", "s", "v"]]
    # silu and mul both read a: one read of 100 B; only the view's output (read by linear b) is written.
    # Eager, the same ops move silu 100 + 100 and mul 200 + 100: 500 B.
    swiglu = regions[1]
    assert sum(size for _, size in swiglu.reads) == 100 and sum(size for _, size in swiglu.writes) == 100
    # The residual add reads b (50 B) and x, from outside the layer, taken at its own output's size
    # (50 B), and writes the layer's output (50 B): what eager moves too.
    add = regions[0]
    assert sum(size for _, size in add.reads) == 100 and sum(size for _, size in add.writes) == 50
    members, fwd, bwd = fused_works(CHAIN, 2.0, lambda op: 1)
    assert members == {"s", "m", "v", "r"}
    assert sorted(work.bytes for work in fwd) == [2 * 150, 2 * 200]
    assert sorted(work.bytes for work in bwd) == [MEMORY_BWD_TRAFFIC_RATIO * 2 * 150, MEMORY_BWD_TRAFFIC_RATIO * 2 * 200]
    # Tensor parallelism dividing every member divides every boundary tensor.
    _, split_fwd, _ = fused_works(CHAIN, 2.0, lambda op: 2)
    assert sorted(work.bytes for work in split_fwd) == [150, 200]


def test_views_alone_make_no_kernel():
    ops = (_op("a", OpKind.MATMUL, "linear", ("x",), 100, flops=1e6), _op("t", OpKind.OTHER, "transpose", ("a",)),
           _op("b", OpKind.MATMUL, "linear", ("t",), 100, flops=1e6))
    assert fused_regions(ops) == ()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    spec = parse_spec({"arch": "llama", "layers": 2, "hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS,
                       "ffn_hidden": FFN, "vocab": 1000, "max_seq_len": SEQ}, "fusion-llama.yaml")
    return trace(spec, seq_len=SEQ, micro_batch=BATCH)


def test_a_llama_block_fuses_every_memory_bound_op_once(llama):
    block = llama.blocks[0]
    regions = fused_regions(block.ops)
    members = [name for region in regions for name in region.members]
    assert len(members) == len(set(members))
    by_name = {op.name: op for op in block.ops}
    assert all(by_name[name].kind in FUSIBLE_KINDS for name in members)
    fusible = {op.name for op in block.ops if op.kind in FUSIBLE_KINDS and op.target not in VIEW_TARGETS}
    assert fusible <= set(members)
    # SwiGLU: one kernel reads the gate and up projections (tokens x ffn each) and writes their
    # product for the down projection.
    tokens_ffn_bytes = SEQ * BATCH * FFN * BF16
    swiglu = next(region for region in regions if any(by_name[name].target == "silu" for name in region.members))
    assert sorted(size for _, size in swiglu.reads) == [tokens_ffn_bytes, tokens_ffn_bytes]
    assert [size for _, size in swiglu.writes] == [tokens_ffn_bytes]


def test_fused_kernels_make_a_step_faster_and_change_nothing_else(llama):
    cluster = load_cluster("h100-sxm:1x8")
    config = {"tp": 2, "pp": 1, "micro_batch": 2, "zero": 1, "recompute": "none"}
    full = make_config(config, cluster.num_devices, 64)
    eager, fused = (Evaluator(llama, cluster, code=TrainingCode.of(elementwise=mode)).estimate(full, 64) for mode in ("eager", "fused"))
    assert fused.time_breakdown["compute_s"] < eager.time_breakdown["compute_s"]
    for key in ("tp_comm_s", "dp_comm_exposed_s", "optimizer_s"):
        assert fused.time_breakdown[key] == pytest.approx(eager.time_breakdown[key])
    assert fused.peak_memory_bytes == eager.peak_memory_bytes


def test_an_unknown_elementwise_mode_is_one_line(llama):
    with pytest.raises(PlannerError, match=r"elementwise='compiled': use one of 'eager', 'fused'"):
        TrainingCode.of(elementwise="compiled")


def test_evaluate_takes_the_elementwise_flag(capsys):
    args = ["evaluate", "--model", "llama2-7b", "--seq-len", "1024", "--cluster", "h100-sxm:1x8", "--global-batch", "16",
            "--tp", "1", "--pp", "1", "--zero", "1", "--recompute", "none", "--json"]
    times = {}
    for mode in ("eager", "fused"):
        assert cli.main([*args, "--elementwise", mode]) == 0
        times[mode] = json.loads(capsys.readouterr().out)["step_time_s"]
    assert times["fused"] < times["eager"]


def test_elementwise_is_a_sweep_setting(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("models: [llama2-7b]\nclusters: [h100-sxm:1x8]\nglobal_batches: [16]\nseq_lens: [1024]\n"
                    "elementwise: fused\n")
    spec = load_sweep_spec(path)
    assert spec.settings == "dtype=bf16 attention=flash elementwise=fused"
    graph = trace("llama2-7b", seq_len=1024)
    point, cluster = spec.points[0], spec.clusters["h100-sxm:1x8"]
    fixed = {"tp": 1, "pp": 1, "micro_batch": 1, "zero": 1, "recompute": "none"}
    eager_row, fused_row = (plan_point(point, graph, cluster, PlanSettings("bf16", TrainingCode.of(elementwise=mode), fixed, ""))
                            for mode in ("eager", "fused"))
    assert fused_row["step_time_s"] < eager_row["step_time_s"]
    path.write_text(path.read_text().replace("fused", "compiled"))
    with pytest.raises(PlannerError, match=r"elementwise: 'compiled': use one of eager, fused"):
        load_sweep_spec(path)


def test_fused_fp8_casts_skip_the_separate_amax_pass():
    # An fp8 GEMM's operand cast moves 2.5 x its bf16 bytes eager (amax read, then read + fp8 write)
    # and 1.5 x fused (the amax inside the producing kernel): one bf16 read less, at memory bandwidth.
    device = load_device("h100-sxm")
    gemm = OpWork(WorkKind.MATMUL, 1e12, 64 * 2**20)
    eager, fused = (layer_time_s([gemm], device, "fp8", cast_traffic_ratio=mode.cast_traffic_ratio)
                    for mode in ElementwiseKernels)
    assert eager - fused == pytest.approx(gemm.bytes / (device.mem_bw_bytes_per_s * device.mem_bw_efficiency))
    assert layer_time_s([gemm], device, "bf16", cast_traffic_ratio=1.5) == layer_time_s([gemm], device, "bf16")


def test_ops_whose_output_takes_no_gradient_run_no_backward():
    # An integer op (routing indices, a mask) has no backward, eager or fused. Eager, its time is its
    # forward alone (priced without its producer's size, it reads as much as it writes). Fused: y (a linear's 100 B) feeds argmax i (10 B of indices, also read by an
    # embedding lookup outside the region) and softmax s (100 B); the mul m of s and i is the layer's
    # output. Forward: y read once, m and i written, 210 B. Backward: only what the floating members
    # read and write (y, read by s too, and m), twice over; i's 10 B take no gradient.
    device = load_device("h100-sxm")
    indices = _op("i", OpKind.OTHER, "argmax", ("y",), 10)
    indices = dataclasses.replace(indices, takes_grad=False)
    assert op_time_s(indices, device, "bf16", 1) == layer_time_s([OpWork(WorkKind.MEMORY, 0.0, 20, "argmax")], device)
    assert op_time_s(dataclasses.replace(indices, takes_grad=True), device, "bf16", 1) > op_time_s(indices, device, "bf16", 1)
    ops = (_op("y", OpKind.MATMUL, "linear", ("x",), 100, flops=1e6), indices,
           _op("s", OpKind.ELEMENTWISE, "softmax", ("y",), 100), _op("m", OpKind.ELEMENTWISE, "mul", ("s", "i"), 100),
           _op("e", OpKind.EMBEDDING, "embedding", ("i",), 100))
    _, fwd, bwd = fused_works(ops, 1.0, lambda op: 1)
    assert [work.bytes for work in fwd] == [210]
    assert [work.bytes for work in bwd] == [MEMORY_BWD_TRAFFIC_RATIO * 200]
