"""A lower bound on the busiest stage's time that sees each stage's own memory (tier 1 of the
search, ``TableCache.stage_floor``).

Stage i of a pipeline holds ``f_i`` in-flight microbatches of its blocks' activations
(``inflight.pipeline_inflight_microbatches``) and at least ``k`` bytes of model states per
parameter, so its layers S_i obey ``k P(S_i) + f_i A(S_i) <= C`` (``memory.stage_memory``:
every other term only adds; with one microbatch the gradients and the activations are never
there together, so ``k`` leaves the gradients out). The first stages hold the most microbatches:
a split that is even in layers may have to recompute there what the pooled bound of
``TableCache.forced_recompute`` spreads over every stage.

For a stage of ``l`` layers, whatever they are: its forward + backward is at least the ``l``
cheapest layers' (t_i >= compute + recompute: ``results.microbatch_time``), its parameters at
least the ``l`` smallest counts, its blocks' activations kept without recompute at least the
``l`` smallest (a non-block layer keeps none of them), so it must save at least
``need(l) = kept_min(l) - (C - k params_min(l)) / f_i`` bytes by recomputation; the least
seconds that save them, choosing modes fractionally on each block's lower convex hull of (kept
bytes, recompute seconds) with at most ``min(l, count_d)`` blocks of each distinct cost d, is a
lower bound on its recompute (the LP relaxation; inf when even the hulls' full savings fall
short). So ``t_i >= floor_i(l)`` whenever stage i holds l layers.

A split whose busiest stage takes at most T gives every stage a layer count l_i with
``floor_i(l_i) <= T`` (and the schedule's least and most layers per stage) summing to L; the
least T for which the largest such counts still reach L bounds ``max_i t_i`` from below (inf when
none does: no split fits). ``tests/unit/solver/test_stage_reach.py`` checks it against every
split and recompute choice of small cases.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from nest_fx.cost import memory
from nest_fx.cost.inflight import pipeline_inflight_microbatches
from nest_fx.cost.options import CostOptions
from nest_fx.graph.recompute_policies import cost_key, parse_recompute
from nest_fx.workload import LayerCost

# the bound is lowered by this relative hair (float rounding of sums taken in another order)
_ROUNDING = 1e-9


@dataclass
class ReachTerms:
    """What :func:`busiest_floor` reads of one variant: prefix sums of the per-layer values sorted
    ascending (``[l]``: the least sum of any l layers), and the blocks' hull segments, cheapest
    first."""

    compute: np.ndarray  # (L + 1,) forward + backward seconds
    params: np.ndarray  # (L + 1,) parameters
    kept: np.ndarray  # (L + 1,) blocks' activation bytes kept without recompute (0 for other layers)
    rate: np.ndarray  # (S,) seconds per byte saved
    unit: np.ndarray  # (S,) bytes one block saves on the segment
    count: np.ndarray  # (S,) blocks of the segment's cost


def block_hull(c: LayerCost, modes) -> Tuple[Tuple[float, float], List[Tuple[float, float]]]:
    """(the cheapest-in-time (kept bytes, recompute seconds) point of a block over ``modes``, its
    lower convex hull's segments from there as (seconds per byte saved, bytes saved))."""
    points = {(c.act_bytes[r], c.recompute_s[r]) for r in modes if r in c.act_bytes}
    start = min(points, key=lambda x: (x[1], x[0]))  # the cheapest in time (none)
    hull = [(0.0, start[1])]  # (bytes saved, seconds): the lower convex hull from the start
    last = 0.0
    for saved, t in sorted((start[0] - a, t) for a, t in points if a < start[0]):
        if saved == last:
            continue  # the same bytes at more seconds
        last = saved
        while len(hull) >= 2 and _slope(hull[-2], hull[-1]) >= _slope(hull[-1], (saved, t)):
            hull.pop()
        hull.append((saved, t))
    return start, [(_slope(u, w), w[0] - u[0]) for u, w in zip(hull, hull[1:])]


def _slope(u: Tuple[float, float], w: Tuple[float, float]) -> float:
    """Seconds per byte saved from hull point ``u`` to ``w`` (each: bytes saved, seconds)."""
    return (w[1] - u[1]) / (w[0] - u[0])


def hull_modes(modes) -> set:
    """The per-block cost keys of recompute ``modes`` (every:<k> runs blocks as none or full)."""
    keys = {cost_key(r) for r in modes if parse_recompute(r).kind != "every"}
    if len(keys) < len(modes):
        keys |= {"none", "full"}
    return keys


def recompute_hull(
    costs: Sequence[LayerCost], counts: Sequence[int], modes
) -> Tuple[float, float, List[Tuple[float, float]]]:
    """(the parameters of the distinct layer ``costs`` held ``counts`` times each, their blocks'
    activation bytes per microbatch kept without recompute, the segments (seconds per byte
    saved, bytes it can save) of the blocks' lower convex hulls over recompute ``modes``,
    cheapest first)."""
    params = sum(int(n) * c.num_params for c, n in zip(costs, counts))
    keys = hull_modes(modes)
    kept = 0.0
    segments: List[Tuple[float, float]] = []
    for c, n in zip(costs, counts):
        count = int(n)
        if not c.block or not count:
            continue
        start, hull = block_hull(c, keys)
        kept += count * start[0]
        segments += [(rate, count * saved) for rate, saved in hull]
    return params, kept, sorted(segments)


def stage_memory_terms(g, p: int, m: int, zero: int, v: int, options: CostOptions) -> Tuple[float, List[float]]:
    """(k: model-state bytes every stage of g's depth-p pipeline holds per parameter at least,
    at ``zero`` (its effective ZeRO stage) over g's shard ranks; f_i: each stage's in-flight
    microbatches of its blocks' activations at interleave factor v). With one microbatch the
    gradients and the activations are never there together (``memory.stage_memory``): k leaves
    the gradients out."""
    states = memory.model_states(1.0, zero, g.shard, options)
    per_param = states["total"] - (states["grads"] if m == 1 else 0.0)
    return per_param, [pipeline_inflight_microbatches(g.schedule, i, p, m, v) for i in range(p)]


def reach_terms(costs: Sequence[LayerCost], counts: Sequence[int], modes) -> ReachTerms:
    """:class:`ReachTerms` of the distinct layer ``costs`` held ``counts`` times each, recompute
    ``modes`` (cost keys: :func:`hull_modes`)."""

    def prefix(values: List[float]) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(np.sort(np.asarray(values, dtype=float)))])

    compute, params, kept, segments = [], [], [], []
    for c, n in zip(costs, counts):
        n = int(n)
        compute += [c.fwd_s + c.bwd_s] * n
        params += [float(c.num_params)] * n
        if not c.block or not n:
            kept += [0.0] * n
            continue
        start, hull = block_hull(c, modes)
        kept += [start[0]] * n
        segments += [(rate, saved, n) for rate, saved in hull]
    segments.sort()
    seg = np.array(segments, dtype=float).reshape(-1, 3)
    return ReachTerms(prefix(compute), prefix(params), prefix(kept), seg[:, 0], seg[:, 1], seg[:, 2])


