"""Cluster description: presets, validation, file round-trips, quantity parsing, rank placement."""

import copy
import json
import pathlib
import re

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from nest_fx.cluster import (
    CLUSTER_FORMAT,
    PRESETS,
    Cluster,
    ClusterError,
    DeviceSpec,
    NetworkLevel,
    parse_quantity,
)
from repo_root import ROOT

GiB = 2**30


# -- presets -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("devices", [1, 2, 8, 32, 64, 100, 1024])
def test_every_preset_builds_a_valid_hierarchy(name, devices):
    c = Cluster.preset(name, devices)
    assert c.num_devices == devices
    assert c.levels[-1].group_size >= devices
    sizes = [lv.group_size for lv in c.levels]
    assert all(b > a and b % a == 0 for a, b in zip(sizes, sizes[1:]))
    c.validate()  # idempotent


def test_dgx_a100_figures():
    c = Cluster.preset("dgx-a100", 64)
    assert c.device.memory_bytes == 80 * GiB
    assert c.device.peak("bf16") == 312e12 and c.device.peak("fp16") == 312e12
    assert c.device.peak("fp32") == 19.5e12 and c.device.peak("tf32") == 156e12
    assert c.device.mem_bandwidth == 2.039e12
    assert [(lv.name, lv.group_size) for lv in c.levels] == [("node", 8), ("rack", 32), ("spine", 64)]
    # NCCL's bus bandwidths (nccl-tests #149, nccl #412), below the link rates: NVLink3 300 GB/s,
    # 8 x 200 Gb/s HDR per node = 8 * 25e9 B/s shared by 8 GPUs = 25e9 B/s per GPU
    assert c.levels[0].bandwidth == 230e9 < 300e9
    assert c.levels[1].bandwidth == c.levels[2].bandwidth == 24e9 < 8 * 200e9 / 8 / 8


def test_dgx_h100_figures():
    c = Cluster.preset("dgx-h100", 16)
    assert c.device.peak("bf16") == 989e12 and c.device.peak("fp8") == 1979e12
    assert c.device.peak("fp32") == 67e12 and c.device.mem_bandwidth == 3.35e12
    # NCCL's bus bandwidth over NVLink4 (nccl-tests #326), below the 450 GB/s link rate
    assert c.levels[0].bandwidth == 360e9 < 450e9
    assert Cluster.preset("dgx-h200", 16).levels[0].bandwidth == c.levels[0].bandwidth
    assert c.levels[1].bandwidth == 47e9 < 400e9 / 8  # 400 Gb/s NDR per GPU, 46-48 GB/s (nccl-tests #290)


def test_nest_paper_clusters_keep_the_papers_figures():
    c = Cluster.preset("h100-spine-leaf", 128)
    assert c.device.memory_bytes == 90 * GiB
    assert [lv.bandwidth for lv in c.levels] == [900e9, 12.5e9, 50e9]  # spine > leaf, as stated
    t = Cluster.preset("tpuv4-fat-tree", 128)
    assert [lv.bandwidth for lv in t.levels] == [900e9, 100e9, 400e9]
    assert t.device.memory_bytes == 64 * GiB and t.device.peak("bf16") == 275e12
    assert t.device.mem_bandwidth == 1.2e12


@pytest.mark.parametrize(
    "devices, expected",
    [
        (4, [8, 32]),  # fewer devices than a node: node and rack kept, spine omitted
        (32, [8, 32]),  # exactly one rack: spine would equal the rack
        (33, [8, 32, 64]),  # 33 rounded up to a multiple of 32
        (100, [8, 32, 128]),
        (256, [8, 32, 256]),
    ],
)
def test_spine_size_follows_device_count(devices, expected):
    assert [lv.group_size for lv in Cluster.preset("dgx-a100", devices).levels] == expected


def test_cpu_gloo_is_one_host_level():
    c = Cluster.preset("cpu-gloo", 2)
    assert [(lv.name, lv.group_size, lv.bandwidth, lv.latency) for lv in c.levels] == [("host", 2, 2e9, 5e-5)]
    assert c.device.peak("fp32") == 50e9 and c.device.memory_bytes == 8 * GiB


