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
    plan = Plan(stages=[StagePlan(0, 2, tp=2), StagePlan(2, 4, tp=2)], dp=2, placement="replica-major", num_layers=4)
    assert plan.tp_group(1, 0) == [2, 3]
    assert plan.dp_group(0, 1) == [1, 5]
    assert plan.rank(1, 1, 0) == 6


def test_context_parallel_rank_layout():
    plan = Plan(stages=[StagePlan(0, 2, tp=2), StagePlan(2, 4, tp=2)], dp=2, cp=2, num_layers=4)
    # a stage replica is cp x tp = 4 ranks, TP innermost: stage 0 holds 0..7, stage 1 8..15
    assert plan.devices_used == 16 and plan.devices_per_replica == 8
    assert plan.tp_group(0, 1, cp_rank=1) == [6, 7]
    assert plan.cp_group(0, 0, tp_rank=1) == [1, 3]
    assert plan.dp_group(1, tp_rank=0, cp_rank=1) == [10, 14]
    assert plan.mesh() == {"dims": ["pp", "dp", "cp", "tp"], "shape": [2, 2, 2, 2]}
    every = sorted(plan.rank(i, r, j, c) for i in range(2) for r in range(2) for c in range(2) for j in range(2))
    assert every == list(range(16))  # a bijection onto the devices used
    rm = Plan(
        stages=[StagePlan(0, 2, tp=2), StagePlan(2, 4, tp=2)], dp=2, cp=2, num_layers=4, placement="replica-major"
    )
    assert rm.cp_group(1, 1, tp_rank=0) == [12, 14] and rm.tp_group(1, 1, cp_rank=1) == [14, 15]


def test_hsdp_shard_groups_and_validation():
    plan = Plan(stages=[StagePlan(0, 1, tp=2)], dp=8, zero=3, dp_shard=4, num_layers=1)
    assert plan.shard_degree == 4 and plan.replicate_degree == 2
    assert plan.shard_group(0, 5) == [8, 10, 12, 14]
    assert Plan(stages=[StagePlan(0, 1)], dp=8, zero=3, num_layers=1).shard_group(0, 5) == list(range(8))
    with pytest.raises(PlanError, match="dp_shard=3 must divide dp=8"):
        Plan(stages=[StagePlan(0, 1)], dp=8, zero=3, dp_shard=3, num_layers=1).validate()
    with pytest.raises(PlanError, match="dp_shard=4 needs zero >= 1"):
        Plan(stages=[StagePlan(0, 1)], dp=8, zero=0, dp_shard=4, num_layers=1).validate()


def test_new_fields_round_trip_and_old_files_read_as_before():
    plan = Plan(stages=[StagePlan(0, 2, tp=2)], dp=4, cp=2, zero=1, dp_shard=2, loss_parallel=True, num_layers=2)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert (again.cp, again.dp_shard, again.loss_parallel) == (2, 2, True)
    old = {k: v for k, v in plan.to_dict().items() if k not in ("cp", "dp_shard", "loss_parallel")}
    assert (Plan.from_dict(old).cp, Plan.from_dict(old).dp_shard, Plan.from_dict(old).loss_parallel) == (1, 0, False)
    with pytest.raises(PlanError, match="loss_parallel must be true or false"):
        Plan.from_dict({**plan.to_dict(), "loss_parallel": "yes"})
    with pytest.raises(PlanError, match="cp: must be >= 1"):
        Plan.from_dict({**plan.to_dict(), "cp": 0})


def test_ep_groups_are_consecutive_replicas():
    plan = Plan(stages=[StagePlan(0, 1)], dp=4, ep=2, num_layers=1)
    assert plan.ep_group(0, 0) == [0, 1]
    assert plan.ep_group(0, 3) == [2, 3]


def test_json_round_trip(tmp_path):
    plan = uniform_plan(
        10,
        pp=2,
        tp=4,
        dp=2,
        zero=1,
        microbatch_size=2,
        num_microbatches=8,
        schedule="interleaved",
        virtual_stages=2,
        recompute="selective",
    )
    path = tmp_path / "p.json"
    plan.save(str(path))
    data = json.loads(path.read_text())
    assert data["format"] == "nest-fx-plan/1" and data["derived"]["global_batch"] == 32
    again = Plan.load(str(path))
    assert again.to_dict() == plan.to_dict()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format="nest-fx-plan/0"), "format"),
        (lambda d: d["stages"][1].update(start=6), "stages[1].start"),
        (lambda d: d.update(ep=3), "ep=3 must divide dp"),
        (lambda d: d.update(zero=4), "zero"),
        (lambda d: d.update(schedule="zigzag"), "schedule"),
        (lambda d: d.update(dp="two"), "dp must be an integer"),
        (lambda d: d.update(colour="red"), "unknown field"),
        (lambda d: d["stages"][0].update(recompute="most"), "recompute"),
        (lambda d: d.update(schedule="interleaved", virtual_stages=1), "virtual_stages"),
    ],
)
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


@pytest.mark.parametrize("good", ["none", "selective", "full", "op", "op:torchtitan", "every:2", "every:12"])
def test_recompute_policy_forms_are_accepted(good):
    Plan(stages=[StagePlan(0, 1, recompute=good)], num_layers=1).validate()


@pytest.mark.parametrize("bad", ["all", "every:1", "every:0", "op:", "Full", "every:k"])
def test_recompute_policy_forms_are_refused(bad):
    with pytest.raises(
        PlanError,
        match=r"stages\[0\].recompute: .* is not a recompute policy"
        r"( \(close matches: [^)]*\))?; use none, selective",
    ):
        Plan(stages=[StagePlan(0, 1, recompute=bad)], num_layers=1).validate()


@pytest.mark.parametrize("v, ok", [(2, True), (3, True), (4, False), (7, False)])
def test_interleaved_chunks_need_a_layer_each(v, ok):
    # 4 stages of 3 layers: the runtime cuts each into v chunks of >= 1 layer (interleaved_ranges)
    plan = uniform_plan(12, pp=4, dp=1, num_microbatches=8, schedule="interleaved", virtual_stages=v)
    if ok:
        plan.validate()
    else:
        with pytest.raises(PlanError, match=f"stages\\[0\\] has 3 layer\\(s\\), fewer than virtual_stages={v}"):
            plan.validate()


def test_virtual_stages_belong_to_the_interleaved_schedule():
    with pytest.raises(PlanError, match="virtual_stages=2.*set virtual_stages to 1"):
        uniform_plan(8, pp=2, num_microbatches=4, schedule="1f1b", virtual_stages=2).validate()
