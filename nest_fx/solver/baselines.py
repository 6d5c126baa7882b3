"""Baseline planners on the same cost model (``step_time.simulate``), for comparison.

* the recipes of ``solver.recipes``: Megatron-LM and torchtitan, as their authors run them;
* ``phaze``: network-unaware search over uniform stages, in the spirit of Phaze
  (Wang et al.): every (tp, dp, pp, microbatch, recompute) with an even layer split is scored
  on a flat network (every level as fast as the innermost), the best is then run on the real
  network.
* ``mcmc``: random search with Metropolis moves over the same space as the NEST DP, with a
  fixed number of evaluations.
* ``exhaustive``: every plan of the search space (all contiguous partitions, all recompute
  assignments); only for small instances, to check the DP's exactness.

The searching baselines (phaze, mcmc, exhaustive) search the space ``SolverOptions`` allows, user
constraints included; the recipes are fixed procedures and take only the cost options
(optimizer, memory headroom) from it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from typing import Iterator, List, Optional, Sequence

from nest_fx.cluster.spec import NetworkLevel
from nest_fx.cluster.topology.graph_cluster import GraphCluster
from nest_fx.cost.step_time import simulate
from nest_fx.plan import Plan, StagePlan
from nest_fx.plan.may_run import unrun_fields
from nest_fx.plan.plan import interleave_problem
from nest_fx.solver.baseline_result import Baseline, evaluate
from nest_fx.solver.candidates import candidates
from nest_fx.solver.recipes import megatron, torchtitan
from nest_fx.solver.space import SolverOptions
from nest_fx.workload import Workload

BASELINES = ("megatron", "torchtitan", "phaze", "mcmc")


def run_baselines(
    workload: Workload,
    cluster,
    global_batch: int,
    options: Optional[SolverOptions] = None,
    mcmc_evaluations: int = 2000,
    deadline: Optional[float] = None,
) -> List[Baseline]:
    """Megatron, torchtitan, Phaze-style and MCMC (:data:`BASELINES`), each timed. With a
    ``deadline`` (a ``time.perf_counter()`` value) each stops there with what it has found, and
    says so in its notes."""
    out = []
    options = (options or SolverOptions()).priced()
    for fn, kwargs in ((megatron, {}), (torchtitan, {}), (phaze, {}), (mcmc, {"evaluations": mcmc_evaluations})):
        start = time.perf_counter()
        b = fn(workload, cluster, global_batch, options, deadline=deadline, **kwargs)
        b.seconds = time.perf_counter() - start
        if deadline is not None and time.perf_counter() > deadline and not b.notes:
            b.notes = f"stopped at the time budget after {b.evaluations} evaluations"
        out.append(b)
    return out


def _past(deadline: Optional[float], step: float = 0.0) -> bool:
    """Whether ``deadline`` has passed, or would before one more step of ``step`` seconds ends."""
    return deadline is not None and time.perf_counter() + step > deadline


def _even(n: int, p: int) -> List[tuple]:
    bounds = [i * n // p for i in range(p + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def flat_network(cluster):
    """The cluster with every level as fast as the innermost one (what a network-unaware
    planner assumes); a graph topology is first seen as its hierarchy hint (a plain Cluster)."""
    cluster = cluster.hierarchy if isinstance(cluster, GraphCluster) else cluster
    inner = cluster.levels[0]
    levels = [
        NetworkLevel(lv.name, lv.group_size, float(inner.bandwidth), float(inner.latency)) for lv in cluster.levels
    ]
    return dataclasses.replace(cluster, levels=levels)


def phaze(
    workload: Workload,
    cluster,
    global_batch: int,
    options: Optional[SolverOptions] = None,
    deadline: Optional[float] = None,
) -> Baseline:
    """Network-unaware search over uniform stages (see module docstring); stops at ``deadline``
    (a ``time.perf_counter()`` value) with the best plan so far."""
    options = options or SolverOptions()
    flat = flat_network(cluster)
    best_t, best_plan, evals, step = math.inf, None, 0, 0.0
    for lb, g, p in candidates(workload, flat, global_batch, options, deadline, expand=True):
        if lb >= best_t or _past(deadline, step):
            break
        m = g.microbatches(global_batch)
        for r in options.recompute:
            plan = g.plan([StagePlan(a, b, g.tp, r) for a, b in _even(len(workload), p)], m, workload, cluster)
            evals += 1
            begin = time.perf_counter()
            result = evaluate(plan, workload, flat, options)
            step = time.perf_counter() - begin
            if result is not None:
                if result.step_s < best_t:
                    best_t, best_plan = result.step_s, plan
                break  # less recomputation that fits is always faster
    if best_plan is None:
        return Baseline("phaze", None, None, evals)
    return Baseline("phaze", best_plan, simulate(best_plan, workload, cluster, options.cost), evals)


def _random_stages(rng: random.Random, n: int, p: int, tp: int, recompute: Sequence[str]) -> List[StagePlan]:
    cuts = sorted(rng.sample(range(1, n), p - 1)) if p > 1 else []
    bounds = [0, *cuts, n]
    return [StagePlan(a, b, tp, rng.choice(list(recompute))) for a, b in zip(bounds[:-1], bounds[1:])]


def mcmc(
    workload: Workload,
    cluster,
    global_batch: int,
    options: Optional[SolverOptions] = None,
    evaluations: int = 2000,
    seed: int = 0,
    temperature: float = 0.05,
    deadline: Optional[float] = None,
) -> Baseline:
    """Metropolis search: move one knob (global config, a cut, a stage's recompute) at a time;
    ``evaluations`` of them, fewer when ``deadline`` (a ``time.perf_counter()`` value) passes."""
    options = options or SolverOptions()
    rng = random.Random(seed)
    pairs = [(g, p) for _, g, p in candidates(workload, cluster, global_batch, options, deadline, expand=True)]
    if not pairs:
        return Baseline("mcmc", None, None, 0)
    n = len(workload)

    def score(plan: Plan) -> float:
        if plan.virtual_stages > 1 and interleave_problem(plan.stages, plan.virtual_stages):
            return math.inf  # a random cut left a stage fewer layers than model chunks
        if unrun_fields(plan):
            return math.inf  # e.g. selective recompute under a split backward
        r = simulate(plan, workload, cluster, options.cost)
        return r.step_s if r.feasible else math.inf

    g, p = rng.choice(pairs)
    current = g.plan(
        _random_stages(rng, n, p, g.tp, options.recompute), g.microbatches(global_batch), workload, cluster
    )
    cur_s = score(current)
    best, best_s = current, cur_s
    done, step = 1, 0.0
    for _ in range(evaluations - 1):
        if _past(deadline, step):
            break
        done += 1
        begin = time.perf_counter()
        move = rng.random()
        if move < 0.3 or current.pp == 1:
            g, p = rng.choice(pairs)
            cand = g.plan(
                _random_stages(rng, n, p, g.tp, options.recompute), g.microbatches(global_batch), workload, cluster
            )
        else:
            stages = [dataclasses.replace(s) for s in current.stages]
            k = rng.randrange(len(stages))
            if move < 0.6:
                stages[k].recompute = rng.choice(list(options.recompute))
            elif k + 1 < len(stages):
                lo, hi = stages[k].start + 1, stages[k + 1].end - 1
                if lo <= hi:
                    cut = rng.randint(lo, hi)
                    stages[k].end, stages[k + 1].start = cut, cut
            cand = dataclasses.replace(current, stages=stages)
        s = score(cand)
        step = time.perf_counter() - begin
        uphill_ok = math.isfinite(s) and (
            not math.isfinite(cur_s) or rng.random() < math.exp(-(s - cur_s) / (temperature * cur_s))
        )
        if s < cur_s or uphill_ok:
            current, cur_s = cand, s
        if s < best_s:
            best, best_s = cand, s
    if not math.isfinite(best_s):
        return Baseline("mcmc", None, None, done)
    return Baseline("mcmc", best, simulate(best, workload, cluster, options.cost), done)


def all_partitions(n: int, p: int) -> Iterator[List[tuple]]:
    """Every split of layers [0, n) into p non-empty contiguous ranges."""
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = [0, *cuts, n]
        yield list(zip(bounds[:-1], bounds[1:]))


def exhaustive(workload: Workload, cluster, global_batch: int, options: Optional[SolverOptions] = None) -> Baseline:
    """The optimum by enumeration: every config, depth, partition and recompute assignment."""
    options = options or SolverOptions()
    best_t, best_plan, evals = math.inf, None, 0
    for _, g, p in candidates(workload, cluster, global_batch, options, expand=True):
        m = g.microbatches(global_batch)
        for ranges in all_partitions(len(workload), p):
            if any(b - a < g.virtual_stages for a, b in ranges):
                continue  # the interleaved and V schedules run v chunks of at least one layer per stage
            for modes in itertools.product(options.recompute, repeat=p):
                plan = g.plan([StagePlan(a, b, g.tp, r) for (a, b), r in zip(ranges, modes)], m, workload, cluster)
                evals += 1
                result = evaluate(plan, workload, cluster, options)
                if result is not None and result.step_s < best_t:
                    best_t, best_plan = result.step_s, plan
    if best_plan is None:
        return Baseline("exhaustive", None, None, evals)
    return Baseline("exhaustive", best_plan, simulate(best_plan, workload, cluster, options.cost), evals)
