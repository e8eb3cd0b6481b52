"""ParallelConfig: one point of the search space, validated on creation."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum

from planner.errors import check_positive_int, invalid
from planner.graph import Recompute


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zb"


# Training dtypes the planner prices: mixed precision in bf16/fp16, fp8 GEMMs over bf16
# (`costmodel.compute.GEMM_ONLY_DTYPES`), or plain fp32 (e.g. CPU ranks without bf16 GEMMs).
TRAINING_DTYPES = ("bf16", "fp16", "fp8", "fp32")
# The choices a user gives for one configuration (`planner.api.make_config`, the command line's flags).
CONFIG_KEYS = ("tp", "pp", "dp", "cp", "ep", "vpp", "micro_batch", "zero", "recompute", "schedule", "offload_optimizer",
               "dp_replicate")

_VALUES = {kind: frozenset(str(member) for member in kind) for kind in (Recompute, Schedule)}

# torch.distributed.pipelining's schedules with several stages per rank (`planner.apply.pipeline`).
MULTI_STAGE_SCHEDULES = frozenset({Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE})


def pipeline_rounds(num_microbatches: int, pp: int) -> int:
    """Rounds torch's multi-stage schedules split the micro-batches into: m // pp (at least 1), each
    of as many micro-batches."""
    return max(1, num_microbatches // pp)


def torch_runs_rounds(num_microbatches: int, pp: int) -> bool:
    """Whether torch's multi-stage schedules can run `num_microbatches` on `pp` stages (equal rounds)."""
    return num_microbatches % pipeline_rounds(num_microbatches, pp) == 0


