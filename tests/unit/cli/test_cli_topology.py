"""Graph topologies on the command line: generator specs, topology files, placed plans, pairwise calibration."""

import json

import pytest

from nest_fx.cluster import cluster_spec, load_cluster
from nest_fx.workload import workload_for_model
from nest_fx.cli import main
from profiler import pairwise as pairwise_mod
from nest_fx.cluster import Cluster
from nest_fx.plan import Plan
from nest_fx.solver import SolverOptions, solve
from nest_fx.cluster.topology import (
    GraphCluster,
    calibrate,
    fat_tree,
    load_topology,
    pairwise_figures,
    router_of,
    save_topology,
)

MODEL = "llama:hidden=512,layers=4,heads=8,seq=256,vocab=2048"


def test_generator_spec_plans_simulates_and_explains(tmp_path, capsys):
    out = tmp_path / "plan.json"
    spec = "fat-tree:2x4,oversub=2"
    rc = main(
        [
            "plan",
            "--model",
            MODEL,
            "--cluster",
            spec,
            "--global-batch",
            "32",
            "--json",
            str(out),
            "--no-baselines",
            "--quiet",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "(config, depth, device order) triples" in text and "device order: " in text and "island 0" in text
    plan = Plan.load(str(out))
    assert plan.cluster == spec and plan.world_size == 8
    assert main(["simulate", "--plan", str(out), "--model", MODEL, "--cluster", spec]) == 0
    assert main(["explain", str(out)]) == 0  # the cluster comes from the plan file
    assert "Mesh and rank layout" in capsys.readouterr().out


def test_a_placed_plan_file_is_simulated_and_explained_with_its_order(tmp_path, capsys):
    topo = fat_tree(2, 4)
    figures = pairwise_figures(topo, [(0, 1)])
    slow = calibrate({(0, 1): (figures[(0, 1)][0] / 30, figures[(0, 1)][1])}, base=topo)
    path = tmp_path / "slow.yaml"
    save_topology(slow, str(path))
    cluster = load_cluster(str(path))
    assert isinstance(cluster, GraphCluster) and cluster.topology.measured == slow.measured
    tp2 = SolverOptions(
        tp_degrees=(2,),
        microbatch_sizes=(1, 2),
        zero_stages=(1,),
        schedules=(("1f1b", 1),),
        recompute=("none",),
        max_stages=2,
        use_all_devices=True,
    )  # TP 2: the slow pair matters
    found = solve(workload_for_model(MODEL, cluster), cluster, 32, tp2)
    plan = found.plan
    assert plan.device_order is not None
    plan.cluster = cluster_spec(str(path), cluster)
    plan.save(str(tmp_path / "p.json"))
    assert json.loads((tmp_path / "p.json").read_text())["device_order"] == plan.device_order
    assert (
        main(
            [
                "simulate",
                "--plan",
                str(tmp_path / "p.json"),
                "--model",
                MODEL,
                "--cluster",
                str(path),
                "--json",
                str(tmp_path / "sim.json"),
            ]
        )
        == 0
    )
    sim = json.loads((tmp_path / "sim.json").read_text())
    assert sim["result"]["step_s"] == pytest.approx(found.result.step_s, rel=1e-12)
    capsys.readouterr()
    assert main(["explain", str(tmp_path / "p.json"), "--model", MODEL]) == 0
    text = capsys.readouterr().out
    assert "device order: the plan's device_order" in text and "island 0 (devices 0-3) runs TP groups" in text


@pytest.mark.parametrize(
    "spec, message",
    [
        ("rail:12y8", "NODES must be a positive integer, got '12y8'"),
        ("fat-tree:16x8,foo=1", "unknown option 'foo'; fat-tree takes leaf, spines, oversub, device"),
        ("fat-tree:16x8,oversub=0.5", "oversubscription: must be a number >= 1"),
        ("torus:4x4x4x4", "a torus has 1 to 3 dimensions, got 4"),
        ("torus:8x0", "dimension 1 must be a positive integer, got 0"),
        ("rail:", "the shape is missing"),
        ("rail:4,spines", "option 'spines' must be KEY=VALUE"),
        ("rail:4,device=abc", "device=abc: unknown cluster preset"),
        # sizes a graph cannot hold are refused before anything is built (no hang)
        ("rail:99999999999x8", "NODES must be at most 65,536"),
        ("torus:4096x4096", "16,777,216 devices: a graph topology is built device by device"),
        ("fat-tree:128x8,spines=999999999", "spines must be at most 4,096"),
    ],
)
def test_malformed_generator_specs_are_one_line_errors(spec, message, capsys):
    rc = main(["plan", "--model", MODEL, "--cluster", spec, "--no-baselines", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: cluster spec {spec!r}: ") and message in err and "e.g. " in err


def test_load_cluster_tells_topology_files_from_cluster_files(tmp_path):
    path = tmp_path / "t.json"
    save_topology(fat_tree(2, 4), str(path))
    graph = load_cluster(str(path))
    assert isinstance(graph, GraphCluster) and graph.num_devices == 8 and graph.levels[0].group_size == 4
    with pytest.raises(ValueError, match="--devices 16 differs"):
        load_cluster(str(path), 16)
    with pytest.raises(ValueError, match="leave --devices out"):
        load_cluster("rail:4x8", 64)
    assert load_cluster("rail:4x8", 32).num_devices == 32
    hier = tmp_path / "c.yaml"
    Cluster.preset("dgx-a100", 16).save(str(hier))
    assert isinstance(load_cluster(str(hier)), Cluster)
    assert cluster_spec("torus:4x4", load_cluster("torus:4x4")) == "torus:4x4"
    assert load_topology(str(path)).num_devices == 8


PAIRS = {(0, 1): (2e9, 3e-5), (0, 2): (1e9, 5e-5), (1, 2): (4e9, 2e-5)}  # bytes/s, s


def _measured_pairs(fn, nproc, sizes, warmup, repeats, timeout):
    """Stands in for the 3-rank launch of the ping-pong: exact transfers of the figures in PAIRS
    (real measurements on a loaded machine: scripts/bench_calibration.py)."""
    assert nproc == 3 and repeats == 3
    row = [
        {"src": a, "dst": b, "nbytes": float(n), "seconds": lat + n / bw}
        for (a, b), (bw, lat) in PAIRS.items()
        for n in sizes
    ]
    return [row] * nproc


def test_pairwise_calibration_writes_a_topology_the_planner_reads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pairwise_mod, "launch", _measured_pairs)
    out = tmp_path / "measured.yaml"
    base = "fat-tree:1x4,device=cpu-gloo"  # the structure the three measured ranks derate
    rc = main(
        [
            "profile",
            "--calibrate",
            "--pairwise",
            "--cluster",
            base,
            "--out",
            str(out),
            "--nproc",
            "3",
            "--sizes-kib",
            "64,8192",
            "--repeats",
            "3",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0 and "wrote" in captured.out, captured.err
    assert all(f"{a} - {b}" in captured.out for a, b in ((0, 1), (0, 2), (1, 2)))
    topo = load_topology(str(out))
    assert topo.num_devices == 4 and set(topo.measured) == {(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)}
    for (a, b), (bw, lat) in topo.measured.items():  # the fitted figures, both directions
        want_bw, want_lat = PAIRS[min(a, b), max(a, b)]
        assert bw == pytest.approx(want_bw, rel=1e-6) and lat == pytest.approx(want_lat, rel=1e-6)
        assert router_of(topo).route(a, b).bandwidth == bw
    rc = main(["plan", "--model", MODEL, "--cluster", str(out), "--global-batch", "8", "--no-baselines", "--quiet"])
    assert rc == 0 and "4 x cpu" in capsys.readouterr().out


def test_pairwise_flag_errors(tmp_path, capsys):
    assert main(["profile", "--pairwise", "--out", str(tmp_path / "t.yaml")]) == 2
    assert "--pairwise goes with --calibrate" in capsys.readouterr().err
    assert main(["profile", "--calibrate", "--pairwise", "--out", str(tmp_path / "t.txt")]) == 2
    assert "end it in .yaml, .yml or .json" in capsys.readouterr().err
