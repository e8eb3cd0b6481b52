"""What evaluate says makes a configuration fit, checked against pricing every change on its own."""
from __future__ import annotations

import pytest

from planner.api import evaluate
from planner.tracing import trace
from planner.fit_fixes import MAX_FIXES
from planner.report.estimate import hints
from planner.result import Estimate

# gpt3-350m on four 24 GB A10Gs at micro-batch 8 without recompute or ZeRO: its activations
# (about 8 x 2048 tokens x 24 layers x ~34 x 1024 bytes at bf16) far exceed the device.
MODEL, CLUSTER, SEQ_LEN, GLOBAL_BATCH = "gpt3-350m", "a10g:1x4", 2048, 32
GIVEN = {"tp": 1, "pp": 1, "micro_batch": 8, "zero": 0, "recompute": "none"}


@pytest.fixture(scope="module")
def graph():
    return trace(MODEL, seq_len=SEQ_LEN)


def _price(graph, **change) -> Estimate:
    return evaluate(graph, CLUSTER, {**GIVEN, **change}, global_batch=GLOBAL_BATCH, fixes=False)


def test_the_fixes_are_the_fastest_single_changes_that_fit(graph):
    given = evaluate(graph, CLUSTER, GIVEN, global_batch=GLOBAL_BATCH)
    assert not given.fits
    # Every single change of a memory choice, priced on its own as a user would give it.
    changes = {f"--recompute {policy}": {"recompute": policy} for policy in ("selective", "selective_op", "full")}
    changes.update({f"--zero {zero}": {"zero": zero} for zero in (1, 2, 3)})
    changes.update({f"--micro-batch {mb}": {"micro_batch": mb} for mb in (4, 2, 1)})
    changes["--offload-optimizer"] = {"offload_optimizer": True}
    priced = {flags: _price(graph, **change) for flags, change in changes.items()}
    fitting = sorted((est.step_time_s, flags) for flags, est in priced.items() if est.fits)
    assert len(fitting) > MAX_FIXES  # the cut to the fastest ones matters here
    assert [fix.change for fix in given.fixes] == [flags for _, flags in fitting[:MAX_FIXES]]
    for fix in given.fixes:
        assert fix.fits and not fix.combined
        assert fix.step_time_s == pytest.approx(priced[fix.change].step_time_s)
        assert fix.peak_memory_bytes == pytest.approx(priced[fix.change].peak_memory_bytes)
    # ZeRO shards the states, a small part here: no ZeRO stage alone fits.
    assert not any(priced[f"--zero {zero}"].fits for zero in (1, 2, 3))


def test_a_configuration_that_fits_has_no_fixes_and_they_survive_json(graph):
    fitting = evaluate(graph, CLUSTER, {**GIVEN, "micro_batch": 1}, global_batch=GLOBAL_BATCH)
    assert fitting.fits and fitting.fixes == ()
    given = evaluate(graph, CLUSTER, GIVEN, global_batch=GLOBAL_BATCH)
    assert Estimate.from_dict(given.to_dict()).fixes == given.fixes
    assert given.to_dict()["fixes"][0]["change"] == given.fixes[0].change


def test_the_hint_names_each_fix_with_its_memory_and_step_time(graph):
    given = evaluate(graph, CLUSTER, GIVEN, global_batch=GLOBAL_BATCH)
    text = " ".join(hints(given))
    first = given.fixes[0]
    assert f"It fits with {first.change} ({first.peak_memory_bytes / 2**30:.2f} GiB, {first.step_time_s:.3f} s a step)" in text


def test_changes_made_together_where_no_single_one_fits():
    # llama3-70b on 8 H100s as 4 stages of dp 2 without ZeRO: each stage holds a quarter of the
    # model's ~16 B/param states (~280 GB), so neither ZeRO-3 over 2 ranks (~140 GB) nor moving the
    # optimizer states to the host (4 B/param left, ~70 GB, plus activations) fits alone.
    given = evaluate("llama3-70b", "h100-sxm:1x8", {"tp": 1, "pp": 4, "micro_batch": 1, "recompute": "full"},
                     global_batch=8, seq_len=2048)
    assert not given.fits and len(given.fixes) == 1
    together = given.fixes[0]
    assert together.combined and together.fits and together.change == "--zero 3 --offload-optimizer"
    both = evaluate("llama3-70b", "h100-sxm:1x8", {"tp": 1, "pp": 4, "micro_batch": 1, "recompute": "full", "zero": 3,
                                                    "offload_optimizer": True}, global_batch=8, seq_len=2048, fixes=False)
    assert both.fits and both.step_time_s == pytest.approx(together.step_time_s)
    assert "No single change fits; these together do: --zero 3 --offload-optimizer" in " ".join(hints(given))


def test_selective_recompute_of_a_fused_attention_is_noted_as_buying_nothing(graph):
    selective = evaluate(graph, CLUSTER, {**GIVEN, "micro_batch": 1, "recompute": "selective"}, global_batch=GLOBAL_BATCH)
    none = _price(graph, micro_batch=1)
    note = next(note for note in selective.notes if note.startswith("--recompute selective drops"))
    assert f"without it the step takes {none.step_time_s:.4g} s" in note and none.step_time_s < selective.step_time_s
    # Unfused attention keeps its scores, which selective recompute drops: no note then.
    unfused = evaluate(graph, CLUSTER, {**GIVEN, "micro_batch": 1, "recompute": "selective"}, global_batch=GLOBAL_BATCH,
                       attention="unfused")
    assert not any(note.startswith("--recompute selective drops") for note in unfused.notes)