def test_unknown_preset_lists_the_valid_names():
    with pytest.raises(ValueError) as exc:
        Cluster.preset("dgx-b300", 8)
    for name in PRESETS:
        assert name in str(exc.value)


@pytest.mark.parametrize("devices", [0, -1, 2.5, True])
def test_preset_rejects_bad_device_counts(devices):
    with pytest.raises(ClusterError, match="devices"):
        Cluster.preset("dgx-a100", devices)


def test_unknown_dtype_names_the_known_ones():
    dev = Cluster.preset("tpuv4-fat-tree", 8).device
    with pytest.raises(ClusterError, match=r"fp8.*\['bf16'\]"):
        dev.peak("fp8")


# -- placement -----------------------------------------------------------------------------


@pytest.fixture
def dgx64():
    return Cluster.preset("dgx-a100", 64)  # node 8, rack 32, spine 64


@pytest.mark.parametrize(
    "ranks, index",
    [
        ([5], 0),
        ([0, 7], 0),
        ([7, 8], 1),  # neighbours across a node boundary
        ([0, 31], 1),
        ([31, 32], 2),  # across a rack boundary
        (range(64), 2),
    ],
)
def test_level_index_of_group(dgx64, ranks, index):
    assert dgx64.level_index_of_group(ranks) == index


@pytest.mark.parametrize(
    "ranks, fanouts",
    [
        (range(16), [8, 2]),  # 2 full nodes in one rack
        ([0, 8, 16, 24], [1, 4]),  # one rank in each of 4 nodes
        ([0, 1], [2]),
        ([3], [1]),
        (range(64), [8, 4, 2]),
        ([0, 32], [1, 1, 2]),  # one rank per rack
        ([0, 1, 2, 8], [3, 2]),  # unbalanced: the fullest node sets the node fan-out
        ([1, 9, 33, 41], [1, 2, 2]),
    ],
)
def test_levels_spanned(dgx64, ranks, fanouts):
    spanned = dgx64.levels_spanned(ranks)
    assert [f for _, f in spanned] == fanouts
    assert [lv.name for lv, _ in spanned] == ["node", "rack", "spine"][: len(fanouts)]


def test_span_counts_ranks_per_group(dgx64):
    # {0,1,2,8}: node 0 holds 3 ranks, node 1 holds 1; the rack holds all 4.
    node, rack = dgx64.span([0, 1, 2, 8])
    assert (node.fanout, node.max_ranks, node.min_ranks) == (3, 3, 1)
    assert (rack.fanout, rack.max_ranks, rack.min_ranks) == (2, 4, 4)


@given(st.sets(st.integers(0, 63), min_size=1, max_size=64))
@settings(max_examples=60, deadline=None)
def test_span_invariants(ranks):
    c = Cluster.preset("dgx-a100", 64)
    spans = c.span(sorted(ranks))
    assert len(spans) == c.level_index_of_group(sorted(ranks)) + 1
    assert spans[-1].max_ranks == spans[-1].min_ranks == len(ranks)  # top group holds all
    product = 1
    for sp in spans:
        product *= sp.fanout
        assert 1 <= sp.min_ranks <= sp.max_ranks <= product  # bottleneck fan-outs bound the count
    assert product >= len(ranks)


