"""Hardware profiles: every shipped file loads, shorthands parse, bad input fails with one-line errors."""
from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from costmodel.errors import ProfileError
from costmodel.hardware import INTER_NODE_KINDS, INTRA_NODE_KINDS, Cluster
from costmodel.profile_files import PROFILES_DIR, PROFILES_PATH_ENV, list_clusters, list_devices, list_links
from costmodel.profile_loader import MATMUL_HALF_EFFICIENCY_TIME_S, load_cluster, load_device
from planner.report.hardware import render_hardware, render_hardware_list

MIB = 2**20
REQUIRED_DEVICES = {"v100-32g", "a100-40g", "a100-80g", "h100-sxm", "h100-pcie", "h800", "h200", "b200", "gb200",
                    "mi250x", "mi300x", "l4", "l40s", "a10g", "rtx-4090", "cpu"}
DEVICE_NUMBER_KEYS = {"peak_flops_per_s", "mem_bytes", "mem_bw_bytes_per_s", "matmul_efficiency",
                      "mem_bw_efficiency", "flash2_attention_ratio", "node", "nic", "price_per_hour", "power_w"}
LINK_NUMBER_KEYS = {"bw_bytes_per_s", "latency_s", "efficiency"}

# A valid device profile with inline links; the validation cases below break one field each.
BASE_DEVICE = {
    "name": "testgpu",
    "peak_flops_per_s": {"bf16": 1.0e12, "fp32": 0.5e12},
    "mem_bytes": 16 * 2**30,
    "mem_bw_bytes_per_s": 1.0e12,
    "matmul_efficiency": {"plateau": 0.5},
    "node": {"devices_per_node": 4,
             "intra_link": {"kind": "nvswitch", "bw_bytes_per_s": 100.0e9, "latency_s": 3.0e-6, "efficiency": 0.8}},
    "nic": {"kind": "ib", "bw_bytes_per_s": 25.0e9, "latency_s": 10.0e-6, "efficiency": 0.9},
}


@pytest.fixture(autouse=True)
def _only_shipped_profiles(monkeypatch):
    monkeypatch.delenv(PROFILES_PATH_ENV, raising=False)


def _write(tmp_path: Path, name: str, data) -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _device_with(tmp_path: Path, **changes) -> Path:
    """BASE_DEVICE written to a file, with `changes` keyed by field path joined by "__"; None deletes."""
    data = yaml.safe_load(yaml.safe_dump(BASE_DEVICE))
    for field_path, value in changes.items():
        *parents, key = field_path.split("__")
        target = data
        for parent in parents:
            target = target[parent]
        if value is None:
            del target[key]
        else:
            target[key] = value
    return _write(tmp_path, "testgpu.yaml", data)


# --- shipped profiles --------------------------------------------------------------------------

def test_required_devices_are_shipped():
    assert REQUIRED_DEVICES <= set(list_devices())


@pytest.mark.parametrize("name", sorted(p.stem for p in (PROFILES_DIR / "devices").glob("*.yaml")))
def test_shipped_device_loads_with_a_source_for_every_number(name):
    raw = yaml.safe_load((PROFILES_DIR / "devices" / f"{name}.yaml").read_text())
    device = load_device(name)
    assert device.name == name
    assert DEVICE_NUMBER_KEYS & raw.keys() <= device.source.keys()
    assert device.intra_link.kind in INTRA_NODE_KINDS and device.nic.kind in INTER_NODE_KINDS
    assert device.description
    flops = [f for f, _ in device.matmul_efficiency]
    assert flops == sorted(flops) and all(0 < e <= 1 for _, e in device.matmul_efficiency)


