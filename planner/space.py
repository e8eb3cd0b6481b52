"""Enumerate the ParallelConfigs that can exist for a model on a cluster; keep a reason for each rejection.

Degrees: tp divides the heads and stays inside a node (tp is innermost on the mesh, so a group
spanning nodes would run every per-layer collective over the NICs) unless `allow_tp_across_nodes`
or the user fixes tp; pp divides the devices left and never exceeds the layers; 2*cp divides the
sequence (the load-balanced split cuts it into 2*cp chunks, each rank taking one from each end),
from `CP_MIN_SEQ_LEN` tokens unless the global batch limits dp (a search-speed choice, see there);
ep divides the experts and dp*cp; dp is what is left. Micro-batches divide the per-replica batch.
`planner.config_check.check_config` says why a given configuration (the user's, or one of these) cannot exist.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from costmodel.hardware import Cluster
from planner.config import ParallelConfig, Schedule, sequence_parallel_for, torch_runs_rounds
from planner.errors import PlannerError, invalid
from planner.mesh import stage_devices
from planner.graph import ModelGraph, Recompute

# Context parallelism is searched from this sequence length up, as Megatron-Core and torchtitan use
# it (8K+). A speed choice: shorter sequences double the space, though cp can win there by splitting
# activations in place of tp (mixtral-8x22b on 512 H100 at 4K tokens: 42.3 -> 44.1% MFU, search 2.8 ->
# 7.7 s). Where the batch leaves more than a node's devices beside dp, tp cannot take them, so cp is
# searched at any length (llama3-8b, 2 x 8 H100, 97 x 4K tokens: tp2 pp8 3.557 s, pp4 cp4 3.227 s; at
# any shortfall, gpt3-175b on 1,024 A100s searched 2.6 -> 6.8 s for 0.3%).
CP_MIN_SEQ_LEN = 8192
# The largest context-parallel degree searched or accepted.
CP_MAX = 32

# Largest micro-batch the search tries: `MAX_MICRO_BATCH` sequences, or more up to `MAX_MICRO_BATCH_TOKENS`
# stream tokens (short sequences, a ViT's patches). Beyond both, GEMM rows (micro-batch x tokens) are well
# past where efficiency saturates (MAMF curves flatten above ~1e11 FLOPs per GEMM, an 8192-wide layer at
# 2K rows), so bigger ones only add activation memory; 16 x 2048 tokens is the usual 2K-token runs' cap.
MAX_MICRO_BATCH = 16
MAX_MICRO_BATCH_TOKENS = 16 * 2048

# Virtual pipeline chunks per device the search tries with the interleaved schedule.
VPP_CHOICES = (2, 3, 4)


@dataclass(frozen=True)
class Rejection:
    """A configuration (or family of them) that was ruled out, and why."""

    what: str
    reason: str

    def to_dict(self) -> dict:
        return {"what": self.what, "reason": self.reason}


@dataclass
class Space:
    """Valid degree tuples and everything rejected on the way."""

    degrees: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # (dp, tp, pp, cp, ep)
    rejected: list[Rejection] = field(default_factory=list)
    not_searched: list[str] = field(default_factory=list)  # what the search leaves out for speed, and how to price it


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, from its prime factors (trial division stops at a prime rest)."""
    found = [1]
    prime = 2
    while n > 1:
        if prime * prime > n:
            prime = n  # what is left is prime
        power = 0
        while n % prime == 0:
            n //= prime
            power += 1
        found = [d * prime**k for d in found for k in range(power + 1)]
        prime += 1 if prime == 2 else 2
    return sorted(found)


def _fixed(constraints: dict, key: str, options: list[int], space: Space, label: str, where: str = "",
           context: str = "") -> list[int]:
    """Apply a user's fixed value (`tp=8`) or bounds (`max_tp=4`, `min_tp=2`) to `options`. The
    rejection of a fixed value names the `options` under `context` (the other degrees they depend
    on) and, unless the value was rejected for a reason of its own already, `where`: what limits them."""
    if key in constraints and constraints[key] is not None:
        value = constraints[key]
        if value not in options:
            given = [r.reason for r in space.rejected if r.what == f"{key}={value}"]
            own = [reason for reason in given if "options" not in reason]  # its own reason, given already
            reason = (f"options{context} are {options}" if own
                      else f"not possible{context}{where}; options are {options}")
            if reason not in given:
                space.rejected.append(Rejection(f"{key}={value}", reason))
            return []
        return [value]
    low, high = constraints.get(f"min_{key}", 1), constraints.get(f"max_{key}", max(options or [1]))
    bound = ", ".join(f"{side}_{key}={constraints[f'{side}_{key}']}" for side in ("min", "max") if f"{side}_{key}" in constraints)
    for o in options:
        if not low <= o <= high:
            space.rejected.append(Rejection(f"{key}={o}", f"outside the user bound {bound} on {label}"))
    return [o for o in options if low <= o <= high]


