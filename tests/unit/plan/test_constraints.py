"""User constraints on a plan: the vocabulary, the search within them, the binding constraint,
the plan file, the command line and auto_parallelize(constraints=...)."""

from __future__ import annotations

import dataclasses
import json

import re

import pytest
import torch
import torch.distributed as dist
from conftest import tight_cluster

from nest_fx.apply import auto_parallelize
from nest_fx.apply.checks import ApplyError
from nest_fx.apply.losses import lm_loss
from nest_fx.cli import main
from nest_fx.cost.optimizers import OPTIMIZERS
from nest_fx.cost.step_time import simulate
from nest_fx.models import build_model
from nest_fx.plan import Plan, PlanError, uniform_plan
from nest_fx.plan.constraints import ConstraintError, Constraints, parse_assignments
from nest_fx.plan.vocabulary import OPTIMIZER_NAMES
from nest_fx.solver import SolverOptions
from nest_fx.solver.baselines import exhaustive
from nest_fx.solver.constraints import constrained_options, cost_options, solve_constrained
from nest_fx.workload import workload_for_model

MODEL = "llama:hidden=1024,layers=5,heads=8,seq=1024,vocab=8192"
# context parallelism would make pp=1 fit the tight clusters below: these tests are about constraints
SPACE = SolverOptions(
    microbatch_sizes=(1, 2),
    tp_degrees=(1, 2),
    zero_stages=(1, 3),
    schedules=(("1f1b", 1), ("interleaved", 2)),
    recompute=("none", "full"),
    max_stages=4,
    cp_degrees=(1,),
)


@pytest.fixture(scope="module")
def small():
    cluster = tight_cluster(0.6)
    return workload_for_model(MODEL, cluster), cluster


# -- the vocabulary -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fix={"xp": 2}), "fix: unknown degree 'xp'"),
        (dict(fix={"tp": 0}), "fix.tp: must be an integer >= 1"),
        (dict(fix={"compile": 1}), "fix.compile: 1 is not true or false"),
        (dict(max={"compile": 1}), "max: unknown degree 'compile'"),
        (dict(min={"tp": 4}, max={"tp": 2}), "min.tp=4 is above max.tp=2"),
        (dict(fix={"pp": 8}, max={"pp": 4}), "fix.pp=8 is outside"),
        (dict(schedules=["zigzag"]), "schedules: 'zigzag' is not a schedule"),
        (dict(schedules=["interleaved:1"]), "interleaved:V"),
        (dict(recompute=["some"]), "recompute: 'some' is not a recompute policy"),
        (dict(zero_stages=[4]), "zero_stages: 4 is not a ZeRO stage"),
        (dict(microbatch_sizes=[]), "microbatch_sizes: must be a non-empty list"),
        (dict(placements=["diagonal"]), "placements: 'diagonal' is not a placement"),
        (dict(memory_headroom=1.0), "memory_headroom: must be a fraction"),
        (dict(optimizer="lamb"), "optimizer: must be one of"),
    ],
)
def test_malformed_constraints_name_the_entry(kwargs, message):
    with pytest.raises(ConstraintError, match=message):
        Constraints(**kwargs)


def test_optimizer_names_are_the_costed_ones():
    assert set(OPTIMIZER_NAMES) == set(OPTIMIZERS)


def test_command_line_forms():
    assert parse_assignments("tp=8, pp=16", "fix") == {"tp": 8, "pp": 16}
    assert parse_assignments("compile=false,sequence-parallel=on", "fix") == {
        "compile": False,
        "sequence_parallel": True,
    }
    with pytest.raises(ConstraintError, match="not NAME=VALUE"):
        parse_assignments("tp8", "fix")
    c = Constraints(fix={"tp": 8}, max={"pp": 4}, schedules=["1f1b"], memory_headroom=0.1, optimizer="sgd")
    assert c.describe() == "tp = 8, pp <= 4, schedule 1f1b, memory headroom 10%, optimizer sgd"
    assert [t for _, t in c.items()] == [
        "--fix tp=8",
        "--max pp=4",
        "--schedule 1f1b",
        "--memory-headroom 0.1",
        "--optimizer sgd",
    ]
    assert c.without("fix.tp").to_dict() == {
        "max": {"pp": 4},
        "schedules": ["1f1b"],
        "memory_headroom": 0.1,
        "optimizer": "sgd",
    }


