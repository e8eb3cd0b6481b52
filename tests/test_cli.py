"""The command line (DESIGN.md contract): commands, JSON keys, plan files, errors and exit codes.

Commands run in-process through `cli.main`; one test runs `python cli.py` in a subprocess to see
what a shell sees (exit status, no traceback).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cli
import planner
from costmodel.memory import ALLOCATOR_FRAGMENTATION_FRACTION
from costmodel.profile_loader import load_device
from planner.cli_args import build_parser
from planner.report.plan import PUBLISHED_MAPE, alternatives_table
from planner.result import Alternative, Plan

REPO = Path(__file__).resolve().parent.parent
MODEL_ARGS = ["--model", "gpt3-125m", "--seq-len", "128"]
RUN_ARGS = [*MODEL_ARGS, "--cluster", "a100-80g:1x8", "--global-batch", "32"]
# DESIGN.md: built-in device names include at least these.
DESIGN_DEVICES = ("v100-32g", "a100-40g", "a100-80g", "h100-sxm", "h100-pcie", "h800", "h200", "b200", "gb200",
                  "mi250x", "mi300x", "l4", "l40s", "a10g", "rtx-4090", "cpu")
CONFIG_KEYS = {"tp", "pp", "dp", "cp", "ep", "vpp", "micro_batch", "num_microbatches", "zero", "recompute", "schedule"}
RESULT_KEYS = {"step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_bytes", "fits", "memory", "config"}


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `paraplan ARGV` (argparse errors exit through SystemExit)."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    # rich wraps tables to the terminal width; a wide one keeps names whole.
    monkeypatch.setenv("COLUMNS", "300")


def test_models_lists_the_zoo_spec_files(capsys):
    code, out, _ = run(["models"], capsys)
    assert code == 0
    assert sorted(out.split()) == sorted(p.stem for p in (REPO / "planner" / "zoo" / "specs").glob("*.yaml"))


def test_hardware_lists_devices_and_clusters(capsys):
    code, out, _ = run(["hardware"], capsys)
    assert code == 0
    names = set(out.replace("│", " ").split())
    assert set(DESIGN_DEVICES) <= names
    assert {p.stem for p in (REPO / "profiles" / "clusters").glob("*.yaml")} <= names


def test_hardware_shows_one_device_in_detail(capsys):
    code, out, _ = run(["hardware", "h100-sxm"], capsys)
    assert code == 0
    assert "h100-sxm" in out
    assert f"{int(load_device('h100-sxm').mem_bytes):,}" in out  # memory in bytes, as the profile gives it


def test_inspect_json_contract(capsys):
    code, out, _ = run(["inspect", *MODEL_ARGS, "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert {"model", "seq_len", "micro_batch", "trace_method", "params", "fwd_flops", "bwd_flops", "layers"} <= set(data)
    assert (data["model"], data["seq_len"], data["micro_batch"], data["trace_method"]) == ("gpt3-125m", 128, 1, "fx")
    # GPT-3 125M: L (12 h^2 + 13 h) in blocks (weights and biases of attention and MLP, two
    # LayerNorms), V h + S h in token and position tables (S = 2048 positions), 2 h final norm;
    # the head is tied to the token table.
    L, h, V, S, s = 12, 768, 51200, 2048, 128
    assert data["params"] == L * (12 * h * h + 13 * h) + V * h + S * h + 2 * h
    # Forward matmul FLOPs (Korthikanti et al. 2022, divided by 3): 24 s L h^2 (1 + s/6h + V/12hL).
    assert data["fwd_flops"] == pytest.approx(24 * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L)))
    assert data["bwd_flops"] == pytest.approx(2 * data["fwd_flops"])
    layers = data["layers"]
    assert [layer["name"] for layer in layers] == ["embed", *(f"layers.{i}" for i in range(L)), "head"]
    for layer in layers:
        assert {"name", "kind", "params", "fwd_flops", "bwd_flops", "saved_bytes", "out_bytes"} <= set(layer)
        assert set(layer["saved_bytes"]) == {"none", "selective", "full", "selective_op"}
    assert sum(layer["params"] for layer in layers) == data["params"]


def test_inspect_traces_in_the_requested_dtype(capsys):
    saved = {}
    for dtype in ("bf16", "fp32"):
        code, out, _ = run(["inspect", *MODEL_ARGS, "--dtype", dtype, "--json"], capsys)
        assert code == 0
        data = json.loads(out)
        assert data["dtype"] == dtype
        saved[dtype] = data["layers"][1]["saved_bytes"]["none"]
    # A block's saved activations are element-sized: fp32 keeps twice bf16's bytes (up to a few
    # dtype-independent tensors such as dropout masks).
    assert 1.8 < saved["fp32"] / saved["bf16"] <= 2.0


def test_evaluate_json_contract(capsys):
    argv = ["evaluate", *RUN_ARGS, "--tp", "2", "--pp", "2", "--micro-batch", "2", "--zero", "1", "--recompute", "selective", "--json"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    data = json.loads(out)
    assert RESULT_KEYS <= set(data)
    # 8 devices / (tp 2 * pp 2) = dp 2; 32 / (dp 2 * micro-batch 2) = 8 micro-batches.
    assert {k: data["config"][k] for k in CONFIG_KEYS} == {
        "tp": 2, "pp": 2, "dp": 2, "cp": 1, "ep": 1, "vpp": 1, "micro_batch": 2, "num_microbatches": 8,
        "zero": 1, "recompute": "selective", "schedule": "1f1b"}
    assert [row["stage"] for row in data["memory"]] == [0, 1]
    assert data["peak_memory_bytes"] == max(row["total_bytes"] for row in data["memory"])
    assert data["tokens_per_s"] == pytest.approx(32 * 128 / data["step_time_s"])
    assert isinstance(data["fits"], bool) and 0 < data["mfu"] < 1
    assert (data["seq_len"], data["global_batch"]) == (128, 32) and data["fixes"] == []
    # gpt2's attention is a fused kernel: selective recompute drops nothing and says so.
    assert len(data["notes"]) == 1 and data["notes"][0].startswith("--recompute selective drops 0.")


def test_evaluate_without_seq_len_says_the_length_it_priced(capsys):
    argv = ["--model", "gpt3-125m", "--cluster", "a100-80g:1x8", "--global-batch", "32"]
    code, out, _ = run(["evaluate", *argv, "--tp", "1", "--pp", "1", "--json"], capsys)
    data = json.loads(out)
    default = planner.trace("gpt3-125m").seq_len
    assert code == 0 and data["seq_len"] == default != 128
    assert f"no seq_len given: priced at {default} tokens per sequence, the model's own" in data["notes"]


def test_evaluate_help_states_the_recompute_it_prices_when_none_is_given(capsys):
    code, out, _ = run(["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "1", "--json"], capsys)
    assert code == 0 and json.loads(out)["config"]["recompute"] == "none"
    helps = {}
    for command in ("evaluate", "plan"):
        code, out, _ = run([command, "--help"], capsys)
        helps[command] = " ".join(out.split())
    assert "(default: 0 where it fits, else the fastest stage that fits)" in helps["evaluate"]
    assert "checkpointing (default: none)" in helps["evaluate"] and "searched" not in helps["evaluate"]
    assert helps["plan"].count("(searched when not given)") == 10 and "stage that fits" not in helps["plan"]


def test_evaluate_says_what_would_fit_and_how_to_shrink_a_bubble(capsys):
    # llama3-70b on 8 devices without ZeRO: ~70e9 x 18 B / 8 ranks of model states, far over 80 GB.
    # All 8 are pipeline stages (dp = 1), so ZeRO would have no data-parallel ranks to shard over.
    code, out, _ = run(["evaluate", "--model", "llama3-70b", "--cluster", "h100-sxm:1x8", "--global-batch", "8",
                        "--seq-len", "2048", "--tp", "1", "--pp", "8", "--micro-batch", "1", "--recompute", "full"], capsys)
    text = " ".join(out.split())
    assert code == 0
    assert re.search(r"Does not fit: stage \d+ needs [\d.]+ GiB of 79.19 GiB; its model states \([\d.]+ GiB\) shrink "
                     r"over more data-parallel devices", text)
    assert "--zero 3" not in text
    code, out, _ = run(["evaluate", "--model", "llama3-70b", "--cluster", "h100-sxm:1x8", "--global-batch", "8",
                        "--seq-len", "2048", "--tp", "1", "--pp", "4", "--micro-batch", "1", "--recompute", "full"], capsys)
    assert code == 0 and re.search(r"shrink under ZeRO-3 \(--zero 3\)", " ".join(out.split()))  # dp = 2: it shards
    # 8 micro-batches over 8 stages: (p - 1) / (m + p - 1) = 7/15 of 1F1B's step is bubble.
    assert re.search(r"The pipeline bubble idles the devices 4\d% of the step: .* an interleaved schedule \(--vpp 2", text)
    code, out, _ = run(["evaluate", *RUN_ARGS, "--tp", "2", "--pp", "1"], capsys)
    assert code == 0 and "Does not fit" not in out and "bubble idles" not in out


def test_evaluate_names_the_pipeline_buffers_where_they_exceed_the_overshoot(capsys):
    # llama2-70b at tp4 pp4 with 20 chunks per device and 32 micro-batches: the receive buffers
    # torch.distributed.pipelining preallocates (a forward input and a gradient per chunk and
    # micro-batch) take more than the stage is over capacity; with transient buffers it fits.
    argv = ["evaluate", "--model", "llama2-70b", "--cluster", "h100-sxm:8x8", "--global-batch", "128", "--seq-len", "4096",
            "--tp", "4", "--pp", "4", "--vpp", "20", "--micro-batch", "1", "--zero", "1"]
    code, out, _ = run([*argv, "--json"], capsys)
    row = max(json.loads(out)["memory"], key=lambda r: r["total_bytes"])
    assert code == 0 and row["comm_buffers_bytes"] > row["total_bytes"] - row["capacity_bytes"] > 0
    code, out, _ = run(argv, capsys)
    assert re.search(r"Its pipeline buffers \([\d.]+ GiB\) exceed the overshoot \([\d.]+ GiB\): .* \(--pp-buffers "
                     r"transient --pp-outputs dropped", " ".join(out.split()))
    code, out, _ = run([*argv, "--pp-buffers", "transient", "--json"], capsys)
    assert json.loads(out)["fits"]


def test_what_would_fit_names_only_levers_not_pulled(capsys):
    # llama3-405b over 16 H100s already at ZeRO-3 with its optimizer offloaded, in two replicas:
    # neither the device nor its 256 GiB share of host memory holds the states. Fewer replicas or
    # more devices would; ZeRO-3 and offload are no news.
    code, out, _ = run(["evaluate", "--model", "llama3-405b", "--cluster", "h100-sxm:2x8", "--global-batch", "16",
                        "--seq-len", "4096", "--tp", "8", "--pp", "1", "--zero", "3", "--recompute", "full",
                        "--micro-batch", "1", "--offload-optimizer", "--dp-replicate", "2"], capsys)
    text = " ".join(out.split())
    assert code == 0
    assert re.search(r"offloaded optimizer states need [\d.]+ GiB of host memory per device, over its 256.00 GiB share", text)
    assert "shrink with fewer hybrid-sharding replicas (--dp-replicate) or over more data-parallel devices" in text
    assert "--zero 3" not in text and "with --offload-optimizer" not in text


def test_plan_and_evaluate_carry_the_trace_notes(capsys):
    # How the model was measured (here: frozen parameters) reaches the results, not only `inspect`.
    workload = ["--model", "tests.fixtures.custom_models:frozen_first_block_gpt_factory", "--cluster", "a100-80g:1x2",
                "--global-batch", "8"]
    code, out, _ = run(["evaluate", *workload, "--tp", "1", "--pp", "1", "--json"], capsys)
    assert code == 0 and any("take no gradient (frozen)" in note for note in json.loads(out)["notes"])
    code, out, _ = run(["plan", *workload], capsys)
    assert code == 0 and "note: " in out and "frozen" in out


def test_plan_says_when_apply_cannot_run_its_tensor_parallel_layout(capsys):
    # A block with one fused qkv projection prices under tp 2, but Plan.apply runs the zoo's modules.
    argv = ["plan", "--cluster", "cpu:1x2", "--global-batch", "4", "--seq-len", "32", "--tp", "2", "--dtype", "fp32", "--json"]
    code, out, _ = run([*argv, "--model", "tests.fixtures.custom_models:fused_qkv_lm"], capsys)
    notes = json.loads(out)["notes"]
    assert code == 0 and any(note.startswith("Plan.apply cannot run this plan on this model: layout 1") for note in notes)
    code, out, _ = run([*argv, "--model", "gpt3-125m"], capsys)
    assert code == 0 and json.loads(out)["notes"] == []


def test_evaluate_fp32_prices_fp32_states_and_peak(capsys):
    """--dtype fp32 (an extension of the contract's bf16|fp16|fp8): on one device 16 B of model
    state per parameter instead of 18 (no master copy), and GEMMs at the fp32 peak, so the same
    step is slower."""
    base = ["evaluate", *MODEL_ARGS, "--cluster", "a100-80g:1x1", "--global-batch", "32", "--tp", "1", "--pp", "1", "--json"]
    results = {}
    for dtype in ("bf16", "fp32"):
        code, out, _ = run([*base, "--dtype", dtype], capsys)
        assert code == 0
        results[dtype] = json.loads(out)
    states = {dtype: sum(data["memory"][0][k] for k in ("weights_bytes", "grads_bytes", "optimizer_bytes"))
              for dtype, data in results.items()}
    assert states["fp32"] == pytest.approx(states["bf16"] * 16 / 18)
    assert results["fp32"]["step_time_s"] > results["bf16"]["step_time_s"]


@pytest.mark.parametrize("recompute,warned", [("none", True), ("full", False)])
def test_a_peak_within_the_memory_error_of_capacity_is_flagged(capsys, recompute, warned):
    # llama3-8b on 32 H100, 8K tokens, dp32 ZeRO-2, one sequence per micro-batch: 98% of memory without
    # recompute (within the model's 10% memory error of capacity), well under it with full recompute.
    args = ["evaluate", "--model", "llama3-8b", "--seq-len", "8192", "--cluster", "h100-sxm:4x8", "--global-batch", "256",
            "--tp", "1", "--pp", "1", "--zero", "2", "--micro-batch", "1", "--recompute", recompute]
    code, out, _ = run(args, capsys)
    assert code == 0 and ("within the cost model's memory error" in " ".join(out.split())) == warned


def test_evaluate_sp_gather_regathered_keeps_the_gathered_inputs_split(capsys):
    """--sp-gather regathered (Megatron-LM) keeps a 1/tp share of each all-gathered matmul input where
    the default keeps it whole: per block the inputs of q/k/v and of fc1, 2 B x b s h each, and the
    head's input once, (1 - 1/tp) of each fewer (gpt3-125m: 12 blocks, h 768; tp 2, micro-batch 4
    of 128 tokens, no recompute)."""
    base = ["evaluate", *RUN_ARGS, "--tp", "2", "--pp", "1", "--micro-batch", "4", "--recompute", "none", "--json"]
    rows = _memory_by_choice(capsys, base, "--sp-gather", ("kept", "regathered"))
    activations = {gather: memory[0]["activations_bytes"] for gather, memory in rows.items()}
    assert activations["kept"] - activations["regathered"] == pytest.approx((2 * 12 + 1) * 2 * 4 * 128 * 768 / 2, rel=1e-6)


def test_evaluate_fused_loss_holds_less_on_the_loss_stage(capsys):
    """--loss fused: the last stage keeps bf16 logits instead of fp32 log-probabilities and holds one
    bf16 gradient instead of two fp32 tensors: 2 + 6 B less per logit of a micro-batch
    (gpt3-125m's vocabulary of 51200, micro-batch 4 of 128 tokens), each with the allocator's share;
    nor does the allocator hold the dropped bf16 logits reserved beside them (2 B more, reserved
    only: `loss_cost.loss_held_copies`). The first stage is unchanged."""
    base = ["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "2", "--micro-batch", "4", "--json"]
    rows = _memory_by_choice(capsys, base, "--loss", ("torch", "fused"))
    first, last = ((rows["torch"][i]["total_bytes"] - rows["fused"][i]["total_bytes"]) for i in (0, 1))
    assert first == 0.0
    fragmentation = 1 + ALLOCATOR_FRAGMENTATION_FRACTION
    assert last == pytest.approx(8 * 4 * 128 * 51200 * fragmentation + 2 * 4 * 128 * 51200, rel=1e-3)


def test_evaluate_pp_outputs_kept_holds_every_micro_batch_s_logits_on_the_last_stage(capsys):
    """--pp-outputs kept (torch's `step()` default, torchtitan): the last stage keeps the fp32 logits
    of each of its 2 micro-batches (dp 4 at global batch 32, micro-batch 4) until the step ends,
    4 x 128 tokens x 51,200 x 4 B each, counted with its buffers; the first stage is unchanged."""
    base = ["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "2", "--micro-batch", "4", "--json"]
    rows = _memory_by_choice(capsys, base, "--pp-outputs", ("dropped", "kept"))
    first, last = ((rows["kept"][i]["comm_buffers_bytes"] - rows["dropped"][i]["comm_buffers_bytes"]) for i in (0, 1))
    assert (first, last) == (0.0, pytest.approx(2 * 4 * 128 * 51200 * 4, rel=1e-9))


def _memory_by_choice(capsys, args: list[str], flag: str, choices: tuple[str, ...]) -> dict[str, list[dict]]:
    """`evaluate --json`'s per-stage memory rows with `flag` set to each of `choices` (exit 0 each)."""
    rows = {}
    for choice in choices:
        code, out, _ = run([*args, flag, choice], capsys)
        assert code == 0
        rows[choice] = json.loads(out)["memory"]
    return rows


@pytest.mark.parametrize("flag, default, zero, exposed_key", [
    ("--zero3-fetch", "prefetch", "3", "fsdp_comm_exposed_s"),
    ("--dp-sync", "overlapped", "1", "dp_comm_exposed_s"),
])
def test_blocking_state_traffic_adds_to_the_step(capsys, flag, default, zero, exposed_key):
    """--zero3-fetch blocking (each ZeRO-3 fetch stalls compute) and --dp-sync blocking (the gradient
    all-reduce and parameter gather after the step): the same configuration takes longer by exactly
    its newly exposed traffic. The memory plan does not change, but for the layer a blocking fetch
    does not prefetch."""
    base = ["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "1", "--zero", zero, "--json"]
    results = {}
    for mode in (default, "blocking"):
        code, out, _ = run([*base, flag, mode], capsys)
        assert code == 0
        results[mode] = json.loads(out)
    slower_s = results["blocking"]["step_time_s"] - results[default]["step_time_s"]
    exposed_s = results["blocking"]["time_breakdown"][exposed_key] - results[default]["time_breakdown"][exposed_key]
    assert slower_s > 0 and slower_s == pytest.approx(exposed_s, rel=1e-6)
    memory = {mode: results[mode]["memory"][0] for mode in results}
    if flag == "--zero3-fetch":
        assert memory["blocking"].pop("weights_bytes") < memory[default].pop("weights_bytes")
        for moment in memory.values():
            del moment["overhead_bytes"], moment["total_bytes"]  # fragmentation follows the weights
    assert memory["blocking"] == memory[default]


def test_plan_json_contract(capsys):
    code, out, _ = run(["plan", *RUN_ARGS, "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert RESULT_KEYS | {"stages", "search", "alternatives"} <= set(data)
    assert CONFIG_KEYS <= set(data["config"])
    assert len(data["stages"]) == data["config"]["pp"]
    for stage in data["stages"]:
        assert {"layers", "ranks", "device"} <= set(stage)
    assert {"time_s", "candidates_evaluated", "status"} <= set(data["search"])
    assert data["alternatives"]
    for alternative in data["alternatives"]:
        assert CONFIG_KEYS <= set(alternative["config"])
        assert alternative["step_time_s"] >= data["step_time_s"]


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_plan_out_round_trips(capsys, tmp_path, suffix):
    path = tmp_path / f"plan{suffix}"
    code, out, _ = run(["plan", *RUN_ARGS, "--out", str(path), "--json"], capsys)
    assert code == 0
    assert Plan.load(path) == Plan.from_json(out)


def test_evaluate_prices_a_saved_plan_as_planned(capsys, tmp_path):
    # The plan is written into a folder that does not exist yet; evaluate --plan takes its degrees,
    # stages, per-layer recompute and dtype (fp32), and the training code it was planned with
    # (--elementwise fused).
    path = tmp_path / "new" / "plan.json"
    code, out, _ = run(["plan", *RUN_ARGS, "--dtype", "fp32", "--elementwise", "fused", "--out", str(path), "--json"], capsys)
    assert code == 0
    planned = json.loads(out)
    assert planned["training_code"]["elementwise"] == "fused"
    for workload in (RUN_ARGS, []):  # the plan records its model, cluster, batch and sequence
        code, out, _ = run(["evaluate", *workload, "--plan", str(path), "--json"], capsys)
        assert code == 0
        priced = json.loads(out)
        for key in ("step_time_s", "peak_memory_bytes", "config", "memory"):
            assert priced[key] == planned[key]
    code, out, _ = run(["evaluate", *RUN_ARGS, "--plan", str(path), "--elementwise", "eager", "--json"], capsys)
    assert code == 0 and json.loads(out)["step_time_s"] > planned["step_time_s"]
    # Twice the global batch: twice the micro-batches of the same size.
    doubled = [arg if arg != "32" else "64" for arg in RUN_ARGS]
    code, out, _ = run(["evaluate", *doubled, "--plan", str(path), "--json"], capsys)
    config = json.loads(out)["config"]
    assert code == 0 and config["num_microbatches"] == 2 * planned["config"]["num_microbatches"]
    assert config["micro_batch"] == planned["config"]["micro_batch"]


def test_a_plan_of_a_python_module_asks_for_the_model(capsys, tmp_path):
    # A plan made from a module object in Python names it by class; evaluate --plan cannot build it
    # and says to pass --model (with it, the plan prices as usual).
    path = tmp_path / "plan.json"
    assert run(["plan", *RUN_ARGS, "--out", str(path)], capsys)[0] == 0
    (tmp_path / "module.json").write_text(json.dumps({**json.loads(path.read_text()), "model": "LanguageModel"}))
    code, out, err = run(["evaluate", "--plan", str(tmp_path / "module.json")], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "the plan names model `LanguageModel`" in err and "pass --model" in err
    assert run(["evaluate", *MODEL_ARGS, "--plan", str(tmp_path / "module.json")], capsys)[0] == 0


def test_a_plan_of_files_names_them_by_absolute_path(capsys, tmp_path, monkeypatch):
    # The plan keeps the spec and cluster files' paths (not the spec's stem, which is no built-in
    # name, nor a built-in name the file shadows), made absolute: evaluate --plan alone finds them
    # again from another directory, where the relative paths would name other files or none.
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "llama3-8b.yaml").write_text(
        "arch: llama\nlayers: 2\nhidden: 256\nheads: 4\nkv_heads: 2\nffn_hidden: 512\nvocab: 1024\n")
    (tmp_path / "work" / "pair.yaml").write_text("groups:\n  - {device: h100-sxm, nodes: 1, devices_per_node: 2}\n")
    monkeypatch.chdir(tmp_path / "work")
    code, out, _ = run(["plan", "--model", "llama3-8b.yaml", "--seq-len", "128", "--cluster", "pair.yaml", "--global-batch", "4",
                        "--out", "plan.json", "--json"], capsys)
    planned = json.loads(out)
    assert code == 0 and (planned["model"], planned["cluster"]) == (str(Path("llama3-8b.yaml").resolve()), str(Path("pair.yaml").resolve()))
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["evaluate", "--plan", "work/plan.json", "--json"], capsys)
    assert code == 0 and json.loads(out)["step_time_s"] == planned["step_time_s"]


def test_peak_memory_names_the_fullest_device_of_a_mixed_cluster(capsys):
    # Stage 0 on 80 GB A100s, stage 1 on 32 GB V100s: the summary gives the fuller one, against its own capacity.
    code, out, _ = run(["evaluate", *MODEL_ARGS, "--cluster", "hetero-a100-v100-8n", "--global-batch", "64", "--tp", "4",
                        "--pp", "2", "--json"], capsys)
    rows = json.loads(out)["memory"]
    fullest = max(rows, key=lambda row: row["total_bytes"] / row["capacity_bytes"])
    assert code == 0 and fullest["device"] == "v100-32g"
    code, out, _ = run(["evaluate", *MODEL_ARGS, "--cluster", "hetero-a100-v100-8n", "--global-batch", "64", "--tp", "4",
                        "--pp", "2"], capsys)
    assert re.search(rf"peak memory .* of {fullest['capacity_bytes'] / 2**30:.2f} GiB on v100-32g", out)


def test_tables_render_without_json(capsys):
    code, out, _ = run(["evaluate", *RUN_ARGS, "--tp", "2", "--pp", "2"], capsys)
    assert code == 0 and "step time" in out and "Memory per device" in out
    assert "training code" not in out  # the defaults: no row
    code, out, _ = run(["plan", *RUN_ARGS], capsys)
    assert code == 0 and "Pipeline stages" in out
    code, out, _ = run(["inspect", *MODEL_ARGS], capsys)
    assert code == 0 and "layers.0-11 (x12)" in out  # identical blocks collapse into one row


def test_alternatives_caption_names_the_simplest_close_alternative(capsys):
    # The plan splits the model three ways (tp, pp, cp); of its alternatives, those within the
    # published-run error of its step time are listed as not separable, and the one that splits
    # least is named: the dp-only one, not the faster tp2 one; nothing is said when no alternative
    # within the error is simpler than the plan.
    code, out, _ = run(["plan", *RUN_ARGS, "--json"], capsys)
    plan = Plan.from_json(out)
    step_s = plan.estimate.step_time_s
    layered = dataclasses.replace(plan.config, tp=2, pp=2, cp=2, dp=1)
    alternatives = tuple(Alternative(config, step_s * ratio, 0.0, 0.0)
                         for config, ratio in ((dataclasses.replace(layered, pp=1, cp=1), 1.01),
                                               (dataclasses.replace(layered, tp=1, pp=1, cp=1), 1.03),
                                               (dataclasses.replace(layered, tp=1, pp=1, cp=1, zero=3), 1.2)))
    caption = alternatives_table(dataclasses.replace(plan, config=layered, alternatives=alternatives)).caption
    assert caption.startswith(f"2 of these are within {PUBLISHED_MAPE:.1%} of the plan")
    assert alternatives[1].config.short() in caption and "data parallel only, against the plan's 3" in caption
    assert "+3.0% step time" in caption
    assert alternatives_table(dataclasses.replace(plan, config=alternatives[1].config, alternatives=alternatives)).caption is None


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "cluster.yaml").write_text("name: x\ngroups: [1, 2\n")
    (root / "typo.yaml").write_text("arch: gpt\nlayers: 2\nhidden: 64\nhaeds: 4\nvocab: 128\n")
    (root / "huge.yaml").write_text("arch: gpt\nlayers: 2\nhidden: 64\nheads: 4\nvocab: 100000000000000000000000\n")
    (root / "truncated.json").write_text('{"schema_version": 1, "model": ')
    fields = {"schema_version": 1, "model": "m", "cluster": "c", "global_batch": 32, "seq_len": 128, "dtype": "bf16", "config": {},
              "step_time_s": 1.0, "tokens_per_s": 1.0, "tflops_per_gpu": 1.0, "mfu": 0.5, "peak_memory_bytes": 1.0, "fits": True,
              "time_breakdown": {}, "memory": []}
    (root / "stage.json").write_text(json.dumps({**fields, "stages": ["stage 0"]}))
    (root / "binary.csv").write_bytes(b"\x00\xff\xfe garbage\n")
    return root


# (argv, a text the one-line message must contain)
BAD_INPUT = [
    pytest.param(["evaluate", "--model", "gpt3-175bb", "--cluster", "a100-80g:1x8", "--global-batch", "8", "--tp", "1", "--pp", "1"],
                 "gpt3-175b", id="unknown model lists the nearest names"),
    pytest.param(["evaluate", *MODEL_ARGS, "--cluster", "h100-sxn:1x8", "--global-batch", "8", "--tp", "1", "--pp", "1"],
                 "h100-sxm", id="unknown device in shorthand"),
    pytest.param(["evaluate", *MODEL_ARGS, "--cluster", "{bad}/cluster.yaml", "--global-batch", "8", "--tp", "1", "--pp", "1"],
                 "cluster.yaml", id="malformed cluster file"),
    pytest.param(["evaluate", *RUN_ARGS, "--tp", "3", "--pp", "1"], "tp*pp*cp = 3*1*1", id="impossible degrees"),
    pytest.param(["evaluate", *MODEL_ARGS, "--cluster", "a100-80g:1x8", "--global-batch", "0", "--tp", "1", "--pp", "1"],
                 "--global-batch", id="zero global batch"),
    pytest.param(["evaluate", *RUN_ARGS, "--tp", "-2", "--pp", "1"], "--tp", id="negative degree"),
    pytest.param(["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "1", "--vpp", "2"], "vpp=2: interleaving virtual pipeline "
                 "stages needs pp > 1", id="virtual stages without a pipeline"),
    pytest.param(["evaluate", "--model", "{bad}/typo.yaml", "--seq-len", "16", "--cluster", "a100-80g:1x8", "--global-batch", "8",
                  "--tp", "1", "--pp", "1"], "did you mean `heads`", id="spec file with a typo key"),
    pytest.param(["inspect", "--model", "{bad}/huge.yaml", "--seq-len", "16"], "torch cannot build it",
                 id="spec size beyond 64 bits"),
    pytest.param(["hardware", "h100-sxn"], "h100-sxn", id="unknown hardware name"),
    pytest.param(["evaluate", *RUN_ARGS, "--tp", "8", "--pp", "1"], "tp=8: must divide the 12 attention heads; fix: use tp 1 or 2 or 4",
                 id="tp not dividing the heads names the tp that do"),
    pytest.param(["plan", *RUN_ARGS, "--dp", "3"], "dp=3: does not divide the cluster's 8 devices", id="fixed dp not dividing"),
    pytest.param(["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "1", "--micro-batch", "3"],
                 "global_batch=32: must be a multiple of dp*micro_batch = 8*3; use a multiple of 24, or a micro-batch dividing 4",
                 id="a micro-batch the batch split cannot take names the fix"),
    pytest.param(["evaluate", *RUN_ARGS, "--tp", "3", "--pp", "1"],
                 "must divide the cluster's 8 devices; pick tp, pp and cp whose product divides 8", id="degrees not dividing the devices"),
    pytest.param(["plan", *RUN_ARGS, "--dtype", "fp8"], "a100-80g has no fp8 peak; fix: pass --dtype bf16 or fp16 or fp32",
                 id="dtype the device lacks"),
    pytest.param(["inspect", "--model", "tests.fixtures.custom_models:fixed_inputs_despite_arguments_factory", "--seq-len", "128"],
                 "called with seq_len=128, the factory returned example inputs with seq_len 64", id="factory inputs of another shape"),
    pytest.param(["inspect", "--model", "tests.fixtures.custom_models:fixed_tiny_gpt_factory", "--micro-batch", "8"],
                 "fixed example inputs of 2 samples", id="micro-batch a model's inputs fix"),
    pytest.param(["inspect", "--model", "tests.fixtures.custom_models:exiting_factory"], "raised SystemExit: config missing",
                 id="factory that exits"),
    pytest.param(["plan", *RUN_ARGS, "--out", "{bad}/plan.txt"], "plan.txt", id="unknown plan file extension"),
    pytest.param(["evaluate", *RUN_ARGS, "--tp", "2"], "--pp required", id="evaluate without degrees or a plan"),
    pytest.param(["inspect", "--model", "gpt3-125m", "--seq-len", "1000000000"], "seq_len=1000000000: too long for model",
                 id="a sequence too long for any tensor"),
    pytest.param(["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "1", "--schedule", "zb"], "schedule=zb: a pipeline schedule "
                 "needs pp > 1", id="evaluate a pipeline schedule without pipeline stages"),
    pytest.param(["evaluate", *MODEL_ARGS, "--cluster", "", "--global-batch", "8", "--tp", "1", "--pp", "1"], "cluster '': unknown",
                 id="evaluate with an empty cluster"),
    pytest.param(["evaluate", "--model", "", "--cluster", "a100-80g:1x8", "--global-batch", "8", "--tp", "1", "--pp", "1"],
                 "model ``: not a built-in model", id="evaluate with an empty model"),
    pytest.param(["evaluate", *MODEL_ARGS, "--tp", "2"], "--cluster, --global-batch, --pp required",
                 id="evaluate without a workload or a plan"),
    pytest.param(["evaluate", *RUN_ARGS, "--plan", "{bad}/truncated.json"], "not a paraplan plan", id="malformed plan file"),
    pytest.param(["evaluate", *RUN_ARGS, "--plan", "{bad}/none.json", "--tp", "2", "--micro-batch", "2"], "--tp, --micro-batch also given",
                 id="a plan and degrees together"),
    pytest.param(["evaluate", *RUN_ARGS, "--plan", "{bad}"], "IsADirectoryError", id="a folder as the plan file"),
    pytest.param(["report", "{bad}/binary.csv", "--out", "{bad}/report.md"], "not a text file", id="a binary results file"),
    pytest.param(["report", "{bad}/truncated.json", "--out", "{bad}/report.md"], "results file", id="results file of another kind"),
    pytest.param(["plan", *RUN_ARGS, "--timeline", "{bad}/c.png", "--memory-chart", "{bad}/c.png"], "the same file as --timeline",
                 id="one path for both charts"),
    pytest.param(["report", str(REPO / "benchmarks" / "results" / "sweep_144.csv"), "--out", "{bad}/cluster.yaml/report.md"],
                 "cluster.yaml", id="an output path under a file"),
    pytest.param(["plan", *RUN_ARGS, "--recompute", "full", "--top", "1", "--timeline", "{bad}/cluster.yaml/t.png"],
                 "cluster.yaml is not a directory", id="a chart path under a file"),
    pytest.param(["evaluate", *RUN_ARGS, "--plan", "{bad}/stage.json"], "plan field `stages[0]`", id="a plan with a malformed stage"),
    pytest.param(["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "1", "--zero", "3", "--dp-replicate", "3"],
                 "dp_replicate=3: must divide dp=8", id="replicas not dividing dp"),
    pytest.param(["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "1", "--dp-replicate", "2"],
                 "zero=0 shards nothing", id="hybrid sharding without ZeRO"),
    pytest.param(["plan", *RUN_ARGS, "--zero", "0", "--dp-replicate", "2"], "dp_replicate=2 with zero=0: hybrid sharding",
                 id="plan with hybrid sharding and no ZeRO"),
    pytest.param(["plan", *RUN_ARGS, "--offload-optimizer", "--no-offload"], "(--offload-optimizer with --no-offload): they contradict",
                 id="offload both asked for and refused"),
    pytest.param(["plan", *RUN_ARGS, "--tp", "4", "--cp", "4"], "tp=4 x cp=4 = 16 devices: does not divide the cluster's 8",
                 id="fixed degrees whose product does not divide the devices"),
    pytest.param(["plan", *RUN_ARGS, "--dp", "1", "--tp", "2", "--pp", "2", "--cp", "1"],
                 "dp=1 x tp=2 x pp=2 x cp=1 = 4 devices: is not the cluster's 8", id="every degree fixed, to another device count"),
    pytest.param(["plan", *RUN_ARGS, "--pp", "1", "--vpp", "2"], "vpp=2 with pp=1: a pipeline schedule needs pipeline stages",
                 id="virtual stages without a pipeline"),
    pytest.param(["plan", *RUN_ARGS, "--pp", "1", "--schedule", "zb"], "schedule=zb with pp=1: a pipeline schedule needs",
                 id="a pipeline schedule without a pipeline"),
    pytest.param(["plan", *RUN_ARGS, "--pp", "2", "--vpp", "2", "--schedule", "zb"],
                 "vpp=2 with schedule=zb: model chunks run only under the interleaved schedule", id="virtual stages under zero bubble"),
    pytest.param(["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "1", "--cp", "8", "--cp-comm", "a2a"],
                 "cp=8 with cp_comm=a2a: the all-to-all splits each rank's 12 query", id="Ulysses cp not dividing the heads"),
]


@pytest.mark.parametrize("argv,mentions", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(capsys, bad_files, argv, mentions):
    code, out, err = run([arg.replace("{bad}", str(bad_files)) for arg in argv], capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("paraplan")
    assert mentions in err


def test_an_interrupt_is_one_line_and_exit_130(capsys, monkeypatch):
    def interrupted(args, json_out):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    code, out, err = run(["plan", *RUN_ARGS], capsys)
    assert (code, out, err) == (130, "", "paraplan: interrupted\n")


def test_sigterm_is_one_line_and_exit_143(capsys, monkeypatch):
    # `timeout` and batch schedulers send SIGTERM; the command says so instead of dying silently.
    def terminated(args, json_out):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return 0

    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli, "_run", terminated)
    try:
        code, out, err = run(["plan", *RUN_ARGS], capsys)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (code, out, err) == (143, "", "paraplan: terminated\n")


def test_sigterm_while_tracing_is_not_taken_for_a_trace_failure(capsys, monkeypatch, tmp_path):
    # The tracer tries fx, then export, then a module-level capture, each under `except Exception`:
    # the signal must end the command, not make it fall back to another method (and cache that).
    monkeypatch.setenv("PARAPLAN_CACHE_DIR", str(tmp_path))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code, out, err = run(["inspect", "--model", "tests.fixtures.custom_models:signalled_factory"], capsys)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (code, out, err) == (143, "", "paraplan: terminated\n")


def test_a_factory_module_in_the_current_directory_imports(capsys, monkeypatch, tmp_path):
    # The console script's sys.path holds its own folder, not the caller's: `paraplan` adds the
    # current directory as `python -m` does, so `--model mymodel:build` finds ./mymodel.py.
    (tmp_path / "paraplan_cwd_model.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def build():\n    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), (torch.ones(4, 8),)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "paraplan_cwd_model", raising=False)
    code, out, err = run(["inspect", "--model", "paraplan_cwd_model:build", "--json"], capsys)
    assert (code, err) == (0, "")
    assert json.loads(out)["params"] == 8 * 8 + 8 + 8 * 2 + 2


@pytest.mark.parametrize("command, key", [
    (["inspect"], "fwd_flops"),
    (["evaluate", "--cluster", "a100-80g:1x1", "--global-batch", "4", "--tp", "1", "--pp", "1"], "step_time_s"),
])
def test_json_stays_whole_when_the_factory_prints(capsys, monkeypatch, tmp_path, command, key):
    (tmp_path / "paraplan_chatty_model.py").write_text(
        "import torch\nfrom torch import nn\nprint('importing the model')\n"
        "def build():\n    print('building')\n    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), (torch.ones(4, 8),)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "paraplan_chatty_model", raising=False)
    code, out, err = run([command[0], "--model", "paraplan_chatty_model:build", *command[1:], "--json"], capsys)
    assert code == 0
    assert json.loads(out)[key] > 0
    assert "importing the model\nbuilding\n" in err


def test_evaluate_of_a_cached_graph_never_imports_torch(tmp_path):
    # Importing torch takes a second or two; a graph from the on-disk cache is priced without it.
    env = {**os.environ, "PARAPLAN_CACHE_DIR": str(tmp_path)}
    argv = ["evaluate", "--model", "gpt3-125m", "--cluster", "a100-80g:1x8", "--global-batch", "8", "--seq-len", "128",
            "--tp", "2", "--pp", "2", "--json"]
    code = f"import sys, cli; code = cli.main({argv!r}); print(code, 'torch' in sys.modules, file=sys.stderr)"
    for expected in ("0 True", "0 False"):  # traced (torch), then cached
        run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert run.stderr.strip().splitlines()[-1] == expected, run.stderr


def test_a_shorthand_of_a_billion_devices_is_refused_not_searched_forever(capsys):
    code, _, err = run(["plan", *MODEL_ARGS, "--cluster", "h100-sxm:125000000x8", "--global-batch", "32"], capsys)
    assert code == 2 and "NODES: 1000000000 devices in one cluster is implausible (at most 4194304)" in err


def test_output_paths_are_checked_before_any_work_and_nothing_is_half_written(capsys, tmp_path):
    # A chart path the file system refuses (/proc takes no new files), a folder that is a file, a
    # report path that is a directory: exit 2 naming the option, and no other output written.
    plan_out = tmp_path / "plan.json"
    code, _, err = run(["plan", *RUN_ARGS, "--out", str(plan_out), "--timeline", "/proc/paraplan-x.png"], capsys)
    assert code == 2 and err.startswith("paraplan: --timeline /proc/paraplan-x.png: cannot be written")
    assert not plan_out.exists()
    # A file or folder under a folder to be made where the file system refuses one (even to root).
    code, _, err = run(["plan", *RUN_ARGS, "--out", "/proc/paraplan-sub/p.json"], capsys)
    assert code == 2 and err.startswith("paraplan: --out /proc/paraplan-sub/p.json: /proc cannot take new files")
    (tmp_path / "afile").write_text("")
    results = tmp_path / "r.csv"
    sweep_args = ["sweep", "--models", "gpt3-125m", "--devices", "a100-80g", "--cluster-sizes", "8", "--global-batches", "32",
                  "--seq-lens", "128", "--out", str(results)]
    for option in ("--plan-dir", "--charts"):
        code, _, err = run([*sweep_args, option, str(tmp_path / "afile" / "sub")], capsys)
        assert code == 2 and f"paraplan: {option} {tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} is a file" in err
        code, _, err = run([*sweep_args, option, "/proc/paraplan-charts"], capsys)
        assert code == 2 and f"paraplan: {option} /proc/paraplan-charts: /proc cannot take new files" in err
    assert not results.exists()
    (tmp_path / "report.md").mkdir()
    code, _, err = run(["report", str(results), "--out", str(tmp_path / "report.md")], capsys)
    assert code == 2 and "is a directory; give a file path" in err and list(tmp_path.glob("report*")) == [tmp_path / "report.md"]


def test_report_on_what_is_not_a_sweeps_results_names_the_file_to_give(capsys, tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("name,value\na,1\n")
    (tmp_path / "folder.csv").mkdir()
    for results, problem in ((other, f"{other}:1: the header is not this paraplan's sweep columns"),
                             (tmp_path / "folder.csv", f"results file {tmp_path / 'folder.csv'}: is a directory")):
        code, _, err = run(["report", str(results), "--out", str(tmp_path / "r.md")], capsys)
        assert code == 2 and err == f"paraplan: {problem}; give a results file `paraplan sweep` wrote (a sweep: write to a new --out file)\n"


def test_a_sweep_with_points_that_failed_unexpectedly_exits_1_saying_so(capsys, tmp_path, monkeypatch):
    import planner.sweeps.runner

    def broken(model, seq_len=None, dtype="bf16"):
        raise NameError("name 'CP_MAX' is not defined")

    monkeypatch.setattr(planner.sweeps.runner, "model_graph", broken)
    results = tmp_path / "r.csv"
    code, _, err = run(["sweep", "--models", "gpt3-125m", "--devices", "a100-80g", "--cluster-sizes", "8", "--global-batches",
                        "32", "--seq-lens", "128", "--out", str(results), "--workers", "1"], capsys)
    assert code == cli.SWEEP_ERRORS_EXIT == 1
    assert err == (f"paraplan: 1 of 1 points failed with an unexpected error (status error in {results}); re-run the same "
                   f"command to plan them again\n")


def test_nothing_fits_exits_3_saying_what_would(capsys):
    # llama2-7b needs 18 B x 6.7e9 = 121 GB of model states; one A100 has 40 GB (offload forbidden).
    code, out, err = run(["plan", "--model", "llama2-7b", "--seq-len", "256", "--cluster", "a100-40g:1x1", "--global-batch", "8",
                          "--no-offload"], capsys)
    assert code == 3
    assert out == ""
    assert err.count("\n") == 1
    assert "no plan fits" in err and "devices" in err


def test_under_json_an_error_is_also_a_json_object_on_standard_output(capsys):
    # A script reading --json gets the error as the one object on standard output; the line on
    # standard error and the exit code stay as without --json.
    bad = ["evaluate", *RUN_ARGS, "--tp", "3", "--pp", "1"]
    code, out, err = run(bad, capsys)
    assert code == 2 and out == ""
    code, out, json_err = run([*bad, "--json"], capsys)
    assert code == 2 and json_err == err
    assert json.loads(out) == {"error": {"kind": "invalid_input", "message": err.removeprefix("paraplan: ").rstrip("\n"),
                                         "exit_code": 2}}
    code, out, err = run(["plan", "--model", "llama2-7b", "--seq-len", "256", "--cluster", "a100-40g:1x1", "--global-batch", "8",
                          "--no-offload", "--json"], capsys)
    error = json.loads(out)["error"]
    assert code == 3 and error["kind"] == "insufficient_memory" and error["exit_code"] == 3
    assert err == f"paraplan: {error['message']}\n" and "no plan fits" in error["message"]


@pytest.mark.parametrize("argv, message", [
    (["inspect", *MODEL_ARGS[:2], "--seq-len", "0"], "argument --seq-len: --seq-len=0: must be a positive integer"),
    (["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "1", "--recompute", "some"], "argument --recompute: invalid choice: 'some'"),
    (["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "1", "--micro_batch", "2"],
     "unrecognized arguments: --micro_batch 2; did you mean --micro-batch?"),
    (["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "1", "--foo", "3"], "unrecognized arguments: --foo 3"),
    ([], "the following arguments are required: command; give one of models, hardware, inspect,"),
])
def test_a_bad_flag_is_one_line_and_under_json_a_json_object_too(capsys, argv, message):
    # Flags argparse rejects are reported as every other bad input: one line on standard error, exit
    # 2, and under --json the error object on standard output; an unknown flag close to one of the
    # subcommand's names that one.
    code, out, err = run(argv, capsys)
    assert code == 2 and out == "" and err.startswith(f"paraplan: {message}") and err.count("\n") == 1
    code, out, json_err = run([*argv, "--json"], capsys)
    assert code == 2 and json_err == err
    assert json.loads(out)["error"]["message"] == err.removeprefix("paraplan: ").rstrip("\n")


@pytest.mark.parametrize("model", ["gpt3-125m", "tests.fixtures.custom_models:mismatched_inputs_factory"])
def test_console_entry_exit_status_and_no_traceback(model):
    # In a fresh process, as a user runs it: a model no capture method can run prints only the
    # one-line reason, not what torch logs while each method fails.
    result = subprocess.run([sys.executable, "cli.py", "evaluate", "--model", model, "--cluster", "a100-80g:1x8",
                             "--global-batch", "32", "--tp", "3" if model == "gpt3-125m" else "1", "--pp", "1"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    expected = "tp*pp*cp = 3*1*1 = 3" if model == "gpt3-125m" else f"model `{model}`: cannot trace"
    assert result.stderr.startswith(f"paraplan: {expected}")
    if model != "gpt3-125m":  # not a tracing problem: the module cannot run its own inputs
        assert "fix: it fails in plain eager PyTorch too, so check that module's forward and the example inputs" in result.stderr


@pytest.mark.parametrize("command", ["evaluate", "plan", "sweep"])
def test_training_code_flags_offer_exactly_the_cost_models_choices(command):
    # The flags list their choices literally (importing the cost model would slow every command's
    # start); they must stay those TrainingCode accepts. A flag not given is None, so `evaluate
    # --plan` keeps the plan's choice, and `planner.plan` then takes TrainingCode's default.
    from planner.api import plan
    from planner.training_code import TrainingCode

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = {action.dest: action for action in subparsers.choices[command]._actions}
    flags = {"tp_overlap": "tp_overlap" if command == "sweep" else "tp_comm_overlap"}
    for name, default in TrainingCode().options().items():
        action = actions[flags.get(name, name)]
        assert tuple(action.choices) == TrainingCode.choices(name)
        assert action.default is None
        assert inspect.signature(plan).parameters[name].default == default


def test_evaluate_says_which_training_code_it_priced(capsys):
    # The figures assume the training code's kernels and overlap: the JSON carries every choice, the
    # tables name those besides the defaults, and a saved plan's choices come back with it.
    args = ["evaluate", *RUN_ARGS, "--tp", "2", "--pp", "1", "--tp-comm-overlap", "forward", "--loss", "fused"]
    code, out, _ = run([*args, "--json"], capsys)
    assert code == 0
    from planner.training_code import TrainingCode
    assert json.loads(out)["training_code"] == {**TrainingCode().options(), "tp_overlap": "forward", "loss": "fused"}
    code, out, _ = run(args, capsys)
    assert code == 0 and "training code" in out and "tp_overlap=forward, loss=fused" in " ".join(out.split())
    code, out, _ = run(["plan", *RUN_ARGS, "--loss", "fused"], capsys)
    assert code == 0 and "loss=fused" in " ".join(out.split())


def test_tp_comm_overlap_alone_means_full_overlap(capsys):
    # `--tp-comm-overlap` was a switch: given without a value it keeps meaning Megatron-Core's overlap.
    args = ["evaluate", *RUN_ARGS, "--tp", "4", "--pp", "1", "--json"]
    steps = {}
    for flag in ([], ["--tp-comm-overlap"], ["--tp-comm-overlap", "full"], ["--tp-comm-overlap", "forward"]):
        code, out, _ = run([*args, *flag], capsys)
        assert code == 0
        steps[" ".join(flag)] = json.loads(out)["step_time_s"]
    assert steps["--tp-comm-overlap"] == steps["--tp-comm-overlap full"]
    assert steps["--tp-comm-overlap full"] < steps["--tp-comm-overlap forward"] < steps[""]


@pytest.mark.parametrize("pp,named", [(1, False), (2, True)])
def test_the_time_caption_names_tied_weights_only_where_stages_could_split_them(capsys, pp, named):
    # gpt3-125m ties its embedding and head: their gradients are summed across pipeline stages only.
    args = ["evaluate", *RUN_ARGS, "--tp", "1", "--pp", str(pp), "--zero", "0"]
    code, out, _ = run(args, capsys)
    text = " ".join(out.split())
    assert code == 0 and "FSDP2's buffer copies" in text and ("tied across pipeline stages" in text) == named


def test_a_model_without_a_token_sequence_reads_in_samples(capsys):
    # A ResNet's images count one token per sample (README): the plan speaks of samples; a language
    # model's of tokens.
    code, out, _ = run(["plan", "--model", "tests.fixtures.custom_models:resnet_factory", "--cluster", "a100-80g:1x2",
                        "--global-batch", "64"], capsys)
    text = " ".join(out.split())
    assert code == 0 and "global batch 64 samples" in text and " samples/s" in text and "tokens" not in text
    code, out, _ = run(["plan", *RUN_ARGS], capsys)
    text = " ".join(out.split())
    assert code == 0 and "global batch 32 x 128 tokens" in text and " tokens/s" in text and "samples" not in text


def test_a_small_model_on_cpus_shows_its_memory_in_mib_and_its_flops_in_gflops(capsys):
    # The tiny Llama on two CPU devices holds well under a GiB and runs well under a TFLOP/s: in GiB and
    # TFLOP/s every figure read 0.0.
    code, out, _ = run(["evaluate", "--model", str(REPO / "examples" / "tiny-llama.yaml"), "--cluster", "cpu:1x2",
                        "--global-batch", "8", "--seq-len", "128", "--tp", "1", "--pp", "1", "--dtype", "fp32"], capsys)
    text = " ".join(out.split())
    assert code == 0 and "Memory per device by pipeline stage (MiB)" in text and " GFLOP/s " in text
    code, out, _ = run(["evaluate", *RUN_ARGS, "--tp", "1", "--pp", "1"], capsys)
    assert "Memory per device by pipeline stage (GiB)" in " ".join(out.split())
