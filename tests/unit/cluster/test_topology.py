"""Graph topologies: generators, file format, routing, contention, agreement with the hierarchical
model, the GraphCluster adapter in the step-time model, orderings and calibration."""

import json

import pytest

from nest_fx.workload import workload_for_model
from nest_fx.cluster import Cluster, NetworkLevel
from nest_fx.cluster.topology import router_of
from nest_fx.cost import collectives
from nest_fx.cost.step_time import simulate
from nest_fx.plan import uniform_plan
from nest_fx.cluster.topology import (
    GraphCluster,
    Link,
    Topology,
    TopologyError,
    calibrate,
    candidate_orders,
    collective_time,
    concurrent_collective_time,
    concurrent_times,
    fat_tree,
    from_cluster,
    from_dict,
    load_topology,
    p2p_time,
    pairwise_figures,
    rail_optimized,
    save_topology,
    to_dict,
    torus,
)
from nest_fx.cluster.topology.algorithms import KINDS
from nest_fx.cost.dp_sync_contention import dp_sync_contention

MODEL = "llama:hidden=512,layers=8,heads=8,seq=256,vocab=1024"
S = 256e6


def nodes_on_route(topo, src, dst):
    return list(router_of(topo).route(src, dst).nodes)


# -- generators ----------------------------------------------------------------------------


def test_fat_tree_shape_and_oversubscription():
    t = fat_tree(8, 4, nodes_per_leaf=2, spines=3, oversubscription=2.0, nic_bandwidth=50e9)
    assert t.num_devices == 32
    assert len(t.switches) == 8 + 4 + 3  # NVSwitches, leaves, spines
    assert len(t.links) == 32 + 32 + 4 * 3  # NVLink, NIC, leaf-spine
    uplink = t.graph["leaf0"]["spine0"]["bandwidth"]
    assert 3 * uplink == pytest.approx(2 * 4 * 50e9 / 2.0)  # a full leaf's downlinks / oversubscription
    assert [lv.group_size for lv in t.levels] == [4, 8, 32]
    assert nodes_on_route(t, 0, 1) == [0, "nvsw0", 1]  # NVLink preferred inside a node
    assert nodes_on_route(t, 0, 4) == [0, "leaf0", 4]
    assert len(nodes_on_route(t, 0, 31)) == 5  # leaf, spine, leaf


def test_rail_optimized_shape_and_routes():
    t = rail_optimized(8, 4, nodes_per_rail_group=4, spines=2)
    assert len(t.switches) == 8 + 8 + 2
    assert len(t.links) == 32 + 32 + 8 * 2
    assert nodes_on_route(t, 1, 5) == [1, "rail0.1", 5]  # same rail: one rail switch
    assert nodes_on_route(t, 1, 6)[2].startswith("spine")  # another rail: through a spine
    assert nodes_on_route(t, 1, 17)[2].startswith("spine")  # same rail, other rail group
    assert nodes_on_route(t, 1, 2) == [1, "nvsw0", 2]


def test_torus_links_and_wraparound():
    assert len(torus([4, 4]).links) == 32
    assert len(torus([4, 4, 2]).links) == 32 + 32 + 16  # the size-2 dimension: one merged link per pair
    t3 = torus([4, 4, 4])
    assert all(t3.graph.degree(d) == 6 for d in range(64))
    t = torus([4, 4], link_bandwidth=50e9, link_latency=1e-6)
    assert t.device_forwarding and [lv.group_size for lv in t.levels] == [4, 16]
    assert nodes_on_route(t, 3, 0) == [3, 0]  # the wraparound link
    # a row ring uses the wrap link: no contention, the one-level ring formula
    expect = 2 * (3 / 4 * S / 50e9 + 3 * 1e-6)
    assert collective_time("all_reduce", t, [0, 1, 2, 3], S) == pytest.approx(expect, rel=1e-12)


def test_from_cluster_shape():
    c = Cluster.preset("dgx-a100", 64)
    t = from_cluster(c)
    assert len(t.switches) == 8 + 2 + 1 and len(t.links) == 3 * 64
    assert t.levels == c.levels


def test_hierarchy_is_inferred_without_a_hint():
    t = fat_tree(4, 8, nodes_per_leaf=2)
    bare = Topology("bare", t.device, t.num_devices, t.switches, t.links)
    assert [(lv.name, lv.group_size) for lv in bare.hierarchy()] == [("island", 8), ("network", 32)]
    assert GraphCluster(bare).levels[0].group_size == 8
    ring = torus([4, 4])
    assert [lv.group_size for lv in Topology("t", ring.device, 16, [], ring.links).hierarchy()] == [16]


