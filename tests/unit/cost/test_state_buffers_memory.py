"""How data parallelism holds the model states under ZeRO-1 (``CostOptions.state_buffers``):
nest-fx's FSDP2 keeps each unit's local shard next to its gathered copy; Megatron-LM's distributed
optimizer (NeMo's and Megatron-Bridge's rows of ``scripts/bench_published.py``) keeps whole bf16
parameter and gradient buffers and shards only the fp32 master weights and the optimizer states,
whose shard of the parameters is a view of the buffer: ``2 / dp`` bytes per parameter less."""

from __future__ import annotations

import pytest

from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import simulate
from nest_fx.plan import uniform_plan
from nest_fx.solver import SolverOptions, solve
from nest_fx.workload import workload_for_model
from cluster_fixtures import h100ish

MODEL = "llama:hidden=512,layers=4,heads=8,seq=256,vocab=1024"
MEGATRON = CostOptions(state_buffers="distributed-optimizer")


@pytest.fixture(scope="module")
def work():
    return workload_for_model(MODEL, h100ish(16), seq=256)


@pytest.mark.parametrize("dp", [2, 8])
def test_the_distributed_optimizer_holds_no_local_parameter_shard(work, dp):
    plan = uniform_plan(len(work), dp=dp, zero=1)
    fsdp, megatron = simulate(plan, work, h100ish(16)), simulate(plan, work, h100ish(16), MEGATRON)
    stage, other = fsdp.stages[0], megatron.stages[0]
    assert stage.memory["fsdp_unsharded"] == pytest.approx(2 * stage.num_params / dp)
    assert other.memory["fsdp_unsharded"] == 0
    for term in ("weights", "grads", "optimizer", "activations"):  # the rest as ZeRO-1 holds it
        assert other.memory[term] == stage.memory[term]


def test_zero_2_and_3_keep_their_working_sets_and_bad_values_are_named(work):
    plan = uniform_plan(len(work), dp=4, zero=3)
    assert (
        simulate(plan, work, h100ish(16), MEGATRON).stages[0].memory
        == simulate(plan, work, h100ish(16)).stages[0].memory
    )
    with pytest.raises(ValueError, match=r"state_buffers: 'megatron', use one of \('fsdp', 'distributed-optimizer'\)"):
        CostOptions(state_buffers="megatron")


def test_the_planner_prices_the_layout_it_is_given(work):
    """The planner's stage tables read the same working sets: its plan simulates to its own figures."""
    found = solve(work, h100ish(16), 32, SolverOptions(time_budget=2, cost=MEGATRON, use_all_devices=True))
    again = simulate(found.plan, work, h100ish(16), MEGATRON)
    assert again.step_s == pytest.approx(found.result.step_s)
    assert max(s.reserved for s in again.stages) == pytest.approx(found.result.peak_reserved)
