"""The published-runs loader of benchmarks/published.py: GPU names to device profiles, and rows to specs and configs."""
from __future__ import annotations

import json

import pytest

from benchmarks.published_rows import REFERENCE, _device, load_rows
from costmodel.profile_files import list_devices


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


def test_reference_rows_are_skipped_only_for_a_missing_number():
    rows, skipped = load_rows(None)
    runs = {run["id"]: run for run in json.loads(REFERENCE.read_text())["runs"]}
    assert len(rows) + len(skipped) == len(runs)
    for run_id, reason in skipped:
        run = runs[run_id]
        stated = (_device(run["hardware"]["gpu"]), run["model"].get("seq_len"), run["plan"].get("global_batch"),
                  run["plan"].get("tp"), run["plan"].get("pp"))
        assert any(value is None for value in stated) or reason.startswith("no step time"), run_id


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
