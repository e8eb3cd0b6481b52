"""Rendering of an Estimate: the time and memory breakdown tables `paraplan evaluate` prints."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from planner.result import Estimate
from planner.training_code import TrainingCode
from planner.report.units import GIB, bar, fmt_bytes, fmt_seconds

# A pipeline bubble above this share of the step gets a hint on how to shrink it.
BUBBLE_HINT_FRACTION = 0.25

# The largest error of the predicted peak memory on measured runs: torchtitan's H100 tables without
# pipelining -9.7% to +4.3% (`python benchmarks/torchtitan_h100.py`), `Plan.apply` on gloo ranks -5.3% to
# +8.8% (`python benchmarks/fidelity.py`, run N). A peak closer than this to capacity gets a warning.
MEMORY_ERROR_FRACTION = 0.10


def estimate_json(estimate: Estimate) -> dict:
    """The `evaluate --json` object (DESIGN.md contract)."""
    return estimate.to_dict()


def throughput_unit(estimate: Estimate) -> str:
    """"samples" for a model without a token sequence (one token per sample, README), else "tokens"."""
    config = estimate.config
    if config is None:
        return "tokens"
    sequences = config.dp * config.micro_batch * config.num_microbatches
    return "samples" if round(estimate.tokens_per_s * estimate.step_time_s / sequences) == 1 else "tokens"


def summary_table(estimate: Estimate, title: str) -> Table:
    """The headline figures, with a row of the training-code choices besides the defaults they assume."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    if estimate.config is not None:
        table.add_row("config", estimate.config.short())
    if changed := TrainingCode.of(**estimate.training_code).changed():
        table.add_row("training code", ", ".join(f"{name}={value}" for name, value in changed.items()))
    table.add_row("step time", fmt_seconds(estimate.step_time_s))
    table.add_row("throughput", f"{estimate.tokens_per_s:,.0f} {throughput_unit(estimate)}/s")
    table.add_row("model TFLOP/s per device", f"{estimate.tflops_per_gpu:.1f}" if estimate.tflops_per_gpu >= 1
                  else f"{estimate.tflops_per_gpu * 1e3:.1f} GFLOP/s")
    table.add_row("MFU", f"{estimate.mfu:.1%}")
    # The fullest stage against its own device (on a mixed cluster the largest bytes may sit on the larger device).
    fullest = max(estimate.memory, key=lambda row: row["total_bytes"] / row["capacity_bytes"])
    where = f" on {fullest['device']}" if len({row["device"] for row in estimate.memory}) > 1 else ""
    table.add_row("peak memory", f"{fmt_bytes(fullest['total_bytes'])} of {fmt_bytes(fullest['capacity_bytes'])}{where}  "
                                 f"{bar(fullest['total_bytes'] / fullest['capacity_bytes'])}")
    table.add_row("fits", "[green]yes[/green]" if estimate.fits else "[red]no[/red]")
    if estimate.fits and fullest["total_bytes"] > (1 - MEMORY_ERROR_FRACTION) * fullest["capacity_bytes"]:
        table.caption = (f"the peak is within the cost model's memory error ({MEMORY_ERROR_FRACTION:.0%} on measured runs) of "
                         f"capacity, and memory outside PyTorch (NCCL buffers) is not counted: plan with --mem-headroom "
                         f"{MEMORY_ERROR_FRACTION:g} for that margin")
    return table


def time_table(estimate: Estimate) -> Table:
    table = Table(title="Step time breakdown (critical stage)", title_justify="left")
    table.add_column("part")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    for key, value in estimate.time_breakdown.items():
        if value <= 0:
            continue
        table.add_row(key.removesuffix("_s").replace("_", " "), fmt_seconds(value), f"{value / estimate.step_time_s:.1%}")
    if estimate.time_breakdown.get("dp_comm_exposed_s", 0.0) > 0 or estimate.time_breakdown.get("fsdp_comm_exposed_s", 0.0) > 0:
        pipelined = estimate.config is not None and estimate.config.pp > 1
        table.caption = (("dp comm includes the gradient sum of any weights tied across pipeline stages; " if pipelined else "")
                         + "dp/fsdp comm include FSDP2's buffer copies, even on one rank")
    return table


def memory_table(estimate: Estimate) -> Table:
    # GiB, or MiB where the largest stage holds under one GiB (a small model on CPUs shows 0.0 GiB throughout)
    unit, scale = ("GiB", GIB) if max(row["total_bytes"] for row in estimate.memory) >= GIB else ("MiB", 2**20)
    table = Table(title=f"Memory per device by pipeline stage ({unit})", title_justify="left")
    for name in ("stage", "weights", "grads", "optim", "activ", "other", "total"):
        table.add_column(name, justify="right")
    table.add_column("of capacity")
    for row in estimate.memory:
        other = sum(row.get(part, 0.0) for part in ("comm_buffers_bytes", "temp_bytes", "overhead_bytes"))
        values = (row["weights_bytes"], row["grads_bytes"], row["optimizer_bytes"], row["activations_bytes"], other, row["total_bytes"])
        table.add_row(str(row["stage"]), *(f"{v / scale:.1f}" for v in values), bar(row["total_bytes"] / row["capacity_bytes"], 10))
    priced = ", ".join(dict.fromkeys(f"{row['dtype']} on {row['device']}" for row in estimate.memory if "dtype" in row))
    host = max(estimate.memory, key=lambda row: (row.get("host_bytes", 0.0) / row["host_capacity_bytes"]
                                                 if row.get("host_capacity_bytes") else 0.0, row.get("host_bytes", 0.0)))
    offloaded = (f"; offloaded optimizer states: {fmt_bytes(host['host_bytes'])} of host memory per device"
                 + (f" (of its {fmt_bytes(host['host_capacity_bytes'])} share)" if host.get("host_capacity_bytes") else "")
                 if host.get("host_bytes") else "")
    table.caption = ("each stage at its peak moment (the forward's end, or the optimizer step, where activations "
                     "are gone: a part not alive then shows 0); other = communication and pipeline buffers + temporaries + CUDA "
                     "context, allocator fragmentation and the gradient blocks a data-parallel reduce stream keeps reserved"
                     + (f"; priced in {priced}" if priced else "") + offloaded)
    return table