# -- file format ---------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_save_load_roundtrip(tmp_path, suffix):
    t = calibrate({(0, 5): (1e9, 2e-5)}, base=fat_tree(4, 2, nodes_per_leaf=2, spines=2, oversubscription=2))
    path = str(tmp_path / f"topo.{suffix}")
    save_topology(t, path)
    back = load_topology(path)
    assert to_dict(back) == to_dict(t)
    assert back.fingerprint() == t.fingerprint()
    assert collective_time("all_reduce", back, range(8), S) == collective_time("all_reduce", t, range(8), S)
    t3 = torus([2, 3])
    assert to_dict(from_dict(json.loads(json.dumps(to_dict(t3))))) == to_dict(t3)


def _minimal():
    return {
        "format": "nest-fx-topology/1",
        "name": "two",
        "device": {"name": "gpu", "memory_bytes": "80GiB", "peak_flops": {"bf16": "312T"}, "mem_bandwidth": "2TB/s"},
        "nodes": {"devices": 2, "switches": ["sw"]},
        "links": [
            {"a": 0, "b": "sw", "bandwidth": "300GB/s", "latency": "2.5us"},
            {"a": 1, "b": "sw", "bandwidth": "300GB/s", "latency": "2.5us"},
        ],
    }


def test_quantities_in_files():
    t = from_dict(_minimal())
    assert t.links[0].bandwidth == 300e9 and t.links[0].latency == pytest.approx(2.5e-6)
    assert p2p_time(t, 0, 1, 3e9) == pytest.approx(5e-6 + 0.01)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format="x"), "format: must be"),
        (lambda d: d.pop("links"), "missing key(s) ['links']"),
        (lambda d: d.update(extra=1), "unknown key(s) ['extra']"),
        (lambda d: d["links"][1].update(bandwidth=-1), "links[1].bandwidth: must be > 0"),
        (lambda d: d["links"][1].update(bandwidth="fast"), "links[1].bandwidth"),
        (lambda d: d["links"][0].update(latency="2 parsecs"), "links[0].latency"),
        (lambda d: d["links"][1].update(b="sw9"), "links[1].b: unknown node 'sw9'"),
        (lambda d: d["links"][1].update(a=0), "links[1]: a second link between 0 and 'sw'"),
        (lambda d: d["links"][1].update(b=1), "links[1]: a link must join two different nodes"),
        (lambda d: d["links"][1].update(bandwith=1), "links[1]: unknown key(s) ['bandwith']"),
        (lambda d: d["nodes"].update(devices=3), "device(s) [2] have no link"),
        (lambda d: d["nodes"].update(devices=0), "nodes.devices"),
        (lambda d: d["nodes"].update(switches=["sw", "7"]), "nodes.switches[1]"),
        (lambda d: d["nodes"].update(switches=["sw", "sw"]), "nodes.switches[1]: duplicate"),
        (lambda d: d["device"].update(memory_bytes=0), "device.memory_bytes"),
        (
            lambda d: d.update(levels=[{"name": "n", "group_size": 1, "bandwidth": 1, "latency": 0}]),
            "levels[0].group_size: the outermost level must hold all 2 devices",
        ),
        (lambda d: d.update(measured=[{"src": 0, "dst": 0, "bandwidth": 1, "latency": 0}]), "src and dst must differ"),
    ],
)
def test_validation_errors_name_the_field(edit, message):
    d = _minimal()
    edit(d)
    with pytest.raises(TopologyError) as err:
        from_dict(d)
    assert message in str(err.value)
    assert isinstance(err.value, ValueError)


def test_disconnected_and_bad_files(tmp_path):
    dev = Cluster.preset("dgx-a100", 1).device
    with pytest.raises(TopologyError, match="not connected"):
        Topology("x", dev, 4, [], [Link(0, 1, 1e9, 0), Link(2, 3, 1e9, 0)])
    bad = tmp_path / "t.yaml"
    bad.write_text("format: [unclosed")
    with pytest.raises(TopologyError, match="t.yaml: not valid YAML"):
        load_topology(str(bad))
    with pytest.raises(TopologyError, match="must end in"):
        load_topology(str(tmp_path / "t.txt"))


# -- agreement with the hierarchical model -------------------------------------------------

