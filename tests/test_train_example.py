"""examples/train.py: the README's training example, run as a script and in this process."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import torch

import planner

ROOT = Path(__file__).resolve().parent.parent
TRAIN_PY = ROOT / "examples" / "train.py"
LOGITS_MODEL = "tests.fixtures.custom_models:sequential_lm"  # returns logits over 256 tokens, no loss


def _train_module():
    spec = importlib.util.spec_from_file_location("train_example", TRAIN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_plan_for_another_model_is_refused_in_one_line_before_any_rank_builds_its_weights(tmp_path, monkeypatch, capsys):
    # The QA run: a plan for tiny-llama given --model llama3-8b built 8B fp32 parameters on each of 4
    # ranks (32 GB each) before Plan.apply compared the model with the plan, and the ranks were
    # killed for memory. The model is checked on the meta device first; a build with weights fails here.
    planner.plan(str(ROOT / "examples" / "tiny-llama.yaml"), "cpu:2x2", global_batch=8, seq_len=128, tp=2,
                 dtype="fp32").save(tmp_path / "tiny.json")
    train = _train_module()
    resolve = train.resolve_model

    def resolve_on_meta_only(name):
        source = resolve(name)

        def build(**kwargs):
            assert torch.get_default_device().type == "meta", f"{name} built with its weights before the check"
            return source.build(**kwargs)

        return dataclasses.replace(source, build=build)

    monkeypatch.setattr(train, "resolve_model", resolve_on_meta_only)
    monkeypatch.setenv("WORLD_SIZE", "4")  # the plan's device count: the model check is what refuses
    monkeypatch.setattr(sys, "argv", ["train.py", "--plan", str(tmp_path / "tiny.json"), "--model", "llama3-8b"])
    assert train.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("train.py: model: has 32 blocks but the plan for ") and "re-plan for this model" in err


def test_a_factory_model_returning_logits_trains_over_the_vocabulary_the_planner_traced(tmp_path):
    # The factory gives no dims, as a zoo model does; the planner's trace reads its 256-token
    # vocabulary, and the loss it priced (fp32 cross-entropy over the logits) is Plan.apply's loss_fn.
    # Before: "--model ...: no token vocabulary is known for it".
    planner.plan(LOGITS_MODEL, "cpu:1", global_batch=2, seq_len=16, dtype="fp32").save(tmp_path / "lm.json")
    run = subprocess.run([sys.executable, str(TRAIN_PY), "--plan", str(tmp_path / "lm.json"), "--steps", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    first, last = run.stdout.splitlines()
    assert first.startswith("step 0: loss ")
    assert abs(float(first.split()[3]) - math.log(256)) < 1.0  # random tokens: about ln(vocabulary)
    # the built-in cpu profile is a placeholder, and the last line says so
    assert last.startswith("median step time ") and "on cpu:1, the built-in cpu profile's placeholder figures; " \
        "`paraplan profile` measures this machine" in last


def test_the_step_time_line_has_no_placeholder_caveat_for_a_measured_or_gpu_profile():
    note = _train_module().placeholder_note
    assert note("cpu:2x2").startswith(", the built-in cpu profile's placeholder figures")
    assert note("h100-sxm:2x8") == ""
    assert note(str(ROOT / "no-such-cluster.yaml")) == ""  # a cluster file of another machine
