"""`evaluate` with --zero left out: ZeRO 0 where it fits, else the fastest ZeRO stage that fits,
checked against pricing every stage explicitly; recompute is never assumed."""
import json

import pytest

import planner
from cli import main

# gpt3-1.3b on 8 A100 40 GB at 2048 tokens: 4 sequences a micro-batch need 42 GiB at ZeRO 0 and fit
# at ZeRO 1-3; 8 sequences fit at no ZeRO stage without recompute.
CLUSTER = "a100-40g:1x8"
GLOBAL_BATCH = 64


@pytest.fixture(scope="module")
def graph():
    return planner.trace("gpt3-1.3b", seq_len=2048)


def _at(graph, micro_batch: int, **given):
    return planner.evaluate(graph, CLUSTER, {"tp": 1, "pp": 1, "micro_batch": micro_batch, **given}, global_batch=GLOBAL_BATCH)


def test_an_open_zero_stage_is_the_fastest_that_fits(graph):
    priced = {zero: _at(graph, 4, zero=zero) for zero in range(4)}
    assert not priced[0].fits
    fastest = min((est.step_time_s, zero) for zero, est in priced.items() if est.fits)
    est = _at(graph, 4)
    assert est.fits and (est.step_time_s, est.config.zero) == fastest and str(est.config.recompute) == "none"
    assert any(note.startswith(f"--zero not given: priced at the fastest ZeRO stage that fits, {fastest[1]}; with ZeRO 0 "
                               "the run needs ") for note in est.notes)


def test_recompute_is_never_assumed_and_a_given_stage_is_kept(graph):
    # No ZeRO stage fits 8 sequences without recompute: the run is priced as given, at ZeRO 0, with
    # the recompute that would fit among its priced fixes.
    assert not any(_at(graph, 8, zero=zero).fits for zero in range(4))
    est = _at(graph, 8)
    assert not est.fits and est.config.zero == 0 and str(est.config.recompute) == "none"
    assert any(fix.change.startswith("--recompute") and fix.fits for fix in est.fixes)
    assert not any("not given" in note for note in est.notes)
    given = _at(graph, 4, zero=0)
    assert not given.fits and given.config.zero == 0 and given.fixes


def test_zero_0_that_fits_is_kept(graph):
    est = _at(graph, 1)
    assert est.fits and est.config.zero == 0
    assert not any("not given" in note for note in est.notes)


def test_zero_0_fitting_only_at_a_split_memory_shaped_gives_way(capsys):
    # gpt3-6.7b at pp 4 on 8 A100 40 GB, one sequence a micro-batch: without ZeRO the first stage
    # holds its 4 micro-batches in flight only where layers move off it to the later stages.
    argv = ["evaluate", "--model", "gpt3-6.7b", "--cluster", CLUSTER, "--global-batch", "64", "--seq-len", "2048",
            "--tp", "1", "--pp", "4", "--json"]
    assert main([*argv, "--zero", "0"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    open_ = json.loads(capsys.readouterr().out)
    assert given["fits"] and any(note.startswith("memory shapes the stage split") for note in given["notes"])
    assert open_["fits"] and open_["step_time_s"] < given["step_time_s"] and open_["config"]["zero"] > 0
    assert open_["config"]["recompute"] == "none"
    assert any("the run fits only at a stage split that memory shapes, taking "
               f"{given['step_time_s']:.4g} s a step" in note for note in open_["notes"])
