"""Checks that a model, a device and a world size are the ones a plan can run on, before any process-group work.

A plan names its pipeline-cut units (`StagePlan.fqns`: top-level modules, with the blocks of a
ModuleList expanded as `layers.0`, `layers.1`, ...), the parameter count of each layer
(`Plan.layer_params`) and per-module placements for one representative block per distinct
structure (`Plan.layouts`). The model must have exactly those units, the same parameter count in
every pipeline stage, and every module the layouts name; each of its blocks takes the layout of the
representative block with the same structure (module types and parameter shapes). The model must
hold its weights and not have been applied to already (`check_arguments`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from costmodel.errors import ProfileError
from costmodel.profile_loader import load_cluster
from planner.errors import invalid, unsupported
from planner.models import required_inputs
from planner.result import Plan
from planner.graph import OpKind
from planner.layering import Grouping
from planner.tp_strategies import Placement, weight_split_dim
from planner.zoo.moe import GroupedLinear

# Placements `parallelize_module` applies to a module through a weight split.
_SPLIT_PLACEMENTS = frozenset({Placement.COLWISE, Placement.ROWWISE})
# The op kind whose weight split (`weight_split_dim`) a module type follows.
_WEIGHT_KINDS = ((nn.Embedding, OpKind.EMBEDDING), (nn.Linear, OpKind.MATMUL))


@dataclass(frozen=True)
class ModelMatch:
    """The model's units as the plan sees them.

    Attributes:
        units: pipeline-cut unit FQNs in forward order.
        blocks: the units that are repeated blocks (children of a ModuleList or ModuleDict).
        layouts: placement of every module FQN of the model that the plan shards (all blocks).
        tied: units that share a parameter with another unit (tied embeddings).
        tied_params: for each shared parameter, its names in the model (one per module using it).
    """

    units: tuple[str, ...]
    blocks: tuple[str, ...]
    layouts: dict[str, str]
    tied: frozenset[str] = frozenset()
    tied_params: tuple[tuple[str, ...], ...] = ()


def world_size() -> int:
    """Ranks of the job: the default process group's size, else torchrun's WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_world_size(plan: Plan) -> None:
    """Raises PlannerError when the job does not have the plan's device count."""
    size = world_size()
    if size != plan.config.devices:
        raise invalid(f"world size {size}: the plan ({plan.config.short()}) needs {plan.config.devices} processes; "
                      f"start torchrun with --nproc-per-node {plan.config.devices} (or re-plan for {size} device{'s' * (size != 1)})")


def check_one_input(model: nn.Module) -> None:
    """Raises PlannerError when the model's forward needs more than one input: `forward_backward`
    and the first pipeline stage feed it one tensor of tokens per micro-batch."""
    required = required_inputs(model)
    if len(required) > 1:
        raise unsupported(f"model: its forward takes {len(required)} inputs ({', '.join(required)}), and Plan.apply feeds "
                          f"it one tensor of tokens per micro-batch; wrap it in a module whose forward takes the tokens "
                          f"alone (and builds or holds the rest)")


