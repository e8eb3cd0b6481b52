"""Sweeps: sweep files and flags, the results file, resume after a signal, local and Ray executors.

Planning tests use the 4-layer GPT of tests/fixtures (about a second a point) on 8- and
16-device clusters; one module-scoped uninterrupted run is the reference every other run must
reproduce row for row (all columns but `plan_time_s`, which is a wall time).
"""
from __future__ import annotations

import json

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import planner
from costmodel.profile_loader import load_cluster, load_device
from planner.errors import PlannerError, PlannerErrorKind
from planner.sweeps.executors import PlanSettings, base_row, failure, plan_file_name, plan_point
from planner.sweeps.results import ADDED_COLUMNS, COLUMNS, ResultsFile, read_results, rows_without_plan
from planner.sweeps.runner import SweepSummary, sweep
from planner.sweeps.spec import SweepPoint, load_sweep_spec, sweep_spec_from_dict
from planner.training_code import TrainingCode

REPO = Path(__file__).resolve().parent.parent
TINY = "tests.fixtures.custom_models:tiny_gpt_factory"
GRID = {"models": [TINY], "devices": ["a100-80g", "h100-sxm", "l4"], "cluster_sizes": [8, 16], "global_batches": [32],
        "seq_lens": [128]}
FLAGS = ["--models", TINY, "--devices", "a100-80g,h100-sxm,l4", "--cluster-sizes", "8,16", "--global-batches", "32",
         "--seq-lens", "128"]
TIMING_COLUMNS = ("plan_time_s",)


def comparable(rows: list[dict]) -> dict[SweepPoint, dict]:
    """Rows keyed by point, without wall-time columns; a repeated point fails the test."""
    out = {}
    for row in rows:
        point = SweepPoint(row["model"], row["cluster"], row["global_batch"], row["seq_len"])
        assert point not in out, f"{point} has two rows"
        out[point] = {key: value for key, value in row.items() if key not in TIMING_COLUMNS}
    return out


