"""What the search computes once or on arrays for speed (round 7) returns, bit for bit, what the
fresh, one-at-a-time computation does: the network-free spans per interleave factor kept across a
pair's tiers (``tier_bounds._FactorSpans``), a stage table's recompute modes built at once and
its tails q_i for every mode at once, the tail floor's DP sync at its two sizes as numbers, the
collective functions resolved once per rank group (``TableCache.collective``), the replica's terms
from integer counts, the recompute floors keyed by in-flight counts, the in-flight sums of the
forced recompute, and ``every:<k>``'s block counts shared by the factors of one range."""

import dataclasses
import math

import numpy as np
import pytest

from nest_fx.cost.recv_buffers import recv_buffer_bytes
from nest_fx.cost import inflight, memory
from nest_fx.cost.collectives import collective_fn
from nest_fx.cost.dp_sync import dp_sync_time, reduce_spread, tail_terms
from nest_fx.cost.memory import held_per_microbatch, stage_memory
from nest_fx.cost.options import CostOptions
from nest_fx.cost.results import microbatch_time, stage_work
from nest_fx.cost.stage_terms import compute_terms
from nest_fx.cost.step_time import exposed_comms
from nest_fx.solver.ordered_memory import _every, range_recompute
from nest_fx.solver.range_classes import range_classes, replica_terms
from nest_fx.solver.stage_reach import recompute_floors
from nest_fx.solver.stage_table import StageTable
from nest_fx.solver.table_cache import TableCache, _distinct
from nest_fx.solver.tier_bounds import NO_NETWORK, TAILS, WHOLE, network_bounds
from nest_fx.workload import Variant, workload_for_model

from test_stage_reach import OPTIONS
from test_stage_table import MODELS, _pairs, toy_cluster


