"""plan.async_tp (micro-pipelined TP): declared once, priced by the cost model, planned when
asked for, and refused before training where it cannot run (CPU ranks, no compile, no SP)."""

from __future__ import annotations

import pytest

from nest_fx.apply import ApplyError, checks
from nest_fx.apply.losses import lm_loss
from nest_fx.cluster import load_cluster
from nest_fx.cost.step_time import simulate
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan
from nest_fx.plan.constraints import Constraints
from nest_fx.plan.may_run import unrun_fields
from nest_fx.solver import SolverOptions
from nest_fx.solver.constraints import ConstraintError, solve_constrained
from nest_fx.workload import workload_for_model

MODEL = "llama:hidden=1024,layers=4,heads=16,seq=1024,vocab=4096"
SPACE = SolverOptions(microbatch_sizes=(1, 2), tp_degrees=(1, 2, 4), cp_degrees=(1,), zero_stages=(1, 3))


@pytest.fixture(scope="module")
def h100():
    cluster = load_cluster("dgx-h100:8")
    return workload_for_model(MODEL, cluster), cluster


def test_async_tp_needs_tp_sequence_parallel_and_compile():
    assert unrun_fields(uniform_plan(4, tp=2, async_tp=True, sequence_parallel=True, compile=True)) == []
    (problem,) = unrun_fields(uniform_plan(4, tp=2, async_tp=True))
    assert "async_tp needs sequence_parallel=true, compile=true" in problem and "async_tp=false" in problem
    (problem,) = unrun_fields(uniform_plan(4, dp=2, async_tp=True, sequence_parallel=True, compile=True))
    assert "tp > 1 (tp=1)" in problem


def test_async_tp_is_refused_on_cpu_before_training():
    model, _ = build_seeded("llama:hidden=64,layers=2,heads=4,seq=32,vocab=128")
    plan = uniform_plan(4, tp=2, async_tp=True, sequence_parallel=True, compile=True)
    with pytest.raises(ApplyError, match=r"async_tp: .*no CUDA device.*fix: .*async_tp=false"):
        checks.check_runtime_options(plan, model, None, lm_loss, "cpu")


def test_async_tp_hides_tp_collectives_under_compute(h100):
    work, cluster = h100
    plain = uniform_plan(
        len(work), tp=4, dp=2, sequence_parallel=True, compile=True, microbatch_size=1, num_microbatches=4
    )
    fused = uniform_plan(
        len(work),
        tp=4,
        dp=2,
        sequence_parallel=True,
        compile=True,
        async_tp=True,
        microbatch_size=1,
        num_microbatches=4,
    )
    a, b = simulate(plain, work, cluster), simulate(fused, work, cluster)
    assert a.stages[0].tp_comm > 0 and b.stages[0].tp_comm < a.stages[0].tp_comm
    assert b.step_s < a.step_s


def test_the_planner_plans_async_tp_when_fixed_and_names_what_it_needs(h100):
    work, cluster = h100
    plan = solve_constrained(work, cluster, 16, Constraints(fix={"async_tp": True, "compile": True}), SPACE).plan
    assert plan.async_tp and plan.compile and plan.sequence_parallel and plan.stages[0].tp > 1
    assert unrun_fields(plan) == []
    with pytest.raises(ConstraintError, match="fix.async_tp.*async_tp needs compile=true"):
        solve_constrained(work, cluster, 16, Constraints(fix={"async_tp": True}), SPACE)