def busiest_floor(
    terms: ReachTerms,
    inflight: Sequence[float],
    per_param: float,
    capacity: float,
    least: int,
    most: int,
) -> float:
    """A lower bound on ``max_i t_i`` of any split of the L layers into ``len(inflight)`` stages
    of ``least`` to ``most`` layers each, stage i holding ``inflight[i]`` microbatches of its
    blocks' activations and ``per_param`` bytes of states per parameter within ``capacity`` bytes
    (module docstring); inf when no split fits."""
    layers = len(terms.compute) - 1
    most = min(most, layers)
    if least > most:
        return math.inf
    ells = np.arange(least, most + 1)
    rows, stages = np.unique(np.asarray(inflight, dtype=float), return_counts=True)
    seconds, fits = _recompute_seconds(terms, rows, per_param, capacity, ells)
    floor = np.where(fits, terms.compute[ells][None, :] + seconds, math.inf)  # (F, E)
    values = np.unique(floor[np.isfinite(floor)])
    if not values.size or not _covers(floor, ells, stages, layers, values[-1]):
        return math.inf
    lo, hi = -1, len(values) - 1  # values[hi] covers; the least that does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _covers(floor, ells, stages, layers, values[mid]):
            hi = mid
        else:
            lo = mid
    return float(values[hi]) * (1 - _ROUNDING)


