"""Timing of compute ops on the device this process runs (`costmodel.profile` runs them on every rank).

Each function times one kind of op across sizes and dtypes and returns what the op table stores:
training GEMMs, streaming copy and elementwise/norm ops (forward and backward), causal attention
per head of one sequence, and the cross-entropy. Under torchrun every rank times each op at the
same moment and the result is the slowest rank's (`rank_max`), as a step waits for its slowest rank.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.benchmark import Timer

from costmodel.compute import CAUSAL_WORK_FRACTION, MEMORY_BWD_TRAFFIC_RATIO
from costmodel.profile_collectives import lockstep_s, rank_max

# Bytes of each tensor of the elementwise measurements (their outputs are allocated, as in training).
# On a CPU a tensor above glibc's largest mmap threshold (32 MiB) is mapped fresh on every call and
# its page faults, not memory bandwidth, set its time: measured on this project's 2-core host, a
# one-thread `a + b` over 64 MiB tensors moved 4.2 GB/s against 20.9 GB/s with a preallocated output
# (`torch.add(a, b, out=c)`), while at 1-16 MiB the two agree. Training tensors of a CPU-sized model
# (a few MiB) come from the reused heap, so the CPU size stays below that threshold.
ELEMENTWISE_BYTES = {"cpu": 8 * 2**20, "cuda": 1 * 2**30}
# Elementwise and norm ops timed, by the name the trace gives them (`planner.op_kinds`): the
# statement, how many activation-sized tensors it reads (its weights, one row, are not counted, as
# the cost model does not count them) and the tensors its backward differentiates, as in training.
ELEMENTWISE_OPS = {
    "add": ("a + b", 2, "(a, b)"), "mul": ("a * b", 2, "(a, b)"), "gelu": ("F.gelu(a)", 1, "(a,)"),
    "gelu_tanh": ("F.gelu(a, approximate='tanh')", 1, "(a,)"), "silu": ("F.silu(a)", 1, "(a,)"),
    "softmax": ("F.softmax(a, -1)", 1, "(a,)"), "layer_norm": ("F.layer_norm(a, (ROW,), w, c)", 1, "(a, w, c)"),
    "rms_norm": ("F.rms_norm(a, (ROW,), w)", 1, "(a, w)"),
}
# Row length of the elementwise tensors (the last dimension norms and softmax run over).
ELEMENTWISE_ROW = 1024
# Bytes the cost model counts for a loss per fp32 logit: its forward reads the logits (4 B), its
# backward moves MEMORY_BWD_TRAFFIC_RATIO times that (`planner.layer_cost`).
LOSS_BYTES_PER_LOGIT = 4 * (1 + MEMORY_BWD_TRAFFIC_RATIO)
# GEMMs of one Linear layer in a training step: forward, input gradient, weight gradient.
GEMMS_PER_LINEAR = 3
# Features and tokens of the linears whose tensor-parallel host work is timed: small, so the host's
# dispatch, not the GEMM, sets the time (the same local linears are timed and subtracted).
TP_DISPATCH_FEATURES = 64
TP_DISPATCH_TOKENS = 8
TP_DISPATCH_TRIALS = 5
# Tokens and features of the tensor-parallel linears whose ranks' waiting is timed
# (`measure_sync_wait`): a linear of a model sized for the device, so the GEMMs between two
# collectives last as long as in training (on a CPU a few milliseconds, on a GPU about one).
TP_SYNC_SHAPE = {"cpu": (1024, 512), "cuda": (8192, 4096)}
QUICK_TP_SYNC_SHAPE = {"cpu": (128, 128), "cuda": (1024, 1024)}
# Ranks of the tensor-parallel group the waiting is timed on: the smallest, which every even
# world size can form (pairs of neighbouring ranks, all timed at once).
TP_SYNC_GROUP = 2
# Calls per timing of the waiting: a fixed count, the same on every rank (`lockstep_s`), since each
# call runs collectives every rank of the group must join (an adaptive timer would stop the ranks
# at different counts and leave one waiting in a collective forever).
TP_SYNC_ITERATIONS = 5
QUICK_TP_SYNC_ITERATIONS = 2

_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _time_s(stmt: str, values: dict, min_run_time_s: float) -> float:
    """Median seconds of `stmt` (torch.utils.benchmark: warm-up, device sync, blocked autorange).

    Under torchrun every rank starts each measurement together (a barrier first), so each op is
    timed while all ranks run it, as in training; without it the ranks drift apart and an op timed
    while the other ranks wait runs faster than it ever will in a step (on a 2-core machine, 2-3x).
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return Timer(stmt, globals=values, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time_s).median


