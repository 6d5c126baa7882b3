"""What the search memoises for speed returns what it would compute afresh: a layer's cost asked
as a ``Variant`` or by name, from a warm or a fresh workload, and from a runtime-derived
workload (its own memos, not its base's); one replica's work under every schedule's recompute
modes (``TableCache.replica_work`` is keyed without them); the per-range floor as the greedy asks
it (memoised per range and in-flight count) equal to ``range_recompute`` itself."""

import dataclasses

import numpy as np
import pytest

from nest_fx.cost import memory
from nest_fx.cost.options import CostOptions
from nest_fx.solver.ordered_memory import range_recompute
from nest_fx.solver.table_cache import TableCache
from nest_fx.workload import Variant, workload_for_model

from test_stage_reach import OPTIONS
from test_stage_table import MODELS, _pairs, toy_cluster

VARIANTS = [Variant(1, 1, 1), Variant(2, 1, 2, True), Variant(2, 1, 1, True, 1, True), Variant(1, 1, 4)]


def _costs(work, variants):
    return [[work.cost(i, v) for i in range(len(work))] for v in variants]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_layer_costs_memoised_equal_fresh(model):
    cluster = toy_cluster(1.0)
    warm = workload_for_model(MODELS[model], cluster)
    variants = [v for v in VARIANTS if warm.supports(v)]
    assert len(variants) >= 2
    first = _costs(warm, variants)
    assert _costs(warm, variants) == first  # asked again: the memo
    for v in variants:  # by name: the same cost as the Variant
        for i in range(len(warm)):
            named = warm.cost(i, tp=v.tp, mbs=v.microbatch_size, sp=v.sequence_parallel, lp=v.loss_parallel)
            assert named == warm.cost(i, v)
    fresh = workload_for_model(MODELS[model], cluster)
    assert _costs(fresh, list(reversed(variants))) == list(reversed(first))  # another order, no memo shared
    # a runtime-derived workload costs with its own memos: the fused backend's differ from eager's
    fused_after = _costs(warm.for_runtime(kernels="fused"), variants)
    fused_fresh = _costs(workload_for_model(MODELS[model], cluster).for_runtime(kernels="fused"), variants)
    assert fused_after == fused_fresh
    assert fused_after != first


@pytest.mark.parametrize("model", sorted(MODELS))
def test_replica_work_same_under_every_schedules_modes(model):
    cluster = toy_cluster(1.0)
    work = workload_for_model(MODELS[model], cluster)
    pairs = [(g, p) for g, p in _pairs(work, cluster, 16, OPTIONS, 40, seed=3) if p > 1]
    assert pairs
    split = 0
    for g, p in pairs:
        other = dataclasses.replace(g, schedule="zbv", virtual_stages=2)
        one, two = (TableCache(work, cluster, CostOptions(), OPTIONS.recompute) for _ in range(2))
        split += one.modes_for(g) != two.modes_for(other)
        assert one.replica_work(g, p, 1) == two.replica_work(other, p, 1)
        assert one.layer_prefix(g, p) == two.layer_prefix(other, p)
    assert split  # the schedules' mode sets differ (zero-bubble runs no selective checkpointing)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_memoised_range_floor_equals_range_recompute(model):
    cluster = toy_cluster(0.08)
    work = workload_for_model(MODELS[model], cluster)
    cache = TableCache(work, cluster, CostOptions(), OPTIONS.recompute)
    asked = 0
    for g, p in _pairs(work, cluster, 16, OPTIONS, 40, seed=5):
        m = g.microbatches(16)
        v = g.virtual_stages
        for cap in (1e-3, 1e-2, 1e-1, 1.0):
            cache.splits_fit(g, p, m, v, cap)
        zero = memory.effective_zero_stage(g.zero, p, g.pp_shard_grads)
        per_param, inflight = cache._memory_terms(g, p, m, zero, v)
        room = cache._room_left(g, p, m, v)
        memo = cache._ranged.get((g.variant, cache.modes_for(g), per_param, room), {})
        ordered, share = cache._ordered_memory(g), cache.options.allocator_peak_share
        for (f, begin, lo, hi, n), got in memo.items():
            want = range_recompute(ordered, begin, np.arange(lo, hi + 1), f, per_param, room, share)
            assert n == hi - lo + 1 and np.array_equal(got, want)
            asked += 1
    assert asked