def _span_by_definition(cluster, ranks):
    """Cluster.span's definition, one rank at a time (the method itself works on arrays)."""
    top = cluster.level_index_of_group(ranks)
    out, inner = [], 1
    for level in cluster.levels[: top + 1]:
        groups = {}
        for r in ranks:
            groups.setdefault(r // level.group_size, []).append(r)
        fanouts = [len({r // inner for r in g}) for g in groups.values()]
        sizes = [len(g) for g in groups.values()]
        out.append((level.name, max(fanouts), max(sizes), min(sizes)))
        inner = level.group_size
    return out


@given(st.lists(st.integers(0, 255), min_size=1, max_size=200, unique=True))
@settings(max_examples=80, deadline=None)
def test_span_equals_its_definition_in_any_order(ranks):
    c = Cluster.preset("h100-spine-leaf", 256)
    assert [(sp.level.name, sp.fanout, sp.max_ranks, sp.min_ranks) for sp in c.span(ranks)] == _span_by_definition(
        c, ranks
    )


@pytest.mark.parametrize(
    "ranks, message",
    [
        ([], "non-empty"),
        ([64], "not a rank"),
        ([-1], "not a rank"),
        ([1, 1], "duplicate"),
        ([0.5], "not a rank"),
    ],
)
def test_bad_ranks(dgx64, ranks, message):
    with pytest.raises(ClusterError, match=message):
        dgx64.levels_spanned(ranks)


# -- construction validation ---------------------------------------------------------------


def _device(**kw):
    args = dict(name="gpu", memory_bytes=80e9, peak_flops={"bf16": 1e14}, mem_bandwidth=2e12)
    args.update(kw)
    return DeviceSpec(**args)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ([8, 8], r"levels\[1\]\.group_size: must be greater"),
        ([8, 4], r"levels\[1\]\.group_size: must be greater"),
        ([8, 12], r"levels\[1\]\.group_size: must be a multiple"),
        ([8, 32, 48], r"levels\[2\]\.group_size: must be a multiple"),
        ([8, 16], r"levels\[1\]\.group_size: the outermost level must hold all 64"),
    ],
)
def test_hierarchy_validation_names_the_level(sizes, message):
    levels = [NetworkLevel(f"l{i}", s, 1e9, 1e-6) for i, s in enumerate(sizes)]
    with pytest.raises(ClusterError, match=message):
        Cluster("x", _device(), 64, levels)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(memory_bytes=0), "memory_bytes: must be > 0"),
        (dict(memory_bytes=-1), "memory_bytes: must be > 0"),
        (dict(mem_bandwidth=float("nan")), "mem_bandwidth: must be a finite number"),
        (dict(peak_flops={}), "peak_flops: must be a non-empty mapping"),
        (dict(peak_flops={"bf16": -5}), r"peak_flops\.bf16: must be > 0"),
        (dict(name=""), "name: must be a non-empty string"),
    ],
)
def test_device_validation_names_the_field(kwargs, message):
    with pytest.raises(ClusterError, match=message):
        _device(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(group_size=0), "group_size: must be >= 1"),
        (dict(group_size=8.0), "group_size: must be an integer"),
        (dict(bandwidth=0), "bandwidth: must be > 0"),
        (dict(latency=-1e-6), "latency: must be >= 0"),
    ],
)
def test_level_validation_names_the_field(kwargs, message):
    args = dict(name="node", group_size=8, bandwidth=1e9, latency=1e-6)
    args.update(kwargs)
    with pytest.raises(ClusterError, match=message):
        NetworkLevel(**args)


# -- files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("ext", ["yaml", "yml", "json"])
def test_round_trip(tmp_path, name, ext):
    c = Cluster.preset(name, 96)
    path = str(tmp_path / f"cluster.{ext}")
    c.save(path)
    assert Cluster.load(path) == c
    assert Cluster.from_dict(c.to_dict()) == c


def test_json_file_is_plain_json(tmp_path):
    path = tmp_path / "c.json"
    Cluster.preset("dgx-a100", 16).save(str(path))
    data = json.loads(path.read_text())
    assert data["format"] == CLUSTER_FORMAT and data["levels"][0]["group_size"] == 8


HUMAN_YAML = """
format: nest-fx-cluster/1
name: my-a100s
num_devices: 16
device:
  name: A100
  memory_bytes: 80GiB
  peak_flops: {bf16: 312TFLOPS, fp32: 19.5e12}
  mem_bandwidth: 2039GB/s
levels:
  - {name: node, group_size: 8, bandwidth: 300GB/s, latency: 5us}
  - {name: rack, group_size: 32, bandwidth: 200Gb/s, latency: 0.01ms}
"""


