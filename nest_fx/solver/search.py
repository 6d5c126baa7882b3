"""``solve(workload, cluster, global_batch)``: best-first branch and bound over (global config g,
pipeline depth p) pairs, the NEST DP inside.

Every pair carries a lower bound on the step time of its plans, refined in tiers, cheapest
first (each tier's bound is valid on its own; a pair keeps the largest it has seen):

0. ``candidates``: ``pipeline_span(W / p, W) + T_opt(N / p)``, W the replica's per-microbatch
   forward + backward seconds and N its per-device parameters (max_i t_i >= W / p,
   sum_i t_i >= W, the span is monotone in both, and the largest stage's optimizer step is at
   least that of N / p parameters), after a memory screen (the leanest model states of p
   stages, N / p parameters each, must fit); max_i t_i is also at least the busiest stage's
   compute (``candidates.busiest_stage_floor``: ceil(L / p) layers);
1. ``network_bound``: the same with W' >= W adding each layer's collectives on the stage where
   they are cheapest and each stage boundary's cheapest p2p (``TableCache.replica_work``), the
   busiest stage also at least the linear-partition optimum of the layers in order
   (``candidates.partition_floor``), and the largest tail q_i at least the DP sync floor of an
   average stage (``TableCache.tail_floor``; tier 2 keeps it);
2. the pair's stage table (``stage_table.StageTable``: every stage slot, layer range and
   recompute mode, memory-forced recomputation included) and its suffix bounds, with q_i
   bounded by the optimizer step (no DP-sync traffic asked of the network yet);
3. the same with the exact tails q_i (exposed DP sync + optimizer step);
4. the exact DP (``nest_dp.solve_partition``).

Tier 0's pairs stream in sorted (``candidates.tier0``); tier 1 is asked in three heap steps
(``TABLE_TIERS``: without the network, with the tails, whole), so the network is asked only of
pairs whose cheaper bound is still below the best plan when they come up again.

Before any of it, :func:`states_bound` refuses a model whose states cannot fit on the whole
cluster (the command line asks it before the trace, from the parameter count alone).

Pairs sit in a heap keyed by their bound; the smallest is popped and refined one tier (solved at
tier 4), and the search stops when the smallest bound is no better than the best plan found, so
the answer is the optimum of the cost model over the search space. The first incumbent is the
Megatron recipe; each pair whose table is built also offers its even split. With a time budget
the best plan so far is returned when it runs out (NoFeasiblePlan, saying so, when there is none
yet); the Megatron incumbent's own search stops at the deadline too.

On a graph topology the device order is part of the search (``solver.placement``): every pair
of TP degree t is entered once per candidate order for t (the cluster's own order first), each
order with its own view of the network and TableCache (the network-independent entries shared).
Tier 0 does not depend on the network, so all orders of a pair start with the same bound; the
heap then refines whichever (pair, order) is most promising, so orders that cannot win are
dropped at their first network-aware tier. The plan records the winning order in
``Plan.device_order``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import math
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from nest_fx.common.errors import NestFxError
from nest_fx.cost import memory
from nest_fx.cost.options import CostOptions
from nest_fx.cost.results import SimResult
from nest_fx.cost.step_time import simulate
from nest_fx.plan.plan import Plan
from nest_fx.solver.recipes import megatron
from nest_fx.solver.candidates import tier0
from nest_fx.solver.nest_dp import BudgetExceeded, solve_partition
from nest_fx.solver.placement import Placement, placements
from nest_fx.plan.vocabulary import CHUNKED_SCHEDULES
from nest_fx.solver.space import (
    ANY_INTERLEAVE,
    GlobalConfig,
    SolverOptions,
    global_configs,
    in_space,
    interleave_factors,
    objective,
)
from nest_fx.solver.stage_bounds import SLACK
from nest_fx.solver.stage_table import StageTable
from nest_fx.solver.table_cache import TableCache
from nest_fx.solver.tier_bounds import WHOLE, network_bound, network_bounds, table_bound, table_worth
from nest_fx.workload.types import Variant, Workload


# the heap's tiers: 0 (tier 0's bound), 1 to 3 (tier 1's without the network, with the DP groups'
# tail floor, whole: tier_bounds.NO_NETWORK, TAILS, WHOLE, one more each), then the stage table's
# suffix bounds (TABLE_TIERS[0]: without, [1]: with the exact tails), then the exact DP
TABLE_TIERS = (3, 4, 5)

# tier-0 pairs whose tier-1 bounds _dive compares for a first incumbent
DIVE_PAIRS = 64
DIVE_SOLVES = 4  # of those, the pairs of least tier-1 bound solved exactly


class NoFeasiblePlan(NestFxError, ValueError):
    """Nothing fits; the message names the binding constraint and the smallest change that fits."""


@dataclass
class SolveResult:
    plan: Plan
    result: SimResult
    seconds: float
    candidates: int  # (config, depth) pairs considered
    dp_runs: int  # exact DP runs
    stage_evaluations: int  # (stage slot, layer-range class, recompute mode) entries tabulated
    complete: bool  # False when the time budget stopped the search
    stats: Dict[str, float] = field(default_factory=dict)
    placement: str = "identity"  # name of the chosen device order (solver.placement)
    placements: List[Placement] = field(default_factory=list)  # the candidates searched


class _Tables:
    """Stage tables of the (pair, placement) entries in flight: the latest few kept, others
    rebuilt when needed. ``caches[o]`` is placement o's TableCache."""

    def __init__(self, caches: List[TableCache], global_batch: int, keep: int = 64):
        self.caches, self.global_batch, self.keep = caches, global_batch, keep
        self.recent: "OrderedDict[Tuple[int, int], StageTable]" = OrderedDict()
        self.built = self.entries = 0

    def get(self, key: Tuple[int, int], g: GlobalConfig, p: int, best: float) -> StageTable:
        table = self.recent.pop(key, None)
        if table is None:
            table = StageTable(self.caches[key[1]], g, p, g.microbatches(self.global_batch), best)
            self.built += 1
            self.entries += table.entries
        self.recent[key] = table
        while len(self.recent) > self.keep:
            self.recent.popitem(last=False)
        return table

    def drop(self, key: Tuple[int, int]) -> None:
        self.recent.pop(key, None)


