"""`paraplan profile`: measurements become a cluster profile whose op tables drive the cost model."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

import cli
import planner
from costmodel import profile as profile_module
from costmodel.compute import OpWork, WorkKind, op_time_s
from costmodel.errors import ProfileError
from costmodel.hardware import _priced_fields
from costmodel.op_table import OpTable
from costmodel.profile import Measurements, run_profile, write_profile
from costmodel.profile_files import list_devices, profile_kind
from costmodel.profile_loader import load_cluster, load_device
from costmodel.profile_collectives import _coefficients, collective_factors, fit_link
from planner.estimate import Evaluator
from planner.graph import Recompute

TINY_GPT = "arch: gpt\nlayers: 2\nhidden: 64\nheads: 4\nvocab: 256\nmax_seq_len: 64\ntie_embeddings: false\n"


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "tiny.yaml"
    path.write_text(TINY_GPT)
    return path


def _measurements(matmul_scale: float = 1.0, link=None, world: int = 1) -> Measurements:
    """A synthetic measurement: GEMMs at 50 GFLOP/s (fp32) and 25 GFLOP/s (bf16), times `matmul_scale`."""
    sizes = [2.0 * n ** 3 for n in (64, 256, 1024)]
    return Measurements(
        device_type="cpu", device_name="test-cpu", world_size=world, mem_bytes=8e9,
        matmul_times_s={"fp32": [(f, matmul_scale * f / 50e9) for f in sizes],
                        "bf16": [(f, matmul_scale * f / 25e9) for f in sizes]},
        stream_bytes_per_s=20e9,
        elementwise_bytes_per_s={"fp32": {"add": 10e9, "gelu": 5e9, "layer_norm": 4e9, "gelu_tanh": 1e9,
                                          "gelu_tanh:bwd": 2e9},
                                 "bf16": {"add": 1e9, "gelu": 1e9, "layer_norm": 1e9}},
        attention_times_s={"fp32": [(1e8, 2e-3, 5e-3), (1e9, 1e-2, 3e-2)]},
        loss_bytes_per_s=2e9,
        tp_linear_host_s=(1e-4, 3e-4),
        sync_wait_fraction=0.05,
        link=link,
    )


def test_fit_link_recovers_the_link_the_samples_come_from():
    # Samples generated from the cost model's ring formulas with bw 2 GB/s and latency 30 us.
    bw, latency, world = 2e9, 30e-6, 4
    samples = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        for size in (4**6, 4**9, 4**12):
            per_byte, steps = _coefficients(op, world, size)
            samples.append({"op": op, "bytes": size, "seconds": per_byte / bw + steps * latency})
    fitted_bw, fitted_latency = fit_link(samples, world)
    assert fitted_bw == pytest.approx(bw, rel=1e-9)
    assert fitted_latency == pytest.approx(latency, rel=1e-9)


def test_collective_factors_recover_each_collectives_own_slowdown():
    # Samples from the ring formulas on a 2 GB/s, 30 us link, with all-gather 3x and reduce-scatter
    # 5x slower than the formula (as gloo's are); the joint fit lands between them, and each factor
    # times the fitted formula gives back the measured times at the bandwidth-bound sizes.
    bw, latency, world = 2e9, 30e-6, 2
    slowdown = {"all_reduce": 1.0, "all_gather": 3.0, "reduce_scatter": 5.0, "p2p": 1.0}
    samples = []
    for op, factor in slowdown.items():
        for size in (4**6, 4**9, 4**11, 4**12):
            per_byte, steps = _coefficients(op, world, size)
            samples.append({"op": op, "bytes": size, "seconds": factor * (per_byte / bw + steps * latency)})
    link = fit_link(samples, world)
    factors = collective_factors(samples, world, link)
    assert factors["reduce_scatter"] > factors["all_gather"] > factors["all_reduce"]
    for sample in samples:
        per_byte, steps = _coefficients(sample["op"], world, sample["bytes"])
        if sample["bytes"] >= 4**11:
            predicted = factors[sample["op"]] * (per_byte / link[0] + steps * link[1])
            assert predicted == pytest.approx(sample["seconds"], rel=0.05)


def test_written_profile_loads_with_measured_fields(tmp_path):
    out = tmp_path / "box.yaml"
    measured = _measurements(link=(3e9, 40e-6), world=2)
    measured.link_factors = {"all_reduce": 1.5, "all_gather": 3.0}
    written = write_profile(out, measured, load_device("cpu"))
    assert [p.name for p in written] == ["box.yaml", "box-device.yaml", "box-ops-fp32.json", "box-ops-bf16.json"]
    cluster = load_cluster(str(out))
    device = cluster.groups[0].node.device
    assert cluster.num_devices == 2 and device.name == "box-device"
    # Peaks are the best measured throughput; fp32 is the faster dtype, so it anchors the curve at 1.0.
    assert device.peak_flops_per_s == {"fp32": pytest.approx(50e9), "bf16": pytest.approx(25e9)}
    assert [fraction for _, fraction in device.matmul_efficiency] == pytest.approx([1.0, 1.0, 1.0])
    # Elementwise efficiency: median of the fp32 add, GELU and LayerNorm rates (10, 5 and 4 GB/s) over
    # the 20 GB/s copy; the slower tanh GELU is priced by its own rate, not by the median.
    assert device.mem_bw_bytes_per_s == 20e9 and device.mem_bw_efficiency == pytest.approx(5e9 / 20e9)
    assert (device.intra_link.bw_bytes_per_s, device.intra_link.latency_s) == (3e9, 40e-6)
    assert [device.intra_link.time_factor(op) for op in ("all_reduce", "all_gather", "p2p")] == [1.5, 3.0, 1.0]
    base_nic = load_device("cpu").nic
    assert (device.nic.kind, device.nic.bw_bytes_per_s, device.nic.latency_s) == (base_nic.kind, base_nic.bw_bytes_per_s,
                                                                                base_nic.latency_s)
    table = OpTable.from_dict(json.loads(Path(device.op_tables["fp32"]).read_text()))
    assert table.device == "box-device" and table.elementwise_bytes_per_s["gelu_tanh:bwd"] == 2e9
    assert table.attention_times_s == ((1e8, 2e-3, 5e-3), (1e9, 1e-2, 3e-2)) and table.loss_bytes_per_s == 2e9
    assert table.tp_linear_host_s == (1e-4, 3e-4) and table.sync_wait_fraction == 0.05


def test_measured_op_table_overrides_the_roofline(tmp_path):
    write_profile(tmp_path / "box.yaml", _measurements(), load_device("cpu"))
    device = load_device(str(tmp_path / "box-device.yaml"))
    table = OpTable.from_dict(json.loads(Path(device.op_tables["fp32"]).read_text()))
    flops = 2.0 * 256 ** 3
    gemm = OpWork(WorkKind.MATMUL, flops, 0.0)
    # At a measured size the table's time is returned exactly: flops / 50 GFLOP/s, no launch overhead.
    assert op_time_s(gemm, device, "fp32", table) == pytest.approx(flops / 50e9, rel=1e-12)
    assert op_time_s(gemm, device, "fp32") != pytest.approx(flops / 50e9, rel=1e-3)
    memory = OpWork(WorkKind.MEMORY, 0.0, 1e6)  # the table has no memory-bound entry: roofline
    assert op_time_s(memory, device, "fp32", table) == op_time_s(memory, device, "fp32")
    # Attention at a measured size: its forward and backward times (the backward's work is 2.5 times
    # the forward's); between the two measured sizes (1e8 FLOPs at 50 GFLOP/s, 1e9 at 100 GFLOP/s)
    # the rate is a power law of FLOPs: at the log midpoint, the geometric mean of the two rates.
    assert op_time_s(OpWork(WorkKind.ATTENTION, 1e8, 0.0), device, "fp32", table) == pytest.approx(2e-3)
    assert op_time_s(OpWork(WorkKind.ATTENTION_BWD, 2.5e8, 0.0), device, "fp32", table) == pytest.approx(5e-3)
    # The table timed the machine's attention kernel: the works of named flash kernels are priced by it too.
    for fwd, bwd in ((WorkKind.FLASH2_ATTENTION, WorkKind.FLASH2_ATTENTION_BWD),
                     (WorkKind.FLASH1_ATTENTION, WorkKind.FLASH1_ATTENTION_BWD)):
        assert op_time_s(OpWork(fwd, 1e8, 0.0), device, "fp32", table) == pytest.approx(2e-3)
        assert op_time_s(OpWork(bwd, 2.5e8, 0.0), device, "fp32", table) == pytest.approx(5e-3)
    middle = 10 ** 8.5
    assert op_time_s(OpWork(WorkKind.ATTENTION, middle, 0.0), device, "fp32", table) == pytest.approx(middle / (50e9 * 100e9) ** 0.5)
    # Eight heads of the smaller measured size run at that size's rate, not at the rate of their total.
    heads = OpWork(WorkKind.ATTENTION, 8e8, 0.0, unit_flops=1e8)
    assert op_time_s(heads, device, "fp32", table) == pytest.approx(8 * 2e-3)
    # Elementwise ops with a measured rate are priced by it, forward and backward; others by the roofline.
    assert op_time_s(OpWork(WorkKind.MEMORY, 0.0, 1e6, "gelu_tanh"), device, "fp32", table) == pytest.approx(1e6 / 1e9)
    assert op_time_s(OpWork(WorkKind.MEMORY, 0.0, 1e6, "gelu_tanh:bwd"), device, "fp32", table) == pytest.approx(1e6 / 2e9)
    assert op_time_s(OpWork(WorkKind.MEMORY, 0.0, 1e6, "neg"), device, "fp32", table) == op_time_s(memory, device, "fp32")
    # A loss at the measured 2 GB/s; without a table, at the roofline's memory bandwidth.
    loss = OpWork(WorkKind.LOSS, 0.0, 1e6)
    assert op_time_s(loss, device, "fp32", table) == pytest.approx(1e6 / 2e9)
    assert op_time_s(loss, device, "fp32") == op_time_s(memory, device, "fp32")


def test_profile_op_tables_drive_the_evaluator(tmp_path, spec):
    """Matmul time scales with the table: step time is linear in a uniform scale of every GEMM time."""
    graph = planner.trace(str(spec), seq_len=64, dtype="fp32")
    steps = []
    for scale in (1.0, 2.0, 3.0):
        out = tmp_path / f"box{int(scale)}.yaml"
        write_profile(out, _measurements(scale), load_device("cpu"))
        evaluator = Evaluator(graph, load_cluster(str(out)), "fp32")
        device = load_cluster(str(out)).groups[0].node.device
        assert evaluator.table_for(device, "fp32").matmul_times_s[0][1] == pytest.approx(scale * 2 * 64**3 / 50e9)
        steps.append(evaluator.estimate(planner.make_config({"tp": 1, "pp": 1}, 1, 4), 4).time_breakdown["compute_s"])
    assert steps[1] - steps[0] == pytest.approx(steps[2] - steps[1], rel=1e-9)
    assert steps[1] > steps[0]


@pytest.mark.parametrize("comm_overlaps_compute", [False, True])
def test_tensor_parallel_host_work_is_priced_per_dtensor_op(tmp_path, spec, comm_overlaps_compute):
    """A block of the tiny GPT runs 6 linears (q, k, v, o, fc1, fc2) and, under sequence parallelism,
    2 norms on DTensors at tp = 2: on CPU ranks each adds the table's 0.1 ms forward and 0.3 ms
    backward to the block's compute; a GPU's host dispatches beside its compute, so only a host
    slower than the device shows: at 1 us and 3 us per op the block's time is its compute's, at
    1000 times the table's it is the host's."""
    graph = planner.trace(str(spec), seq_len=64, dtype="fp32")
    block = next(i for i, layer in enumerate(graph.layers) if layer.name == "layers.0")
    config = planner.make_config({"tp": 2, "pp": 1}, 2, 4)
    priced = {}
    for scale in (0.0, 0.01, 1.0, 1000.0):
        out = tmp_path / f"box{scale:g}.yaml"
        measured = _measurements(world=2, link=(3e9, 40e-6))
        measured.tp_linear_host_s = (scale * 1e-4, scale * 3e-4)
        write_profile(out, measured, load_device("cpu"))
        cluster = load_cluster(str(out))
        node = cluster.groups[0].node
        device = dataclasses.replace(node.device, comm_overlaps_compute=comm_overlaps_compute)
        node = dataclasses.replace(node, device=device)
        evaluator = Evaluator(graph, cluster, "fp32")
        evaluator.table_for = lambda _device, dtype, table=evaluator.table_for(node.device, "fp32"): table
        cost = evaluator.layer_cost(block, config, device, node, Recompute.NONE)
        priced[scale] = (cost.fwd_s, cost.bwd_s)
    dtensor_ops = 6 + 2
    if comm_overlaps_compute:
        assert priced[0.01] == priced[0.0]
        assert priced[1000.0] == pytest.approx((dtensor_ops * 0.1, dtensor_ops * 0.3))
    else:
        assert priced[1.0][0] - priced[0.0][0] == pytest.approx(dtensor_ops * 1e-4)
        assert priced[1.0][1] - priced[0.0][1] == pytest.approx(dtensor_ops * 3e-4)


@pytest.mark.parametrize(("degrees", "part"), [({"tp": 2}, "tp_comm_s"), ({"cp": 2}, "cp_comm_s"), ({"dp": 2}, None)])
def test_ranks_wait_the_measured_fraction_of_the_compute_their_collectives_split(tmp_path, spec, degrees, part):
    """Under tensor or context parallelism every op of a block of the tiny GPT lies between two of the
    block's blocking collectives, so its ranks wait `sync_wait_fraction` of the block's forward and
    backward compute: that much more exposed communication of that kind, whether or not the device
    overlaps communication (waiting is not host work), and no more compute. Data parallelism puts no
    collective inside a block: nothing changes."""
    graph = planner.trace(str(spec), seq_len=64, dtype="fp32")
    block = next(i for i, layer in enumerate(graph.layers) if layer.name == "layers.0")
    config = planner.make_config({"tp": 1, "pp": 1, "micro_batch": 1, **degrees}, 2, 4)
    for comm_overlaps_compute in (False, True):
        costs = {}
        for fraction in (0.0, 0.25):
            out = tmp_path / f"wait{fraction:g}{comm_overlaps_compute}.yaml"
            measured = _measurements(world=2, link=(3e9, 40e-6))
            measured.sync_wait_fraction = fraction
            write_profile(out, measured, load_device("cpu"))
            cluster = load_cluster(str(out))
            node = cluster.groups[0].node
            device = dataclasses.replace(node.device, comm_overlaps_compute=comm_overlaps_compute)
            evaluator = Evaluator(graph, cluster, "fp32")
            evaluator.table_for = lambda _device, dtype, table=evaluator.table_for(node.device, "fp32"): table
            costs[fraction] = evaluator.layer_cost(block, config, device, dataclasses.replace(node, device=device),
                                                   Recompute.NONE)
        base, waited = costs[0.0], costs[0.25]
        assert (waited.fwd_s, waited.bwd_s) == (base.fwd_s, base.bwd_s)
        expected = 0.25 * (base.fwd_s + base.bwd_s) if part else 0.0
        assert waited.total_s - base.total_s == pytest.approx(expected)
        if part:
            assert getattr(waited, part) - getattr(base, part) == pytest.approx(expected)


def test_a_profile_takes_only_the_base_devices_links_not_its_peaks(tmp_path):
    # --like h100-sxm: the NIC comes from the base, but a dtype the run did not measure (fp16, fp8)
    # gets no peak, so planning in it is refused rather than priced at an H100's rate.
    write_profile(tmp_path / "box.yaml", _measurements(), load_device("h100-sxm"))
    device = load_cluster(str(tmp_path / "box.yaml")).groups[0].node.device
    assert set(device.peak_flops_per_s) == {"fp32", "bf16"}
    assert device.nic.bw_bytes_per_s == load_device("h100-sxm").nic.bw_bytes_per_s


def test_a_damaged_op_table_fails_in_one_line_naming_it(tmp_path):
    write_profile(tmp_path / "box.yaml", _measurements(), load_device("cpu"))
    table = tmp_path / "box-ops-bf16.json"
    table.write_text(table.read_text()[:300])
    with pytest.raises(ProfileError, match=r"box-ops-bf16.json: not a readable op table .*re-run `paraplan profile`$"):
        load_cluster(str(tmp_path / "box.yaml"))
    good = json.loads((tmp_path / "box-ops-fp32.json").read_text())
    for broken in ({"loss_bytes_per_s": -1.0}, {"loss_bytes_per_s": float("inf")},
                   {"matmul_times_s": [{"flops": 1e9, "time_s": float("nan")}]},
                   {"matmul_times_s": [{"flops": 10**400, "time_s": 1.0}]},
                   # finite sizes and times whose rate is not: 1e9 FLOPs in 1e-320 s; a 1e-300 B/s add
                   {"matmul_times_s": [{"flops": 1e9, "time_s": 1e-320}]},
                   {"elementwise_bytes_per_s": {"add": 1e-300}}):
        table.write_text(json.dumps({**good, "dtype": "bf16", **broken}))
        with pytest.raises(ProfileError, match=r"box-ops-bf16.json: not a readable op table \(.*\); re-run"):
            load_cluster(str(tmp_path / "box.yaml"))
    table.write_text("[" * 100000 + "]" * 100000)  # too deep for the JSON parser
    with pytest.raises(ProfileError, match=r"box-ops-bf16.json: not a readable op table"):
        load_cluster(str(tmp_path / "box.yaml"))
    table.write_text(json.dumps(good))  # the fp32 table named as the bf16 one
    with pytest.raises(ProfileError, match=r"op_tables.bf16: .*box-ops-bf16.json' holds the table of box-device/fp32, not "
                                           r"box-device/bf16"):
        load_cluster(str(tmp_path / "box.yaml"))


def test_a_profile_that_cannot_be_written_leaves_no_file(tmp_path):
    # One op table's path is a folder: nothing is written (every file goes to a temporary name first,
    # renamed into place only once all are written), so an older profile there is never mixed with a
    # new one.
    (tmp_path / "box-ops-bf16.json").mkdir()
    with pytest.raises(ProfileError, match="box-ops-bf16.json: is a folder"):
        write_profile(tmp_path / "box.yaml", _measurements(), load_device("cpu"))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["box-ops-bf16.json"]


def test_a_bad_output_path_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(profile_module, "measure", lambda **_: pytest.fail("measured before checking --out"))
    (tmp_path / "a-file").write_text("")
    (tmp_path / "box-device.yaml").mkdir()
    for out, message in ((tmp_path / "a-file" / "x.yaml", "is not a writable folder"),
                         (tmp_path / "box.yaml", "box-device.yaml is a folder")):
        assert cli.main(["profile", "--out", str(out), "--quick"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err


def test_op_tables_on_the_profiles_path_are_not_devices(tmp_path, monkeypatch):
    # A profiled device copied onto the profiles path with its op tables beside it (where it names them).
    written = write_profile(tmp_path / "box.yaml", _measurements(), load_device("cpu"))
    (tmp_path / "roots" / "devices").mkdir(parents=True)
    for path in written[1:]:
        shutil.copy(path, tmp_path / "roots" / "devices" / path.name)
    monkeypatch.setenv("PARAPLAN_PROFILES_PATH", str(tmp_path / "roots"))
    assert "box-device" in list_devices() and not [name for name in list_devices() if "-ops-" in name]
    assert set(load_device("box-device").op_tables) == {"fp32", "bf16"}


def test_the_cluster_fingerprint_follows_the_op_tables_contents_and_omits_default_fields(tmp_path):
    # A sweep resumes into a row only while its hardware's fingerprint holds: a re-measured op table
    # (the device file unchanged) prices differently, so it must change it. Fields at their defaults
    # are left out, so a field added to the schema later keeps existing results resumable.
    written = write_profile(tmp_path / "box.yaml", _measurements(), load_device("cpu"))
    cluster = load_cluster(str(tmp_path / "box.yaml"))
    before = cluster.fingerprint
    table = next(path for path in written if "-ops-" in path.name)
    data = json.loads(table.read_text())
    data["loss_bytes_per_s"] *= 2
    table.write_text(json.dumps(data))
    assert dataclasses.replace(cluster).fingerprint != before
    assert "flash2_attention_ratio" not in repr(_priced_fields(load_device("a100-80g")))
    assert "flash2_attention_ratio" in repr(_priced_fields(load_device("h100-sxm")))


def test_a_model_spec_given_as_hardware_is_called_what_it_is(tmp_path):
    (tmp_path / "tiny.yaml").write_text("arch: gpt\nlayers: 2\nhidden: 64\nheads: 4\nvocab: 9\n")
    for load in (load_cluster, load_device):
        with pytest.raises(ProfileError, match=r"tiny.yaml: a model spec \(it has `arch` and `layers`\), not a hardware "
                                               r"profile; fix: pass it as --model"):
            load(str(tmp_path / "tiny.yaml"))


def test_a_device_file_with_a_wrong_key_is_read_as_a_device(tmp_path):
    (tmp_path / "typo.yaml").write_text("name: typo\npeak_flop_per_s: {bf16: 1.0e+12}\nmem_bytes: 1.0e+9\n")
    with pytest.raises(ProfileError, match=r"typo.yaml: peak_flop_per_s: unknown key.*peak_flops_per_s"):
        load_device(str(tmp_path / "typo.yaml"))
    assert profile_kind({"mem_bytes": 1e9}) == "device" and profile_kind({"latency_s": 1e-6}) == "link"


def test_quick_profile_changes_predictions(tmp_path, spec):
    written = run_profile(tmp_path / "here.yaml", quick=True, show_progress=False)
    assert all(path.exists() for path in written)
    sources = yaml.safe_load((tmp_path / "here-device.yaml").read_text())["sources"]
    assert "paraplan profile --quick" in sources["mem_bw_bytes_per_s"]  # marked as a smoke check
    # A DTensor linear costs the host more than a plain one, forward and backward.
    table = OpTable.from_dict(json.loads((tmp_path / "here-ops-fp32.json").read_text()))
    assert all(t > 0 for t in table.tp_linear_host_s) and len(table.tp_linear_host_s) == 2
    config = {"tp": 1, "pp": 1}
    measured = planner.evaluate(str(spec), str(tmp_path / "here.yaml"), config, global_batch=4, seq_len=64, dtype="fp32")
    placeholder = planner.evaluate(str(spec), "cpu:1x1", config, global_batch=4, seq_len=64, dtype="fp32")
    assert measured.step_time_s != pytest.approx(placeholder.step_time_s, rel=1e-3)


def _profile_rank(rank: int, world: int, store_path: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    # A file store needs no port, which another test's gloo connections could take first.
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    run_profile(out, quick=True, show_progress=False)
    dist.barrier()
    dist.destroy_process_group()


def test_profile_under_two_ranks_measures_the_link(tmp_path):
    mp.spawn(_profile_rank, args=(2, str(tmp_path / "store"), str(tmp_path / "pair.yaml")), nprocs=2)
    device = yaml.safe_load((tmp_path / "pair-device.yaml").read_text())
    assert device["node"]["devices_per_node"] == 2
    assert "fit of all-reduce" in device["node"]["intra_link"]["sources"]["bw_bytes_per_s"]
    assert load_cluster(str(tmp_path / "pair.yaml")).num_devices == 2
    # The pair also timed how long its ranks wait for each other at tensor-parallel collectives.
    table = json.loads((tmp_path / "pair-ops-fp32.json").read_text())
    assert table["sync_wait_fraction"] >= 0


def test_cli_rejects_a_non_yaml_output(tmp_path, capsys):
    assert cli.main(["profile", "--out", str(tmp_path / "x.json"), "--quick"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_gpu_validation_dry_run_on_cpu():
    # The GPU script's whole flow (profile, plan none/full recompute, apply, train, measure) at CPU scale.
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "benchmarks/gpu_validate.py", "--dry-run"], cwd=root, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["none"], ["full"])]
    assert [row[0] for row in rows] == ["none", "full"]
    predicted_gib = {row[0]: float(row[4]) for row in rows}
    assert predicted_gib["full"] < predicted_gib["none"]  # recompute keeps fewer activations
    assert all(float(row[5]) > 0 and float(row[2]) > 0 for row in rows)
