"""`evaluate` with --zero or --recompute left out: the defaults where they fit, else the fastest
choice that fits, checked against pricing every choice explicitly."""
import itertools
import json

import pytest

import planner
from cli import main

# gpt3-1.3b on 8 A100 40 GB, 8 sequences of 2048 tokens a micro-batch: ZeRO 0 without recompute
# needs about 60 GiB of the 39.6, so the open choices must change.
GRAPH_ARGS = ("gpt3-1.3b",)
CLUSTER = "a100-40g:1x8"
DEGREES = {"tp": 1, "pp": 1, "micro_batch": 8}
GLOBAL_BATCH = 64


@pytest.fixture(scope="module")
def graph():
    return planner.trace(*GRAPH_ARGS, seq_len=2048)


def _explicit(graph, **choices):
    return planner.evaluate(graph, CLUSTER, {**DEGREES, **choices}, global_batch=GLOBAL_BATCH)


def test_open_choices_are_the_fastest_that_fits(graph):
    defaults = _explicit(graph, zero=0, recompute="none")
    assert not defaults.fits
    priced = {(zero, str(policy)): _explicit(graph, zero=zero, recompute=str(policy))
              for zero, policy in itertools.product(range(4), graph.recompute_policies)}
    fitting = {choice: est.step_time_s for choice, est in priced.items() if est.fits}
    est = planner.evaluate(graph, CLUSTER, DEGREES, global_batch=GLOBAL_BATCH)
    assert est.fits and est.step_time_s == min(fitting.values())
    assert (est.config.zero, str(est.config.recompute)) in {c for c, t in fitting.items() if t == est.step_time_s}
    assert any(note.startswith("--zero and --recompute not given: priced at the fastest choice that fits, "
                               f"zero {est.config.zero}, recompute {est.config.recompute}; with zero 0 and recompute none "
                               "the run needs ") for note in est.notes)


def test_a_choice_given_is_kept_and_only_the_other_is_chosen(graph):
    est = planner.evaluate(graph, CLUSTER, {**DEGREES, "recompute": "none"}, global_batch=GLOBAL_BATCH)
    zeros = {zero: _explicit(graph, zero=zero, recompute="none") for zero in range(4)}
    fitting = [e.step_time_s for e in zeros.values() if e.fits]
    assert str(est.config.recompute) == "none"
    if fitting:
        assert est.fits and est.step_time_s == min(fitting)
    else:
        assert not est.fits and est.config.zero == 0 and est.fixes
    given = planner.evaluate(graph, CLUSTER, {**DEGREES, "zero": 0, "recompute": "none"}, global_batch=GLOBAL_BATCH)
    assert not given.fits and given.config.zero == 0 and given.fixes
    assert not any("not given" in note for note in given.notes)


def test_defaults_that_fit_are_kept(graph):
    est = planner.evaluate(graph, CLUSTER, {"tp": 1, "pp": 1}, global_batch=GLOBAL_BATCH)
    assert est.fits and est.config.zero == 0 and str(est.config.recompute) == "none"
    assert not any("not given" in note for note in est.notes)


def test_defaults_fitting_only_at_a_split_memory_shaped_give_way(capsys):
    # gpt3-6.7b at pp 4 on 8 A100 40 GB, one sequence a micro-batch: without ZeRO the first stage
    # holds its 4 micro-batches in flight only where layers move off it to the later stages.
    argv = ["evaluate", "--model", "gpt3-6.7b", "--cluster", CLUSTER, "--global-batch", "64", "--seq-len", "2048",
            "--tp", "1", "--pp", "4", "--json"]
    assert main([*argv, "--zero", "0", "--recompute", "none"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    open_ = json.loads(capsys.readouterr().out)
    shaped = [note for note in given["notes"] if note.startswith("memory shapes the stage split")]
    assert given["fits"] and shaped
    assert open_["fits"] and open_["step_time_s"] < given["step_time_s"]
    assert (open_["config"]["zero"], open_["config"]["recompute"]) != (0, "none")
    assert any("the run fits only at a stage split that memory shapes, taking "
               f"{given['step_time_s']:.4g} s a step" in note for note in open_["notes"])