@contextlib.contextmanager
def _no_cyclic_gc():
    """Pause Python's cyclic garbage collector: the search allocates millions of short-lived,
    acyclic objects (reference counting frees them), and the collector's full passes over the
    caller's heap (a traced model, torch) would otherwise take about half the search time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def solve(
    workload: Workload,
    cluster,
    global_batch: int,
    options: Optional[SolverOptions] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> SolveResult:
    """The fastest feasible plan for ``global_batch`` sequences per step (see module docstring).
    ``progress(pairs settled, pairs)`` is called after each exact DP run."""
    with _no_cyclic_gc():
        return _solve(workload, cluster, global_batch, options or SolverOptions(), progress)


def _solve(
    workload: Workload,
    cluster,
    global_batch: int,
    options: SolverOptions,
    progress: Optional[Callable[[int, int], None]],
) -> SolveResult:
    start = time.perf_counter()
    deadline = start + options.time_budget if options.time_budget else None
    options = options.priced()
    workload = options.runtime_workload(workload)
    problem = states_bound(workload.num_params, cluster, options.cost)
    if problem:
        raise NoFeasiblePlan(problem)
    pairs = tier0(workload, cluster, global_batch, options, deadline)
    places, by_tp = placements(cluster, set(pairs.tps), options.search_placement)
    # placement 0 (the cluster's own order); half the budget at most, the search needs the rest
    best_t, best = _incumbent(
        workload, cluster, global_batch, options, None if deadline is None else (start + deadline) / 2
    )
    first = TableCache(workload, cluster, options.cost, options.recompute)
    tables = _Tables(
        [first] + [TableCache(workload, pl.cluster, options.cost, options.recompute, share=first) for pl in places[1:]],
        global_batch,
    )
    bounds: Dict[tuple, object] = {}  # network_bound's network-independent terms
    best_t, best = _dive(pairs, by_tp, tables, workload, global_batch, bounds, best_t, best, deadline)
    # the tier-0 entries (lb, 0, k, o), already sorted, stream in; the heap holds the refined ones:
    # each pop takes the least of the two heads, as one heap of every entry would
    stream = _tier0_entries(pairs, by_tp)
    head = next(stream, None)
    heap: List[tuple] = []
    total = sum(len(by_tp[t]) * count for t, count in Counter(pairs.tps).items())
    runs = pops = settled = 0
    complete = deadline is None or time.perf_counter() <= deadline  # every pair enumerated
    while True:
        from_heap = bool(heap) and (head is None or heap[0] < head)
        entry = heap[0] if from_heap else head
        if entry is None or entry[0] * SLACK >= best_t:
            break
        if deadline is not None and time.perf_counter() > deadline:
            complete = False
            break
        if from_heap:
            bound, tier, k, o = heapq.heappop(heap)
        else:
            bound, tier, k, o = head
            head = next(stream, None)
        pops += 1
        _, g, p = pairs[k]
        m = g.microbatches(global_batch)
        if g.virtual_stages == ANY_INTERLEAVE and g.schedule in CHUNKED_SCHEDULES:  # a family: one entry per factor
            factors = interleave_factors(workload, p)
            if tier < WHOLE:  # the family's bound (its least member's) without the network, then with the tails
                lb = max(bound, min(network_bounds(tables.caches[o], g, p, m, factors, best_t, bounds, upto=tier)))
                if lb * SLACK < best_t:
                    heapq.heappush(heap, (lb, tier + 1, k, o))
                else:
                    settled += 1
                continue
            bounds_of = network_bounds(tables.caches[o], g, p, m, factors, best_t, bounds)
            for v, lb in zip(factors, bounds_of):
                if lb * SLACK < best_t:  # only the members kept become configurations
                    pairs.append((lb, dataclasses.replace(g, virtual_stages=v), p))
                    heapq.heappush(heap, (max(bound, lb), WHOLE + 1, len(pairs) - 1, o))
                    total += 1
            settled += 1
            continue
        if tier < TABLE_TIERS[-1]:  # refine the bound (to the tier of the module docstring after ``tier``)
            if tier < TABLE_TIERS[0]:  # tier 1 in three steps: the network asked last, once popped again
                lb = network_bound(tables.caches[o], g, p, m, best_t, bounds, upto=tier)
            elif tier == TABLE_TIERS[0] and not table_worth(tables.caches[o], g, p, m, best_t, bounds):
                settled += 1  # each stage's own memory: no table needed
                continue
            else:
                table = tables.get((k, o), g, p, best_t)
                if tier == TABLE_TIERS[0]:
                    even = table.even_split(best_t)
                    step = objective(*even[:3], m, g.schedule, g.virtual_stages) if even else math.inf
                    if step < best_t:
                        best_t, best = step, (g, m, even[3], o)
                lb = table_bound(table, best_t, exact_tails=tier == TABLE_TIERS[1])
            lb = max(bound, lb)  # each tier's bound is valid: keep the largest
            if lb * SLACK < best_t:
                heapq.heappush(heap, (lb, tier + 1, k, o))
            else:
                tables.drop((k, o))
                settled += 1
            continue
        try:
            found = solve_partition(tables.get((k, o), g, p, best_t), best_t, deadline)
        except BudgetExceeded:
            complete = False
            break
        tables.drop((k, o))
        runs += 1
        settled += 1
        if progress:
            progress(settled, total)
        if found is not None and found.step_s < best_t:
            best_t, best = found.step_s, (g, m, found.stages, o)
    if best is None and not complete:
        raise NoFeasiblePlan(
            f"no plan found within the time budget of {options.time_budget:g} s (the search "
            "stopped before it finished, so one may exist): allow more time (--time-budget)"
        )
    if best is None:
        raise NoFeasiblePlan(explain_infeasible(workload, cluster, global_batch, options))
    g, m, stages, o = best
    order = places[o].device_order
    plan = g.plan(
        stages,
        m,
        workload,
        cluster,
        device_order=list(order) if order is not None else None,
        constraints=options.constraints or None,
    )
    # what it was planned for: simulate / explain of the file rebuild the same workload
    plan.seq_len = workload.dims.seq_len  # (plan.precision: options.precision, set by g.plan)
    result = simulate(plan, workload, cluster, options.cost)
    plan.predicted = {
        "step_s": result.step_s,
        "tokens_per_s": result.tokens_per_s,
        "model_flops_per_device": result.model_flops_per_device,
        "peak_memory_bytes": max(s.memory["total"] for s in result.stages),
    }
    return SolveResult(
        plan=plan,
        result=result,
        seconds=time.perf_counter() - start,
        candidates=total,
        dp_runs=runs,
        stage_evaluations=tables.entries,
        complete=complete,
        stats={"dp_objective": best_t, "tables": tables.built, "heap_pops": pops, "placements": len(places)},
        placement=places[o].name,
        placements=places,
    )


def _tier0_entries(pairs, by_tp):
    """The heap entries ``(lb, 0, k, o)`` of every tier-0 pair k and device order o of its TP
    degree, in heap order (the pairs are sorted by bound, ties by k)."""
    orders = {t: sorted(os) for t, os in by_tp.items()}
    for k, (lb, t) in enumerate(zip(pairs.lbs, pairs.tps)):
        for o in orders[t]:
            yield (lb, 0, k, o)


def _dive(
    pairs, by_tp, tables: "_Tables", workload: Workload, global_batch: int, bounds, best_t: float, best, deadline
):
    """A better first incumbent than the recipe's: of the first ``DIVE_PAIRS`` pairs of tier 0
    (each interleaved family's factors one by one, each on its first device order), the
    ``DIVE_SOLVES`` with the least tier-1 bounds, solved exactly; (best_t, best) unchanged when
    none is faster.
    The search stays exact (an incumbent is a plan; it only prunes what cannot beat it), and a
    good one early lets the network-free checks of tier 1 drop pairs before the network is asked."""
    probes = []
    for lb0, g, p in pairs[:DIVE_PAIRS]:
        if lb0 * SLACK >= best_t:
            break
        o, m = by_tp[g.tp][0], g.microbatches(global_batch)
        family = g.virtual_stages == ANY_INTERLEAVE and g.schedule in CHUNKED_SCHEDULES
        factors = interleave_factors(workload, p) if family else [g.virtual_stages]
        for v, lb in zip(factors, network_bounds(tables.caches[o], g, p, m, factors, best_t, bounds)):
            if lb * SLACK < best_t:
                probes.append((lb, len(probes), dataclasses.replace(g, virtual_stages=v) if family else g, p, o))
    for _, _, g, p, o in sorted(probes)[:DIVE_SOLVES]:
        m = g.microbatches(global_batch)
        try:
            found = solve_partition(tables.get(("dive", o), g, p, best_t), best_t, deadline)
        except BudgetExceeded:
            break
        finally:
            tables.drop(("dive", o))
        if found is not None and found.step_s < best_t:
            best_t, best = found.step_s, (g, m, found.stages, o)
    return best_t, best


def _incumbent(
    workload: Workload, cluster, global_batch: int, options: SolverOptions, deadline: Optional[float] = None
):
    """The Megatron recipe when it lies in the search space (so the pruning bites from the start
    and the answer is never worse than it): (step seconds, (g, m, stages)), or (inf, None) (also
    when the recipe's search passes ``deadline``, a ``time.perf_counter()`` value)."""
    recipe = megatron(workload, cluster, global_batch, options, deadline=deadline)
    if recipe.plan is None or not in_space(recipe.plan, options, cluster):
        return math.inf, None
    p = recipe.plan
    return recipe.result.step_s, (GlobalConfig.of(p), p.num_microbatches, list(p.stages), 0)


def states_bound(num_params: float, cluster, cost: CostOptions) -> Optional[str]:
    """Why no plan can fit, when the weights, gradients and optimizer states of ``num_params``
    parameters spread evenly over every device of ``cluster`` (nothing replicated: ZeRO-3 over
    all of them) exceed one device's usable memory; else None. Every plan keeps each state
    somewhere, so some device holds at least this average (activations come on top): the bound
    never refuses a model that fits, and needs nothing but the parameter count."""
    devices = cluster.num_devices
    states = memory.model_states(float(num_params), 3, devices, cost)["total"]
    capacity = memory.usable_bytes(cluster.device.memory_bytes, cost)
    if states <= capacity:
        return None
    gib = 2**30
    return (
        f"binding constraint: model states. The {num_params / 1e9:.3g} G parameters' weights, gradients and "
        f"{cost.optimizer} states take {states * devices / gib:,.1f} GiB: {states / gib:,.1f} GiB per device "
        f"even spread over all {devices} devices > {capacity / gib:.1f} GiB usable. Smallest change: at least "
        f"{math.ceil(states * devices / capacity):,} devices (have {devices}), or devices with more memory"
    )


def explain_infeasible(workload: Workload, cluster, global_batch: int, options: SolverOptions) -> str:
    """Why nothing fits, and the smallest change that would."""
    capacity = memory.usable_bytes(cluster.device.memory_bytes, options.cost)
    node = min(cluster.levels[0].group_size, cluster.num_devices)
    tps = [t for t in options.tp_degrees if t <= node and workload.supports(Variant(t, sequence_parallel=t > 1))]
    if not tps:
        return (
            f"no tensor-parallel degree in {list(options.tp_degrees)} is both at most {node} (the devices of "
            f"one {cluster.levels[0].name}) and one the workload has costs for (its shapes must divide by it, "
            "and a layer table must list it): add tp=1 variants to the table, or allow other degrees"
        )
    if not any(True for _ in global_configs(workload, cluster, global_batch, options)):
        return (
            f"no parallel configuration divides the global batch {global_batch} "
            f"(with microbatch sizes {list(options.microbatch_sizes)}) over {cluster.num_devices} devices: "
            "use a global batch with more small factors (e.g. a power of two)"
        )
    # The leanest plan: most TP inside a node, deepest pipeline, ZeRO-3, full recompute, microbatch 1.
    tp = max(tps)
    total_params = sum(workload.cost(i, Variant(tp, sequence_parallel=tp > 1)).num_params for i in range(len(workload)))
    zero = max(options.zero_stages)
    p_max = min(len(workload), cluster.num_devices // tp)
    dp_max = max(1, cluster.num_devices // (tp * p_max))
    per_device = memory.model_state_bytes(
        total_params / p_max, zero_stage=zero, dp=dp_max, optimizer=options.cost.optimizer
    )["total"]
    act = max(workload.cost(i, Variant(tp, sequence_parallel=tp > 1)).act_bytes["full"] for i in range(len(workload)))
    need = per_device + act
    gib = 2**30
    if need > capacity:
        states = memory.model_state_bytes(total_params * tp, zero_stage=zero, dp=1, optimizer=options.cost.optimizer)
        devices = math.ceil(states["total"] / capacity)
        return (
            f"binding constraint: model states. Even with tp={tp}, pp={p_max}, ZeRO-{zero}, full recompute "
            f"and microbatch 1 a device needs {need / gib:.1f} GiB > {capacity / gib:.1f} GiB usable. "
            f"Smallest change: about {devices} devices or more (have {cluster.num_devices}), "
            "or devices with more memory"
        )
    return (
        f"binding constraint: activations or the batch split. The leanest model-state layout fits "
        f"({need / gib:.1f} GiB per device) but no plan with the allowed options does: allow full "
        f"recompute and ZeRO-3, microbatch size 1, or a global batch divisible by more data-parallel degrees"
    )
