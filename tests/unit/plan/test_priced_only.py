"""Options that price another system's runtime (``expert_dispatch``, ``stage_outputs``,
``state_buffers``): a plan records them in its constraints, the cost model prices them, ``simulate``
reproduces the price from the file, and nest-fx's runtime refuses any value but its own before the
first collective (``nest_fx.plan.priced_only``, asked by ``plan.may_run``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from nest_fx.apply import auto_parallelize
from nest_fx.apply import prepare as prepare_module
from nest_fx.apply.checks import ApplyError
from nest_fx.apply.losses import lm_loss
from nest_fx.cli import main
from nest_fx.cost.options import CostOptions
from nest_fx.models import build_seeded
from nest_fx.plan import Plan
from nest_fx.plan.constraints import ConstraintError, Constraints
from nest_fx.plan.may_run import unrun_constraints, unrun_fields
from nest_fx.plan.plan import uniform_plan
from nest_fx.plan.priced_only import priced_only_constraints, priced_only_problem
from nest_fx.plan.settings import PRICED_ONLY_OPTIONS, default, setting

LLAMA = "llama:hidden=64,layers=2,heads=4,seq=32,vocab=128"
OTHER_SYSTEMS = {"expert_dispatch": "per-rank", "stage_outputs": "freed", "state_buffers": "distributed-optimizer"}


def test_every_priced_only_option_runs_only_its_default():
    assert set(OTHER_SYSTEMS) == set(PRICED_ONLY_OPTIONS)
    for name in PRICED_ONLY_OPTIONS:
        assert priced_only_problem(name, None) == "" and priced_only_problem(name, default(name)) == ""
        assert default(name) == getattr(CostOptions(), name)  # the cost model's default is the runtime's
        for value in setting(name).values:
            if value != default(name):
                problem = priced_only_problem(name, value)
                assert f"priced with {name}={value}" in problem and f"fix: drop {name}" in problem, problem
    assert unrun_constraints(Constraints(stage_outputs="sharded", state_buffers="fsdp")) is None
    found = priced_only_constraints(Constraints(stage_outputs="full", state_buffers="distributed-optimizer"))
    assert [key for key, _ in found] == ["stage_outputs=full", "state_buffers=distributed-optimizer"]
    assert unrun_constraints(Constraints(state_buffers="distributed-optimizer"))[0] == (
        "state_buffers=distributed-optimizer"
    )
    plan = uniform_plan(4, dp=4, pp=2)
    assert unrun_fields(plan) == []
    priced = dataclasses.replace(plan, constraints=Constraints(stage_outputs="freed"))
    assert any("stage_outputs=freed" in p and "fix: drop stage_outputs" in p for p in unrun_fields(priced))
    with pytest.raises(ConstraintError, match="stage_outputs: must be one of"):
        Constraints(stage_outputs="dropped")


def test_the_plan_records_the_layout_it_was_priced_with_and_simulate_reproduces_it(tmp_path, capsys):
    model = "llama:hidden=1024,layers=4,heads=8,seq=1024,vocab=8192"
    common = ["--model", model, "--cluster", "dgx-h100:8", "--global-batch", "16", "--fix", "dp=8,pp=1", "--zero", "1"]
    common += ["--time-budget", "2"]
    plain, megatron = tmp_path / "fsdp.json", tmp_path / "megatron.json"
    assert main(["plan", *common, "--json", str(plain)]) == 0
    assert main(["plan", *common, "--state-buffers", "distributed-optimizer", "--json", str(megatron)]) == 0
    printed = capsys.readouterr().out
    assert "not for training with nest-fx: the plan is priced with state_buffers=distributed-optimizer" in printed
    assert Plan.load(str(plain)).constraints.state_buffers is None  # not given: not recorded
    recorded = Plan.load(str(megatron))
    assert recorded.constraints.state_buffers == "distributed-optimizer"
    figures, says = {}, {}
    for name, path, extra in (
        ("fsdp", plain, []),
        ("megatron", megatron, []),
        ("megatron as fsdp", megatron, ["--state-buffers", "fsdp"]),
    ):
        out = tmp_path / f"{name}.sim.json"
        assert main(["simulate", "--plan", str(path), "--json", str(out), *extra]) == 0
        figures[name] = json.loads(out.read_text())
        says[name] = "not for training with nest-fx" in capsys.readouterr().out
    assert says == {"fsdp": False, "megatron": True, "megatron as fsdp": False}
    memory = {k: max(s["memory"]["total"] for s in v["result"]["stages"]) for k, v in figures.items()}
    # Megatron-LM's distributed optimizer keeps no FSDP2 local shard beside the gathered copy
    assert memory["megatron"] < memory["fsdp"]
    assert memory["megatron as fsdp"] == pytest.approx(memory["fsdp"])
    assert figures["megatron"]["result"]["stages"][0]["memory"]["fsdp_unsharded"] == 0


def test_auto_parallelize_refuses_a_plan_priced_for_another_runtime_before_any_collective(single_rank, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("auto_parallelize reached the ranks' agreement collective")

    monkeypatch.setattr(prepare_module, "agree", never)
    model, _ = build_seeded(LLAMA)
    tokens = torch.randint(0, 128, (8, 32))
    run = dict(global_batch_size=8, loss_fn=lm_loss, verbose=False)
    plan = uniform_plan(4, constraints=Constraints(stage_outputs="freed"))
    with pytest.raises(ApplyError, match="stage_outputs=freed.*fix: drop stage_outputs"):
        auto_parallelize(model, tokens, plan=plan, **run)
    monkeypatch.setattr(prepare_module, "init_distributed", never)
    if dist.is_initialized():
        dist.destroy_process_group()
    priced = Constraints(state_buffers="distributed-optimizer")
    with pytest.raises(ConstraintError, match="^constraints= state_buffers=distributed-optimizer: .*fix: drop"):
        auto_parallelize(model, tokens, constraints=priced, **run)


def test_explain_says_a_plan_priced_for_another_runtime_is_not_for_training():
    from nest_fx.cluster import load_cluster
    from nest_fx.cost.step_time import simulate
    from nest_fx.report.explain import explain_text
    from nest_fx.solver.constraints import cost_options
    from nest_fx.workload import workload_for_model

    cluster = load_cluster("dgx-h100:8")
    work = workload_for_model("gpt:hidden=256,layers=4,heads=8,seq=256,vocab=4096", cluster)
    plan = uniform_plan(len(work), dp=8, zero=1)
    for priced, says in (
        (dataclasses.replace(plan, constraints=Constraints(state_buffers="distributed-optimizer")), "state_buffers"),
        (dataclasses.replace(plan, kernels="fused"), "fused kernels"),
        (plan, None),
    ):
        result = simulate(priced, work, cluster, cost_options(priced.constraints))
        lines = [
            line for line in explain_text(priced, work, cluster, result).splitlines() if "not for training" in line
        ]
        assert (lines and says in lines[0]) if says else not lines, lines
