"""The pipeline boundary term P_i prices what nest-fx's runtime sends (``step_time.p2p_time``):
under sequence parallelism each TP rank sends its sequence shard of a layer block's output and no
collective runs at the boundary; without it (or after the head) the whole tensor. The runtime's
bytes are counted on gloo ranks in ``tests/distributed/apply/test_pipeline_sequence_shards.py``."""

from __future__ import annotations

import pytest

from nest_fx.cost import collectives
from nest_fx.cost.options import CostOptions
from nest_fx.cost.stage_terms import stage_groups
from nest_fx.cost.step_time import boundary_bytes, simulate, stage_variant
from nest_fx.plan import Plan, StagePlan
from nest_fx.workload import workload_for_model
from cluster_fixtures import h100ish

MODEL = "llama:hidden=512,layers=4,heads=8,seq=256,vocab=1024"
CLUSTER = h100ish(16)


@pytest.fixture(scope="module")
def work():
    return workload_for_model(MODEL, CLUSTER, seq=256)


def _plan(cuts, tps, sp: bool, dp: int = 1) -> Plan:
    bounds = [0, *cuts]
    return Plan(
        stages=[StagePlan(a, b, tp, "none") for a, b, tp in zip(bounds, bounds[1:], tps)],
        num_layers=bounds[-1],
        dp=dp,
        microbatch_size=1,
        num_microbatches=4,
        sequence_parallel=sp,
    )


def _p2p(plan: Plan, nbytes: float) -> float:
    return max(collectives.p2p(CLUSTER, a, b, nbytes) for a, b in stage_groups(plan, 1).p2p)


def _out(work, plan: Plan, layer: int) -> float:
    return work.cost(layer, stage_variant(plan, 0)).out_bytes


@pytest.mark.parametrize("sp", [True, False])
def test_a_layer_boundary_sends_the_shard_under_sp_else_the_whole_tensor(work, sp):
    n = len(work)
    plan = _plan([n // 2, n], [4, 4], sp, dp=2)  # 16 devices: the stages on two nodes
    out = _out(work, plan, n // 2 - 1)
    assert work.cost(n // 2 - 1, stage_variant(plan, 0)).block and out > 0
    sent = out / 4 if sp else out
    assert boundary_bytes(out, 4, sp) == sent
    p2p = simulate(plan, work, CLUSTER).stages[1].p2p
    assert p2p == _p2p(plan, sent)  # no all-gather at the boundary
    if sp:  # the old scatter/gather price: the shard, then an all-gather in the receiving TP group
        gather = max(collectives.collective_time("all_gather", CLUSTER, g, out) for g in stage_groups(plan, 1).tp)
        assert p2p < _p2p(plan, sent) + gather


def test_after_the_head_the_whole_embedding_output_crosses(work):
    plan = _plan([1, len(work)], [2, 2], True)
    out = _out(work, plan, 0)
    assert not work.cost(0, stage_variant(plan, 0)).block
    assert simulate(plan, work, CLUSTER).stages[1].p2p == _p2p(plan, out)


def test_stages_of_different_tp_degrees_price_the_gather_and_slice(work):
    """The runtime refuses them (``apply.mesh.require_uniform_tp``); the price is the whole tensor
    and, under SP, the sender's all-gather and the receiver's slice's backward all-gather, each
    once per microbatch (P_i is counted forward and backward)."""
    n = len(work)
    for sp in (False, True):
        plan = _plan([n // 2, n], [2, 4], sp)
        out = _out(work, plan, n // 2 - 1)
        expected = _p2p(plan, out)
        if sp:
            gathers = [
                max(collectives.collective_time("all_gather", CLUSTER, g, out) for g in stage_groups(plan, i).tp)
                for i in (0, 1)
            ]
            expected += sum(gathers) / 2
        assert simulate(plan, work, CLUSTER).stages[1].p2p == pytest.approx(expected, rel=1e-12)


def test_the_default_holds_the_shard_a_sequence_parallel_stage_hands_on(work):
    n = len(work)
    plan = _plan([n // 2, n], [2, 2], True)
    out = _out(work, plan, n // 2 - 1)
    sharded = simulate(plan, work, CLUSTER).stages[0].memory["activations"]
    full = simulate(plan, work, CLUSTER, CostOptions(stage_outputs="full")).stages[0].memory["activations"]
    assert CostOptions().stage_outputs == "sharded"
    assert full - sharded == pytest.approx(2 * out / 2)  # 1F1B stage 0 of 2 holds 2 microbatches in flight
