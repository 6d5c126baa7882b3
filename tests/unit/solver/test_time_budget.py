"""The time budget on a fake clock (1 ms per reading, the ``fake_clock`` fixture): the search and
the baselines `nest-fx plan` runs after it read their deadline, stop within a few readings of it and
return the best plan they have. Deterministic on any machine: the wall-clock overrun under load
(budget + 10% at 65,536 devices) is measured by ``scripts/bench_planner.py --budget-check``."""

from __future__ import annotations

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.solver import NoFeasiblePlan, SolverOptions, solve
from nest_fx.solver.baselines import run_baselines
from nest_fx.workload import workload_for_model

TICK = 1e-3
BUDGET = 1.0  # 1,000 readings: the baselines' recipes finish inside it, MCMC does not
SEARCH_BUDGET = 0.5  # 500 readings; the complete search of this case reads the clock 1,509 times (2026-11-26)
OVERRUN = 20 * TICK  # readings the planners may take between passing the deadline and returning


@pytest.fixture(scope="module")
def large():
    cluster = load_cluster("h100-spine-leaf:1024")
    return workload_for_model("llama3-70b", cluster, seq=2048), cluster


def test_search_stops_at_its_deadline_with_its_best_plan(large, fake_clock):
    work, cluster = large
    clock = fake_clock(TICK)
    found = solve(work, cluster, 4096, SolverOptions(time_budget=SEARCH_BUDGET))
    assert clock.now <= SEARCH_BUDGET + OVERRUN, clock.reads
    assert not found.complete  # the deadline cut the search short ...
    assert found.result.feasible and found.plan.devices_used <= 1024  # ... and it kept its best plan
    assert found.plan.predicted["step_s"] == pytest.approx(found.result.step_s)


def test_a_budget_too_short_for_any_plan_says_so(large, fake_clock):
    work, cluster = large
    fake_clock(TICK)
    with pytest.raises(NoFeasiblePlan, match=r"within the time budget of 0.002 s .*allow more time"):
        solve(work, cluster, 4096, SolverOptions(time_budget=2 * TICK))


def test_baselines_stop_at_the_deadline_and_say_so(large, fake_clock):
    work, cluster = large
    clock = fake_clock(TICK)
    deadline = clock() + BUDGET
    baselines = run_baselines(work, cluster, 4096, SolverOptions(), mcmc_evaluations=100_000, deadline=deadline)
    assert clock.now <= deadline + OVERRUN, clock.reads
    by_name = {b.name: b for b in baselines}
    assert by_name["megatron"].plan is not None  # the recipes finished before the deadline
    mcmc = by_name["mcmc"]
    assert mcmc.evaluations < 100_000 and "stopped at the time budget" in mcmc.notes
