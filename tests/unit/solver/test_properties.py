"""Property tests (hypothesis) for the parsers and the planner on random clusters and workloads.

* the solver either returns a plan or raises NoFeasiblePlan with a reason, never anything else;
* every returned plan fits: re-simulated, each stage's memory is within the usable device memory
  and is what the solver reported;
* with a time budget the solver returns within 20 readings of its deadline (on a fake clock);
* Cluster / Plan / Workload survive their file form unchanged, and random garbage is refused
  with our own error types only.
"""

from __future__ import annotations

import functools
import json
import math
import time
from unittest import mock

import pytest
from conftest import FakeClock
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nest_fx.cluster import Cluster, ClusterError, DeviceSpec, NetworkLevel
from nest_fx.cost.step_time import simulate
from nest_fx.plan import Plan, PlanError, StagePlan
from nest_fx.solver import NoFeasiblePlan, SolverOptions, solve
from nest_fx.workload import Workload, WorkloadError, workload_from_table, workload_to_table

GiB = 2**30
OUR_ERRORS = (ClusterError, PlanError, WorkloadError)
SMALL_SPACE = dict(
    tp_degrees=(1, 2, 4), microbatch_sizes=(1, 2), schedules=(("1f1b", 1), ("interleaved", 2)), max_stages=4
)

# -- strategies ----------------------------------------------------------------------------


@st.composite
def clusters(draw, max_devices: int = 64) -> Cluster:
    """A valid hierarchy: 1-3 levels, each group size a multiple (x2..x8) of the one inside,
    bandwidths 0.1-1000 GB/s, latencies 0-100 us, a device with 0.25-84 GiB and 1-1000 TFLOP/s
    (log-uniform, so that memory binds as often as not)."""
    sizes = [draw(st.sampled_from([1, 2, 4, 8]))]
    for _ in range(draw(st.integers(0, 2))):
        sizes.append(sizes[-1] * draw(st.sampled_from([2, 4, 8])))
    if len(sizes) > 1 and sizes[0] == 1:
        sizes = sizes[1:]
    devices = draw(st.integers(1, min(sizes[-1], max_devices)))
    levels = [
        NetworkLevel(f"l{i}", size, 10 ** draw(st.floats(8, 12)), draw(st.floats(0, 1e-4)))
        for i, size in enumerate(sizes)
    ]
    flops = 10 ** draw(st.floats(12, 15))
    device = DeviceSpec(
        "dev", 2 ** draw(st.floats(-2, 6.4)) * GiB, {"bf16": flops, "fp32": flops / 8}, draw(st.floats(1e11, 4e12))
    )
    return Cluster(draw(st.sampled_from(["c", "my cluster"])), device, devices, levels)


def _variant(draw, tp: int, mbs: int, scale: float) -> dict:
    fwd = 10 ** draw(st.floats(-5, -1)) * scale / tp
    params = 10 ** draw(st.floats(5, 8.7)) / tp
    act = 10 ** draw(st.floats(5, 9.5)) * mbs / tp
    v = {
        "tp": tp,
        "ep": 1,
        "mbs": mbs,
        "fwd_s": fwd,
        "bwd_s": fwd * draw(st.floats(1, 3)),
        "num_params": params,
        "param_bytes": 2 * params,
        "act_bytes": {"none": act, "selective": act / 2, "full": act / 20},
        "recompute_s": {"none": 0.0, "selective": fwd / 4, "full": fwd},
        "out_bytes": draw(st.floats(0, 1e8)) * mbs,
        "comms": [],
    }
    if tp > 1 and draw(st.booleans()):
        v["comms"] = [
            {
                "kind": "all_reduce",
                "group": "tp",
                "nbytes": draw(st.floats(0, 1e8)),
                "phase": p,
                "count": draw(st.integers(1, 2)),
            }
            for p in ("fwd", "bwd")
        ]
    return v


@st.composite
def tables(draw, max_blocks: int = 5) -> dict:
    """A ``nest-fx-workload/1`` table: optional head and tail, 1..max_blocks blocks of 1-2
    signatures, costs for a random subset of tp in {1, 2, 4} (not always tp=1) and mbs 1 (and 2)."""
    blocks = draw(st.lists(st.sampled_from(["a", "b"]), min_size=1, max_size=max_blocks))
    layers = [{"name": "head", "kind": "head", "signature": "e"}] if draw(st.booleans()) else []
    layers += [
        {"name": f"layers.{i}", "kind": "block", "signature": s, "flops_per_sample": 1e9} for i, s in enumerate(blocks)
    ]
    layers += [{"name": "tail", "kind": "tail", "signature": "t"}] if draw(st.booleans()) else []
    tps = sorted(draw(st.sets(st.sampled_from([1, 2, 4]), min_size=1)))
    mbss = [1, 2] if draw(st.booleans()) else [1]
    costs = {}
    for key in sorted({f"{ly['kind']}:{ly['signature']}" for ly in layers}):
        scale = draw(st.floats(0.1, 10))
        costs[key] = [_variant(draw, tp, mbs, scale) for tp in tps for mbs in mbss]
    dims = {"seq_len": draw(st.integers(1, 4096)), "heads": draw(st.sampled_from([0, 4, 6, 8]))}
    return {"format": "nest-fx-workload/1", "model": "random", "dims": dims, "layers": layers, "costs": costs}


