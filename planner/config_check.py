"""Whether one parallel configuration can exist for a model, cluster and batch (`check_config`):
the reasons the evaluator and the search refuse one, each naming the field and the fix."""
from __future__ import annotations

from costmodel.hardware import Cluster
from planner.config import ParallelConfig, Schedule, check_batch_split, check_zero_bubble_sharding
from planner.errors import invalid
from planner.graph import ModelGraph, Recompute
from planner.layer_comm import CpComm
from planner.space import ZERO_BUBBLE_RECOMPUTE, divisors


def check_config(graph: ModelGraph, cluster: Cluster, config: ParallelConfig, global_batch: int,
                 cp_comm: CpComm = CpComm.ALL_GATHER) -> None:
    """Raises PlannerError(INVALID_INPUT) naming why `config` cannot exist for this model, cluster and
    batch, with context parallelism exchanging as `cp_comm` says."""
    dims = graph.dims
    if config.devices != cluster.num_devices:
        raise invalid(
            f"dp*tp*pp*cp = {config.dp}*{config.tp}*{config.pp}*{config.cp} = {config.devices}: must equal the cluster's "
            f"{cluster.num_devices} devices; fix: price it on a cluster of {config.devices} devices, or change the degrees"
        )
    fitting = [tp for tp in divisors(cluster.num_devices)
               if not (dims.heads and dims.heads % tp) and not (dims.kv_heads and tp > 1 and dims.kv_heads % tp and tp % dims.kv_heads)]
    if dims.heads and dims.heads % config.tp:
        raise invalid(f"tp={config.tp}: must divide the {dims.heads} attention heads; fix: use tp {' or '.join(map(str, fitting))}")
    if dims.kv_heads and config.tp > 1 and dims.kv_heads % config.tp and config.tp % dims.kv_heads:
        raise invalid(f"tp={config.tp}: must divide, or be a multiple of, the {dims.kv_heads} key/value heads; fix: use tp "
                      f"{' or '.join(map(str, fitting))}")
    if config.cp > 1 and cp_comm is CpComm.ALL_TO_ALL:
        _check_head_split(dims.heads, dims.kv_heads, config.tp, config.cp)
    if config.recompute not in graph.recompute_policies:
        raise invalid(f"recompute={config.recompute}: not priced for this model (selective and op-level checkpointing are "
                      f"priced on fx/export traces; this one was traced at module level); use "
                      f"{' or '.join(map(str, graph.recompute_policies))}")
    if config.recompute == Recompute.SELECTIVE_OP and config.ep > 1:
        raise invalid(f"recompute=selective_op with ep={config.ep}: op-level checkpointing replays each block's ops one "
                      f"for one, and the experts' own FSDP units inside the block run other hooks in the replay; use "
                      f"recompute selective or full, or ep=1")
    if config.schedule == Schedule.ZERO_BUBBLE and config.pp > 1 and config.recompute not in ZERO_BUBBLE_RECOMPUTE:
        raise invalid(f"recompute={config.recompute} with schedule=zb: torch's zero-bubble schedule runs each backward as "
                      f"an input-gradient and a weight-gradient pass, and selective checkpointing allows one backward per "
                      f"region; use recompute none or full, or another schedule")
    check_zero_bubble_sharding(config)
    if config.tp > 1 and not any(layer.ops for layer in graph.layers):
        raise invalid(f"tp={config.tp}: the model was traced at module level (no op graph), so only tp=1 is supported")
    if config.ep > 1 and (not dims.experts or dims.experts % config.ep):
        raise invalid(f"ep={config.ep}: must divide the model's {dims.experts} experts; use ep "
                      f"{', '.join(str(e) for e in divisors(dims.experts) if (config.dp * config.cp) % e == 0)}"
                      if dims.experts else f"ep={config.ep}: the model has no experts; use ep=1")
    if config.cp > 1 and graph.recurrent_targets:
        raise invalid(f"cp={config.cp}: the model's recurrent layers ({', '.join(graph.recurrent_targets)}) run their "
                      f"time steps in sequence order, so a sequence split into chunks cannot run them side by side; use cp 1")
    if config.cp > 1 and graph.seq_len % (2 * config.cp):
        raise invalid(f"cp={config.cp}: the load-balanced split cuts the sequence into 2*cp = {2 * config.cp} chunks, "
                      f"which must divide seq_len={graph.seq_len}; pick another cp or a seq_len multiple of {2 * config.cp}")
    if config.tp > 1 and config.sequence_parallel and graph.stream_tokens % config.seq_split:
        raise invalid(f"tp={config.tp}: sequence parallelism splits each sequence's {graph.stream_tokens} tokens "
                      f"{config.seq_split} ways (tp x cp), which must divide them; pick a tp that does, or "
                      f"sequence_parallel=False (the stream stays whole on the tp ranks)")
    chunks = config.pp * config.vpp
    if chunks > len(graph.layers):
        raise invalid(f"pp*vpp={chunks}: more pipeline chunks than the model's {len(graph.layers)} layers; use pp*vpp "
                      f"of at most {len(graph.layers)}")
    check_batch_split(global_batch, config.dp, config.micro_batch)
    if config.global_batch != global_batch:
        raise invalid(f"num_microbatches={config.num_microbatches}: dp*micro_batch*num_microbatches must equal global_batch={global_batch}")
    if config.schedule == Schedule.INTERLEAVED and config.num_microbatches % config.pp:
        raise invalid(f"num_microbatches={config.num_microbatches}: the interleaved schedule needs a multiple of pp={config.pp}")
    if config.pp > 1 and config.schedule == Schedule.GPIPE and config.num_microbatches < config.pp:
        raise invalid(f"num_microbatches={config.num_microbatches}: GPipe needs at least pp={config.pp} micro-batches")


def _check_head_split(heads: int, kv_heads: int, tp: int, cp: int) -> None:
    """Raises PlannerError unless context parallelism by all-to-all (`CpComm.ALL_TO_ALL`) can split
    each rank's query and key/value heads (after tp) over cp."""
    if not heads:
        raise invalid(f"cp={cp} with cp_comm=a2a: the model has no attention heads to split over cp; use cp_comm all_gather")
    local, local_kv = heads // tp, max(1, (kv_heads or heads) // tp)
    if local % cp or local_kv % cp:
        raise invalid(f"cp={cp} with cp_comm=a2a: the all-to-all splits each rank's {local} query and {local_kv} "
                      f"key/value heads (after tp={tp}) over cp, which must divide both; pick such a cp, or cp_comm all_gather")
