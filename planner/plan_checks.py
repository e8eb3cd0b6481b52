"""The checks a plan file passes before it becomes a `Plan` (`check_plan_fields`): its schema, each
field's type and value, and the fields that must agree with its own configuration, each refusal
naming the field."""
from __future__ import annotations

from dataclasses import fields

from planner.config import TRAINING_DTYPES, ParallelConfig
from planner.errors import PlannerError, invalid
from planner.graph import Recompute
from planner.tp_strategies import Placement
from planner.training_code import TrainingCode

SCHEMA_VERSION = 1


# The configuration keys every plan carries (DESIGN.md's command-line contract); others have defaults.
CONFIG_CONTRACT_KEYS = ("tp", "pp", "dp", "cp", "ep", "vpp", "micro_batch", "num_microbatches", "zero", "recompute", "schedule")
# Plan fields `Plan.from_dict` reads, with their JSON types; the rest are optional.
_REQUIRED_FIELDS = {"model": str, "cluster": str, "global_batch": int, "seq_len": int, "dtype": str, "config": dict,
                    "step_time_s": (int, float), "tokens_per_s": (int, float), "tflops_per_gpu": (int, float),
                    "mfu": (int, float), "peak_memory_bytes": (int, float), "fits": bool, "time_breakdown": dict,
                    "memory": list, "stages": list}
_TYPE_NAMES = {str: "text", int: "an integer", bool: "true or false", dict: "a mapping", list: "a list"}
_OPTIONAL_FIELDS = {"layouts": dict, "memory_plan": dict, "search": dict, "alternatives": list, "rejected": list,
                    "layer_names": list, "layer_params": list, "training_code": dict}


def check_plan_fields(data) -> None:
    """PlannerError naming the first plan field that is missing, of the wrong type, or of a value no plan has."""
    fix = "re-run `paraplan plan --out`"
    if not isinstance(data, dict):
        raise invalid(f"plan: expected a mapping of plan fields, got {type(data).__name__}; {fix}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise invalid(f"plan schema_version={version!r}: this paraplan reads version {SCHEMA_VERSION}; {fix}")
    for fields_, required in ((_REQUIRED_FIELDS, True), (_OPTIONAL_FIELDS, False)):
        for key, kind in fields_.items():
            if key not in data:
                if required:
                    raise invalid(f"plan field `{key}`: missing; {fix}")
                continue
            value = data[key]
            accepted = (list, tuple) if kind is list else kind  # `Plan.to_dict` keeps tuples; JSON makes them lists
            if not isinstance(value, accepted) or (isinstance(value, bool) and kind is not bool):
                raise invalid(f"plan field `{key}`: expected {_TYPE_NAMES.get(kind, 'a number')}, got "
                              f"{type(value).__name__}; {fix}")
    for index, stage in enumerate(data["stages"]):
        if not isinstance(stage, dict) or not isinstance(stage.get("layer_names"), (list, tuple)):
            raise invalid(f"plan field `stages[{index}]`: expected a mapping with a `layer_names` list; {fix}")
    recompute = data.get("memory_plan", {}).get("recompute", {})
    if not isinstance(recompute, dict) or not all(isinstance(names, list) for names in recompute.values()):
        raise invalid(f"plan field `memory_plan.recompute`: expected a mapping of policy to a list of layer names; {fix}")
    _check_plan_values(data, recompute, fix)


def _check_plan_values(data: dict, recompute: dict, fix: str) -> None:
    """PlannerError naming the first plan field whose value no plan has (types already checked)."""
    for key in ("global_batch", "seq_len"):
        if data[key] < 1:
            raise invalid(f"plan field `{key}`: {data[key]} is not positive; {fix}")
    if data["dtype"] not in TRAINING_DTYPES:
        raise invalid(f"plan field `dtype`: {data['dtype']!r} is not one of {', '.join(TRAINING_DTYPES)}; {fix}")
    known = {f.name for f in fields(ParallelConfig)}
    for key in (*CONFIG_CONTRACT_KEYS, *data["config"]):
        if key not in data["config"] or key not in known:
            raise invalid(f"plan field `config.{key}`: {'missing' if key in known else 'not a configuration field'}; {fix}")
    _check_plan_against_config(data, fix)
    policies = {str(policy) for policy in Recompute}
    known_layers = set(data.get("layer_names", [])) or {name for stage in data["stages"] for name in stage["layer_names"]}
    listed = [name for names in recompute.values() for name in names]
    twice = next((name for name in listed if listed.count(name) > 1), None)
    if twice:
        raise invalid(f"plan field `memory_plan.recompute`: layer {twice!r} is listed more than once; {fix}")
    for policy, names in recompute.items():
        if policy not in policies:
            raise invalid(f"plan field `memory_plan.recompute`: unknown policy {policy!r} (one of {', '.join(sorted(policies))}); {fix}")
        missing = [name for name in names if name not in known_layers]
        if missing:
            raise invalid(f"plan field `memory_plan.recompute.{policy}`: {missing[0]!r} is not a layer of the plan; {fix}")
    placements = {str(placement) for placement in Placement}
    bad = next(((fqn, value) for fqn, value in data.get("layouts", {}).items() if value not in placements), None)
    if bad:
        raise invalid(f"plan field `layouts.{bad[0]}`: {bad[1]!r} is not a placement ({', '.join(sorted(placements))}); {fix}")


def _check_plan_against_config(data: dict, fix: str) -> None:
    """PlannerError naming the first plan field that disagrees with the plan's own configuration
    (which validates its own values first)."""
    config = ParallelConfig.from_dict(data["config"])
    if len(data["stages"]) != config.pp:
        count = len(data["stages"])
        raise invalid(f"plan field `stages`: {count} stage{'s' * (count != 1)}, but config.pp = {config.pp}; {fix}")
    if config.tp > 1 and not data.get("layouts"):
        raise invalid(f"plan field `layouts`: none, but config.tp = {config.tp} needs each module's placement; {fix}")
    if config.cp > 1 and data["seq_len"] % (2 * config.cp):
        raise invalid(f"plan field `seq_len`: {data['seq_len']} tokens, which 2 x config.cp = {2 * config.cp} chunks "
                      f"do not divide; {fix}")
    try:
        TrainingCode.of(**data.get("training_code", {}))
    except PlannerError as error:
        raise invalid(f"plan field `training_code`: {error.message}") from None
