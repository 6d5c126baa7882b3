"""auto_parallelize(constraints=...) asking for kernels nest-fx's runtime does not run
(``kernels=fused``: Transformer-Engine-style kernels that price other systems for ``nest-fx
plan/simulate``; ``kernels=compile`` without ``fix.compile``) is refused at once, before it
traces, plans or joins a collective, by the one function that decides (``plan.may_run``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nest_fx.apply import auto_parallelize
from nest_fx.apply import prepare as prepare_module
from nest_fx.apply.losses import lm_loss
from nest_fx.models import build_seeded
from nest_fx.plan.constraints import ConstraintError, Constraints
from nest_fx.plan.may_run import may_run, unrun_constraints
from nest_fx.solver.runtime_planner import check_runtime_constraints

LLAMA = "llama:hidden=64,layers=2,heads=4,seq=32,vocab=128"


def test_the_one_verdict_on_kernel_constraints():
    assert unrun_constraints(None) is None and unrun_constraints(Constraints()) is None
    for ok in (Constraints(kernels="eager"), Constraints(kernels="compile", fix={"compile": True})):
        assert unrun_constraints(ok) is None
    setting, fused = unrun_constraints(Constraints(kernels="fused"))
    assert setting == "kernels=fused"
    assert fused.startswith("auto_parallelize would plan for fused kernels but nest-fx's runtime runs eager kernels")
    assert "fix: drop kernels from constraints= (or set it to '' or eager)" in fused and "plan/simulate" in fused
    assert "fix: add fix compile=true to the constraints" in unrun_constraints(Constraints(kernels="compile"))[1]
    # under fix.compile the runtime runs compiled kernels: eager is not what it would run either
    assert "runs compile kernels" in unrun_constraints(Constraints(kernels="eager", fix={"compile": True}))[1]
    # the planner's own check asks the same function (for a planner= built by planner_for)
    model, _ = build_seeded(LLAMA)
    assert may_run(model).constraint_problem(Constraints(kernels="fused")) == ("kernels=fused", fused)
    with pytest.raises(ConstraintError, match="^kernels=fused: auto_parallelize would plan for fused kernels"):
        check_runtime_constraints(Constraints(kernels="fused"), model, None)


@pytest.mark.parametrize(
    "constraints,says",
    [
        ({"kernels": "fused"}, r"^constraints= kernels=fused: .*runtime runs eager kernels.*fix: drop kernels"),
        (Constraints(kernels="compile"), r"^constraints= kernels=compile: .*fix: add fix compile=true"),
    ],
)
def test_auto_parallelize_refuses_them_before_tracing_planning_or_any_collective(
    single_rank, monkeypatch, constraints, says
):
    def never(*args, **kwargs):
        raise AssertionError("auto_parallelize traced, planned or started the process group")

    for step in ("trace", "planner_for", "init_distributed"):
        monkeypatch.setattr(prepare_module, step, never)
    model, _ = build_seeded(LLAMA)
    tokens = torch.randint(0, 128, (8, 32))
    with pytest.raises(ConstraintError, match=says):
        auto_parallelize(model, tokens, global_batch_size=8, loss_fn=lm_loss, verbose=False, constraints=constraints)
    assert not dist.is_initialized()
