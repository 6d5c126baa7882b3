"""One decision for the planner and the runtime: ``nest_fx.plan.support`` (issue: the planner never
offers a plan the runtime refuses)."""

import torch

from nest_fx.graph import trace
from nest_fx.models import build_model
from nest_fx.plan import uniform_plan
from nest_fx.plan.support import parallel_support
from nest_fx.solver import SolverOptions
from nest_fx.solver.runtime_planner import runtime_options


def _traced(spec: str):
    model, cfg = build_model(spec, device="meta")
    return model, trace(model, (torch.empty(2, cfg.seq_len, dtype=torch.long, device="meta"),))


def test_planner_space_follows_the_runtime_verdict():
    model, graph = _traced("gpt:hidden=48,layers=2,heads=6,seq=16,vocab=64,tie_embeddings=true")
    support = parallel_support(model, graph)
    assert support.tp_problem(2) == "" and "does not divide the model's 6 attention heads" in support.tp_problem(4)
    assert support.pp_problem(2) == ""  # tied embeddings live on the first and the last stage
    opts = runtime_options(model, graph, SolverOptions())
    assert opts.tp_degrees == (1, 2) and opts.max_stages is None and opts.ep_degrees is None


def test_expert_degrees_come_from_the_runtime_verdict():
    model, graph = _traced("moe:hidden=32,layers=2,heads=4,kv=2,seq=16,vocab=64,experts=4")
    opts = runtime_options(model, graph, SolverOptions())
    assert opts.ep_degrees == (1, 2, 4) and opts.max_stages is None
    assert "does not divide the model's 4 experts" in parallel_support(model, graph).ep_problem(3)


def test_runtime_checks_say_what_the_support_says():
    from nest_fx.apply import ApplyError, checks

    model, graph = _traced("gpt:hidden=48,layers=2,heads=6,seq=16,vocab=64")
    problem = parallel_support(model, graph).tp_problem(4)
    try:
        checks.check_tp(uniform_plan(4, tp=4), model, graph)
    except ApplyError as exc:
        assert str(exc) == problem
    else:
        raise AssertionError("tp=4 on 6 heads was accepted")


def test_loss_parallel_and_cp_follow_the_runtime_verdict():
    import pytest

    from nest_fx.plan.constraints import ConstraintError, Constraints
    from nest_fx.solver.runtime_planner import check_runtime_constraints

    tied, tied_graph = _traced("gpt:hidden=48,layers=2,heads=6,seq=16,vocab=64,tie_embeddings=true")
    opts = runtime_options(tied, tied_graph, SolverOptions(cp_degrees=(1, 2, 16)))
    assert opts.loss_parallel is False  # the tied head stays replicated under TP: no vocabulary shards
    assert opts.cp_degrees == (1, 2)  # 16 tokens do not split into 2 x 16 chunks
    with pytest.raises(ConstraintError, match="loss_parallel=true: loss_parallel: .* shares its weight"):
        check_runtime_constraints(Constraints(fix={"loss_parallel": True}), tied, tied_graph)
    untied, graph = _traced("gpt:hidden=48,layers=2,heads=6,seq=16,vocab=64")
    assert runtime_options(untied, graph, SolverOptions()).loss_parallel is None  # searched
    check_runtime_constraints(Constraints(fix={"loss_parallel": True}), untied, graph)


def test_one_entry_point_answers_the_planner_and_the_runtime():
    """``nest_fx.plan.may_run``: the planner's space, a user's fixed degree and the runtime's
    checks are the same answers."""
    import pytest

    from nest_fx.apply import ApplyError, checks
    from nest_fx.cluster import load_cluster
    from nest_fx.plan.constraints import Constraints
    from nest_fx.plan.may_run import may_run

    model, graph = _traced("gpt:hidden=48,layers=2,heads=6,seq=16,vocab=64,tie_embeddings=true")
    runs = may_run(model, graph, load_cluster("cpu-gloo:8"))
    reason = runs.degree_problem("tp", 4)
    assert "does not divide the model's 6 attention heads" in reason
    assert runs.allowed("tp", (1, 2, 4, 8)) == runtime_options(model, graph, SolverOptions()).tp_degrees == (1, 2)
    assert runs.constraint_problem(Constraints(fix={"tp": 4})) == ("fix tp=4", reason)
    assert runs.constraint_problem(Constraints(fix={"tp": 2})) is None
    bad = uniform_plan(len(graph.blocks), tp=4, float8=True)
    problems = runs.plan_problems(bad)
    assert problems[0] == reason and "no fp8 rate" in problems[-1]  # Float8 runs with TP: only the device lacks it
    with pytest.raises(ApplyError, match="6 attention heads"):
        checks.check_may_run(bad, model, graph)
    assert may_run().plan_problems(uniform_plan(4, tp=4)) == []  # no model, no device: nothing to refuse
