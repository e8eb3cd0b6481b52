"""planner.training_code: the training code's choices, validated once for every entry point."""
from __future__ import annotations

import pytest

from planner.errors import PlannerError
from planner.layer_comm import TpOverlap
from planner.pipeline_buffers import PipeOutputs, kept_output_bytes
from planner.state_cost import DpSync
from planner.training_code import TrainingCode


def test_strings_become_the_cost_models_enums_and_round_trip():
    code = TrainingCode.of(dp_sync="blocking", tp_overlap="forward")
    assert code.dp_sync is DpSync.BLOCKING and code.tp_overlap is TpOverlap.FORWARD
    assert code.changed() == {"tp_overlap": "forward", "dp_sync": "blocking"}
    assert TrainingCode.of(**code.options()) == code
    assert TrainingCode.of() == TrainingCode() and TrainingCode().changed() == {}


def test_a_direct_construction_gets_the_same_enums():
    # The cost model compares choices by identity (`kind is PipeOutputs.KEPT`): a plain string given
    # to the constructor priced as the default before, silently.
    code = TrainingCode(pp_outputs="kept", dp_sync="blocking")
    assert code.pp_outputs is PipeOutputs.KEPT and code.dp_sync is DpSync.BLOCKING
    assert kept_output_bytes(code.pp_outputs, 2, 8, 1.0) == 8.0
    with pytest.raises(ValueError):
        TrainingCode(pp_outputs="kep")


def test_the_tp_overlap_switch_of_old_means_full_or_none():
    # `tp_overlap` was true / false before it named which passes overlap: plans saved then, sweep
    # files and callers that pass a bool keep their meaning.
    assert TrainingCode.of(tp_overlap=True).tp_overlap is TpOverlap.FULL
    assert TrainingCode(tp_overlap=False).tp_overlap is TpOverlap.NONE
    assert TrainingCode.of(tp_overlap=True).changed() == {"tp_overlap": "full"}


def test_choices_list_the_default_first():
    for name, default in TrainingCode().options().items():
        assert TrainingCode.choices(name)[0] == default
    assert TrainingCode.choices("attention") == ("flash", "flash2", "flash1", "unfused")


@pytest.mark.parametrize("choices, message", [
    ({"attention": "xformers"}, r"^attention='xformers': use one of 'flash', 'flash2', 'flash1', 'unfused'$"),
    ({"tp_overlap": "yes"}, r"^tp_overlap='yes': use one of 'none', 'full', 'forward'$"),
    ({"fetch": "blocking"}, r"^fetch: not a training-code choice; use attention, tp_overlap, loss, zero3_fetch, dp_sync, elementwise, pp_buffers, cp_comm, sp_gather, pp_outputs$"),
])
def test_bad_choices_are_one_line(choices, message):
    with pytest.raises(PlannerError, match=message):
        TrainingCode.of(**choices)
