"""Measured and datasheet curves of a value over a size (a matmul efficiency over FLOPs, an achieved
rate over an op's size), validated once and read as power laws between their points."""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from costmodel.errors import ProfileError


@lru_cache(maxsize=256)
def log_curve(curve: tuple[tuple[float, float], ...], owner: str) -> tuple[np.ndarray, np.ndarray]:
    """Validates a (size, value) curve and returns (log10(size), log10(value)) arrays for np.interp."""
    sizes, values = [size for size, _ in curve], [value for _, value in curve]
    if not curve or min(sizes) <= 0 or any(b <= a for a, b in zip(sizes, sizes[1:])) or min(values) <= 0:
        raise ProfileError(f"{owner}: points must be non-empty with sizes > 0, strictly ascending, and values > 0, got {curve}")
    return np.log10(sizes), np.log10(values)


def interp_log_log(x: float, curve: tuple[tuple[float, float], ...], owner: str) -> float:
    """Value of `curve` (a rate or an efficiency) at size `x`: a power law between neighbouring
    points (linear in log-log), clamped to the end values outside the curve.

    Between two points whose times (size / value) do not fall with size, the time does not fall
    either: time grows as size^(1 - k) where the value grows as size^k, k <= 1.
    """
    log_sizes, log_values = log_curve(curve, owner)
    if x <= 0:
        return float(10 ** log_values[0])
    return float(10 ** np.interp(math.log10(x), log_sizes, log_values))
