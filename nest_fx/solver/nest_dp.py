"""The NEST structured dynamic program, exact for nest-fx's cost model.

For one global configuration g (TP degree, DP degree, EP degree, microbatch, ZeRO, schedule,
placement) and one pipeline depth p, the step time is

    T = pipeline_span(max_i t_i, sum_i t_i) + max_i q_i

where stage i's per-microbatch time t_i and tail q_i (exposed DP sync + optimizer) come from
``step_time.stage_cost``: the very function ``simulate`` uses. Stage i's cost depends only on
its index (in-flight microbatches, its ranks and hence the network level of its boundary and
of its DP group), its layer range and its recompute mode; so a DP over states
(stage index i, layers consumed b) enumerates all contiguous partitions. T is monotone in the
three aggregates (max t, sum t, max q), so keeping, per state, the Pareto-optimal aggregate
triples is exact; partial plans whose T already exceeds the best complete plan are dropped
(T only grows as stages are added).

Identical layers: when every block has the same signature, a stage's cost depends on
(i, holds head, holds tail, number of blocks, recompute) and not on where the range starts, so
stage costs are computed O(p * L) times, not O(p * L^2); costing a layer is done once per
distinct layer and variant (``Workload.cost`` caches by signature).

Improvements over the NEST artifact, written down because they change results: one unit
system (seconds and bytes everywhere; the artifact mixes seconds and milliseconds so its
network terms barely register), optimizer states and mixed precision in memory, explicit rank
placement per candidate (stage-major or replica-major) instead of a heuristic, and a Pareto DP
that is exact for its cost model (tests compare it with exhaustive enumeration).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from nest_fx.cost.step_time import CostOptions, stage_cost, stage_tail
from nest_fx.plan import Plan, StagePlan
from nest_fx.solver.space import GlobalConfig, objective
from nest_fx.workload import Workload

# (max_t, sum_t, max_q, back-pointer)
Entry = Tuple[float, float, float, Optional[tuple]]


class BudgetExceeded(Exception):
    """The time budget ran out inside a DP run."""


@dataclass
class DPResult:
    step_s: float
    stages: List[StagePlan]


def _pareto_insert(front: List[Entry], new: Entry) -> None:
    """Insert ``new`` unless dominated; drop entries it dominates."""
    a, b, c = new[0], new[1], new[2]
    for e in front:
        if e[0] <= a and e[1] <= b and e[2] <= c:
            return
    front[:] = [e for e in front if not (a <= e[0] and b <= e[1] and c <= e[2])]
    front.append(new)


class StageTable:
    """Memoised (t_i, q_i, fits) for stage slots of one (g, p), via ``step_time.stage_cost``."""

    def __init__(self, workload: Workload, cluster, g: GlobalConfig, p: int, m: int, options: CostOptions):
        self.workload, self.cluster, self.g, self.p, self.options = workload, cluster, g, p, options
        n = len(workload)
        self.template = Plan(stages=[StagePlan(k, k + 1, g.tp) for k in range(p)], dp=g.dp, ep=g.ep, zero=g.zero,
                             microbatch_size=g.mbs, num_microbatches=m, schedule=g.schedule, virtual_stages=g.v,
                             sequence_parallel=g.sp, placement=g.placement, num_layers=n)
        blocks = [k for k, layer in enumerate(workload.layers) if layer.kind == "block"]
        sigs = {workload.layers[k].signature for k in blocks}
        self.uniform = bool(blocks) and len(sigs) == 1 and blocks == list(range(blocks[0], blocks[-1] + 1))
        self.b0, self.b1 = (blocks[0], blocks[-1] + 1) if blocks else (0, 0)
        self.n = n
        self.memo: Dict[tuple, Tuple[float, float, bool]] = {}
        self.evaluations = 0

    def key(self, i: int, start: int, end: int, r: str) -> tuple:
        """Identical blocks make a stage's cost independent of which blocks it holds: only the
        head/tail layers it holds, its block count and the kind of layer before it matter."""
        if not self.uniform:
            return (i, start, end, r)
        blocks = max(0, min(end, self.b1) - max(start, self.b0))
        before = self.workload.layers[start - 1].kind if start > 0 else ""
        return (i, r, start if start <= self.b0 else -1, end if end >= self.b1 else -1, blocks, before)

    def get(self, i: int, start: int, end: int, r: str) -> Tuple[float, float, bool]:
        k = self.key(i, start, end, r)
        hit = self.memo.get(k)
        if hit is not None:
            return hit
        plan = self.template
        plan.stages[i] = StagePlan(start, end, self.g.tp, r)
        if i > 0:
            plan.stages[i - 1] = StagePlan(start - 1, start, self.g.tp, "none")
        sc = stage_cost(self.workload, self.cluster, plan, i, self.options)
        t = sc.per_microbatch(self.g.v)
        q = sum(stage_tail(sc, plan, self.cluster, self.options))
        self.evaluations += 1
        hit = self.memo[k] = (t, q, sc.fits)
        return hit


def solve_partition(table: StageTable, m: int, recompute: Tuple[str, ...], best: float,
                    deadline: Optional[float] = None) -> Optional[DPResult]:
    """Best contiguous partition into ``table.p`` stages with per-stage recompute, or None when
    nothing fits or nothing beats ``best``."""
    g, p, n = table.g, table.p, table.n
    # T >= (m - 1) max_i t_i (1F1B) or m max_i t_i (interleaved): no stage may take longer than this.
    t_cap = best / max(m - 1 if g.schedule != "interleaved" else m, 1)
    fronts: Dict[int, List[Entry]] = {0: [(0.0, 0.0, 0.0, None)]}
    for i in range(p):
        nxt: Dict[int, List[Entry]] = {}
        last = i == p - 1
        for b, front in fronts.items():
            if deadline is not None and time.perf_counter() > deadline:
                raise BudgetExceeded
            hi = n - (p - 1 - i)
            for e in (range(n, n + 1) if last else range(b + 1, hi + 1)):
                any_fit = False
                fastest = min(table.get(i, b, e, r)[0] for r in recompute)
                if fastest >= t_cap and m > 1:
                    break  # more layers only take longer
                for r in recompute:
                    t, q, fits = table.get(i, b, e, r)
                    if not fits:
                        continue
                    any_fit = True
                    for entry in front:
                        cand = (max(entry[0], t), entry[1] + t, max(entry[2], q), (i, b, e, r, entry))
                        if objective(cand[0], cand[1], cand[2], m, g.schedule, g.v) >= best:
                            continue
                        _pareto_insert(nxt.setdefault(e, []), cand)
                if not any_fit and not last:
                    break  # more layers only need more memory
        fronts = nxt
        if not fronts:
            return None
    finals = fronts.get(n, [])
    if not finals:
        return None
    top = min(finals, key=lambda x: objective(x[0], x[1], x[2], m, g.schedule, g.v))
    stages: List[StagePlan] = []
    entry = top
    while entry[3] is not None:
        i, b, e, r, prev = entry[3]
        stages.append(StagePlan(b, e, g.tp, r))
        entry = prev
    stages.reverse()
    return DPResult(step_s=objective(top[0], top[1], top[2], m, g.schedule, g.v), stages=stages)
