"""The NEST structured dynamic program, exact for nest-fx's cost model.

For one global configuration g (TP degree, DP degree, EP degree, microbatch, ZeRO, schedule,
placement) and one pipeline depth p, the step time is

    T = pipeline_span(max_i t_i, sum_i s_i) + max_i q_i

where stage i's per-microbatch time t_i, span s_i (``results.microbatch_time``) and tail q_i
(exposed DP sync + optimizer) are the simulator's own terms (``step_time.stage_cost``, here
evaluated for all stage slots at once by ``stage_table.StageTable``). Stage i's cost depends only
on its index (in-flight microbatches, its ranks and hence the network level of its boundary and of
its DP group), its layer range and its recompute mode; so a DP over states (stage index i, layers consumed b) enumerates all
contiguous partitions. T is monotone in the three aggregates (max t, sum s, max q), so keeping,
per state, the Pareto-optimal aggregate triples is exact. Per (stage, layer range) only the
recompute modes whose (t, s, q) no other fitting mode beats are tried
(:func:`undominated_rows`).

Pruning (safe: only lower bounds): a partial plan is dropped when T evaluated on its aggregates
combined with the suffix bounds of the state it reaches (``StageTable.suffix_bounds``: the least
max t, sum s and max q any feasible completion can have) is no better than the best plan known.
The same bounds at the root bound the whole (g, p) pair.

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

import numpy as np

from nest_fx.plan import StagePlan
from nest_fx.solver.space import objective
from nest_fx.solver.stage_bounds import SLACK
from nest_fx.solver.stage_table import StageTable

# (max_t, sum_s, max_q, back-pointer)
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


def undominated_rows(
    table: StageTable, i: int, cols: np.ndarray, tails: Dict[str, np.ndarray]
) -> Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Stage i's (t, s, q) per recompute mode over ``cols`` (inf where the mode does not fit, or
    another fitting mode has t, s and q no larger, strictly smaller in one or earlier in
    ``table.modes``: it never gives a better plan); modes left with nothing are dropped."""
    rows = {
        r: (
            np.where(table.fits[r][i], table.t[r][i], np.inf)[cols],
            np.where(table.fits[r][i], table.s[r][i], np.inf)[cols],
            tails[r][cols],
        )
        for r in table.modes
    }
    modes = list(rows)
    dropped = {r: np.zeros(cols.shape, dtype=bool) for r in modes}
    for a, ra in enumerate(modes):
        ta, sa, qa = rows[ra]
        for b, rb in enumerate(modes):
            if a == b:
                continue
            tb, sb, qb = rows[rb]
            no_worse = np.isfinite(tb) & (tb <= ta) & (sb <= sa) & (qb <= qa)
            better = (tb < ta) | (sb < sa) | (qb < qa) if b > a else True
            dropped[ra] |= no_worse & better
    out = {}
    for r in modes:
        if not dropped[r].all() and np.isfinite(rows[r][0]).any():
            out[r] = tuple(np.where(dropped[r], np.inf, x) for x in rows[r])
    return out


def solve_partition(table: StageTable, best: float, deadline: Optional[float] = None) -> Optional[DPResult]:
    """Best contiguous partition into ``table.p`` stages with per-stage recompute, or None when
    nothing fits or nothing beats ``best``."""
    g, p, n, m = table.g, table.p, table.n, table.m
    sched, v = g.schedule, g.virtual_stages
    bounds = table.suffix_bounds(best)
    fronts: Dict[int, List[Entry]] = {0: [(0.0, 0.0, 0.0, None)]}
    for i in range(p):
        nxt: Dict[int, List[Entry]] = {}
        b0, _, ends = table.band(i, best)
        cols = table.viable(i, best)
        tails = table.tails(i, best)
        rows = undominated_rows(table, i, cols, tails)
        t_after, s_after, q_after = bounds[i + 1]
        for b, front in fronts.items():
            if deadline is not None and time.perf_counter() > deadline:
                raise BudgetExceeded
            row = b - b0
            e_row = ends[row]
            t_next, s_next, q_next = t_after[e_row], s_after[e_row], q_after[e_row]
            # Screen (end, mode) with the front's smallest aggregates: a vector lower bound.
            lo_t = min(x[0] for x in front)
            lo_s = min(x[1] for x in front)
            lo_q = min(x[2] for x in front)
            for r, (ts, ss, qs) in rows.items():
                t_row, s_row, q_row = ts[row], ss[row], qs[row]
                with np.errstate(invalid="ignore"):  # 0 * inf (m = 1, no fit): NaN, screened out
                    screen = objective(
                        np.maximum(np.maximum(lo_t, t_row), t_next),
                        lo_s + s_row + s_next,
                        np.maximum(np.maximum(lo_q, q_row), q_next),
                        m,
                        sched,
                        v,
                    )
                for j in np.flatnonzero(screen * SLACK < best).tolist():
                    t, s_i, q = float(t_row[j]), float(s_row[j]), float(q_row[j])
                    e = int(e_row[j])
                    tn, sn, qn = float(t_next[j]), float(s_next[j]), float(q_next[j])
                    for entry in front:
                        cand = (max(entry[0], t), entry[1] + s_i, max(entry[2], q), (i, b, e, r, entry))
                        lb = objective(max(cand[0], tn), cand[1] + sn, max(cand[2], qn), m, sched, v)
                        if lb * SLACK >= best:
                            continue
                        _pareto_insert(nxt.setdefault(e, []), cand)
        fronts = nxt
        if not fronts:
            return None
    finals = fronts.get(n, [])
    if not finals:
        return None
    step = [objective(x[0], x[1], x[2], m, sched, v) for x in finals]  # (max t, sum s, max q)
    k = min(range(len(finals)), key=step.__getitem__)
    if step[k] >= best:
        return None
    stages: List[StagePlan] = []
    entry = finals[k]
    while entry[3] is not None:
        i, b, e, r, prev = entry[3]
        stages.append(StagePlan(b, e, g.tp, r))
        entry = prev
    stages.reverse()
    return DPResult(step_s=step[k], stages=stages)