def measure_matmuls(device, dtypes, sizes, min_run_time_s, advance) -> dict[str, list[tuple[float, float]]]:
    """(FLOPs, seconds) of one training GEMM per size and dtype, ascending in FLOPs.

    Each size n times the three GEMMs of an n x n Linear layer on n tokens in training, in the
    layouts autograd runs them (forward `linear(x, w)`, input gradient `dy @ w`, weight gradient
    `dy.t() @ x`) and takes their mean: the cost model prices a Linear as one forward and two
    backward GEMMs of equal FLOPs, and transposed layouts run at different speeds on some devices.
    """
    out = {}
    linear = torch.nn.functional.linear
    for dtype in dtypes:
        points = []
        for n in sizes:
            x, w, dy = (torch.randn(n, n, device=device, dtype=getattr(torch, _TORCH_DTYPES[dtype])) for _ in range(3))
            triplet_s = _time_s("linear(x, w); dy @ w; dy.t() @ x", {"x": x, "w": w, "dy": dy, "linear": linear},
                                min_run_time_s)
            points.append((2.0 * n ** 3, triplet_s / GEMMS_PER_LINEAR))
            advance()
        out[dtype] = list(zip([f for f, _ in points], rank_max([t for _, t in points])))
    return out


def measure_memory(device, dtypes, stream_bytes, min_run_time_s, advance) -> tuple[float, dict[str, dict[str, float]]]:
    """Copy bandwidth, and by dtype the bytes per second of each of ELEMENTWISE_OPS forward ("gelu")
    and backward ("gelu:bwd"), bytes counted as the cost model counts them (forward: inputs plus
    output; backward: MEMORY_BWD_TRAFFIC_RATIO times that). A backward is never priced faster than
    its forward: it reads at least what the forward wrote and writes a gradient of the same size
    (the floor also keeps a pass-through backward such as add's from pricing at zero)."""
    x = torch.randn(stream_bytes // 4, device=device)
    # Quick runs shrink `stream_bytes` below ELEMENTWISE_BYTES; the elementwise tensors shrink with it.
    elements = min(stream_bytes, ELEMENTWISE_BYTES[device.type]) // 4
    (copy_s,) = rank_max([_time_s("y.copy_(x)", {"x": x, "y": torch.empty_like(x)}, min_run_time_s)])
    advance()
    rates = {}
    for dtype in dtypes:
        torch_dtype = getattr(torch, _TORCH_DTYPES[dtype])
        a, b = (torch.randn(elements // ELEMENTWISE_ROW, ELEMENTWISE_ROW, device=device, dtype=torch_dtype,
                            requires_grad=True) for _ in range(2))
        w, c = (torch.randn(ELEMENTWISE_ROW, device=device, dtype=torch_dtype, requires_grad=True) for _ in range(2))
        grad = torch.randn_like(a)
        size = a.numel() * a.element_size()
        values = {"a": a, "b": b, "w": w, "c": c, "g": grad, "F": torch.nn.functional, "ROW": ELEMENTWISE_ROW,
                  "backward": torch.autograd.grad}
        seconds, moved = [], []
        for stmt, reads, inputs in ELEMENTWISE_OPS.values():
            seconds.append(_time_s(stmt, values, min_run_time_s))
            seconds.append(_time_s(f"backward({stmt}, {inputs}, g)", values, min_run_time_s))
            moved.append((reads + 1) * size)
            advance()
        seconds = rank_max(seconds)
        rates[dtype] = {}
        for name, fwd_s, fwd_bwd_s, fwd_bytes in zip(ELEMENTWISE_OPS, seconds[::2], seconds[1::2], moved):
            rates[dtype][name] = fwd_bytes / fwd_s
            rates[dtype][f"{name}:bwd"] = MEMORY_BWD_TRAFFIC_RATIO * fwd_bytes / max(fwd_bwd_s - fwd_s, fwd_s)
    return 2 * stream_bytes / copy_s, rates


def measure_attention(device, dtypes, shapes, min_run_time_s, advance) -> dict[str, list[tuple[float, float, float]]]:
    """(forward FLOPs, forward s, backward s) of causal SDPA per head of one sequence at each shape,
    by dtype, ascending in FLOPs.

    FLOPs are the causal kernel's work, CAUSAL_WORK_FRACTION of the 4·s²·d that the two GEMMs over
    one head's full score matrix count (as `FlopCounterMode` counts attention in the trace); times
    are the whole call's over batch x heads; the backward is the forward+backward time less the
    forward.
    """
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = {}
    for dtype in dtypes:
        flops, seconds = [], []
        for batch, heads, seq, head_dim in shapes:
            q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=getattr(torch, _TORCH_DTYPES[dtype]),
                            requires_grad=True)
            values = {"q": q, "sdpa": sdpa}
            flops.append(CAUSAL_WORK_FRACTION * 4.0 * seq * seq * head_dim)
            seconds.append(_time_s("sdpa(q, q, q, is_causal=True)", values, min_run_time_s) / (batch * heads))
            seconds.append(_time_s("sdpa(q, q, q, is_causal=True).sum().backward()", values, min_run_time_s)
                           / (batch * heads))
            advance()
        seconds = rank_max(seconds)
        # A backward (ATTENTION_BWD_WORK_RATIO times the forward's work) never beats its forward; the
        # floor keeps timing noise from pricing it below that.
        points = [(f, fwd_s, max(fwd_bwd_s - fwd_s, fwd_s))
                  for f, fwd_s, fwd_bwd_s in zip(flops, seconds[::2], seconds[1::2])]
        out[dtype] = sorted(points)
    return out