def hints(estimate: Estimate) -> list[str]:
    """What would make the estimated configuration fit, or shrink a large pipeline bubble."""
    out = []
    host = estimate.host_overflow()
    config = estimate.config
    if host is not None:
        out.append(f"Does not fit: stage {host['stage']}'s offloaded optimizer states need {fmt_bytes(host['host_bytes'])} of "
                   f"host memory per device, over its {fmt_bytes(host['host_capacity_bytes'])} share of the node's; they "
                   f"shrink {_or(_state_fixes(config, offload=False))}, or on nodes with more host memory.")
    device_full = any(row["total_bytes"] > row["capacity_bytes"] for row in estimate.memory)
    if not estimate.fits and (device_full or host is None):
        row = max(estimate.memory, key=lambda r: r["total_bytes"] / r["capacity_bytes"])
        states = row["weights_bytes"] + row["grads_bytes"] + row["optimizer_bytes"]
        fix = (f"its model states ({fmt_bytes(states)}) shrink {_or(_state_fixes(config, offload=True))}"
               if states >= row["activations_bytes"] else
               f"its activations ({fmt_bytes(row['activations_bytes'])}) shrink with recompute (--recompute full),"
               " a smaller --micro-batch, or more tp, cp or pp")
        over = row["total_bytes"] - row["capacity_bytes"]
        buffers = (f" Its pipeline buffers ({fmt_bytes(row['comm_buffers_bytes'])}) exceed the overshoot "
                   f"({fmt_bytes(over)}): training code that receives into transient buffers and frees each micro-batch's "
                   f"outputs with its loss (--pp-buffers transient --pp-outputs dropped: Megatron-LM, DeepSpeed) holds "
                   f"fewer of them."
                   if config is not None and config.pp > 1 and row["comm_buffers_bytes"] >= over > 0 else "")
        out.append(f"Does not fit: stage {row['stage']} needs {fmt_bytes(row['total_bytes'])} of "
                   f"{fmt_bytes(row['capacity_bytes'])}; {fix}.{_fits_with(estimate.fixes)} `paraplan plan` searches for "
                   f"what fits.{buffers}")
    if config is not None and config.pp > 1 and estimate.bubble_fraction > BUBBLE_HINT_FRACTION:
        interleave = "" if config.vpp > 1 else " or an interleaved schedule (--vpp 2 or more)"
        out.append(f"The pipeline bubble idles the devices {estimate.bubble_fraction:.0%} of the step: more "
                   f"micro-batches (a larger --global-batch or a smaller --micro-batch){interleave} shrink it.")
    return out


def _fits_with(fixes) -> str:
    """The priced changes that fit (`Estimate.fixes`) as a sentence, with a leading space; "" for none."""
    priced = [f"{fix.change} ({fmt_bytes(fix.peak_memory_bytes)}, {fix.step_time_s:.3f} s a step)" for fix in fixes]
    if not priced:
        return ""
    if fixes[0].combined:
        return f" No single change fits; these together do: {priced[0]}."
    return f" It fits with {_or(priced)}."


def _state_fixes(config, offload: bool) -> list[str]:
    """What shrinks `config`'s model states per device, of the levers it does not pull already:
    ZeRO (to stage 3; on one data-parallel rank it shards nothing), fewer hybrid-sharding replicas,
    more data-parallel devices, and (`offload`) optimizer offload."""
    fixes = []
    if config is None or (config.zero < 3 and config.shard_ranks > 1):
        fixes.append("under ZeRO-3 (--zero 3)")
    if config is not None and config.dp_replicate > 1:
        fixes.append("with fewer hybrid-sharding replicas (--dp-replicate)")
    fixes.append("over more data-parallel devices")
    if offload and (config is None or not config.offload_optimizer):
        fixes.append("with --offload-optimizer")
    return fixes


def _or(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def trace_notes(estimate: Estimate) -> list[Text]:
    """How the model was traced and measured (fallbacks, frozen parameters, ...), one line each."""
    return [Text(f"note: {note}", style="dim") for note in estimate.notes]


def render_estimate(estimate: Estimate, title: str = "Estimate") -> Group:
    """The summary, time and memory tables, then the `hints` and the trace notes."""
    return Group(summary_table(estimate, title), time_table(estimate), memory_table(estimate),
                 *(Text(hint, style="yellow") for hint in hints(estimate)), *trace_notes(estimate))
