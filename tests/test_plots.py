"""Charts: the pipeline timeline and memory chart of a plan, the sweep charts, the sweep report.

Images are read back: size, non-blank, and the colours of the bars they should show. The
timeline's bars are checked against the schedule simulation's events one by one.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

import cli
import planner
from costmodel import pipeline_sim
from costmodel.pipeline_sim import EventKind
from planner.errors import PlannerError
from planner.report.figures import COLOURS
from planner.report.memory_chart import SEGMENTS, memory_figure
from planner.report.sweep_charts import cost_figure, mfu_figure, save_sweep_charts, throughput_figure
from planner.report.sweep_report import write_sweep_report
from planner.report.timeline import EVENT_STYLE, save_timeline, simulate_plan, timeline_figure
from planner.report.units import GIB
from planner.sweeps.results import COLUMNS, ResultsFile

TINY = "tests.fixtures.custom_models:tiny_gpt_factory"
KIND_NAMES = {style: kind for kind, (style, _) in EVENT_STYLE.items()}


@pytest.fixture(scope="module")
def pipelined_plan():
    """The 4-layer GPT on 8 A100s, pipelined 4 ways under zero bubble (F, B and W events, transfers)."""
    plan = planner.plan(TINY, "a100-80g:1x8", global_batch=32, seq_len=128, pp=4, schedule="zb", micro_batch=2)
    assert plan.config.pp == 4 and plan.config.num_microbatches > 1
    return plan


def bars(axes) -> dict[str, list[tuple[float, float, float, float]]]:
    """(x, width, y, height) of every bar of each broken_barh collection, by the collection's gid."""
    out = {}
    for collection in axes.collections:
        rects = []
        for path in collection.get_paths():
            (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            rects.append((x0, x1 - x0, y0, y1 - y0))
        out[collection.get_gid()] = sorted(rects)
    return out


def image(path) -> np.ndarray:
    pixels = imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] >= 400 and pixels.shape[1] >= 800
    return pixels[..., :3]


def has_colour(pixels: np.ndarray, colour: str, at_least: int = 50) -> bool:
    """Whether at least `at_least` pixels have `colour` (within PNG rounding)."""
    return int((np.abs(pixels - np.array(to_rgb(colour))).max(axis=-1) < 2 / 255).sum()) >= at_least


def test_timeline_bars_are_the_simulated_events(pipelined_plan):
    plan, schedule = pipelined_plan, simulate_plan(pipelined_plan)
    figure = timeline_figure(plan)
    drawn = bars(figure.axes[0])
    scale = 1e3 if schedule.step_time_s < 1 else 1.0
    for device in range(plan.config.pp):
        for style, kind in KIND_NAMES.items():
            events = [e for e in schedule.events if e.device == device and e.kind == kind]
            expected = sorted((e.start_s * scale, (e.end_s - e.start_s) * scale) for e in events)
            got = [(x, w) for x, w, _, _ in drawn.get(f"{style}:{device}", [])]
            assert len(got) == len(expected) == plan.config.num_microbatches, (style, device)
            assert np.allclose(got, expected, rtol=1e-9, atol=1e-12), (style, device)
    assert {e.kind for e in schedule.events} == {EventKind.FORWARD, EventKind.BACKWARD, EventKind.WEIGHT}
    # The optimizer runs on every stage once the pipeline drains and the exposed gradient sync (here
    # the sum of the tied embedding's and head's gradients) ends, for the estimate's optimizer time.
    optimizer_s = plan.estimate.time_breakdown["optimizer_s"]
    optimizer_start_s = schedule.step_time_s + plan.estimate.time_breakdown["dp_comm_exposed_s"]
    for device in range(plan.config.pp):
        (x, width, _, _), = drawn[f"optimizer:{device}"]
        assert (x, width) == pytest.approx((optimizer_start_s * scale, optimizer_s * scale))
    # Each micro-batch crosses each of the pp-1 stage boundaries once forward and once backward.
    sends = sum(len(rects) for gid, rects in drawn.items() if gid.startswith("p2p:"))
    assert sends == 2 * (plan.config.pp - 1) * plan.config.num_microbatches