@functools.lru_cache(maxsize=None)
def _traced(spec: str) -> Workload:
    from nest_fx.workload import workload_for_model

    return workload_for_model(spec, Cluster.preset("dgx-a100", 8))


TRACED = [
    "llama:hidden=64,layers=3,heads=4,kv=2,seq=64,vocab=256",
    "moe:hidden=64,layers=2,heads=4,seq=32,vocab=128,experts=4",
]


@st.composite
def workloads(draw) -> Workload:
    """A random layer table (most draws) or a small traced model (dense or MoE)."""
    if draw(st.integers(0, 4)) == 0:
        return _traced(draw(st.sampled_from(TRACED)))
    return workload_from_table(draw(tables()))


@st.composite
def plans(draw) -> Plan:
    """A valid plan: contiguous stages, any knobs, optionally a device order."""
    n = draw(st.integers(1, 12))
    pp = draw(st.integers(1, n))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=pp - 1, max_size=pp - 1))) if pp > 1 else []
    bounds = [0, *cuts, n]
    stages = [
        StagePlan(a, b, draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from(["none", "selective", "full"])))
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    ep = draw(st.sampled_from([1, 2]))
    dp = ep * draw(st.integers(1, 4))
    shortest = min(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    schedule = draw(st.sampled_from(["1f1b", "gpipe"] + (["interleaved"] if shortest >= 2 else [])))
    v = draw(st.integers(2, min(3, shortest))) if schedule == "interleaved" else 1  # a layer per model chunk
    m = pp * draw(st.integers(1, 4)) if schedule == "interleaved" else draw(st.integers(1, 16))
    plan = Plan(
        stages=stages,
        dp=dp,
        ep=ep,
        zero=draw(st.integers(0, 3)),
        microbatch_size=draw(st.integers(1, 4)),
        num_microbatches=m,
        schedule=schedule,
        virtual_stages=v,
        sequence_parallel=draw(st.booleans()),
        placement=draw(st.sampled_from(["stage-major", "replica-major"])),
        model=draw(st.text(max_size=8)),
        num_layers=n,
        notes=draw(st.text(max_size=8)),
        predicted={"step_s": draw(st.floats(0, 10)), "tokens_per_s": draw(st.floats(0, 1e6))},
    )
    world = plan.devices_used + draw(st.integers(0, 4))
    if draw(st.booleans()):
        plan.world_size = world
        if draw(st.booleans()):
            plan.device_order = draw(st.permutations(range(world)))
    plan.validate()
    return plan


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def _damaged(draw, doc):
    """``doc`` with one value somewhere replaced by a random JSON value (or deleted)."""
    doc = json.loads(json.dumps(doc))
    node, path = doc, []
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append((node, key))
        node = node[key]
    if not path:
        return draw(json_values)
    parent, key = path[-1]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[key]
    else:
        parent[key] = draw(json_values)
    return doc


# -- the planner ----------------------------------------------------------------------------


def _check_plan(found, workload: Workload, cluster: Cluster, global_batch: int, options: SolverOptions) -> None:
    plan = found.plan
    assert plan.global_batch == global_batch and plan.devices_used <= cluster.num_devices
    again = simulate(plan, workload, cluster, options.cost)
    capacity = cluster.device.memory_bytes * options.cost.usable_memory_fraction
    assert again.feasible and found.result.feasible
    assert again.step_s == pytest.approx(found.result.step_s, rel=1e-9)
    assert plan.predicted["step_s"] == pytest.approx(again.step_s, rel=1e-9)
    for mine, reported in zip(again.stages, found.result.stages):
        assert mine.memory["total"] <= capacity
        assert mine.memory["total"] == pytest.approx(reported.memory["total"], rel=1e-9)
    assert plan.predicted["peak_memory_bytes"] == pytest.approx(max(s.memory["total"] for s in again.stages))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads(), cluster=clusters(), global_batch=st.integers(1, 16))
