"""Published training runs (shared/reference/published-runs.json) as paraplan inputs.

Each row becomes a model spec, a cluster shorthand, the run's own parallel configuration, and the
published step time, converted from the source's own metric with the source's FLOP convention
(`peak_conventions` in the file). Fields a row leaves out are filled by a stated rule
(`FILL_RULES`), never per row.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from planner.graph import LayerKind, ModelGraph, Recompute

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "published-runs.json"

# Groups the cost-model accuracy goal is stated for (issue: Megatron-LM 2021 Tables 1-2,
# Megatron-Core H100 scaling, Korthikanti 2022 Table 5, torchtitan, MosaicML MPT).
GOAL_GROUPS = ("megatron2021_weak", "megatron2021_zero3_vs_ptd", "megatron_core_h100", "korthikanti2022_table5",
               "torchtitan_2024_08", "llmfoundry_mpt")

FILL_RULES = {
    "nic": "the built-in link of the row's stated inter-node network where it is not the device's usual one "
           "(STATED_NICS: BLOOM's 4 Omni-Path links per 8-GPU node -> opa-4x100g-8gpu; Alpa's 25 Gbps between "
           "p3.16xlarge nodes -> eth-25g-8gpu); the device's usual NIC otherwise",
    "device": "the profile of the row's GPU: h100-hbm2e when an H100 row says HBM2e (torchtitan's lower-TDP parts), "
              "else h100-sxm; a100-40g or a100-80g, v100-16g or v100-32g by the stated memory; any other built-in device "
              "by its name (`DEVICE_PATTERNS`)",
    "micro_batch": "1 when the source gives none (Megatron's default for its large-model runs); for Megatron-LM "
                   "2020 each replica's whole batch (global / dp: no gradient accumulation before the 2021 "
                   "pipeline schedules)",
    "seq_len, vocab, recompute (Megatron-LM 2020)": "1024, 51200 and full: the table states none of them, and "
                                                    "with these every row's TFLOP/s follows from its iteration "
                                                    "time by the 96-formula to 0.1 TFLOP/s",
    "recompute, zero_stage": "when the source gives none: the least memory-saving choice under which the run fits "
                             "(ZeRO 0..3, then recompute none, selective, full), since the run did fit; "
                             "'FSDP ...' means ZeRO-3; torchtitan's 'selective layer' is full recompute on every "
                             "second block (LAYER_FREQUENCY_RECOMPUTE)",
    "model.ffn_hidden": "4 x hidden when absent (GPT)",
    "arch": "llama when the row has kv_heads or a non-4h FFN with a 'Llama' name, else gpt",
    "dtype": "fp16 on V100 (no bf16), fp8 when the precision names fp8 (fp8 linear GEMMs, the rest bf16), "
             "bf16 otherwise",
    "tp_overlap": "full when the source's flags include --tp-comm-overlap (Megatron-Core userbuffer overlap); forward "
                  "when the run names AsyncTP (PyTorch's async tensor parallelism of 2024, the forward pass's "
                  "collectives only: planner.layer_comm.TpOverlap); none otherwise",
    "zero_stage (Megatron-Core)": "1 when the source's flags include --overlap-param-gather, which needs the distributed "
                                  "optimizer (ZeRO-1)",
    "attention": "unfused for runs published before FlashAttention (May 2022) and the frameworks of that era "
                 "(Megatron-LM 2020-2022, Megatron-DeepSpeed/BLOOM, metaseq/OPT, Alpa); flash1 for MosaicML's MPT runs "
                 "(their 2023 yamls set attn_impl: triton, the first FlashAttention's Triton port); flash otherwise",
    "zero3_fetch": "blocking for Megatron-LM 2021 Table 2 (its ZeRO-3 rows ran DeepSpeed's ZeRO-3, published April "
                   "2021, before DeepSpeed PR #1188 of June 2021 made fetches overlap); prefetch otherwise",
    "dp_sync": "blocking for BLOOM (Megatron-DeepSpeed's pipeline engine with DeepSpeed's BF16_Optimizer, which the "
               "run names: fp32 gradients all-reduced after the last backward, ZeRO-1 parameters gathered after the "
               "step); overlapped otherwise",
    "pp_buffers": "transient for every row: the pipelined runs used Megatron-LM, Megatron-DeepSpeed or Alpa, which "
                  "hold received tensors only while in flight, not torch.distributed.pipelining",
    "loss": "fused for llm-foundry's MPT runs (ComposerMPTCausalLM's default loss_fn is 'fused_crossentropy', "
            "flash-attn's xentropy kernel); inplace for the runs of Megatron-LM code (Megatron-LM, Megatron-Core, "
            "Megatron-DeepSpeed: vocab_parallel_cross_entropy works in place on the fp32 logits); torch (fp32 logits, "
            "F.cross_entropy) otherwise",
    "sp_gather": "regathered for the runs of Megatron-LM code (as for loss: its sequence-parallel linears save their "
                 "split input and gather it again in backward); kept (autograd saves the gathered input, PyTorch's "
                 "DTensor styles) otherwise",
}

# Fields a group's source leaves out that its own figures pin down (FILL_RULES).
GROUP_MODEL_FILLS = {"megatron2020_tp_scaling": {"seq_len": 1024, "vocab": 51200}}
GROUP_PLAN_FILLS = {"megatron2020_tp_scaling": {"recompute": "full"}}
# Groups trained without gradient accumulation: a replica's batch is one micro-batch.
NO_ACCUMULATION_GROUPS = ("megatron2020_tp_scaling",)

# Inter-node networks a row's `hardware.interconnect` states (pattern), as built-in link profiles (FILL_RULES "nic").
STATED_NICS = ((r"\b4 Omni-Path", "opa-4x100g-8gpu"), (r"\b25 Gbps inter-node", "eth-25g-8gpu"))

# Groups whose ZeRO-3 fetched parameters blocking (`planner.state_cost.Zero3Fetch`).
BLOCKING_ZERO3_GROUPS = ("megatron2021_zero3_vs_ptd",)

# Groups whose data-parallel synchronisation blocks (`planner.state_cost.DpSync`).
BLOCKING_DP_SYNC_GROUPS = ("bloom",)

# Groups whose training code computes the cross-entropy with a fused kernel over half-precision logits.
FUSED_LOSS_GROUPS = ("llmfoundry_mpt",)
# Groups that ran Megatron-LM's model code (Alpa's priced rows are its Megatron-LM baselines): its
# vocab-parallel cross-entropy works in place on the fp32 logits (`planner.loss_cost.LossKernel.INPLACE`)
# and its sequence-parallel matmuls gather their input again in backward (`planner.sp_gather.SpGather`).
MEGATRON_CODE_GROUPS = ("megatron2020_tp_scaling", "megatron2021_weak", "megatron2021_zero3_vs_ptd", "megatron_core_h100",
                       "korthikanti2022_table5", "korthikanti2022_abstract", "bloom", "alpa_osdi22")

# Groups whose software predates fused (flash) attention: the score tensor is materialised.
UNFUSED_ATTENTION_GROUPS = ("megatron2020_tp_scaling", "megatron2021_weak", "megatron2021_zero3_vs_ptd",
                            "korthikanti2022_table5", "korthikanti2022_abstract", "bloom", "opt", "alpa_osdi22")
# Groups whose software ran the first FlashAttention's kernels: llm-foundry's MPT yamls of 2023
# (scripts/train/yamls/pretrain/mpt-*.yaml, `attn_config: attn_impl: triton`).
FLASH1_ATTENTION_GROUPS = ("llmfoundry_mpt",)


# Groups whose TFLOP/s count the recomputed forward (peak_conventions: Megatron-LM 2021, Alpa
# "counting remat", BLOOM's 8N coefficient); the others report model FLOPs.
HARDWARE_FLOPS_GROUPS = ("megatron2021_weak", "megatron2021_zero3_vs_ptd", "alpa_osdi22", "bloom")


@dataclass(frozen=True)
class Row:
    id: str
    group: str
    spec: dict
    seq_len: int
    cluster: str
    config: dict
    global_batch: int
    published_step_s: float
    metric: str
    unverified: bool
    attention: str
    open_choices: tuple[str, ...] = ()
    tp_overlap: str = "none"
    dtype: str = "bf16"
    loss: str = "torch"
    zero3_fetch: str = "prefetch"
    nic: str | None = None
    dp_sync: str = "overlapped"
    pp_buffers: str = "transient"
    sp_gather: str = "kept"
    checkpoint_every: int = 1

    def cluster_spec(self) -> str | dict:
        """The cluster to evaluate on: the `DEVICE:NODESxGPUS` shorthand, as a cluster mapping with the
        stated NIC where the row names one (`STATED_NICS`)."""
        if self.nic is None:
            return self.cluster
        device, shape = self.cluster.split(":")
        nodes, per_node = (int(n) for n in shape.split("x"))
        return {"name": f"{self.cluster} with {self.nic}",
                "groups": [{"device": device, "nodes": nodes, "devices_per_node": per_node, "nic": self.nic}]}


def _stated_nic(interconnect: str | None) -> str | None:
    return next((link for pattern, link in STATED_NICS if re.search(pattern, interconnect or "")), None)


# (substrings of the row's GPU name with spaces and punctuation removed, built-in device); the first
# entry whose substrings all occur wins, so a name containing another's comes first (GB200 before
# B200, L40S before L4).
DEVICE_PATTERNS = (
    (("gb200",), "gb200"), (("b200",), "b200"), (("h200",), "h200"), (("h800",), "h800"), (("h100", "pcie"), "h100-pcie"),
    (("h100", "hbm2e"), "h100-hbm2e"), (("h100",), "h100-sxm"), (("a100", "40g"), "a100-40g"), (("a100",), "a100-80g"),
    (("v100", "16g"), "v100-16g"), (("v100",), "v100-32g"), (("mi300x",), "mi300x"), (("mi250x",), "mi250x"), (("l40s",), "l40s"), (("l4",), "l4"),
    (("a10g",), "a10g"), (("4090",), "rtx-4090"),
)


def _device(gpu: str) -> str | None:
    """The built-in device profile of a row's GPU name ("A100-SXM4-40GB", "H100 (SXM, 80GB assumed)"), or None."""
    name = re.sub(r"[^a-z0-9]", "", gpu.lower())
    return next((device for parts, device in DEVICE_PATTERNS if all(part in name for part in parts)), None)


