"""Predicted vs published throughput and memory of torchtitan's H100 benchmark tables, held out.

Every row of `benchmarks/llama3_h100_202412_torchtitan.md` in pytorch/torchtitan (@ 31a17bf; torch,
torchao and torchtitan of December 2024): Llama 3.1 8B, 70B and 405B on Grand Teton hosts of 8
H100 with 96 GB HBM2e at the default 500 W limit (the `h100-hbm2e` profile), NVLink inside a host,
400 Gb/s RDMA per GPU between hosts. Each row states its GPUs, local and global batch, activation
checkpointing, parallel degrees and the techniques used; it publishes tokens per second per GPU
and the peak memory over all GPUs. None of these rows is in shared/reference or was used to set a
constant.

Tables 1 and 3 run the same model and configuration in PyTorch eager, under torch.compile, and
under torch.compile with Float8 linears: the first two rows differ only in how the elementwise ops
run (`--elementwise eager` vs `fused`, `planner.fusion`), the next in the GEMMs' dtype.

Open choices, the same for every row: FSDP is ZeRO-3 over dp x cp; "selective activation
checkpointing" is torchtitan's default op-level policy of the time (`selective_op`); the interleaved
schedule runs 2 stages per rank (torchtitan's default for looped schedules without split points)
and the local batch splits into one micro-batch per pipeline stage (torchtitan's default of the
time, `n_microbatches = pp x stages per rank`; the per-micro-batch size setting came in 2025):
Table 5 runs 8 micro-batches of 4 sequences under 1F1B and 16 of 2 interleaved. Pipeline stages
are cut where torchtitan cut them without split points (`generate_split_points` of the time,
torchtitan/parallelisms/pipelining_utils.py: the first stage base = blocks // stages blocks, the
middle ones one more while blocks % stages last, the last stage the rest; `torchtitan_split`). The pipeline's
last stage keeps every micro-batch's output until the step ends (`--pp-outputs kept`): torch's
`Schedule.step()` did then, and torchtitan's Llama returns fp32 logits (`self.output(h).float()`). torchtitan reports the caching allocator's reserved peak
(`torch.cuda.memory_stats()["reserved_bytes.all.peak"]`), which counts fragmentation but not the CUDA
context, so it is compared with the predicted peak less `costmodel.memory.CUDA_CONTEXT_BYTES` (the
prediction already holds the allocator's share, `ALLOCATOR_FRAGMENTATION_FRACTION`). Float8 is priced as fp8 GEMMs (`--dtype fp8`); AsyncTP as the forward
pass's tensor-parallel collectives overlapped (`--tp-comm-overlap forward`, async TP of 2024). Attention is FlashAttention-2's kernels
(`--attention flash2`): torchtitan calls PyTorch's SDPA, which on H100 ran FlashAttention-2 in the
nightlies of December 2024 (pytorch/pytorch#142132, torch 2.6.0.dev20241204; cuDNN attention was
opt-in from 2.5.1, pytorch/pytorch#138522).

Usage: python benchmarks/torchtitan_h100.py
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodel.memory import CUDA_CONTEXT_BYTES  # noqa: E402
from planner.api import evaluate  # noqa: E402
from planner.graph import LayerKind  # noqa: E402
from planner.tracing import trace  # noqa: E402

SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ 31a17bfdb70bab6f62a13d21816a5339b911d6e3"
DEVICE = "h100-hbm2e"
GPUS_PER_NODE = 8
INTERLEAVED_STAGES_PER_RANK = 2
GIB = 2**30


class Row(NamedTuple):
    table: int
    model: str
    gpus: int
    local_batch: int
    global_batch: int
    seq_len: int
    dp: int  # FSDP
    tp: int
    pp: int
    cp: int
    schedule: str
    recompute: str
    compiled: bool  # torch.compile
    float8: bool
    async_tp: bool
    published_tokens_per_s: int  # per GPU
    published_gib: float


ROWS = tuple(Row(*row) for row in (
    (1, "llama3-8b", 8, 2, 16, 8192, 8, 1, 1, 1, "1f1b", "selective_op", False, False, False, 5762, 82.4),
    (1, "llama3-8b", 8, 2, 16, 8192, 8, 1, 1, 1, "1f1b", "selective_op", True, False, False, 6667, 77.0),
    (1, "llama3-8b", 8, 2, 16, 8192, 8, 1, 1, 1, "1f1b", "selective_op", True, True, False, 8532, 76.8),
    (2, "llama3-8b", 8, 1, 8, 32768, 8, 1, 1, 1, "1f1b", "full", True, True, False, 3890, 83.9),
    (2, "llama3-8b", 8, 1, 4, 65536, 4, 1, 1, 2, "1f1b", "full", True, True, False, 2540, 84.2),
    (2, "llama3-8b", 8, 1, 2, 131072, 2, 1, 1, 4, "1f1b", "full", True, True, False, 1071, 84.0),
    (2, "llama3-8b", 8, 1, 1, 262144, 1, 1, 1, 8, "1f1b", "full", True, True, False, 548, 84.5),
    (3, "llama3-8b", 128, 2, 256, 8192, 128, 1, 1, 1, "1f1b", "selective_op", False, False, False, 5605, 67.0),
    (3, "llama3-8b", 128, 2, 256, 8192, 128, 1, 1, 1, "1f1b", "selective_op", True, False, False, 6514, 62.0),
    (3, "llama3-8b", 128, 2, 256, 8192, 128, 1, 1, 1, "1f1b", "selective_op", True, True, False, 8380, 61.8),
    (4, "llama3-70b", 256, 16, 512, 8192, 32, 8, 1, 1, "1f1b", "full", True, True, False, 829, 71.9),
    (4, "llama3-70b", 256, 16, 512, 8192, 32, 8, 1, 1, "1f1b", "full", True, True, True, 876, 67.6),
    (5, "llama3-405b", 512, 32, 256, 8192, 8, 8, 8, 1, "1f1b", "full", True, True, True, 100, 82.5),
    (5, "llama3-405b", 512, 32, 256, 8192, 8, 8, 8, 1, "interleaved", "full", True, True, True, 128, 72.7),
    (6, "llama3-405b", 512, 8, 64, 32768, 8, 8, 8, 1, "1f1b", "full", True, True, True, 76, 75.3),
    (6, "llama3-405b", 512, 8, 32, 65536, 4, 8, 8, 2, "1f1b", "full", True, True, True, 47, 75.9),
    (6, "llama3-405b", 512, 8, 16, 131072, 2, 8, 8, 4, "1f1b", "full", True, True, True, 31, 77.1),
    (6, "llama3-405b", 512, 8, 8, 262144, 1, 8, 8, 8, "1f1b", "full", True, True, True, 16, 84.9),
))


def torchtitan_split(graph, chunks: int) -> tuple[int, ...]:
    """The chunk cut points over `graph`'s layers where torchtitan's generate_split_points cut the
    blocks (the embedding rides with the first chunk, the final norm and output with the last)."""
    blocks = [index for index, layer in enumerate(graph.layers) if layer.kind == LayerKind.BLOCK]
    base, extra = divmod(len(blocks), chunks)
    cuts, current = [], 0
    for chunk in range(chunks - 1):
        current += base + (1 if chunk and extra > 0 else 0)
        extra -= 1 if chunk and extra > 0 else 0
        cuts.append(blocks[current])
    return (0, *cuts, len(graph.layers))


def evaluate_row(row: Row):
    """The row's configuration priced with the open choices of the module docstring."""
    nodes = max(1, row.gpus // GPUS_PER_NODE)
    vpp = INTERLEAVED_STAGES_PER_RANK if row.schedule == "interleaved" else 1
    config = {"dp": row.dp, "tp": row.tp, "pp": row.pp, "cp": row.cp, "zero": 3, "recompute": row.recompute,
              "schedule": row.schedule, "micro_batch": row.local_batch // (row.pp * vpp), "vpp": vpp}
    dtype = "fp8" if row.float8 else "bf16"
    graph = trace(row.model, seq_len=row.seq_len, dtype=dtype)
    return evaluate(graph, f"{DEVICE}:{nodes}x{min(row.gpus, GPUS_PER_NODE)}",
                    config, global_batch=row.global_batch, dtype=dtype, tp_overlap="forward" if row.async_tp else "none",
                    elementwise="fused" if row.compiled else "eager", attention="flash2", pp_outputs="kept",
                    boundaries=torchtitan_split(graph, row.pp * vpp) if row.pp > 1 else None)


def techniques(row: Row) -> str:
    return "+".join(["compile"] * row.compiled + ["float8"] * row.float8 + ["asyncTP"] * row.async_tp) or "eager"


def main() -> None:
    print(f"{'table':>5s} {'model':11s} {'GPUs':>4s} {'config':34s} {'techniques':22s} {'pred tok/s':>10s} "
          f"{'published':>9s} {'error':>7s} {'pred GiB':>8s} {'pub GiB':>7s} {'error':>7s}")
    speed_errors, memory_errors = [], []
    for row in ROWS:
        est = evaluate_row(row)
        predicted = est.tokens_per_s / row.gpus
        speed_errors.append(predicted / row.published_tokens_per_s - 1)
        predicted_gib = (est.peak_memory_bytes - CUDA_CONTEXT_BYTES) / GIB
        memory_errors.append(predicted_gib / row.published_gib - 1)
        print(f"{row.table:5d} {row.model:11s} {row.gpus:4d} {est.config.short():34s} {techniques(row):22s} {predicted:10.0f} "
              f"{row.published_tokens_per_s:9d} {speed_errors[-1]:+7.1%} {predicted_gib:8.1f} {row.published_gib:7.1f} "
              f"{memory_errors[-1]:+7.1%}")
    print(f"\nrows {len(ROWS)}  throughput MAPE {statistics.mean(abs(e) for e in speed_errors):.1%} "
          f"(mean {statistics.mean(speed_errors):+.1%}, negative: pessimistic)  memory MAPE "
          f"{statistics.mean(abs(e) for e in memory_errors):.1%} (mean {statistics.mean(memory_errors):+.1%})")
    for label, pipelined in (("without", False), ("with", True)):
        errors = [abs(e) for e, row in zip(memory_errors, ROWS) if (row.pp > 1) == pipelined]
        print(f"{label} pipeline parallelism: memory MAPE {statistics.mean(errors):.1%} over {len(errors)} rows, "
              f"{sum(e <= 0.10 for e in errors)} within 10%")
    print(f"source: {SOURCE}")


if __name__ == "__main__":
    main()