PRESET_SIZES = [("dgx-a100", 128), ("dgx-h100", 64), ("h100-spine-leaf", 128), ("tpuv4-fat-tree", 96), ("cpu-gloo", 8)]
GROUPS = {
    "pair": [0, 1],
    "node": list(range(8)),
    "half-node": [2, 3, 4, 5],
    "rack-stride": [0, 8, 16, 24],
    "two-nodes": list(range(16)),
    "rack": list(range(32)),
    "cross-rack": [0, 32, 64],
    "racks": list(range(64)),
    "node-heads": [8 * i for i in range(12)],
    "stride-2": list(range(0, 96, 2)),
    "mixed": [1, 9, 33, 41],
}


@pytest.mark.parametrize("preset, devices", PRESET_SIZES)
def test_graph_agrees_with_hierarchical_model(preset, devices):
    cluster = Cluster.preset(preset, devices)
    topo = from_cluster(cluster)
    worst = 0.0
    for name, group in GROUPS.items():
        if max(group) >= devices:
            continue
        for kind in KINDS:
            for nbytes in (0.0, 1.0, 1e6, S):
                h = collectives.collective_time(kind, cluster, group, nbytes)
                g = collective_time(kind, topo, group, nbytes)
                assert g == pytest.approx(h, rel=1e-12, abs=0.0), (name, kind, nbytes)
                worst = max(worst, abs(g - h) / h if h else 0.0)
    for src, dst in [(0, 1), (0, 7), (0, 9), (3, 33), (5, 5)]:
        if dst < devices:
            assert p2p_time(topo, src, dst, S) == pytest.approx(collectives.p2p(cluster, src, dst, S), rel=1e-12)
    print(f"{preset}: worst relative difference {worst:.1e}")


def test_from_cluster_links_carry_the_path_bandwidth():
    # h100-spine-leaf: the spine (50 GB/s) sits behind the 12.5 GB/s leaf, so a device's spine
    # plane link carries 12.5 GB/s and cross-spine routes agree with the hierarchical p2p
    cluster = Cluster.preset("h100-spine-leaf", 128)
    topo = from_cluster(cluster)
    spine = [link.bandwidth for link in topo.links if "spine" in str(link.a) + str(link.b)]
    assert spine and set(spine) == {12.5e9}
    assert p2p_time(topo, 0, 100, S) == pytest.approx(1.5e-5 + S / 12.5e9, rel=1e-12)
    assert p2p_time(topo, 0, 100, S) == pytest.approx(collectives.p2p(cluster, 0, 100, S), rel=1e-12)


def test_unbalanced_sets_never_cost_more_than_the_hierarchical_model():
    cluster = Cluster.preset("dgx-a100", 64)
    topo = from_cluster(cluster)
    for group in ([0, 1, 2, 8], [0, 1, 2, 3, 4, 40], [7, 8, 9, 10, 11, 12, 13, 14, 15, 33]):
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            hierarchical = collectives.collective_time(kind, cluster, group, S)
            assert collective_time(kind, topo, group, S) <= hierarchical * (1 + 1e-12)


def test_pairwise_all_to_all_is_cheaper_than_staged_across_levels():
    topo = from_cluster(Cluster.preset("dgx-a100", 64))
    one_level = list(range(8))
    assert collective_time("all_to_all", topo, one_level, S, all_to_all="pairwise") == pytest.approx(
        collective_time("all_to_all", topo, one_level, S), rel=1e-12
    )
    staged = collective_time("all_to_all", topo, [8 * i for i in range(8)], S)
    pairwise = collective_time("all_to_all", topo, [8 * i for i in range(8)], S, all_to_all="pairwise")
    assert pairwise < staged
    assert collective_time("all_to_all", topo, [8 * i for i in range(8)], S, all_to_all="best") == pairwise


def test_bad_queries():
    topo = from_cluster(Cluster.preset("dgx-a100", 16))
    with pytest.raises(TopologyError, match="unknown collective kind"):
        collective_time("allreduce", topo, [0, 1], S)
    with pytest.raises(TopologyError, match="not a device"):
        collective_time("all_reduce", topo, [0, 16], S)
    with pytest.raises(TopologyError, match="shares devices"):
        concurrent_collective_time("all_reduce", topo, [[0, 1], [1, 2]], S)
    with pytest.raises(TopologyError, match="nbytes"):
        collective_time("all_reduce", topo, [0, 1], -1)
    assert collective_time("all_reduce", topo, [3], S) == 0.0 and p2p_time(topo, 4, 4, S) == 0.0


# -- contention ----------------------------------------------------------------------------