def _recompute(text) -> str:
    text = str(text or "none").lower()
    if text.startswith("full") or text == LAYER_FREQUENCY_RECOMPUTE:
        return "full"
    if text.startswith("selective op"):
        return "selective_op"
    if text.startswith("selective"):
        return "selective"
    return "none"


# torchtitan's "selective layer" checkpointing (`selective_ac_option` an integer n, its docs' example 2)
# wraps every n-th block in a full activation checkpoint (the 2nd, 4th, ...) and no other.
LAYER_FREQUENCY_RECOMPUTE = "selective layer"
LAYER_FREQUENCY = 2


def row_policies(graph: ModelGraph, row: Row) -> tuple[Recompute, ...] | None:
    """The row's recompute per layer of `graph` where it checkpoints every n-th block
    (`Row.checkpoint_every` > 1): full on the n-th, 2n-th, ... block, none elsewhere; else None
    (its configuration's policy on every block)."""
    if row.checkpoint_every == 1:
        return None
    policies, block = [], 0
    for layer in graph.layers:
        block += layer.kind == LayerKind.BLOCK
        full = layer.kind == LayerKind.BLOCK and block % row.checkpoint_every == 0
        policies.append(Recompute.FULL if full else Recompute.NONE)
    return tuple(policies)


def _zero(value) -> int:
    if isinstance(value, int):
        return value
    return 3 if value and "fsdp" in str(value).lower() else 0


