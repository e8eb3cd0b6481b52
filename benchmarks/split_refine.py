"""How close the stage split comes to the best arrangement by the schedule's own price.

On random small instances (300 of random layer times, 300 shaped like a language model: a light
embedding, equal blocks, a head of random weight; 2-6 stages, 1-8 micro-batches per stage, 1F1B or
zero bubble), compares the price (`StageProblem.schedule_step_s`) of the solver's position-blind
split and of the refined one (`planner.stage_polish`) with the best over every split (brute force).

Usage: python benchmarks/split_refine.py
"""
from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.stage_polish import refine  # noqa: E402
from planner.stage_problem import StageProblem  # noqa: E402
from planner.stages import split_dp  # noqa: E402

INSTANCES = 300


def _problem(times: np.ndarray, stages: int, microbatches: int, schedule: str) -> StageProblem:
    layers = len(times)
    return StageProblem(layer_time_s=times, layer_static_bytes=np.ones(layers), layer_act_bytes=np.zeros(layers),
                        num_stages=stages, in_flight=np.ones(stages), mem_cap_bytes=np.full(stages, 1e9),
                        stage_speed=np.ones(stages), num_microbatches=microbatches, layer_fwd_s=times / 3, schedule=schedule)


def random_layers(rng: random.Random) -> StageProblem:
    layers = rng.randint(6, 12)
    stages = rng.randint(2, min(5, layers))
    times = np.array([rng.choice([1.0, 1.0, 1.3, 0.6]) for _ in range(layers)])
    return _problem(times, stages, rng.choice([stages, 2 * stages, 4 * stages, 8]), rng.choice(["1f1b", "zb"]))


def language_model(rng: random.Random) -> StageProblem:
    blocks = rng.randint(6, 12)
    stages = rng.randint(2, min(6, blocks))
    times = np.array([rng.uniform(0.02, 0.2)] + [1.0] * blocks + [rng.uniform(0.3, 2.5)])
    return _problem(times, stages, rng.choice([stages, 2 * stages, 4 * stages, 8 * stages]), rng.choice(["1f1b", "zb"]))


def main() -> None:
    print(f"{'instances':16s} {'split':8s} {'> 0.1% off':>10s} {'max off':>8s} {'mean off':>9s}")
    for name, make in (("random layers", random_layers), ("language model", language_model)):
        rng = random.Random(0)
        gaps: dict[str, list[float]] = {"solver": [], "refined": []}
        for _ in range(INSTANCES):
            problem = make(rng)
            choices = np.zeros(problem.num_layers, dtype=int)
            splits = [(0, *cuts, problem.num_layers) for cuts in itertools.combinations(range(1, problem.num_layers), problem.num_stages - 1)]
            best_s = min(problem.schedule_step_s(split, choices) for split in splits)
            blind = split_dp(problem).boundaries
            gaps["solver"].append(problem.schedule_step_s(blind, choices) / best_s - 1)
            gaps["refined"].append(problem.schedule_step_s(refine(problem, blind, choices), choices) / best_s - 1)
        for split, values in gaps.items():
            print(f"{name:16s} {split:8s} {sum(v > 1e-3 for v in values):10d} {max(values):8.2%} {np.mean(values):9.3%}")


if __name__ == "__main__":
    main()