def test_plan_file_records_constraints_and_old_files_load():
    plan = uniform_plan(8, pp=2, dp=2, num_microbatches=4)
    old = plan.to_dict()
    assert "constraints" not in old and Plan.from_dict(old).constraints is None
    plan.constraints = Constraints(fix={"tp": 1}, zero_stages=[3], optimizer="adamw")
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["constraints"] == {"fix": {"tp": 1}, "zero_stages": [3], "optimizer": "adamw"}
    assert Plan.from_dict(data).constraints == plan.constraints
    data["constraints"]["zero_stages"] = [5]
    with pytest.raises(PlanError, match=r"plan: constraints\.zero_stages: 5 is not a ZeRO stage"):
        Plan.from_dict(data)


# -- the search within them ----------------------------------------------------------------


@pytest.mark.parametrize(
    "constraints",
    [
        Constraints(fix={"tp": 2}),
        Constraints(fix={"pp": 1}),
        Constraints(max={"pp": 2}, min={"dp": 2}),
        Constraints(schedules=["1f1b"], zero_stages=[3]),
        Constraints(recompute=["full"], microbatch_sizes=[1], placements=["replica-major"]),
        Constraints(memory_headroom=0.3, optimizer="sgd"),
    ],
    ids=lambda c: c.describe(),
)
def test_the_plan_is_the_optimum_within_the_constraints(small, constraints):
    work, cluster = small
    found = solve_constrained(work, cluster, 16, constraints, SPACE)
    plan = found.plan
    assert plan.constraints == constraints
    for degree, value in (("tp", plan.stages[0].tp), ("pp", plan.pp), ("dp", plan.dp)):
        lo, hi = constraints.bounds(degree)
        assert lo <= value <= hi
    if constraints.schedules:
        assert plan.schedule in constraints.schedules
    for name, value in (
        ("zero_stages", plan.zero),
        ("microbatch_sizes", plan.microbatch_size),
        ("placements", plan.placement),
    ):
        assert getattr(constraints, name) is None or value in getattr(constraints, name)
    assert constraints.recompute is None or {s.recompute for s in plan.stages} <= set(constraints.recompute)
    # exact: enumeration over the same narrowed space finds nothing faster
    narrowed = constrained_options(SPACE, constraints, work, cluster, 16)
    best = exhaustive(work, cluster, 16, narrowed)
    assert found.result.step_s == pytest.approx(best.result.step_s, rel=1e-9)
    # the prediction is the cost model's under the constraints' optimizer and headroom
    costs = cost_options(constraints)
    assert simulate(plan, work, cluster, costs).step_s == pytest.approx(found.result.step_s, rel=1e-12)
    usable = cluster.device.memory_bytes * costs.usable_memory_fraction
    assert all(s.memory["total"] <= usable for s in found.result.stages)


def test_headroom_and_optimizer_change_what_fits(small):
    work, cluster = small
    lean = solve_constrained(work, cluster, 16, Constraints(optimizer="sgd"), SPACE).result
    roomy = solve_constrained(work, cluster, 16, Constraints(memory_headroom=0.5), SPACE).result
    plain = solve_constrained(work, cluster, 16, None, SPACE).result
    assert lean.step_s <= plain.step_s <= roomy.step_s
    assert max(s.memory["total"] for s in roomy.stages) <= 0.5 * cluster.device.memory_bytes


