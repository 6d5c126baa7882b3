"""The busiest-stage floors of tier 1 are true lower bounds: ``TableCache.stage_floor`` (each
stage's own memory, ``solver.stage_reach``) and ``TableCache.busiest_work`` (the layers'
collectives) never exceed the least ``max_i t_i`` of any plan of their (g, p) that fits, nor the
tier-1 bound with them the pair's optimum, checked against every partition and recompute choice
of small cases; and the per-stage floor bites where memory is tight (it proves pairs infeasible
and raises the busiest stage above the compute-only floor)."""

import math

import pytest

from nest_fx.cost import memory
from nest_fx.cost.options import CostOptions
from nest_fx.cost.stage_terms import compute_terms
from nest_fx.cost.step_time import simulate
from nest_fx.plan import StagePlan
from nest_fx.solver.candidates import busiest_stage_floor, layer_floors
from nest_fx.solver.tier_bounds import network_bound
from nest_fx.solver.space import SolverOptions
from nest_fx.solver.stage_reach import stage_memory_terms
from nest_fx.solver.table_cache import TableCache
from nest_fx.workload import workload_for_model

from test_stage_table import MODELS, _pairs, toy_cluster
from solver_enumeration import every_plan, stage_splits

OPTIONS = SolverOptions(
    microbatch_sizes=(1, 2),
    tp_degrees=(1, 2),
    zero_stages=(0, 1, 3),
    schedules=(("1f1b", 1), ("interleaved", 2), ("gpipe", 1), ("interleaved-zb", 2), ("zbv", 2)),
    recompute=("none", "selective", "full", "every:2"),
    max_stages=3,
)


def _plans(work, cluster, g, p, m, cost):
    """(max_i t_i, step seconds, whether every stage fits) of every partition and recompute
    choice of (g, p)."""
    for plan in every_plan(work, cluster, g, p, m, OPTIONS.recompute):
        result = simulate(plan, work, cluster, cost)
        busiest = max(sc.per_microbatch(g.virtual_stages) for sc in result.stages)
        yield busiest, result.step_s, all(sc.fits for sc in result.stages)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("memory_gib", [0.05, 0.08, 0.2])
def test_busiest_floors_never_exceed_any_fitting_plan(model, memory_gib):
    cluster = toy_cluster(memory_gib)
    work = workload_for_model(MODELS[model], cluster)
    cost = CostOptions()
    cache = TableCache(work, cluster, cost, OPTIONS.recompute)
    checked = proved = raised = 0
    for g, p in _pairs(work, cluster, 16, OPTIONS, 40, seed=11):
        m = g.microbatches(16)
        floor, busiest = cache.stage_floor(g, p, m), cache.busiest_work(g, p)
        plans = list(_plans(work, cluster, g, p, m, cost))
        fitting = [(t, step) for t, step, fits in plans if fits]
        assert busiest <= min(t for t, _, _ in plans) * (1 + 1e-9), (g, p)  # every plan: no memory in it
        bound = network_bound(cache, g, p, m, math.inf, {}, stages=True)
        if fitting:
            assert floor <= min(t for t, _ in fitting) * (1 + 1e-9), (g, p, floor)
            assert bound <= min(step for _, step in fitting) * (1 + 1e-9), (g, p, bound)
        proved += math.isinf(floor) and not math.isinf(network_bound(cache, g, p, m, math.inf, {}))
        raised += floor > float(busiest_stage_floor(layer_floors(work, g.variant), p)) * (1 + 1e-6)
        checked += 1
    assert checked >= 30
    if memory_gib < 0.1:  # tight memory: the stages' own budgets say more than the pooled one
        assert proved + raised >= 1, (proved, raised)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_stage_holds_its_states_and_inflight_activations(model):
    """The premise of both memory bounds (``forced_recompute`` and ``stage_floor``): every stage
    of every plan holds at least ``k P_i + f_i A_i`` bytes (``stage_reach.stage_memory_terms``:
    k per parameter, f_i in-flight microbatches of its blocks' activations A_i), one microbatch
    included, where the gradients and the activations are never there together (counting both
    there fails this test)."""
    cluster = toy_cluster(0.2)
    work = workload_for_model(MODELS[model], cluster)
    cost = CostOptions()
    seen = set()
    for g, p in _pairs(work, cluster, 16, OPTIONS, 400, seed=3):
        m = g.microbatches(16)
        if m > 1 and len(seen) > 40:
            continue
        zero = memory.effective_zero_stage(g.zero, p)
        k, inflight = stage_memory_terms(g, p, m, zero, g.virtual_stages, cost)
        for bounds in stage_splits(len(work), p, g.virtual_stages):
            for r in OPTIONS.recompute:
                plan = g.plan([StagePlan(a, b, g.tp, r) for a, b in zip(bounds, bounds[1:])], m, work, cluster)
                result = simulate(plan, work, cluster, cost)
                for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
                    terms = compute_terms(work.range_costs(a, b, g.variant), r)
                    held = k * terms.params + inflight[i] * (terms.act - terms.act_root)
                    assert result.stages[i].memory["total"] >= held * (1 - 1e-12), (g, p, m, i, r)
            seen.add((m == 1, p > 1))
    assert (True, False) in seen and (False, True) in seen  # one microbatch, and pipelines


def test_one_microbatch_states_leave_the_gradients_out():
    """With one microbatch the gradients and activations are never held together
    (``memory.stage_memory``): the memory floors must not count both."""
    cluster = toy_cluster(0.2)
    work = workload_for_model(MODELS["uniform"], cluster)
    cost = CostOptions()
    cache = TableCache(work, cluster, cost, OPTIONS.recompute)
    checked = 0
    for g, p in _pairs(work, cluster, 16, OPTIONS, 400, seed=3):
        m = g.microbatches(16)
        if m != 1:
            continue
        fitting = [(t, step) for t, step, fits in _plans(work, cluster, g, p, m, cost) if fits]
        if fitting:
            assert cache.stage_floor(g, p, m) <= min(t for t, _ in fitting) * (1 + 1e-9)
            assert network_bound(cache, g, p, m, math.inf, {}, stages=True) <= min(s for _, s in fitting) * (1 + 1e-9)
            checked += 1
    assert checked >= 1
