"""Predicted vs published throughput of MosaicML's MPT benchmark tables on H100 and A100 80 GB, held out.

The MPT goal group (shared/reference) is llm-foundry's A100 40 GB table; the same README also
publishes an H100 80 GB BF16 table and an A100 80 GB table (1600 Gbps RoCE between nodes) from the
same training code. None of their rows is in shared/reference or was used to set a constant, so
they test what the 40 GB rows taught the model on two other devices, sequence lengths up to 65,536
and gradient accumulation.

Every row states its model, sequence length, GPUs, micro-batch, gradient accumulation, global batch,
FULL_SHARD (ZeRO-3) and whether activations are checkpointed (full recompute), and publishes tokens
per second per GPU. The model dimensions are the MPT group's (shared/reference, from llm-foundry's
yamls) with the row's sequence length; the training code is priced as the MPT group's
(`benchmarks/published_rows.FILL_RULES`: the first FlashAttention's kernels, the fused
cross-entropy). Rows whose global batch is not a whole number of micro-batches per GPU are left out
(llm-foundry's micro-batching runs a short last micro-batch).

Not priced: the tables' "MP Mode DEFAULT" rows keep FSDP's gathered parameters in fp32 (Composer's
DEFAULT mixed precision) where the model gathers bf16, so their parameter gathers move twice the
bytes the model counts; all H100 rows and all but the 70B A100 80 GB rows ran so.

Usage: python benchmarks/llmfoundry_heldout.py
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.published_rows import load_rows  # noqa: E402
from planner.api import evaluate  # noqa: E402
from planner.models import resolve_model  # noqa: E402
from planner.tracing import trace  # noqa: E402
from planner.zoo.spec import parse_spec  # noqa: E402

SOURCE = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md @ 061f2c7ce64e655100286584a7629e2a09f827ba, "
          "sections 'H100 80GB BF16' and 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)'")
GPUS_PER_NODE = 8

# Per table, its device profile and rows: model, sequence length, GPUs, micro-batch, gradient
# accumulation, global batch, activation checkpointing (1 = full recompute), Throughput (T/s/GPU).
TABLES = {
    "h100-sxm": """
        70b 2048 64 8 4 2048 1 1039 | 70b 2048 32 2 16 1024 1 882 | 30b 8192 8 1 21 168 1 1384 | 30b 4096 8 1 21 168 1 1802
        30b 2048 32 14 3 1344 1 2308 | 30b 2048 16 10 3 480 1 2263 | 30b 2048 8 3 21 504 1 2002 | 30b 1024 8 6 21 1008 1 2084
        13b 32768 8 1 3 24 1 1976 | 13b 16384 8 3 3 72 1 2985 | 13b 4096 8 10 3 240 1 4717 | 13b 2048 64 2 1 128 0 4800
        13b 2048 32 2 1 64 0 4811 | 13b 2048 16 2 1 32 0 4767 | 13b 2048 8 2 1 16 0 4792 | 13b 1024 8 40 3 960 1 5502
        7b 65536 8 1 2 16 1 1956 | 7b 32768 8 2 2 32 1 3318 | 7b 8192 8 8 2 128 1 6935 | 7b 4096 8 16 2 256 1 8611
        7b 2048 8 6 1 48 0 10643 | 7b 1024 8 64 2 1024 1 10203 | 3b 65536 8 1 2 16 1 3262 | 3b 32768 8 3 6 144 1 5873
        3b 16384 8 1 6 48 0 11152 | 3b 8192 8 3 6 144 0 16578 | 3b 4096 8 5 6 240 0 20964 | 3b 2048 64 6 3 1152 0 22525
        3b 2048 32 6 3 576 0 23021 | 3b 2048 16 10 3 480 0 24142 | 3b 1024 8 20 6 960 0 27046 | 3b 512 8 40 6 1920 0 27965
        1b 65536 8 1 2 16 1 5506 | 1b 32768 8 1 4 32 0 12025 | 1b 16384 8 2 4 64 0 19649 | 1b 8192 8 3 4 96 0 29157
        1b 4096 8 7 4 224 0 38535 | 1b 2048 64 20 1 1280 0 44402 | 1b 2048 32 20 1 640 0 45130 | 1b 2048 16 20 1 320 0 46037
        1b 2048 8 14 1 112 0 45455 | 1b 1024 8 18 4 576 0 48910 | 1b 512 8 56 4 1792 0 52275 | 760m 32768 8 1 2 16 0 16291
        760m 16384 8 3 2 48 0 27815 | 760m 8192 8 6 2 96 0 41825 | 760m 4096 8 12 2 192 0 55459 | 760m 2048 32 24 1 768 0 67971
        760m 2048 16 24 1 384 0 68551 | 760m 2048 8 24 2 384 0 63147 | 760m 1024 8 48 2 768 0 78581 | 760m 512 8 96 2 1536 0 83749
    """,
    "a100-80g": """
        70b 2048 64 8 4 2048 1 410 | 70b 2048 32 2 16 1024 1 373 | 30b 8192 8 1 21 168 1 574 | 30b 4096 8 1 21 168 1 814
        30b 2048 8 3 21 504 1 916 | 30b 1024 8 6 21 1008 1 946 | 30b 512 8 12 21 2016 1 967 | 13b 32768 8 1 3 24 1 1016
        13b 16384 8 3 3 72 1 1431 | 13b 8192 8 5 3 120 1 1795 | 13b 4096 8 10 3 240 1 2060 | 13b 2048 8 2 3 48 0 2262
        13b 1024 8 40 3 960 1 2330 | 7b 65536 8 1 2 16 1 1013 | 7b 32768 8 2 2 32 1 1672 | 7b 16384 8 4 2 64 1 2453
        7b 8192 8 8 2 128 1 3206 | 7b 4096 8 16 2 256 1 3684 | 7b 2048 8 6 2 96 0 4641 | 7b 1024 8 64 2 1024 1 4357
        3b 65536 8 1 2 16 1 1767 | 3b 32768 8 3 6 144 1 3029 | 3b 16384 8 1 6 48 0 5529 | 3b 8192 8 3 6 144 0 7695
        3b 4096 8 5 6 240 0 9457 | 3b 2048 8 10 2 160 0 10811 | 3b 1024 8 20 6 960 0 11580 | 3b 512 8 40 6 1920 0 12127
        1b 65536 8 1 2 16 1 3044 | 1b 32768 8 1 4 32 0 6275 | 1b 16384 8 2 4 64 0 9956 | 1b 8192 8 3 4 96 0 13814
        1b 4096 8 7 4 224 0 17807 | 1b 2048 8 14 4 448 0 20513 | 1b 1024 8 18 4 576 0 22112 | 1b 512 8 56 4 1792 0 23148
        760m 65536 8 1 2 16 1 4143 | 760m 32768 8 1 2 16 0 8802 | 760m 16384 8 3 2 48 0 14274 | 760m 8192 8 6 2 96 0 20933
        760m 4096 8 12 2 192 0 27351 | 760m 2048 8 24 2 384 0 32434 | 760m 1024 8 48 2 768 0 29765 | 760m 512 8 96 2 1536 0 29446
        350m 65536 8 1 2 16 0 7524 | 350m 32768 8 2 2 32 0 13652 | 350m 16384 8 4 2 64 0 23559 | 350m 8192 8 8 2 128 0 36569
        350m 4096 8 16 2 256 0 49555 | 350m 2048 8 32 2 512 0 58782 | 350m 1024 8 64 2 1024 0 64813 | 350m 512 8 128 2 2048 0 69330
        125m 65536 8 1 2 16 0 20368 | 125m 32768 8 2 2 32 0 36407 | 125m 16384 8 4 2 64 0 60040 | 125m 8192 8 8 2 128 0 90392
        125m 4096 8 16 2 256 0 118396 | 125m 2048 8 40 2 640 0 142830 | 125m 2048 8 32 2 512 0 141737
        125m 1024 8 64 2 1024 0 156468 | 125m 512 8 128 2 2048 0 165681
    """,
}


def mpt_specs() -> dict[str, dict]:
    """MPT model dimensions by size ("7b", "760m", ...): the reference's MPT group's."""
    rows, _ = load_rows(("llmfoundry_mpt",))
    return {row.id.split("-")[1].removeprefix("mpt"): row.spec for row in rows}


def rows():
    """(device, size, seq_len, gpus, micro_batch, global_batch, recompute, tokens/s per GPU) of every table row."""
    for device, table in TABLES.items():
        for entry in table.replace("\n", "|").split("|"):
            if entry.strip():
                size, *numbers = entry.split()
                seq, gpus, micro_batch, _accumulation, global_batch, checkpointed, tokens = map(int, numbers)
                yield device, size, seq, gpus, micro_batch, global_batch, "full" if checkpointed else "none", tokens


def main() -> None:
    specs = mpt_specs()
    print(f"{'device':9s} {'model':5s} {'seq':>6s} {'GPUs':>4s} {'config':32s} {'pred tok/s':>10s} {'published':>9s} "
          f"{'error':>7s} {'mem/cap':>7s}")
    errors: dict[str, list[float]] = {}
    for device, size, seq, gpus, micro_batch, global_batch, recompute, published in rows():
        if global_batch % (gpus * micro_batch):
            continue
        graph = trace(resolve_model(parse_spec({**specs[size], "max_seq_len": seq}, f"mpt-{size}.yaml")), seq_len=seq)
        cluster = f"{device}:{max(1, gpus // GPUS_PER_NODE)}x{min(gpus, GPUS_PER_NODE)}"
        est = evaluate(graph, cluster, {"tp": 1, "pp": 1, "micro_batch": micro_batch, "zero": 3, "recompute": recompute},
                       global_batch=global_batch, attention="flash1", loss="fused", fixes=False)
        predicted = est.tokens_per_s / gpus
        errors.setdefault(device, []).append(predicted / published - 1)
        peak = max(row["total_bytes"] / row["capacity_bytes"] for row in est.memory)
        print(f"{device:9s} {size:5s} {seq:6d} {gpus:4d} {est.config.short():32s} {predicted:10.0f} {published:9d} "
              f"{errors[device][-1]:+7.1%} {peak:7.1%}")
    print()
    for device, values in errors.items():
        print(f"{device:9s} rows {len(values):3d}  MAPE {statistics.mean(map(abs, values)):5.1%}  mean {statistics.mean(values):+6.1%}"
              f"  over 25%: {sum(abs(e) > 0.25 for e in values)}")
    every = [e for values in errors.values() for e in values]
    print(f"{'all':9s} rows {len(every):3d}  MAPE {statistics.mean(map(abs, every)):5.1%}  mean {statistics.mean(every):+6.1%}")
    print(f"source: {SOURCE}")


if __name__ == "__main__":
    main()