@pytest.mark.parametrize(
    "constraints, message",
    [
        (Constraints(fix={"tp": 4}), "--fix tp=4: tensor parallelism stays inside one node of 2 devices"),
        (Constraints(fix={"tp": 2, "pp": 4, "dp": 2}), "needs at least 16 devices, the cluster has 8"),
        (Constraints(fix={"pp": 9}), "--fix pp=9: the model has 7 layers"),
        (Constraints(fix={"cp": 3}), "--fix cp=3: cp=3 does not divide the sequence: 1024 tokens"),
        (Constraints(fix={"float8": True}), "--fix float8=true: the device .* has no fp8 rate"),
        (Constraints(recompute=["op:fancy"]), "--recompute op:fancy: .*unknown op policy 'fancy'"),
        (Constraints(microbatch_sizes=[3]), "--microbatch 3: no microbatch size divides the global batch 16"),
        (Constraints(fix={"dp": 3}), "--fix dp=3: dp=3 does not divide the global batch 16"),
        (Constraints(fix={"ep": 2}), "--fix ep=2: .* has no experts"),
    ],
)
def test_what_the_model_or_cluster_rules_out_is_refused_at_once(small, constraints, message):
    work, cluster = small
    with pytest.raises(ConstraintError, match=message):
        solve_constrained(work, cluster, 16, constraints, SPACE)


def test_compile_no_longer_holds_the_planner_to_tp1(small):
    """torch.compile runs with tensor parallelism (tests/distributed/apply/test_compile_parallel.py): a fixed tp=2
    under --compile is planned, not refused, and the plan records both."""
    work, cluster = small
    plan = solve_constrained(work, cluster, 16, Constraints(fix={"compile": True, "tp": 2}), SPACE).plan
    assert plan.compile and {s.tp for s in plan.stages} == {2}


def test_the_binding_constraint_is_named():
    # on 0.36 GiB devices this model needs a pipeline or ZeRO-3: pp=1 with ZeRO-1 fits nowhere (0.4 GiB
    # held it once the runtime's F.rms_norm keeps no fp32 copies)
    cluster = tight_cluster(0.36)
    work = workload_for_model(MODEL, cluster)
    with pytest.raises(ConstraintError) as info:
        solve_constrained(work, cluster, 16, Constraints(fix={"pp": 1}, zero_stages=[1]), SPACE)
    message = str(info.value)
    assert message.startswith("no plan meets the constraints; ")
    # without pp=1: a pipeline (its depth depends on the gradient traffic: bf16-mixed, the planner's default
    # on this bf16 device, reduces gradients in fp32)
    assert re.search(r"--fix pp=1 \(without it: pp=[2-8] ", message) and "--zero 1 (without it: pp=1 " in message
    assert " zero=3 " in message.split("--zero 1 (without it: ")[1]
    assert message.endswith("each bind")


def test_constraints_that_bind_only_together_say_so():
    # on 0.3 GiB devices this model fits only with TP > 1 and recompute: tp=1 fails with any
    # recompute, no recompute with any TP degree, so leaving out either alone does not help
    # (its bf16-mixed gradients are held in fp32 on the master weights: memory.held_grad_bytes)
    cluster = tight_cluster(0.3)
    work = workload_for_model(MODEL, cluster)
    with pytest.raises(
        ConstraintError,
        match=r"no plan meets the constraints together \(--fix tp=1, "
        r"--recompute none\); leaving out any one",
    ):
        solve_constrained(work, cluster, 16, Constraints(fix={"tp": 1}, recompute=["none"]), SPACE)


# -- the command line and the runtime -------------------------------------------------------