def test_human_friendly_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(HUMAN_YAML)
    c = Cluster.load(str(path))
    assert c.device.memory_bytes == 80 * 2**30
    assert c.device.peak_flops == {"bf16": 312e12, "fp32": 19.5e12}
    assert c.device.mem_bandwidth == pytest.approx(2.039e12)
    assert c.levels[0].bandwidth == 300e9 and c.levels[0].latency == pytest.approx(5e-6)
    assert c.levels[1].bandwidth == 25e9 and c.levels[1].latency == pytest.approx(1e-5)


def _good():
    return yaml.safe_load(HUMAN_YAML)


def _set(path, value):
    def edit(d):
        keys = path.split(".")
        for k in keys[:-1]:
            d = d[int(k)] if isinstance(d, list) else d[k]
        last = keys[-1]
        if value is _DELETE:
            del d[last]
        elif isinstance(d, list):
            d[int(last)] = value
        else:
            d[last] = value

    return edit


_DELETE = object()


@pytest.mark.parametrize(
    "edit, message",
    [
        (_set("levels.1.bandwidth", -3), r"levels\[1\]\.bandwidth: must be > 0, got -3"),
        (_set("levels.0.latency", "5 parsecs"), r"levels\[0\]\.latency: cannot read unit 'parsecs'"),
        (_set("levels.1.group_size", 12), r"levels\[1\]\.group_size: must be a multiple"),
        (_set("levels.0.bandwith", 1), r"levels\[0\]: unknown key\(s\) \['bandwith'\]"),
        (_set("levels.0.name", _DELETE), r"levels\[0\]: missing key\(s\) \['name'\]"),
        (_set("levels", []), "levels: must be a non-empty list"),
        (_set("device.memory_bytes", "80G"), r"device\.memory_bytes: cannot read unit 'G'"),
        (_set("device.memory_bytes", 0), r"device\.memory_bytes: must be > 0"),
        (_set("device.peak_flops", {"bf16": "fast"}), r"device\.peak_flops\.bf16: expected FLOP/s"),
        (_set("device.peak_flops", {}), r"device\.peak_flops: must be a non-empty mapping"),
        (_set("device.mem_bandwidth", "2TB"), r"device\.mem_bandwidth: cannot read unit 'TB'"),
        (_set("num_devices", 64), r"levels\[1\]\.group_size: the outermost level must hold all 64"),
        (_set("num_devices", "16"), "num_devices: must be an integer"),
        (_set("format", "nest-fx-cluster/2"), "format: must be 'nest-fx-cluster/1'"),
        (_set("format", _DELETE), r"missing key\(s\) \['format'\]"),
        (_set("extra", 1), r"unknown key\(s\) \['extra'\]"),
    ],
)
def test_from_dict_errors_name_the_field(edit, message):
    d = copy.deepcopy(_good())
    edit(d)
    with pytest.raises(ClusterError, match=message):
        Cluster.from_dict(d)


def test_load_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(HUMAN_YAML.replace("bandwidth: 300GB/s", "bandwidth: -1"))
    with pytest.raises(ClusterError, match=r"bad\.yaml: levels\[0\]\.bandwidth: must be > 0"):
        Cluster.load(str(bad))
    with pytest.raises(ClusterError, match="cannot read cluster file"):
        Cluster.load(str(tmp_path / "missing.json"))
    with pytest.raises(ClusterError, match="must end in"):
        Cluster.load(str(tmp_path / "c.toml"))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ClusterError, match="not valid JSON"):
        Cluster.load(str(broken))


