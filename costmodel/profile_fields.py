"""Checks the fields of profile data: known keys, types, ranges and enum members.

Each check returns the validated value or raises a one-line `ProfileError` naming where the data
came from (`Origin`), the field and the fix.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from enum import StrEnum

from costmodel.errors import ProfileError


@dataclass(frozen=True)
class Origin:
    """Where a piece of profile data comes from; builds the one-line errors about it."""

    label: str

    def error(self, field_name: str, problem: str) -> ProfileError:
        return ProfileError(f"{self.label}: {field_name}: {problem}")


# Keys that mark a model spec passed where a profile goes (`planner.zoo.spec`).
MODEL_SPEC_MARKERS = ("arch", "layers")


def check_keys(origin: Origin, prefix: str, data: dict, allowed, required) -> None:
    """Every key of `data` is in `allowed` (else the nearest valid one is named, or a model spec
    passed by mistake is called one) and every `required` one is there."""
    if not prefix and all(marker in data for marker in MODEL_SPEC_MARKERS) and not set(MODEL_SPEC_MARKERS) & set(allowed):
        raise ProfileError(f"{origin.label}: a model spec (it has `arch` and `layers`), not a hardware profile; fix: pass "
                           f"it as --model, and as the cluster a cluster file or DEVICE:NODESxGPUS")
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            hint = f"did you mean {prefix}{close[0]!s}?" if close else f"valid keys: {', '.join(allowed)}"
            raise origin.error(f"{prefix}{key}", f"unknown key; {hint}")
    for key in required:
        if key not in data:
            raise origin.error(f"{prefix}{key}", "missing required key; add it (see profiles/README.md)")


def sources(origin: Origin, prefix: str, value, allowed) -> dict[str, str]:
    """A `sources` mapping: field name (one of `allowed`) -> where its number comes from."""
    if not isinstance(value, dict):
        raise origin.error(f"{prefix}sources", "must map field names to source strings")
    check_keys(origin, f"{prefix}sources.", value, allowed, ())
    return {key: text(origin, f"{prefix}sources.{key}", source) for key, source in value.items()}


def text(origin: Origin, field_name: str, value) -> str:
    """A string."""
    if not isinstance(value, str):
        raise origin.error(field_name, f"{value!r} must be a string")
    return value


def enum_member(origin: Origin, field_name: str, value, enum: type[StrEnum]):
    """The member of `enum` whose value is `value`; the error names the closest one."""
    try:
        return enum(value)
    except ValueError:
        names = [m.value for m in enum]
        close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(names)}"
        raise origin.error(field_name, f"{value!r} is not a known {enum.__name__}; {hint}") from None


def number(origin: Origin, field_name: str, value) -> float:
    """A finite number; numeric strings are accepted because YAML 1.1 reads `450e9` as a string."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise origin.error(field_name, f"{value!r} must be a number")
    try:
        parsed = float(value)
    except ValueError:
        raise origin.error(field_name, f"{value!r} must be a number (digits, or scientific notation such as 4.5e11)") from None
    if not math.isfinite(parsed):
        raise origin.error(field_name, f"{value!r} must be a finite number")
    return parsed


def positive(origin: Origin, field_name: str, value) -> float:
    """A number > 0."""
    parsed = number(origin, field_name, value)
    if parsed <= 0:
        raise origin.error(field_name, f"{value!r} must be a positive number")
    return parsed


@dataclass(frozen=True)
class Magnitude:
    """The range a physical quantity of profile data takes in the project's unit."""

    unit: str
    low: float
    high: float
    example: str


