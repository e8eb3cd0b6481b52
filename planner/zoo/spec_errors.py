"""The one-line errors about a model spec file (`planner.zoo.spec`): the file, the field, the fix."""
from __future__ import annotations

import difflib
from typing import Any

from planner.errors import PlannerError, invalid

# Keys that mark a hardware profile passed where a model spec goes, and what that profile is.
PROFILE_MARKERS = (("groups", "a cluster file", "--cluster"), ("peak_flops_per_s", "a device profile", "--cluster FILE:NODESxGPUS"),
                   ("bw_bytes_per_s", "a link profile", "a cluster file's intra_link or nic"))


def unknown_key_error(origin: str, key: Any, data: dict, keys: list[str]) -> PlannerError:
    """`key` is not a spec key: the nearest one, or where a hardware profile was passed by mistake,
    what it is and where it goes; else the spec's keys."""
    for marker, what, where in PROFILE_MARKERS:
        if marker in data:
            return invalid(f"{origin}: {what} (it has `{marker}`), not a model spec; fix: pass it as {where}, "
                           f"and as the model a spec with `arch` and `layers` (or a built-in model's name)")
    hint = nearest_hint(key, keys) or f" ({', '.join(keys)})"
    return field_error(origin, str(key) if isinstance(key, str) else show(key), "unknown key",
                       f"use one of the documented keys{hint}")


def nearest_hint(word: Any, choices: list[str]) -> str:
    if not isinstance(word, str):
        return ""
    nearest = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean `{nearest[0]}`?)" if nearest else ""


def field_error(origin: str, key: str, problem: str, fix: str) -> PlannerError:
    return invalid(one_line(f"{origin}: field `{key}`: {problem}; fix: {fix}"))


def show(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def one_line(text: Any) -> str:
    return " ".join(str(text).split())
