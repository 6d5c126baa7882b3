"""Tier 0 of the search: every admissible (global config, pipeline depth) pair with a lower bound
on its step time that needs no network model (``solver.search`` refines it; the baselines
enumerate the same pairs)."""

from __future__ import annotations

import bisect
import time
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from nest_fx.cluster.protocol import ClusterModel
from nest_fx.cost import memory
from nest_fx.cost.dp_sync import tail_terms
from nest_fx.cost.memory import model_states
from nest_fx.cost.schedules import bubble_factor
from nest_fx.plan.vocabulary import CHUNKED_SCHEDULES
from nest_fx.cost.step_time import pipeline_span
from nest_fx.solver.space import (
    ANY_INTERLEAVE,
    GlobalConfig,
    SolverOptions,
    concrete,
    config_blocks,
    config_of,
    stage_counts,
)
from nest_fx.workload.layer_classes import layer_costs
from nest_fx.workload.types import Variant, Workload


def variant_of(g: GlobalConfig) -> Variant:
    """The workload variant of a configuration (``Workload.cost``)."""
    return g.variant


def _replica_work(workload: Workload, variant: Variant) -> Tuple[float, float, np.ndarray]:
    """(per-microbatch fwd + bwd seconds, per-device parameters, :func:`layer_floors`) of one
    replica at ``variant``."""
    times = layer_costs(workload, variant)
    work = sum(c.fwd_s + c.bwd_s for c in times)
    return work, sum(c.num_params for c in times), _floors([c.fwd_s + c.bwd_s for c in times])


def _floors(times) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.sort(np.asarray(times, dtype=float)))])


def layer_floors(workload: Workload, variant: Variant) -> np.ndarray:
    """(L + 1,): entry k is the least forward + backward seconds of any k of the L layers (prefix
    sums of the sorted per-layer times)."""
    return _floors([c.fwd_s + c.bwd_s for c in layer_costs(workload, variant)])


def layer_prefix(workload: Workload, variant: Variant) -> list:
    """(L + 1,) prefix sums of the layers' forward + backward seconds in layer order (a list, for
    :func:`partition_floor`'s bisection)."""
    times = [c.fwd_s + c.bwd_s for c in layer_costs(workload, variant)]
    return np.concatenate([[0.0], np.cumsum(times)]).tolist()


