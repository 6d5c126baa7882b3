"""The planner on graph topologies: cost curves, device orders in plans, placement search, slow links."""

import dataclasses
import json

import pytest

from nest_fx.workload import workload_for_model
from nest_fx.cluster import Cluster, NetworkLevel
from nest_fx.cluster.ordered import OrderedCluster, placed
from nest_fx.cost.step_time import simulate
from nest_fx.plan import Plan, PlanError, uniform_plan
from nest_fx.solver import SolverOptions, solve
from nest_fx.solver.placement import placements
from nest_fx.cluster.topology import (
    GraphCluster,
    calibrate,
    concurrent_times,
    fat_tree,
    from_cluster,
    pairwise_figures,
    rail_optimized,
    torus,
)
from nest_fx.cluster.topology.algorithms import KINDS, collective_curve
from nest_fx.cost.dp_sync_contention import contended_step_s, dp_sync_contention

MODEL = "llama:hidden=512,layers=8,heads=8,seq=256,vocab=1024"
# a fast search space: TP 2 forced (so a slow TP pair matters), every device used
TP2 = SolverOptions(
    tp_degrees=(2,),
    microbatch_sizes=(1, 2),
    zero_stages=(1,),
    schedules=(("1f1b", 1),),
    recompute=("none", "full"),
    max_stages=2,
    use_all_devices=True,
)
_CACHE = {}


def _workload():
    if "w" not in _CACHE:
        _CACHE["w"] = workload_for_model(MODEL, Cluster.preset("dgx-a100", 8))
    return _CACHE["w"]


def _two_nodes_of_four():
    base = Cluster.preset("dgx-a100", 8)
    return Cluster("2x4", base.device, 8, [NetworkLevel("node", 4, 300e9, 5e-6), NetworkLevel("net", 8, 25e9, 1e-5)])


def _derated(topo, pair, factor):
    """``topo`` with the route between ``pair`` measured at 1/``factor`` of its bandwidth."""
    measured = pairwise_figures(topo, [pair])
    bw, lat = measured[pair]
    return calibrate({pair: (bw / factor, lat)}, base=topo)


# -- cost curves: the graph collective model, resolved once per group ------------------------


@pytest.mark.parametrize(
    "topo",
    [
        fat_tree(4, 4, nodes_per_leaf=2, oversubscription=2.0),
        rail_optimized(4, 4, nodes_per_rail_group=2, oversubscription=2.0),
        torus([4, 4]),
        _derated(from_cluster(_two_nodes_of_four()), (0, 1), 30.0),
    ],
    ids=["fat-tree", "rail", "torus", "derated"],
)
def test_cost_curve_equals_running_the_schedule(topo):
    groups = [[0, 1], [0, 1, 2, 3], [0, 4, 8, 12], [1, 2, 5, 9, 14], list(range(0, 16, 2))]
    groups = [[d for d in g if d < topo.num_devices] for g in groups]
    for kind in KINDS:
        for group in groups:
            for mode in ("staged", "best"):
                curve = collective_curve(kind, topo, group, all_to_all=mode)
                for nbytes in (0.0, 1.0, 4e3, 1e6, 256e6):
                    expect = concurrent_times(kind, topo, [group], nbytes, all_to_all=mode)[0]
                    assert curve(nbytes) == pytest.approx(expect, rel=1e-12, abs=1e-18), (kind, group, nbytes)


def test_graph_cluster_shares_curves_across_orders():
    gcl = GraphCluster(fat_tree(2, 4))
    other = gcl.with_order([4, 5, 6, 7, 0, 1, 2, 3])
    t = gcl.collective_time("all_reduce", [4, 5], 1e6)
    assert other.collective_time("all_reduce", [0, 1], 1e6) == t  # the same devices: the same curve
    assert other._curves is gcl._curves and ("all_reduce", (4, 5)) in gcl._curves


# -- device_order in the plan file -------------------------------------------------------------