def test_timeline_transfer_times_reproduce_the_estimate(pipelined_plan):
    plan = pipelined_plan
    hops_s = plan.estimate.pipeline_p2p_s
    assert len(hops_s) == plan.config.pp and min(hops_s[:-1]) > 0
    # The estimate's pipeline time, recomputed with the transfer times it carries, gives the estimate.
    config, breakdown = plan.config, plan.estimate.time_breakdown
    pipe_s = pipeline_sim.priced_step_s(str(config.schedule), [s.fwd_s for s in plan.stages], [s.bwd_s for s in plan.stages],
                                        config.num_microbatches, config.vpp, hops_s)
    assert pipe_s + breakdown["dp_comm_exposed_s"] + breakdown["optimizer_s"] == pytest.approx(plan.estimate.step_time_s)
    # The timeline's simulation agrees with the estimate (or its closed form, within its tolerance).
    assert simulate_plan(plan).step_time_s == pytest.approx(pipe_s, rel=0.025)


def test_timeline_png_and_svg_are_readable(pipelined_plan, tmp_path):
    pixels = image(save_timeline(pipelined_plan, tmp_path / "timeline.png"))
    assert (pixels < 0.95).any(axis=-1).mean() > 0.05  # not blank: over 5% of the pixels are drawn on
    for colour in ("forward", "backward", "weight_grad", "optimizer"):
        assert has_colour(pixels, COLOURS[colour]), colour
    svg = save_timeline(pipelined_plan, tmp_path / "timeline.svg").read_text()
    assert "<svg" in svg and "Pipeline timeline of one training step" in svg
    with pytest.raises(PlannerError, match=r"^--timeline t.jpg: unknown image extension '.jpg'; use .png or .svg$"):
        save_timeline(pipelined_plan, "t.jpg")


def test_memory_chart_stacks_the_breakdown_under_the_capacity(pipelined_plan, tmp_path):
    estimate = pipelined_plan.estimate
    figure = memory_figure(estimate, "test")
    axes = figure.axes[0]
    by_gid = {patch.get_gid(): patch for patch in axes.patches if patch.get_gid()}
    for row in estimate.memory:
        stack = [by_gid[f"{key}:{row['stage']}"] for key, _, _ in SEGMENTS]
        assert sum(p.get_height() for p in stack) == pytest.approx(row["total_bytes"] / GIB)
        assert stack[0].get_height() == pytest.approx(row["weights_bytes"] / GIB)
        assert all(a.get_y() + a.get_height() == pytest.approx(b.get_y()) for a, b in zip(stack, stack[1:]))
    capacity = {c.get_gid(): c for c in axes.collections}
    for row in estimate.memory:
        (segment,) = capacity[f"capacity:{row['stage']}"].get_segments()
        assert segment[0][1] == pytest.approx(row["capacity_bytes"] / GIB)
    assert axes.get_ylabel() == "memory per device (GiB)"


def test_plan_command_writes_both_charts(tmp_path, capsys):
    path = tmp_path / "memory.png"
    code = cli.main(["plan", "--model", TINY, "--seq-len", "128", "--cluster", "a100-80g:1x8", "--global-batch", "32",
                     "--pp", "4", "--schedule", "zb", "--micro-batch", "2", "--memory-chart", str(path),
                     "--timeline", str(tmp_path / "t.svg"), "--json"])
    assert code == 0, capsys.readouterr().err
    assert "<svg" in (tmp_path / "t.svg").read_text()
    pixels = image(path)
    for key in ("weights", "optimizer_states", "activations", "capacity"):
        assert has_colour(pixels, COLOURS[key], at_least=20), key


def test_plan_rejects_a_chart_extension_before_planning(capsys):
    code = cli.main(["plan", "--model", "gpt3-125m", "--cluster", "a100-80g:1x8", "--global-batch", "32",
                     "--timeline", "t.pdf"])
    assert code == 2
    assert capsys.readouterr().err == "paraplan: --timeline t.pdf: unknown image extension '.pdf'; use .png or .svg\n"


