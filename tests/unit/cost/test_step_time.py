"""Step-time and memory of a plan: formulas by hand and invariants."""

import dataclasses

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.workload import workload_for_model
from nest_fx.cluster import Cluster, NetworkLevel
from nest_fx.cluster import hierarchical_collectives
from nest_fx.cost import collectives
from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import pipeline_time, simulate
from nest_fx.plan import Plan, PlanError, StagePlan, uniform_plan

MODEL = "llama:hidden=512,layers=8,heads=8,seq=256,vocab=1024"


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("dgx-a100:64")


@pytest.fixture(scope="module")
def work(cluster):
    return workload_for_model(MODEL, cluster)


def scaled_bandwidth(cluster: Cluster, factor: float) -> Cluster:
    levels = [NetworkLevel(lv.name, lv.group_size, lv.bandwidth * factor, lv.latency) for lv in cluster.levels]
    return dataclasses.replace(cluster, levels=levels)


def test_pipeline_formula_by_hand():
    # 1F1B: (m-1) max + sum
    assert pipeline_time([1.0, 2.0, 1.5], 8, "1f1b") == (7 * 2.0 + 4.5, 7 * 2.0 + 4.5 - 16.0)
    # interleaved with v chunks: m max + (sum - max)/v
    total, bubble = pipeline_time([2.0, 2.0, 2.0, 2.0], 8, "interleaved", v=2)
    assert total == 8 * 2.0 + 6.0 / 2 and bubble == pytest.approx(3.0)
    # uniform stages reproduce Narayanan et al. 2021's bubble fraction (p-1)/m
    total, bubble = pipeline_time([1.0] * 4, 16, "1f1b")
    assert bubble / (16 * 1.0) == pytest.approx(3 / 16)


def test_single_device_step_is_layer_sum(work, cluster):
    plan = uniform_plan(len(work), pp=1, tp=1, dp=1, num_microbatches=4)
    r = simulate(plan, work, cluster)
    per_mb = sum(work.cost(i).fwd_s + work.cost(i).bwd_s for i in range(len(work)))
    assert r.breakdown["compute"] == pytest.approx(4 * per_mb)
    assert r.breakdown["bubble"] == pytest.approx(0.0, abs=1e-12)
    assert r.breakdown["dp_sync_exposed"] == 0
    assert r.step_s == pytest.approx(4 * per_mb + r.breakdown["optimizer"])
    assert r.tokens_per_s == pytest.approx(4 * 256 / r.step_s)


def test_data_parallel_sync_without_overlap_is_one_allreduce(work, cluster):
    from nest_fx.cost.options import CostOptions

    plan = uniform_plan(len(work), pp=1, tp=1, dp=16, num_microbatches=1)
    r = simulate(plan, work, cluster, CostOptions(overlap_grad_sync=False))
    grads = sum(work.cost(i).num_params for i in range(len(work))) * 2
    expected = hierarchical_collectives.all_reduce(cluster, list(range(16)), grads)
    assert r.breakdown["dp_sync_exposed"] == pytest.approx(expected)
    overlapped = simulate(plan, work, cluster)
    assert overlapped.breakdown["dp_sync_exposed"] <= r.breakdown["dp_sync_exposed"]


def test_zero0_sync_runs_after_backward_fsdp_overlaps(work, cluster):
    from nest_fx.cost.options import CostOptions

    exposed = {}
    for zero in (0, 1):
        plan = uniform_plan(len(work), pp=1, tp=1, dp=16, num_microbatches=1, zero=zero)
        exposed[zero] = [
            simulate(plan, work, cluster, CostOptions(overlap_grad_sync=o)).breakdown["dp_sync_exposed"]
            for o in (True, False)
        ]
    # the runtime's ZeRO-0 all-reduce starts after backward (GradientSync): nothing to overlap
    assert exposed[0][0] == exposed[0][1] > 0
    # FSDP reduces during backward
    assert exposed[1][0] < exposed[1][1]