def busiest_stage_floor(floors: np.ndarray, depths):
    """A lower bound on max_i t_i of any split into ``depths`` stages (an int or an array): the
    stage holding the most layers holds at least ceil(L / p) of them, and its per-microbatch time is
    at least their forward + backward seconds (``results.microbatch_time``: collectives,
    recompute and sends only add), hence at least the ceil(L / p) cheapest layers' sum."""
    layers = len(floors) - 1
    return floors[-(-layers // np.asarray(depths))]


def partition_floor(prefix: Sequence[float], p: int, iterations: int = 16) -> float:
    """A lower bound on max_i t_i of any split of the layers into ``p`` contiguous stages:
    ``prefix`` holds the prefix sums of the layers' forward + backward seconds in layer order
    (t_i is at least its layers' sum: ``busiest_stage_floor``'s argument), and no split into p
    parts has a smaller largest part than the least cap a greedy cut fits into p parts (the
    classic linear partition). Returns the largest cap found too small by a binary search (so
    the optimum exceeds it), a hair below for rounding; 0 for p >= the layers."""
    layers = len(prefix) - 1
    if p >= layers:
        return 0.0
    total = prefix[-1]
    lo = max(total / p, max(b - a for a, b in zip(prefix, prefix[1:])))
    if _fits(prefix, p, lo):
        return lo * (1 - 1e-9)
    hi = 2 * lo
    while not _fits(prefix, p, hi):
        lo, hi = hi, 2 * hi
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if _fits(prefix, p, mid):
            hi = mid
        else:
            lo = mid
    return lo * (1 - 1e-9)


def _fits(prefix: Sequence[float], p: int, cap: float) -> bool:
    """Whether greedy cuts (each stage takes layers while their sum stays <= cap) need at most p stages."""
    pos, last = 0, len(prefix) - 1
    for _ in range(p):
        pos = bisect.bisect_right(prefix, prefix[pos] + cap, pos) - 1
        if pos >= last:
            return True
    return False


def _least_fitting_depth(params: float, zero: int, shard: int, layers: int, capacity: float, options) -> int:
    """The least depth p <= ``layers`` whose leanest model states, those of ``params / p``
    parameters, fit in ``capacity`` (``layers + 1`` when none does): they shrink as p grows
    (each term is a product of the parameters and positive factors, rounded monotonically), so
    a bisection asks a few depths instead of every one."""

    def fits(p: int) -> bool:
        return model_states(params / p, zero, shard, options.cost)["total"] <= capacity

    lo, hi = 0, layers + 1  # fits(hi) taken as true, fits(lo) as false
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


class Pairs:
    """Tier 0's pairs, sorted by bound (ties in enumeration order), built lazily: ``self[k]``
    is ``(lb, g, p)``, g's :class:`GlobalConfig` made on first ask (the search asks for a few
    thousand of the ~10^5 pairs). Pairs appended later (an interleaved family's members) follow
    the tier-0 ones. ``lbs`` and ``tps``: every tier-0 pair's bound and TP degree, as lists."""

    def __init__(self, lbs: np.ndarray, depths: np.ndarray, rows: np.ndarray, fields: "RowFields", shared: dict):
        self.lbs, self.depths, self.count = lbs.tolist(), depths.tolist(), len(lbs)
        self._rows, self._fields, self._shared = rows.tolist(), fields, shared
        self.tps = fields.tps[rows].tolist()
        self._configs: Dict[int, GlobalConfig] = {}
        self._more: list = []

    def __len__(self) -> int:
        return self.count + len(self._more)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if k >= self.count:
            return self._more[k - self.count]
        r = self._rows[k]
        g = self._configs.get(r)
        if g is None:
            g = self._configs[r] = config_of(self._fields.row(r), self._shared)
        return self.lbs[k], g, self.depths[k]

    def append(self, pair: tuple) -> None:
        self._more.append(pair)


class RowFields:
    """Tier 0's configuration rows (fields :data:`space.CONFIG_ROW`) as an outer row of
    ``space.config_blocks`` and an inner one each: row r is ``outer[of[r]] + inner[at[r]]``."""

    def __init__(self, outers: list, inner: list, of: np.ndarray, at: np.ndarray):
        self.outers, self.inner, self.of, self.at = outers, inner, of, at
        self.tps = np.array([o[2] for o in outers], dtype=np.intp)[of] if outers else np.zeros(0, np.intp)

    def row(self, r: int) -> tuple:
        return self.outers[int(self.of[r])] + self.inner[int(self.at[r])]


def candidates(
    workload: Workload,
    cluster: ClusterModel,
    global_batch: int,
    options: SolverOptions,
    deadline: Optional[float] = None,
    expand: bool = False,
) -> list:
    """(LB, g, p) for every admissible pair that passes the memory screen, sorted by LB (tier 0
    of the module docstring); only those enumerated before ``deadline`` (a
    ``time.perf_counter()`` value) when it passes. An interleaved ``g`` with ``v =
    ANY_INTERLEAVE`` stands for every factor at its depth (its bound: the largest factor's,
    the least); ``expand`` lists the factors one by one instead (the baselines)."""
    pairs = tier0(workload, cluster, global_batch, options, deadline)
    if not expand:
        return pairs[:]
    workload = options.priced().runtime_workload(workload)
    return [(lb, h, p) for lb, g, p in pairs[:] for h in concrete(g, workload, p)]


def tier0(
    workload: Workload,
    cluster: ClusterModel,
    global_batch: int,
    options: SolverOptions,
    deadline: Optional[float] = None,
) -> Pairs:
    """:func:`candidates` (not expanded) as :class:`Pairs`. The configurations are read as rows
    (``space.config_rows``); a row's admissible depths depend on a few of its fields
    (``stage_counts``, asked once per distinct set), its bounds on its variant, ZeRO stage,
    shard degree, microbatches and schedule: the per-depth terms are tabulated once per variant
    and per (parameters, ZeRO, shard), and the bounds of every (row, depth) computed in one pass of
    array arithmetic, element by element the same operations as per row."""
    options = options.priced()
    workload = options.runtime_workload(workload)
    capacity = memory.usable_bytes(cluster.device.memory_bytes, options.cost)
    layers = len(workload)
    every = np.arange(1, layers + 1)
    depth_sets: list = []  # (layers + 1,) bool: depth p admissible
    variants: Dict[tuple, int] = {}
    works: list = []  # per variant: (work, params, max_t by depth)
    screens: Dict[tuple, int] = {}
    screen_terms: list = []  # per (parameters, ZeRO, shard): (fits by depth, t_opt by depth)
    schedules: Dict[tuple, int] = {}
    outers: list = []  # the outer rows with admissible depths
    kept: list = []  # per such outer row: (its inner rows, screen, variant, microbatches)
    shared, inner, outer_rows = config_blocks(workload, cluster, global_batch, options)
    codes = np.array([schedules.setdefault((schedule, v), len(schedules)) for schedule, v, _ in inner], dtype=np.intp)
    # per what stage_counts reads of the outer fields (and the workload, cluster and options,
    # fixed here; compile is the options'): the inner rows (schedule, factor, placement) with
    # admissible depths and their depth sets (most rows have none and never build a GlobalConfig)
    inner_memo: Dict[tuple, int] = {}
    inner_rows: list = []  # (inner row indices, their depth sets) as arrays
    for k, outer in enumerate(outer_rows):
        if deadline is not None and k % 32 == 0 and time.perf_counter() > deadline:
            break
        mbs, dp, tp, ep, cp, lp, sp, zero, dp_shard = outer  # CONFIG_ROW's first nine fields
        inner_key = (dp * tp * cp, dp * mbs, zero)
        wi = inner_memo.get(inner_key)
        if wi is None:
            js, dss = [], []
            for j, ends in enumerate(inner):
                depths = stage_counts(workload, cluster, config_of(outer + ends, shared), global_batch, options)
                if depths:
                    admissible = np.zeros(layers + 1, dtype=bool)
                    admissible[depths] = True
                    js.append(j)
                    dss.append(len(depth_sets))
                    depth_sets.append(admissible)
            wi = inner_memo[inner_key] = len(inner_rows) if js else -1
            if js:
                inner_rows.append((np.array(js, dtype=np.intp), np.array(dss, dtype=np.intp)))
        if wi < 0:
            continue
        vkey = (tp, ep, mbs, sp, cp, lp)  # Variant's fields, in its order
        vi = variants.get(vkey)
        if vi is None:
            vi = variants[vkey] = len(works)
            work, params, floors = _replica_work(workload, Variant(*vkey))
            # the busiest stage's floor does not depend on the schedule or placement
            max_t = np.maximum(work / every, busiest_stage_floor(floors, every))
            works.append((work, params, np.concatenate([[np.inf], max_t])))
        shard = (dp_shard or dp) * cp  # GlobalConfig.shard
        params = works[vi][1]  # the variants of one parameter count (microbatch sizes) share these
        si = screens.get((params, zero, shard))
        if si is None:  # fits[p]: the leanest model states of p stages fit
            si = screens[(params, zero, shard)] = len(screen_terms)
            fits = every >= _least_fitting_depth(params, zero, shard, layers, capacity, options)
            t_opt = tail_terms(0.0, 0.0, 0.0, params / every, shard, zero, cluster, options.cost)[1]
            screen_terms.append((np.concatenate([[False], fits]), np.concatenate([[np.inf], t_opt])))
        outers.append(outer)
        kept.append((wi, si, vi, global_batch // (dp * mbs)))
    if not kept:
        empty = np.zeros(0, dtype=np.intp)
        return Pairs(np.zeros(0), empty, empty, RowFields([], inner, empty, empty), shared)
    # the rows in enumeration order: each outer row followed by its inner rows with depths
    wi, si, vi, m = (np.array(c) for c in zip(*kept))
    sizes = np.array([len(js) for js, _ in inner_rows], dtype=np.intp)[wi]
    of = np.repeat(np.arange(len(kept)), sizes)
    at = np.concatenate([inner_rows[w][0] for w in wi.tolist()])
    ds = np.concatenate([inner_rows[w][1] for w in wi.tolist()])
    si, vi, m, sc = si[of], vi[of], m[of], codes[at]
    row, p = np.nonzero(np.array(depth_sets)[ds] & np.array([f for f, _ in screen_terms])[si])  # row-major
    vi, m, sc = vi[row], m[row], sc[row]
    work = np.array([w for w, _, _ in works])[vi]
    max_t = np.array([t for _, _, t in works])[vi, p]
    t_opt = np.array([t for _, t in screen_terms])[si[row], p]
    lbs = np.empty(len(row))
    for (schedule, v), code in schedules.items():
        at_code = sc == code
        if not at_code.any():
            continue
        if v == ANY_INTERLEAVE and schedule in CHUNKED_SCHEDULES:
            factor = layers // p[at_code]  # the largest factor gives the least bound of the family
            lbs[at_code] = (
                m[at_code] * max_t[at_code]
                + (work[at_code] - max_t[at_code]) * bubble_factor(schedule, 1) / factor
                + t_opt[at_code]
            )
        else:
            lbs[at_code] = pipeline_span(max_t[at_code], work[at_code], m[at_code], schedule, v) + t_opt[at_code]
    order = np.argsort(lbs, kind="stable")  # ties keep the enumeration order (row, then depth)
    return Pairs(lbs[order], p[order], row[order], RowFields(outers, inner, of, at), shared)
