"""What of a stage table can still be part of a plan faster than a given ``best``, and the
bounds the NEST DP prunes with (:class:`StageBounds`, the search half of ``StageTable``).

Every bound here is about plans faster than ``best``, which only decreases during a search, so
what a table derives for one ``best`` is memoised until it changes. A class is *alive* for a
stage when some recompute mode fits and its own time already leaves room under ``best``;
*bands* are the layer ranges each stage may still hold; a range is *viable* when the prefix
bounds before it and the suffix bounds after it leave room too. The suffix and prefix bounds
are exact single-criterion optima (max t, sum s, max q) over the bands, so together they bound
every completion from below. ``even_split`` gives the DP a first incumbent.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from nest_fx.plan import StagePlan
from nest_fx.solver.space import GlobalConfig, objective

INF = math.inf
# Bounds add in another order than a plan's own sums; never prune on a last-ulp difference.
SLACK = 1.0 - 1e-12


class StageBounds:
    """The pruning half of :class:`~nest_fx.solver.stage_table.StageTable`, which fills in the
    entries these methods read: (p, K + 1) arrays over the K live classes and the sentinel K."""

    g: GlobalConfig
    n: int  # layers
    p: int  # stages
    m: int  # microbatches
    modes: Tuple[str, ...]
    cls: np.ndarray  # (L + 1, L + 1): live class of range [b, e), K when not live
    length: np.ndarray  # (K,) layers of each live class
    t: Dict[str, np.ndarray]  # per mode: time per microbatch
    s: Dict[str, np.ndarray]  # per mode: span per microbatch
    fits: Dict[str, np.ndarray]  # per mode: fits in memory
    t_opt: np.ndarray  # (K + 1,) optimizer step
    _fastest: np.ndarray  # t in the fastest fitting mode
    _fastest_s: np.ndarray  # s in the fastest fitting mode
    _memo: Dict[tuple, object]
    _memo_best: float
    size: int  # K, the sentinel's index (a property of the table)
    _tail_values: Callable[[int, np.ndarray], Dict[str, np.ndarray]]  # exact q_i per mode for some classes

    def _memoised(self, key: tuple, best: float, compute):
        """Per-``best`` memo: what a table derives for one incumbent (``best`` only decreases)."""
        if best != self._memo_best:
            self._memo, self._memo_best = {}, best
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    # -- what can still matter --------------------------------------------------------------
    def alive(self, best: float = INF) -> np.ndarray:
        """(p, K + 1): whether stage i holding class c could be part of a plan faster than
        ``best``: some mode fits, and the stage's own time t and span s in their fastest fitting
        modes do not already give ``pipeline_span(t, s) + T_opt >= best``."""

        def compute():
            t = self._fastest
            ok = np.isfinite(t)
            if best < INF:
                with np.errstate(invalid="ignore"):
                    ok &= (
                        objective(t, self._fastest_s, self.t_opt, self.m, self.g.schedule, self.g.virtual_stages)
                        * SLACK
                        < best
                    )
            return ok

        return self._memoised(("alive",), best, compute)

    def too_short(self, best: float = INF) -> bool:
        """Whether the longest alive class of each stage, together, hold fewer than L layers:
        then no partition of the layers is made of alive stages (a cheap infeasibility proof)."""
        longest = np.where(self.alive(best)[:, :-1], self.length, 0).max(axis=1, initial=0)
        return int(longest.sum()) < self.n

    def bands(self, best: float = INF) -> Tuple[np.ndarray, np.ndarray]:
        """Ranges each stage may hold in a plan faster than ``best``: (classes, ends), both
        (p, L - p + 1, kmax), entry [i, r, k - 1] for range [i + r, i + r + k); the sentinel K
        where the range is out of stage i's reach (stage 0 starts at layer 0, the last stage
        ends at L, every stage holds a layer) or its class is not :meth:`alive`. kmax is the
        longest alive class, so deep pipelines scan short bands."""

        def compute():
            n, p, size = self.n, self.p, self.size
            alive = self.alive(best)
            width = n - p + 1
            longest = int(np.where(alive[:, :size], self.length, 0).max(initial=0))
            stage = np.arange(p)[:, None, None]
            row = np.arange(width)[None, :, None]
            starts = stage + row
            ends = starts + np.arange(1, min(longest, width) + 1)[None, None, :]
            first = np.where(stage == p - 1, n, stage + 1)
            last = np.where(stage == p - 1, n, n - p + stage + 1)
            reach = (ends >= first) & (ends <= last) & ((stage > 0) | (row == 0))
            ends = np.minimum(ends, n)
            cols = np.where(reach, self.cls[starts, ends], size)
            live = np.take_along_axis(alive, cols.reshape(p, -1), axis=1).reshape(cols.shape)
            return np.where(live, cols, size), ends

        return self._memoised(("bands",), best, compute)

    def band(self, i: int, best: float = INF) -> Tuple[int, np.ndarray, np.ndarray]:
        """Stage i's part of :meth:`bands`: (first layer b of row 0, classes, ends)."""
        cols, ends = self.bands(best)
        return i, cols[i], ends[i]

    def viable(self, i: int, best: float = INF) -> np.ndarray:
        """Stage i's :meth:`band` classes, with the sentinel K also where the range [b, e) cannot
        be part of a plan faster than ``best``: the prefix bounds at (i, b), the stage's fastest
        fitting time and optimizer step, and the suffix bounds at (i + 1, e) (both with q bounded
        by the optimizer step) already give a step time >= ``best``."""

        def compute():
            b0, cols, ends = self.band(i, best)
            if not cols.size:
                return cols
            t_pre, s_pre, q_pre = self.prefix_bounds(best)[i][:, b0 : b0 + cols.shape[0], None]
            t_suf, s_suf, q_suf = self.suffix_bounds(best, exact_tails=False)[i + 1][:, ends]
            t, s, q = self._fastest[i][cols], self._fastest_s[i][cols], self.t_opt[cols]
            with np.errstate(invalid="ignore"):
                lb = objective(
                    np.maximum(np.maximum(t_pre, t), t_suf),
                    s_pre + s + s_suf,
                    np.maximum(np.maximum(q_pre, q), q_suf),
                    self.m,
                    self.g.schedule,
                    self.g.virtual_stages,
                )
            return np.where(lb * SLACK < best, cols, self.size)

        return self._memoised(("viable", i), best, compute)

    def tails(self, i: int, best: float = INF) -> Dict[str, np.ndarray]:
        """q_i = exposed DP sync + optimizer step per mode, (K + 1,) over classes: exact for the
        classes :meth:`viable` for stage i, inf for the others. The DP sync asks the network, so
        it is computed once per (stage, class), on demand."""

        def compute():
            cols = np.unique(self.viable(i, best))
            cols = cols[cols < self.size]
            out = {}
            for r, q in self._tail_values(i, cols).items():
                out[r] = np.full(self.size + 1, INF)
                out[r][cols] = q
            return out

        return self._memoised(("tails", i), best, compute)

    # -- bounds -----------------------------------------------------------------------------
    def suffix_bounds(self, best: float = INF, exact_tails: bool = True) -> np.ndarray:
        """(p + 1, 3, L + 1): entry [i, :, b] bounds (max t, sum s, max q) from below over the
        stages i..p-1 of any feasible completion holding layers [b, L) that could belong to a
        plan faster than ``best``. Each is an exact single-criterion optimum over the bands
        (each stage's mode chosen for that criterion alone), so together they bound every such
        completion. Without ``exact_tails`` q is bounded by the optimizer step (no network)."""
        return self._memoised(("bounds", exact_tails), best, lambda: self._suffix_bounds(best, exact_tails))

    def _suffix_bounds(self, best: float, exact_tails: bool) -> np.ndarray:
        n, p = self.n, self.p
        cols, ends = self.bands(best)
        t_min = self._fastest
        if exact_tails:
            cols = np.array([self.viable(i, best) for i in range(p)]).reshape(cols.shape)
            q_min = np.array(
                [
                    np.minimum.reduce([np.where(self.fits[r][i], q, INF) for r, q in self.tails(i, best).items()])
                    for i in range(p)
                ]
            )
        else:
            q_min = np.where(np.isfinite(t_min), self.t_opt, INF)
        out = np.full((p + 1, 3, n + 1), INF)
        out[p, :, n] = 0.0
        if not cols.shape[2]:
            return out
        t_band = np.take_along_axis(t_min, cols.reshape(p, -1), axis=1).reshape(cols.shape)
        s_band = np.take_along_axis(self._fastest_s, cols.reshape(p, -1), axis=1).reshape(cols.shape)
        q_band = np.take_along_axis(q_min, cols.reshape(p, -1), axis=1).reshape(cols.shape)
        width = cols.shape[1]
        for i in range(p - 1, -1, -1):
            after = out[i + 1][:, ends[i]]  # (3, rows, kmax): the best completion after each range
            np.maximum(t_band[i], after[0], out=after[0])
            after[1] += s_band[i]
            np.maximum(q_band[i], after[2], out=after[2])
            out[i, :, i : i + width] = after.min(axis=2)
        return out

    def prefix_bounds(self, best: float = INF) -> np.ndarray:
        """(p + 1, 3, L + 1): entry [i, :, b] bounds (max t, sum s, max q) from below over stages
        0..i-1 of any feasible start holding layers [0, b) (q bounded by the optimizer step);
        the mirror image of :meth:`suffix_bounds`."""

        def compute():
            n, p = self.n, self.p
            cols, ends = self.bands(best)
            out = np.full((p + 1, 3, n + 1), INF)
            out[0, :, 0] = 0.0
            if not cols.shape[2]:
                return out
            t_band = np.take_along_axis(self._fastest, cols.reshape(p, -1), axis=1).reshape(cols.shape)
            s_band = np.take_along_axis(self._fastest_s, cols.reshape(p, -1), axis=1).reshape(cols.shape)
            q_band = np.where(np.isfinite(t_band), self.t_opt[cols], INF)
            width = cols.shape[1]
            criteria = np.arange(3)[:, None, None]
            for i in range(p):
                reach = out[i][:, i : i + width, None]  # (3, rows, 1): the best start before each range
                step = np.stack(
                    [np.maximum(reach[0], t_band[i]), reach[1] + s_band[i], np.maximum(reach[2], q_band[i])]
                )
                np.minimum.at(out[i + 1], (criteria, ends[i][None]), step)
            return out

        return self._memoised(("prefix",), best, compute)

    def even_split(self, best: float = INF) -> Optional[Tuple[float, float, float, List[StagePlan]]]:
        """The even layer split, each stage with the first mode (in option order) that fits:
        (max t, sum s, max q, stages), or None when a stage fits in no mode, is not live, or the
        split cannot beat ``best`` even with q at the optimizer step (then its DP sync is never
        asked of the network)."""
        n, p = self.n, self.p
        bounds = [i * n // p for i in range(p + 1)]
        cols = [self.cls[bounds[i], bounds[i + 1]] for i in range(p)]
        modes = [next((r for r in self.modes if self.fits[r][i, c]), None) for i, c in enumerate(cols)]
        if None in modes:
            return None
        times = [float(self.t[r][i, c]) for i, (r, c) in enumerate(zip(modes, cols))]
        spans = [float(self.s[r][i, c]) for i, (r, c) in enumerate(zip(modes, cols))]
        if (
            objective(
                max(times), sum(spans), float(self.t_opt[cols].max()), self.m, self.g.schedule, self.g.virtual_stages
            )
            * SLACK
            >= best
        ):
            return None
        max_t = sum_s = max_q = 0.0
        for i, (r, c, t, s) in enumerate(zip(modes, cols, times, spans)):
            q = float(self._tail_values(i, np.array([c]))[r][0])
            max_t, sum_s, max_q = max(max_t, t), sum_s + s, max(max_q, q)
        return max_t, sum_s, max_q, [StagePlan(a, b, self.g.tp, r) for a, b, r in zip(bounds, bounds[1:], modes)]