@pytest.mark.parametrize(
    "order, message",
    [
        ([0, 1, 2], "has 3 entries but the world has 4"),
        ([0, 1, 1, 3], r"device_order\[2\]: rank 1 appears twice"),
        ([0, 1, 2, 4], r"device_order\[3\]: 4 is out of range 0..3"),
        ([0, 1, 2, "3"], "entries must be integers"),
        ([0, None, 2, 3], "entries must be integers, got None"),
        ("0123", "must be a list"),
    ],
)
def test_device_order_must_be_a_permutation_of_the_world(order, message):
    plan = uniform_plan(4, tp=2, dp=2, world_size=4, device_order=order)
    with pytest.raises(PlanError, match=message) as info:
        plan.validate()
    assert "exactly once" in str(info.value) or "must be" in str(info.value)


def test_device_order_round_trips_and_identity_stays_absent(tmp_path):
    plan = uniform_plan(4, tp=2, dp=2, world_size=4, device_order=[0, 2, 1, 3])
    path = tmp_path / "p.json"
    plan.save(str(path))
    assert json.loads(path.read_text())["device_order"] == [0, 2, 1, 3]
    assert Plan.load(str(path)).device_order == [0, 2, 1, 3]
    uniform_plan(4, tp=2, dp=2, world_size=4).save(str(path))
    assert "device_order" not in json.loads(path.read_text())
    data = json.loads(path.read_text())
    data["device_order"] = [3, 2, 1]
    with pytest.raises(PlanError, match="device_order"):
        Plan.from_dict(data)


def test_simulate_honours_the_device_order_on_both_models():
    work = _workload()
    cluster = Cluster.preset("dgx-a100", 16)
    plan = uniform_plan(len(work), tp=2, dp=8, num_microbatches=2)
    spread = [d for k in range(8) for d in (k, k + 8)]  # each TP pair straddles the two nodes
    base = simulate(plan, work, cluster)
    moved = simulate(dataclasses.replace(plan, device_order=spread), work, cluster)
    assert moved.breakdown["tp_comm"] > 2 * base.breakdown["tp_comm"]  # NVLink 600 GB/s -> 25 GB/s network
    assert simulate(plan, work, cluster).step_s == base.step_s  # the memo keeps orders apart
    graph = GraphCluster(from_cluster(cluster))
    on_graph = simulate(dataclasses.replace(plan, device_order=spread), work, graph)
    assert on_graph.step_s == pytest.approx(moved.step_s, rel=1e-9)  # balanced groups: the models agree
    assert on_graph.step_s == simulate(plan, work, graph.with_order(spread)).step_s
    # orders compose: a view with an order, asked for a plan with another
    view = placed(cluster, spread)
    assert isinstance(view, OrderedCluster) and view.devices_of([0, 1, 2]) == [0, 8, 1]
    assert placed(view, [1, 0] + list(range(2, 16))).devices_of([0, 1]) == [8, 0]
    with pytest.raises(ValueError, match="order"):
        OrderedCluster(cluster, [0] * 16)


def test_dp_sync_contention_follows_the_device_order():
    work = _workload()
    gcl = GraphCluster(fat_tree(4, 4, nodes_per_leaf=2, oversubscription=4.0))
    plan = uniform_plan(len(work), tp=2, dp=8, num_microbatches=4)
    order = list(range(8, 16)) + list(range(8))
    with_order = dp_sync_contention(dataclasses.replace(plan, device_order=order), work, gcl)
    assert with_order == dp_sync_contention(plan, work, gcl.with_order(order))


# -- placement candidates and the search -----------------------------------------------------


