"""The chunk outputs a pipeline keeps until their backward, priced (``memory.held_per_microbatch``):
torch's ``PipelineStage`` holds one output per in-flight chunk-microbatch (checked on gloo ranks in
``tests/distributed/apply/test_stage_outputs_held.py``); a runtime that frees them after the send
(``CostOptions(stage_outputs="freed")``: Megatron-LM, Meta's Llama 3 stack) does not; nest-fx and
torchtitan keep the sequence shard their sequence-parallel blocks hand on (``"sharded"``, the
default)."""

from __future__ import annotations

import dataclasses

import pytest

from nest_fx.cost.inflight import pipeline_inflight_microbatches
from nest_fx.cost.memory import held_per_microbatch
from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import simulate, stage_variant
from nest_fx.plan import Plan, StagePlan
from nest_fx.solver import SolverOptions, solve
from nest_fx.workload import workload_for_model
from cluster_fixtures import h100ish

MODEL = "llama:hidden=512,layers=4,heads=8,seq=256,vocab=1024"
FREED = CostOptions(stage_outputs="freed")


@pytest.fixture(scope="module")
def work():
    return workload_for_model(MODEL, h100ish(16), seq=256)


def _pp2(work, schedule="1f1b", v=1, m=4):
    n = len(work)
    return Plan(
        stages=[StagePlan(0, n // 2, 1, "none"), StagePlan(n // 2, n, 1, "none")],
        num_layers=n,
        dp=1,
        microbatch_size=1,
        num_microbatches=m,
        schedule=schedule,
        virtual_stages=v,
    )


def test_each_in_flight_microbatch_adds_its_chunk_outputs():
    assert held_per_microbatch(10.0, 3.0, 4, 2, CostOptions(), sp_degree=3) == 12.0  # nest-fx: SP stages hand on shards
    assert held_per_microbatch(10.0, 3.0, 4, 2, CostOptions(stage_outputs="full"), sp_degree=3) == 16.0
    assert held_per_microbatch(10.0, 3.0, 4, 2, FREED) == 10.0
    assert held_per_microbatch(10.0, 3.0, 1, 1, CostOptions()) == 10.0  # no pipeline, no stage outputs
    with pytest.raises(ValueError, match="stage_outputs"):
        held_per_microbatch(10.0, 3.0, 4, 2, CostOptions(stage_outputs="kept"))


def test_a_1f1b_stage_prices_one_output_per_in_flight_microbatch(work):
    plan = _pp2(work)
    held, freed = simulate(plan, work, h100ish(16)), simulate(plan, work, h100ish(16), FREED)
    first = plan.stages[0]
    out = work.cost(first.end - 1, stage_variant(plan, 0)).out_bytes
    extra = held.stages[0].memory["activations"] - freed.stages[0].memory["activations"]
    assert out > 0
    assert extra == pytest.approx(pipeline_inflight_microbatches("1f1b", 0, 2, 4, 1) * out)
    # the last stage hands on nothing (its last layer is the loss): nothing held beyond its activations
    assert held.stages[1].memory["activations"] == freed.stages[1].memory["activations"]


def test_the_planner_prices_the_outputs_as_simulate_does(work):
    """The solver's stage tables add the same bytes: the plan it returns, simulated, has the memory
    its tables priced (it is feasible under simulate with the default options)."""
    options = SolverOptions(degree_bounds={"pp": (2, 2)}, use_all_devices=True)
    found = solve(work, h100ish(16), 8, options)
    again = simulate(found.plan, work, h100ish(16))
    assert found.plan.pp == 2 and again.feasible
    assert again.step_s == pytest.approx(found.result.step_s, rel=1e-9)
    off = dataclasses.replace(options, cost=FREED)
    assert solve(work, h100ish(16), 8, off).result.step_s <= found.result.step_s * (1 + 1e-9)