def enumerate_degrees(graph: ModelGraph, cluster: Cluster, constraints: dict, global_batch: int | None = None) -> Space:
    """Every (dp, tp, pp, cp, ep) that fits the cluster and model, with reasons for the rest (a
    `global_batch` that limits dp widens the context-parallel degrees searched: `CP_MIN_SEQ_LEN`)."""
    space = Space()
    devices = cluster.num_devices
    per_node = min(g.node.devices_per_node for g in cluster.groups)
    dims = graph.dims
    has_ops = any(layer.ops for layer in graph.layers)
    for key in ("tp", "pp", "dp", "cp"):
        if key in constraints and devices % constraints[key]:
            space.rejected.append(Rejection(f"{key}={constraints[key]}", f"does not divide the cluster's {devices} devices"))
    fixed = {key: constraints[key] for key in ("dp", "tp", "pp", "cp") if key in constraints}
    product = math.prod(fixed.values())
    if len(fixed) > 1 and (devices % product or (len(fixed) == 4 and product != devices)):
        raise invalid(f"{' x '.join(f'{key}={value}' for key, value in fixed.items())} = {product} devices: "
                      f"{'does not divide' if devices % product else 'is not'} the cluster's {devices}; "
                      f"fix degrees whose product {'divides' if len(fixed) < 4 else 'equals'} {devices}")
    tp_options = []
    for tp in divisors(devices):
        # A tp the user fixes may cross nodes, as `evaluate` prices it; the search keeps to a node.
        if tp > per_node and not constraints.get("allow_tp_across_nodes") and constraints.get("tp") != tp:
            if tp <= 64:
                space.rejected.append(Rejection(f"tp={tp}", f"exceeds the {per_node} devices of a node (tp collectives would cross the NICs)"))
            continue
        if dims.heads and dims.heads % tp:
            space.rejected.append(Rejection(f"tp={tp}", f"does not divide the {dims.heads} attention heads"))
            continue
        if dims.kv_heads and tp > 1 and dims.kv_heads % tp and tp % dims.kv_heads:
            space.rejected.append(Rejection(f"tp={tp}", f"neither divides nor is a multiple of the {dims.kv_heads} key/value heads"))
            continue
        if tp > 1 and not has_ops:
            space.rejected.append(Rejection(f"tp={tp}", "the model was traced at module level; tensor parallelism needs its op graph"))
            continue
        tp_options.append(tp)
    tp_options = _fixed(constraints, "tp", tp_options, space, "tensor parallelism",
                        f" ({per_node} devices per node, {dims.heads} attention heads)" if dims.heads else "")
    cp_all = [c for c in divisors(devices) if (c == 1 or graph.seq_len % (2 * c) == 0) and c <= CP_MAX]
    if graph.recurrent_targets:
        space.rejected += [Rejection(f"cp={c}", f"the recurrent layers ({', '.join(graph.recurrent_targets)}) run their "
                                                "time steps in sequence order, which a sequence split cannot run side by side")
                           for c in cp_all if c > 1]
        cp_all = [1]
    batch_dp = max((d for d in divisors(devices) if global_batch % d == 0), default=1) if global_batch else devices
    cp_options = [c for c in cp_all if c == 1 or graph.seq_len >= CP_MIN_SEQ_LEN or batch_dp * per_node < devices]
    if len(cp_options) < len(cp_all) and "cp" not in constraints:
        space.rejected.append(Rejection("cp>1", f"seq_len={graph.seq_len} is below {CP_MIN_SEQ_LEN}; context parallelism is not "
                                                  "searched at such lengths while what the global batch leaves beside dp fits in "
                                                  "a node, to keep the search fast, though it can win by splitting activations "
                                                  "in place of tp; give --cp to price it"))
        space.not_searched.append(f"cp > 1 below {CP_MIN_SEQ_LEN} tokens per sequence (give --cp to price it)")
    if "cp" in constraints:
        cp_options = cp_all
    cp_options = _fixed(constraints, "cp", cp_options, space, "context parallelism",
                        f" (cp divides the {devices} devices, 2 x cp the {graph.seq_len} tokens, and cp <= {CP_MAX})")
    layers, dp_options = len(graph.layers), _fixed(constraints, "dp", divisors(devices), space, "data parallelism")
    for tp in tp_options:
        for cp in cp_options:
            if devices % (tp * cp) or graph.stream_tokens % cp:
                continue
            fitting = [p for p in divisors(devices // (tp * cp)) if p <= layers]
            pp_all = [p for p in fitting if _stages_on_one_device_type(cluster, p, space)]
            for pp in _fixed(constraints, "pp", pp_all, space, "pipeline parallelism", f" on {devices} devices ({layers} layers)",
                             f" with tp={tp} and cp={cp}"):
                dp = devices // (tp * cp * pp)
                if dp not in dp_options:
                    continue
                for ep in _ep_options(graph, dp * cp, tp, constraints, space):
                    space.degrees.append((dp, tp, pp, cp, ep))
    if not space.degrees:
        raise no_degrees_error(space, constraints)
    if "zero" not in constraints and any(pp > 1 and dp * cp > 1 for dp, _, pp, cp, _ in space.degrees):
        space.rejected.append(Rejection("zero=2 with pp>1", "pipeline stages reduce the gradients once per step, so "
                                        "ZeRO-2 holds and moves what ZeRO-1 does; searched as zero=1"))
    one_micro_batch = bool(global_batch) and any(
        pp == 1 and dp * cp > 1 and global_batch % dp == 0
        and global_batch // dp in micro_batches(global_batch // dp, constraints, graph.stream_tokens)
        for dp, _, pp, cp, _ in space.degrees)
    if "zero" not in constraints and one_micro_batch:
        space.rejected.append(Rejection("zero=2 over one micro-batch", "FSDP2 reduce-scatters the gradients in the one "
                                        "backward, so ZeRO-1 holds and moves what ZeRO-2 does; searched as zero=1"))
    return space


def _stages_on_one_device_type(cluster: Cluster, pp: int, space: Space) -> bool:
    """Whether every pipeline stage of `pp` sits on one device type (a stage's devices run in lockstep)."""
    if len(cluster.groups) == 1:
        return True
    try:
        stage_devices(cluster, pp)
    except PlannerError:
        rejection = Rejection(f"pp={pp}", "a pipeline stage would span node groups of different device types")
        if rejection not in space.rejected:
            space.rejected.append(rejection)
        return False
    return True


def _ep_options(graph: ModelGraph, data_ranks: int, tp: int, constraints: dict, space: Space) -> list[int]:
    """Expert-parallel degrees dividing the experts and `data_ranks` (dp x cp): ep groups inside the
    flattened data-parallel axes, as Megatron-Core and `Plan.apply` build them; and a fixed ep that
    folds tp in (tp times a divisor of dp x cp: Megatron-Core's parallel folding, which the search
    does not offer on its own since Plan.apply does not build it)."""
    experts = graph.dims.experts
    if not experts:
        return _fixed(constraints, "ep", [1], space, "expert parallelism", ": the model has no experts")
    if not graph.dims.top_k:
        return _fixed(constraints, "ep", [1], space, "expert parallelism",
                      f": the {experts} experts' block states no `top_k` or `num_experts_per_tok`, which the "
                      "all-to-all's volume needs")
    fixed = constraints.get("ep")
    rejection = Rejection(f"ep={fixed}", f"does not divide the {experts} experts")
    if fixed and experts % fixed and rejection not in space.rejected:
        space.rejected.append(rejection)
    options = [e for e in divisors(data_ranks) if experts % e == 0]
    if fixed and fixed not in options and not experts % fixed and tp > 1 and not fixed % tp and not data_ranks % (fixed // tp):
        options.append(fixed)
    return _fixed(constraints, "ep", options, space, "expert parallelism",
                  f" ({experts} experts; ep divides them and dp x cp)", f" with dp x cp={data_ranks}")


def no_degrees_error(space: Space, constraints: dict) -> PlannerError:
    """Why no degree tuple is left: the rejections of the fixed values themselves first."""
    fixed = {k: v for k, v in constraints.items() if k.removeprefix("max_").removeprefix("min_") in ("tp", "pp", "dp", "cp", "ep")}
    named, axes = {f"{k}={v}" for k, v in fixed.items()}, {k.removeprefix("max_").removeprefix("min_") for k in fixed}
    about_fixed = ([r for r in space.rejected if r.what in named]
                   or [r for r in space.rejected if r.what.split("=")[0] in axes] or space.rejected)
    values: dict[str, dict[str, None]] = {}  # reason -> the values it rules out, each named once
    for r in about_fixed:
        values.setdefault(r.reason, {})[r.what] = None
    distinct = [f"{', '.join(whats)}: {reason}" for reason, whats in values.items()]
    own = [reason for reason in distinct if "options" not in reason]  # each value's own reasons first, then its options
    reasons = "; ".join((own + [reason for reason in distinct if reason not in own])[:3])
    named_values = ", ".join(f"{key.replace('_', '-')} {value}" for key, value in fixed.items())
    return invalid(f"no parallel degrees fit the constraints {named_values}: {reasons}; relax one of them")


def max_micro_batch(tokens_per_sequence: int) -> int:
    """The largest micro-batch the search tries for sequences of `tokens_per_sequence` stream tokens."""
    return max(MAX_MICRO_BATCH, MAX_MICRO_BATCH_TOKENS // max(1, tokens_per_sequence))


def micro_batches(per_replica_batch: int, constraints: dict, tokens_per_sequence: int) -> list[int]:
    options = [b for b in divisors(per_replica_batch) if b <= max_micro_batch(tokens_per_sequence)]
    if "micro_batch" in constraints:
        return [constraints["micro_batch"]] if per_replica_batch % constraints["micro_batch"] == 0 else []
    return options


def schedules(pp: int, layers: int, num_microbatches: int, constraints: dict) -> list[tuple[Schedule, int]]:
    """(schedule, vpp) pairs that can run `num_microbatches` on `pp` stages of `layers` layers."""
    if pp == 1:
        fixed_pipelining = constraints.get("vpp", 1) > 1 or constraints.get("schedule", Schedule.ONE_F_ONE_B) != Schedule.ONE_F_ONE_B
        return [] if fixed_pipelining else [(Schedule.ONE_F_ONE_B, 1)]
    allowed = constraints.get("schedules") or ([constraints["schedule"]] if "schedule" in constraints else None)
    out = [(Schedule.ONE_F_ONE_B, 1)]
    # torch's multi-stage schedules (zero bubble, interleaved) split the micro-batches into m // pp
    # equal rounds (`planner.apply.pipeline.check_schedule`); interleaved needs m % pp == 0 anyway.
    if torch_runs_rounds(num_microbatches, pp):
        out.append((Schedule.ZERO_BUBBLE, 1))
    if num_microbatches >= pp:
        out.append((Schedule.GPIPE, 1))
    if num_microbatches % pp == 0:
        vpps = [constraints["vpp"]] if "vpp" in constraints else list(VPP_CHOICES)
        out += [(Schedule.INTERLEAVED, v) for v in vpps if v > 1 and pp * v <= layers]
    if "vpp" in constraints:
        out = [(s, v) for s, v in out if v == constraints["vpp"]]
    if allowed:
        out = [(s, v) for s, v in out if str(s) in {str(a) for a in allowed}]
    return out


def recompute_options(constraints: dict, measured: tuple[Recompute, ...]) -> list[Recompute]:
    """The fixed policy, else every policy the tracer measured (`ModelGraph.recompute_policies`)."""
    if "recompute" in constraints:
        return [Recompute(constraints["recompute"])]
    return list(measured)


def zero_options(constraints: dict, dp_cp: int, pp: int, num_microbatches: int) -> list[int]:
    """The fixed ZeRO stage, else every stage that differs: no ZeRO-2 under pipelining, where it runs as
    ZeRO-1 (pipeline stages reduce the whole gradients once per step: `state_cost.zero3_exposed_s`),
    nor over one micro-batch, where ZeRO-1 runs as ZeRO-2 (FSDP2 reduce-scatters the gradients in the
    one backward). Without data parallelism only ZeRO-3 differs, without pipelining: FSDP2 on one rank
    keeps the fp32 master alone and casts each layer as it gathers it, where replication keeps a
    working copy too."""
    if "zero" in constraints:
        return [constraints["zero"]]
    if dp_cp == 1:
        return [0, 3] if pp == 1 else [0]
    return [0, 1, 3] if pp > 1 or num_microbatches == 1 else [0, 1, 2, 3]


def replica_options(constraints: dict, degrees: tuple[int, int, int, int, int], zero: int,
                    devices_per_node: int | None) -> list[int]:
    """The fixed `dp_replicate` where it can run, else 1 and, for ZeRO-3 over several nodes, hybrid
    sharding with one shard group per node (HSDP's usual layout: parameter gathers on the node's
    links, one all-reduce of the reduced shards over the NICs). Below ZeRO-3 it only trades memory
    for NIC traffic, so only a fixed value tries it; none where `devices_per_node` is None (unknown)."""
    dp, tp, _, cp, ep = degrees
    if "dp_replicate" in constraints:
        replicas = constraints["dp_replicate"]
        return [replicas] if dp % replicas == 0 and (replicas == 1 or (zero >= 1 and ep == 1)) else []
    if zero != 3 or ep > 1 or devices_per_node is None or devices_per_node % (tp * cp):
        return [1]
    per_node = devices_per_node // (tp * cp)
    return [1, dp // per_node] if dp % per_node == 0 and dp > per_node else [1]


def configs_for(degrees: tuple[int, int, int, int, int], graph: ModelGraph, global_batch: int, constraints: dict,
                devices_per_node: int | None = None):
    """Every ParallelConfig for one degree tuple: micro-batch, schedule/vpp, ZeRO stage, hybrid
    sharding (`replica_options`, on nodes of `devices_per_node`), recompute."""
    dp, tp, pp, cp, ep = degrees
    if global_batch % dp:
        return
    policies = recompute_options(constraints, graph.recompute_policies)
    for mb in micro_batches(global_batch // dp, constraints, graph.stream_tokens):
        m = global_batch // (dp * mb)
        for schedule, vpp in schedules(pp, len(graph.layers), m, constraints):
            for zero in zero_options(constraints, dp * cp, pp, m):
                for replicas in replica_options(constraints, degrees, zero, devices_per_node):
                    for recompute in policies:
                        yield ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp, micro_batch=mb,
                                             num_microbatches=m, zero=zero, recompute=recompute, schedule=schedule,
                                             sequence_parallel=sequence_parallel_for(graph.stream_tokens, tp, cp),
                                             offload_optimizer=bool(constraints.get("offload_optimizer", False)),
                                             dp_replicate=replicas)


def why_no_configs(degrees: tuple[int, int, int, int, int], graph: ModelGraph, global_batch: int,
                   constraints: dict) -> str:
    """Why `configs_for(degrees, ...)` yields nothing (its global batch already divides by dp)."""
    dp, _, pp, _, ep = degrees
    replicas = constraints.get("dp_replicate", 1)
    if dp % replicas:
        return f"dp_replicate={replicas} does not divide dp={dp}"
    if replicas > 1 and ep > 1:
        return f"dp_replicate={replicas}: hybrid sharding of expert-parallel models (ep={ep}) is not supported"
    if not micro_batches(global_batch // dp, constraints, graph.stream_tokens):
        return (f"micro_batch={constraints['micro_batch']} does not divide the sequences per data-parallel replica "
                f"(global_batch={global_batch} / dp)")
    if pp == 1:
        return "the fixed schedule/vpp needs pipeline stages (pp > 1)"
    return (f"the fixed schedule/vpp cannot run {pp} stages of {len(graph.layers)} layers (interleaved needs "
            f"num_microbatches divisible by pp and pp*vpp <= layers; gpipe needs num_microbatches >= pp; zb needs "
            f"num_microbatches divisible by num_microbatches // pp)")


# Recompute policies torch's zero-bubble schedule (ScheduleInterleavedZeroBubble) can run: it calls
# backward twice on each stage's graph (input gradients, then weight gradients), which
# torch.utils.checkpoint's selective policies refuse ("Trying to backward an extra time").
ZERO_BUBBLE_RECOMPUTE = (Recompute.NONE, Recompute.FULL)


def per_layer_recompute(graph: ModelGraph, config: ParallelConfig) -> tuple[Recompute, ...]:
    """The recompute policies a layer of `config` may take: those `check_config` allows it uniformly."""
    policies = graph.recompute_policies
    if config.ep > 1:
        policies = tuple(p for p in policies if p != Recompute.SELECTIVE_OP)
    if config.schedule == Schedule.ZERO_BUBBLE and config.pp > 1:
        policies = tuple(p for p in policies if p in ZERO_BUBBLE_RECOMPUTE)
    return policies
