"""Plan, Estimate and StagePlan: what the planner returns, serialisable and versioned."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from costmodel.profile_files import PROFILE_SUFFIXES
from planner.config import ParallelConfig
from planner.errors import invalid
from planner.plan_checks import SCHEMA_VERSION, check_plan_fields

PLAN_SUFFIXES = (".json", ".yaml", ".yml")

# The cost model's mean absolute error of throughput over the published runs of its goal groups
# (`python benchmarks/published.py`, benchmarks/results/published.txt, session 39): estimates closer
# than this are not told apart by the model.
PUBLISHED_MAPE = 0.054


def contiguous_runs(indices: list[int]) -> tuple[tuple[int, int], ...]:
    """(first, last) of each run of consecutive integers in `indices`, in their order."""
    starts = [i for k, i in enumerate(indices) if k == 0 or i != indices[k - 1] + 1]
    ends = [i for k, i in enumerate(indices) if k == len(indices) - 1 or indices[k + 1] != i + 1]
    return tuple(zip(starts, ends))


def check_plan_path(path: str | Path) -> Path:
    """`path` as a Path when it names a plan file format; PlannerError otherwise."""
    path = Path(path)
    if path.suffix not in PLAN_SUFFIXES:
        raise invalid(f"--out {path}: unknown extension; use .json, .yaml or .yml")
    return path


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: which layers (and module FQNs) run on which global ranks."""

    index: int
    first_layer: int
    last_layer: int
    layer_names: tuple[str, ...]
    fqns: tuple[str, ...]
    ranks: tuple[int, int]
    device: str
    fwd_s: float
    bwd_s: float
    memory: dict
    chunks: tuple[tuple[int, int], ...] = ()  # (first, last) layer of each contiguous run: vpp of them when interleaved

    def to_dict(self) -> dict:
        out = asdict(self)
        out["layers"] = [self.first_layer, self.last_layer]
        out["ranks"] = list(self.ranks)
        out["chunks"] = [list(chunk) for chunk in self.chunks]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "StagePlan":
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["layer_names"] = tuple(kwargs["layer_names"])
        kwargs["fqns"] = tuple(kwargs["fqns"])
        kwargs["ranks"] = tuple(kwargs["ranks"])
        kwargs["chunks"] = tuple(tuple(chunk) for chunk in kwargs.get("chunks", ()))
        return cls(**kwargs)


@dataclass(frozen=True)
class Fix:
    """One change of a configuration that does not fit, priced (`planner.fit_fixes`): `change` as
    command-line flags, with the step time and peak memory per device the changed one has;
    `combined` where it is several changes made together because no single one fits."""

    change: str
    step_time_s: float
    peak_memory_bytes: float
    fits: bool
    combined: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Estimate:
    """Predicted performance and memory of one configuration on one cluster.

    `time_breakdown` holds seconds per step by cause (compute, recompute, each exposed
    communication kind, pipeline bubble, optimizer); `memory` one breakdown per pipeline stage
    (the largest device of that stage) with its capacity.
    """

    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    peak_memory_bytes: float
    fits: bool
    time_breakdown: dict
    memory: list
    stages: tuple[StagePlan, ...] = ()
    bubble_fraction: float = 0.0
    config: ParallelConfig | None = None
    notes: tuple[str, ...] = ()  # how the model was traced and measured (`ModelGraph.notes`)
    # Seconds of one transfer from each stage's device to the next (the last: to the first, the
    # wrap of an interleaved schedule); empty without pipelining.
    pipeline_p2p_s: tuple[float, ...] = ()
    seq_len: int | None = None  # tokens per sequence priced (the model's own where none was given)
    global_batch: int | None = None  # sequences per optimizer step
    fixes: tuple[Fix, ...] = ()  # where it does not fit: the changes that would (`planner.fit_fixes`)
    training_code: dict = field(default_factory=dict)  # `TrainingCode.options()` priced (`planner.evaluate`, `planner.plan`)

    def host_overflow(self) -> dict | None:
        """The stage row (of `memory`) whose offloaded optimizer states exceed its devices' share of
        the node's host memory, if any (a share of None is unknown, not checked)."""
        over = [row for row in self.memory if 0 < (row.get("host_capacity_bytes") or 0.0) < row.get("host_bytes", 0.0)]
        return max(over, key=lambda row: row["host_bytes"], default=None)

    def to_dict(self) -> dict:
        out = {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "peak_memory_bytes": self.peak_memory_bytes,
            "fits": self.fits,
            "host_memory_fits": self.host_overflow() is None,  # offloaded states: `fits` is false without it
            "bubble_fraction": self.bubble_fraction,
            "time_breakdown": dict(self.time_breakdown),
            "memory": list(self.memory),
            "stages": [s.to_dict() for s in self.stages],
            "notes": list(self.notes),
            "pipeline_p2p_s": list(self.pipeline_p2p_s),
            "fixes": [fix.to_dict() for fix in self.fixes],
        }
        if self.training_code:
            out["training_code"] = dict(self.training_code)
        if self.config is not None:
            out["config"] = self.config.to_dict()
        if self.seq_len is not None:
            out.update(seq_len=self.seq_len, global_batch=self.global_batch)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Estimate":
        return cls(
            step_time_s=data["step_time_s"],
            tokens_per_s=data["tokens_per_s"],
            tflops_per_gpu=data["tflops_per_gpu"],
            mfu=data["mfu"],
            peak_memory_bytes=data["peak_memory_bytes"],
            fits=data["fits"],
            time_breakdown=data["time_breakdown"],
            memory=data["memory"],
            stages=tuple(StagePlan.from_dict(s) for s in data.get("stages", [])),
            bubble_fraction=data.get("bubble_fraction", 0.0),
            config=ParallelConfig.from_dict(data["config"]) if "config" in data else None,
            notes=tuple(data.get("notes", ())),
            pipeline_p2p_s=tuple(data.get("pipeline_p2p_s", ())),
            seq_len=data.get("seq_len"),
            global_batch=data.get("global_batch"),
            fixes=tuple(Fix(**fix) for fix in data.get("fixes", ())),
            training_code=data.get("training_code", {}),
        )


