"""The Python API: `plan`, `evaluate` and `make_config`, shared by the CLI and user code."""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from pathlib import Path

from costmodel.errors import ProfileError
from costmodel.hardware import Cluster
from costmodel.profile_loader import load_cluster
from planner.config import CONFIG_KEYS, ParallelConfig, Schedule, check_batch_split, sequence_parallel_for
from planner.errors import check_positive_int, invalid
from planner.graph import LayerKind, ModelGraph, Recompute
from planner.result import Estimate, Plan, stored_reference

# Degrees `make_config` divides by before ParallelConfig validates them.
_DIVISOR_KEYS = ("tp", "pp", "cp", "dp", "micro_batch")


def model_graph(model, seq_len: int | None = None, micro_batch: int = 1, dtype: str = "bf16") -> ModelGraph:
    """The graph of `model` traced in training dtype `dtype`, from the on-disk cache when it has one
    (`planner.graph_cache`)."""
    if seq_len is not None:
        check_positive_int("seq_len", seq_len)
    if isinstance(model, ModelGraph):
        if seq_len not in (None, model.seq_len):
            raise invalid(f"seq_len={seq_len}: the traced graph of {model.name} is of seq_len={model.seq_len}; trace it "
                          f"again at {seq_len} (planner.trace), or leave seq_len out")
        return model
    from planner import graph_cache

    path = graph_cache.cache_path(model, seq_len, micro_batch, dtype) if isinstance(model, str) else None
    graph = graph_cache.load(path)
    if graph is None:
        from planner.tracing import trace  # imports torch (about a second); a cached graph needs none

        graph = trace(model, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype)
        graph_cache.store(path, graph)
    return graph


def _cluster(cluster) -> Cluster:
    try:
        return load_cluster(cluster)
    except ProfileError as error:
        raise invalid(str(error)) from None


