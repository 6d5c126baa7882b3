"""Tiers 1 to 3 of the search's bounds on one (g, p) pair (``solver.search`` has the order
they are asked in): ``network_bound`` (tier 1, no table: the replica's work, collectives,
sends, the recompute memory forces, the tail and busiest-stage floors) and ``table_bound``
(tiers 2 and 3, from a stage table's suffix bounds). Each is a true lower bound on the step
time of every plan of its pair (the tests under ``tests/unit/solver/`` check them against
enumeration)."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from nest_fx.cost import memory
from nest_fx.cost.dp_sync import tail_terms
from nest_fx.cost.schedules import bubble_factor
from nest_fx.cost.step_time import pipeline_span
from nest_fx.solver.candidates import busiest_stage_floor, layer_floors, layer_prefix, partition_floor
from nest_fx.solver.space import GlobalConfig, objective
from nest_fx.solver.stage_bounds import SLACK
from nest_fx.solver.stage_table import StageTable
from nest_fx.solver.table_cache import TableCache


# how much of the network tier 1 asks (``network_bounds(upto=)``): nothing, the DP groups' tail
# floor, or also each layer's collectives and the stage boundaries' sends (the whole bound)
NO_NETWORK, TAILS, WHOLE = 0, 1, 2


def network_bound(
    cache: TableCache,
    g: GlobalConfig,
    p: int,
    m: int,
    best: float = math.inf,
    memo: Optional[Dict[tuple, object]] = None,
    stages: bool = False,
    upto: int = WHOLE,
) -> float:
    """Tier 1: ``pipeline_span(max(T / p, F_p), W + X) + Q`` with Q = ``cache.tail_floor`` (at
    least T_opt(N / p)) and (W, X) =
    ``cache.replica_work`` (the stages' work and their sends) plus the recompute memory forces
    (``cache.forced_recompute``; inf when nothing fits) and T = W, or W + X when sends are not
    overlapped, and F_p the busiest stage's compute (``candidates.busiest_stage_floor`` and
    ``partition_floor``). The
    network is asked last: when the same bound without collectives or sends (W
    the layers' compute alone, a smaller valid bound) already reaches ``best`` (the pair is
    dropped either way), that bound is returned and the pair's groups are never resolved; the
    DP groups (the tail floor) are asked before the layers' collectives.
    ``memo``: the network-independent terms per (variant, ZeRO, shard degree, p), one dict per search.
    ``upto``: ``NO_NETWORK`` stops before the tail floor, ``TAILS`` before the collectives (each
    a smaller valid bound: the search asks the network only for pairs whose cheaper bound stays
    below the best plan when they are popped again)."""
    return network_bounds(cache, g, p, m, [g.virtual_stages], best, memo, stages, upto)[0]


def network_bounds(
    cache: TableCache,
    g: GlobalConfig,
    p: int,
    m: int,
    factors: List[int],
    best: float = math.inf,
    memo: Optional[Dict[tuple, object]] = None,
    stages: bool = False,
    upto: int = WHOLE,
) -> List[float]:
    """:func:`network_bound` of g at each interleave factor of ``factors`` (an interleaved
    family's members: the terms that do not depend on the factor, the tail floor and the
    replica's work, are looked up once; each factor's bound is the one its own call gives)."""
    memo = {} if memo is None else memo
    key = (id(cache), g.variant, g.zero, g.shard, p)
    if key not in memo:  # (t_opt, the layers' compute, the busiest stage's), or None when states cannot fit
        memo[key] = None if states_exceed_memory(cache, g, p) else compute_terms_of(cache, g, p, memo)
    base = memo[key]
    if base is None:
        return [math.inf] * len(factors)
    t_opt, compute, busiest = base
    # the network-free spans per factor, kept for the pair's next tiers (they do not depend on best)
    fkey = ("factors", id(cache), g.variant, g.zero, g.pp_shard_grads, g.shard, p, m, g.schedule, tuple(factors))
    spans = memo.get(fkey)
    if spans is None:
        spans = memo[fkey] = _FactorSpans(cache, g, p, m, factors, compute, busiest)
    tail = work = None  # asked of the network only for a factor the cheaper bounds keep
    out = []
    for j, v in enumerate(factors):
        cheap = spans.cheap[j]
        if (cheap + t_opt) * SLACK >= best:  # without the recompute memory forces (>= 0) either
            out.append(cheap + t_opt)
            continue
        forced, cheap = spans.forced(j)  # what memory forces every plan of the pair to re-run
        if math.isinf(forced):
            out.append(math.inf)
            continue
        if (cheap + t_opt) * SLACK >= best or upto == NO_NETWORK:
            out.append(cheap + t_opt)
            continue
        # the tails (their DP groups, shared by the variants of equal parameters), then the collectives
        if tail is None:
            tail = max(t_opt, cache.tail_floor(g, p, m))
        if (cheap + tail) * SLACK >= best or upto == TAILS:
            out.append(cheap + tail)
            continue
        if work is None:  # the factor's sends are v times one chunk's (2 P_i each)
            work, sends_one = cache.replica_work(g, p, 1)
            busiest_work = max(busiest, cache.busiest_work(g, p))  # the busiest stage with its collectives
        sends = v * sends_one
        paced = work + forced + (1 - float(cache.options.overlap_p2p)) * sends  # results.microbatch_time's t_i >= this
        floor = max(busiest_work, cache.stage_floor(g, p, m, v)) if stages else busiest_work
        bound = pipeline_span(max(paced / p, floor), work + forced + sends, m, g.schedule, v) + tail
        if stages and bound * SLACK < best:
            bound = _ordered_stages(cache, g, p, m, v, best, tail, work + forced + sends, max(paced / p, floor), bound)
        out.append(bound)
    return out


class _FactorSpans:
    """What :func:`network_bounds` computes per interleave factor before it asks the network, for
    one (cache, variant, ZeRO, shard, p, m, schedule, factors): ``cheap[j]``, the span of the
    layers' compute alone, and :meth:`forced` (the recompute memory forces and the span with it,
    asked only of the factors whose first bound stays below the incumbent). A pair is asked
    again at each of its tiers, an interleaved family once per tier for every factor; these do not
    change in between."""

    def __init__(self, cache: TableCache, g: GlobalConfig, p: int, m: int, factors, compute: float, busiest: float):
        self.cache, self.g, self.p, self.m, self.factors = cache, g, p, m, factors
        self.compute, self.busiest = compute, busiest
        self.cheap = [pipeline_span(max(compute / p, busiest), compute, m, g.schedule, v) for v in factors]
        self._forced: List[Optional[Tuple[float, float]]] = [None] * len(factors)

    def forced(self, j: int) -> Tuple[float, float]:
        """(``TableCache.forced_recompute`` at factor j, the span with the layers' compute and it;
        the span is not computed when the forced recompute is inf)."""
        hit = self._forced[j]
        if hit is None:
            v = self.factors[j]
            forced = self.cache.forced_recompute(self.g, self.p, self.m, v)
            if math.isinf(forced):
                hit = (forced, math.inf)
            else:
                least = self.compute + forced  # replica_work's W without collectives
                hit = (forced, pipeline_span(max(least / self.p, self.busiest), least, self.m, self.g.schedule, v))
            self._forced[j] = hit
        return hit


def _ordered_stages(
    cache: TableCache, g: GlobalConfig, p: int, m: int, v: int, best: float, tail: float, spans: float, floor, bound
) -> float:
    """``bound`` raised when no split of (g, p) can keep its busiest stage at the time that
    would make the pair's bound reach ``best``: the stages' layers in order with their
    collectives and the recompute each stage's own memory forces (``TableCache.splits_fit``).
    Asked at that one time only (the pipeline span is increasing in max_i t_i when m > its
    bubble factor), so it costs one greedy pass."""
    share = bubble_factor(g.schedule, v)
    if m <= share:
        return bound
    cap = (best - tail - spans * share) / (m - share) * (1 + 1e-9)  # max_i t_i at which the bound reaches best
    if cap <= floor or cache.splits_fit(g, p, m, v, cap):
        return bound
    return pipeline_span(cap, spans, m, g.schedule, v) + tail  # every split's busiest stage takes more than cap


def table_worth(cache: TableCache, g: GlobalConfig, p: int, m: int, best: float, memo: Dict[tuple, object]) -> bool:
    """Whether a pair tier 1 keeps still may beat ``best`` once its busiest stage also sees each
    stage's own memory (``TableCache.stage_floor`` by layer count, ``TableCache.splits_fit`` in
    layer order with the collectives: asked only here, before a table is built)."""
    return network_bound(cache, g, p, m, best, memo, stages=True) * SLACK < best


def compute_terms_of(
    cache: TableCache, g: GlobalConfig, p: int, memo: Dict[tuple, object]
) -> Tuple[float, float, float]:
    """(T_opt(N / p), the replica's forward + backward seconds, the busiest stage's floor)."""
    floors = memo.get(("floors", g.variant))
    if floors is None:
        floors = memo[("floors", g.variant)] = layer_floors(cache.workload, g.variant)
    busiest = memo.get(("busiest", g.variant, p))
    if busiest is None:  # the busiest stage's compute: by layer count, and by the layers' order
        prefix = memo.get(("prefix", g.variant))
        if prefix is None:
            prefix = memo[("prefix", g.variant)] = layer_prefix(cache.workload, g.variant)
        busiest = memo[("busiest", g.variant, p)] = max(
            float(busiest_stage_floor(floors, p)), partition_floor(prefix, p)
        )
    t_opt = tail_terms(0.0, 0.0, 0.0, cache.replica_params(g) / p, g.shard, g.zero, cache.cluster, cache.options)[1]
    replica = cache.replica(g)
    terms = replica.terms[replica.modes[0]]
    return t_opt, float(terms.fwd + terms.bwd), busiest


def states_exceed_memory(cache: TableCache, g: GlobalConfig, p: int) -> bool:
    """Whether no split of (g, p) can fit: the model states of an average stage (the replica's
    parameters / p, sharded over all of g's ZeRO ranks, experts included) exceed the usable
    memory. Some stage holds at least the average and its total is at least its states, so
    this never drops a feasible pair (it spares building their tables: an interleaved family
    that cannot fit would build one per factor)."""
    o = cache.options
    zero = memory.effective_zero_stage(g.zero, p, g.pp_shard_grads)
    # the parameters' dtype for the gradients: no more than a pipelined stage holds (a lower bound)
    states = memory.model_states(cache.replica_params(g) / p, zero, g.shard, o)["total"]
    return states > memory.usable_bytes(cache.cluster.device.memory_bytes, o)


def table_bound(table: StageTable, best: float, exact_tails: bool) -> float:
    """Tiers 2 and 3: the pair's bound on plans faster than ``best`` from its suffix bounds
    (inf when there are none)."""
    if table.too_short(best):
        return math.inf
    t, s, q = (float(a[0]) for a in table.suffix_bounds(best, exact_tails)[0])
    if not exact_tails:  # q bounded by the optimizer step alone: tier 1's tail floor is a bound too
        q = max(q, table.cache.tail_floor(table.g, table.p, table.m))
    if math.isinf(t) or math.isinf(s) or math.isinf(q):
        return math.inf
    return objective(t, s, q, table.m, table.g.schedule, table.g.virtual_stages)