def _recompute_seconds(
    terms: ReachTerms, rows: np.ndarray, per_param: float, capacity: float, ells: np.ndarray
) -> Tuple[np.ndarray, np.ndarray]:
    """(F, E) each: the least recompute seconds a stage holding ``rows[f]`` in-flight microbatches
    and ``ells[e]`` layers spends to fit (the LP on the blocks' hulls, module docstring), and
    whether the hulls' full savings suffice."""
    need = terms.kept[ells][None, :] - (capacity - per_param * terms.params[ells])[None, :] / rows[:, None]
    cap = np.minimum(terms.count[None, :], ells[:, None]) * terms.unit[None, :]  # (E, S), cheapest first
    before = np.cumsum(cap, axis=1) - cap
    used = np.clip(need[:, :, None] - before[None], 0.0, cap[None])  # (F, E, S) bytes saved per segment
    seconds = (used * terms.rate).sum(axis=2)
    fits = need <= cap.sum(axis=1)[None, :] + _ROUNDING * np.abs(terms.kept[ells])[None, :]
    return seconds, fits


def recompute_floors(terms: ReachTerms, inflight: Sequence[float], per_param: float, capacity: float) -> np.ndarray:
    """(p, L + 1): entry [i, l] a lower bound on the recompute seconds per microbatch of stage i
    (``inflight[i]`` microbatches) holding l layers, whatever they are (:func:`busiest_floor`'s
    LP), made non-decreasing in l by taking the least over l and every longer count (still a
    lower bound); inf where no count from l up fits, 0 for no layer."""
    layers = len(terms.compute) - 1
    rows, index = np.unique(np.asarray(inflight, dtype=float), return_inverse=True)
    seconds, fits = _recompute_seconds(terms, rows, per_param, capacity, np.arange(1, layers + 1))
    floors = np.minimum.accumulate(np.where(fits, seconds, math.inf)[:, ::-1], axis=1)[:, ::-1]
    return np.concatenate([np.zeros((len(rows), 1)), floors], axis=1)[index.ravel()]


def splits_fit(
    prefix: Sequence[float],
    floors: np.ndarray,
    cap: float,
    ranged: Optional[Callable[[int, int, np.ndarray], np.ndarray]] = None,
) -> bool:
    """Whether the layers can be cut into ``len(floors)`` contiguous stages (some possibly empty)
    with every stage's lower bound at most ``cap``: stage i holding layers [b, e) takes at least
    ``prefix[e] - prefix[b] + floors[i, e - b]`` (``prefix``: prefix sums of each layer's least
    time, in layer order; ``floors``: :func:`recompute_floors`). Greedy, stage by stage, each
    reaching as far as its cap allows: from a later start a stage reaches no less (its layers'
    sum shrinks and ``floors[i]`` grows with the count), so no split fits when the greedy one
    does not. ``ranged(i, b, ends)``: per end e, a further lower bound on stage i's recompute
    holding [b, e) that never grows when the range shrinks (``ordered_memory.range_recompute``),
    asked of the ends the by-count floor keeps. False proves every split's busiest stage slower
    than ``cap``."""
    if ranged is not None and not splits_fit(prefix, floors, cap):
        return False  # each stage reaches no further with its range's floor than without
    layers = len(prefix) - 1
    pos = 0
    for i, row in enumerate(floors):
        base = prefix[pos]
        if row[0] > cap:
            return False
        # the furthest end within the cap on the layers' sums alone, then back while the floor exceeds it
        end = bisect.bisect_right(prefix, base + cap, pos) - 1
        lo, hi = pos, end
        while lo < hi:  # the largest e in [pos, end] with prefix[e] - base + row[e - pos] <= cap
            mid = (lo + hi + 1) // 2
            if prefix[mid] - base + row[mid - pos] <= cap:
                lo = mid
            else:
                hi = mid - 1
        if ranged is not None and lo > pos:  # the furthest of those ends its own range's memory allows
            ends = np.arange(pos + 1, lo + 1)
            ok = np.asarray(prefix)[ends] - base + ranged(i, pos, ends) <= cap
            lo = int(ends[ok].max()) if ok.any() else pos
        pos = lo
        if pos >= layers:
            return True
    return False


def _covers(floor: np.ndarray, ells: np.ndarray, stages: np.ndarray, layers: int, cap: float) -> bool:
    """Whether stages whose time is at most ``cap`` can hold all the layers: every stage some
    count with ``floor <= cap``, the largest such counts summing to at least ``layers``."""
    ok = floor <= cap
    if not ok.any(axis=1).all():
        return False
    largest = np.where(ok, ells[None, :], 0).max(axis=1)
    return int((largest * stages).sum()) >= layers
