"""Evaluate one ParallelConfig: step time, throughput, MFU and memory per pipeline stage.

On a device whose collectives do not run beside compute (`DeviceSpec.comm_overlaps_compute`,
false for CPU ranks) nothing below overlaps: every collective is exposed.

Step time = pipeline time of the stages (each stage's forward and backward per micro-batch:
compute, recompute, exposed tensor/context/expert-parallel communication, exposed FSDP gathers)
+ exposed data-parallel gradient reduction + the optimizer step. Overlap is modelled explicitly:

- DP gradient reduction (ZeRO 0-2) overlaps with the backward of the last micro-batch
  (`planner.state_cost`, with the optimizer step);
- FSDP (ZeRO-3) gathers of the next layer overlap with the current layer's compute, per micro-batch
  (unless the training code fetches them blocking, `state_cost.Zero3Fetch`);
- TP/SP collectives are exposed (they sit between dependent matmuls), unless the training code
  pipelines them with the GEMMs (`tp_overlap`: all, or the forward pass's only, `layer_comm.TpOverlap`);
- the CP ring overlaps with attention and keeps its links busy: DP and FSDP traffic over the same
  links hides only in the compute it leaves, over other links in the ring's exposed time too
  (`mesh.cp_shares_shard_links`, `LayerCost.windows_s`); EP all-to-all is exposed;
- pipeline p2p sits on the critical path of the schedule (`costmodel.pipeline`), at the slower end's links;
- the sum of a tied weight's gradients between the first and last stages is exposed after the
  schedule (counted with the data-parallel traffic, `state_cost.tied_gradient_sum_s`).
"""
from __future__ import annotations


import numpy as np

from costmodel import memory as memory_model
from costmodel import pipeline, pipeline_sim
from costmodel.comm import CommGroup
from costmodel.compute import base_dtype, bytes_per_element
from costmodel.hardware import Cluster, DeviceSpec, NodeSpec
from costmodel.offload import host_state_bytes
from costmodel.op_table import OpTable
from costmodel.profile_files import load_op_table
from planner.config import TRAINING_DTYPES, ParallelConfig
from planner.errors import invalid
from planner.estimate_assembly import assemble_estimate
from planner.graph import LayerKind, ModelGraph, Recompute
from planner.layer_cost import LayerContext, LayerCost, price_layer
from planner.mesh import cp_shares_shard_links, expert_data_group, mesh_groups, pipeline_hop_times, stage_devices
from planner.pipeline_buffers import chunk_recv_bytes, kept_output_bytes, recv_buffer_bytes
from planner.result import Estimate, StagePlan, contiguous_runs
from planner.config_check import check_config
from planner.default_split import default_splits
from planner.stage_problem import StageProblem
from planner.state_cost import (dp_exposed_s, grads_pooled, optimizer_step_s, owned_params, precision_of, state_options,
                                 state_zero, tied_gradient_sum_s, zero3_exposed_s)
from planner.tp_plan import folded_expert_plan, tp_plan_for
from planner.training_code import TrainingCode

# Memory cap of a chunk with no room left (positive, as StageProblem requires): no layer fits under it.
NO_ROOM_BYTES = 1.0


# Columns of the per-layer table one device type yields for one configuration (one micro-batch).
COLUMNS = ("fwd_s", "bwd_s", "compute_s", "recompute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "cp_hidden_fwd_s",
           "cp_hidden_bwd_s", "fsdp_exposed_s", "dense_params", "expert_params", "frozen_params", "buffer_bytes", "static_bytes", "grad_bytes",
           "act_bytes", "temp_bytes", "work_bytes", "held_bytes", "out_bytes", "loss_input_bytes")
COL = {name: i for i, name in enumerate(COLUMNS)}


