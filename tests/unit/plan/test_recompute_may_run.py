"""A recompute policy that would mutate a saved tensor (graph.recompute_mutations) is refused by the one
"what may run" question: the runtime's checks before any collective, the planner's search space and
the user's constraints."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from nest_fx.apply import ApplyError, auto_parallelize
from nest_fx.apply.losses import lm_loss
from nest_fx.graph import trace
from nest_fx.plan import uniform_plan
from nest_fx.plan.constraints import ConstraintError, Constraints
from nest_fx.plan.may_run import may_run
from nest_fx.solver.runtime_planner import check_runtime_constraints, planner_for, runtime_options
from nest_fx.solver.space import SolverOptions

VOCAB, HIDDEN, SEQ = 64, 16, 8


class Block(nn.Module):
    """A pre-norm MLP block; ``inplace``: its activation is ``nn.ReLU(inplace=True)`` on the up
    projection's output (which ``selective``, ``op`` and ``op:matmuls`` save)."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up, self.act, self.down = nn.Linear(HIDDEN, 32), nn.ReLU(inplace=inplace), nn.Linear(32, HIDDEN)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(inplace) for _ in range(2)])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


REFUSED = {"selective", "op", "op:default", "op:matmuls"}


def _traced(inplace: bool):
    torch.manual_seed(0)
    model = TinyLM(inplace)
    return model, trace(model, (torch.randint(0, VOCAB, (2, SEQ)),))


def test_plan_problems_name_the_stage_module_and_fix():
    model, graph = _traced(inplace=True)
    runs = may_run(model, graph)
    for recompute in ("none", "full", "every:2", "op:attention"):
        assert runs.plan_problems(uniform_plan(4, recompute=recompute)) == []
    for recompute in REFUSED:
        problems = runs.plan_problems(uniform_plan(4, recompute=recompute))
        assert len(problems) == 1
        assert problems[0].startswith(
            f"stages[0]: recompute={recompute}: module 'layers.0.act' mutates in place (relu_) the output of "
            "'layers.0.up' (addmm)"
        )
        assert problems[0].endswith("or make 'layers.0.act' out of place")
    # the same model with an out-of-place ReLU runs every policy
    model, graph = _traced(inplace=False)
    for recompute in REFUSED:
        assert may_run(model, graph).plan_problems(uniform_plan(4, recompute=recompute)) == []


def test_planner_never_offers_a_refused_policy():
    searched = SolverOptions().recompute
    assert REFUSED - {"op:default"} <= set(searched)
    model, graph = _traced(inplace=True)
    offered = runtime_options(model, graph, SolverOptions()).recompute
    assert set(offered) == set(searched) - REFUSED
    assert "op:attention" in offered and "full" in offered
    model, graph = _traced(inplace=False)
    assert runtime_options(model, graph, SolverOptions()).recompute == searched


def test_the_planner_plans_with_the_policy_that_runs():
    """Offered only selective, op:matmuls and op:attention, the planner's plan uses op:attention on the
    model whose ReLU is in place, and may use any of them on the out-of-place one."""
    options = SolverOptions(time_budget=10.0, recompute=("selective", "op:matmuls", "op:attention"))
    model, graph = _traced(inplace=True)
    plan = planner_for(model, options)(graph, None, 1, 4)
    assert {s.recompute for s in plan.stages} == {"op:attention"}
    assert may_run(model, graph).plan_problems(plan) == []


def test_constraints_asking_for_a_refused_policy_are_refused_before_planning():
    model, graph = _traced(inplace=True)
    with pytest.raises(ConstraintError, match=r"recompute full,selective: recompute=selective: module 'layers.0.act'"):
        check_runtime_constraints(Constraints(recompute=["full", "selective"]), model, graph)
    check_runtime_constraints(Constraints(recompute=["full", "op:attention"]), model, graph)


def test_auto_parallelize_refuses_a_forced_plan_before_any_collective(single_rank, monkeypatch):
    """One rank, a plan forcing ``selective`` on a model with ``ReLU(inplace=True)``: refused in the
    checks with the module, the reason and the fix, before any collective (each one raises here)."""

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective ran before the refusal")

    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object", "barrier", "broadcast_object_list"):
        monkeypatch.setattr(dist, name, no_collective)
    model, _ = _traced(inplace=True)
    tokens = torch.randint(0, VOCAB, (4, SEQ))
    with pytest.raises(ApplyError, match=r"recompute=selective: module 'layers.0.act' mutates in place \(relu_\)"):
        auto_parallelize(
            model, tokens, global_batch_size=4, loss_fn=lm_loss, plan=uniform_plan(4, recompute="selective")
        )