def model_units(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(units, blocks): top-level children in order, the members of a ModuleList/ModuleDict expanded,
    and the modules holding the planner's block stack (`planner.layering.Grouping`: an
    nn.TransformerEncoder's `layers`) expanded into their children, as the planner's layers name them."""
    container = Grouping.of(model).container or ""
    units, blocks = [], []

    def expand(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if container.startswith(f"{fqn}."):  # nanoGPT's `transformer` ModuleDict around its blocks `h`
                expand(f"{fqn}.", child)
            elif isinstance(child, (nn.ModuleList, nn.ModuleDict)) or fqn == container:
                members = [f"{fqn}.{key}" for key, _ in child.named_children()]
                units.extend(members)
                blocks.extend(members)
            else:
                units.append(fqn)

    expand("", model)
    return tuple(units), tuple(blocks)


def _signature(module: nn.Module) -> tuple:
    return tuple((name, type(m).__name__, tuple((p, tuple(t.shape)) for p, t in m.named_parameters(recurse=False)))
                 for name, m in module.named_modules())


def _unit_params(model: nn.Module, units: tuple[str, ...]) -> dict[str, int]:
    """Parameters per unit; a parameter shared by several units counts for the first (as the tracer does)."""
    seen: set[int] = set()
    counts = {}
    for unit in units:
        fresh = [p for p in model.get_submodule(unit).parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        counts[unit] = sum(p.numel() for p in fresh)
    return counts


def _check_units(plan: Plan, units: tuple[str, ...], blocks: tuple[str, ...]) -> None:
    planned = [fqn for stage in plan.stages for fqn in stage.fqns]
    planned_blocks = [name for name in plan.layer_names if "." in name]
    if len(planned_blocks) != len(blocks):
        raise invalid(f"model: has {len(blocks)} blocks but the plan for {plan.model} has {len(planned_blocks)}; "
                      f"apply the plan to the model it was made for, or re-plan for this model")
    missing = [fqn for fqn in planned if fqn not in units]
    extra = [fqn for fqn in units if fqn not in planned]
    if missing or extra:
        what = f"lacks module {missing[0]!r}" if missing else f"has module {extra[0]!r} the plan does not place"
        raise invalid(f"model: {what} (plan for {plan.model}); apply the plan to the model it was made for, or re-plan")


def _check_params(plan: Plan, model: nn.Module, units: tuple[str, ...]) -> None:
    outside = _outside(model, units)
    if outside and plan.config.pp > 1:
        raise unsupported(f"model: parameter {outside[0][0]!r} sits outside its units ({', '.join(units[:2])}, ...), on a module "
                          f"pipeline stages do not hold; move it into a unit (e.g. the embedding) or plan with --pp 1")
    if not plan.layer_params:
        return
    per_unit = _unit_params(model, units)
    per_layer = dict(zip(plan.layer_names, plan.layer_params))
    for stage in plan.stages:
        expected = sum(per_layer[name] for name in stage.layer_names)
        # one stage holds the whole model, its own parameters too
        actual = sum(per_unit[fqn] for fqn in stage.fqns) + sum(p.numel() for _, p in outside) * (plan.config.pp == 1)
        if expected != actual:
            raise invalid(f"model: pipeline stage {stage.index} ({stage.layer_names[0]}..{stage.layer_names[-1]}) has "
                          f"{actual:,} parameters, the plan for {plan.model} expects {expected:,}; the shapes differ: "
                          f"apply the plan to the model it was made for, or re-plan")


def _outside(model: nn.Module, units: tuple[str, ...]) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of those no unit holds (registered on the model itself or on a module beside the units)."""
    return [(name, param) for name, param in model.named_parameters() if owner_unit(name, units) is None]


def owner_unit(fqn: str, units: tuple[str, ...]) -> str | None:
    matches = [u for u in units if fqn == u or fqn.startswith(u + ".")]
    return max(matches, key=len) if matches else None


def expand_layouts(plan: Plan, model: nn.Module, units: tuple[str, ...], blocks: tuple[str, ...]) -> dict[str, str]:
    """Plan layouts (one representative block per structure) mapped onto every block of `model`.

    Raises:
        PlannerError: a layout names a module the model lacks, a placement does not fit the module
            type, or a block has no representative of its structure.
    """
    by_unit: dict[str, dict[str, str]] = {}
    for fqn, placement in plan.layouts.items():
        unit = owner_unit(fqn, units)
        if unit is None:
            raise invalid(f"model: lacks module {fqn!r} named by the plan's layouts; apply the plan to the model it was made for")
        by_unit.setdefault(unit, {})[fqn[len(unit):]] = placement
    representatives = {_signature(model.get_submodule(u)): rel for u, rel in by_unit.items() if u in blocks}
    out: dict[str, str] = {}
    for unit in units:
        relative = by_unit.get(unit)
        if relative is None and unit in blocks and plan.layouts:
            relative = representatives.get(_signature(model.get_submodule(unit)))
            if relative is None:
                raise invalid(f"model: block {unit!r} matches no block structure of the plan's layouts; re-plan for this model")
        for suffix, placement in (relative or {}).items():
            out[unit + suffix] = placement
    for fqn, placement in out.items():
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            raise invalid(f"model: lacks module {fqn!r} named by the plan's layouts; apply the plan to the model it was made for") from None
        if placement in _SPLIT_PLACEMENTS and not isinstance(module, (nn.Linear, nn.Embedding, GroupedLinear)):
            raise invalid(f"layout {fqn}: {placement} needs a Linear, Embedding or GroupedLinear, the model has "
                          f"{type(module).__name__}; re-plan")
    return out


def _check_ties(model: nn.Module, units: tuple[str, ...], layouts: dict[str, str]) -> tuple[tuple[str, ...], ...]:
    """Tensor parallelism must split a shared parameter the same way in every module that uses it
    (e.g. a tied embedding and output head both by vocabulary).

    Returns:
        For each shared parameter, its names in the model.
    """
    owners: dict[int, list[str]] = {}
    for unit in units:
        for name, param in model.get_submodule(unit).named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), []).append(f"{unit}.{name}")
    shared = tuple(tuple(names) for names in owners.values() if len(names) > 1)
    for names in shared:
        dims = {n: _weight_split_dim(model, n, layouts) for n in names}
        differing = [n for n in names if dims[n] != dims[names[0]]]
        if differing:
            raise invalid(f"model: {names[0]} and {differing[0]} share one parameter that the plan's layouts split "
                          f"differently; untie them (spec: tie_embeddings: false) or re-plan with --tp 1")
    return shared