def test_solver_returns_a_plan_that_fits_or_says_why_not(workload, cluster, global_batch):
    options = SolverOptions(**SMALL_SPACE, time_budget=10)
    try:
        found = solve(workload, cluster, global_batch, options)
    except NoFeasiblePlan as exc:
        assert str(exc).strip()
        return
    _check_plan(found, workload, cluster, global_batch, options)
    for s in found.plan.stages:  # the planner keeps to the variants the workload has costs for
        assert workload.supports(s.tp, found.plan.ep, found.plan.sequence_parallel)


@st.composite
def big_instances(draw):
    """Deep chains of identical blocks on up to 4,096 devices: searches that take seconds."""
    table = draw(tables(max_blocks=1))
    block = next(ly for ly in table["layers"] if ly["kind"] == "block")
    table["layers"] += [dict(block, name=f"more.{i}") for i in range(draw(st.integers(16, 80)))]
    table["dims"]["heads"] = draw(st.sampled_from([0, 8, 64]))  # every drawn tp divides it
    heavier = 10 ** draw(st.floats(0.3, 1.5))  # up to ~2.5e10 parameters per block: only deep pipelines fit
    for v in table["costs"][f"block:{block['signature']}"]:
        v["num_params"] *= heavier
        v["param_bytes"] *= heavier
    memory = draw(st.sampled_from([4, 16, 40, 80]))
    cluster = Cluster.preset(
        draw(st.sampled_from(["dgx-a100", "h100-spine-leaf", "tpuv4-fat-tree"])),
        draw(st.sampled_from([256, 1024, 4096])),
    )
    cluster.device.memory_bytes = memory * GiB
    return workload_from_table(table), cluster, draw(st.sampled_from([256, 1024, 4096]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instance=big_instances(), budget=st.floats(0.1, 0.8))
def test_solver_returns_within_its_time_budget(instance, budget):
    workload, cluster, global_batch = instance
    options = SolverOptions(time_budget=budget)
    clock = FakeClock(1e-3)  # 1 ms per reading: deterministic under any load
    with mock.patch.object(time, "perf_counter", clock):
        try:
            found = solve(workload, cluster, global_batch, options)
        except NoFeasiblePlan as exc:
            assert str(exc).strip()
            found = None
    assert clock.now <= budget + 0.02
    if found is not None:
        _check_plan(found, workload, cluster, global_batch, options)


# -- file forms -----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(cluster=clusters(max_devices=4096))
def test_cluster_round_trips(cluster):
    assert Cluster.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster


@settings(max_examples=100, deadline=None)
@given(plan=plans())
def test_plan_round_trips(plan):
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan


@settings(max_examples=60, deadline=None)
@given(table=tables())
def test_workload_round_trips(table):
    work = workload_from_table(table)
    tps = sorted({v["tp"] for vs in table["costs"].values() for v in vs if work.dims.tp_ok(v["tp"])})
    assume(tps)  # to_table writes only the degrees that divide the heads
    mbss = sorted({v["mbs"] for vs in table["costs"].values() for v in vs})
    written = workload_to_table(work, tps=tps, mbss=mbss)
    again = workload_from_table(json.loads(json.dumps(written)))
    assert workload_to_table(again, tps=tps, mbss=mbss) == written
    assert [layer.name for layer in again.layers] == [ly["name"] for ly in table["layers"]]
    for i in range(len(work)):
        for tp in tps:
            for mbs in mbss:
                assert again.cost(i, tp, 1, mbs) == work.cost(i, tp, 1, mbs)


def _only_our_errors(parse, doc) -> None:
    try:
        parse(doc)
    except OUR_ERRORS as exc:
        message = str(exc)
        assert message and "\n" not in message and len(message) < 600
    # anything else propagates and fails the test


@settings(max_examples=150, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["cluster", "plan", "workload"]))
def test_garbage_raises_only_our_errors(data, kind):
    if kind == "cluster":
        base, parse = data.draw(clusters()).to_dict(), Cluster.from_dict
    elif kind == "plan":
        base, parse = data.draw(plans()).to_dict(), Plan.from_dict
    else:
        base, parse = data.draw(tables()), workload_from_table
    doc = data.draw(json_values) if data.draw(st.booleans()) else _damaged(data.draw, base)
    _only_our_errors(parse, doc)


@settings(max_examples=60, deadline=None)
@given(table=tables(), tp=st.sampled_from([1, 2, 4, 8]), sp=st.booleans())
def test_supported_variants_are_the_costable_ones(table, tp, sp):
    """``supports`` answers exactly when every layer can be costed (so the solver never asks
    a table for a variant it lacks)."""
    work = workload_from_table(table)
    try:
        costs = [work.cost(i, tp, 1, 1, sp) for i in range(len(work))]
    except WorkloadError:
        costs = None
    shapes_ok = work.dims.tp_ok(tp)
    assert work.supports(tp, 1, sp) == (costs is not None and shapes_ok)
    if costs is not None:
        assert all(math.isfinite(c.fwd_s) for c in costs)
