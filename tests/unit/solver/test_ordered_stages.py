"""The ordered per-stage floor of tier 1 (``TableCache.splits_fit``: each stage's layers in order
with their collectives plus the recompute its own memory forces for its layer count) is a true
bound: at the busiest stage time of every plan that fits, some split fits; the tier-1 bound that
asks it at the time reaching ``best`` never drops a pair with a plan faster than ``best``; and
it proves more than the two floors it combines (``busiest_work``: the layers in order with
their collectives, no memory; ``stage_floor``: each stage's memory, its layers by count)."""

import math

import pytest

from nest_fx.cost.options import CostOptions
from nest_fx.solver.stage_bounds import SLACK
from nest_fx.solver.table_cache import TableCache
from nest_fx.solver.tier_bounds import network_bound
from nest_fx.workload import workload_for_model

from test_stage_reach import OPTIONS, _plans
from test_stage_table import MODELS, _pairs, toy_cluster


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("memory_gib", [0.08, 0.2])
def test_ordered_stages_fit_every_fitting_plan(model, memory_gib):
    cluster = toy_cluster(memory_gib)
    work = workload_for_model(MODELS[model], cluster)
    cost = CostOptions()
    cache = TableCache(work, cluster, cost, OPTIONS.recompute)
    checked = tighter = 0
    for g, p in _pairs(work, cluster, 16, OPTIONS, 40, seed=11):
        m, v = g.microbatches(16), g.virtual_stages
        fitting = [(t, step) for t, step, fits in _plans(work, cluster, g, p, m, cost) if fits]
        if not fitting:
            continue
        least_t = min(t for t, _ in fitting)
        assert cache.splits_fit(g, p, m, v, least_t * (1 + 1e-9)), (g, p, least_t)
        # a best just above the pair's optimum: the bound that asks the ordered floor keeps the pair
        best = min(step for _, step in fitting) * (1 + 1e-6)
        assert network_bound(cache, g, p, m, best, {}, stages=True) * SLACK < best, (g, p)
        # it says more than both floors it combines
        known = max(cache.busiest_work(g, p), cache.stage_floor(g, p, m))
        tighter += not math.isinf(known) and not cache.splits_fit(g, p, m, v, known * (1 + 1e-6))
        checked += 1
    if memory_gib >= 0.2:  # (at 0.05 GiB no plan fits; at 0.08 a few)
        assert checked >= 10 and tighter >= 1, (checked, tighter)