def _spec(model: dict) -> dict:
    hidden, heads = model["hidden"], model["heads"]
    ffn = model.get("ffn_hidden") or 4 * hidden
    llama = bool(model.get("kv_heads")) or "llama" in str(model.get("name", "")).lower()
    spec = {"arch": "llama" if llama else "gpt", "layers": model["layers"], "hidden": hidden, "heads": heads,
            "ffn_hidden": ffn, "vocab": model.get("vocab") or 51200}
    if model.get("kv_heads"):
        spec["kv_heads"] = model["kv_heads"]
    moe = model.get("moe") or {}
    experts = moe.get("num_experts") or moe.get("experts")
    if experts:  # every block a mixture of `experts` SwiGLU experts, as the zoo's moe arch builds it
        spec.update(arch="moe", experts=experts, top_k=moe.get("top_k") or moe.get("topk") or 2,
                    moe_ffn_hidden=moe.get("moe_ffn_hidden") or moe.get("expert_ffn_hidden") or ffn)
    elif not llama:
        spec["max_seq_len"] = model.get("seq_len") or 2048
    return spec


def _model_flops_72(b: int, s: int, layers: int, h: int, vocab: int) -> float:
    """Korthikanti 2022 model FLOPs per iteration: 72 B s L h^2 (1 + s/6h + V/12hL)."""
    return 72 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * h * layers))


def _hardware_flops_96(b: int, s: int, layers: int, h: int, vocab: int) -> float:
    """Narayanan 2021 FLOPs per iteration with activation recompute: 96 B s L h^2 (1 + s/6h + V/16hL)."""
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * h * layers))


def _published_step_s(run: dict, gb: int, seq: int, gpus: int) -> tuple[float, str] | None:
    measured, model = run["measured"], run["model"]
    if measured.get("iter_time_s"):
        return measured["iter_time_s"], "iter_time_s"
    if measured.get("tokens_per_s"):
        return gb * seq / (measured["tokens_per_s"] * gpus), "tokens_per_s"
    if measured.get("tflops_per_gpu"):
        args = (gb, seq, model["layers"], model["hidden"], model.get("vocab") or 51200)
        if run["group"] in HARDWARE_FLOPS_GROUPS:
            return _hardware_flops_96(*args) / (measured["tflops_per_gpu"] * 1e12 * gpus), "tflops_per_gpu (96-formula, recompute counted)"
        return _model_flops_72(*args) / (measured["tflops_per_gpu"] * 1e12 * gpus), "tflops_per_gpu (72-formula, model FLOPs)"
    return None


