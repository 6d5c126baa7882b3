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
    config_of,
    config_rows,
    stage_counts,
)
from nest_fx.workload.types import Variant, Workload


def variant_of(g: GlobalConfig) -> Variant:
    """The workload variant of a configuration (``Workload.cost``)."""
    return g.variant


def _replica_work(workload: Workload, g: GlobalConfig) -> Tuple[float, float, np.ndarray]:
    """(per-microbatch fwd + bwd seconds, per-device parameters, :func:`layer_floors`) of one
    replica at g's variant."""
    times = [workload.cost(i, g.variant) for i in range(len(workload))]
    work = sum(c.fwd_s + c.bwd_s for c in times)
    return work, sum(c.num_params for c in times), _floors([c.fwd_s + c.bwd_s for c in times])


def _floors(times) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.sort(np.asarray(times, dtype=float)))])


def layer_floors(workload: Workload, variant: Variant) -> np.ndarray:
    """(L + 1,): entry k is the least forward + backward seconds of any k of the L layers (prefix
    sums of the sorted per-layer times)."""
    return _floors([c.fwd_s + c.bwd_s for c in (workload.cost(i, variant) for i in range(len(workload)))])


def layer_prefix(workload: Workload, variant: Variant) -> list:
    """(L + 1,) prefix sums of the layers' forward + backward seconds in layer order (a list, for
    :func:`partition_floor`'s bisection)."""
    times = [c.fwd_s + c.bwd_s for c in (workload.cost(i, variant) for i in range(len(workload)))]
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


def candidates(
    workload: Workload,
    cluster: ClusterModel,
    global_batch: int,
    options: SolverOptions,
    deadline: Optional[float] = None,
    expand: bool = False,
):
    """(LB, g, p) for every admissible pair that passes the memory screen, sorted by LB (tier 0
    of the module docstring); only those enumerated before ``deadline`` (a
    ``time.perf_counter()`` value) when it passes. An interleaved ``g`` with ``v =
    ANY_INTERLEAVE`` stands for every factor at its depth (its bound: the largest factor's,
    the least); ``expand`` lists the factors one by one instead (the baselines)."""
    options = options.priced()
    workload = options.runtime_workload(workload)
    capacity = memory.usable_bytes(cluster.device.memory_bytes, options.cost)
    works: Dict[tuple, Tuple[float, float, np.ndarray]] = {}
    screens: Dict[tuple, np.ndarray] = {}
    depth_memo: Dict[tuple, np.ndarray] = {}
    t_opts: Dict[tuple, np.ndarray] = {}
    busiest: Dict[tuple, np.ndarray] = {}
    out = []
    shared, rows = config_rows(workload, cluster, global_batch, options)
    first = options.placements[0]
    for k, row in enumerate(rows):
        if deadline is not None and k % 256 == 0 and time.perf_counter() > deadline:
            break
        mbs, dp, tp, _, cp, _, _, zero, _, schedule, v, placement = row  # CONFIG_ROW
        # stage_counts reads only these of g (and the workload, cluster and options, fixed here;
        # compile is the options'): most rows have no depth and never build their GlobalConfig
        depth_key = (dp * tp * cp, dp * mbs, schedule, v, zero, placement == first)
        depths = depth_memo.get(depth_key)
        if depths is None:
            g = config_of(row, shared)
            depths = depth_memo[depth_key] = np.array(
                stage_counts(workload, cluster, g, global_batch, options), dtype=np.intp
            )
        if not depths.size:
            continue
        g = config_of(row, shared)
        key = variant_of(g)
        if key not in works:
            works[key] = _replica_work(workload, g)
        work, params, floors = works[key]
        screen_key = (params, g.zero, g.shard, int(depths[-1]))
        if screen_key not in screens:  # fits[p]: the leanest model states of p stages fit
            every = np.arange(1, int(depths[-1]) + 1, dtype=float)
            screens[screen_key] = np.concatenate(
                [[False], model_states(params / every, g.zero, g.shard, options.cost)["total"] <= capacity]
            )
        depths = depths[screens[screen_key][depths]]
        # the optimizer step and the busiest stage's floor do not depend on the schedule or placement
        depths_key = depths.tobytes()
        t_opt = t_opts.get((screen_key, depths_key))
        if t_opt is None:
            t_opt = t_opts[(screen_key, depths_key)] = tail_terms(
                0.0, 0.0, 0.0, params / depths, g.shard, g.zero, cluster, options.cost
            )[1]
        max_t = busiest.get((key, depths_key))
        if max_t is None:
            max_t = busiest[(key, depths_key)] = np.maximum(work / depths, busiest_stage_floor(floors, depths))
        m = g.microbatches(global_batch)
        if g.virtual_stages == ANY_INTERLEAVE and g.schedule in CHUNKED_SCHEDULES:
            v = len(workload) // depths  # the largest factor gives the least bound of the family
            lbs = m * max_t + (work - max_t) * bubble_factor(g.schedule, 1) / v + t_opt
        else:
            lbs = pipeline_span(max_t, work, m, g.schedule, g.virtual_stages) + t_opt
        if expand:
            for lb, p in zip(lbs.tolist(), depths.tolist()):
                out.extend((lb, h, p) for h in concrete(g, workload, p))
        else:
            out += [(lb, g, p) for lb, p in zip(lbs.tolist(), depths.tolist())]
    out.sort(key=lambda x: x[0])
    return out