def test_runtime_call_overheads_add_per_collective(work, cluster):
    from nest_fx.cost.options import CostOptions

    a, b = 2e-3, 1e-9
    tp_plan = uniform_plan(len(work), pp=1, tp=4, dp=1, num_microbatches=2)
    base = simulate(tp_plan, work, cluster)
    slow = simulate(tp_plan, work, cluster, CostOptions(tp_call_overhead=(a, b)))
    calls = [(c.count, c.nbytes) for i in range(len(work)) for c in work.cost(i, tp=4).comms]
    assert len(calls) > 8
    per_mb = sum(n * (a + b * nbytes) for n, nbytes in calls)
    assert slow.stages[0].tp_comm - base.stages[0].tp_comm == pytest.approx(per_mb)
    assert slow.breakdown["tp_comm"] - base.breakdown["tp_comm"] == pytest.approx(2 * per_mb)
    # the host work is per TP region: sequence parallelism's all-gather + reduce-scatter pair
    # costs what plain TP's all-reduce does; the first block's slice and the gather before the tail
    # (workload.sequence_edges) are calls of their own
    sp_plan = uniform_plan(len(work), pp=1, tp=4, dp=1, num_microbatches=2, sequence_parallel=True)
    sp_extra = (
        simulate(sp_plan, work, cluster, CostOptions(tp_call_overhead=(a, b))).breakdown["tp_comm"]
        - simulate(sp_plan, work, cluster).breakdown["tp_comm"]
    )
    edges = [
        c
        for i in range(len(work))
        for c in work.cost(i, tp=4, sp=True).comms[len(work.own_cost(i, tp=4, sp=True).comms) :]
    ]
    assert len(edges) == 2
    assert sp_extra == pytest.approx(2 * (per_mb + sum(a + b * c.nbytes for c in edges)))
    # without TP there is no TP collective to pay for
    one = uniform_plan(len(work), pp=1, tp=1, dp=1, num_microbatches=2)
    assert (
        simulate(one, work, cluster, CostOptions(tp_call_overhead=(a, b))).step_s == simulate(one, work, cluster).step_s
    )

    # FSDP: ZeRO-3 with m microbatches issues 2m all-gathers and m reduce-scatters per unit
    m, dp = 2, 8
    z3 = uniform_plan(len(work), pp=1, tp=1, dp=dp, num_microbatches=m, zero=3)
    base, slow = simulate(z3, work, cluster), simulate(z3, work, cluster, CostOptions(fsdp_call_overhead=(a, b)))
    units = sum(1 for layer in work.layers if layer.kind == "block") + 1  # blocks + the root
    params = sum(work.cost(i).num_params for i in range(len(work)))
    extra = units * 3 * m * a + b * params * (2 * m * 2 + m * 2)  # bf16 parameters and gradients
    assert slow.stages[0].dp_sync - base.stages[0].dp_sync == pytest.approx(extra)
    z0 = uniform_plan(len(work), pp=1, tp=1, dp=dp, num_microbatches=m, zero=0)
    assert (
        simulate(z0, work, cluster, CostOptions(fsdp_call_overhead=(a, b))).step_s == simulate(z0, work, cluster).step_s
    )


def test_tensor_parallel_comm_matches_collectives(work, cluster):
    plan = uniform_plan(len(work), pp=1, tp=4, dp=1, num_microbatches=1)
    r = simulate(plan, work, cluster)
    expected = 0.0
    for i in range(len(work)):
        for c in work.cost(i, tp=4).comms:
            expected += c.count * collectives.collective_time(c.kind, cluster, [0, 1, 2, 3], c.nbytes)
    assert r.breakdown["tp_comm"] == pytest.approx(expected)


@pytest.mark.parametrize("placement", ["stage-major", "replica-major"])
def test_more_bandwidth_is_never_slower(work, cluster, placement):
    plan = uniform_plan(len(work), pp=2, tp=4, dp=4, num_microbatches=8, placement=placement, zero=1)
    times = [simulate(plan, work, scaled_bandwidth(cluster, f)).step_s for f in (0.25, 1.0, 4.0)]
    assert times[0] >= times[1] >= times[2]
    assert times[0] > times[2]


def test_zero_stages_reduce_memory(work, cluster):
    mems = []
    for zero in (0, 1, 2, 3):
        plan = uniform_plan(len(work), pp=1, tp=1, dp=8, num_microbatches=2, zero=zero)
        mems.append(simulate(plan, work, cluster).stages[0].memory)
    totals = [m["total"] for m in mems]
    assert totals[3] < totals[2] < totals[1] < totals[0]
    assert mems[1]["optimizer"] == pytest.approx(mems[0]["optimizer"] / 8)
    assert mems[2]["grads"] == pytest.approx(mems[0]["grads"] / 8)
    assert mems[3]["weights"] == pytest.approx(mems[0]["weights"] / 8)


def test_recompute_trades_memory_for_time(work, cluster):
    res = {}
    for mode in ("none", "op", "every:2", "full"):
        plan = uniform_plan(len(work), pp=2, tp=1, dp=1, num_microbatches=8, recompute=mode)
        res[mode] = simulate(plan, work, cluster)
    act = {k: v.stages[0].memory["activations"] for k, v in res.items()}
    assert act["full"] < act["op"] < act["none"] and act["full"] < act["every:2"] < act["none"]
    assert res["full"].step_s > res["op"].step_s > res["none"].step_s
    assert res["full"].step_s > res["every:2"].step_s > res["none"].step_s