# Ranges far wider than any hardware's, meant to catch a value written in another unit (Gb/s for
# bytes per second, microseconds for seconds, GB for bytes, TFLOP/s for FLOP/s), not to judge hardware.
# FLOP/s start at 1e8: `paraplan profile` of this project's 2-core CPU, two ranks at once beside a
# loaded test run, measured bf16 matmuls at 8.7e8 FLOP/s (no AMX), and a measured profile must load.
LINK_BANDWIDTH = Magnitude("bytes per second", 1e6, 1e14, "5.0e10 for 400 Gb/s")
LATENCY = Magnitude("seconds", 1e-8, 1.0, "9.6e-6 for 9.6 us")
MEMORY = Magnitude("bytes", 1e8, 1e15, "8.0e10 for 80 GB")
MEMORY_BANDWIDTH = Magnitude("bytes per second", 1e9, 1e14, "3.35e12 for 3.35 TB/s")
PEAK_FLOPS = Magnitude("FLOP/s", 1e8, 1e17, "9.89e14 for 989 TFLOP/s")
# Likewise for a fabric's N:1 oversubscription (built fabrics run from 1:1 up to a few to 1; Llama 3's
# 24K-GPU RoCE fabric, the most oversubscribed shipped profile, runs 7:1) and the devices of one node
# (the largest NVLink domain, GB200 NVL576, joins 576), and a whole cluster's devices (the largest
# published training clusters hold a few hundred thousand GPUs: xAI's Colossus, 200,000 in 2025).
MAX_OVERSUBSCRIPTION = 64.0
MAX_DEVICES_PER_NODE = 1024
MAX_CLUSTER_DEVICES = 2**22


def cluster_devices(origin: Origin, field_name: str, devices: int) -> int:
    """A cluster's device count, up to `MAX_CLUSTER_DEVICES`."""
    if devices > MAX_CLUSTER_DEVICES:
        raise origin.error(field_name, f"{devices} devices in one cluster is implausible (at most {MAX_CLUSTER_DEVICES}); "
                                       f"give the node count of this cluster")
    return devices


def physical(origin: Origin, field_name: str, value, magnitude: Magnitude) -> float:
    """A positive number inside `magnitude`'s range."""
    parsed = positive(origin, field_name, value)
    if not magnitude.low <= parsed <= magnitude.high:
        raise origin.error(field_name, f"{value!r} is implausible in {magnitude.unit} ({magnitude.low:.0e} to "
                                       f"{magnitude.high:.0e}); write it in {magnitude.unit}, e.g. {magnitude.example}")
    return parsed


def optional_positive(origin: Origin, field_name: str, data: dict) -> float:
    """A positive number when the key is present, 0.0 (unknown) when it is absent."""
    return positive(origin, field_name, data[field_name]) if field_name in data else 0.0


def fraction(origin: Origin, field_name: str, value) -> float:
    """A number in (0, 1]."""
    parsed = number(origin, field_name, value)
    if not 0 < parsed <= 1:
        raise origin.error(field_name, f"{value!r} must be a fraction in (0, 1]")
    return parsed


def fractions(origin: Origin, field_name: str, value, keys: tuple[str, ...]) -> tuple[float, ...]:
    """A mapping of exactly `keys` to numbers in (0, 1], in the order of `keys`."""
    if not isinstance(value, dict):
        raise origin.error(field_name, "must be a mapping {" + ", ".join(f"{key}: F" for key in keys) + "} of fractions in (0, 1]")
    check_keys(origin, f"{field_name}.", value, keys, keys)
    return tuple(fraction(origin, f"{field_name}.{key}", value[key]) for key in keys)


def boolean(origin: Origin, field_name: str, value) -> bool:
    """true or false (YAML booleans only, not 0/1 or strings)."""
    if not isinstance(value, bool):
        raise origin.error(field_name, f"{value!r} must be true or false")
    return value


def count(origin: Origin, field_name: str, value) -> int:
    """A positive integer, also written as a whole float (`4.0`, as numbers elsewhere in a profile may
    be written); booleans rejected."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise origin.error(field_name, f"{value!r} must be a positive integer")
    return value


def node_devices(origin: Origin, field_name: str, value) -> int:
    """A node's device count: a positive integer up to `MAX_DEVICES_PER_NODE`."""
    devices = count(origin, field_name, value)
    if devices > MAX_DEVICES_PER_NODE:
        raise origin.error(field_name, f"{devices} devices in one node is implausible (at most {MAX_DEVICES_PER_NODE}); "
                                       f"give the devices of one node and the node count in nodes")
    return devices
