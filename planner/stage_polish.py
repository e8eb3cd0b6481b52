"""A stage split refined by the schedule's own step price, which sees where each stage sits.

The split solvers (`planner.stages.split_dp`, `planner.stage_ilp.split_ilp`) minimise
(m - 1) max_s T_s + sum_s T_s, which prices every arrangement of the same stage times alike. The
schedules do not: under 1F1B (and zero bubble) a heavier stage costs less near the start of the
pipeline, where it fills before the micro-batches behind it queue, and with few micro-batches the
best split puts more layers on the first stages (llama3-8b at 16K tokens on 8 H200 stages: 7%).
`refine` descends from the solver's answer by `StageProblem.schedule_step_s` (the closed form the
estimate prices, `costmodel.pipeline.step_time_s`): each round takes the best move of one layer from
one stage to another (the cut points between them shift by one), among splits whose every stage
still fits, for at most `POLISH_ROUNDS_PER_STAGE` rounds per stage and `MAX_PRICED_SPLITS` splits
priced, where the pipeline's fill and drain take at least `MIN_BUBBLE_SHARE` of the step. The
closed form leaves out transfers and each stage's own gradient sync, so the evaluator prices the
solver's split and the refined one in full and keeps the faster (`Evaluator.estimate`,
`memory_plan`). On 600 random instances of up to 14 layers and 6 stages (python
benchmarks/split_refine.py) the refined split's price was within 3% of the brute-force best of the
closed form, 0.04% on average (the solvers' answer: 13%, 1.3%).

An interleaved pipeline's chunks share devices, and the schedule runs each device's sum of chunks:
the DP, which balances the chunks, may give one device the longer ones (nemotron-4-340b in 48
chunks on 4 GB200s: one device 45% more layers than the others, the step 29% slower). There a move
shifts a cut point of the busiest device's chunks by one layer, a device's memory is checked over
its chunks together, and the rounds run until no shift lowers the price or `MAX_PRICED_CHUNK_SPLITS`
are priced.
"""
from __future__ import annotations

import numpy as np

from planner.stage_problem import StageProblem

# Rounds of moves per pipeline stage; each round prices the S (S - 1) moves of S stages.
POLISH_ROUNDS_PER_STAGE = 1
# Most splits priced in one refinement (each ~0.1 ms): 5 rounds of 8 stages, 1 of 16 (the search
# prices its kept candidates' splits so, and they took up to 1,900 on 16 stages unbounded).
MAX_PRICED_SPLITS = 300
# A move must lower the step by more than this share to be taken (float noise is no gain).
MIN_GAIN = 1e-9
# Least share of the step the pipeline's fill and drain take (1 - m x the slowest device's time
# over the step) for a split to be refined: all a better arrangement can save, under it the moves
# cost more than they can return.
MIN_BUBBLE_SHARE = 0.05
# Most stages refined: a round prices S (S - 1) moves, and deeper pipelines hold a layer or two per
# stage, where moves have little to choose from.
MAX_REFINED_STAGES = 16
# Most splits priced in refining an interleaved pipeline, whose rounds price the 2 v shifts of the
# cut points of the busiest device's v chunks (~0.1 ms each): nemotron-4-340b's 48 chunks on 4
# devices, whose DP split left one device 45% more layers than the others, took 223.
MAX_PRICED_CHUNK_SPLITS = 600


def refines(stages: int, devices: int) -> bool:
    """Whether `refine` can move anything in a pipeline of `stages` chunks on `devices` devices."""
    return 1 < stages <= MAX_REFINED_STAGES if devices == stages else stages > devices > 1