def _tp_pairs(mesh, features: int, device) -> tuple[nn.Module, nn.Module]:
    """A colwise-then-rowwise pair of linears (an MLP's pattern), as the plain local linears of one
    rank's shard and parallelised over `mesh`."""
    hidden = 4 * features
    local = nn.Sequential(nn.Linear(features, hidden // mesh.size()), nn.Linear(hidden // mesh.size(), features)).to(device)
    parallel = nn.Sequential(nn.Linear(features, hidden), nn.Linear(hidden, features)).to(device)
    parallelize_module(parallel, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    return local, parallel


def measure_tp_dispatch(mesh, min_run_time_s: float, advance) -> tuple[float, float]:
    """(forward, backward) host seconds one tensor-parallel linear adds per call to its local GEMMs.

    Times a colwise-then-rowwise pair of linears (the pattern of an MLP or of attention's input and
    output projections) parallelised over `mesh`, a mesh of this rank alone (so no communication is
    timed), against the same pair of plain linears, and halves the difference: DTensor dispatch and
    the parallel styles' hooks, which a CPU rank runs on the cores that compute. The two are timed
    back to back in each of TP_DISPATCH_TRIALS trials and the differences' median kept, so that load
    which comes and goes on a shared host (other ranks' work) cancels rather than lands in one term.
    """
    x = torch.randn(TP_DISPATCH_TOKENS, TP_DISPATCH_FEATURES, device=mesh.device_type, requires_grad=True)
    pairs = [{"pair": pair, "x": x} for pair in _tp_pairs(mesh, TP_DISPATCH_FEATURES, mesh.device_type)]
    trial_s = min_run_time_s / TP_DISPATCH_TRIALS
    forward, backward = [], []
    for _ in range(TP_DISPATCH_TRIALS):
        (local_fwd_s, local_step_s), (tp_fwd_s, tp_step_s) = (
            (_time_s("pair(x)", values, trial_s), _time_s("pair(x).sum().backward()", values, trial_s)) for values in pairs)
        forward.append((tp_fwd_s - local_fwd_s) / 2)
        backward.append(((tp_step_s - tp_fwd_s) - (local_step_s - local_fwd_s)) / 2)
    advance()
    return tuple(max(0.0, t) for t in rank_max([float(np.median(forward)), float(np.median(backward))]))


def measure_sync_wait(mesh, shape: tuple[int, int], host_s: tuple[float, float], iterations: int, advance) -> float:
    """Seconds the ranks of a tensor-parallel group wait for each other per second of local GEMMs.

    Ranks that compute the same work drift apart (other threads and processes take their cores
    now and then), and each blocking collective waits for the last rank to arrive: the more
    compute between two collectives, the longer the wait. Times the colwise-then-rowwise pair on
    `mesh` (a real group of TP_SYNC_GROUP ranks, `shape` = (tokens, features)) against its local
    linears, subtracts the pair's two all-reduces (forward and input gradient) timed alone on the
    same group and the DTensor host work of its two linears (`host_s`, `measure_tp_dispatch`), and
    divides what is left by the local pair's time, median over TP_DISPATCH_TRIALS back-to-back trials.
    """
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    tokens, features = shape
    x = torch.randn(tokens, features, device=device, requires_grad=True)
    local, parallel = _tp_pairs(mesh, features, device)
    buffer, group = torch.zeros(tokens, features, device=device), mesh.get_group()
    fractions = []
    for _ in range(TP_DISPATCH_TRIALS):
        local_s, parallel_s, all_reduce_s = (lockstep_s(run, device, iterations) for run in (
            lambda: local(x).sum().backward(), lambda: parallel(x).sum().backward(),
            lambda: dist.all_reduce(buffer, group=group)))
        wait_s = parallel_s - local_s - 2 * all_reduce_s - 2 * sum(host_s)
        fractions.append(wait_s / local_s)
    advance()
    return max(0.0, rank_max([float(np.median(fractions))])[0])


def measure_loss(device, shape: tuple[int, int], min_run_time_s: float, advance) -> float:
    """Cross-entropy forward and backward over fp32 logits of `shape`, as bytes per second in the cost
    model's accounting (LOSS_BYTES_PER_LOGIT)."""
    tokens, vocab = shape
    logits = torch.randn(tokens, vocab, device=device, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device=device)
    (seconds,) = rank_max([_time_s("cross_entropy(x, t).backward()",
                                   {"x": logits, "t": targets, "cross_entropy": torch.nn.functional.cross_entropy},
                                   min_run_time_s)])
    advance()
    return LOSS_BYTES_PER_LOGIT * tokens * vocab / seconds