def make_config(constraints: dict | ParallelConfig, num_devices: int, global_batch: int) -> ParallelConfig:
    """A full ParallelConfig from the degrees a user gave: dp fills the devices, micro-batches fill the batch.

    Args:
        constraints: tp and pp at least; dp, cp, ep, vpp, micro_batch, zero, recompute, schedule,
            offload_optimizer, dp_replicate optional.
        num_devices: devices of the cluster.
        global_batch: sequences per optimizer step.

    Raises:
        PlannerError: INVALID_INPUT naming the unknown key, or the degree or batch that does not fit.
    """
    if isinstance(constraints, ParallelConfig):
        return constraints
    if not isinstance(constraints, dict):
        raise invalid(f"config: expected a mapping of degrees ({{'tp': 2, 'pp': 1}}), a ParallelConfig or a Plan, got "
                      f"{type(constraints).__name__}")
    values = dict(constraints)
    for key in values:
        if key not in CONFIG_KEYS:
            raise invalid(f"config key {key!r}: unknown; use one of {', '.join(CONFIG_KEYS)}")
    for key, value in (*((k, values.get(k, 1)) for k in _DIVISOR_KEYS), ("global_batch", global_batch)):
        check_positive_int(key, value)
    tp, pp, cp = values.get("tp", 1), values.get("pp", 1), values.get("cp", 1)
    model_parallel = tp * pp * cp
    if num_devices % model_parallel:
        raise invalid(f"tp*pp*cp = {tp}*{pp}*{cp} = {model_parallel}: must divide the cluster's {num_devices} devices; "
                      f"pick tp, pp and cp whose product divides {num_devices}")
    dp = values.get("dp", num_devices // model_parallel)
    if dp * model_parallel != num_devices:
        raise invalid(f"dp*tp*pp*cp = {dp}*{tp}*{pp}*{cp} = {dp * model_parallel}: must equal the cluster's {num_devices} devices; "
                      f"give dp={num_devices // model_parallel}, or leave dp out (it fills them)")
    micro_batch = values.get("micro_batch", 1)
    check_batch_split(global_batch, dp, micro_batch)
    vpp = values.get("vpp", 1)
    schedule = values.get("schedule", Schedule.INTERLEAVED if vpp > 1 else Schedule.ONE_F_ONE_B)
    return ParallelConfig(
        dp=dp, tp=tp, pp=pp, cp=cp, ep=values.get("ep", 1), vpp=vpp, micro_batch=micro_batch,
        num_microbatches=global_batch // (dp * micro_batch), zero=values.get("zero", 0),
        recompute=values.get("recompute", "none"), schedule=schedule,
        offload_optimizer=bool(values.get("offload_optimizer", False)), dp_replicate=values.get("dp_replicate", 1),
    )


def evaluate(model, cluster, config: dict | ParallelConfig | Plan, *, global_batch: int | None = None, seq_len: int | None = None,
             dtype: str | None = None, attention: str | None = None, tp_overlap: str | None = None, loss: str | None = None,
             zero3_fetch: str | None = None, dp_sync: str | None = None, elementwise: str | None = None,
             pp_buffers: str | None = None, cp_comm: str | None = None, sp_gather: str | None = None,
             pp_outputs: str | None = None, boundaries: tuple[int, ...] | None = None,
             recompute_per_layer: Sequence[str] | None = None, fixes: bool = True) -> Estimate:
    """Predict step time, throughput, MFU and per-stage memory of one configuration.

    `model` is as for `plan`. `config` is the degrees a user gives (`make_config`), a ParallelConfig, or a Plan: a plan is
    priced as it was planned, with its stage split and per-layer recompute, and its global batch,
    dtype, sequence length and training code unless given here. The training-code choices are as for
    `plan`; a choice left None is the plan's, else `TrainingCode`'s default (dtype: bf16).
    `boundaries`, for degrees given: the pipeline split as pp*vpp+1 cut points over the traced graph's
    layers (`trace(...).layers`; chunk c holds layers [boundaries[c], boundaries[c+1])); by default the
    memory-aware split, refined by where the schedule puts its heavy stages.
    `recompute_per_layer`, for degrees given: a recompute policy per traced layer (names as
    `--recompute`), overriding the configuration's; e.g. full on every other block, as torchtitan's
    layer-frequency checkpointing (`selective_ac_option = "2"`) runs.
    `fixes`: where the degrees given do not fit, price the single changes that would
    (`Estimate.fixes`, `planner.fit_fixes`).
    Degrees given without `zero` leave it open: ZeRO 0 where it fits at a split memory did not shape,
    else the fastest ZeRO stage that fits, with a note (`planner.open_choices`); recompute is never
    assumed (`none` unless given).

    Example::

        >>> est = evaluate("gpt3-1.3b", "a100-80g:1x8", {"tp": 2, "pp": 1}, global_batch=64, seq_len=2048)
        >>> est.config.dp, est.fits
        (4, True)
    """
    from planner.attention_note import attention_kernel_note
    from planner.default_split import memory_shaped_note
    from planner.estimate import Evaluator
    from planner.fit_fixes import fit_fixes, idle_recompute_note
    from planner.open_choices import fastest_fitting_zero
    from planner.tp_plan import whole_weights_note
    from planner.training_code import TrainingCode

    planned = config if isinstance(config, Plan) else None
    if global_batch is None and planned is None:
        raise invalid("global_batch: required (sequences per optimizer step) unless config is a Plan")
    global_batch = planned.global_batch if global_batch is None else global_batch
    check_positive_int("global_batch", global_batch)
    given = {"attention": attention, "tp_overlap": tp_overlap, "loss": loss, "zero3_fetch": zero3_fetch, "dp_sync": dp_sync,
             "elementwise": elementwise, "pp_buffers": pp_buffers, "cp_comm": cp_comm, "sp_gather": sp_gather,
             "pp_outputs": pp_outputs}
    code = TrainingCode.of(**{**(planned.training_code if planned else {}), **{k: v for k, v in given.items() if v is not None}})
    dtype = dtype or (planned.dtype if planned else "bf16")
    planned_seq_len = planned.seq_len if planned and not isinstance(model, ModelGraph) else None  # a graph has its own
    graph = model_graph(model, seq_len or planned_seq_len, dtype=dtype)
    hardware = _cluster(cluster)
    evaluator = Evaluator(graph, hardware, dtype, code=code)
    if planned is None:
        full = make_config(config, hardware.num_devices, global_batch)
        if not isinstance(config, ParallelConfig):  # degrees a user gives: sequence parallelism where it can run
            full = dataclasses.replace(full, sequence_parallel=sequence_parallel_for(graph.stream_tokens, full.tp, full.cp))
        boundaries, policies = _checked_boundaries(boundaries, full, len(graph.layers)), _checked_policies(recompute_per_layer, graph)
        estimate = evaluator.estimate(full, global_batch, boundaries=boundaries, recompute_per_layer=policies)
        shaped = memory_shaped_note(evaluator, full, estimate, global_batch) if boundaries is None else ()
        notes = ()
        if isinstance(config, dict) and "zero" not in config and boundaries is None and policies is None:
            given = full
            full, estimate, notes = fastest_fitting_zero(evaluator, full, estimate, global_batch, shaped)
            shaped = shaped if full == given else memory_shaped_note(evaluator, full, estimate, global_batch)
        notes += idle_recompute_note(evaluator, full, estimate, global_batch) + whole_weights_note(evaluator, full)
        notes += attention_kernel_note(evaluator, full, estimate, global_batch, boundaries, policies) + shaped
        if fixes and boundaries is None:
            estimate = dataclasses.replace(estimate, fixes=fit_fixes(evaluator, full, estimate, global_batch))
        if seq_len is None and not isinstance(model, ModelGraph):
            notes += (f"no seq_len given: priced at {graph.seq_len} tokens per sequence, the model's own",)
        return dataclasses.replace(estimate, notes=estimate.notes + notes, training_code=code.options())
    if boundaries is not None or recompute_per_layer is not None:
        raise invalid("boundaries, recompute_per_layer: a plan is priced at its own split and recompute; give the degrees "
                      "instead of the plan to price others")
    full, boundaries, policies = _planned_choices(planned, graph, global_batch)
    estimate = evaluator.estimate(full, global_batch, boundaries=boundaries, recompute_per_layer=policies)
    return dataclasses.replace(estimate, training_code=code.options())


def _checked_boundaries(boundaries, config: ParallelConfig, layers: int) -> tuple[int, ...] | None:
    """`boundaries` as ints, checked to cut `layers` layers into pp*vpp non-empty chunks; None passes."""
    if boundaries is None:
        return None
    cuts, chunks = tuple(boundaries), config.pp * config.vpp
    if (len(cuts) != chunks + 1 or any(not isinstance(b, numbers.Integral) or isinstance(b, bool) for b in cuts)
            or cuts[0] != 0 or cuts[-1] != layers or any(a >= b for a, b in zip(cuts, cuts[1:]))):
        raise invalid(f"boundaries={list(cuts)}: need pp*vpp+1 = {chunks + 1} increasing integers from 0 to the graph's "
                      f"{layers} layers (chunk c holds layers boundaries[c] to boundaries[c+1]-1)")
    return tuple(int(b) for b in cuts)


def _checked_policies(policies: Sequence[str] | None, graph: ModelGraph) -> tuple[Recompute, ...] | None:
    """`policies` as Recompute values, one per layer of `graph`, each one the trace priced; None passes."""
    if policies is None:
        return None
    priced = {str(policy) for policy in graph.recompute_policies}
    if len(policies) != len(graph.layers) or any(str(policy) not in priced for policy in policies):
        raise invalid(f"recompute_per_layer: need one of {', '.join(sorted(priced))} for each of the graph's "
                      f"{len(graph.layers)} layers (got {len(policies)} values)")
    return tuple(Recompute(str(policy)) for policy in policies)


def _planned_choices(planned: Plan, graph: ModelGraph, global_batch: int) -> tuple[ParallelConfig, tuple[int, ...], tuple[Recompute, ...]]:
    """The configuration (its micro-batch count for `global_batch`), stage cut points and per-layer
    recompute of `planned`, checked against `graph`, the model it is priced on."""
    names = tuple(layer.name for layer in graph.layers)
    params = tuple(layer.params for layer in graph.layers)
    if names != planned.layer_names or (planned.layer_params and params != planned.layer_params):
        if len(names) != len(planned.layer_names):
            differ = f"{len(planned.layer_names)} traced layers there, {len(names)} here"
        else:
            i = next(i for i, name in enumerate(names)
                     if name != planned.layer_names[i] or (planned.layer_params and params[i] != planned.layer_params[i]))
            differ = (f"layer {i} is {planned.layer_names[i]} there, {names[i]} here" if names[i] != planned.layer_names[i] else
                      f"layer {i} ({names[i]}) holds {planned.layer_params[i]:,} parameters there, {params[i]:,} here")
            if names == planned.layer_names and graph.seq_len != planned.seq_len and all(
                    graph.layers[j].kind == LayerKind.EMBEDDING for j in range(len(names)) if params[j] != planned.layer_params[j]):
                raise invalid(f"seq_len={graph.seq_len}: the model's position table grows past the plan's {planned.seq_len} "
                              f"tokens ({differ}), so the plan does not hold this model; re-plan at this sequence length")
        raise invalid(f"plan: made for {planned.model} as it was then, not for this model ({differ}); evaluate it with the "
                      f"model it was planned for, or re-plan")
    staged = [name for stage in planned.stages for name in stage.layer_names]
    if sorted(staged) != sorted(names):
        odd = sorted(set(staged) ^ set(names)) or sorted(name for name in set(staged) if staged.count(name) > 1)
        raise invalid(f"plan stages: layer {odd[0]} is not in exactly one stage; re-run `paraplan plan --out`")
    boundaries, chunks = planned.boundaries(), planned.config.pp * planned.config.vpp
    if len(boundaries) != chunks + 1:
        raise invalid(f"plan stages: their layers form {len(boundaries) - 1} contiguous runs, pp*vpp = {chunks} expected; re-plan")
    policies = planned.recompute_per_layer()
    unknown = sorted(set(policies) - {str(p) for p in Recompute})
    if unknown:
        raise invalid(f"plan memory_plan.recompute: unknown policy {unknown[0]!r}; use one of {', '.join(str(p) for p in Recompute)}")
    config = planned.config
    per_round = config.dp * config.micro_batch
    if global_batch % per_round:
        raise invalid(f"global_batch={global_batch}: the plan runs dp*micro_batch = {config.dp}*{config.micro_batch} sequences "
                      f"per micro-batch; give a multiple of {per_round} (the plan's is {planned.global_batch}) or re-plan")
    full = dataclasses.replace(config, num_microbatches=global_batch // per_round)
    return full, boundaries, tuple(Recompute(p) for p in policies)


def plan(model, cluster, *, global_batch: int, seq_len: int | None = None, dtype: str = "bf16", attention: str = "flash",
         tp_overlap: str = "none", loss: str = "torch", zero3_fetch: str = "prefetch", dp_sync: str = "overlapped",
         elementwise: str = "eager", pp_buffers: str = "preallocated", cp_comm: str = "all_gather", sp_gather: str = "kept",
         pp_outputs: str = "dropped", **constraints) -> Plan:
    """Search the plan with the highest throughput that fits in memory.

    Args:
        model: zoo name, spec file, "package.module:factory", an nn.Module (starting with an
            embedding), a pair (nn.Module, example_inputs), or a traced ModelGraph.
        cluster: cluster name, cluster file, "DEVICE:NODESxGPUS", or a Cluster.
        global_batch: sequences per optimizer step.
        seq_len: tokens per sequence (default: the model's).
        dtype: compute dtype.
        attention: attention kernel of the training code, "flash" (the device's own), "flash2", "flash1"
            or "unfused" (`planner.op_works.AttentionKernel`).
        tp_overlap: which tensor-parallel collectives the training code overlaps with GEMMs, "none",
            "full" (Megatron-Core `--tp-comm-overlap`; True means it too) or "forward" (the forward
            pass's only: PyTorch's async TP of 2024; `planner.layer_comm.TpOverlap`).
        loss: cross-entropy kernel of the training code, "torch" (fp32 logits, `F.cross_entropy`),
            "inplace" (fp32 logits worked in place: Megatron's vocab-parallel cross-entropy) or "fused"
            (one kernel over the half-precision logits, e.g. flash-attn's xentropy, or a torch.compile'd loss).
        zero3_fetch: how the training code fetches ZeRO-3 parameters, "prefetch" (FSDP) or "blocking"
            (DeepSpeed ZeRO-3 of spring 2021; `planner.state_cost.Zero3Fetch`).
        dp_sync: how the training code synchronises data-parallel states below ZeRO-3, "overlapped"
            (FSDP, DDP, Megatron-Core) or "blocking" (DeepSpeed's pipeline engine with BF16_Optimizer:
            fp32 all-reduce after the last backward; `planner.state_cost.DpSync`).
        elementwise: how the training code runs memory-bound ops, "eager" (one kernel per op) or
            "fused" (each chain between GEMMs in one kernel: torch.compile, Transformer Engine;
            `planner.fusion`).
        pp_buffers: how the training code's pipeline holds received tensors, "preallocated" (a
            buffer per micro-batch: torch.distributed.pipelining, `Plan.apply`) or "transient"
            (Megatron-LM, DeepSpeed; `planner.pipeline_buffers`).
        cp_comm: how context parallelism exchanges keys and values, "all_gather" (ring or all-gather
            of the keys and values: torch, Megatron-Core p2p, `Plan.apply`) or "a2a" (DeepSpeed-Ulysses
            all-to-all of heads; `planner.layer_comm.CpComm`).
        sp_gather: what sequence parallelism keeps of the inputs it all-gathers for column-parallel
            matmuls, "kept" (the gathered tensor, saved by autograd: DTensor, torchtitan, `Plan.apply`)
            or "regathered" (the split input, gathered again in backward: Megatron-LM;
            `planner.sp_gather.SpGather`).
        pp_outputs: what the training code's pipeline keeps of the last stage's outputs, "dropped"
            (each while its loss runs: `Plan.apply`, Megatron-LM, DeepSpeed) or "kept" (every micro-batch's
            logits until the step ends: torch.distributed.pipelining's `step()` default, torchtitan;
            `planner.pipeline_buffers.PipeOutputs`).
        **constraints: fix a choice (tp=8, zero=3, schedule="1f1b", ...), bound one (max_tp=...,
            max_pp=...), mem_headroom (fraction of memory kept free), top (alternatives kept).

    Raises:
        PlannerError: INVALID_INPUT for bad input, INSUFFICIENT_MEMORY when nothing fits (the
            message says what would).
    """
    from planner.attention_note import attention_kernel_note
    from planner.estimate import Evaluator
    from planner.search import search
    from planner.training_code import TrainingCode

    check_positive_int("global_batch", global_batch)
    graph = model_graph(model, seq_len, dtype=dtype)
    hardware = _cluster(cluster)
    code = TrainingCode.of(attention=attention, tp_overlap=tp_overlap, loss=loss, zero3_fetch=zero3_fetch, dp_sync=dp_sync,
                           elementwise=elementwise, pp_buffers=pp_buffers, cp_comm=cp_comm, sp_gather=sp_gather,
                           pp_outputs=pp_outputs)
    result = search(graph, hardware, global_batch=global_batch, dtype=dtype, code=code,
                    cluster_name=stored_reference(str(cluster)) if isinstance(cluster, (str, Path)) else hardware.name,
                    **constraints)
    note = attention_kernel_note(Evaluator(graph, hardware, dtype, code=code), result.config, result.estimate, global_batch,
                                 result.boundaries(), tuple(Recompute(p) for p in result.recompute_per_layer()))
    if note:
        result = dataclasses.replace(result, estimate=dataclasses.replace(result.estimate, notes=result.estimate.notes + note))
    # A model named by reference (a spec file's path, not just its stem) is kept, so that
    # `evaluate --plan` and `examples/train.py` find it again.
    return dataclasses.replace(result, model=stored_reference(model) if isinstance(model, str) else result.model,
                               layer_params=tuple(layer.params for layer in graph.layers))