class Evaluator:
    """Prices configurations of one model on one cluster, caching per-layer costs across configs.

    Args:
        graph: the traced model.
        cluster: the hardware.
        dtype: compute dtype ("bf16", "fp16", "fp8").
        table: measured op times that override the roofline.
        code: the training code's kernels and state synchronisation (`TrainingCode`).
    """

    def __init__(self, graph: ModelGraph, cluster: Cluster, dtype: str = "bf16", table: OpTable | None = None,
                 code: TrainingCode = TrainingCode()):
        if bytes_per_element(base_dtype(graph.dtype)) != bytes_per_element(base_dtype(dtype)):
            raise invalid(f"dtype={dtype!r}: {graph.name} was traced in {graph.dtype}, whose activations differ in size; "
                          f"fix: trace it with dtype={dtype!r}")
        if sum(layer.frozen_params for layer in graph.layers) == graph.params:
            what = "every parameter is frozen (requires_grad=False)" if graph.params else "it has no parameters"
            raise invalid(f"model `{graph.name}`: {what}, so there is nothing to train; fix: plan a model with parameters "
                          f"that take gradients")
        self.code = code
        self.graph = graph
        self.cluster = cluster
        self.dtype = dtype
        self.precision = precision_of(dtype)
        self.table = table
        self._layer_cache, self._table_cache, self._time_cache = {}, {}, {}  # per layer, per config table, per time table
        self._stage_devices: dict = {}
        self._device_types: dict = {}
        self._policies: dict = {}
        self._distinct: dict = {}
        self.layout_cache: dict = {}  # sharding-ILP layouts, shared by every config of this evaluator
        # Splits refined by where the schedule puts their stages (`planner.stage_polish`); the search
        # ranks its candidates without (milliseconds each) and refines the plans it keeps.
        self.schedule_splits = True

    def stage_devices(self, pp: int) -> list[tuple[DeviceSpec, NodeSpec]]:
        """`planner.mesh.stage_devices` of this cluster, computed once per pp."""
        if pp not in self._stage_devices:
            self._stage_devices[pp] = stage_devices(self.cluster, pp)
        return self._stage_devices[pp]

    def device_types(self, pp: int) -> list[tuple[DeviceSpec, NodeSpec]]:
        """The distinct (device, node) kinds the pp stages sit on (node size and links count), in stage order."""
        if pp not in self._device_types:
            self._device_types[pp] = list({node: (device, node) for device, node in self.stage_devices(pp)}.values())
        return self._device_types[pp]

    def table_for(self, device: DeviceSpec, dtype: str) -> OpTable | None:
        """The op table given to the Evaluator, else the one `device`'s profile names for `dtype` (`op_tables`)."""
        path = device.op_tables.get(dtype)
        return self.table if self.table is not None else load_op_table(path) if path else None

    def dtype_for(self, device: DeviceSpec) -> str:
        """The compute dtype on `device`: the requested one, or fp16 where a device lacks bf16 (V100)."""
        if self.dtype in device.peak_flops_per_s:
            return self.dtype
        if self.dtype == "bf16" and "fp16" in device.peak_flops_per_s:
            return "fp16"
        usable = [dtype for dtype in TRAINING_DTYPES if dtype in device.peak_flops_per_s]
        raise invalid(f"dtype {self.dtype} (--dtype, bf16 by default): {device.name} has no {self.dtype} peak; "
                      f"fix: pass --dtype {' or '.join(usable) or 'with a peak in its profile'}")

    def layer_cost(self, index: int, config: ParallelConfig, device: DeviceSpec, node: NodeSpec, recompute: Recompute) -> LayerCost:
        layer = self.graph.layers[index]
        key = (layer.signature or layer.name, node, config.tp, config.cp, config.ep, config.ep_folds_tp, config.micro_batch,
               recompute, config.sequence_parallel)
        cost = self._layer_cache.get(key)
        if cost is None:
            groups = mesh_groups(config, node.devices_per_node)
            ctx = LayerContext(
                device=device, node=node, dtype=self.dtype_for(device), tp=config.tp, cp=config.cp, ep=config.ep,
                batch_scale=config.micro_batch / self.graph.micro_batch, recompute=recompute,
                sequence_parallel=config.sequence_parallel, tp_group=groups.tp, cp_group=groups.cp,
                ep_group=groups.ep, top_k=self.graph.dims.top_k, hidden=self.graph.dims.hidden,
                table=self.table_for(device, self.dtype_for(device)), attention=self.code.attention,
                tp_overlap=self.code.tp_overlap, loss=self.code.loss, elementwise=self.code.elementwise,
                cp_comm=self.code.cp_comm, sp_gather=self.code.sp_gather, oversubscription=self.cluster.oversubscription)
            plan = tp_plan_for(layer, config.tp, device, node, ctx.dtype, self.layout_cache, self.graph, config.sequence_parallel)
            if config.ep_folds_tp:
                plan = folded_expert_plan(plan, layer, self.graph.dims.experts)
            cost = price_layer(layer, plan, ctx)
            self._layer_cache[key] = cost
        return cost

    def policies(self, config: ParallelConfig, recompute_per_layer: tuple[Recompute, ...] | None = None) -> tuple[Recompute, ...]:
        """Recompute policy per layer: the config's policy on blocks, none on embedding and head."""
        if recompute_per_layer is not None:
            return tuple(recompute_per_layer)
        if config.recompute not in self._policies:
            self._policies[config.recompute] = tuple(
                config.recompute if layer.kind == LayerKind.BLOCK else Recompute.NONE for layer in self.graph.layers)
        return self._policies[config.recompute]

    def layer_table(self, config: ParallelConfig, device: DeviceSpec, node: NodeSpec, policies: tuple[Recompute, ...]) -> np.ndarray:
        """[L, len(COLUMNS)] per-layer seconds and bytes of one micro-batch on `device` (cached)."""
        key = (node, config.tp, config.cp, config.ep, config.dp, config.micro_batch,
               state_zero(config), config.dp_replicate, config.sequence_parallel, config.offload_optimizer, policies, config.pp > 1)
        table = self._table_cache.get(key)
        if table is not None:
            return table
        groups = mesh_groups(config, node.devices_per_node)
        expert_group = expert_data_group(config, node)
        state = state_options(config, self.precision)
        representatives, index = self._distinct_layers(policies)
        rows = [self._layer_row(layer, config, device, node, policies[layer], groups, expert_group, state) for layer in representatives]
        table = np.array(rows, dtype=float)[index]
        self._table_cache[key] = table
        return table

    def time_table(self, config: ParallelConfig, device: DeviceSpec, node: NodeSpec, policies: tuple[Recompute, ...]) -> np.ndarray:
        """`layer_table` for reading only its time, parameter-count and output-size columns, which depend on
        dp and the ZeRO stage only through ZeRO-3's parameter gathers, and on pp only through the stage copies
        of tied weights: configs differing only there share one table (memory columns of the first)."""
        key = (node, config.tp, config.cp, config.ep, config.ep_folds_tp, config.micro_batch,
               config.sequence_parallel, policies, (config.dp, config.dp_replicate) if config.zero == 3 else None, config.pp > 1)
        table = self._time_cache.get(key)
        if table is None:
            table = self._time_cache[key] = self.layer_table(config, device, node, policies)
        return table

    def _distinct_layers(self, policies: tuple[Recompute, ...]) -> tuple[list[int], np.ndarray]:
        """Layers that price differently under `policies` (identical blocks under one policy price
        identically): one representative layer each, and per layer the position of its representative."""
        found = self._distinct.get(policies)
        if found is None:
            positions: dict = {}
            index = [positions.setdefault((layer.signature or layer.name, policy), len(positions))
                     for layer, policy in zip(self.graph.layers, policies)]
            representatives = [index.index(position) for position in range(len(positions))]
            found = self._distinct[policies] = (representatives, np.array(index))
        return found

    def _layer_row(self, index: int, config: ParallelConfig, device: DeviceSpec, node: NodeSpec, policy: Recompute,
                   groups, expert_group: CommGroup, state: dict) -> tuple:
        """One row of `layer_table` (see COLUMNS)."""
        layer = self.graph.layers[index]
        cost = self.layer_cost(index, config, device, node, policy)
        copies = self.graph.stage_copy_params[index] if config.pp > 1 else 0
        shared = layer.params - layer.expert_params + copies
        whole = (tp_plan_for(layer, config.tp, device, node, self.dtype_for(device), self.layout_cache, self.graph,
                             config.sequence_parallel).whole_params if config.tp > 1 and layer.ops else 0)  # `TpPlan.whole_params`
        dense = (shared + min(whole, shared) * (config.tp - 1)) / config.tp
        expert = layer.expert_params / (config.ep_over_data * config.tp)
        frozen = layer.frozen_params / config.tp
        gathered = config.zero == 3 and config.pp > 1  # all, at a pipelined backward's end (`stage_memory`)
        zero = state_zero(config)
        states = (memory_model.model_state_bytes(dense, zero, config.shard_ranks, gathered_params=dense * gathered,
                                                 frozen_params=frozen, **state),
                  memory_model.model_state_bytes(expert, zero, expert_group.size, gathered_params=expert * gathered, **state))
        static, grads = sum(sum(part) for part in states) + layer.buffer_bytes, sum(part.grads_bytes for part in states)
        exposed_fwd_s = exposed_bwd_s = 0.0
        if config.zero == 3:
            windows = cost.windows_s(cp_shares_shard_links(groups)) if device.comm_overlaps_compute else (0.0, 0.0)
            exposed_fwd_s, exposed_bwd_s = zero3_exposed_s(self.code.zero3_fetch, self.precision, dense, expert, groups, expert_group, node,
                                                           self.cluster.oversubscription, *windows, refetch=policy is Recompute.FULL,
                                                           pipelined=config.pp > 1, frozen=frozen)
        fwd = cost.fwd_s + cost.tp_comm_s / 2 + cost.cp_fwd_comm_s + cost.ep_comm_s / 2 + exposed_fwd_s
        exposed = exposed_fwd_s + exposed_bwd_s
        return (fwd, cost.total_s + exposed - fwd, cost.fwd_s + cost.bwd_s, cost.recompute_s, cost.tp_comm_s, cost.cp_comm_s,
                cost.ep_comm_s, *cost.cp_hidden_s, exposed, dense, expert, frozen, layer.buffer_bytes, static, grads,
                cost.act_bytes, cost.temp_bytes, cost.work_bytes, cost.held_bytes, layer.out_bytes * config.micro_batch / self.graph.micro_batch,
                cost.loss_input_bytes)

    def stage_problem(self, config: ParallelConfig, policy_sets: list[tuple[Recompute, ...]], headroom: float = 0.0) -> StageProblem:
        """The stage-split instance of `config`: one column per candidate per-layer policy set."""
        chunks = config.pp * config.vpp
        per_device = self.stage_devices(config.pp)
        refs = [self.layer_table(config, *per_device[0], policies) for policies in policy_sets]
        ref_total = float(refs[0][:, COL["fwd_s"]].sum() + refs[0][:, COL["bwd_s"]].sum())
        gathered_bytes = 0.0  # ZeRO-3's gathered layers (`_stage_costs`); pipelined, the static bytes hold all
        if config.zero == 3 and config.pp == 1:
            largest = float((refs[0][:, COL["dense_params"]] + refs[0][:, COL["expert_params"]]).max())
            gathered_bytes = self.code.zero3_fetch.gathered_layers * largest * self.precision.weight_bytes
        speeds, caps, in_flight = [], [], []
        for chunk in range(chunks):
            stage = chunk % config.pp
            device, node = per_device[stage]
            own = self.layer_table(config, device, node, policy_sets[0])
            speeds.append(ref_total / float(own[:, COL["fwd_s"]].sum() + own[:, COL["bwd_s"]].sum()))
            usable = device.mem_bytes * (1 - headroom) / (1 + memory_model.ALLOCATOR_FRAGMENTATION_FRACTION)
            boundary = float(own[:-1, COL["out_bytes"]].max(initial=0.0))  # the cuts are not known yet: the largest
            kept = kept_output_bytes(self.code.pp_outputs, config.pp, config.num_microbatches, float(own[:, COL["loss_input_bytes"]].sum()))
            recv = chunk_recv_bytes(self.code.pp_buffers, chunk, chunks, boundary, boundary, config.num_microbatches,
                                    config.seq_split) + kept * (chunk == chunks - 1)  # the loss is in the last chunk
            caps.append(max(NO_ROOM_BYTES, (usable - memory_model.CUDA_CONTEXT_BYTES) / config.vpp - recv - gathered_bytes))
            in_flight.append(pipeline.in_flight_microbatches(str(config.schedule), config.pp, stage, config.num_microbatches, config.vpp)
                             if config.pp > 1 else 1.0)
        column = lambda name: np.stack([ref[:, COL[name]] for ref in refs], axis=1)  # noqa: E731
        static = column("static_bytes")
        if config.num_microbatches == 1 and config.pp == 1 and not grads_pooled(config):
            # the gradients peak at the optimizer step, apart from the activations (`stage_memory`); no
            # recompute choice changes that moment. A reduce stream's pool keeps them reserved throughout.
            static = static - column("grad_bytes")
        return StageProblem(
            layer_time_s=column("fwd_s") + column("bwd_s"), layer_static_bytes=static, layer_act_bytes=column("act_bytes"),
            num_stages=chunks, in_flight=np.array(in_flight), mem_cap_bytes=np.array(caps), stage_speed=np.array(speeds),
            num_microbatches=config.num_microbatches, devices=config.pp,
            layer_transient_bytes=column("temp_bytes") + column("held_bytes"), layer_work_bytes=column("work_bytes"),
            layer_fwd_s=column("fwd_s"), schedule=str(config.schedule) if config.pp > 1 and self.schedule_splits else None,
            layer_tail_s=optimizer_step_s(config, self.precision, per_device[0][0], 1.0) * owned_params(
                config, per_device[0][1], column("dense_params"), column("expert_params"), column("frozen_params")),
        )

    def estimate(
        self,
        config: ParallelConfig,
        global_batch: int,
        *,
        recompute_per_layer: tuple[Recompute, ...] | None = None,
        boundaries: tuple[int, ...] | None = None,
        headroom: float = 0.0,
    ) -> Estimate:
        """Predicted step time, throughput, MFU and per-stage memory of `config`.

        Args:
            config: the parallel configuration (validated against the model and cluster).
            global_batch: sequences per optimizer step.
            recompute_per_layer: a recompute policy per layer overriding `config.recompute`.
            boundaries: pp*vpp+1 layer cut points; when None, the exact memory-aware split or its
                refinement by the schedule, the faster (`planner.default_split`).
            headroom: fraction of each device's memory to keep free.

        Raises:
            PlannerError: INVALID_INPUT when the configuration cannot exist.
        """
        check_config(self.graph, self.cluster, config, global_batch, self.code.cp_comm)
        graph, m = self.graph, config.num_microbatches
        per_device = self.stage_devices(config.pp)
        policies = self.policies(config, recompute_per_layer)
        if boundaries is None:
            splits = default_splits(self, config, policies, headroom)
            if len(splits) > 1:  # the solver's and the refined: priced in full, the faster kept
                return min((self.estimate(config, global_batch, recompute_per_layer=recompute_per_layer, boundaries=b,
                                          headroom=headroom) for b in splits),
                           key=lambda estimate: (not estimate.fits, estimate.step_time_s))
            boundaries = splits[0]
        stage_layers: list[list[int]] = [[] for _ in range(config.pp)]
        for chunk in range(config.pp * config.vpp):
            stage_layers[chunk % config.pp].extend(range(boundaries[chunk], boundaries[chunk + 1]))

        sums, stage_plans, breakdowns = [], [], []
        exposed_dp_s = optimizer_s = 0.0
        tables = {node: self.layer_table(config, device, node, policies) for device, node in self.device_types(config.pp)}
        priced: dict = {}  # stages with the same node and layer totals price the same (identical blocks)
        for stage in range(config.pp):
            device, node = per_device[stage]
            layer_ids = stage_layers[stage]
            rows = tables[node][layer_ids]
            total = rows.sum(axis=0).tolist()  # Python floats: the Estimate must serialise (JSON, YAML)
            total[COL["work_bytes"]] = float(rows[:, COL["work_bytes"]].max())  # one layer recomputes at a time
            sums.append(total)
            in_flight = pipeline.in_flight_microbatches(str(config.schedule), config.pp, stage, m, config.vpp) if config.pp > 1 else 1.0
            kept = kept_output_bytes(self.code.pp_outputs, config.pp, m, total[COL["loss_input_bytes"]])  # 0 but on the last
            recv_bytes = kept + recv_buffer_bytes(self.code.pp_buffers, boundaries, tables[node][:, COL["out_bytes"]], stage, config.pp, m,
                                                  config.seq_split)
            params = rows[:, COL["dense_params"]] + rows[:, COL["expert_params"]]
            trainable = rows[:, [COL["dense_params"], COL["expert_params"]]] - rows[:, [COL["frozen_params"]]] * [1, 0]
            first_gathered = rows[int(np.argmax(params > 0)), [COL["dense_params"], COL["expert_params"]]]
            last_reduced = trainable[int(np.argmax(trainable.sum(axis=1) > 0))]
            key = (node, tuple(total), float(params.max()), in_flight, recv_bytes, tuple(first_gathered.tolist()),
                   tuple(last_reduced.tolist()))
            if key not in priced:
                priced[key] = self._stage_costs(config, device, node, *key[1:])
            stage_dp_s, stage_optimizer_s, breakdown, host_bytes = priced[key]
            exposed_dp_s, optimizer_s = max(exposed_dp_s, stage_dp_s), max(optimizer_s, stage_optimizer_s)
            breakdowns.append((device, node, breakdown, host_bytes))
            first, last = layer_ids[0], layer_ids[-1]
            stage_plans.append(StagePlan(
                index=stage, first_layer=first, last_layer=last, chunks=contiguous_runs(layer_ids),
                layer_names=tuple(graph.layers[i].name for i in layer_ids),
                fqns=tuple(f for i in layer_ids for f in graph.layers[i].fqns),
                ranks=(stage * config.devices // config.pp, (stage + 1) * config.devices // config.pp - 1),
                device=device.name, fwd_s=float(total[COL["fwd_s"]]), bwd_s=float(total[COL["bwd_s"]]),
                memory={**breakdown.to_dict(), "capacity_bytes": device.mem_bytes},
            ))

        hops_s = pipeline_hop_times(self.cluster, config, per_device, [
            float(tables[per_device[chunk % config.pp][1]][boundaries[chunk + 1] - 1, COL["out_bytes"]]) / config.seq_split
            for chunk in range(config.pp * config.vpp - 1)])
        fwd_s = [float(t[COL["fwd_s"]]) for t in sums]
        bwd_s = [float(t[COL["bwd_s"]]) for t in sums]
        if config.pp > 1:
            pipe_s = pipeline_sim.priced_step_s(str(config.schedule), fwd_s, bwd_s, m, config.vpp, hops_s)
        else:
            pipe_s = m * (fwd_s[0] + bwd_s[0])
        exposed_dp_s += max(tied_gradient_sum_s(config, sum(self.graph.stage_copy_params), end, self.cluster.oversubscription)
                            for end in {per_device[0][1], per_device[-1][1]})  # first and last stages, at the slower's links
        step_s = pipe_s + exposed_dp_s + optimizer_s
        slowest = max(sums, key=lambda t: t[COL["fwd_s"]] + t[COL["bwd_s"]])
        busy_s = m * float(slowest[COL["fwd_s"]] + slowest[COL["bwd_s"]])
        time_breakdown = {
            "compute_s": m * float(slowest[COL["compute_s"]]),
            "recompute_s": m * float(slowest[COL["recompute_s"]]),
            "tp_comm_s": m * float(slowest[COL["tp_comm_s"]]),
            "cp_comm_s": m * float(slowest[COL["cp_comm_s"]]),
            "ep_comm_s": m * float(slowest[COL["ep_comm_s"]]),
            "fsdp_comm_exposed_s": m * float(slowest[COL["fsdp_exposed_s"]]),
            "pp_bubble_s": max(0.0, pipe_s - busy_s),
            "dp_comm_exposed_s": exposed_dp_s,
            "optimizer_s": optimizer_s,
        }
        stages = [(plan, device, node, breakdown, host_bytes, self.dtype_for(device))
                  for plan, (device, node, breakdown, host_bytes) in zip(stage_plans, breakdowns)]
        return assemble_estimate(graph, self.cluster.num_devices, self.dtype, config, global_batch, step_s, pipe_s, time_breakdown,
                                 stages, headroom, hops_s)

    def _stage_costs(self, config: ParallelConfig, device: DeviceSpec, node: NodeSpec, total: tuple, largest_params: float,
                     in_flight: float, recv_bytes: float, first_gathered: tuple, last_reduced: tuple) -> tuple:
        """(exposed data-parallel traffic, optimizer step, memory, host memory of offloaded states) of
        one stage from its `layer_table` column sums, its largest layer, its pipeline receive buffers
        and its first layers with parameters and with trainable ones (`dp_exposed_s`)."""
        groups = mesh_groups(config, node.devices_per_node)
        dense, expert, frozen = total[COL["dense_params"]], total[COL["expert_params"]], total[COL["frozen_params"]]
        shared = cp_shares_shard_links(groups)  # the windows are what the compute leaves beside a cp exchange on the links
        dp_s = dp_exposed_s(config, self.precision, node, groups, dense, expert, total[COL["fwd_s"]] - shared * total[COL["cp_hidden_fwd_s"]],
                            total[COL["bwd_s"]] - shared * total[COL["cp_hidden_bwd_s"]], self.cluster.oversubscription,
                            self.code.dp_sync, frozen, first_gathered, last_reduced)
        expert_group = expert_data_group(config, node).size
        dense_shard = config.shard_ranks if config.zero >= 1 else 1
        breakdown = memory_model.stage_memory(
            params=dense + expert, expert_params=expert, activation_bytes_per_microbatch=total[COL["act_bytes"]],
            in_flight=in_flight, zero=state_zero(config), dense_shard_group=config.shard_ranks, expert_shard_group=expert_group,
            gathered_params=min(self.code.zero3_fetch.gathered_layers * largest_params, dense + expert) if config.zero == 3 else 0.0,
            temp_bytes=total[COL["temp_bytes"]], work_bytes=total[COL["work_bytes"]], held_bytes=total[COL["held_bytes"]],
            grads_at_peak=config.num_microbatches > 1,
            grads_pooled=grads_pooled(config), chunks=config.vpp, comm_buffer_bytes=recv_bytes, frozen_params=frozen,
            buffer_bytes=total[COL["buffer_bytes"]], **state_options(config, self.precision),
        )
        owned = owned_params(config, node, dense, expert, frozen)
        host_bytes = host_state_bytes(owned, frozen / dense_shard) if config.offload_optimizer else 0.0
        return dp_s, optimizer_step_s(config, self.precision, device, owned), breakdown, host_bytes