def refine(problem: StageProblem, boundaries: np.ndarray, choices: np.ndarray) -> np.ndarray:
    """The split reached from `boundaries` by the moves of the module docstring while they lower
    `schedule_step_s`; `boundaries` itself without a schedule price, with one layer per stage or
    with more than `MAX_REFINED_STAGES` stages of a device each.

    Where chunks share devices (interleaved), a move shifts a cut point of one of the busiest
    device's chunks by one layer (the layer passes to the neighbouring chunk, on the neighbouring
    device), while it lowers the price, which sums each device's chunks: the split solvers balance
    the chunks alone, and among equally balanced chunk splits may give one device more of the
    longer chunks. Devices within a layer's time of each other are left as they are."""
    boundaries = np.asarray(boundaries, dtype=int)
    if (not problem.schedule_priced or problem.num_stages == problem.num_layers
            or not refines(problem.num_stages, problem.devices)):
        return boundaries

    interleaved = problem.num_stages > problem.devices
    device = np.arange(problem.num_stages) % problem.devices
    device_cap_bytes = np.bincount(device, problem.mem_cap_bytes, problem.devices)

    def fits(candidate: np.ndarray) -> bool:
        """Every stage under its cap; chunks sharing a device, their sum under the device's (a chunk
        may take more than its even share of the device where the others take less)."""
        stage_bytes = problem.stage_mem_bytes(candidate, choices)
        if interleaved:
            return bool(np.all(np.bincount(device, stage_bytes, problem.devices) <= device_cap_bytes))
        return bool(np.all(stage_bytes <= problem.mem_cap_bytes))

    def device_s(candidate: np.ndarray) -> np.ndarray:
        return np.bincount(device, problem.stage_times_s(candidate, choices), problem.devices)

    best_s = problem.schedule_step_s(boundaries, choices)
    if interleaved:
        layer_s = float(np.median(problem.layer_time_s[np.arange(problem.num_layers), choices]))
        if np.ptp(device_s(boundaries)) <= layer_s:
            return boundaries  # no layer moved off the busiest device lowers it below another's
    elif 1 - problem.num_microbatches * max(problem.stage_times_s(boundaries, choices)) / best_s < MIN_BUBBLE_SHARE:
        return boundaries
    budget = MAX_PRICED_CHUNK_SPLITS if interleaved else MAX_PRICED_SPLITS
    for _ in range(budget if interleaved else POLISH_ROUNDS_PER_STAGE * problem.num_stages):
        moves = _shifts(boundaries, device == int(np.argmax(device_s(boundaries)))) if interleaved else [
            _moved(boundaries, source, target) for source in range(problem.num_stages)
            for target in range(problem.num_stages) if source != target and boundaries[source + 1] - boundaries[source] > 1]
        budget -= len(moves)
        if budget < 0:
            return boundaries
        priced = sorted((problem.schedule_step_s(candidate, choices), index) for index, candidate in enumerate(moves))
        for step_s, index in priced:
            if step_s >= best_s * (1 - MIN_GAIN):
                return boundaries
            if fits(moves[index]):
                boundaries, best_s = moves[index], step_s
                break
        else:
            return boundaries
    return boundaries


def _shifts(boundaries: np.ndarray, busiest: np.ndarray) -> list[np.ndarray]:
    """`boundaries` with one cut point of a chunk marked in `busiest` (the busiest device's) moved
    inwards by one layer, which passes to the neighbouring chunk; each chunk keeps a layer."""
    shifted = []
    last = len(boundaries) - 2
    for chunk in np.flatnonzero(busiest):
        if boundaries[chunk + 1] - boundaries[chunk] < 2:
            continue
        for cut, step in ((chunk, 1), (chunk + 1, -1)):
            if 0 < cut <= last:
                moved = boundaries.copy()
                moved[cut] += step
                shifted.append(moved)
    return shifted


def _moved(boundaries: np.ndarray, source: int, target: int) -> np.ndarray:
    """`boundaries` with one layer of stage `source` moved to stage `target`: the cut points between
    them shift by one layer towards the source."""
    moved = boundaries.copy()
    if source < target:
        moved[source + 1:target + 1] -= 1
    else:
        moved[target + 1:source + 1] += 1
    return moved