# -- quantities ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, unit, value",
    [
        (25e9, "B/s", 25e9),
        ("25e9", "B/s", 25e9),
        ("80GiB", "B", 80 * 2**30),
        ("80 GB", "B", 80e9),
        ("512MiB", "B", 512 * 2**20),
        ("1.5KB", "B", 1500.0),
        ("2TiB", "B", 2 * 2**40),
        ("300GB/s", "B/s", 300e9),
        ("200Gb/s", "B/s", 200e9 / 8),  # bits
        ("100Gbps", "B/s", 100e9 / 8),
        ("1GiB/s", "B/s", 2.0**30),
        ("5us", "s", 5e-6),
        ("5µs", "s", 5e-6),
        ("1.5ms", "s", 1.5e-3),
        ("100ns", "s", 1e-7),
        ("2e-6s", "s", 2e-6),
        ("2", "s", 2.0),
        ("312T", "FLOP/s", 312e12),
        ("312e12", "FLOP/s", 312e12),
        ("312TFLOPS", "FLOP/s", 312e12),
        ("312 TFLOP/s", "FLOP/s", 312e12),
        ("19.5 T", "FLOP/s", 19.5e12),
        ("50G", "FLOP/s", 50e9),
    ],
)
def test_parse_quantity(text, unit, value):
    assert parse_quantity(text, unit) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize(
    "text, unit",
    [
        ("80G", "B"),  # ambiguous: GB or GiB?
        ("300GB", "B/s"),  # a size where a rate is expected
        ("5 min", "s"),
        ("fast", "FLOP/s"),
        ("312 TB", "FLOP/s"),
        ("", "B"),
        (None, "B"),
        (True, "s"),
        ("inf", "B"),
        ("1e999", "B"),
    ],
)
def test_parse_quantity_rejects(text, unit):
    with pytest.raises(ClusterError, match="bandwidth"):
        parse_quantity(text, unit, path="bandwidth")


def test_parse_quantity_unknown_unit():
    with pytest.raises(ValueError, match="unit must be one of"):
        parse_quantity("1", "furlongs")


# -- the documented example ----------------------------------------------------------------


def _doc_blocks(lang):
    text = (pathlib.Path(ROOT) / "docs" / "cluster_format.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _flatten(d, prefix=""):
    if isinstance(d, dict):
        return {k2: v2 for k, v in d.items() for k2, v2 in _flatten(v, f"{prefix}{k}.").items()}
    if isinstance(d, list):
        return {k2: v2 for i, v in enumerate(d) for k2, v2 in _flatten(v, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): d}


@pytest.mark.parametrize("lang, parse", [("yaml", yaml.safe_load), ("json", json.loads)])
def test_documented_example_is_the_dgx_a100_preset(lang, parse):
    (block,) = [b for b in _doc_blocks(lang) if "kernel_rates" not in b]  # that one: test_kernel_rates.py
    got = _flatten(Cluster.from_dict(parse(block)).to_dict())
    want = _flatten(Cluster.preset("dgx-a100", 64).to_dict())
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), key


def test_blackwell_presets_levels_and_rates():
    """DGX B200 keeps the 8-GPU node; GB200 NVL72 has one 72-GPU NVLink level, then whole racks."""
    b200 = Cluster.preset("dgx-b200", 64)
    assert [lv.group_size for lv in b200.levels] == [8, 32, 64]
    assert b200.levels[0].bandwidth == 2 * Cluster.preset("dgx-h100", 64).levels[0].bandwidth
    one_rack = Cluster.preset("gb200-nvl72", 72)
    assert [(lv.name, lv.group_size) for lv in one_rack.levels] == [("nvl72", 72)]
    racks = Cluster.preset("gb200-nvl72", 100)  # rounded up to whole racks
    assert [(lv.name, lv.group_size) for lv in racks.levels] == [("nvl72", 72), ("fabric", 144)]
    for c in (b200, racks):
        assert c.device.peak_flops["fp8"] == 2 * c.device.peak_flops["bf16"]  # dense fp8 doubles bf16
        assert c.device.memory_bytes >= 180e9


def test_h200_preset_is_an_h100_with_more_and_faster_memory():
    """DGX H200: the H100's compute and network, 140 GiB at 4.8 TB/s."""
    h100, h200 = Cluster.preset("dgx-h100", 16), Cluster.preset("dgx-h200", 16)
    assert h200.device.peak_flops == h100.device.peak_flops
    assert [lv.bandwidth for lv in h200.levels] == [lv.bandwidth for lv in h100.levels]
    assert h200.device.mem_bandwidth == 4.8e12 and h200.device.memory_bytes == 140 * 2**30
