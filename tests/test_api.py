"""The Python API (planner.plan, planner.evaluate, planner.make_config) as user code calls it,
and the rejection of configurations that cannot exist."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import planner
from costmodel.profile_loader import load_cluster
from planner.config import ParallelConfig, Schedule
from planner.errors import PlannerError, PlannerErrorKind
from planner.graph import LayerKind, Recompute
from planner.result import Plan

SMALL = "gpt3-125m"  # 12 layers, 12 heads, no experts: 14 pipeline layers with embedding and head
NODE = "a100-80g:1x8"


@pytest.fixture(scope="module")
def small_graph():
    return planner.trace(SMALL, seq_len=128)


def test_make_config_fills_data_parallel_and_micro_batches():
    # 16 devices / (tp 2 * pp 2) = dp 4; 64 sequences / (dp 4 * micro-batch 1) = 16 micro-batches.
    config = planner.make_config({"tp": 2, "pp": 2}, 16, 64)
    assert config == ParallelConfig(dp=4, tp=2, pp=2, num_microbatches=16)
    # Virtual stages imply the interleaved schedule; 64 / (4 * 2) = 8 micro-batches of 2.
    config = planner.make_config({"tp": 2, "pp": 2, "vpp": 2, "micro_batch": 2, "zero": 1, "recompute": "full"}, 16, 64)
    assert (config.schedule, config.num_microbatches, config.zero, config.recompute) == (Schedule.INTERLEAVED, 8, 1, Recompute.FULL)
    given = ParallelConfig(dp=8, num_microbatches=2)
    assert planner.make_config(given, 8, 16) is given


# (constraints, global batch, seq_len, text the message must start with: the field at fault)
REJECTED = [
    pytest.param({"tp": 8}, 16, 128, "tp=8", id="tp does not divide 12 heads"),
    pytest.param({"tp": 2, "dp": 2}, 16, 128, "dp*tp*pp*cp", id="degrees do not cover the devices"),
    pytest.param({"tp": 3}, 16, 128, "tp*pp*cp", id="degrees do not divide the devices"),
    pytest.param({"cp": 8}, 16, 100, "cp=8", id="cp does not divide seq_len"),
    pytest.param({"cp": 8}, 16, 120, "cp=8", id="2*cp does not divide seq_len (load-balanced halves)"),
    pytest.param({"tp": 2, "dp": 3}, 16, 128, "dp*tp*pp*cp", id="degrees off the devices, named before the batch"),
    pytest.param({"pp": 2, "schedule": "interleaved"}, 16, 128, "schedule=interleaved", id="interleaved without virtual stages"),
    pytest.param({"ep": 2}, 16, 128, "ep=2", id="ep without experts"),
    pytest.param({}, 12, 128, "global_batch=12", id="batch not divisible by dp"),
    pytest.param({"pp": 2, "vpp": 2}, 12, 128, "num_microbatches=3", id="interleaved with m % pp != 0"),
    pytest.param({"pp": 2, "schedule": "gpipe"}, 4, 128, "num_microbatches=1", id="gpipe with m < pp"),
    pytest.param({"pp": 8, "vpp": 2}, 16, 128, "pp*vpp=16", id="more chunks than layers"),
    pytest.param({"zero": 4}, 16, 128, "zero=4", id="unknown zero stage"),
    pytest.param({"micro_batch": 0}, 16, 128, "micro_batch=0", id="zero micro-batch"),
    pytest.param({"tp": 0}, 16, 128, "tp=0", id="zero tp"),
    pytest.param({}, 0, 128, "global_batch=0", id="zero global batch"),
    pytest.param({"tpp": 2}, 16, 128, "config key 'tpp'", id="typo key"),
    pytest.param({}, "16", 128, "global_batch='16'", id="global batch as text"),
    pytest.param({}, 16.0, 128, "global_batch=16.0", id="fractional-typed global batch"),
    pytest.param({}, 16, "128", "seq_len='128'", id="sequence length as text"),
    pytest.param(None, 16, 128, "config: expected a mapping", id="no configuration"),
]


@pytest.mark.parametrize("constraints,global_batch,seq_len,field", REJECTED)
def test_impossible_configurations_are_rejected_naming_the_field(constraints, global_batch, seq_len, field):
    with pytest.raises(PlannerError) as error:
        planner.evaluate(SMALL, NODE, constraints, global_batch=global_batch, seq_len=seq_len)
    assert error.value.kind == PlannerErrorKind.INVALID_INPUT
    assert error.value.message.startswith(field)
    assert "\n" not in error.value.message


def test_unknown_recompute_policy_names_the_field():
    with pytest.raises(PlannerError, match="recompute"):
        planner.evaluate(SMALL, NODE, {"recompute": "some"}, global_batch=16, seq_len=128)


def test_evaluate_accepts_names_graphs_clusters_and_configs(small_graph):
    by_name = planner.evaluate(SMALL, NODE, {"tp": 2, "pp": 2}, global_batch=16, seq_len=128)
    by_objects = planner.evaluate(small_graph, load_cluster(NODE), ParallelConfig(dp=2, tp=2, pp=2, num_microbatches=8), global_batch=16)
    assert by_name.config == by_objects.config
    assert by_name.step_time_s == by_objects.step_time_s
    assert by_name.memory == by_objects.memory


def test_a_module_with_example_inputs_is_planned_and_priced_as_its_factory_is():
    # DESIGN.md: `model` may be an nn.Module with example inputs. A module whose first layer is no
    # embedding needs them, and the error's fix says how to pass them: as a (module, inputs) pair.
    from tests.fixtures.custom_models import resnet_factory

    module, inputs = resnet_factory()
    with pytest.raises(PlannerError, match=r"fix: pass the model as \(module, example_inputs\)"):
        planner.plan(module, NODE, global_batch=16)
    config = {"tp": 1, "pp": 1}
    by_pair = planner.evaluate((module, inputs), NODE, config, global_batch=16)
    by_factory = planner.evaluate("tests.fixtures.custom_models:resnet_factory", NODE, config, global_batch=16)
    assert (by_pair.step_time_s, by_pair.peak_memory_bytes) == (by_factory.step_time_s, by_factory.peak_memory_bytes)
    assert planner.plan((module, inputs), NODE, global_batch=16).config == planner.plan(
        "tests.fixtures.custom_models:resnet_factory", NODE, global_batch=16).config
    assert planner.trace((module, inputs)).params == sum(p.numel() for p in module.parameters())
    with pytest.raises(PlannerError, match="pass one of them"):
        planner.models.resolve_model((module, inputs), example_inputs=inputs)


def test_a_forward_needing_a_keyword_only_input_is_refused_by_name():
    # Example inputs reach the forward by position; a keyword-only input would be missing, and the
    # trace's failure blamed the forward itself.
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(64, 16)

        def forward(self, tokens, *, scale):
            return self.embed(tokens) * scale

    with pytest.raises(PlannerError, match=r"model `Scaled`: its forward needs keyword-only input 'scale', and example "
                                           r"inputs are passed by position; fix: wrap it"):
        planner.trace((Scaled(), (torch.zeros(2, 8, dtype=torch.long),)))


def test_evaluate_reports_a_bad_cluster_as_invalid_input(small_graph):
    with pytest.raises(PlannerError) as error:
        planner.evaluate(small_graph, "h100-sxn:1x8", {}, global_batch=8)
    assert error.value.kind == PlannerErrorKind.INVALID_INPUT
    assert "h100-sxm" in error.value.message


@pytest.fixture(scope="module")
def small_plan(small_graph):
    return planner.plan(small_graph, NODE, global_batch=32)


def test_plan_is_the_fastest_fitting_candidate(small_plan, small_graph):
    plan = small_plan
    assert plan.config.devices == 8
    assert plan.estimate.fits
    assert plan.search["candidates_evaluated"] >= 1
    assert plan.alternatives
    assert all(plan.estimate.step_time_s <= alt.step_time_s for alt in plan.alternatives)
    # The per-layer memory plan can only improve on the uniform policy the search priced.
    uniform = planner.evaluate(small_graph, NODE, plan.config, global_batch=32)
    assert plan.estimate.step_time_s <= uniform.step_time_s * (1 + 1e-9)


def test_plan_round_trips_through_json(small_plan):
    assert planner.Plan.from_json(small_plan.to_json()) == small_plan
    assert planner.Plan.from_dict(small_plan.to_dict()) == small_plan
    with pytest.raises(PlannerError, match=r"^plan JSON: not JSON \(Expecting"):
        planner.Plan.from_json("{")


@pytest.mark.parametrize(("change", "message"), [
    ({"global_batch": -8}, "plan field `global_batch`: -8 is not positive"),
    ({"global_batch": 64}, "plan field `global_batch`: 64 but its config runs dp*micro_batch*num_microbatches"),
    ({"dtype": "float32"}, "plan field `dtype`: 'float32' is not one of bf16, fp16, fp8, fp32"),
    ({"memory_plan": {"recompute": {"partial": ["layers.0"]}}}, "plan field `memory_plan.recompute`: unknown policy 'partial'"),
    ({"memory_plan": {"recompute": {"full": ["layers.99"]}}}, "plan field `memory_plan.recompute.full`: 'layers.99' is not a layer"),
    ({"layouts": {"layers.0.attn.q_proj": "diagonal"}}, "plan field `layouts.layers.0.attn.q_proj`: 'diagonal' is not a placement"),
    ({"memory_plan": {"recompute": {"full": ["embed"], "none": ["embed"]}}}, "plan field `memory_plan.recompute`: layer 'embed' is listed more than once"),
])
def test_a_plan_file_with_values_no_plan_has_is_refused_naming_the_field(small_plan, change, message):
    # A hand-edited plan file would otherwise apply with a traceback, or silently run another
    # batch or recompute than the one priced.
    with pytest.raises(PlannerError) as error:
        Plan.from_dict({**json.loads(small_plan.to_json()), **change})
    assert error.value.message.startswith(message) and "\n" not in error.value.message


@pytest.mark.parametrize(("edit", "message"), [
    (lambda plan: plan["config"].pop("pp"), "plan field `config.pp`: missing"),
    (lambda plan: plan["config"].update(pipeline=2), "plan field `config.pipeline`: not a configuration field"),
    (lambda plan: plan["config"].update(pp=2), "plan field `stages`: 1 stage, but config.pp = 2"),
    (lambda plan: plan["config"].update(tp=2) or plan.update(layouts={}), "plan field `layouts`: none, but config.tp = 2"),
    (lambda plan: plan["config"].update(cp=2) or plan.update(seq_len=130), "plan field `seq_len`: 130 tokens, which 2 x config.cp = 4"),
    (lambda plan: plan.update(training_code={"cp_comm": "ring"}), "plan field `training_code`: cp_comm='ring': use one of"),
])
def test_a_plan_file_whose_config_lacks_or_adds_a_field_is_refused_naming_it(small_plan, edit, message):
    # Each would otherwise load and then fail in Plan.apply with a traceback, or run another program
    # than the one priced (a missing pp read as 1; cp chunks dropping the tokens past 2 x cp x 32).
    data = json.loads(small_plan.to_json())
    data["config"].update(tp=1, pp=1, cp=1)
    edit(data)
    with pytest.raises(PlannerError) as error:
        Plan.from_dict(data)
    assert error.value.message.startswith(message) and "\n" not in error.value.message


def test_a_traced_graph_is_not_re_planned_at_another_sequence_length(small_graph):
    with pytest.raises(PlannerError, match="seq_len=256: the traced graph of gpt3-125m is of seq_len=128"):
        planner.plan(small_graph, NODE, global_batch=32, seq_len=256)
    assert planner.plan(small_graph, NODE, global_batch=32, seq_len=128, tp=1, pp=1).seq_len == 128


def test_plan_honours_fixed_choices_and_bounds(small_graph):
    plan = planner.plan(small_graph, NODE, global_batch=32, tp=2, zero=1, max_pp=1)
    for config in [plan.config, *(alt.config for alt in plan.alternatives)]:
        assert (config.tp, config.zero, config.pp) == (2, 1, 1)


@pytest.mark.parametrize(("constraint", "message"), [
    ({"micro_batch": 0}, "micro_batch=0: must be a positive integer"), ({"recompute": "some"}, "recompute='some': use one of"),
    ({"zero": 4}, "zero=4: use one of 0, 1, 2, 3"), ({"max_pp": True}, "max_pp=True: must be a positive integer"),
    ({"mem_headroom": "a lot"}, "mem_headroom='a lot': must be a number"),
])
def test_plan_rejects_a_bad_constraint_value(small_graph, constraint, message):
    with pytest.raises(PlannerError) as error:
        planner.plan(small_graph, NODE, global_batch=32, **constraint)
    assert error.value.kind == PlannerErrorKind.INVALID_INPUT and error.value.message.startswith(message)


def test_plan_rejects_an_unknown_constraint(small_graph):
    with pytest.raises(PlannerError) as error:
        planner.plan(small_graph, NODE, global_batch=32, tpp=2)
    assert error.value.kind == PlannerErrorKind.INVALID_INPUT
    assert "'tpp'" in error.value.message and "did you mean tp" in error.value.message
    # A name like none of them lists them all.
    with pytest.raises(PlannerError, match=r"^constraint 'tensor_parallel': unknown; use one of allow_offload, .*, tp, vpp, zero$"):
        planner.plan(small_graph, NODE, global_batch=32, tensor_parallel=2)


def test_plan_says_what_would_fit_when_nothing_does():
    # llama2-7b's model states alone are 18 B x 6.7e9 = 121 GB, more than one 40 GB A100; with the
    # optimizer offloaded it could fit (4 B x 6.7e9 = 27 GB), so offload is forbidden here.
    with pytest.raises(PlannerError) as error:
        planner.plan("llama2-7b", "a100-40g:1x1", global_batch=8, seq_len=256, allow_offload=False)
    assert error.value.kind == PlannerErrorKind.INSUFFICIENT_MEMORY
    assert error.value.exit_code == 3
    assert "devices" in error.value.message


@pytest.fixture(scope="module")
def gpipe_plan():
    # gpt3-1.3b on four 24 GB A10Gs with GPipe's 8 micro-batches of 8 in flight: the search picks
    # full recompute and the per-layer ILP then lightens it on some blocks (tp=2 on the winner).
    graph = planner.trace("gpt3-1.3b", seq_len=2048)
    return graph, planner.plan(graph, "a10g:1x4", global_batch=64, micro_batch=8, pp=2, schedule="gpipe")


def test_a_saved_plan_evaluates_to_its_own_estimate(gpipe_plan, tmp_path):
    graph, plan = gpipe_plan
    blocks = {policy for policy, layer in zip(plan.recompute_per_layer(), graph.layers) if layer.kind == LayerKind.BLOCK}
    assert "full" in blocks and len(blocks) > 1
    path = tmp_path / "plan.yaml"
    plan.save(path)
    again = planner.evaluate(graph, "a10g:1x4", Plan.load(path), global_batch=64)
    assert again.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-12)
    assert again.peak_memory_bytes == pytest.approx(plan.estimate.peak_memory_bytes, rel=1e-12)
    assert [stage.layer_names for stage in again.stages] == [stage.layer_names for stage in plan.stages]
    # Its config alone prices full recompute on every block, which the per-layer plan beats.
    assert planner.evaluate(graph, "a10g:1x4", plan.config, global_batch=64).step_time_s > plan.estimate.step_time_s


CHEAPER = {"full": ("none", "selective_op", "selective"), "selective_op": ("none", "selective"), "selective": ("none",)}


@pytest.mark.parametrize(("cluster", "global_batch", "fixed"), [
    ("a10g:1x4", 32, {"micro_batch": 8}),  # one micro-batch: gradients and activations peak apart
    ("a10g:1x4", 64, {"micro_batch": 8, "pp": 2, "schedule": "gpipe"}),
    ("a10g:1x8", 96, {"micro_batch": 6, "zero": 3, "tp": 1}),  # ZeRO-3's gathered layers beside the activations
    # interleaved: a device's chunks share its memory, the loss's chunk taking more than its share
    ("a10g:1x4", 64, {"micro_batch": 8, "pp": 2, "schedule": "interleaved"}),
])
def test_no_single_block_recomputes_less_and_still_fits(cluster, global_batch, fixed):
    # The per-layer recompute plan against an independent local search: moving any one block to a
    # cheaper policy, priced by evaluate on the plan's own split, either does not fit or is not faster.
    # Without offload, which could free the memory instead.
    graph = planner.trace("gpt3-1.3b", seq_len=2048)
    plan = planner.plan(graph, cluster, global_batch=global_batch, allow_offload=False, **fixed)
    policies = plan.recompute_per_layer()
    assert any(policy != "none" for policy in policies)
    assert planner.evaluate(graph, cluster, plan).fits
    for index, policy in enumerate(policies):
        for cheaper in CHEAPER.get(policy, ()):
            if plan.config.schedule == "zb" and cheaper.startswith("selective"):
                continue
            recompute = {}
            for name, chosen in zip(plan.layer_names, (*policies[:index], cheaper, *policies[index + 1:])):
                recompute.setdefault(chosen, []).append(name)
            moved = dataclasses.replace(plan, memory_plan={**plan.memory_plan, "recompute": recompute})
            estimate = planner.evaluate(graph, cluster, moved, global_batch=global_batch)
            assert not (estimate.fits and estimate.step_time_s < plan.estimate.step_time_s * (1 - 1e-9)), (index, cheaper)


def test_a_plan_evaluates_at_its_own_global_batch_unless_given_one(gpipe_plan):
    graph, plan = gpipe_plan
    assert planner.evaluate(graph, "a10g:1x4", plan).step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-12)
    with pytest.raises(PlannerError, match="global_batch: required"):
        planner.evaluate(graph, "a10g:1x4", plan.config.to_dict())


def test_a_fixed_recompute_policy_is_kept_on_every_block(gpipe_plan):
    graph, _ = gpipe_plan
    plan = planner.plan(graph, "a10g:1x4", global_batch=64, micro_batch=8, pp=2, schedule="gpipe", recompute="full")
    assert {policy for policy, layer in zip(plan.recompute_per_layer(), graph.layers) if layer.kind == LayerKind.BLOCK} == {"full"}
    assert plan.estimate.step_time_s == pytest.approx(planner.evaluate(graph, "a10g:1x4", plan.config, global_batch=64).step_time_s, rel=1e-12)


def test_a_plan_evaluates_only_on_the_model_it_was_made_for(gpipe_plan, small_graph):
    # Another layer count, and the same 24 blocks with other sizes (gpt3-350m: hidden 1024, not 2048).
    # The error says what differs.
    _, plan = gpipe_plan
    sizes = planner.trace("gpt3-350m", seq_len=2048)
    embedding = plan.layer_params[0]
    for other, differ in ((small_graph, f"26 traced layers there, {len(small_graph.layers)} here"),
                          (sizes, f"layer 0 (embed) holds {embedding:,} parameters there, {sizes.layers[0].params:,} here")):
        with pytest.raises(PlannerError, match=re.escape(f"plan: made for gpt3-1.3b as it was then, not for this model ({differ}); ")):
            planner.evaluate(other, "a10g:1x4", plan, global_batch=64)


def test_a_plan_priced_past_its_position_table_says_so(gpipe_plan):
    # gpt3-1.3b's learned position table holds 2048 positions; at 4096 tokens it grows, and the
    # plan (made at 2048) no longer holds the model: the error names the sequence length, not a model change.
    _, plan = gpipe_plan
    longer = planner.trace("gpt3-1.3b", seq_len=4096)
    with pytest.raises(PlannerError, match=re.escape("seq_len=4096: the model's position table grows past the plan's 2048 "
                                                     "tokens (layer 0 (embed) holds ")):
        planner.evaluate(longer, "a10g:1x4", plan, global_batch=64)


def test_interleaved_stages_list_their_chunks(small_graph):
    # pp=2 x vpp=2 over the 14 layers: chunk c runs on stage c % 2, so stage 0 holds chunks 0 and 2
    # and stage 1 chunks 1 and 3; together the chunks tile the layers in order.
    estimate = planner.evaluate(small_graph, NODE, {"tp": 1, "pp": 2, "vpp": 2}, global_batch=32)
    chunks = [stage.chunks for stage in estimate.stages]
    assert [len(c) for c in chunks] == [2, 2]
    order = [chunks[0][0], chunks[1][0], chunks[0][1], chunks[1][1]]
    assert order[0][0] == 0 and order[-1][1] == len(small_graph.layers) - 1
    assert all(nxt[0] == prev[1] + 1 for prev, nxt in zip(order, order[1:]))
    for stage in estimate.stages:
        assert sum(last - first + 1 for first, last in stage.chunks) == len(stage.layer_names)


def test_evaluate_prices_a_split_the_user_gives(small_graph):
    # A run's own pipeline split (torchtitan's cut points, say) priced as given: the stages hold
    # exactly those layers; a split that is not pp*vpp increasing cuts from 0 to the layers is refused.
    layers = len(small_graph.layers)
    est = planner.evaluate(small_graph, "a100-80g:1x4", {"pp": 2, "tp": 1}, global_batch=8, boundaries=(0, 2, layers))
    assert [(s.first_layer, s.last_layer) for s in est.stages] == [(0, 1), (2, layers - 1)]
    assert est.step_time_s != planner.evaluate(small_graph, "a100-80g:1x4", {"pp": 2, "tp": 1}, global_batch=8,
                                               boundaries=(0, layers - 1, layers)).step_time_s
    for bad in ((0, layers), (0, 3, 2, layers), (1, 2, layers), (0, 2.0, layers)):
        with pytest.raises(PlannerError, match=r"^boundaries=.*need pp\*vpp\+1 = 3 increasing integers from 0"):
            planner.evaluate(small_graph, "a100-80g:1x4", {"pp": 2, "tp": 1}, global_batch=8, boundaries=bad)


def test_evaluate_prices_a_recompute_policy_per_layer_the_user_gives(small_graph):
    # Full recompute on every other block (torchtitan's layer-frequency checkpointing) is priced as
    # the evaluator prices those policies: one forward of each such block more than no recompute,
    # one forward of each other block less than full recompute, on one device (nothing overlaps).
    config = {"dp": 1, "tp": 1, "pp": 1}
    policies = tuple("full" if layer.kind == LayerKind.BLOCK and i % 2 else "none" for i, layer in enumerate(small_graph.layers))
    every_other = planner.evaluate(small_graph, "a100-80g:1x1", config, global_batch=4, recompute_per_layer=policies)
    none, full = (planner.evaluate(small_graph, "a100-80g:1x1", {**config, "recompute": r}, global_batch=4) for r in ("none", "full"))
    assert every_other.time_breakdown["recompute_s"] == pytest.approx(full.time_breakdown["recompute_s"] * policies.count("full")
                                                               / sum(layer.kind == LayerKind.BLOCK for layer in small_graph.layers))
    assert none.step_time_s < every_other.step_time_s < full.step_time_s
    assert full.peak_memory_bytes < every_other.peak_memory_bytes < none.peak_memory_bytes
    for bad in (policies[:-1], ("sometimes",) * len(policies)):
        with pytest.raises(PlannerError, match=r"^recompute_per_layer: need one of .* for each of the graph's 14 layers"):
            planner.evaluate(small_graph, "a100-80g:1x1", config, global_batch=4, recompute_per_layer=bad)


def test_attention_kernels_that_would_move_the_step_beyond_the_models_error_are_noted(small_graph):
    # At 8K tokens most of GPT-3 125M's step is attention: on an H100 its FlashAttention-2 kernels
    # (0.52 / 0.57 of the device's own) lengthen the step by far more than the model's error, and the
    # note gives the step `--attention flash2` prices. Not where FlashAttention-2 is the device's flash
    # kernel (A100), where it is the kernel priced already, or where attention is a small part (128 tokens).
    long = planner.trace(SMALL, seq_len=8192)
    config = {"tp": 1, "pp": 1, "dp": 1}
    flash = planner.evaluate(long, "h100-sxm:1x1", config, global_batch=1)
    flash2 = planner.evaluate(long, "h100-sxm:1x1", config, global_batch=1, attention="flash2")
    assert flash2.step_time_s > 1.2 * flash.step_time_s
    (note,) = [note for note in flash.notes if note.startswith("attention is priced at the device's own flash kernels")]
    assert f"the step takes {flash2.step_time_s:.4g} s, {flash2.step_time_s / flash.step_time_s - 1:+.0%}" in note
    planned = planner.plan(long, "h100-sxm:1x1", global_batch=1)
    assert any(note.startswith("attention is priced at the device's own flash kernels") for note in planned.estimate.notes)
    for quiet in (flash2, planner.evaluate(long, "a100-80g:1x1", config, global_batch=1),
                  planner.evaluate(small_graph, "h100-sxm:1x1", config, global_batch=1)):
        assert not any(note.startswith("attention is priced") for note in quiet.notes)


def test_tensor_parallelism_that_splits_few_block_weights_says_so():
    # HF GPT-2's Conv1D applies a transposed weight by addmm, which the layout does not split: tp 2
    # leaves every block weight whole. The same blocks of nn.Linear are split, and not noted.
    note = "tp=2 leaves 100% of the blocks' weights whole on every rank"
    config = {"tp": 2, "pp": 1}
    conv = planner.evaluate("tests.fixtures.custom_models:conv1d_lm", "a100-80g:1x2", config, global_batch=2, seq_len=32)
    assert any(n.startswith(note) for n in conv.notes)
    linear = planner.evaluate("tests.fixtures.custom_models:fused_qkv_lm", "a100-80g:1x2", config, global_batch=2, seq_len=32)
    assert not any("whole on every rank" in n for n in linear.notes)
