"""What expert parallelism's all-to-alls send (nest_fx.workload.expert_dispatch): the owner ranks
per token under each routing against enumeration, the bytes the cost model prices per MoE layout
and per ``expert_dispatch`` / ``expert_routing`` setting, and the runtime's refusal of a plan
priced with another system's dispatch. The runtime's rows are counted on gloo ranks in
``tests/distributed/apply/test_ep_per_rank_dispatch.py``."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import simulate
from nest_fx.plan import uniform_plan
from nest_fx.plan.constraints import Constraints
from nest_fx.plan import vocabulary
from nest_fx.plan.may_run import unrun_constraints, unrun_fields
from nest_fx.workload import expert_dispatch, workload_for_model, workload_from_table, workload_to_table
from nest_fx.workload.expert_dispatch import dispatch_bytes, dispatched_comm, owner_ranks_per_token
from nest_fx.workload.types import Variant

ZOO_MOE = "moe:hidden=256,layers=2,heads=4,seq=256,vocab=1024,experts=8,top_k=2"


def _owners(experts, local, chosen):
    return len({e // local for e in chosen})


@pytest.mark.parametrize("experts, top_k, ep", [(8, 2, 4), (16, 4, 4), (6, 3, 3), (12, 5, 2), (8, 8, 8)])
def test_uniform_routing_owner_ranks_equal_the_mean_over_every_choice_of_experts(experts, top_k, ep):
    local = experts // ep
    subsets = list(itertools.combinations(range(experts), top_k))
    mean = sum(_owners(experts, local, s) for s in subsets) / len(subsets)
    assert owner_ranks_per_token(experts, top_k, ep) == pytest.approx(mean, rel=1e-12)
    assert owner_ranks_per_token(experts, top_k, ep, "") == owner_ranks_per_token(experts, top_k, ep, "uniform")


@pytest.mark.parametrize("experts, top_k, ep", [(128, 8, 8), (128, 8, 32), (6, 4, 3), (10, 3, 5), (8, 2, 1)])
def test_contiguous_routing_owner_ranks_equal_the_balanced_gate_over_many_tokens(experts, top_k, ep):
    """AutoModel's FakeBalancedGate without noise: token t takes experts k t ... k t + k - 1 mod E."""
    local = experts // ep
    tokens = 4 * experts
    mean = sum(_owners(experts, local, [(top_k * t + j) % experts for j in range(top_k)]) for t in range(tokens))
    assert owner_ranks_per_token(experts, top_k, ep, "contiguous") == pytest.approx(mean / tokens, rel=1e-12)


def test_the_settings_name_the_routings_and_dispatches_the_cost_model_prices():
    assert vocabulary.EXPERT_ROUTINGS == expert_dispatch.EXPERT_ROUTINGS
    assert vocabulary.EXPERT_DISPATCHES == expert_dispatch.DISPATCHES


def test_qwen3_30b_a3b_at_ep8_reaches_5_3_ranks_uniformly_and_one_under_the_balanced_gate():
    assert owner_ranks_per_token(128, 8, 8) == pytest.approx(5.339, abs=1e-3)
    assert owner_ranks_per_token(128, 8, 8, "contiguous") == 1.0
    with pytest.raises(ValueError, match="unknown expert routing 'random'"):
        owner_ranks_per_token(128, 8, 8, "random")


def test_dispatch_bytes_give_the_runtime_s_dispatch_and_every_setting():
    nbytes, each = dispatch_bytes(800.0, 100.0, "per-rank", 8, 2, 4)  # 100 bytes of tokens, routed to 2 of 8
    table = {(d, r): b for d, r, b in each}
    assert nbytes == table[("", "uniform")] == pytest.approx(100.0 * owner_ranks_per_token(8, 2, 4))
    assert table[("slots", "uniform")] == table[("slots", "contiguous")] == 800.0
    assert table[("per-rank", "contiguous")] == pytest.approx(100.0)  # experts 2t, 2t + 1: one rank of 2 each
    slots, _ = dispatch_bytes(800.0, 100.0, "slots", 8, 2, 4)
    assert slots == 800.0


def _ep_comms(work, ep):
    block = next(i for i, layer in enumerate(work.layers) if layer.kind == "block")
    return [c for c in work.cost(block, Variant.of(tp=1, ep=ep)).comms if c.group == "ep"]


def test_the_zoo_moe_is_priced_at_its_capacity_slots_and_another_dispatch_on_request():
    cluster = load_cluster("dgx-h100:8")
    work = workload_for_model(ZOO_MOE, cluster)
    comms = _ep_comms(work, 4)
    assert len(comms) == 2 and {c.phase for c in comms} == {"fwd", "bwd"}
    tokens, hidden, k, capacity_factor = 256, 256, 2, 1.0
    slots = tokens * k * capacity_factor * hidden * 2  # bf16 rows of the [B, E, C, H] buffer
    assert comms[0].nbytes == pytest.approx(slots)
    per_rank = dispatched_comm(comms[0], "per-rank", "uniform")
    assert per_rank.nbytes == pytest.approx(tokens * hidden * 2 * owner_ranks_per_token(8, 2, 4))
    assert dispatched_comm(comms[0], "", "contiguous").nbytes == comms[0].nbytes  # slots: whatever the routing
    # simulate and its options: the all-to-all seconds follow the bytes
    plan = uniform_plan(len(work), dp=8, ep=4, microbatch_size=1, num_microbatches=1)
    base = simulate(plan, work, cluster).stages[0].ep_comm
    deepep = simulate(plan, work, cluster, CostOptions(expert_dispatch="per-rank", expert_routing="contiguous"))
    assert 0 < deepep.stages[0].ep_comm < base
    # a layer table keeps every dispatch's bytes: the same seconds read back
    table = workload_from_table(json.loads(json.dumps(workload_to_table(work, tps=(1,), eps=(1, 4)))))
    options = CostOptions(expert_dispatch="per-rank", expert_routing="contiguous")
    assert simulate(plan, table, cluster, options).stages[0].ep_comm == pytest.approx(deepep.stages[0].ep_comm)


def test_hf_stacked_experts_are_priced_once_per_owner_rank():
    pytest.importorskip("transformers")
    cluster = load_cluster("dgx-h100:8")
    work = workload_for_model("hf:qwen3_moe", cluster)  # transformers' config, shrunk
    block = next(i for i, layer in enumerate(work.layers) if layer.kind == "block")
    experts, top_k = work.dims.num_experts, work.source.facts(block).top_k
    assert experts % 2 == 0 and 1 < top_k < experts
    comms = _ep_comms(work, 2)
    pairs = dispatched_comm(comms[0], "slots").nbytes
    assert comms[0].nbytes == pytest.approx(pairs / top_k * owner_ranks_per_token(experts, top_k, 2))
    assert comms[0].nbytes < pairs


def test_a_plan_priced_with_another_dispatch_is_refused_before_it_runs():
    found = unrun_constraints(Constraints(expert_dispatch="per-rank"))
    assert found and found[0] == "expert_dispatch=per-rank" and "fix: drop expert_dispatch" in found[1]
    assert unrun_constraints(Constraints(expert_routing="contiguous")) is None  # a routing assumption runs
    plan = uniform_plan(4, dp=4, ep=2)
    assert unrun_fields(plan) == []
    priced = dataclasses.replace(plan, constraints=Constraints(expert_dispatch="slots"))
    assert any("expert_dispatch=slots" in p for p in unrun_fields(priced))
    with pytest.raises(ValueError, match="expert_dispatch"):
        CostOptions(expert_dispatch="deepep")