def load_rows(groups: tuple[str, ...] | None = None, path: Path = REFERENCE) -> tuple[list[Row], list[tuple[str, str]]]:
    """Rows usable for evaluation, and (id, reason) for the rows skipped.

    Raises:
        SystemExit: one line, when the reference file is not there (it lives beside the repository).
    """
    if not path.is_file():
        raise SystemExit(f"{path}: not found; the published runs live in shared/reference/ beside the repository "
                         f"(../shared from its root)")
    data = json.loads(path.read_text())
    rows, skipped = [], []
    for run in data["runs"]:
        if groups and run["group"] not in groups:
            continue
        model = {**run["model"], **GROUP_MODEL_FILLS.get(run["group"], {})}
        plan = {**run["plan"], **GROUP_PLAN_FILLS.get(run["group"], {})}
        hw = run["hardware"]
        device = _device(hw["gpu"])
        seq = model.get("seq_len")
        gb = plan.get("global_batch")
        if device is None or not seq or not gb or plan.get("tp") is None or plan.get("pp") is None:
            skipped.append((run["id"], "missing device, seq_len, global batch or degrees"))
            continue
        gpus, per_node = hw["num_gpus"], hw.get("gpus_per_node") or 8
        per_node = per_node if isinstance(per_node, int) else 8
        cluster = f"{device}:{gpus // per_node}x{per_node}" if gpus >= per_node else f"{device}:1x{gpus}"
        step = _published_step_s({**run, "model": model}, gb, seq, gpus)
        if step is None:
            skipped.append((run["id"], "no step time, tokens/s or TFLOP/s"))
            continue
        flags = str(plan.get("overlap") or "")
        zero_stage = plan.get("zero_stage")
        if zero_stage is None and "--overlap-param-gather" in flags:
            zero_stage = 1
        dp = plan.get("dp") or gpus // (plan["tp"] * plan["pp"])
        micro_batch = plan.get("micro_batch") or (gb // dp if run["group"] in NO_ACCUMULATION_GROUPS else 1)
        config = {"tp": plan["tp"], "pp": plan["pp"], "dp": dp, "cp": plan.get("cp") or 1, "micro_batch": micro_batch,
                  "zero": _zero(zero_stage), "recompute": _recompute(plan.get("recompute"))}
        open_choices = tuple(key for key, value in (("zero", zero_stage), ("recompute", plan.get("recompute"))) if value is None)
        if plan.get("vpp") and plan["vpp"] > 1:
            config["vpp"] = plan["vpp"]
        if isinstance(plan.get("ep"), int) and plan["ep"] > 1:
            config["ep"] = plan["ep"]
        layer_frequency = str(plan.get("recompute")).lower() == LAYER_FREQUENCY_RECOMPUTE
        attention = ("unfused" if run["group"] in UNFUSED_ATTENTION_GROUPS
                     else "flash1" if run["group"] in FLASH1_ATTENTION_GROUPS else "flash")
        tp_overlap = "full" if "--tp-comm-overlap" in flags else "forward" if "asynctp" in run["id"].lower() else "none"
        dtype = "fp8" if "fp8" in str(run.get("precision", "")).lower() else "bf16"
        loss = "fused" if run["group"] in FUSED_LOSS_GROUPS else "inplace" if run["group"] in MEGATRON_CODE_GROUPS else "torch"
        zero3_fetch = "blocking" if run["group"] in BLOCKING_ZERO3_GROUPS else "prefetch"
        rows.append(Row(run["id"], run["group"], _spec(model), seq, cluster, config, gb, step[0], step[1],
                        bool(run.get("unverified")), attention, open_choices, tp_overlap, dtype, loss, zero3_fetch,
                        _stated_nic(hw.get("interconnect")),
                        "blocking" if run["group"] in BLOCKING_DP_SYNC_GROUPS else "overlapped",
                        sp_gather="regathered" if run["group"] in MEGATRON_CODE_GROUPS else "kept",
                        checkpoint_every=LAYER_FREQUENCY if layer_frequency else 1))
    return rows, skipped


def fitting_configs(row: Row):
    """The row's configuration, then, for choices the source left open, the variants in the order
    FILL_RULES tries them (the caller keeps the first one that fits)."""
    zeros = (0, 1, 2, 3) if "zero" in row.open_choices else (row.config["zero"],)
    recomputes = ("none", "selective", "full") if "recompute" in row.open_choices else (row.config["recompute"],)
    for recompute in recomputes:
        for zero in zeros:
            yield {**row.config, "zero": zero, "recompute": recompute}


def spec_key(spec: dict) -> str:
    return re.sub(r"\W+", "-", json.dumps(spec, sort_keys=True))