def sweep_rows() -> list[dict]:
    """Two devices x two sizes for one workload; one point without a plan."""
    def row(device, devices, tokens_per_s, mfu, usd, status="ok"):
        values = dict.fromkeys(COLUMNS)
        values.update(model="m", cluster=f"{device}:{devices}", global_batch=64, seq_len=1024, settings="dtype=bf16 tp=8",
                      device=device, devices=devices, nodes=devices // 8, status=status,
                      cluster_usd_per_hour=None if usd is None else 1.0)
        if status == "ok":
            values.update(tokens_per_s=tokens_per_s, mfu=mfu, usd_per_million_tokens=usd, config="dp8 tp1 pp1",
                          step_time_s=1.0, peak_memory_bytes=2**30)
        else:
            values["reason"] = "no plan fits: try more devices"
        return values

    return [row("a", 8, 1000.0, 0.5, 0.2), row("a", 16, 1900.0, 0.45, 0.25),
            {**row("b", 8, 3000.0, 0.6, None), "notes": "b has no bf16: priced in fp16"},
            row("b", 16, None, None, None, status="infeasible")]


def test_sweep_charts_draw_each_device_against_cluster_size(tmp_path):
    rows = sweep_rows()
    lines = {line.get_label(): line for line in throughput_figure(rows).axes[0].get_lines()}
    assert list(lines["a"].get_xdata()) == [8, 16] and list(lines["a"].get_ydata()) == [1000.0, 1900.0]
    assert list(lines["b"].get_xdata()) == [8] and list(lines["b"].get_ydata()) == [3000.0]  # the infeasible point is not drawn
    mfu = {line.get_label(): list(line.get_ydata()) for line in mfu_figure(rows).axes[0].get_lines()}
    assert mfu == {"a": [0.5, 0.45], "b": [0.6]}
    cost = cost_figure(rows)
    assert sorted(p.get_height() for p in cost.axes[0].patches) == [0.2, 0.25]  # device b has no price
    assert "no price in the profile: b" in cost.get_supxlabel()
    paths = save_sweep_charts(rows, tmp_path)
    assert [p.name for p in paths] == ["throughput.png", "mfu.png", "cost.png"]
    for path in paths:
        assert (image(path) < 0.95).any(axis=-1).mean() > 0.02


def test_a_workload_without_any_plan_gets_a_panel_saying_so():
    # A second model whose one point has no plan: its panel has no line and no y scale to read, but
    # says why; the first model's panel is unchanged.
    rows = [*sweep_rows(), {**sweep_rows()[-1], "model": "huge"}]
    for figure in (throughput_figure(rows), mfu_figure(rows)):
        ours, huge = figure.axes[:2]
        assert ours.get_lines() and not ours.texts
        assert not huge.get_lines() and list(huge.get_yticks()) == []
        assert [text.get_text() for text in huge.texts] == ["no plan on any cluster\n(see the results' reasons)"]


@pytest.mark.parametrize("suffix", [".html", ".md"])
def test_report_bundles_tables_and_charts(tmp_path, suffix, capsys):
    results = tmp_path / "results.csv"
    with ResultsFile.open(results) as out:
        for row in sweep_rows():
            out.append(row)
    report = tmp_path / f"report{suffix}"
    assert cli.main(["report", str(results), "--out", str(report)]) == 0
    text = report.read_text()
    assert "no plan fits: try more devices" in text and "3,000" in text and "$0.200" in text
    assert "b has no bf16: priced in fp16" in text  # the row's notes
    assert "4 points: 3 ok, 1 infeasible. Planned with dtype=bf16 tp=8." in text  # the sweep's settings
    if suffix == ".html":
        assert len(re.findall(r"<img alt='[^']+' src='data:image/png;base64,", text)) == 3
    else:
        assert [p.name for p in sorted(tmp_path.glob("report_*.png"))] == ["report_cost.png", "report_mfu.png", "report_throughput.png"]
        assert "| m | a:16 | 64 | 1024 | ok | dp8 tp1 pp1 | 1,900 | 45.0% |" in text
    with pytest.raises(PlannerError, match="unknown report extension '.pdf'"):
        write_sweep_report(results, tmp_path / "report.pdf")


def test_report_of_one_point_says_point(tmp_path):
    results = tmp_path / "results.csv"
    with ResultsFile.open(results) as out:
        out.append(sweep_rows()[0])
    assert "1 point: 1 ok." in write_sweep_report(results, tmp_path / "report.md").read_text()
