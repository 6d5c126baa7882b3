"""Baseline planners on the same cost model (``step_time.simulate``), for comparison.

* ``megatron``: the manual recipe of Narayanan et al. 2021: tensor parallelism inside a node,
  pipeline parallelism across nodes, the smallest model-parallel size (tp * pp) that fits,
  uniform layer split, microbatch 1, 1F1B, ZeRO-1 (distributed optimizer), selective
  recomputation (full recomputation only when selective does not fit).
* ``phaze``: network-unaware search over uniform stages, in the spirit of Phaze
  (Wang et al.): every (tp, dp, pp, microbatch, recompute) with an even layer split is scored
  on a flat network (every level as fast as the innermost), the best is then run on the real
  network.
* ``mcmc``: random search with Metropolis moves over the same space as the NEST DP, with a
  fixed number of evaluations.
* ``exhaustive``: every plan of the search space (all contiguous partitions, all recompute
  assignments); only for small instances, to check the DP's exactness.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

from nest_fx.cluster.spec import NetworkLevel
from nest_fx.cluster.topology.graph_cluster import GraphCluster
from nest_fx.cost.results import SimResult
from nest_fx.cost.step_time import simulate
from nest_fx.plan import Plan, StagePlan, uniform_plan
from nest_fx.plan.plan import interleave_problem
from nest_fx.solver.candidates import candidates
from nest_fx.solver.space import GlobalConfig, SolverOptions, divisors
from nest_fx.workload import Workload


@dataclass
class Baseline:
    name: str
    plan: Optional[Plan]
    result: Optional[SimResult]
    evaluations: int
    seconds: float = 0.0


def run_baselines(workload: Workload, cluster, global_batch: int, options: Optional[SolverOptions] = None,
                  mcmc_evaluations: int = 2000) -> List[Baseline]:
    """Megatron, Phaze-style and MCMC, each timed."""
    out = []
    for fn, kwargs in ((megatron, {}), (phaze, {}), (mcmc, {"evaluations": mcmc_evaluations})):
        start = time.perf_counter()
        b = fn(workload, cluster, global_batch, options, **kwargs)
        b.seconds = time.perf_counter() - start
        out.append(b)
    return out


def _plan_for(g: GlobalConfig, stages: List[StagePlan], m: int, workload: Workload, cluster) -> Plan:
    return Plan(stages=stages, dp=g.dp, ep=g.ep, zero=g.zero, microbatch_size=g.mbs, num_microbatches=m,
                schedule=g.schedule, virtual_stages=g.v, sequence_parallel=g.sp, placement=g.placement,
                model=workload.model, model_fingerprint=workload.fingerprint, num_layers=len(workload),
                world_size=cluster.num_devices)


def _even(n: int, p: int) -> List[tuple]:
    bounds = [i * n // p for i in range(p + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _evaluate(plan: Plan, workload: Workload, cluster, options: SolverOptions) -> Optional[SimResult]:
    r = simulate(plan, workload, cluster, options.cost)
    return r if r.feasible else None


def megatron(workload: Workload, cluster, global_batch: int, options: Optional[SolverOptions] = None,
             deadline: Optional[float] = None) -> Baseline:
    """Narayanan et al. 2021's manual recipe (see module docstring); no plan when the search for
    the smallest shape that fits passes ``deadline`` (a ``time.perf_counter()`` value)."""
    options = options or SolverOptions()
    node = cluster.levels[0].group_size
    tps = [t for t in (1, 2, 4, 8) if t <= node and t <= cluster.num_devices and workload.supports(t, 1, t > 1)]
    evals = 0
    shapes = sorted(((tp, pp) for tp in tps for pp in range(1, len(workload) + 1)
                     if tp * pp <= cluster.num_devices), key=lambda x: (x[0] * x[1], -x[0]))
    for recompute in ("selective", "full"):
        for tp, pp in shapes:
            if deadline is not None and time.perf_counter() > deadline:
                return Baseline("megatron", None, None, evals)
            dps = [d for d in divisors(global_batch) if d * tp * pp <= cluster.num_devices]
            if not dps:
                continue
            dp = max(dps)
            ep = max((e for e in divisors(max(workload.dims.num_experts, 1))
                      if dp % e == 0 and workload.supports(tp, e, tp > 1)), default=1) if workload.is_moe else 1
            plan = uniform_plan(len(workload), pp=pp, tp=tp, dp=dp, ep=ep, zero=1, microbatch_size=1,
                                num_microbatches=global_batch // dp, recompute=recompute, sequence_parallel=tp > 1,
                                model=workload.model, world_size=cluster.num_devices)
            evals += 1
            result = _evaluate(plan, workload, cluster, options)
            if result is not None:
                return Baseline("megatron", plan, result, evals)
    return Baseline("megatron", None, None, evals)


def flat_network(cluster):
    """The cluster with every level as fast as the innermost one (what a network-unaware
    planner assumes); a graph topology is first seen as its hierarchy hint (a plain Cluster)."""
    cluster = cluster.hierarchy if isinstance(cluster, GraphCluster) else cluster
    inner = cluster.levels[0]
    levels = [NetworkLevel(lv.name, lv.group_size, float(inner.bandwidth), float(inner.latency))
              for lv in cluster.levels]
    return dataclasses.replace(cluster, levels=levels)


def phaze(workload: Workload, cluster, global_batch: int, options: Optional[SolverOptions] = None) -> Baseline:
    """Network-unaware search over uniform stages (see module docstring)."""
    options = options or SolverOptions()
    flat = flat_network(cluster)
    best_t, best_plan, evals = math.inf, None, 0
    for lb, g, p in candidates(workload, flat, global_batch, options):
        if lb >= best_t:
            break
        m = g.microbatches(global_batch)
        for r in options.recompute:
            plan = _plan_for(g, [StagePlan(a, b, g.tp, r) for a, b in _even(len(workload), p)], m, workload, cluster)
            evals += 1
            result = _evaluate(plan, workload, flat, options)
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


def mcmc(workload: Workload, cluster, global_batch: int, options: Optional[SolverOptions] = None,
         evaluations: int = 2000, seed: int = 0, temperature: float = 0.05) -> Baseline:
    """Metropolis search: move one knob (global config, a cut, a stage's recompute) at a time."""
    options = options or SolverOptions()
    rng = random.Random(seed)
    pairs = [(g, p) for _, g, p in candidates(workload, cluster, global_batch, options)]
    if not pairs:
        return Baseline("mcmc", None, None, 0)
    n = len(workload)

    def score(plan: Plan) -> float:
        if plan.schedule == "interleaved" and interleave_problem(plan.stages, plan.virtual_stages):
            return math.inf  # a random cut left a stage fewer layers than model chunks
        r = simulate(plan, workload, cluster, options.cost)
        return r.step_s if r.feasible else math.inf

    g, p = rng.choice(pairs)
    current = _plan_for(g, _random_stages(rng, n, p, g.tp, options.recompute), g.microbatches(global_batch),
                        workload, cluster)
    cur_s = score(current)
    best, best_s = current, cur_s
    for _ in range(evaluations - 1):
        move = rng.random()
        if move < 0.3 or current.pp == 1:
            g, p = rng.choice(pairs)
            cand = _plan_for(g, _random_stages(rng, n, p, g.tp, options.recompute), g.microbatches(global_batch),
                             workload, cluster)
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
        uphill_ok = math.isfinite(s) and (not math.isfinite(cur_s)
                                          or rng.random() < math.exp(-(s - cur_s) / (temperature * cur_s)))
        if s < cur_s or uphill_ok:
            current, cur_s = cand, s
        if s < best_s:
            best, best_s = cand, s
    if not math.isfinite(best_s):
        return Baseline("mcmc", None, None, evaluations)
    return Baseline("mcmc", best, simulate(best, workload, cluster, options.cost), evaluations)


def all_partitions(n: int, p: int) -> Iterator[List[tuple]]:
    """Every split of layers [0, n) into p non-empty contiguous ranges."""
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = [0, *cuts, n]
        yield list(zip(bounds[:-1], bounds[1:]))


def exhaustive(workload: Workload, cluster, global_batch: int, options: Optional[SolverOptions] = None) -> Baseline:
    """The optimum by enumeration: every config, depth, partition and recompute assignment."""
    options = options or SolverOptions()
    best_t, best_plan, evals = math.inf, None, 0
    for _, g, p in candidates(workload, cluster, global_batch, options):
        m = g.microbatches(global_batch)
        for ranges in all_partitions(len(workload), p):
            if any(b - a < g.v for a, b in ranges):
                continue  # the interleaved schedule runs v chunks of at least one layer per stage
            for modes in itertools.product(options.recompute, repeat=p):
                plan = _plan_for(g, [StagePlan(a, b, g.tp, r) for (a, b), r in zip(ranges, modes)], m,
                                 workload, cluster)
                evals += 1
                result = _evaluate(plan, workload, cluster, options)
                if result is not None and result.step_s < best_t:
                    best_t, best_plan = result.step_s, plan
    if best_plan is None:
        return Baseline("exhaustive", None, None, evals)
    return Baseline("exhaustive", best_plan, simulate(best_plan, workload, cluster, options.cost), evals)
