"""Collective timing for `paraplan profile`: all-reduce, all-gather, reduce-scatter and p2p across
sizes over the ranks the profile runs on, the fit of a link's bandwidth and latency to the cost
model's ring formulas (`costmodel.comm`) by relative least squares, and each collective's factor
over that fit (`LinkTier.collective_factors`): one link cannot describe an implementation whose
collectives differ in kind, as gloo's do (measured on this project's 2-core host, 2 ranks: all-reduce
1.0-1.6x and p2p 0.6-2x the joint fit, all-gather 2-6x and reduce-scatter 4-9x).
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

# Collective buffer sizes: from latency-bound to bandwidth-bound.
COLLECTIVE_BYTES = {"cpu": tuple(4**k for k in range(6, 13)), "cuda": tuple(4**k for k in range(8, 15))}
QUICK_COLLECTIVE_BYTES = {"cpu": (4**6, 4**10), "cuda": (4**8, 4**13)}
# Timed iterations per collective size (after the warm-up ones).
COLLECTIVE_ITERATIONS = 10
QUICK_COLLECTIVE_ITERATIONS = 3
WARMUP_ITERATIONS = 2
# Latency floor of a fitted link: a fit dominated by bandwidth can land at or below zero latency,
# which no link has (a shared-memory round trip takes at least about a microsecond).
MIN_LATENCY_S = 1e-6


def rank_max(values: list[float]) -> list[float]:
    """Element-wise maximum over ranks (the slowest rank sets the step), identity when alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _collective_s(op: str, size_bytes: int, device, iterations: int) -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    buffer = torch.zeros(size_bytes // 4, device=device)
    shard = torch.zeros(size_bytes // 4 // world, device=device)

    def p2p() -> None:
        if rank == 0:
            dist.send(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)

    run = {
        "all_reduce": lambda: dist.all_reduce(buffer),
        "all_gather": lambda: dist.all_gather_into_tensor(buffer, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, buffer),
        "p2p": p2p,
    }[op]
    return lockstep_s(run, device, iterations)


def lockstep_s(run, device, iterations: int) -> float:
    """Mean seconds of `run()` over `iterations` calls that every rank makes together, after
    WARMUP_ITERATIONS untimed calls and a barrier: a fixed count, the same on every rank, as each
    call may run collectives every rank must join."""
    for _ in range(WARMUP_ITERATIONS):
        run()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iterations


# (bandwidth coefficient per byte, latency steps) of each collective over n ranks: the ring formulas
# of costmodel.comm for a group inside one node.
def _coefficients(op: str, n: int, size_bytes: float) -> tuple[float, float]:
    return {
        "all_reduce": (2 * (n - 1) / n * size_bytes, 2 * (n - 1)),
        "all_gather": ((n - 1) / n * size_bytes, n - 1),
        "reduce_scatter": ((n - 1) / n * size_bytes, n - 1),
        "p2p": (size_bytes, 1),
    }[op]


def fit_link(samples: list[dict], world: int) -> tuple[float, float]:
    """(bytes/s, latency s) that best fit `samples` ({op, bytes, seconds}) by relative least squares."""
    rows = np.array([_coefficients(s["op"], world, s["bytes"]) for s in samples], dtype=float)
    seconds = np.array([s["seconds"] for s in samples], dtype=float)
    (inverse_bw, latency), *_ = np.linalg.lstsq(rows / seconds[:, None], np.ones_like(seconds), rcond=None)
    best_rate = max(row[0] / t for row, t in zip(rows, seconds))
    return float(1.0 / inverse_bw if inverse_bw > 0 else best_rate), max(float(latency), MIN_LATENCY_S)


def collective_factors(samples: list[dict], world: int, link: tuple[float, float]) -> dict[str, float]:
    """Per collective, the median of measured time over the ring formula's time on `link` (bytes/s,
    latency s), over its bandwidth-bound sizes (where the bandwidth term is at least half the
    formula's time: the sizes training moves; small sizes are the noisiest) or all its sizes if none is."""
    bw, latency = link
    ratios: dict[str, list[tuple[bool, float]]] = {}
    for sample in samples:
        per_byte, steps = _coefficients(sample["op"], world, sample["bytes"])
        formula_s = per_byte / bw + steps * latency
        ratios.setdefault(sample["op"], []).append((per_byte / bw >= formula_s / 2, sample["seconds"] / formula_s))
    factors = {}
    for op, values in ratios.items():
        bound = [ratio for bandwidth_bound, ratio in values if bandwidth_bound]
        factors[op] = float(np.median(bound or [ratio for _, ratio in values]))
    return factors


def measure_collectives(device, sizes, iterations, advance) -> list[dict]:
    """Seconds of each collective and size over all ranks (p2p between ranks 0 and 1)."""
    world = dist.get_world_size()
    samples = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        for size in sizes:
            size = size - size % (4 * world)
            seconds = rank_max([_collective_s(op, size, device, iterations)])[0]
            samples.append({"op": op, "bytes": size, "seconds": seconds})
            advance()
    return samples
