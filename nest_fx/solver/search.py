"""``solve(workload, cluster, global_batch)``: branch and bound over global configs, the NEST DP
inside.

Every (global config g, pipeline depth p) gets a lower bound on its step time,

    LB = pipeline_span(W / p, W) with W = sum_l (fwd + bwd) at g's TP degree and microbatch,

valid because max_i t_i >= W / p, sum_i t_i >= W and the span is monotone in both; and a memory
screen (the smallest per-stage model state, 1/p of the replica's parameters, must fit). Pairs
are solved in increasing LB order with the exact DP and the search stops when the next LB is
no better than the best plan found, so the answer is the optimum of the cost model over the
search space. With a time budget the best plan so far is returned when it runs out.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

from nest_fx.cost import memory
from nest_fx.cost.step_time import SimResult, comm_time, pipeline_span, simulate
from nest_fx.plan import Plan
from nest_fx.solver.nest_dp import BudgetExceeded, StageTable, solve_partition
from nest_fx.solver.space import GlobalConfig, SolverOptions, global_configs, stage_counts
from nest_fx.workload import Workload


class NoFeasiblePlan(ValueError):
    """Nothing fits; the message names the binding constraint and the smallest change that fits."""


@dataclass
class SolveResult:
    plan: Plan
    result: SimResult
    seconds: float
    candidates: int  # (config, depth) pairs considered
    dp_runs: int  # exact DP runs
    stage_evaluations: int
    complete: bool  # False when the time budget stopped the search
    stats: Dict[str, float] = field(default_factory=dict)


def _replica_work(workload: Workload, cluster, g: GlobalConfig) -> Tuple[float, float]:
    """(per-microbatch fwd+bwd+TP-collective seconds, per-device parameters) of one replica.

    Every TP group of every placement is ``tp`` consecutive ranks starting at a multiple of
    ``tp``, so the TP collectives cost what they cost on ranks 0..tp-1."""
    work = params = 0.0
    tp_group = list(range(g.tp))
    for i in range(len(workload)):
        c = workload.cost(i, g.tp, g.ep, g.mbs, g.sp)
        work += c.fwd_s + c.bwd_s + sum(comm_time(cluster, x, tp_group) for x in c.comms if x.group == "tp")
        params += c.num_params
    return work, params


def candidates(workload: Workload, cluster, global_batch: int, options: SolverOptions):
    """(LB, g, p) for every admissible pair that passes the memory screen, sorted by LB."""
    capacity = cluster.device.memory_bytes * options.cost.usable_memory_fraction
    cache: Dict[tuple, Tuple[float, float]] = {}
    out = []
    for g in global_configs(workload, cluster, global_batch, options):
        key = (g.tp, g.ep, g.mbs, g.sp)
        if key not in cache:
            cache[key] = _replica_work(workload, cluster, g)
        work, params = cache[key]
        m = g.microbatches(global_batch)
        for p in stage_counts(workload, cluster, g, global_batch, options):
            states = memory.model_state_bytes(params / p, zero_stage=g.zero, dp=g.dp, optimizer=options.cost.optimizer,
                                              param_dtype_bytes=options.cost.param_bytes,
                                              grad_dtype_bytes=options.cost.grad_bytes)["total"]
            if states > capacity:
                continue
            out.append((pipeline_span(work / p, work, m, g.schedule, g.v), g, p))
    out.sort(key=lambda x: x[0])
    return out


def solve(workload: Workload, cluster, global_batch: int, options: Optional[SolverOptions] = None,
          progress: Optional[Callable[[int, int], None]] = None) -> SolveResult:
    """The fastest feasible plan for ``global_batch`` sequences per step (see module docstring)."""
    options = options or SolverOptions()
    start = time.perf_counter()
    deadline = start + options.time_budget if options.time_budget else None
    pairs = candidates(workload, cluster, global_batch, options)
    best_t, best = _incumbent(workload, cluster, global_batch, options, pairs, start)
    runs = evaluations = 0
    complete = True
    for k, (lb, g, p) in enumerate(pairs):
        if lb >= best_t:
            break
        if deadline is not None and time.perf_counter() > deadline and best is not None:
            complete = False
            break
        m = g.microbatches(global_batch)
        table = StageTable(workload, cluster, g, p, m, options.cost)
        try:
            found = solve_partition(table, m, tuple(options.recompute), best_t,
                                    deadline if best is not None else None)
        except BudgetExceeded:
            complete = False
            break
        runs += 1
        evaluations += table.evaluations
        if progress:
            progress(k + 1, len(pairs))
        if found is not None and found.step_s < best_t:
            best_t, best = found.step_s, (g, m, found.stages)
    if best is None:
        raise NoFeasiblePlan(explain_infeasible(workload, cluster, global_batch, options))
    g, m, stages = best
    plan = Plan(stages=stages, dp=g.dp, ep=g.ep, zero=g.zero, microbatch_size=g.mbs, num_microbatches=m,
                schedule=g.schedule, virtual_stages=g.v, sequence_parallel=g.sp, placement=g.placement,
                model=workload.model, num_layers=len(workload), world_size=cluster.num_devices)
    result = simulate(plan, workload, cluster, options.cost)
    plan.predicted = {"step_s": result.step_s, "tokens_per_s": result.tokens_per_s,
                      "model_flops_per_device": result.model_flops_per_device,
                      "peak_memory_bytes": max(s.memory["total"] for s in result.stages)}
    return SolveResult(plan=plan, result=result, seconds=time.perf_counter() - start, candidates=len(pairs),
                       dp_runs=runs, stage_evaluations=evaluations, complete=complete,
                       stats={"dp_objective": best_t})


def _uniform_stages(table: StageTable, recompute, m: int):
    """Even layer split, each stage with the least recomputation that fits: (T, stages) or None."""
    from nest_fx.plan import StagePlan
    from nest_fx.solver.space import objective

    g, p, n = table.g, table.p, table.n
    max_t = sum_t = max_q = 0.0
    stages = []
    bounds = [i * n // p for i in range(p + 1)]
    for i in range(p):
        for r in recompute:
            t, q, fits = table.get(i, bounds[i], bounds[i + 1], r)
            if fits:
                break
        else:
            return None
        max_t, sum_t, max_q = max(max_t, t), sum_t + t, max(max_q, q)
        stages.append(StagePlan(bounds[i], bounds[i + 1], g.tp, r))
    return objective(max_t, sum_t, max_q, m, g.schedule, g.v), stages


def _within(plan: Plan, options: SolverOptions, cluster) -> bool:
    """Whether a plan lies in the search space the options define."""
    return (not options.use_all_devices or plan.devices_used == cluster.num_devices) and (plan.placement in options.placements and plan.microbatch_size in options.microbatch_sizes
            and plan.zero in options.zero_stages and (plan.schedule, plan.virtual_stages) in options.schedules
            and all(s.tp in options.tp_degrees and s.recompute in options.recompute for s in plan.stages)
            and (not options.max_stages or plan.pp <= options.max_stages))


def _incumbent(workload: Workload, cluster, global_batch: int, options: SolverOptions, pairs, start: float):
    """A good feasible plan before the exact search, so its pruning bites from the start: the
    Megatron recipe, then even splits in lower-bound order (a network-aware Phaze pass), for at
    most a quarter of the time budget. The answer is therefore never worse than either."""
    from nest_fx.solver.baselines import megatron

    best_t, best = math.inf, None
    recipe = megatron(workload, cluster, global_batch, options)
    if recipe.plan is not None and _within(recipe.plan, options, cluster):
        p = recipe.plan
        g = GlobalConfig(tp=p.stages[0].tp, dp=p.dp, ep=p.ep, mbs=p.microbatch_size, zero=p.zero,
                         schedule=p.schedule, v=p.virtual_stages, placement=p.placement, sp=p.sequence_parallel)
        best_t, best = recipe.result.step_s, (g, p.num_microbatches, list(p.stages))
    stop = start + options.time_budget / 4 if options.time_budget else None
    for lb, g, p in pairs:
        if lb >= best_t or (stop is not None and time.perf_counter() > stop):
            break
        m = g.microbatches(global_batch)
        found = _uniform_stages(StageTable(workload, cluster, g, p, m, options.cost), tuple(options.recompute), m)
        if found is not None and found[0] < best_t:
            best_t, best = found[0], (g, m, found[1])
    return best_t, best


def explain_infeasible(workload: Workload, cluster, global_batch: int, options: SolverOptions) -> str:
    """Why nothing fits, and the smallest change that would."""
    capacity = cluster.device.memory_bytes * options.cost.usable_memory_fraction
    if not any(True for _ in global_configs(workload, cluster, global_batch, options)):
        return (f"no parallel configuration divides the global batch {global_batch} "
                f"(with microbatch sizes {list(options.microbatch_sizes)}) over {cluster.num_devices} devices: "
                "use a global batch with more small factors (e.g. a power of two)")
    # The leanest plan: most TP inside a node, deepest pipeline, ZeRO-3, full recompute, microbatch 1.
    tp = max(t for t in options.tp_degrees if workload.dims.tp_ok(t) and t <= cluster.levels[0].group_size)
    total_params = sum(workload.cost(i, tp, 1, 1, tp > 1).num_params for i in range(len(workload)))
    zero = max(options.zero_stages)
    p_max = min(len(workload), cluster.num_devices // tp)
    dp_max = max(1, cluster.num_devices // (tp * p_max))
    per_device = memory.model_state_bytes(total_params / p_max, zero_stage=zero, dp=dp_max,
                                          optimizer=options.cost.optimizer)["total"]
    act = max(workload.cost(i, tp, 1, 1, tp > 1).act_bytes["full"] for i in range(len(workload)))
    need = per_device + act
    gib = 2**30
    if need > capacity:
        states = memory.model_state_bytes(total_params * tp, zero_stage=zero, dp=1, optimizer=options.cost.optimizer)
        devices = math.ceil(states["total"] / capacity)
        return (f"binding constraint: model states. Even with tp={tp}, pp={p_max}, ZeRO-{zero}, full recompute "
                f"and microbatch 1 a device needs {need / gib:.1f} GiB > {capacity / gib:.1f} GiB usable. "
                f"Smallest change: about {devices} devices or more (have {cluster.num_devices}), "
                "or devices with more memory")
    return (f"binding constraint: activations or the batch split. The leanest model-state layout fits "
            f"({need / gib:.1f} GiB per device) but no plan with the allowed options does: allow full "
            f"recompute and ZeRO-3, microbatch size 1, or a global batch divisible by more data-parallel degrees")
