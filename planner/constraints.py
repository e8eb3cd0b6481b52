"""The constraints `plan` takes besides the model, cluster and batch: fixed choices, bounds on the
degrees and search options, checked before any work (`check_constraints`)."""
from __future__ import annotations

from planner.config import Schedule
from planner.errors import check_positive_int, invalid
from planner.graph import Recompute

# Constraint keys `plan` accepts besides the fixed choices; anything else is a typo.
BOUND_KEYS = {f"{bound}_{axis}" for bound in ("min", "max") for axis in ("tp", "pp", "dp", "cp", "ep")}
FIXED_KEYS = {"tp", "pp", "dp", "cp", "ep", "vpp", "micro_batch", "zero", "recompute", "schedule", "offload_optimizer",
              "dp_replicate"}
OTHER_KEYS = {"schedules", "allow_tp_across_nodes", "mem_headroom", "top", "exhaustive", "allow_offload"}

# Constraints whose value is a positive integer; the other fixed ones take a listed value.
_POSITIVE_KEYS = {"tp", "pp", "dp", "cp", "ep", "vpp", "micro_batch", "top", "dp_replicate"} | BOUND_KEYS
_FLAG_KEYS = {"offload_optimizer", "allow_tp_across_nodes", "exhaustive", "allow_offload"}


def check_constraints(constraints: dict) -> None:
    """Raises PlannerError (INVALID_INPUT) naming the first unknown constraint or bad value."""
    import difflib

    for key, value in constraints.items():
        if key not in BOUND_KEYS | FIXED_KEYS | OTHER_KEYS:
            near = difflib.get_close_matches(key, sorted(BOUND_KEYS | FIXED_KEYS | OTHER_KEYS), n=1)
            hint = f"; did you mean {near[0]}?" if near else f"; use one of {', '.join(sorted(FIXED_KEYS | BOUND_KEYS | OTHER_KEYS))}"
            raise invalid(f"constraint {key!r}: unknown{hint}")
        if key in _POSITIVE_KEYS:
            check_positive_int(key, value)
        if key in _FLAG_KEYS and not isinstance(value, bool):
            raise invalid(f"{key}={value!r}: must be true or false")
        choices = {"zero": (0, 1, 2, 3), "recompute": tuple(str(p) for p in Recompute),
                   "schedule": tuple(str(s) for s in Schedule)}.get(key)
        if choices and (isinstance(value, bool) or str(value) not in {str(c) for c in choices}):
            raise invalid(f"{key}={value!r}: use one of {', '.join(str(c) for c in choices)}")
        if key == "schedules" and (not isinstance(value, (list, tuple)) or not {str(v) for v in value} <= {str(s) for s in Schedule}):
            raise invalid(f"schedules={value!r}: must be a list of {', '.join(str(s) for s in Schedule)}")
    replicas = constraints.get("dp_replicate", 1)
    if replicas > 1 and constraints.get("zero") == 0:
        raise invalid(f"dp_replicate={replicas} with zero=0: hybrid sharding replicates ZeRO shards, and zero=0 shards "
                      f"nothing; fix zero 1-3 or drop dp_replicate")
    if replicas > 1 and constraints.get("ep", 1) > 1:
        raise invalid(f"dp_replicate={replicas} with ep={constraints['ep']}: hybrid sharding of expert-parallel models is "
                      f"not supported; drop one of them")
    if constraints.get("offload_optimizer") and constraints.get("allow_offload") is False:
        raise invalid("offload_optimizer=True with allow_offload=False (--offload-optimizer with --no-offload): they "
                      "contradict; drop one of them")
    if constraints.get("pp") == 1 and (constraints.get("vpp", 1) > 1 or str(constraints.get("schedule", Schedule.ONE_F_ONE_B)) != Schedule.ONE_F_ONE_B):
        fixed = f"vpp={constraints['vpp']}" if constraints.get("vpp", 1) > 1 else f"schedule={constraints['schedule']}"
        raise invalid(f"{fixed} with pp=1: a pipeline schedule needs pipeline stages; fix pp above 1 or drop {fixed.split('=')[0]}")
    schedule = str(constraints.get("schedule", Schedule.INTERLEAVED))
    if constraints.get("vpp", 1) > 1 and schedule != Schedule.INTERLEAVED:
        raise invalid(f"vpp={constraints['vpp']} with schedule={schedule}: model chunks run only under the interleaved "
                      f"schedule; fix schedule=interleaved or drop vpp")
    headroom = constraints.get("mem_headroom", 0.0)
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0.0 <= headroom < 0.9:
        raise invalid(f"mem_headroom={headroom!r}: must be a number in [0, 0.9)")