@pytest.mark.parametrize("path", sorted((PROFILES_DIR / "links").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_link_has_a_source_for_every_number(path):
    raw = yaml.safe_load(path.read_text())
    assert raw["name"] == path.stem
    assert all(isinstance(raw[key], float) for key in LINK_NUMBER_KEYS), "write numbers as 1.0e+9 (YAML 1.1)"
    assert LINK_NUMBER_KEYS <= raw["sources"].keys()


@pytest.mark.parametrize("name", sorted(p.stem for p in (PROFILES_DIR / "clusters").glob("*.yaml")))
def test_shipped_cluster_loads_with_the_file_device_count(name):
    raw = yaml.safe_load((PROFILES_DIR / "clusters" / f"{name}.yaml").read_text())
    cluster = load_cluster(name)
    # Independent count: nodes x the device profile's usual node size, read from the YAML files.
    expected = sum(g["nodes"] * g.get("devices_per_node", yaml.safe_load(
        (PROFILES_DIR / "devices" / f"{g['device']}.yaml").read_text())["node"]["devices_per_node"])
        for g in raw["groups"])
    assert cluster.name == name
    assert cluster.num_devices == expected == len(cluster.devices())
    assert cluster.source.keys() == {"groups", "oversubscription"}


def test_h100_numbers_come_from_the_profile():
    device = load_device("h100-sxm")
    assert device.mem_bytes == 81089 * MIB  # torch total_memory=81089MB, i.e. MiB
    assert device.peak_flops_per_s["bf16"] == 989.4e12
    assert device.intra_link.bw_bytes_per_s == 450e9 and device.nic.bw_bytes_per_s == 50e9
    # Plateau 0.803 (MAMF 794.5 / 989.4); at 1e14 FLOPs the saturation model gives
    # 0.803 * 1e14 / (1e14 + 0.803 * 989.4e12 * 5e-6) = 0.80297.
    last_flops, last = device.matmul_efficiency[-1]
    assert last_flops == 1e14
    assert last == pytest.approx(0.803 * 1e14 / (1e14 + 0.803 * 989.4e12 * 5e-6))


def test_loading_the_same_profile_twice_is_cached():
    assert load_device("a100-80g") is load_device("a100-80g")
    assert load_cluster("dgx-h100-su") is load_cluster("dgx-h100-su")


def test_v100_has_no_bf16_peak():
    assert "bf16" not in load_device("v100-32g").peak_flops_per_s


# --- the efficiency curve ----------------------------------------------------------------------

def test_plateau_form_expands_to_the_saturation_curve(tmp_path):
    device = load_device(_device_with(tmp_path))
    assert MATMUL_HALF_EFFICIENCY_TIME_S == 5e-6
    # plateau 0.5, bf16 peak 1e12: f_half = 0.5 * 1e12 * 5e-6 = 2.5e6 FLOPs, so at 1e7 FLOPs the
    # fraction is 0.5 * 1e7 / (1e7 + 2.5e6) = 0.4, and at 2.5e6 FLOPs it would be half the plateau.
    curve = dict(device.matmul_efficiency)
    assert curve[1e7] == pytest.approx(0.4)
    assert len(curve) == 17 and min(curve) == 1e6 and max(curve) == 1e14


def test_explicit_curve_is_kept(tmp_path):
    device = load_device(_device_with(tmp_path, matmul_efficiency=[[1.0e9, 0.3], [1.0e11, 0.7]]))
    assert device.matmul_efficiency == ((1e9, 0.3), (1e11, 0.7))


def test_numeric_strings_that_yaml_1_1_leaves_unparsed_are_accepted(tmp_path):
    path = _write(tmp_path, "g.yaml", yaml.safe_dump(BASE_DEVICE).replace("1000000000000.0", "1e12"))
    assert yaml.safe_load(path.read_text())["mem_bw_bytes_per_s"] == "1e12"
    assert load_device(path).mem_bw_bytes_per_s == 1e12


# --- clusters ----------------------------------------------------------------------------------

def test_shorthand_nodes_by_gpus():
    cluster = load_cluster("h100-sxm:16x8")
    device = load_device("h100-sxm")
    assert (cluster.name, cluster.num_nodes, cluster.num_devices) == ("h100-sxm:16x8", 16, 128)
    assert cluster.groups[0].node.intra_link is device.intra_link and cluster.groups[0].node.nic is device.nic


def test_shorthand_with_a_non_standard_node_size_keeps_the_device_links():
    node = load_cluster(" H100-SXM:2X4 ").groups[0].node
    assert node.devices_per_node == 4 and node.intra_link.name == "nvlink4-nvswitch"


@pytest.mark.parametrize("spec, nodes, per_node", [("a100-80g:4", 1, 4), ("a100-80g:8", 1, 8),
                                                    ("a100-80g:16", 2, 8), ("gb200:144", 2, 72)])
def test_shorthand_device_count(spec, nodes, per_node):
    cluster = load_cluster(spec)
    assert (cluster.num_nodes, cluster.groups[0].node.devices_per_node) == (nodes, per_node)


@pytest.mark.parametrize("spec, nodes, per_node", [
    # GB200's NVLink domain is the 72-GPU rack across 18 trays: nodes of fewer GPUs share one, up to
    # the most GPUs that whole nodes fill and that divide the cluster (256 = 4 x 64; 80 = 2 x 40).
    ("gb200:32x8", 4, 64), ("gb200:64x4", 4, 64), ("gb200:2x8", 1, 16), ("gb200:10x8", 2, 40), ("gb200:2x64", 2, 64),
    ("gb200:1x72", 1, 72),
    # An H100's NVLink domain is its host: nodes of 4 stay nodes of 4.
    ("h100-sxm:16x4", 16, 4)])
def test_shorthand_joins_nodes_into_a_domain_that_spans_hosts(spec, nodes, per_node):
    cluster = load_cluster(spec)
    assert (cluster.num_nodes, cluster.groups[0].node.devices_per_node) == (nodes, per_node)
    given_nodes, gpus = map(int, spec.split(":")[1].split("x"))
    assert cluster.num_devices == given_nodes * gpus
    assert ("joined into NVLink domains" in cluster.description) == (nodes != given_nodes)


def test_a_device_count_past_a_host_spanning_domain_suggests_nodes_that_join_one():
    # 256 GB200s do not fill 72-GPU racks; 4 domains of 64 do, and the shorthand builds them.
    with pytest.raises(ProfileError, match=r"72-device gb200 nodes; .* e\.g\. gb200:4x64 \(gb200 nodes of fewer"):
        load_cluster("gb200:256")
    assert load_cluster("gb200:4x64").num_devices == 256
    with pytest.raises(ProfileError) as error:
        load_cluster("a100-80g:12")
    assert "e.g." not in str(error.value)


def test_shorthand_accepts_a_device_file(tmp_path):
    path = _device_with(tmp_path)
    assert load_cluster(f"{path}:3x2").num_devices == 6


def test_a_node_sent_to_another_process_hashes_as_one_built_there():
    # The planner's price caches are keyed by node; a sweep sends its clusters to worker processes
    # by pickle, where strings hash differently: the node's hash is computed there again.
    code = ("import pickle, sys; from costmodel.profile_loader import load_cluster; "
            "node = pickle.loads(sys.stdin.buffer.read()); print(hash(node) == hash(load_cluster('h100-sxm:1x8').groups[0].node))")
    node = load_cluster("h100-sxm:1x8").groups[0].node
    hash(node)
    result = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(node), capture_output=True, check=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.decode().strip() == "True"


def test_heterogeneous_cluster_ranks_fill_groups_in_order():
    cluster = load_cluster("hetero-a100-v100-8n")
    assert (cluster.num_nodes, cluster.num_devices, cluster.homogeneous) == (8, 64, False)
    names = [d.name for d in cluster.devices()]
    assert names == ["a100-80g"] * 32 + ["v100-32g"] * 32
    assert [n.device.name for n in cluster.nodes()] == ["a100-80g"] * 4 + ["v100-32g"] * 4
    assert cluster.min_device_mem_bytes == 32510 * MIB  # the V100's torch-reported capacity


def test_group_override_replaces_only_the_nic():
    node = load_cluster("aws-p4d-16n").groups[0].node
    assert node.nic.name == "efa-4x100g-8gpu" and node.nic.bw_bytes_per_s == 400e9 / 8 / 8  # 400 Gb/s per 8 GPUs
    assert node.intra_link is load_device("a100-40g").intra_link


def test_host_memory_is_each_devices_share_of_the_usual_node_unless_a_group_sets_it():
    dgx = load_device("h100-sxm").host_mem_bytes
    assert dgx == 2 * 2**40  # DGX H100: 2 TB
    assert load_cluster("h100-sxm:2x4").groups[0].node.host_mem_bytes == dgx / 2  # 4 of the node's 8 devices
    p4d = load_cluster("aws-p4d-16n").groups[0].node
    assert p4d.host_mem_bytes == 1152 * 2**30 and p4d.host_mem_bytes_per_device == 144 * 2**30
    assert load_cluster("h800:1x8").groups[0].node.host_mem_bytes == 0  # unknown: not checked


def test_load_cluster_accepts_instances_dicts_and_paths(tmp_path):
    cluster = load_cluster("dgx-h100-su")
    assert load_cluster(cluster) is cluster
    spec = {"groups": [{"device": "l4", "nodes": 2, "devices_per_node": 4}], "oversubscription": 2}
    from_dict = load_cluster(spec)
    assert (from_dict.name, from_dict.num_devices, from_dict.oversubscription) == ("custom", 8, 2.0)
    assert load_cluster(_write(tmp_path, "mine.yaml", spec)).name == "mine"
    assert load_cluster(str(_write(tmp_path, "mine.json", '{"groups": [{"device": "cpu", "nodes": 1}]}'))).num_devices == 2
    # Counts written as whole floats read as the integers they are (as other numbers may be written).
    whole = load_cluster({"groups": [{"device": "l4", "nodes": 2.0, "devices_per_node": 4.0}]})
    assert (whole.num_devices, whole.groups[0].count, whole.groups[0].node.devices_per_node) == (8, 2, 4)


def test_cluster_file_refers_to_a_device_file_next_to_it(tmp_path):
    _device_with(tmp_path)
    cluster = load_cluster(_write(tmp_path, "c.yaml", {"groups": [{"device": "./testgpu.yaml", "nodes": 2}]}))
    assert cluster.num_devices == 8


def test_profiles_path_is_searched_first(tmp_path, monkeypatch):
    (tmp_path / "devices").mkdir()
    _write(tmp_path / "devices", "h100-sxm.yaml", {**BASE_DEVICE, "name": "h100-sxm"})
    _write(tmp_path / "devices", "mybox.yaml", {**BASE_DEVICE, "name": "mybox"})
    monkeypatch.setenv(PROFILES_PATH_ENV, str(tmp_path))
    assert {"mybox", "h100-sxm", "b200"} <= set(list_devices())
    assert load_device("h100-sxm").mem_bytes == 16 * 2**30
    assert load_cluster("mybox:2x4").num_devices == 8


# --- one-line errors that name the field -------------------------------------------------------

DEVICE_ERRORS = [
    ({"mem_byte": 1}, "mem_byte", "did you mean mem_bytes"),
    ({"nic": None}, "nic", "missing required key"),
    ({"mem_bytes": -1}, "mem_bytes", "positive"),
    ({"mem_bytes": "80GB"}, "mem_bytes", "must be a number"),
    ({"mem_bw_bytes_per_s": float("nan")}, "mem_bw_bytes_per_s", "finite"),
    ({"nic__efficiency": 1.5}, "nic.efficiency", "(0, 1]"),
    ({"node__intra_link__latency_s": 0}, "node.intra_link.latency_s", "positive"),
    ({"node__devices_per_node": 0}, "node.devices_per_node", "positive integer"),
    ({"node__devices_per_node": 8.5}, "node.devices_per_node", "positive integer"),
    ({"matmul_efficiency": [[1.0e9, 0.5], [1.0e8, 0.6]]}, "matmul_efficiency[1]", "ascending op_flops"),
    ({"matmul_efficiency": [[1.0e9, 0.0]]}, "matmul_efficiency[0][1]", "(0, 1]"),
    ({"matmul_efficiency": {"plateau": 1.2}}, "matmul_efficiency.plateau", "(0, 1]"),
    ({"peak_flops_per_s": {"bf61": 1.0e12}}, "peak_flops_per_s", "did you mean 'bf16'"),
    ({"peak_flops_per_s": {"fp8": 1.0e14}}, "peak_flops_per_s.fp8", "add peak_flops_per_s.bf16"),
    ({"nic": "ib-ndr"}, "nic", "ib-ndr400"),
    ({"nic": "nvlink4-nvswitch"}, "nic", "kind"),
    ({"node__intra_link__kind": "ib"}, "node.intra_link.kind", "cannot serve here"),
    ({"nic__kind": "infiniband"}, "nic.kind", "not a known LinkKind"),
    ({"price_per_hour": 0}, "price_per_hour", "positive"),
    ({"node__host_mem_bytes": -1}, "node.host_mem_bytes", "positive"),
    ({"node__host_mem_bytes": 0}, "node.host_mem_bytes", "leave the key out"),
    ({"host_mem_bytes": 1.0e12}, "host_mem_bytes", "node.host_mem_bytes"),
    ({"comm_overlaps_compute": "no"}, "comm_overlaps_compute", "true or false"),
    ({"flash2_attention_ratio": 0.5}, "flash2_attention_ratio", "mapping {fwd: F, bwd: F}"),
    ({"flash2_attention_ratio": {"fwd": 0.5}}, "flash2_attention_ratio.bwd", "missing required key"),
    ({"flash2_attention_ratio": {"fwd": 0.5, "bwd": 1.5}}, "flash2_attention_ratio.bwd", "(0, 1]"),
    ({"nic__collective_factors": {"allgather": 2.0}}, "nic.collective_factors.allgather", "did you mean 'all_gather'"),
    ({"nic__collective_factors": {"all_gather": 0}}, "nic.collective_factors.all_gather", "positive"),
    ({"nic__collective_factors": [2.0]}, "nic.collective_factors", "mapping of collective to factor"),
    ({"node__intra_link__peer_bw_bytes_per_s": 200.0e9}, "node.intra_link.peer_bw_bytes_per_s", "exceeds bw_bytes_per_s"),
    ({"node__intra_link__peer_bw_bytes_per_s": 64}, "node.intra_link.peer_bw_bytes_per_s", "implausible"),
    ({"matmul_efficiency": []}, "matmul_efficiency", "leave it out for the default curve"),
    ({"node__intra_link__nvls_efficiency": 0.85}, "node.intra_link.nvls_latency_s", "add nvls_latency_s"),
    ({"node__intra_link__nvls_latency_s": 89e-6}, "node.intra_link.nvls_efficiency", "add nvls_efficiency"),
    ({"nic__nvls_efficiency": 0.85, "nic__nvls_latency_s": 89e-6}, "nic.nvls_efficiency", "only an nvswitch"),
    ({"node__intra_link__nvls_efficiency": 1.2, "node__intra_link__nvls_latency_s": 89e-6},
     "node.intra_link.nvls_efficiency", "(0, 1]"),
    # Values written in another unit: GB, TB/s, TFLOP/s, Gb/s and microseconds.
    ({"mem_bytes": 80}, "mem_bytes", "implausible in bytes"),
    ({"mem_bw_bytes_per_s": 3.35}, "mem_bw_bytes_per_s", "e.g. 3.35e12"),
    ({"peak_flops_per_s": {"bf16": 989.4}}, "peak_flops_per_s.bf16", "implausible in FLOP/s"),
    ({"nic__bw_bytes_per_s": 400}, "nic.bw_bytes_per_s", "e.g. 5.0e10 for 400 Gb/s"),
    ({"node__intra_link__latency_s": 9.6}, "node.intra_link.latency_s", "e.g. 9.6e-6 for 9.6 us"),
    ({"node__host_mem_bytes": 2048}, "node.host_mem_bytes", "implausible in bytes"),
]


@pytest.mark.parametrize("changes, field, fix", DEVICE_ERRORS, ids=[c[1] + ":" + c[2] for c in DEVICE_ERRORS])
def test_device_error_is_one_line_naming_file_field_and_fix(tmp_path, changes, field, fix):
    path = _device_with(tmp_path, **changes)
    with pytest.raises(ProfileError) as err:
        load_device(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and f": {field}:" in message and fix in message


CLUSTER_ERRORS = [
    ({"groups": [{"device": "h100-sxm", "nodes": 0}]}, "groups[0].nodes", "positive integer"),
    ({"groups": [{"device": "a100-80", "nodes": 2}]}, "groups[0].device", "a100-80g"),
    ({"groups": [{"device": "h100-sxm", "node": 2}]}, "groups[0].node", "did you mean groups[0].nodes"),
    ({"groups": []}, "groups", "non-empty list"),
    ({"groups": [{"device": "h100-sxm", "nodes": 1}], "oversubscription": 0.5}, "oversubscription", "below 1"),
    ({"groups": [{"device": "h100-sxm", "nodes": 1}], "oversubscription": 1.0e9}, "oversubscription", "up to 64"),
    ({"groups": [{"device": "h100-sxm", "nodes": 2, "devices_per_node": 100000}]}, "groups[0].devices_per_node",
     "node count in nodes"),
    ({"groups": [{"device": "h100-sxm", "nodes": 1, "nic": "nvlink3-nvswitch"}]}, "groups[0].nic", "kind"),
    ({"clusters": []}, "clusters", "valid keys"),
    ({"groups": [{"device": "h100-sxm", "nodes": 400000}, {"device": "a100-80g", "nodes": 200000}]}, "groups[].nodes",
     "4800000 devices in one cluster is implausible"),
    ({"groups": [{"device": "h100-sxm", "nodes": 2, "nic": {"kind": "ib", "bw_bytes_per_s": 400, "latency_s": 5e-6}}]},
     "groups[0].nic.bw_bytes_per_s", "implausible in bytes per second"),
]


@pytest.mark.parametrize("data, field, fix", CLUSTER_ERRORS, ids=[c[1] for c in CLUSTER_ERRORS])
def test_cluster_error_is_one_line_naming_file_field_and_fix(tmp_path, data, field, fix):
    path = _write(tmp_path, "bad.yaml", data)
    with pytest.raises(ProfileError) as err:
        load_cluster(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and f": {field}:" in message and fix in message


@pytest.mark.parametrize("spec, fix", [
    ("h100-sxm:16x", "expected DEVICE:NODESxGPUS, e.g. h100-sxm:16x8"),
    ("h100-sxm:", "expected DEVICE:NODESxGPUS"),
    ("h100-sxm:0x8", "NODES: needs at least 1 node"),
    ("h100-sxm:2x0", "GPUS: needs at least 1 device"),
    ("h100-sxm:1x100000", "GPUS: 100000 devices in one node is implausible"),
    ("h100-sxm:99999999x8", "NODES: 799999992 devices in one cluster is implausible"),
    ("h100-sxm:80000000", "NODES: 80000000 devices in one cluster is implausible"),
    ("h100-sxm:0", "N: needs at least 1 device"),
    ("h100-sxm:12", "use a multiple of 8"),
    ("h100-sx:2x8", "did you mean h100-sxm"),
    ("dgx-a100", "did you mean dgx-a100-superpod, "),
    ("h100-sxm", "DEVICE:NODESxGPUS"),
    ("missing/cluster.yaml", "not found"),
])
def test_bad_cluster_spec_is_one_line(spec, fix):
    with pytest.raises(ProfileError) as err:
        load_cluster(spec)
    assert "\n" not in str(err.value) and fix in str(err.value)


@pytest.mark.parametrize("name, text, fix", [
    ("broken.yaml", "a: [1, 2\n", "invalid YAML"),
    ("broken.yaml", "- 1\n- 2\n", "top level must be a mapping"),
    ("twice.yaml", "name: d\nmem_bytes: 8.0e+10\nmem_bytes: 4.0e+10\n", "key 'mem_bytes' given twice"),
    ("twice.json", '{"name": "d", "mem_bytes": 8.0e+10, "mem_bytes": 4.0e+10}', "key 'mem_bytes' given twice"),
])
def test_unparseable_file_is_one_line(tmp_path, name, text, fix):
    # A key given twice would otherwise be read as whichever came last.
    path = _write(tmp_path, name, text)
    with pytest.raises(ProfileError) as err:
        load_device(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value) and fix in str(err.value)


def test_merge_keys_may_be_overridden_but_a_key_written_twice_may_not():
    # YAML's `<<: *anchor` brings keys in that the mapping may then set itself; writing one key twice
    # by hand, or a list as a key, is an error (PyYAML would keep the last, or raise a TypeError).
    from costmodel.strict_parse import load_text

    text = "base: &b {bw_bytes_per_s: 1.0, latency_s: 2.0}\nlink:\n  <<: *b\n  latency_s: 3.0\n"
    assert load_text(text, is_json=False)["link"] == {"bw_bytes_per_s": 1.0, "latency_s": 3.0}
    with pytest.raises(yaml.YAMLError, match="key 'a' given twice"):
        load_text("a: 1\nb: 2\na: 3\n", is_json=False)
    with pytest.raises(yaml.YAMLError, match="found an unhashable key"):
        load_text("[1, 2]: x\n", is_json=False)


def test_two_device_profiles_of_one_name_in_a_cluster_are_refused(tmp_path):
    # The cost model keys devices by name: a slowed copy of h100-sxm keeping its name would be priced
    # as whichever group came first.
    text = (PROFILES_DIR / "devices" / "h100-sxm.yaml").read_text().replace("bf16: 989.4e+12", "bf16: 400.0e+12")
    slow = _write(tmp_path, "slow.yaml", text)
    cluster = _write(tmp_path, "mixed.yaml", f"groups:\n  - {{device: h100-sxm, nodes: 1}}\n  - {{device: {slow}, nodes: 1}}\n")
    with pytest.raises(ProfileError, match=r"groups\[1\]\.device: a different profile than groups\[0\]'s is also named 'h100-sxm'"):
        load_cluster(cluster)
    same = _write(tmp_path, "same.yaml", "groups:\n  - {device: h100-sxm, nodes: 1}\n  - {device: h100-sxm, nodes: 2, nic: eth-25g-8gpu}\n")
    assert load_cluster(same).num_devices == 24


def test_unknown_device_lists_nearest_names():
    with pytest.raises(ProfileError, match="did you mean h100-hbm2e, h100-pcie, h100-sxm"):
        load_device("h100")


_PART = st.one_of(st.integers(min_value=-3, max_value=10**6).map(str), st.text(max_size=4))


@settings(max_examples=300, deadline=None)
@given(device=st.one_of(st.sampled_from(sorted(REQUIRED_DEVICES) + ["h100", "H100-SXM", ""]), st.text(max_size=12)),
       nodes=_PART, gpus=_PART)
def test_random_shorthand_parses_to_nodes_times_gpus_or_raises_profile_error(device, nodes, gpus):
    spec = f"{device}:{nodes}x{gpus}"
    try:
        cluster = load_cluster(spec)
    except ProfileError as err:
        assert "\n" not in str(err)
        return
    assert isinstance(cluster, Cluster)
    joined = cluster.groups[0].node.device.node_spans_hosts and int(gpus) < cluster.groups[0].node.device.devices_per_node
    assert cluster.num_devices == int(nodes) * int(gpus) and (joined or cluster.num_nodes == int(nodes))


# --- rendering ---------------------------------------------------------------------------------

def _text(renderable) -> str:
    console = Console(record=True, width=250, color_system=None)
    console.print(renderable)
    return console.export_text()


def _cells(text: str) -> dict[str, list[str]]:
    """First cell of each table row -> the remaining cells."""
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
    return {row[0]: row[1:] for row in rows if row}


def test_hardware_list_keeps_every_name_whole_at_80_columns():
    # The names are what a user types next (`--cluster h100-hbm2e:4x8`): at a pipe's default width
    # other columns fold their text, and no name is cut.
    console = Console(record=True, width=80, color_system=None)
    console.print(render_hardware_list())
    first_cells = {line.split("│")[1].strip() for line in console.export_text().splitlines() if line.startswith("│")}
    assert set(list_devices()) | set(list_links()) | set(list_clusters()) <= first_cells


def test_hardware_list_shows_every_device_link_and_cluster():
    cells = _cells(_text(render_hardware_list()))
    assert set(list_devices()) | set(list_links()) | set(list_clusters()) <= cells.keys()
    # profiles/links/ib-hdr200.yaml: 200 Gb/s = 25 GB/s, 9.6 us, 0.92.
    assert cells["ib-hdr200"] == ["ib", "25", "9.6", "0.92"]
    # h100-sxm: 989.4 TFLOP/s bf16; 81089 MiB = 79.19 GiB; 3.35 TB/s; $98.32 / 8 = 12.29 per GPU-hour.
    h100 = cells["h100-sxm"]
    assert h100[:3] + h100[-1:] == ["989.4", "79.2", "3.35", "12.29"]
    assert cells["v100-32g"][0] == "-"  # no bf16 on Volta
    assert cells["llama3-h100-roce-24k"] == ["24576", "3072", "3072 x 8 h100-sxm", "7:1"]


def test_hardware_list_names_a_broken_profile_and_lists_the_rest(tmp_path, monkeypatch):
    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "broken.yaml").write_text("name: broken\npeak_flops_per_s: {bf16: 1.0e+12}\nmem_bytes: 1.0e+9\n")
    monkeypatch.setenv("PARAPLAN_PROFILES_PATH", str(tmp_path))
    text = _text(render_hardware_list())
    cells = _cells(text)
    assert "broken" not in cells and "h100-sxm" in cells and "ib-hdr200" in cells
    assert "broken.yaml: mem_bw_bytes_per_s: missing required key" in text.split("Not listed")[1]


def test_device_detail_shows_sources_and_bracketed_text_verbatim():
    text = _text(render_hardware("h100-sxm"))
    assert "81089MB" in text and "hwLat[NET][Ring][Simple]" in text and "(nvswitch)" in text


def test_cluster_detail_lists_groups():
    cells = _cells(_text(render_hardware("hetero-a100-v100-8n")))
    assert cells["devices"] == ["64"] and cells["nodes"] == ["8"]
    assert cells["smallest device memory"] == ["31.75 GiB"]  # 32510 MiB / 1024
    assert cells["a100-80g"][:2] == ["4", "8"] and cells["v100-32g"][:2] == ["4", "8"]


def test_cluster_detail_accepts_shorthand():
    cells = _cells(_text(render_hardware("h100-sxm:2x8")))
    assert cells["devices"] == ["16"] and cells["nodes"] == ["2"]


def test_link_detail_shows_each_number_with_its_source():
    cells = _cells(_text(render_hardware("opa-4x100g-8gpu")))
    assert cells["kind"] == ["omnipath"] and cells["bandwidth"] == ["6.25 GB/s per direction per device"]
    assert any("Omni-Path" in " ".join(row) for name, row in cells.items() if name.startswith("source"))


def test_render_unknown_link_name_suggests_nearest():
    with pytest.raises(ProfileError, match="not a known device, link or cluster; did you mean .*ib-ndr400"):
        render_hardware("ib-ndr40")


def test_render_unknown_name_suggests_nearest():
    with pytest.raises(ProfileError, match="did you mean .*h100-sxm"):
        render_hardware("h100")


def test_hardware_shows_a_device_or_link_file_as_what_it_is():
    device = _cells(_text(render_hardware(str(PROFILES_DIR / "devices" / "a100-40g.yaml"))))
    assert device["memory"][0].startswith("39.59 GiB")  # 40536 MiB
    link = _cells(_text(render_hardware(str(PROFILES_DIR / "links" / "ib-hdr200.yaml"))))
    assert link["bandwidth"] == ["25 GB/s per direction per device"]


@pytest.mark.parametrize(("given", "hint"), [
    (PROFILES_DIR / "devices" / "a100-40g.yaml", "a device profile, not a cluster; write .*a100-40g.yaml:NODESxGPUS"),
    (PROFILES_DIR / "links" / "ib-hdr200.yaml", "a link profile, not a cluster; name it as"),
])
def test_a_profile_of_another_kind_is_refused_saying_how_to_use_it(given, hint):
    with pytest.raises(ProfileError, match=hint):
        load_cluster(str(given))


def test_a_cluster_file_as_a_shorthand_device_is_refused_saying_how_to_use_it():
    with pytest.raises(ProfileError, match="a cluster profile, not a device; give it as --cluster"):
        load_cluster(f"{PROFILES_DIR / 'clusters' / 'aws-p4d-16n.yaml'}:1x8")


def test_a_folder_given_as_a_profile_says_so(tmp_path):
    with pytest.raises(ProfileError, match="a folder, not a profile file"):
        load_cluster(f"{tmp_path}/")
