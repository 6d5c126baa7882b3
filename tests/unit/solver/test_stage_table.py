"""The solver's vectorised stage table equals the simulator; its bounds never exceed the optimum."""

import dataclasses
import math
import random

import numpy as np
import pytest

from nest_fx.cluster import load_cluster
from nest_fx.workload import workload_for_model
from nest_fx.cluster import Cluster
from nest_fx.cost import collectives
from nest_fx.cost.collectives import cached_collective
from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import simulate, stage_cost, stage_tail
from nest_fx.plan import StagePlan
from nest_fx.solver.nest_dp import solve_partition
from nest_fx.solver.candidates import candidates
from nest_fx.solver.tier_bounds import network_bound, table_bound
from nest_fx.solver.space import SolverOptions, global_configs, stage_counts
from nest_fx.solver.stage_table import StageTable
from nest_fx.solver.table_cache import TableCache
from solver_enumeration import every_plan

MODELS = {
    "uniform": "llama:hidden=512,layers=4,heads=8,seq=512,vocab=4096",
    "moe-every-2": "moe:hidden=512,layers=4,heads=8,kv=4,seq=512,vocab=4096,experts=4,moe_every=2",
}
SPACE = SolverOptions(
    microbatch_sizes=(1, 2),
    tp_degrees=(1, 2),
    zero_stages=(0, 1, 2, 3),
    schedules=(("1f1b", 1), ("interleaved", 2), ("gpipe", 1)),
    max_stages=4,
)


def toy_cluster(memory_gib: float) -> Cluster:
    """8 devices, 2 per node on a fast link, slow links above."""
    return Cluster.from_dict(
        {
            "format": "nest-fx-cluster/1",
            "name": "toy",
            "num_devices": 8,
            "device": {
                "name": "toy",
                "memory_bytes": memory_gib * 2**30,
                "peak_flops": {"bf16": 100e12, "fp32": 20e12},
                "mem_bandwidth": 1e12,
            },
            "levels": [
                {"name": "node", "group_size": 2, "bandwidth": 100e9, "latency": 5e-6},
                {"name": "rack", "group_size": 8, "bandwidth": 2e9, "latency": 2e-5},
            ],
        }
    )


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request):
    cluster = toy_cluster(0.2)
    return workload_for_model(MODELS[request.param], cluster), cluster


def _pairs(work, cluster, batch, options, count, seed):
    rng = random.Random(seed)
    pairs = [
        (g, p)
        for g in global_configs(work, cluster, batch, options)
        for p in stage_counts(work, cluster, g, batch, options)
    ]
    rng.shuffle(pairs)
    return pairs[:count]


def _slot_plan(work, cluster, g, p, m, i, start, end, mode, n):
    """A plan whose stage i holds [start, end) in ``mode`` (what stage i's cost depends on)."""
    plan = dataclasses.replace(g.plan([StagePlan(k, k + 1, g.tp) for k in range(p)], m, work, cluster), num_layers=n)
    plan.stages[i] = StagePlan(start, end, g.tp, mode)
    if i > 0:
        plan.stages[i - 1] = StagePlan(start - 1, start, g.tp)
    return plan