def stored_reference(ref: str) -> str:
    """A model or cluster reference as a plan stores it: a spec, cluster or device file (also the
    device file of `FILE:NODESxGPUS`; spec files take the profiles' suffixes) by its absolute path,
    since a plan is re-priced and applied from other directories; names and factories as given."""
    head, colon, shape = ref.rpartition(":")
    if colon and head.lower().endswith(PROFILE_SUFFIXES) and Path(head).is_file():
        return f"{Path(head).resolve()}:{shape}"
    if ref.lower().endswith(PROFILE_SUFFIXES) and Path(ref).is_file():
        return str(Path(ref).resolve())
    return ref


@dataclass(frozen=True)
class Alternative:
    config: ParallelConfig
    step_time_s: float
    tokens_per_s: float
    peak_memory_bytes: float
    note: str = ""
    # Where the memory plan chose per layer: each layer's recompute policy, and the layer cut points of
    # the pipeline chunks it split them at (the config's uniform policy and split otherwise).
    recompute_per_layer: tuple[str, ...] = ()
    chunk_boundaries: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "note": self.note,
            "recompute_per_layer": list(self.recompute_per_layer),
            "chunk_boundaries": list(self.chunk_boundaries),
        }


@dataclass(frozen=True)
class Plan:
    """The chosen configuration with its stages, per-module layouts, memory plan and estimate.

    Example::

        >>> import planner
        >>> plan = planner.plan("gpt3-125m", "a100-80g:1x8", global_batch=64, seq_len=1024)
        >>> plan.config.devices
        8
        >>> planner.Plan.from_json(plan.to_json()) == plan
        True
    """

    model: str
    cluster: str
    global_batch: int
    seq_len: int
    dtype: str
    config: ParallelConfig
    estimate: Estimate
    layouts: dict = field(default_factory=dict)
    memory_plan: dict = field(default_factory=dict)
    search: dict = field(default_factory=dict)
    alternatives: tuple[Alternative, ...] = ()
    rejected: tuple[dict, ...] = ()
    layer_names: tuple[str, ...] = ()
    layer_params: tuple[int, ...] = ()  # parameters per layer, aligned with layer_names (apply checks the model)
    training_code: dict = field(default_factory=dict)  # `TrainingCode.options()` the plan was priced with

    @property
    def stages(self) -> tuple[StagePlan, ...]:
        return self.estimate.stages

    def boundaries(self) -> tuple[int, ...]:
        """The layer cut points of the plan's pp * vpp chunks (chunk c runs on stage c % pp): each
        contiguous run of a stage's layers is a chunk."""
        index = {name: i for i, name in enumerate(self.layer_names)}
        starts = sorted(first for stage in self.stages
                        for first, _ in contiguous_runs([index[name] for name in stage.layer_names]))
        return (*starts, len(self.layer_names))

    def recompute_per_layer(self) -> tuple[str, ...]:
        """The recompute policy of each layer, as the memory plan names them."""
        policy = {name: p for p, names in self.memory_plan.get("recompute", {}).items() for name in names}
        return tuple(policy.get(name, str(self.config.recompute)) for name in self.layer_names)

    def to_dict(self) -> dict:
        out = {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "cluster": self.cluster,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "dtype": self.dtype,
        }
        estimate = self.estimate.to_dict()
        out.update({k: v for k, v in estimate.items() if k != "stages"})
        out["config"] = self.config.to_dict()
        out["stages"] = estimate["stages"]
        out["layouts"] = dict(self.layouts)
        out["memory_plan"] = dict(self.memory_plan)
        out["search"] = dict(self.search)
        out["alternatives"] = [a.to_dict() for a in self.alternatives]
        out["rejected"] = list(self.rejected)
        out["layer_names"] = list(self.layer_names)
        out["layer_params"] = list(self.layer_params)
        out["training_code"] = dict(self.training_code)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        """The plan `to_dict` wrote; PlannerError naming the first field that is missing or of the wrong type."""
        check_plan_fields(data)
        estimate = Estimate.from_dict(data)
        config = ParallelConfig.from_dict(data["config"])
        if config.global_batch != data["global_batch"]:
            raise invalid(f"plan field `global_batch`: {data['global_batch']} but its config runs dp*micro_batch*"
                          f"num_microbatches = {config.dp}*{config.micro_batch}*{config.num_microbatches} = "
                          f"{config.global_batch}; re-run `paraplan plan --out`")
        return cls(
            model=data["model"],
            cluster=data["cluster"],
            global_batch=data["global_batch"],
            seq_len=data["seq_len"],
            dtype=data["dtype"],
            config=config,
            estimate=estimate,
            layouts=data.get("layouts", {}),
            memory_plan=data.get("memory_plan", {}),
            search=data.get("search", {}),
            alternatives=tuple(
                Alternative(ParallelConfig.from_dict(a["config"]), a["step_time_s"], a["tokens_per_s"], a["peak_memory_bytes"],
                            a.get("note", ""), tuple(a.get("recompute_per_layer", ())), tuple(a.get("chunk_boundaries", ())))
                for a in data.get("alternatives", [])
            ),
            rejected=tuple(data.get("rejected", [])),
            layer_names=tuple(data.get("layer_names", [])),
            layer_params=tuple(data.get("layer_params", [])),
            training_code=data.get("training_code", {}),
        )

    def apply(self, model, **options):
        """Applies this plan to `model` with torch.distributed; see `planner.apply.apply_plan`."""
        from planner.apply import apply_plan  # imports torch.distributed (seconds); plans load without it

        return apply_plan(self, model, **options)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The plan `to_json` wrote; PlannerError when `text` is not JSON (`from_dict` for its fields)."""
        try:
            data = json.loads(text)
        except ValueError as error:
            raise invalid(f"plan JSON: not JSON ({error}); pass what Plan.to_json wrote") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Writes the plan to a .json or .yaml file, creating its folder."""
        path = check_plan_path(path)
        text = self.to_json()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            text = yaml.safe_dump(json.loads(text), sort_keys=False)  # numpy scalars as plain numbers
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as error:
            raise invalid(f"--out {path}: cannot write ({error.strerror}); pick a writable path") from None

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Reads a plan written by `save`.

        Raises:
            PlannerError: INVALID_INPUT when the file is missing or is not a plan.
        """
        path = Path(path)
        if not path.exists():
            raise invalid(f"plan file {path}: not found")
        import yaml

        try:
            text = path.read_text()
            data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
            return cls.from_dict(data)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError) as error:
            reason = " ".join(f"{type(error).__name__}: {error}".split())
            raise invalid(f"plan file {path}: not a paraplan plan ({reason}); write one with `paraplan plan --out`") from None
