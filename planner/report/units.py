"""Human units for rendering; everything inside the planner stays in seconds, bytes and FLOPs."""
from __future__ import annotations

GIB = 2**30


def fmt_number_of(count: int, noun: str) -> str:
    """"1 point", "2 points": a count with its noun, plural unless it is one."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def fmt_bytes(value: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def fmt_seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} us"


def fmt_flops(value: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} FLOP"


def fmt_count(value: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def bar(fraction: float, width: int = 20) -> str:
    """A text bar of `fraction` (0-1, clipped) of `width` cells, red past 100%."""
    filled = int(round(min(max(fraction, 0.0), 1.0) * width))
    colour = "red" if fraction > 1.0 else ("yellow" if fraction > 0.9 else "green")
    return f"[{colour}]{'█' * filled}[/{colour}]{'░' * (width - filled)} {fraction:.0%}"
