"""The search's tier-1 bounds: the tail bound (``TableCache.tail_floor``) never exceeds the largest tail
q_i = exposed DP sync + optimizer step of any plan of its (g, p), checked against every
partition and recompute choice of small cases, and it bites (it prunes what the optimizer step
alone would not); the linear-partition floor on the busiest stage's compute."""

import dataclasses
import itertools
import math
import random

import pytest

from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import simulate, stage_tail
from nest_fx.solver.candidates import partition_floor
from nest_fx.solver.space import SolverOptions
from nest_fx.solver.table_cache import TableCache
from nest_fx.workload import workload_for_model

from test_stage_table import MODELS, _pairs, toy_cluster
from solver_enumeration import every_plan

OPTIONS = SolverOptions(
    microbatch_sizes=(1, 2),
    tp_degrees=(1, 2),
    zero_stages=(0, 1, 3),
    schedules=(("1f1b", 1), ("interleaved", 2)),
    recompute=("none", "full"),
    max_stages=3,
)


def _largest_tails(work, cluster, g, p, m, cost):
    """(least max_i q_i, least optimizer step of the largest stage) over every partition and
    recompute choice of (g, p), feasible in memory or not."""
    least = math.inf
    for plan in every_plan(work, cluster, g, p, m, OPTIONS.recompute):
        result = simulate(plan, work, cluster, cost)
        least = min(least, max(sum(stage_tail(sc, plan, cluster, cost)) for sc in result.stages))
    return least


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_tail_floor_never_exceeds_any_plans_largest_tail(model, share):
    cluster = toy_cluster(0.2)
    work = workload_for_model(MODELS[model], cluster)
    cost = dataclasses.replace(CostOptions(), overlap_grad_sync=share)
    cache = TableCache(work, cluster, cost, OPTIONS.recompute)
    checked = bites = 0
    for g, p in _pairs(work, cluster, 16, OPTIONS, 30, seed=5):
        m = g.microbatches(16)
        floor = cache.tail_floor(g, p, m)
        least = _largest_tails(work, cluster, g, p, m, cost)
        assert floor <= least * (1 + 1e-9), (g, p, floor, least)
        t_opt = float(cache.states(g, p)[4].max()) / p  # the optimizer step of an average stage
        bites += floor > 2 * t_opt
        checked += 1
    assert checked >= 20
    assert bites >= 1  # the DP sync term raises the floor above the optimizer step somewhere


def test_partition_floor_is_the_linear_partition_optimum_from_below():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 9)
        times = [rng.choice([0.0, rng.uniform(0.01, 1.0), 5.0 * rng.random()]) for _ in range(n)]
        prefix = [0.0, *itertools.accumulate(times)]
        for p in range(1, n + 1):
            optimum = min(
                max(prefix[b] - prefix[a] for a, b in zip((0, *cuts), (*cuts, n)))
                for cuts in itertools.combinations(range(1, n), p - 1)
            )
            floor = partition_floor(prefix, p)
            assert floor <= optimum
            if p < n:
                assert floor >= optimum * (1 - 1e-3)  # the bisection gets within its precision
