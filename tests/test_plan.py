"""Plan format: rank layout, validation and JSON round trip."""
import json

import pytest

from nest_fx.plan import Plan, PlanError, StagePlan, uniform_plan


def test_uniform_plan_splits_layers_evenly():
    plan = uniform_plan(34, pp=4, tp=2, dp=3)
    assert [s.num_layers for s in plan.stages] == [8, 9, 8, 9]
    assert plan.devices_used == 3 * 4 * 2
    assert plan.mesh() == {"dims": ["pp", "dp", "tp"], "shape": [4, 3, 2]}


def test_stage_major_rank_layout():
    plan = Plan(stages=[StagePlan(0, 2, tp=2), StagePlan(2, 4, tp=4)], dp=3, num_layers=4)
    # stage 0 holds ranks 0..5 (3 replicas x tp 2), stage 1 ranks 6..17
    assert plan.tp_group(0, 1) == [2, 3]
    assert plan.dp_group(0, 1) == [1, 3, 5]
    assert plan.tp_group(1, 0) == [6, 7, 8, 9]
    assert plan.dp_group(1, 0) == [6, 10, 14]
    assert plan.rank(1, 2, 3) == 17
    assert plan.mesh() is None  # non-uniform TP is not a regular DeviceMesh


def test_replica_major_rank_layout():
    plan = Plan(stages=[StagePlan(0, 2, tp=2), StagePlan(2, 4, tp=2)], dp=2, placement="replica-major",
                num_layers=4)
    assert plan.tp_group(1, 0) == [2, 3]
    assert plan.dp_group(0, 1) == [1, 5]
    assert plan.rank(1, 1, 0) == 6


def test_ep_groups_are_consecutive_replicas():
    plan = Plan(stages=[StagePlan(0, 1)], dp=4, ep=2, num_layers=1)
    assert plan.ep_group(0, 0) == [0, 1]
    assert plan.ep_group(0, 3) == [2, 3]


def test_json_round_trip(tmp_path):
    plan = uniform_plan(10, pp=2, tp=4, dp=2, zero=1, microbatch_size=2, num_microbatches=8,
                        schedule="interleaved", virtual_stages=2, recompute="selective")
    path = tmp_path / "p.json"
    plan.save(str(path))
    data = json.loads(path.read_text())
    assert data["format"] == "nest-fx-plan/1" and data["derived"]["global_batch"] == 32
    again = Plan.load(str(path))
    assert again.to_dict() == plan.to_dict()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="nest-fx-plan/0"), "format"),
    (lambda d: d["stages"][1].update(start=6), "stages[1].start"),
    (lambda d: d.update(ep=3), "ep=3 must divide dp"),
    (lambda d: d.update(zero=4), "zero"),
    (lambda d: d.update(schedule="zigzag"), "schedule"),
    (lambda d: d.update(dp="two"), "dp must be an integer"),
    (lambda d: d.update(colour="red"), "unknown field"),
    (lambda d: d["stages"][0].update(recompute="most"), "recompute"),
    (lambda d: d.update(schedule="interleaved", virtual_stages=1), "virtual_stages"),
])
def test_malformed_plans_name_the_field(mutate, message):
    data = uniform_plan(10, pp=2, tp=1, dp=2).to_dict()
    mutate(data)
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Plan.from_dict(data)


def test_plan_for_another_model_or_world_is_refused():
    plan = uniform_plan(10, pp=2, tp=2, dp=2)
    with pytest.raises(PlanError, match="workload has 12 layers"):
        plan.validate(num_layers=12)
    with pytest.raises(PlanError, match="world has 4"):
        plan.validate(world_size=4)