def check_zero_bubble_sharding(config: ParallelConfig) -> None:
    """Raises PlannerError for ZeRO-3 under torch's zero-bubble schedule. Its weight-gradient pass
    takes the weights a stage's module holds when the input-gradient pass runs, and FSDP2 holds the
    sharded ones then (resharded after the forward), so autograd finds none of them in the graph:
    every stage but the first, whose pass is a full backward, never updates (torch 2.13)."""
    if config.schedule == Schedule.ZERO_BUBBLE and config.pp > 1 and config.zero == 3:
        raise invalid("zero=3 with schedule=zb: torch's zero-bubble schedule computes weight gradients for the "
                      "weights a stage holds after its forward, which FSDP2 has resharded, so every stage but the "
                      "first would never update; use zero 0, 1 or 2, or another schedule")


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees, micro-batching, ZeRO stage, recompute policy and pipeline schedule.

    `dp * tp * pp * cp` equals the device count; expert parallelism `ep` lives inside `dp * cp`
    (experts are sharded over ep ranks of the data-parallel group, each expert split over tp), or
    folds tp in (Megatron-Core's MoE parallel folding: `ep` is tp times a divisor of `dp * cp`, its
    groups consecutive ranks across tp, each expert whole on its rank; `ep_folds_tp`). `vpp` is the
    number of virtual pipeline chunks per device (interleaved schedule only). `micro_batch` is
    sequences per micro-batch per data-parallel rank and `num_microbatches` how many of them one step
    runs.
    `offload_optimizer` keeps the fp32 master weights and Adam moments in host memory and runs the
    update on the CPU (ZeRO-Offload). `dp_replicate` > 1 is hybrid sharding (HSDP, MiCS): the dp
    ranks form `dp_replicate` replicas, each sharding the ZeRO states over its `dp / dp_replicate`
    ranks (times cp); gradients are reduce-scattered inside a replica, then all-reduced across
    replicas. The replica axis is the outer part of dp, so a replica's ranks are neighbours.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    micro_batch: int = 1
    num_microbatches: int = 1
    zero: int = 0
    recompute: Recompute = Recompute.NONE
    schedule: Schedule = Schedule.ONE_F_ONE_B
    sequence_parallel: bool = True
    offload_optimizer: bool = False
    dp_replicate: int = 1

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "ep", "vpp", "micro_batch", "num_microbatches", "dp_replicate"):
            check_positive_int(name, getattr(self, name))
        if self.zero not in (0, 1, 2, 3):
            raise invalid(f"zero={self.zero!r}: must be 0, 1, 2 or 3")
        for name, kind in (("recompute", Recompute), ("schedule", Schedule)):
            value = getattr(self, name)
            if isinstance(value, kind):
                continue
            if value not in _VALUES[kind]:
                raise invalid(f"{name}={value!r}: use one of {', '.join(str(member) for member in kind)}")
            object.__setattr__(self, name, kind(value))
        if (self.dp * self.cp) % self.ep_over_data:
            shard = self.dp * self.cp
            fitting = sorted({f * d for d in range(1, shard + 1) if shard % d == 0 for f in (1, self.tp)})
            raise invalid(f"ep={self.ep}: must divide dp*cp={shard} (experts are sharded inside the data-parallel "
                          f"group) or be tp={self.tp} times a divisor of it (tp folded into the expert groups); use ep "
                          f"{', '.join(map(str, fitting))}")
        if self.dp % self.dp_replicate:
            raise invalid(f"dp_replicate={self.dp_replicate}: must divide dp={self.dp} (the replicas split the data-parallel ranks)")
        if self.dp_replicate > 1 and self.zero == 0:
            raise invalid(f"dp_replicate={self.dp_replicate}: hybrid sharding replicates ZeRO shards, and zero=0 shards "
                          f"nothing; set zero 1-3 or drop dp_replicate")
        if self.dp_replicate > 1 and self.ep > 1:
            raise invalid(f"dp_replicate={self.dp_replicate} with ep={self.ep}: hybrid sharding of expert-parallel models "
                          f"is not supported; use dp_replicate=1 or ep=1")
        if self.vpp > 1 and self.schedule != Schedule.INTERLEAVED:
            raise invalid(f"vpp={self.vpp}: virtual pipeline stages need schedule=interleaved")
        if self.schedule == Schedule.INTERLEAVED and self.pp == 1:
            what = f"vpp={self.vpp}" if self.vpp > 1 else "schedule=interleaved"
            raise invalid(f"{what}: interleaving virtual pipeline stages needs pp > 1; set pp > 1 or drop it")
        if self.pp == 1 and self.schedule not in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED):
            raise invalid(f"schedule={self.schedule}: a pipeline schedule needs pp > 1; set pp > 1 or drop it (1f1b)")
        if self.schedule == Schedule.INTERLEAVED and self.vpp == 1:
            raise invalid("schedule=interleaved: needs vpp >= 2 virtual stages per device; set vpp=2 or schedule=1f1b")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.num_microbatches

    @property
    def shard_ranks(self) -> int:
        """Ranks one ZeRO shard of the dense model states spans: dp x cp, over `dp_replicate` replicas."""
        return self.dp * self.cp // self.dp_replicate

    @property
    def seq_split(self) -> int:
        """Ways the sequence of an activation between layers is split: cp, times tp under sequence parallelism."""
        return self.cp * (self.tp if self.sequence_parallel else 1)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def ep_folds_tp(self) -> bool:
        """Whether the expert groups take in the tp ranks (ep does not divide dp * cp but tp times a
        divisor of it does): Megatron-Core's MoE parallel folding with expert tensor parallelism 1."""
        return self.tp > 1 and (self.dp * self.cp) % self.ep != 0 and self.ep % self.tp == 0

    @property
    def ep_over_data(self) -> int:
        """How many ways the experts split over the dp * cp ranks: `ep`, or `ep / tp` where ep folds
        tp in. Folded or not, a rank holds `1 / (ep_over_data * tp)` of the expert weights and does
        that share of their work (folded: ep / tp times the experts, each whole, on a tp-th of the
        tokens)."""
        return self.ep // self.tp if self.ep_folds_tp else self.ep

    def to_dict(self) -> dict:
        out = asdict(self)
        out["recompute"] = str(self.recompute)
        out["schedule"] = str(self.schedule)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ParallelConfig":
        return cls(**data)

    def short(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.tp > 1 and not self.sequence_parallel:
            parts.insert(2, "no-sp")  # tensor parallelism with the stream replicated (`sequence_parallel_for`)
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.dp_replicate > 1:
            parts.append(f"hsdp{self.dp_replicate}")
        if self.vpp > 1:
            parts.append(f"v{self.vpp}")
        parts += [f"mb{self.micro_batch}x{self.num_microbatches}", f"z{self.zero}", str(self.recompute), str(self.schedule)]
        if self.offload_optimizer:
            parts.append("offload")
        return " ".join(parts)


def sequence_parallel_for(stream_tokens: int, tp: int, cp: int) -> bool:
    """Whether tensor parallelism splits the residual stream by sequence (Megatron-SP): where tp x cp
    divides each sequence's `stream_tokens`. Otherwise (ViT's 197 tokens at tp 2) the layout keeps the
    stream replicated on the tp ranks, norms and residuals whole, as Megatron-LM without SP."""
    return stream_tokens % (tp * cp) == 0


def check_batch_split(global_batch: int, dp: int, micro_batch: int) -> None:
    """Raises PlannerError unless dp ranks of `micro_batch`-sample micro-batches divide the global batch."""
    if global_batch % (dp * micro_batch):
        fix = (f"a micro-batch dividing {global_batch // dp}" if global_batch % dp == 0
               else f"a dp dividing {global_batch}")
        raise invalid(f"global_batch={global_batch}: must be a multiple of dp*micro_batch = {dp}*{micro_batch}; use a "
                      f"multiple of {dp * micro_batch}, or {fix}")