def test_placements_per_tp_degree():
    hier, by_tp = placements(Cluster.preset("dgx-a100", 16), [1, 2, 4])
    assert [p.name for p in hier] == ["identity"] and by_tp == {1: [0], 2: [0], 4: [0]}
    gcl = GraphCluster(rail_optimized(4, 4))
    found, by_tp = placements(gcl, [1, 2, 4])
    names = [p.name for p in found]
    assert names[0] == "node-major" and found[0].device_order is None and found[0].cluster is gcl
    assert "rail-aligned/tp2" in names and set(by_tp) == {1, 2, 4} and all(by_tp[t][0] == 0 for t in by_tp)
    assert by_tp[4] == [0]  # blocks of a whole node: rail-aligned is node-major
    for p in found[1:]:
        assert sorted(p.device_order) == list(range(16))
        assert placed(gcl, p.device_order).cache_token == p.cluster.cache_token
    alone, _ = placements(gcl, [2], search=False)
    assert len(alone) == 1 and alone[0].device_order is None and alone[0].cluster is gcl
    # on a cluster with its own order, device_order is in the cluster's rank numbering
    shifted = gcl.with_order(list(range(4, 16)) + list(range(4)))
    again, _ = placements(shifted, [2])
    rail = next(p for p in again if p.name == "rail-aligned/tp2")
    same = next(p for p in found if p.name == "rail-aligned/tp2")
    assert placed(shifted, rail.device_order).order == same.cluster.order


def test_solve_is_exact_over_the_placements():
    work = _workload()
    gcl = GraphCluster(_derated(from_cluster(_two_nodes_of_four()), (0, 1), 30.0))
    found = solve(work, gcl, 32, TP2)
    assert found.complete and len(found.placements) >= 2
    each = {
        p.name: solve(work, p.cluster, 32, dataclasses.replace(TP2, search_placement=False)).result.step_s
        for p in found.placements
    }
    assert found.result.step_s == pytest.approx(min(each.values()), rel=1e-12)
    assert found.result.step_s == pytest.approx(each[found.placement], rel=1e-12)
    # the plan carries its order: simulating it again on the same cluster gives the prediction
    assert simulate(found.plan, work, gcl).step_s == found.result.step_s
    assert found.stats["dp_objective"] == pytest.approx(found.result.step_s, rel=1e-9)


def test_slow_link_moves_the_planners_placement():
    work = _workload()
    healthy_topo = from_cluster(_two_nodes_of_four())
    slow_topo = _derated(healthy_topo, (0, 1), 30.0)  # the pair (0, 1) at 1/30 of its NVLink bandwidth
    healthy, slow = GraphCluster(healthy_topo), GraphCluster(slow_topo)

    def tp_pairs(plan):
        order = plan.device_order or list(range(8))
        return [{order[r] for r in plan.tp_group(i, rep)} for i in range(plan.pp) for rep in range(plan.dp)]

    before = solve(work, healthy, 32, TP2)
    assert before.plan.uniform_tp == 2 and {0, 1} in tp_pairs(before.plan)  # TP runs over the pair
    after = solve(work, slow, 32, TP2)
    assert {0, 1} not in tp_pairs(after.plan) and after.plan.device_order is not None
    stale = simulate(before.plan, work, slow).step_s  # the healthy plan on the degraded network
    assert after.result.step_s < stale / 1.1  # 15% here
    assert after.result.step_s == pytest.approx(before.result.step_s, rel=1e-6)  # the pair carries no TP


def test_contention_stretches_the_exposed_dp_sync():
    # large parameters, tiny compute: the DP all-reduce is not hidden behind the backward
    work = workload_for_model("llama:hidden=2048,layers=2,heads=16,seq=32,vocab=1024", Cluster.preset("dgx-a100", 8))
    plan = uniform_plan(len(work), tp=2, dp=8, num_microbatches=1, zero=1)
    healthy = GraphCluster(fat_tree(4, 4, nodes_per_leaf=2, oversubscription=1.0))
    step, report = contended_step_s(plan, work, healthy)
    assert report.slowdown == pytest.approx(1.0) and step == pytest.approx(
        simulate(plan, work, healthy).step_s, rel=1e-12
    )
    over = GraphCluster(fat_tree(4, 4, nodes_per_leaf=2, oversubscription=4.0))
    alone = simulate(plan, work, over)
    step, report = contended_step_s(plan, work, over)
    assert report.slowdown > 1.2 and alone.breakdown["dp_sync_exposed"] > 0
    # the extra time is the stretched sync: (slowdown - 1) x the stage's DP sync
    assert step - alone.step_s == pytest.approx((report.slowdown - 1) * alone.stages[0].dp_sync, rel=1e-9)
