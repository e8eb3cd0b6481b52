"""The published-runs loader of benchmarks/published.py: GPU names to device profiles, and rows to specs and configs."""
from __future__ import annotations

import json

import pytest

import planner
from benchmarks.published_rows import _device, load_rows, row_policies
from costmodel.profile_files import list_devices


MISSING = "missing device, seq_len, global batch or degrees"


@pytest.mark.parametrize(("gpu", "device"), [
    ("A100-SXM4-40GB", "a100-40g"), ("A100-PCIe-40GB", "a100-40g"), ("A100-80GB", "a100-80g"), ("A100 (DGX-A100)", "a100-80g"),
    ("H100 (SXM, 80GB assumed)", "h100-sxm"), ("H100 PCIe", "h100-pcie"), ("H100 (94/95GB HBM2e, lower TDP)", "h100-hbm2e"),
    ("H200-SXM", "h200"), ("H800-SXM", "h800"), ("B200-SXM", "b200"), ("GB200 (per Blackwell GPU)", "gb200"),
    ("MI300X", "mi300x"), ("MI250X", "mi250x"), ("L40S", "l40s"), ("L4", "l4"), ("A10G", "a10g"), ("RTX 4090", "rtx-4090"),
    ("V100-SXM2-16GB (AWS p3.16xlarge)", "v100-16g"), ("V100 (DGX-2)", "v100-32g"), ("TPU v4", None),
])
def test_gpu_names_map_to_built_in_devices(gpu, device):
    assert _device(gpu) == device
    assert device is None or device in list_devices()


def _run(run_id: str, gpu: str = "A100-SXM4-80GB", seq_len: int | None = 2048, tp: int | None = 1,
         measured: dict | None = None) -> dict:
    return {"id": run_id, "group": "g", "precision": "bf16", "measured": {"tokens_per_s": 1000} if measured is None else measured,
            "model": {"layers": 2, "hidden": 256, "heads": 4, "vocab": 1024, "seq_len": seq_len},
            "hardware": {"gpu": gpu, "num_gpus": 8, "gpus_per_node": 8},
            "plan": {"tp": tp, "pp": 1, "global_batch": 64}}


def test_rows_are_skipped_only_for_a_missing_number(tmp_path):
    runs = [_run("kept"), _run("tpu", gpu="TPU v4"), _run("no-seq", seq_len=None), _run("no-tp", tp=None),
            _run("no-metric", measured={})]
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": runs}))
    rows, skipped = load_rows(None, path)
    assert [row.id for row in rows] == ["kept"]
    assert dict(skipped) == {"tpu": MISSING, "no-seq": MISSING, "no-tp": MISSING, "no-metric": "no step time, tokens/s or TFLOP/s"}


def test_layer_frequency_checkpointing_recomputes_every_second_block_whole(tmp_path):
    # torchtitan's "selective layer" rows wrap every second block in a full checkpoint, no other layer.
    run = _run("layer")
    run["plan"]["recompute"] = "selective layer"
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": [run, _run("plain")]}))
    (row, plain), _ = load_rows(None, path)
    assert (row.config["recompute"], row.checkpoint_every) == ("full", 2)
    graph = planner.trace("gpt3-125m", seq_len=128)
    policies = row_policies(graph, row)
    assert [layer.name for layer, policy in zip(graph.layers, policies) if policy == "full"] == \
        [f"layers.{i}" for i in range(1, 12, 2)]
    assert set(policies) == {"full", "none"}
    assert row_policies(graph, plain) is None


def test_a_mixture_of_experts_row_keeps_its_experts_and_expert_parallelism(tmp_path):
    run = {"id": "moe", "group": "g", "precision": "bf16", "measured": {"tokens_per_s": 1000},
           "model": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn_hidden": 14336, "vocab": 32000,
                     "seq_len": 4096, "moe": {"num_experts": 8, "top_k": 2}},
           "hardware": {"gpu": "H100-SXM5-80GB", "num_gpus": 64, "gpus_per_node": 8},
           "plan": {"tp": 1, "pp": 4, "ep": 8, "global_batch": 256, "micro_batch": 1, "zero_stage": 1, "recompute": "full"}}
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": [run]}))
    (row,), _ = load_rows(None, path)
    assert (row.spec["arch"], row.spec["experts"], row.spec["top_k"], row.spec["moe_ffn_hidden"]) == ("moe", 8, 2, 14336)
    assert (row.config["ep"], row.config["dp"], row.cluster) == (8, 16, "h100-sxm:8x8")
