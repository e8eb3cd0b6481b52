"""Predicted vs published throughput of NVIDIA's NeMo performance tables on DGX-H100, held out.

Rows of dense models the zoo has, from two of NVIDIA's published tables, each with its whole
configuration stated (GPUs, global and micro batch, sequence length, TP/PP/CP/VP, FSDP or data
parallelism, precision); the published metric is tokens per second per GPU, which needs no FLOP
convention. Nothing in the cost model is fitted to these rows: they test it on software it was
not calibrated on (Transformer Engine FP8 with current scaling, cuDNN fused attention, fused
norms and activations) and at sequence lengths of 4K-8K.

Open choices are filled the same way for every row: FSDP = 1 is ZeRO-3; FSDP = 0 is Megatron's
distributed optimizer (ZeRO-1), the default of NeMo's performance recipes; recompute is not
stated and every row is priced without it. Elementwise ops are priced fused, as Transformer Engine runs
them; `--elementwise eager` prices them op by op, as PyTorch eager runs them. Each row ran, so a predicted peak over the device's
memory is a memory prediction proven too high; the table shows the peak over capacity.

Usage: python benchmarks/nemo_h100.py [--elementwise eager|fused]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.api import evaluate  # noqa: E402
from planner.tracing import trace  # noqa: E402

NEMO_24_07 = ("NVIDIA/NeMo docs/source/performance/performance_summary.md @ 070a0bb168d405d653b9734c0017cf5078e77c0d "
              "(container NeMo 24.07, DGX-H100, FP8)")
BRIDGE_25_09 = ("NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, section '25.09 NeMo Container', "
                "System: DGX-H100 (FP8 current scaling)")
GPUS_PER_NODE = 8

# (source, zoo model, GPUs, global batch, micro-batch, sequence length, FSDP, TP, PP, CP, VP, dtype,
#  published tokens per second per GPU)
ROWS = (
    (NEMO_24_07, "gpt3-175b", 128, 256, 1, 2048, 0, 4, 8, 1, 6, "fp8", 726),
    (NEMO_24_07, "gpt3-175b", 512, 2048, 2, 2048, 0, 4, 8, 1, 6, "fp8", 782),
    (NEMO_24_07, "llama2-7b", 8, 128, 1, 4096, 0, 1, 1, 1, 1, "fp8", 16847),
    (NEMO_24_07, "llama2-13b", 16, 128, 1, 4096, 0, 1, 4, 1, 10, "fp8", 8646),
    (NEMO_24_07, "llama2-70b", 64, 128, 1, 4096, 0, 4, 4, 1, 20, "fp8", 1707),
    (NEMO_24_07, "llama3-8b", 8, 128, 1, 8192, 0, 1, 1, 2, 1, "fp8", 12036),
    (NEMO_24_07, "llama3-70b", 64, 128, 1, 8192, 0, 4, 4, 2, 5, "fp8", 1533),
    (BRIDGE_25_09, "llama3-8b", 8, 128, 1, 8192, 1, 1, 1, 1, 1, "fp8", 14079),
    (BRIDGE_25_09, "llama3-70b", 64, 128, 1, 8192, 0, 4, 8, 1, 5, "fp8", 1619),
    (BRIDGE_25_09, "llama3-405b", 1024, 512, 1, 8192, 0, 8, 8, 2, 8, "fp8", 302),
)


def evaluate_row(model: str, gpus: int, global_batch: int, micro_batch: int, seq_len: int, fsdp: int, tp: int, pp: int,
                 cp: int, vpp: int, dtype: str, elementwise: str = "fused"):
    """The row's configuration priced without recompute; Transformer Engine fuses the norms, rotary
    embeddings and SwiGLU, hence fused elementwise kernels by default (`planner.fusion`)."""
    graph = trace(model, seq_len=seq_len)
    cluster = f"h100-sxm:{gpus // GPUS_PER_NODE}x{GPUS_PER_NODE}"
    config = {"dp": gpus // (tp * pp * cp), "tp": tp, "pp": pp, "cp": cp, "vpp": vpp, "micro_batch": micro_batch,
              "zero": 3 if fsdp else 1, "schedule": "interleaved" if vpp > 1 else "1f1b", "recompute": "none"}
    # NeMo runs Megatron-Core's pipeline schedules, its vocab-parallel cross-entropy (in place on fp32 logits)
    # and its sequence-parallel linears, which gather their input again in backward
    return evaluate(graph, cluster, config, global_batch=global_batch, dtype=dtype, elementwise=elementwise,
                    pp_buffers="transient", loss="inplace", sp_gather="regathered", fixes=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elementwise", default="fused", choices=["eager", "fused"], help="as `paraplan evaluate`")
    args = parser.parse_args()
    print(f"{'model':12s} {'GPUs':>5s} {'config':40s} {'pred tok/s/GPU':>14s} {'published':>9s} {'error':>7s} {'mem/cap':>7s}")
    errors = []
    for source, model, gpus, global_batch, micro_batch, seq_len, fsdp, tp, pp, cp, vpp, dtype, published in ROWS:
        est = evaluate_row(model, gpus, global_batch, micro_batch, seq_len, fsdp, tp, pp, cp, vpp, dtype, args.elementwise)
        predicted = est.tokens_per_s / gpus
        errors.append(predicted / published - 1)
        capacity = max(stage["total_bytes"] / stage["capacity_bytes"] for stage in est.memory)
        print(f"{model:12s} {gpus:5d} {est.config.short():40s} {predicted:14.0f} {published:9d} {errors[-1]:+7.1%} "
              f"{capacity:7.1%}")
    print(f"\nrows {len(errors)}  MAPE {statistics.mean(abs(e) for e in errors):.1%}  mean error "
          f"{statistics.mean(errors):+.1%}  (negative: the model is pessimistic)")
    for source in dict.fromkeys(row[0] for row in ROWS):
        print(f"source: {source}")


if __name__ == "__main__":
    main()
