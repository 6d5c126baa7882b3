"""Input limits (docs/runtime.md, "Input files"): only regular files are read, never waited on, at
most 64 MiB, and each is parsed once; a NaN time in a profile is refused."""

from __future__ import annotations

import math
import os

import pytest

import nest_fx.common.fileio as fileio
from nest_fx.cluster import ClusterError, load_cluster
from nest_fx.cluster.spec import Cluster
from nest_fx.cluster.topology import fat_tree, save_topology
from nest_fx.plan import Plan, PlanError
from nest_fx.workload.profile_file import Profile, ProfileError


def test_devices_fifos_and_directories_are_refused_at_once(tmp_path):
    with pytest.raises(PlanError, match="/dev/zero: is a character device, not a regular file"):
        Plan.load("/dev/zero")
    fifo = tmp_path / "x.yaml"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    with pytest.raises(ClusterError, match=r"x.yaml: is a FIFO \(named pipe\), not a regular file"):
        load_cluster(str(fifo))
    (tmp_path / "d.json").mkdir()
    with pytest.raises(PlanError, match="d.json: is a directory"):
        Plan.load(str(tmp_path / "d.json"))


def test_files_over_the_limit_are_refused_without_reading_them(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as fh:  # sparse: its size is past the limit, nothing to read
        fh.truncate(fileio.MAX_FILE_BYTES + 1)
    with pytest.raises(ClusterError, match="cluster files larger than 64 MiB are refused"):
        load_cluster(str(big))
    with pytest.raises(PlanError, match="small.json: 102 bytes; plan files larger than 50 bytes are refused"):
        (tmp_path / "small.json").write_text("{}" + " " * 100)
        fileio.read_bytes(str(tmp_path / "small.json"), PlanError, "plan", max_bytes=50)
    # a file whose size says 0 (procfs) is read with a bound too
    assert os.path.getsize("/proc/self/status") == 0
    with pytest.raises(PlanError, match="/proc/self/status: more than 50 bytes"):
        fileio.read_bytes("/proc/self/status", PlanError, "plan", max_bytes=50)


def test_a_cluster_or_topology_file_is_parsed_once(tmp_path, monkeypatch):
    cluster_path, topo_path = str(tmp_path / "c.yaml"), str(tmp_path / "t.yaml")
    Cluster.preset("dgx-a100", 16).save(cluster_path)
    save_topology(fat_tree(2, 4), topo_path)
    parses = []
    real = fileio.parse_yaml
    monkeypatch.setattr(fileio, "parse_yaml", lambda *a: parses.append(a[1]) or real(*a))
    assert load_cluster(cluster_path).num_devices == 16
    assert load_cluster(topo_path).num_devices == 8
    assert parses == [cluster_path, topo_path]


def _profile(**entry) -> dict:
    return {
        "format": "nest-fx-profile/1",
        "device": "cpu",
        "device_name": "x",
        "dtype": "float32",
        "torch_version": "2",
        "ops": {"k": {"op": "mm", "fwd_s": 1e-3, "bwd_s": 2e-3, "peak_bytes": 0, **entry}},
    }


def test_a_nan_time_in_a_profile_is_refused():
    for field, value in [
        ("fwd_s", math.nan),
        ("bwd_s", math.inf),
        ("fwd_host_s", math.nan),
        ("fwd_s", -1.0),
        ("peak_bytes", math.nan),
    ]:
        with pytest.raises(ProfileError, match=f"ops\\['k'\\].{field}: {value} is not a finite non-negative number"):
            Profile.from_dict(_profile(**{field: value}))
    # an op that was not measured says so, and may carry NaN
    entry = Profile.from_dict(_profile(fwd_s=math.nan, bwd_s=math.nan, skipped="oom")).ops["k"]
    assert not entry.usable
    assert Profile.from_dict(_profile()).ops["k"].usable


def test_a_key_given_twice_is_refused_naming_it(tmp_path):
    """JSON and YAML parsers keep the last of two equal keys without a word: a plan whose second
    ``tp`` silently wins would run another plan than the one read."""
    from nest_fx.workload import WorkloadError
    from nest_fx.workload.table import load_workload

    cases = [
        (
            "plan.json",
            '{"format": "nest-fx-plan/1",\n "stages": [{"tp": 2, "dp": 1, "tp": 4}]}',
            Plan.load,
            PlanError,
            "JSON",
        ),
        ("cluster.yaml", "name: x\ndevices: 8\nlevels: []\ndevices: 16\n", load_cluster, ClusterError, "YAML"),
        (
            "workload.json",
            '{"format": "nest-fx-workload/1", "layers": [], "layers": []}',
            load_workload,
            WorkloadError,
            "JSON",
        ),
        ("profile.json", json_with_twice("fwd_s"), Profile.load, ProfileError, "JSON"),
    ]
    for name, text, load, error, kind in cases:
        path = tmp_path / name
        path.write_text(text)
        key = {"plan.json": "tp", "cluster.yaml": "devices", "workload.json": "layers", "profile.json": "fwd_s"}[name]
        with pytest.raises(error, match=f"{name}: not valid (YAML \\()?.*key '{key}' appears twice"):
            load(str(path))
    # where the YAML key is
    with pytest.raises(ClusterError, match="at line 4, column 1"):
        load_cluster(str(tmp_path / "cluster.yaml"))
    # a YAML merge key still overrides, as YAML defines
    merged = fileio.parse_yaml("base: &b {a: 1, b: 2}\nother:\n  <<: *b\n  a: 3\n", "m.yaml", ClusterError)
    assert merged["other"] == {"a": 3, "b": 2}


def json_with_twice(key: str) -> str:
    return (
        '{"format": "nest-fx-profile/1", "device": "cpu", "device_name": "x", "dtype": "float32", '
        f'"torch_version": "2", "ops": {{"k": {{"op": "mm", "{key}": 1e-3, "bwd_s": 2e-3, "peak_bytes": 0, '
        f'"{key}": 5e-3}}}}}}'
    )


def test_an_absurd_depth_is_refused_at_once():
    """``layers=20000`` would trace for minutes without a word; the limit is documented in
    nest_fx.common.limits.MAX_LAYERS (docs/tracer.md)."""
    from nest_fx.common.errors import ModelError
    from nest_fx.common.limits import MAX_LAYERS
    from nest_fx.models.build import build_any

    for name in ("gpt:hidden=64,layers=20000,heads=4,seq=16,vocab=100", f"llama:layers={MAX_LAYERS + 1}"):
        with pytest.raises(ModelError, match=f"above the limit of {MAX_LAYERS}"):
            build_any(name)
    assert build_any("gpt:hidden=64,layers=4,heads=4,seq=16,vocab=100")[1].layers == 4
