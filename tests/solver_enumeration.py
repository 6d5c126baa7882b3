"""Every plan of one (global configuration, stage count) by enumeration: the ground truth the
solver's bound tests compare with (helpers on pytest's pythonpath, not tests themselves)."""

from __future__ import annotations

import itertools
from typing import Iterator, List, Sequence

from nest_fx.plan import StagePlan


def stage_splits(n: int, p: int, min_layers: int) -> Iterator[List[int]]:
    """The stage bounds ``[0, ..., n]`` of every split of ``n`` layers into ``p`` stages of at
    least ``min_layers`` each (``Plan.validate`` refuses fewer layers than interleaved chunks)."""
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = [0, *cuts, n]
        if all(b - a >= min_layers for a, b in zip(bounds, bounds[1:])):
            yield bounds


def every_plan(work, cluster, g, p: int, m: int, modes: Sequence[str]) -> Iterator:
    """The plans of ``g`` with ``p`` stages and ``m`` microbatches: every split, every recompute
    mode of ``modes`` per stage."""
    for bounds in stage_splits(len(work), p, g.virtual_stages):
        for chosen in itertools.product(modes, repeat=p):
            yield g.plan([StagePlan(a, b, g.tp, r) for a, b, r in zip(bounds, bounds[1:], chosen)], m, work, cluster)
