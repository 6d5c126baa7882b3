"""The per-range memory floor of tier 1 (``ordered_memory.range_recompute``, read by
``TableCache.splits_fit``) is a true lower bound: no stage of any plan that fits re-runs less
than it says for its own layer range and recompute mode (every split and mode of small cases,
tight memory), and the tier-1 bound that asks it never drops a pair's optimum; it never grows
when a range loses a layer (what the greedy of ``stage_reach.splits_fit`` needs); and it proves
more than the by-count floor alone (pairs whose busiest stage it shows slower)."""

import math

import numpy as np
import pytest

from nest_fx.cost import memory
from nest_fx.cost.options import CostOptions
from nest_fx.cost.stage_terms import compute_terms
from nest_fx.cost.step_time import simulate
from nest_fx.solver.stage_bounds import SLACK
from nest_fx.solver.stage_reach import splits_fit
from nest_fx.solver.table_cache import TableCache
from nest_fx.solver.tier_bounds import network_bound
from nest_fx.solver.ordered_memory import _every, range_recompute
from nest_fx.workload import workload_for_model

from test_stage_reach import OPTIONS
from test_stage_table import MODELS, _pairs, toy_cluster
from solver_enumeration import every_plan


def _ranged(cache, g, p, m):
    """(the per-range floor of stage i as ``splits_fit`` asks it, the by-count floors)."""
    zero = memory.effective_zero_stage(g.zero, p, g.pp_shard_grads)
    per_param, inflight = cache._memory_terms(g, p, m, zero, g.virtual_stages)
    ordered = cache._ordered_memory(g)
    cache.splits_fit(g, p, m, g.virtual_stages, 0.0)  # fills the by-count floors
    room = cache._room_left(g, p, m, g.virtual_stages)  # the capacity less every stage's receive buffers
    key = (g.variant, cache.replica(g).modes, per_param, tuple(inflight), room)  # TableCache.splits_fit's

    def ranged(i, begin, ends):
        share = cache.options.allocator_peak_share
        return range_recompute(ordered, begin, np.asarray(ends), inflight[i], per_param, room, share)

    return ranged, cache._recompute_floors[key]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("memory_gib", [0.08, 0.2])
def test_range_floor_never_exceeds_a_fitting_stage(model, memory_gib):
    cluster = toy_cluster(memory_gib)
    work = workload_for_model(MODELS[model], cluster)
    cost = CostOptions()
    cache = TableCache(work, cluster, cost, OPTIONS.recompute)
    stages = pairs_kept = 0
    for g, p in _pairs(work, cluster, 16, OPTIONS, 40, seed=11):
        m = g.microbatches(16)
        ranged, _ = _ranged(cache, g, p, m)
        best = math.inf
        for plan in every_plan(work, cluster, g, p, m, OPTIONS.recompute):
            result = simulate(plan, work, cluster, cost)
            for i, (sp, sc) in enumerate(zip(plan.stages, result.stages)):
                if not sc.fits:
                    continue
                seconds = compute_terms(work.range_costs(sp.start, sp.end, g.variant), sp.recompute).recompute
                floor = float(ranged(i, sp.start, [sp.end])[0])
                assert floor <= seconds * (1 + 1e-9) + 1e-15, (g, p, i, sp, floor, seconds)
                stages += 1
            if all(sc.fits for sc in result.stages):
                best = min(best, result.step_s)
        if not math.isinf(best):  # the bound asking it at a best just above the optimum keeps the pair
            assert network_bound(cache, g, p, m, best * (1 + 1e-6), {}, stages=True) * SLACK < best * (1 + 1e-6)
            pairs_kept += 1
    assert stages >= 50, stages
    if memory_gib >= 0.2:  # (at 0.08 GiB few whole plans fit)
        assert pairs_kept >= 5, pairs_kept


@pytest.mark.parametrize("model", sorted(MODELS))
def test_range_floor_never_grows_when_a_range_shrinks(model):
    cluster = toy_cluster(0.08)
    work = workload_for_model(MODELS[model], cluster)
    cache = TableCache(work, cluster, CostOptions(), OPTIONS.recompute)
    layers = len(work)
    checked = 0
    for g, p in _pairs(work, cluster, 16, OPTIONS, 20, seed=5):
        ranged, _ = _ranged(cache, g, p, g.microbatches(16))
        for i in range(p):
            for b in range(layers):
                row = ranged(i, b, range(b + 1, layers + 1))
                assert np.all(row[1:] >= row[:-1]), (g, p, i, b, row)  # longer from the same start
                later = ranged(i, b + 1, range(b + 1, layers + 1))  # later start, same ends
                assert np.all(later <= row), (g, p, i, b)
                checked += 1
    assert checked >= 20


@pytest.mark.parametrize("model", sorted(MODELS))
def test_range_floor_proves_more_than_the_count_floor(model):
    """At the least busiest-stage time the by-count floors allow, the ranges' own memory shows
    some pair cannot fit (tight memory)."""
    cluster = toy_cluster(0.08)
    work = workload_for_model(MODELS[model], cluster)
    cache = TableCache(work, cluster, CostOptions(), OPTIONS.recompute)
    proved = 0
    for g, p in _pairs(work, cluster, 16, OPTIONS, 200, seed=11):
        if p == 1:
            continue
        m = g.microbatches(16)
        ranged, floors = _ranged(cache, g, p, m)
        prefix = cache.layer_prefix(g, p)
        caps = sorted(
            {
                prefix[e] - prefix[b] + float(floors[i, e - b])
                for i in range(p)
                for b in range(len(prefix))
                for e in range(b, len(prefix))
            }
        )
        caps = [c for c in caps if math.isfinite(c)]
        cap = next((c for c in caps if splits_fit(prefix, floors, c * (1 + 1e-9))), None)
        if cap is not None and not splits_fit(prefix, floors, cap * (1 + 1e-9), ranged):
            proved += 1
    assert proved >= 1


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_k_sums_equal_compute_terms(model):
    """The vectorised ``every:<k>`` sums of ``range_recompute`` are ``compute_terms``' own."""
    cluster = toy_cluster(0.2)
    work = workload_for_model(MODELS[model], cluster)
    cache = TableCache(work, cluster, CostOptions(), ("none", "full", "every:2", "every:3"))
    for g, _ in _pairs(work, cluster, 16, OPTIONS, 10, seed=2):
        ordered = cache._ordered_memory(g)
        layers = len(work)
        for b in range(layers):
            ends = np.arange(b + 1, layers + 1)
            held = ordered.counts[:, ends] - ordered.counts[:, [b]]
            for k in (2, 3):
                kept, seconds, peak = _every(ordered, held, k, ordered.none_kept @ held)
                for j, e in enumerate(ends):
                    t = compute_terms(work.range_costs(b, int(e), g.variant), f"every:{k}")
                    assert kept[j] == pytest.approx(t.act - t.act_root, rel=1e-12, abs=1e-9)
                    assert seconds[j] == pytest.approx(t.recompute, rel=1e-12, abs=1e-15)
                    assert peak[j] == pytest.approx(t.layer_peak, rel=1e-12, abs=1e-9)