def match_model(plan: Plan, model: nn.Module) -> ModelMatch:
    """Checks `model` against `plan` (see the module docstring) and returns its units and layouts.

    Raises:
        PlannerError: INVALID_INPUT with a one-line message naming the mismatch.
    """
    units, blocks = model_units(model)
    _check_units(plan, units, blocks)
    _check_params(plan, model, units)
    layouts = expand_layouts(plan, model, units, blocks)
    shared = _check_ties(model, units, layouts)
    return ModelMatch(units, blocks, layouts, frozenset(owner_unit(n, units) for names in shared for n in names), shared)


def _weight_split_dim(model: nn.Module, name: str, layouts: dict[str, str]) -> int | None:
    """The dimension tensor parallelism splits parameter `name` along, None when it is replicated."""
    fqn, _, param = name.rpartition(".")
    placement = layouts.get(fqn)
    if placement not in _SPLIT_PLACEMENTS:
        return None
    module = model.get_submodule(fqn)
    kind = next((kind for module_type, kind in _WEIGHT_KINDS if isinstance(module, module_type)), None)
    if param == "weight" and kind is not None:
        return weight_split_dim(kind, Placement(placement))
    raise invalid(f"model: {name} is shared with another module and split by tensor parallelism, which cannot "
                  f"split it the same way everywhere; untie it or re-plan with --tp 1")


def default_device() -> torch.device:
    """This process's GPU (torchrun's LOCAL_RANK) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


APPLIED_MARK = "_paraplan_applied"  # set on a model once `Plan.apply` starts splitting and wrapping its modules


def check_arguments(plan, model, device) -> torch.device:
    """The device to run on; PlannerError when the plan, the model or the device cannot be applied."""
    if not isinstance(plan, Plan):
        raise invalid(f"plan: expected a Plan (planner.plan, Plan.load), got {type(plan).__name__}")
    if not isinstance(model, nn.Module):
        raise invalid(f"model: expected the nn.Module the plan was made for, built with its weights, got "
                      f"{type(model).__name__}; build it first (examples/train.py shows how)")
    if getattr(model, APPLIED_MARK, False):
        raise invalid("model: a plan was applied to it already (its modules are split and wrapped); build a fresh one, "
                      "with the same seed on every rank, for each Plan.apply")
    if any(tensor.is_meta for tensor in (*model.parameters(), *model.buffers())):
        raise invalid("model: its parameters are on the meta device (no weights); build it on a real device "
                      "(the same seed on every rank) before applying the plan")
    try:
        device = torch.device(device) if device is not None else default_device()
    except (RuntimeError, TypeError):
        raise invalid(f"device={device!r}: not a device; use 'cpu' or 'cuda'") from None
    if device.type not in ("cpu", "cuda"):
        raise invalid(f"device='{device}': plans apply on 'cpu' (gloo) or 'cuda' (NCCL)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise invalid(f"device='{device}': no CUDA device is available here; use 'cpu', or run where GPUs are")
    return device


# How far below the plan's device memory this GPU's may fall before the plan's memory estimate no
# longer holds: driver builds of one GPU model report total memory within a few MiB of each other
# (81082-81090 MB across H100 80GB drivers, profiles/devices/h100-sxm.yaml), far inside 1%.
DEVICE_MEMORY_TOLERANCE = 0.01


def hardware_note(plan: Plan, device: torch.device) -> str:
    """A warning when the GPU this rank runs on has less memory than the devices the plan was priced
    for (its memory estimate then does not hold: the plan may run out of memory), else ""."""
    if device.type != "cuda":
        return ""
    try:
        planned_bytes = load_cluster(plan.cluster).min_device_mem_bytes
    except ProfileError:  # a cluster file of another machine: nothing to compare with
        return ""
    properties = torch.cuda.get_device_properties(device)
    if properties.total_memory >= planned_bytes * (1 - DEVICE_MEMORY_TOLERANCE):
        return ""
    return (f"Plan.apply: this GPU ({properties.name}, {properties.total_memory / 2**30:.1f} GiB) has less memory than the "
            f"{planned_bytes / 2**30:.1f} GiB of the devices of {plan.cluster}, which the plan was priced for, so it may run "
            f"out of memory; plan again with --cluster describing this hardware")


def precision_note(plan: Plan, model: nn.Module, mixed_precision: bool) -> str:
    """A warning when the plan was priced for mixed precision and the run, given no mixed-precision
    policy, would train the model's fp32 parameters as they are ('' otherwise)."""
    if mixed_precision or plan.dtype == "fp32" or not any(p.dtype == torch.float32 for p in model.parameters()):
        return ""
    return (f"Plan.apply trains the model's fp32 parameters as they are: the plan was priced for {plan.dtype} mixed "
            f"precision; pass mp_policy=planner.apply.data_parallel.mixed_precision_policy({plan.dtype!r}) to train so")