def test_1f1b_holds_fewer_microbatches_than_gpipe(work, cluster):
    a = simulate(uniform_plan(len(work), pp=4, num_microbatches=16, schedule="1f1b"), work, cluster)
    b = simulate(uniform_plan(len(work), pp=4, num_microbatches=16, schedule="gpipe"), work, cluster)
    assert a.stages[0].memory["activations"] < b.stages[0].memory["activations"]
    assert a.step_s == pytest.approx(b.step_s)
    # the last 1F1B stage holds one microbatch, the first p
    per_layer_first = a.stages[0].memory["activations"]
    assert a.stages[-1].memory["activations"] < per_layer_first


def test_pipeline_boundary_cost_follows_network_level(work):
    """The same plan is slower when its stage boundary crosses racks instead of nodes."""
    cl = load_cluster("h100-spine-leaf:64")
    near = Plan(stages=[StagePlan(0, 5, 4), StagePlan(5, 10, 4)], dp=1, num_microbatches=8, num_layers=10)
    r_near = simulate(near, work, cl)  # stage 1 starts at rank 4: same node
    far = Plan(stages=[StagePlan(0, 5, 4), StagePlan(5, 10, 4)], dp=8, num_microbatches=8, num_layers=10)
    r_far = simulate(far, work, cl)  # stage 1 starts at rank 32: another rack
    assert r_far.stages[1].p2p > r_near.stages[1].p2p
    assert r_near.stages[0].p2p == 0


def test_infeasible_plan_names_binding_term(cluster):
    big = workload_for_model("llama2-7b", cluster, seq=4096)
    plan = uniform_plan(len(big), pp=1, tp=1, dp=1, num_microbatches=1)
    r = simulate(plan, big, cluster)
    assert not r.feasible
    assert "stage 0" in r.binding and "optimizer" in r.binding  # 16 bytes/param * 6.7B > 80 GiB
    fits = simulate(
        uniform_plan(len(big), pp=2, tp=8, dp=1, num_microbatches=4, recompute="selective", sequence_parallel=True),
        big,
        cluster,
    )
    assert fits.feasible and fits.binding == ""


def test_plan_world_size_mismatch_is_refused(work):
    small = load_cluster("dgx-a100:8")
    with pytest.raises(PlanError, match="world has 8"):
        simulate(uniform_plan(len(work), pp=2, tp=4, dp=2), work, small)


@pytest.mark.parametrize(
    "optimizer, kernel, update, states",
    [
        # torch's default on a GPU ('') is foreach: the passes of _multi_tensor_adam / _multi_tensor_sgd
        ("adam", "", 72, 12),
        ("adamw", "", 80, 12),
        ("sgd-momentum", "", 32, 8),
        ("sgd", "", 12, 4),
        ("adamw", "for-loop", 80, 12),
        ("adamw", "fused", 28, 12),  # one read of grad, param, m, v; one write of param, m, v
        ("sgd-momentum", "fused", 20, 8),
    ],
)
def test_optimizer_sets_state_bytes_and_update_traffic(work, cluster, optimizer, kernel, update, states):
    plan = uniform_plan(len(work), pp=1, tp=1, dp=4, zero=1, num_microbatches=2)
    r = simulate(plan, work, cluster, CostOptions(optimizer=optimizer, optimizer_kernel=kernel))
    params = sum(work.cost(i).num_params for i in range(len(work)))
    # ZeRO-1: each rank updates 1/dp of the parameters, memory-bound at 70% of HBM bandwidth
    assert r.breakdown["optimizer"] == pytest.approx(params / 4 * update / (cluster.device.mem_bandwidth * 0.7))
    assert r.stages[0].memory["optimizer"] == pytest.approx(params * states / 4)


def test_state_free_sgd_needs_less_memory_and_a_shorter_step_than_adam(work, cluster):
    plan = uniform_plan(len(work), pp=1, tp=1, dp=1, num_microbatches=2)
    adam, sgd = (simulate(plan, work, cluster, CostOptions(optimizer=o)) for o in ("adam", "sgd"))
    assert sgd.stages[0].memory["total"] < adam.stages[0].memory["total"]
    assert sgd.step_s < adam.step_s
    assert sgd.breakdown["compute"] == adam.breakdown["compute"]


def test_unknown_optimizer_is_refused_with_the_names():
    with pytest.raises(ValueError, match="sgd-momentum"):
        CostOptions(optimizer="lamb")