def test_cli_plan_prints_records_and_simulates_under_the_constraints(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = [
        "plan",
        "--model",
        MODEL,
        "--cluster",
        "dgx-a100:16",
        "--global-batch",
        "32",
        "--quiet",
        "--no-baselines",
        "--fix",
        "tp=2",
        "--max-pp",
        "2",
        "--optimizer",
        "sgd",
        "--memory-headroom",
        "20%",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    # the allocator's segments are always recorded, as the optimizer: the runtime turns them on
    assert "constraints: tp = 2, pp <= 2, memory headroom 20%, allocator segments expandable, optimizer sgd" in printed
    plan = Plan.load(str(out))
    assert plan.constraints == Constraints(
        fix={"tp": 2}, max={"pp": 2}, memory_headroom=0.2, allocator_segments="expandable", optimizer="sgd"
    )
    assert plan.uniform_tp == 2 and plan.pp <= 2
    assert (
        main(
            [
                "simulate",
                "--plan",
                str(out),
                "--model",
                MODEL,
                "--cluster",
                "dgx-a100:16",
                "--json",
                str(tmp_path / "sim.json"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    step = json.loads((tmp_path / "sim.json").read_text())["result"]["step_s"]
    assert step == pytest.approx(plan.predicted["step_s"], rel=1e-12)  # costed with SGD, as planned


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--fix", "tp=16"], "error: --fix tp=16: tensor parallelism stays inside one node of 8 devices"),
        (["--fix", "tp=foo"], "error: --fix tp=foo: tp takes a positive integer"),
        (["--memory-headroom", "150%"], "error: constraint memory_headroom: must be a fraction"),
        (["--schedule", "zigzag"], "error: constraint schedules: 'zigzag' is not a schedule"),
    ],
)
def test_cli_refuses_impossible_constraints_in_one_line(capsys, extra, message):
    argv = [
        "plan",
        "--model",
        MODEL,
        "--cluster",
        "dgx-a100:16",
        "--global-batch",
        "32",
        "--quiet",
        "--no-baselines",
        *extra,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_auto_parallelize_plans_within_constraints(fake_world):
    model, _ = build_model("llama:hidden=64,layers=4,heads=4,kv=2,seq=32,vocab=128", device="meta")
    tokens = torch.empty(8, 32, dtype=torch.long, device="meta")
    pm = auto_parallelize(
        model,
        tokens,
        global_batch_size=8,
        loss_fn=lm_loss,
        verbose=False,
        constraints={"fix": {"tp": 2, "pp": 1}, "optimizer": "sgd"},
    )
    assert pm.plan.uniform_tp == 2 and pm.plan.pp == 1 and pm.plan.dp == 2
    assert pm.plan.constraints == Constraints(fix={"tp": 2, "pp": 1}, optimizer="sgd")


def test_auto_parallelize_refuses_what_the_runtime_cannot_run(fake_world):
    model, _ = build_model("llama:hidden=64,layers=4,heads=4,kv=2,seq=32,vocab=128", device="meta")
    tokens = torch.empty(8, 32, dtype=torch.long, device="meta")
    with pytest.raises(ConstraintError, match="fix tp=4: tp=4 does not divide the model's 2 key/value heads"):
        auto_parallelize(
            model, tokens, global_batch_size=8, loss_fn=lm_loss, verbose=False, constraints=Constraints(fix={"tp": 4})
        )
    with pytest.raises(ApplyError, match="constraints= shape the default planner's search"):
        auto_parallelize(
            model,
            tokens,
            global_batch_size=8,
            loss_fn=lm_loss,
            verbose=False,
            plan=uniform_plan(6, dp=4, num_microbatches=2),
            constraints=Constraints(fix={"tp": 1}),
        )


def test_cost_options_from_a_plans_constraints():
    base = cost_options(None)
    sgd = cost_options(Constraints(optimizer="sgd-momentum", memory_headroom=0.25))
    assert (base.optimizer, base.usable_memory_fraction) == ("adam", 0.95)
    assert (sgd.optimizer, sgd.usable_memory_fraction) == ("sgd-momentum", 0.75)
    assert dataclasses.replace(sgd, optimizer="adam", memory_headroom=0.05) == base