def test_contention_only_when_rings_share_a_link():
    cross = [[i, i + 4] for i in range(4)]  # 2 GPUs x 2 nodes per leaf: every pair crosses the spine
    inside = [[0, 1], [2, 3], [4, 5], [6, 7]]  # NVLink pairs
    over = fat_tree(4, 2, nodes_per_leaf=2, oversubscription=2.0)
    flat = fat_tree(4, 2, nodes_per_leaf=2, oversubscription=1.0)
    alone = collective_time("all_reduce", over, cross[0], S)
    assert collective_time("all_reduce", flat, cross[0], S) == alone
    assert concurrent_collective_time("all_reduce", flat, cross, S) == pytest.approx(alone, rel=1e-12)
    shared = concurrent_collective_time("all_reduce", over, cross, S)
    assert shared > 1.9 * alone  # 4 flows on an uplink of twice a NIC: half a NIC each
    per_group = concurrent_times("all_reduce", over, cross, S)
    assert max(per_group) == shared
    assert concurrent_collective_time("all_reduce", over, inside, S) == pytest.approx(
        collective_time("all_reduce", over, inside[0], S), rel=1e-12
    )


def test_d_mod_k_spreads_over_spines():
    t = fat_tree(4, 2, nodes_per_leaf=2, spines=2, oversubscription=1.0)
    cross = [[i, i + 4] for i in range(4)]
    assert concurrent_collective_time("all_reduce", t, cross, S) == pytest.approx(
        collective_time("all_reduce", t, cross[0], S), rel=1e-12
    )


def test_dp_sync_contention_of_a_plan():
    work = _workload()
    plan = uniform_plan(len(work), pp=1, tp=2, dp=8, num_microbatches=4)
    over = GraphCluster(fat_tree(4, 4, nodes_per_leaf=2, oversubscription=4.0))
    report = dp_sync_contention(plan, work, over)
    # both DP groups' cross-leaf rings share the 4:1 uplinks: that step runs at half speed
    assert report.slowdown > 1.2
    assert dp_sync_contention(plan, work, GraphCluster(fat_tree(4, 4, nodes_per_leaf=2))).slowdown == pytest.approx(1.0)
    assert report.isolated[0] == over.collective_time("all_reduce", plan.dp_group(0, 0), _grad_bytes(work, plan))
    healthy = dp_sync_contention(plan, work, GraphCluster(from_cluster(Cluster.preset("dgx-a100", 16))))
    assert healthy.slowdown == pytest.approx(1.0)


def _grad_bytes(work, plan):
    from nest_fx.cost.dp_sync_contention import stage_gradient_bytes
    from nest_fx.cost.options import CostOptions

    return stage_gradient_bytes(plan, work, CostOptions())[0]


# -- GraphCluster in the step-time model ---------------------------------------------------

_WORK = {}


def _workload():
    if "w" not in _WORK:
        _WORK["w"] = workload_for_model(MODEL, Cluster.preset("dgx-a100", 8))
    return _WORK["w"]


@pytest.mark.parametrize(
    "shape",
    [
        dict(pp=1, tp=1, dp=64),
        dict(pp=2, tp=4, dp=8),
        dict(pp=4, tp=2, dp=8, placement="replica-major"),
        dict(pp=2, tp=8, dp=4, zero=3),
    ],
)
def test_simulate_on_graph_cluster_matches_hierarchical(shape):
    cluster = Cluster.preset("dgx-a100", 64)
    work = _workload()
    plan = uniform_plan(len(work), num_microbatches=8, **shape)
    expect = simulate(plan, work, cluster)
    got = simulate(plan, work, GraphCluster(from_cluster(cluster)))
    assert got.step_s == pytest.approx(expect.step_s, rel=1e-12)
    assert got.breakdown == pytest.approx(expect.breakdown, rel=1e-12)


def _two_nodes_of_four():
    base = Cluster.preset("dgx-a100", 8)
    return Cluster("2x4", base.device, 8, [NetworkLevel("node", 4, 300e9, 5e-6), NetworkLevel("net", 8, 25e9, 1e-5)])


def _with_slow_pair(topo, pair=(0, 1), bandwidth=10e9):
    measured = pairwise_figures(topo)
    measured[pair] = (bandwidth, measured[pair][1])
    measured[pair[::-1]] = (bandwidth, measured[pair[::-1]][1])
    return calibrate(measured, base=topo)