@pytest.mark.parametrize(
    "overlap, overheads", [(True, False), (False, False), (True, True), (0.5, False), ("dispatch", False)]
)
def test_table_equals_stage_cost_exactly(case, overlap, overheads):
    work, cluster = case
    if overlap == "dispatch":  # another system's expert all-to-all: each token once per owner rank
        cost = CostOptions(expert_dispatch="per-rank", expert_routing="contiguous")
    else:
        cost = CostOptions(overlap_grad_sync=overlap)
    if overlap == 0.5:  # measured shares (docs/cost_model.md, "Overlap") of every kind at once
        cost = CostOptions(
            overlap_grad_sync=0.5, overlap_tp_comm=0.25, overlap_ep_comm=0.5, overlap_cp_comm=0.5, overlap_p2p=0.5
        )
    if overheads:  # the runtime's host work per TP and FSDP collective (CPU-like figures)
        cost = CostOptions(tp_call_overhead=(2e-3, 1e-9), fsdp_call_overhead=(5e-3, 2e-9))
    cache = TableCache(work, cluster, cost, SPACE.recompute)
    n, checked = len(work), 0
    seed = 5 if overlap == "dispatch" else int(overlap) + 2 * int(overheads)
    for g, p in _pairs(work, cluster, 16, SPACE, 150, seed=seed):
        m = g.microbatches(16)
        table = StageTable(cache, g, p, m)
        for i in range(p):
            firsts = [0] if i == 0 else range(i, n - p + i + 1)
            for b, e in ((b, e) for b in firsts for e in range(b + 1, n - p + i + 2)):
                if i == p - 1 and e != n:
                    continue
                c = table.cls[b, e]
                if e - b < g.virtual_stages:  # fewer layers than interleaved model chunks: never a stage of a plan
                    assert c == table.size
                    continue
                for r in table.modes:
                    plan = _slot_plan(work, cluster, g, p, m, i, b, e, r, n)
                    sc = stage_cost(work, cluster, plan, i, cost)
                    assert table.t[r][i, c] == sc.per_microbatch(g.virtual_stages)
                    assert table.s[r][i, c] == sc.span(g.virtual_stages)
                    assert bool(table.fits[r][i, c]) == sc.fits
                    q = table._tail_values(i, np.array([c]))[r][0]
                    assert q == sum(stage_tail(sc, plan, cluster, cost))
                    checked += 1
    assert checked > 1500


def _pair_optimum(work, cluster, g, p, m, modes):
    """The best feasible plan of one (g, p) by enumeration: every partition, every mode per stage."""
    best = math.inf
    for plan in every_plan(work, cluster, g, p, m, modes):
        r = simulate(plan, work, cluster)
        if r.feasible:
            best = min(best, r.step_s)
    return best


def test_bounds_never_exceed_the_pair_optimum_and_the_dp_reaches_it(case):
    work, cluster = case
    options = SolverOptions(
        microbatch_sizes=(1, 2),
        tp_degrees=(1, 2),
        zero_stages=(1, 3),
        schedules=(("1f1b", 1), ("interleaved", 2)),
        recompute=("none", "full"),
        max_stages=3,
    )
    lb0 = {(g, p): lb for lb, g, p in candidates(work, cluster, 16, options)}
    cache = TableCache(work, cluster, options.cost, options.recompute)
    feasible = 0
    for g, p in _pairs(work, cluster, 16, options, 24, seed=3):
        if (g, p) not in lb0:  # screened out: then nothing of it fits
            assert _pair_optimum(work, cluster, g, p, g.microbatches(16), options.recompute) == math.inf
            continue
        m = g.microbatches(16)
        optimum = _pair_optimum(work, cluster, g, p, m, options.recompute)
        tolerance = optimum * (1 + 1e-9)
        assert lb0[(g, p)] <= tolerance
        assert network_bound(cache, g, p, m) <= tolerance
        for best in (math.inf, optimum * 1.5):  # bounds on the plans faster than ``best``
            table = StageTable(cache, g, p, m, best)
            assert table_bound(table, best, exact_tails=False) <= tolerance
            assert table_bound(table, best, exact_tails=True) <= tolerance
            found = solve_partition(table, best)
            if optimum == math.inf:
                assert found is None
            else:
                assert found.step_s == pytest.approx(optimum, rel=1e-9)
        feasible += optimum < math.inf
    assert feasible >= 5


def test_memoised_collectives_equal_the_model():
    cluster = load_cluster("h100-spine-leaf:1024")
    rng = random.Random(0)
    for _ in range(60):
        size = rng.choice([2, 3, 8, 64, 300])
        group = sorted(rng.sample(range(1024), size))
        kind = rng.choice(["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
        for nbytes in (0.0, 1e3, rng.uniform(1e6, 1e9)):
            assert cached_collective(kind, cluster, group, nbytes) == collectives.collective_time(
                kind, cluster, group, nbytes
            )
        a, b = rng.sample(range(1024), 2)
        assert cached_collective("p2p", cluster, (a, b), 1e6) == collectives.p2p(cluster, a, b, 1e6)
