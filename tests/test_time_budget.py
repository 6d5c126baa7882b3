"""The time budget is honoured within budget + 10%: the search, and the baselines `nest-fx plan`
runs after it, on a case whose full search takes longer than the budget (65,536 devices)."""
from __future__ import annotations

import time

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.solver import SolverOptions, solve
from nest_fx.solver.baselines import run_baselines
from nest_fx.workload import workload_for_model

BUDGET = 5.0  # long enough that one unit of work between deadline checks is well under 10% on a loaded 2-core machine


@pytest.fixture(scope="module")
def large():
    cluster = load_cluster("h100-spine-leaf:65536")
    return workload_for_model("mixtral-8x7b", cluster), cluster


@pytest.mark.slow
def test_search_returns_within_its_budget(large):
    work, cluster = large
    start = time.perf_counter()
    found = solve(work, cluster, 4096, SolverOptions(time_budget=BUDGET))
    elapsed = time.perf_counter() - start
    assert elapsed <= 1.1 * BUDGET
    assert found.result.feasible
    # the budget bound: the full search takes longer (it would be complete otherwise)
    assert not found.complete


@pytest.mark.slow
def test_baselines_stop_at_the_deadline_and_say_so(large):
    work, cluster = large
    start = time.perf_counter()
    baselines = run_baselines(work, cluster, 4096, SolverOptions(), mcmc_evaluations=100_000,
                              deadline=start + BUDGET)
    assert time.perf_counter() - start <= 1.1 * BUDGET
    mcmc = next(b for b in baselines if b.name == "mcmc")
    assert mcmc.evaluations < 100_000 and "stopped at the time budget" in mcmc.notes