def test_slow_link_changes_the_preferred_order():
    work = _workload()
    healthy = from_cluster(_two_nodes_of_four())
    slow = _with_slow_pair(healthy)
    # ZeRO-1: its gradient sync hides under backward (ZeRO-0's runs after it, on every link)
    plan = uniform_plan(len(work), pp=1, tp=2, dp=4, num_microbatches=4, zero=1)

    def costs(topo):
        return {
            name: (simulate(plan, work, GraphCluster(topo, perm)).step_s, perm)
            for name, perm in candidate_orders(topo, block=2).items()
        }

    base = costs(healthy)
    assert min(base.values())[0] == pytest.approx(base["node-major"][0])
    degraded = costs(slow)
    assert degraded["node-major"][0] > base["node-major"][0] * 1.02  # the TP pair {0, 1} is slow now
    best_time, best_perm = min(degraded.values())
    tp_groups = [set(best_perm[i : i + 2]) for i in range(0, 8, 2)]
    assert {0, 1} not in tp_groups
    assert best_time == pytest.approx(base["node-major"][0], rel=1e-9)  # the slow pair carries no TP traffic
    # the cost model's cache keeps graph results apart from the hierarchical ones
    cluster = _two_nodes_of_four()
    assert simulate(plan, work, cluster).step_s == pytest.approx(base["node-major"][0], rel=1e-12)


def test_with_order_maps_ranks_to_devices():
    gcl = GraphCluster(from_cluster(_two_nodes_of_four()))
    swapped = gcl.with_order([0, 4, 1, 5, 2, 6, 3, 7])
    assert swapped.devices_of([0, 1]) == [0, 4]
    assert swapped.collective_time("all_reduce", [0, 1], S) > gcl.collective_time("all_reduce", [0, 1], S)
    assert swapped.p2p_time(0, 2, S) == gcl.p2p_time(0, 1, S)
    assert swapped.cache_token != gcl.cache_token and swapped.cost_key != gcl.cost_key
    assert swapped.levels[0].group_size == 4
    assert swapped.level_index_of_group([0, 1]) == 1 and gcl.level_index_of_group([0, 1]) == 0
    assert [f for _, f in swapped.levels_spanned([0, 2])] == [2]
    with pytest.raises(TopologyError, match="order"):
        gcl.with_order([0, 1, 2])
    with pytest.raises(TopologyError, match="duplicate"):
        gcl.with_order([0, 0, 1, 2, 3, 4, 5, 6])


def test_rail_aligned_order_keeps_dp_on_a_rail():
    t = rail_optimized(4, 4, nodes_per_rail_group=4)
    orders = candidate_orders(t, block=2)
    perm = orders["rail-aligned"]
    # replicas of TP pairs alternate over the nodes, so a rank and its DP neighbour share a rail
    assert perm[:8] == [0, 1, 4, 5, 8, 9, 12, 13]


# -- calibration ---------------------------------------------------------------------------


def test_calibration_from_measurements_alone():
    dev = Cluster.preset("dgx-a100", 1).device
    t = calibrate({(0, 1): (100e9, 2e-6), (1, 0): (80e9, 3e-6), (1, 2): (10e9, 1e-5)}, device=dev)
    assert t.num_devices == 3 and len(t.links) == 2
    assert p2p_time(t, 0, 1, 1e9) == pytest.approx(3e-6 + 1e9 / 80e9)  # slower direction, larger latency
    with pytest.raises(TopologyError, match="no route from device 0 to device 2"):
        p2p_time(t, 0, 2, 1e9)
    with pytest.raises(TopologyError, match="device spec"):
        calibrate({(0, 1): (1e9, 0)})


def test_measured_route_derates_but_keeps_sharing_links():
    topo = from_cluster(_two_nodes_of_four())
    slow = _with_slow_pair(topo)
    assert p2p_time(slow, 0, 1, S) == pytest.approx(5e-6 + S / 10e9)
    assert p2p_time(slow, 0, 2, S) == p2p_time(topo, 0, 2, S)
    fast = calibrate({(0, 1): (1e15, 1e-6)}, base=topo)  # above the links: only the latency changes
    assert p2p_time(fast, 0, 1, S) == pytest.approx(1e-6 + S / 300e9)


# -- performance ---------------------------------------------------------------------------


def test_costing_1024_devices():
    """A ring over 1,024 devices and 128 concurrent groups are costed on each kind of topology
    (how long that takes: ``scripts/bench_topology.py``, its costing table)."""
    for build in (
        lambda: from_cluster(Cluster.preset("dgx-a100", 1024)),
        lambda: fat_tree(128, 8, nodes_per_leaf=4, spines=4, oversubscription=4.0),
        lambda: torus([8, 8, 16]),
    ):
        topo = build()
        ring = collective_time("all_reduce", topo, range(1024), S)
        groups = [[g + 128 * k for k in range(8)] for g in range(128)]
        together = concurrent_collective_time("all_reduce", topo, groups, S)
        assert ring > 0 and together >= collective_time("all_reduce", topo, groups[0], S) * (1 - 1e-12)