def _setup(model, memory_gib=1.0, seed=3, count=40):
    cluster = toy_cluster(memory_gib)
    work = workload_for_model(MODELS[model], cluster)
    return cluster, work, _pairs(work, cluster, 16, OPTIONS, count, seed=seed)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_factor_spans_kept_across_tiers_equal_fresh_bounds(model):
    """The bounds one search memo gives a pair at each tier (in the order the search asks them, at
    falling incumbents) equal a fresh call's without any memo."""
    cluster, work, pairs = _setup(model, 0.3)
    shared = TableCache(work, cluster, CostOptions(), OPTIONS.recompute)
    memo: dict = {}
    asked = finite = 0
    for g, p in pairs:
        m = g.microbatches(16)
        factors = list(range(2, len(work) // p + 1)) if g.schedule == "interleaved" else [g.virtual_stages]
        for best in (math.inf, 10.0, 1e-2, 1e-4):
            for upto in (NO_NETWORK, TAILS, WHOLE):
                got = network_bounds(shared, g, p, m, factors, best, memo, upto=upto)
                fresh = TableCache(work, cluster, CostOptions(), OPTIONS.recompute)
                assert got == network_bounds(fresh, g, p, m, factors, best, None, upto=upto)
                asked += 1
                finite += any(math.isfinite(b) for b in got)
    assert asked and finite


def _table_per_mode(table: StageTable, cache: TableCache, g, p, m):
    """t, s and fits of every mode the way one mode's table was built before (one (p, K) array each)."""
    rc, opts = cache.classes(g), cache.options
    k = table.size
    held = table.cls < k  # the ranges of a live class: their class of the whole range set
    live = np.full(k, -1, dtype=np.intp)
    live[table.cls[held]] = rc.cls[held]
    assert (live >= 0).all() and np.array_equal(np.sort(live), live)  # every live class, in order
    states, estates, _, _, _, gathered, unsharded, scratch = cache.states(g, p)
    states = {key: v[live] for key, v in states.items()}
    estates = {key: v[live] for key, v in estates.items()}
    p2p = cache.p2p(g, p)[:, rc.prev[live]]
    out = {}
    for r in table.modes:
        terms = table.terms[r]
        comms = {key: v[:, live] for key, v in cache.comms(g, p, r).items()}
        exposed = exposed_comms(comms, terms.fwd + terms.bwd + terms.recompute, opts)
        work = stage_work(terms.fwd, terms.bwd, terms.recompute, exposed["tp"], exposed["ep"], exposed["cp"])
        t, s = microbatch_time(work, p2p, g.virtual_stages, opts.overlap_p2p)
        act = held_per_microbatch(
            terms.act, rc.out_bytes[live], p, g.virtual_stages, opts, g.tp if g.sequence_parallel else 1
        )
        held = np.array(
            [
                inflight.held_activation_bytes(act, terms.act_root, g.schedule, i, p, m, g.virtual_stages)
                for i in range(p)
            ]
        ).reshape(p, k)
        sp = g.tp if g.sequence_parallel else 1
        buffers = np.array(
            [
                recv_buffer_bytes(
                    rc.out_bytes[live], rc.in_bytes[live], i, p, m, g.virtual_stages, g.schedule, opts, sp
                )
                for i in range(p)
            ]
        ).reshape(p, k)
        mem = stage_memory(
            states, estates, held, terms.layer_peak, rc.out_bytes[live], gathered[live], unsharded[live],
            scratch[live], num_microbatches=m, options=opts, buffers=buffers,
        )  # fmt: skip
        out[r] = (t, s, mem["total"] <= cache.capacity)
    return out


@pytest.mark.parametrize("model", sorted(MODELS))
def test_stage_table_modes_at_once_equal_one_mode_at_a_time(model):
    cluster, work, pairs = _setup(model, 0.3, seed=7, count=25)
    cache = TableCache(work, cluster, CostOptions(), OPTIONS.recompute)
    tails = 0
    for g, p in pairs:
        m = g.microbatches(16)
        table = StageTable(cache, g, p, m)
        k = table.size
        for r, (t, s, fits) in _table_per_mode(table, cache, g, p, m).items():
            assert np.array_equal(table.t[r][:, :k], t) and np.array_equal(table.s[r][:, :k], s)
            assert np.array_equal(table.fits[r][:, :k], fits)
        cols = np.arange(k)
        for i in range(p):
            got = table._tail_values(i, cols)
            for r in table.modes:  # q_i one mode at a time, from the DP sync the table computed
                terms = table.terms[r]
                exposed, t_opt = tail_terms(
                    table._sync[i, cols], terms.bwd[cols], terms.recompute[cols], terms.params[cols], g.shard,
                    table.zero, cluster, cache.options, table._tied[i], reduce_spread(table.zero, p, m),
                )  # fmt: skip
                assert np.array_equal(got[r], exposed + t_opt)
                tails += k
    assert tails


@pytest.mark.parametrize("model", sorted(MODELS))
def test_tail_floor_syncs_as_numbers_equal_the_array_of_both_sizes(model):
    cluster, work, pairs = _setup(model)
    cache = TableCache(work, cluster, CostOptions(), OPTIONS.recompute)
    checked = 0
    for g, p in pairs:
        m = g.microbatches(16)
        zero = memory.effective_zero_stage(g.zero, p, g.pp_shard_grads)
        for d, e in ((3.0e6, 0.0), (0.0, 2.5e6), (1.0e6, 7.0e5)):
            least, slope, affine = cache._stage_syncs(g, p, m, zero, d, e)
            sizes = np.array([1.0, 2.0])
            at = []
            for groups in _distinct(cache.layout(g, p))[0]:  # the array form, with collective_fn itself
                y = dp_sync_time(
                    cluster, groups, d * sizes, e * sizes, g.dp * g.cp, g.ep, zero, m, cache.options, 0.0,
                    d * sizes if g.float8 else 0.0,
                )  # fmt: skip
                at.append((float(y[0]), float(y[1])) if isinstance(y, np.ndarray) else (float(y), float(y)))
            assert least == min(y0 for y0, _ in at)
            assert slope == (min(y1 - y0 for y0, y1 in at) / (d + e) if affine else 0.0)
            checked += least > 0
    assert checked


@pytest.mark.parametrize("model", sorted(MODELS))
def test_collective_once_per_group_equals_collective_fn(model):
    cluster, work, pairs = _setup(model)
    cache = TableCache(work, cluster, CostOptions(), OPTIONS.recompute)
    sizes = np.array([0.0, 1.0, 3.5e6, 2.0e9])
    seen = 0
    for g, p in pairs:
        for groups in cache.layout(g, p):
            for group in (groups.dp, groups.expert_dp, groups.shard, groups.replicate):
                if len(group) < 2:
                    continue
                for kind in ("all_reduce", "reduce_scatter", "all_gather"):
                    first = cache.collective(kind, cluster, group)
                    assert cache.collective(kind, cluster, group) is first  # resolved once
                    want = collective_fn(kind, cluster, group)
                    assert np.array_equal(first(sizes), want(sizes)) and first(7.0e5) == want(7.0e5)
                    seen += 1
            m = g.microbatches(16)
            for zero in (0, 1, 2, 3):
                args = (cluster, groups, 4.0e6, 1.5e6, g.dp * g.cp, g.ep, zero, m, cache.options)
                assert dp_sync_time(*args, collective=cache.collective) == dp_sync_time(*args)
    assert seen


@pytest.mark.parametrize("model", sorted(MODELS))
def test_replica_terms_from_int_counts_equal_numpy_counts(model):
    cluster = toy_cluster(1.0)
    work = workload_for_model(MODELS[model], cluster)
    for v in (Variant(1, 1, 1), Variant(2, 1, 2, True)):
        rc = replica_terms(work, v, OPTIONS.recompute)
        whole = range_classes(work, v, OPTIONS.recompute)
        cls = whole.cls[0, len(work)]
        for r in rc.modes:  # numpy integer counts, as before, and the range classes' whole range
            want = compute_terms(list(zip(rc.costs, rc.counts)), r)
            assert dataclasses.asdict(rc.terms[r]) == dataclasses.asdict(want)
            assert float(rc.terms[r].fwd) == float(whole.terms[r].fwd[cls])
            assert float(rc.terms[r].recompute) == float(whole.terms[r].recompute[cls])


@pytest.mark.parametrize("model", sorted(MODELS))
def test_memory_floor_memos_equal_fresh(model):
    """recompute floors keyed by in-flight counts, the in-flight sums of the forced recompute."""
    cluster, work, pairs = _setup(model, 0.08, seed=5)
    cache = TableCache(work, cluster, CostOptions(), OPTIONS.recompute)
    finite = 0
    for g, p in pairs:
        m, v = g.microbatches(16), g.virtual_stages
        zero = memory.effective_zero_stage(g.zero, p, g.pp_shard_grads)
        for cap in (1e-3, 1e-1, 10.0):
            cache.splits_fit(g, p, m, v, cap)
        per_param, inflight_ = cache._memory_terms(g, p, m, zero, v)
        room = cache._room_left(g, p, m, v)  # the capacity less every stage's least receive buffers
        assert room < cache.capacity if p > 1 else room == cache.capacity
        floors = cache._recompute_floors[(g.variant, cache.replica(g).modes, per_param, tuple(inflight_), room)]
        assert np.array_equal(floors, recompute_floors(cache._reach_terms(g), inflight_, per_param, room))
        got = cache.forced_recompute(g, p, m, v)
        params, kept, segments = cache._recompute_hull(g)  # the formula with the sums taken afresh
        excess = kept - (room * sum(1.0 / f for f in inflight_) - per_param * params / max(inflight_))
        seconds = 0.0
        for rate, saved in segments:
            if excess <= 0:
                break
            take = min(saved, excess)
            seconds, excess = seconds + rate * take, excess - take
        assert got == (seconds if excess <= 0 else math.inf)
        finite += math.isfinite(got) and got > 0
    assert finite


def test_every_with_shared_block_counts_equals_its_own():
    cluster = toy_cluster(0.08)
    work = workload_for_model(MODELS["uniform"], cluster)
    cache = TableCache(work, cluster, CostOptions(), OPTIONS.recompute)
    g = next(g for g, _ in _pairs(work, cluster, 16, OPTIONS, 40, seed=1))
    ordered = cache._ordered_memory(g)
    assert ordered.every
    n = len(work)
    for begin in range(n):
        ends = np.arange(begin + 1, n + 1)
        held = ordered.counts[:, ends] - ordered.counts[:, [begin]]
        kept_none = ordered.none_kept @ held
        blocks = held[ordered.order]
        shared = (blocks, blocks.sum(axis=0), np.cumsum(blocks, axis=0) - blocks)
        for k in ordered.every:
            for a, b in zip(_every(ordered, held, k, kept_none, shared), _every(ordered, held, k, kept_none)):
                assert np.array_equal(a, b)
        floor = range_recompute(ordered, begin, ends, 2.0, 16.0, cache.capacity, 0.1)
        assert floor.shape == ends.shape