def assert_same_rows(got: dict[SweepPoint, dict], expected: dict[SweepPoint, dict], ignore: tuple[str, ...] = ()) -> None:
    """`comparable` rows equal, point for point, apart from the `ignore` columns; names what differs."""
    assert set(got) == set(expected)
    differences = [f"{point.cluster} {key}: {got[point][key]!r} != {row[key]!r}"
                   for point, row in expected.items() for key in row if key not in ignore and got[point][key] != row[key]]
    assert not differences, "; ".join(differences)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The rows of an uninterrupted in-process run of GRID."""
    out = tmp_path_factory.mktemp("reference") / "results.csv"
    summary = sweep(GRID, out, workers=1)
    assert summary.points == summary.planned == 6
    return read_results(out)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


# --- sweep files and flags ---------------------------------------------------------------------

def test_grid_expands_every_combination_with_canonical_cluster_names(tmp_path):
    path = write(tmp_path, "models: [gpt3-125m, gpt3-350m]\ndevices: [a100-80g, l4]\ncluster_sizes: [4, 16]\n"
                           "clusters: [a100-80g:2x8]\nglobal_batches: [64]\nseq_lens: [512, 1024]\n")
    spec = load_sweep_spec(path)
    # 2 models x 2 seq_lens x 1 batch x (2 devices x 2 sizes + 1 cluster) = 20, less the cluster
    # a100-80g:2x8, which is also a100-80g with 16 devices: 2 x 2 x 4 = 16 distinct points.
    assert len(spec.points) == 16
    assert list(spec.clusters) == ["a100-80g:1x4", "a100-80g:2x8", "l4:1x4", "l4:2x8"]
    assert spec.points[0] == SweepPoint("gpt3-125m", "a100-80g:1x4", 64, 512)
    assert spec.clusters["l4:2x8"].num_devices == 16
    assert spec.settings == "dtype=bf16 attention=flash"


def test_a_device_file_is_its_own_cluster_even_under_a_built_in_name(tmp_path):
    # A copy of the h100-sxm profile at half its peak keeps the built-in's `name:`; given by its path
    # (in `devices` or in a `clusters` shorthand) its points stay apart from the built-in's.
    (tmp_path / "devices").mkdir()
    text = (REPO / "profiles" / "devices" / "h100-sxm.yaml").read_text()
    text = text.replace("bf16: 989.4e+12", "bf16: 494.7e+12")
    assert "bf16: 494.7e+12" in text
    (tmp_path / "devices" / "h100-sxm.yaml").write_text(text)
    path = write(tmp_path, "models: [gpt3-125m]\ndevices: [h100-sxm, devices/h100-sxm.yaml]\ncluster_sizes: [8]\n"
                           "clusters: [devices/h100-sxm.yaml:1x8]\nglobal_batches: [64]\nseq_lens: [512]\n")
    spec = load_sweep_spec(path)
    slow = f"{tmp_path / 'devices' / 'h100-sxm.yaml'}:1x8"
    assert list(spec.clusters) == ["h100-sxm:1x8", slow]
    assert spec.clusters[slow].groups[0].node.device.peak_flops_per_s["bf16"] == 494.7e12
    # Rows (and the charts, which group by the device column) keep the two apart too.
    settings = PlanSettings(spec.dtype, spec.code, spec.constraints, spec.settings)
    rows = [base_row(point, spec.clusters[point.cluster], settings) for point in spec.points]
    assert [row["device"] for row in rows] == ["h100-sxm", str(tmp_path / "devices" / "h100-sxm.yaml")]


def test_tp_overlap_is_a_sweep_setting(tmp_path):
    path = write(tmp_path, "models: [gpt3-125m]\nclusters: [a100-80g:1x8]\nglobal_batches: [64]\nseq_lens: [512]\n"
                           "tp_overlap: true\nconstraints: {tp: 4}\n")
    spec = load_sweep_spec(path)  # true: the switch of old, full overlap
    assert spec.code.tp_overlap == "full" and spec.settings == "dtype=bf16 attention=flash tp_overlap=full tp=4"
    assert load_sweep_spec(path, {"tp_overlap": None}).code.tp_overlap == "full"  # an absent flag keeps the file's value
    assert load_sweep_spec(path, {"tp_overlap": "forward"}).code.tp_overlap == "forward"
    graph = planner.trace("gpt3-125m", seq_len=512)
    cluster = spec.clusters["a100-80g:1x8"]
    point = spec.points[0]
    # tp=4 in one node: the overlapped run exposes less TP communication, so it is faster.
    exposed = plan_point(point, graph, cluster, PlanSettings("bf16", TrainingCode(), {"tp": 4}, "tp=4"))
    overlapped = plan_point(point, graph, cluster, PlanSettings("bf16", TrainingCode.of(tp_overlap="full"), {"tp": 4}, "tp=4"))
    assert overlapped["step_time_s"] < exposed["step_time_s"]


def test_loss_kernel_is_a_sweep_setting(tmp_path):
    path = write(tmp_path, "models: [gpt3-125m]\nclusters: [a100-80g:1x8]\nglobal_batches: [64]\nseq_lens: [512]\n"
                           "loss: fused\n")
    spec = load_sweep_spec(path)
    assert spec.code.loss == "fused" and spec.settings == "dtype=bf16 attention=flash loss=fused"
    assert load_sweep_spec(path, {"loss": "torch"}).code.loss == "torch"  # a flag overrides the file
    graph = planner.trace("gpt3-125m", seq_len=512)
    point, cluster = spec.points[0], spec.clusters["a100-80g:1x8"]
    # The same configuration with a fused loss needs less memory on the device holding the loss.
    fixed = {"tp": 1, "pp": 1, "micro_batch": 8, "zero": 0, "recompute": "none"}
    torch_row, fused_row = (plan_point(point, graph, cluster, PlanSettings("bf16", TrainingCode.of(loss=loss), fixed, ""))
                            for loss in ("torch", "fused"))
    assert fused_row["peak_memory_bytes"] < torch_row["peak_memory_bytes"]


@pytest.mark.parametrize("key, default, zero", [("zero3_fetch", "prefetch", 3), ("dp_sync", "overlapped", 1)])
def test_blocking_state_traffic_is_a_sweep_setting(tmp_path, key, default, zero):
    path = write(tmp_path, "models: [gpt3-125m]\nclusters: [a100-80g:1x8]\nglobal_batches: [64]\nseq_lens: [512]\n"
                           f"{key}: blocking\n")
    spec = load_sweep_spec(path)
    assert spec.settings == f"dtype=bf16 attention=flash {key}=blocking"
    assert getattr(load_sweep_spec(path, {key: None}).code, key) == "blocking"  # an absent flag keeps the file's value
    graph = planner.trace("gpt3-125m", seq_len=512)
    point, cluster = spec.points[0], spec.clusters["a100-80g:1x8"]
    # The same configuration is slower when its fetches (ZeRO-3) or its synchronisation (below) stall compute.
    fixed = {"tp": 1, "pp": 1, "micro_batch": 8, "zero": zero, "recompute": "none"}
    default_row, blocking_row = (plan_point(point, graph, cluster, PlanSettings("bf16", TrainingCode.of(**{key: mode}), fixed, ""))
                                 for mode in (default, "blocking"))
    assert blocking_row["step_time_s"] > default_row["step_time_s"]
    bad = write(tmp_path, "models: [gpt3-125m]\nclusters: [a100-80g:1x8]\nglobal_batches: [64]\nseq_lens: [512]\n"
                          f"{key}: async\n")
    with pytest.raises(PlannerError, match=rf"{key}: 'async': use one of {default}, blocking"):
        load_sweep_spec(bad)


@pytest.mark.parametrize("text, message", [
    ("models: [gpt3-125m]\ndevices: [a100-80g, h100-sxn]\ncluster_sizes: [8]\nglobal_batches: [64]\nseq_lens: [512]\n",
     "sweep.yaml:2: devices[1]: device 'h100-sxn': unknown; did you mean h100-sxm"),
    ("models: [gpt3-125m]\ndevices: [a100-80g]\ncluster_sizes: [8]\nglobal_batches: [64]\nseq_lens: []\n",
     "sweep.yaml:5: seq_lens: empty"),
    ("models: [gpt3-125m]\ndevice: [a100-80g]\ncluster_sizes: [8]\nglobal_batches: [64]\nseq_lens: [512]\n",
     "sweep.yaml:2: device: unknown key; did you mean devices?"),
    ("models: [gpt3-125m]\ndevices: [a100-80g]\ncluster_sizes:\n  - 8\n  - 12\nglobal_batches: [64]\nseq_lens: [512]\n",
     "sweep.yaml:5: cluster_sizes[1]: cluster 'a100-80g:12': N: 12 devices do not fill whole 8-device"),
    ("models: [gpt3-125m, gpt-9]\ndevices: [a100-80g]\ncluster_sizes: [8]\nglobal_batches: [64]\nseq_lens: [512]\n",
     "sweep.yaml:1: models[1]:"),
    ("models: [gpt3-125m]\ndevices: [a100-80g]\ncluster_sizes: [8]\nglobal_batches: [0]\nseq_lens: [512]\n",
     "sweep.yaml:4: global_batches[0]: 0: must be a positive integer"),
    ("models: [gpt3-125m]\ndevices: [a100-80g]\nglobal_batches: [64]\nseq_lens: [512]\n",
     "sweep.yaml:2: devices: needs cluster_sizes too"),
    ("points:\n  - {model: gpt3-125m, cluster: a100-80g:1x8, global_batch: 64}\n",
     "sweep.yaml:2: points[0]: seq_len: missing"),
    ("models: [gpt3-125m]\nclusters: [a100-80g:1x8]\nglobal_batches: [64]\nseq_lens: [512]\nconstraints: {zeros: 1}\n",
     "sweep.yaml:5: constraints: zeros: unknown constraint; did you mean zero?"),
    ("models: [gpt3-125m]\nclusters: [a100-80g:1x8]\nglobal_batches: [64]\nseq_lens: [512]\nconstraints: {top: 3}\n",
     "sweep.yaml:5: constraints: top: not taken in a sweep"),
    ("models: [gpt3-125m]\nclusters: [a100-80g:1x8]\nglobal_batches: [64]\nseq_lens: [512]\nconstraints: {micro_batch: 0}\n",
     "sweep.yaml:5: constraints: micro_batch=0: must be a positive integer"),
    ("models: [gpt3-125m]\nclusters: [a100-80g:1x8]\nglobal_batches: [64]\nseq_lens: [512]\nconstraints: {schedule: foo}\n",
     "sweep.yaml:5: constraints: schedule='foo': use one of gpipe, 1f1b, interleaved, zb"),
    ("models: [gpt3-125m]\nclusters: [a100-80g:1x8]\nglobal_batches: [64]\nseq_lens: [512]\nloss: chunked\n",
     "sweep.yaml:5: loss: 'chunked': use one of torch, inplace, fused"),
    ("models: [gpt3-125m]\nclusters: [a100-80g:1x8]\nglobal_batches: [64]\nseq_lens: [512]\ntp_overlap: yes please\n",
     "sweep.yaml:5: tp_overlap: 'yes please': use one of none, full, forward"),
    ("models: [gpt3-125m]\nclusters: [a100-80g:1x8]\nglobal_batches: [64, 64]\nseq_lens: [512]\n",
     "sweep.yaml:3: global_batches[1]: 64 is listed twice"),
])
def test_bad_sweep_files_name_the_line_and_field(tmp_path, text, message):
    with pytest.raises(PlannerError) as error:
        load_sweep_spec(write(tmp_path, text))
    assert message in error.value.message
    assert error.value.message.startswith(str(tmp_path / "sweep.yaml"))
    assert "\n" not in error.value.message


def test_flags_override_the_file_and_errors_name_the_flag(tmp_path):
    path = write(tmp_path, "models: [gpt3-125m]\ndevices: [a100-80g]\ncluster_sizes: [8]\nglobal_batches: [64]\nseq_lens: [512]\n")
    spec = load_sweep_spec(path, {"devices": ["l4", "h100-sxm"], "seq_lens": None})
    assert [p.cluster for p in spec.points] == ["l4:1x8", "h100-sxm:1x8"]
    with pytest.raises(PlannerError, match=r"^--cluster-sizes 12: cluster 'a100-80g:12'"):
        load_sweep_spec(path, {"cluster_sizes": [12]})


def test_a_bad_sweep_is_rejected_before_any_work(tmp_path):
    out = tmp_path / "results.csv"
    with pytest.raises(PlannerError, match=r"^sweep\['devices'\]\[0\]: device 'a100-90g': unknown"):
        sweep({**GRID, "devices": ["a100-90g"]}, out)
    with pytest.raises(PlannerError, match="unknown results extension '.txt'"):
        sweep(GRID, tmp_path / "results.txt")
    assert not out.exists() and not (tmp_path / "results.txt").exists()


# --- the results file --------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_results_round_trip_and_a_partial_last_line_is_cut(tmp_path, suffix, reference):
    path = tmp_path / f"results{suffix}"
    with ResultsFile.open(path) as results:
        for row in reference[:3]:
            results.append(row)
    whole = path.read_bytes()
    with path.open("ab") as stream:
        stream.write(whole.splitlines(keepends=True)[-1][:25])  # a kill in the middle of a write
    assert read_results(path) == reference[:3]
    with ResultsFile.open(path) as results:
        assert results.rows == reference[:3]
        assert path.read_bytes() == whole
        results.append(reference[3])
    assert read_results(path) == reference[:4]


@pytest.mark.parametrize("change, message", [({"tokens_per_s": None}, "tokens_per_s is empty in a row of status ok"),
                                             ({"status": "done"}, "status='done': expected one of ok, infeasible"),
                                             ({"tokens_per_s": float("inf")}, "tokens_per_s=inf: not a finite number"),
                                             ({"mfu": float("nan")}, "mfu=nan: not a finite number")])
def test_a_row_missing_what_its_status_needs_is_damage_named_by_line(tmp_path, change, message):
    # A plan's row without its throughput would break `paraplan report`, a row of an unknown status
    # would be counted nowhere, and an infinite figure would stop the report's charts with a
    # traceback (a NaN would be drawn nowhere): each is named, with its line, as damage to fix.
    path = tmp_path / "results.jsonl"
    row = {**dict.fromkeys(COLUMNS), "model": "gpt3-125m", "cluster": "a100-80g:1x8", "global_batch": 32, "seq_len": 128,
           "settings": "dtype=bf16", "device": "a100-80g", "devices": 8, "status": "ok", "config": "dp8", "step_time_s": 1.0,
           "tokens_per_s": 4096.0, "mfu": 0.5, "peak_memory_bytes": 1.0}
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, **change}) + "\n")
    with pytest.raises(PlannerError, match=rf"results.jsonl:2: {re.escape(message)}.*fix or remove that line$"):
        read_results(path)


def test_a_second_sweep_on_a_results_file_being_written_is_refused(tmp_path):
    # Two sweeps appending to one file would both plan every point (and a rewrite by one would cut
    # the other off): while one holds the file, another is refused in one line; after it, it opens.
    path = tmp_path / "results.csv"
    with ResultsFile.open(path):
        with pytest.raises(PlannerError, match=r"results.csv: another sweep is writing it now; wait for it to end or write to "
                                               r"another --out$"):
            sweep(GRID, path, workers=1)
    with ResultsFile.open(path) as results:
        assert results.rows == []


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_file_from_before_the_added_columns_reads_and_resumes_with_them(tmp_path, suffix, reference):
    # A results file written before `dp_replicate`, `host_bytes`, `fingerprint` and `notes` existed: its rows
    # read with those columns empty, and a sweep appending to it first rewrites it with every column.
    first = [column for column in COLUMNS if column not in ADDED_COLUMNS]
    old = [{column: row[column] for column in first} for row in reference[:2]]
    path = tmp_path / f"old{suffix}"
    if suffix == ".csv":
        path.write_text(",".join(first) + "\n" + "".join(
            ",".join("" if row[c] is None else str(row[c]) for c in first) + "\n" for row in old))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in old))
    expected = [{**row, **dict.fromkeys(ADDED_COLUMNS)} for row in old]
    assert read_results(path) == expected
    with ResultsFile.open(path) as results:
        results.append(reference[2])
    assert read_results(path) == [*expected, reference[2]]
    if suffix == ".csv":
        assert path.read_text().splitlines()[0].split(",") == list(COLUMNS)


def test_a_row_carries_the_estimates_notes():
    # bf16 asked of a V100, which has no bf16: priced in fp16, as `plan` says; the row says so too.
    graph = planner.trace("gpt3-125m", seq_len=128)
    point = SweepPoint("gpt3-125m", "v100-32g:1x8", 64, 128)
    row = plan_point(point, graph, load_cluster("v100-32g:1x8"), PlanSettings("bf16", TrainingCode(), {}, ""))
    assert row["status"] == "ok" and "v100-32g has no bf16: priced in fp16" in row["notes"]
    assert plan_point(point, graph, load_cluster("a100-80g:1x8"), PlanSettings("bf16", TrainingCode(), {}, ""))["notes"] is None


def test_plan_files_keep_model_names_apart():
    # A built-in name keeps its dots (Path.stem would cut llama3.1-8b and llama3.1-70b both to llama3);
    # a spec file is named by its stem and a digest of its path (two files named tiny.yaml in two
    # folders shared one plan file, which held the other model's plan).
    models = ("llama3.1-8b", "llama3.1-70b", "/a/specs/my-gpt.yaml", "/b/specs/my-gpt.yaml", "pkg.models:build")
    names = {model: plan_file_name(SweepPoint(model, "h100-sxm:1x8", 64, 2048)) for model in models}
    assert len(set(names.values())) == 5
    assert names["llama3.1-8b"] == "llama3.1-8b_h100-sxm_1x8_gb64_s2048.json"
    assert re.match(r"my-gpt-[0-9a-f]{8}_h100", names["/a/specs/my-gpt.yaml"])


def test_a_plan_that_cannot_be_saved_keeps_its_row_and_says_why(tmp_path, monkeypatch):
    # A plan file that cannot be written (a full disk; here a directory in its place) used to end the
    # sweep, named --out, and through a worker pool read as a killed worker. The point's results
    # stand and its notes name --plan-dir; a relative --plan-dir is stored absolute.
    monkeypatch.chdir(tmp_path)
    graph = planner.trace("gpt3-125m", seq_len=128)
    point = SweepPoint("gpt3-125m", "a100-80g:1x8", 64, 128)
    settings = PlanSettings("bf16", TrainingCode(), {}, "", plan_dir="plans")
    saved = plan_point(point, graph, load_cluster("a100-80g:1x8"), settings)
    assert saved["plan_path"] == str(tmp_path / "plans" / plan_file_name(point))
    other = SweepPoint("gpt3-125m", "a100-80g:1x8", 32, 128)
    (tmp_path / "plans" / plan_file_name(other)).mkdir()
    row = plan_point(other, graph, load_cluster("a100-80g:1x8"), settings)
    assert row["status"] == "ok" and row.get("plan_path") is None
    assert "--plan-dir: plan not saved to" in row["notes"]


def test_planner_errors_cross_process_boundaries():
    # A sweep's workers send errors back pickled; PlannerError lost its message on the way.
    import pickle
    error = pickle.loads(pickle.dumps(PlannerError(PlannerErrorKind.INSUFFICIENT_MEMORY, "needs 9 GiB")))
    assert (error.kind, error.message, str(error)) == (PlannerErrorKind.INSUFFICIENT_MEMORY, "needs 9 GiB", "needs 9 GiB")


def test_a_directory_given_as_the_sweep_file_is_named_so(tmp_path):
    with pytest.raises(PlannerError, match=r"sweep file .*: is a directory; give the sweep's YAML file"):
        load_sweep_spec(tmp_path)


def test_a_sweep_file_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_bytes(b"models: [gpt2]\n# caf\xe9\n")
    with pytest.raises(PlannerError, match=r"not UTF-8 text \(byte \d+\); save it as UTF-8 YAML"):
        load_sweep_spec(path)


def test_a_point_written_twice_reads_once_as_its_last_row(tmp_path, reference):
    path = tmp_path / "results.jsonl"
    rerun = dict(reference[0], step_time_s=2 * reference[0]["step_time_s"])
    with ResultsFile.open(path) as results:
        for row in (reference[0], reference[1], rerun):
            results.append(row)
    assert read_results(path) == [rerun, reference[1]]


def test_row_prices_the_cluster_and_records_failures(reference):
    row = next(r for r in reference if r["cluster"] == "a100-80g:2x8")
    price = load_device("a100-80g").price_per_hour
    # 16 devices at `price` USD an hour; a million tokens take 1e6 / tokens_per_s seconds.
    assert row["cluster_usd_per_hour"] == pytest.approx(16 * price)
    assert row["usd_per_million_tokens"] == pytest.approx(16 * price / 3600 * 1e6 / row["tokens_per_s"])
    assert (row["device"], row["devices"], row["nodes"], row["status"]) == ("a100-80g", 16, 2, "ok")
    assert row["config"].startswith(f"dp{row['dp']} tp{row['tp']} pp{row['pp']}")
    assert set(row) == set(COLUMNS)

    spec = sweep_spec_from_dict({**GRID, "devices": ["a100-80g"], "cluster_sizes": [8]})
    from planner.tracing import trace

    graph = trace(TINY, seq_len=128)
    cluster = spec.clusters["a100-80g:1x8"]
    # dp=8 cannot split a global batch of 12 sequences.
    bad_batch = plan_point(SweepPoint(TINY, "a100-80g:1x8", 12, 128), graph, cluster,
                           PlanSettings("bf16", TrainingCode(), {"dp": 8}, "dp=8"))
    assert bad_batch["status"] == "invalid" and bad_batch["reason"] and bad_batch["tokens_per_s"] is None
    assert bad_batch["cluster_usd_per_hour"] == pytest.approx(8 * price)
    no_tp3 = plan_point(SweepPoint(TINY, "a100-80g:1x8", 32, 128), graph, cluster, PlanSettings("bf16", TrainingCode(), {"tp": 3}, "tp=3"))
    assert no_tp3["status"] == "invalid" and "tp=3" in no_tp3["reason"]
    assert failure(PlannerError(PlannerErrorKind.INSUFFICIENT_MEMORY, "no plan fits")) == {"status": "infeasible", "reason": "no plan fits"}
    assert failure(ZeroDivisionError("division by zero")) == {"status": "error", "reason": "ZeroDivisionError: division by zero"}


# --- resume ------------------------------------------------------------------------------------

def test_rerun_plans_only_missing_points_and_matches_an_uninterrupted_run(tmp_path, reference):
    out = tmp_path / "results.jsonl"
    first = sweep({**GRID, "devices": ["h100-sxm"]}, out, workers=1)
    assert first.planned == 2
    plans = tmp_path / "plans"
    summary = sweep(GRID, out, workers=1, plan_dir=plans)
    assert (summary.points, summary.planned, summary.status_counts) == (6, 4, {"ok": 6})
    rows = read_results(out)
    assert [r["cluster"] for r in rows] == [r["cluster"] for r in reference]  # the sweep's order once complete
    assert_same_rows(comparable(rows), comparable(reference), ignore=("plan_path",))
    assert sum(r["plan_path"] is not None for r in rows) == 4 and all(Path(r["plan_path"]).is_file() for r in rows if r["plan_path"])
    # The two points of the first run have no plan in the folder; a run that saved them would have.
    assert rows_without_plan(rows, plans) == 2 and rows_without_plan(rows, tmp_path / "other") == 6
    assert sweep(GRID, out, workers=1, plan_dir=plans).planned == 0 and rows_without_plan(read_results(out), plans) == 2
    with pytest.raises(PlannerError, match="planned with 'dtype=bf16 attention=flash', this sweep uses 'dtype=fp16"):
        sweep({**GRID, "dtype": "fp16"}, out, workers=1)
    # Other points with other settings would join rows a report then compares as planned alike.
    with pytest.raises(PlannerError, match="planned with 'dtype=bf16 attention=flash', this sweep uses 'dtype=fp16"):
        sweep({**GRID, "devices": ["a100-40g"], "dtype": "fp16"}, out, workers=1)


def test_the_summary_of_a_run_that_planned_nothing_says_so():
    from rich.console import Console

    from planner.report.sweep_report import render_sweep_summary

    def shown(planned: int) -> str:
        console = Console(width=120, record=True)
        console.print(render_sweep_summary(SweepSummary(Path("r.jsonl"), 6, planned, {"ok": 6}, 3.0, 2.0 if planned else 0.0)))
        return console.export_text()

    idle = shown(0)
    assert "none: all 6 were already in the file" in idle and "points/s" not in idle
    assert "2 (the other 4 were already in the file)" in shown(2) and "1.00 points/s" in shown(2)


@pytest.mark.parametrize("edited", ["groups:\n  - {device: a100-80g, nodes: 2}\n",
                                    "groups:\n  - {device: a100-80g, nodes: 1, nic: eth-25g-8gpu}\n"])
def test_rows_of_a_cluster_file_edited_since_are_refused(tmp_path, edited):
    # Resuming after the cluster file changed (more nodes, a slower NIC) would keep rows priced for
    # the old hardware; a renamed or re-described cluster prices the same and resumes.
    cluster = tmp_path / "mine.yaml"
    cluster.write_text("groups:\n  - {device: a100-80g, nodes: 1}\n")
    grid = {key: value for key, value in {**GRID, "clusters": [str(cluster)]}.items() if key not in ("devices", "cluster_sizes")}
    out = tmp_path / "results.csv"
    assert sweep(grid, out, workers=1).planned == 1
    cluster.write_text("name: renamed\ndescription: the same node\ngroups:\n  - {device: a100-80g, nodes: 1}\n")
    assert sweep(grid, out, workers=1).planned == 0
    cluster.write_text(edited)
    with pytest.raises(PlannerError, match=r"was planned from other hardware or model data \(fingerprint [0-9a-f]{12}, now [0-9a-f]{12}"):
        sweep(grid, out, workers=1)


def test_rows_of_a_model_spec_edited_since_are_refused(tmp_path):
    # A spec file given two more layers since: its rows priced the old model.
    spec = tmp_path / "tiny.yaml"
    spec.write_text("arch: gpt\nlayers: 2\nhidden: 64\nheads: 4\nvocab: 128\nmax_seq_len: 128\n")
    grid = {**GRID, "models": [str(spec)], "devices": ["a100-80g"], "cluster_sizes": [8]}
    out = tmp_path / "results.jsonl"
    assert sweep(grid, out, workers=1).planned == 1
    spec.write_text("arch: gpt\nlayers: 4\nhidden: 64\nheads: 4\nvocab: 128\nmax_seq_len: 128\n")
    with pytest.raises(PlannerError, match="its cluster, device, op-table or model spec file changed since"):
        sweep(grid, out, workers=1)


def test_a_sweep_resumes_alike_from_another_directory(tmp_path, monkeypatch):
    # Files are named by absolute path in the points, so `sweep sub/sweep.yaml` run from above finds
    # the rows `sweep sweep.yaml` wrote from inside, rather than planning the points again.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mine.yaml").write_text("groups:\n  - {device: a100-80g, nodes: 1}\n")
    (tmp_path / "sub" / "sweep.yaml").write_text(f"models: [{TINY}]\nclusters: [mine.yaml]\nglobal_batches: [32]\nseq_lens: [128]\n")
    monkeypatch.chdir(tmp_path / "sub")
    assert sweep("sweep.yaml", "results.csv", workers=1).planned == 1
    monkeypatch.chdir(tmp_path)
    assert sweep("sub/sweep.yaml", "sub/results.csv", workers=1).planned == 0
    assert [row["cluster"] for row in read_results(tmp_path / "sub" / "results.csv")] == [str(tmp_path / "sub" / "mine.yaml")]


def test_a_model_that_fails_to_trace_becomes_rows(tmp_path, monkeypatch):
    import planner.sweeps.runner

    def fail(model, seq_len=None, dtype="bf16"):
        raise PlannerError(PlannerErrorKind.UNSUPPORTED_MODEL, "capture failed in layers.0: boom")

    monkeypatch.setattr(planner.sweeps.runner, "model_graph", fail)
    summary = sweep({**GRID, "cluster_sizes": [8]}, tmp_path / "r.csv", workers=1)
    rows = read_results(tmp_path / "r.csv")
    assert summary.status_counts == {"invalid": 3}
    assert {r["reason"] for r in rows} == {"capture failed in layers.0: boom"}


def test_points_that_failed_unexpectedly_are_planned_again_on_resume(tmp_path, monkeypatch, reference):
    # An unexpected exception (code edited mid-sweep, say) is no answer about a point: its `error`
    # rows are planned again by the next run, which ends with the rows an unbroken run writes.
    import planner.sweeps.runner

    real = planner.sweeps.runner.model_graph

    def broken(model, seq_len=None, dtype="bf16"):
        raise NameError("name 'CP_MAX' is not defined")

    monkeypatch.setattr(planner.sweeps.runner, "model_graph", broken)
    out = tmp_path / "r.csv"
    assert sweep(GRID, out, workers=1).status_counts == {"error": 6}
    monkeypatch.setattr(planner.sweeps.runner, "model_graph", real)
    summary = sweep(GRID, out, workers=1)
    assert summary.planned == 6 and summary.status_counts == {"ok": 6}
    assert_same_rows(comparable(read_results(out)), comparable(reference))


def test_a_stop_request_after_the_last_point_ends_the_sweep_normally(tmp_path, monkeypatch, reference):
    # Ctrl-C as the last point's row is written: nothing is left to stop, so the sweep finishes
    # (its summary, exit 0) instead of asking for a re-run that would plan nothing.
    import planner.sweeps.runner

    real_rows = planner.sweeps.runner._rows

    def rows_then_signal(*args):
        yield from real_rows(*args)
        signal.raise_signal(signal.SIGINT)
        yield None

    monkeypatch.setattr(planner.sweeps.runner, "_rows", rows_then_signal)
    summary = sweep(GRID, tmp_path / "r.csv", workers=1)
    assert summary.planned == 6 and summary.status_counts == {"ok": 6}
    assert_same_rows(comparable(read_results(tmp_path / "r.csv")), comparable(reference))


def test_one_stop_request_delivered_twice_stops_the_sweep_once():
    # `timeout` signals the process and then its group: two SIGTERMs at once are one request, which
    # the previous handler (here one that raises) must not see; one later than the window is a second.
    from planner.sweeps.runner import REPEAT_WINDOW_S, _StopOnSignal

    class Forced(Exception):
        """Raised by the handler a stop signal falls through to."""

    def force(signum, frame):
        raise Forced

    previous = signal.signal(signal.SIGTERM, force)
    try:
        with _StopOnSignal() as stop:
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
            assert stop.event.is_set() and stop.signum == signal.SIGTERM
            time.sleep(REPEAT_WINDOW_S)
            with pytest.raises(Forced):
                signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_progress_line_fits_80_columns_and_rates_points_since_this_run_started(monkeypatch):
    # A resumed run's done points are not planned by it; two points ending 10 ms apart are not a
    # rate of 100 points/s until a second has passed; a long description is cut, not wrapped.
    import io

    from rich.console import Console

    from planner.sweeps import runner

    now = [0.0]
    bar = runner._progress_bar(True)
    bar.get_time = lambda: now[0]
    bar.live.console = Console(file=io.StringIO(), width=80, force_terminal=True)
    task_id = bar.add_task("x" * 200, total=110, completed=10, resumed=10)
    task = bar.tasks[task_id]

    def line() -> str:
        console = bar.live.console
        return "".join(segment.text for segment in console.render(bar.make_tasks_table([task]), console.options))

    now[0] = 0.01
    bar.update(task_id, advance=2)
    assert "- points/s" in line()
    now[0] = 20.0
    bar.update(task_id, advance=8)
    rendered = line()
    assert "0.50 points/s, 3:00 left" in rendered, rendered
    assert rendered.count("\n") == 1 and len(rendered.rstrip("\n")) <= 80 and "…" in rendered


@pytest.mark.parametrize("signum, suffix, workers, rerun, group", [(signal.SIGTERM, ".csv", "2", "command", True),
                                                                   (signal.SIGINT, ".jsonl", "1", "api", False)])
def test_a_signalled_sweep_resumes_to_the_uninterrupted_rows(tmp_path, reference, signum, suffix, workers, rerun, group):
    """Stop `paraplan sweep` once it has written a row; re-run the command (or the same sweep
    through the API, which is what the command runs, to save a process start). With worker
    processes the signal goes to the whole process group, as Ctrl-C, `timeout` and batch
    schedulers send it: the workers leave stopping to the parent."""
    out = tmp_path / f"results{suffix}"
    command = [sys.executable, str(REPO / "cli.py"), "sweep", *FLAGS, "--out", str(out), "--workers", workers]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=group)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or len(read_results(out)) < 1):
        time.sleep(0.05)
    if group:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signum
    assert stderr.strip().splitlines()[-1].startswith(f"paraplan: sweep stopped by {signal.Signals(signum).name} with ")
    assert stderr.strip().endswith("re-run the same command to resume")
    stopped = read_results(out)
    assert 1 <= len(stopped) < 6 and out.read_bytes().endswith(b"\n")
    if rerun == "command":
        again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr
        assert re.search(rf"planned now\s+│\s+{6 - len(stopped)} \(the other {len(stopped)} ", again.stdout)
    else:
        assert sweep(GRID, out, workers=int(workers)).planned == 6 - len(stopped)
    assert_same_rows(comparable(read_results(out)), comparable(reference))


def test_workers_end_with_a_sweep_killed_outright(tmp_path):
    """SIGKILL (the OOM killer) gives the parent no chance to stop its pool: the workers, which
    ignore the stop signals, notice their parent is gone and end instead of holding its output open."""
    out = tmp_path / "results.csv"
    command = [sys.executable, str(REPO / "cli.py"), "sweep", *FLAGS, "--out", str(out), "--workers", "2"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or len(read_results(out)) < 1):
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()

    def left() -> list[str]:
        return subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True).stdout.split()

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and left():
        time.sleep(0.2)
    assert left() == []


# --- executors ---------------------------------------------------------------------------------

def test_worker_processes_produce_the_same_rows(tmp_path, reference):
    summary = sweep(GRID, tmp_path / "results.csv", workers=2)
    assert summary.planned == 6
    assert_same_rows(comparable(read_results(tmp_path / "results.csv")), comparable(reference))


def test_ray_tasks_produce_the_same_rows(tmp_path, reference):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        sweep({**GRID, "cluster_sizes": [8]}, tmp_path / "results.jsonl", executor="ray")
    finally:
        ray.shutdown()
    expected = {point: row for point, row in comparable(reference).items() if point.cluster.endswith(":1x8")}
    assert_same_rows(comparable(read_results(tmp_path / "results.jsonl")), expected)


def test_a_point_written_twice_resumes_as_the_report_reads_it(tmp_path, reference):
    # Two results files joined: a point's later row marks it infeasible. The sweep kept the first
    # row (and the duplicate) while `paraplan report` read the last: they disagreed on the counts.
    path = tmp_path / "results.csv"
    with ResultsFile.open(path) as results:
        for row in [*reference, dict(reference[0], status="infeasible", reason="joined from another file")]:
            results.append(row)
    summary = sweep(GRID, path, workers=1)
    assert summary.planned == 0 and summary.status_counts.get("infeasible") == 1
    rows = read_results(path)
    assert len(rows) == len(reference) == len(path.read_text().splitlines()) - 1
    assert rows[0]["status"] == "infeasible"


def test_progress_goes_to_a_log_as_lines_and_a_resumed_run_says_so(tmp_path, capsys):
    # Where stderr is not a terminal (a batch job's log) the bar shows nothing; each point planned
    # is a line there instead, and a run that resumes a results file says how much was done.
    out = tmp_path / "results.csv"
    first = sweep({**GRID, "devices": ["a100-80g"]}, out, workers=1, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("]")[0] for line in lines if line.startswith("[")] == [f"[{k}/{first.points}" for k in range(1, first.points + 1)]
    again = sweep(GRID, out, workers=1, progress=True)
    err = capsys.readouterr().err
    assert f"resuming {out}: {first.points} of {again.points} points planned before" in err
