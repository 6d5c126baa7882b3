"""The recompute a stage's own memory forces on it for a given layer range, in layer order (what
``stage_reach.splits_fit`` reads beside its by-count floors; ``TableCache.splits_fit``).

A stage runs one recompute mode r over its layers (``StagePlan.recompute``). Holding layers
[b, e) under r, stage i holds at least ``k P[b, e) + f_i A_r[b, e)`` bytes (``stage_reach``'s
premise: model states, ``f_i`` in-flight microbatches of its blocks' activations kept under r)
plus its one-layer backward working set ``layer_peak_r`` once in ``activations`` and
``cache_share`` times it in ``allocator_cache`` (``memory.stage_memory``; with one microbatch,
where the gradients may replace the activations at the peak, they are at least as large), and
re-runs exactly ``R_r[b, e)`` seconds per microbatch; all of these are the sums and maxima
``stage_terms.compute_terms`` gives the range. So the least ``R_r[b, e)`` over the modes r that
fit bounds the stage's recompute from below (inf when none fits).

It says more than the by-count floor (``stage_reach.recompute_floors``: the l cheapest layers of
the whole model for a stage of l layers, recompute chosen fractionally per block), which lets a
first stage hold the tail's small parameter count and a fraction of a recomputed block. Every
term of a mode only shrinks when the range loses a layer (``every:<k>`` too: it drops a
recomputed block only with one that keeps at least as much), so neither does the bound
(``splits_fit``'s greedy stays exact); ``tests/unit/solver/test_ordered_memory.py`` checks it
against every split and recompute choice of small cases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

from nest_fx.cost.stage_terms import compute_terms
from nest_fx.graph.recompute_policies import parse_recompute
from nest_fx.workload import LayerCost


@dataclass
class OrderedMemory:
    """One variant's layers in order by distinct cost d (prefix counts), and per recompute mode
    what :func:`range_recompute` sums: per-layer modes as (M, D) rows, ``every:<k>`` ones kept
    by name (their recomputed blocks depend on the range: ``compute_terms``)."""

    counts: np.ndarray  # (D, L + 1): layers of cost d before each position
    params: np.ndarray  # (L + 1,) prefix sums of the parameters
    kept: np.ndarray  # (M, D) a block's activation bytes kept under each per-layer mode (0 for other layers)
    seconds: np.ndarray  # (M, D) its recompute seconds
    peak: np.ndarray  # (M, D) its one-layer backward working set (what it rebuilds + bwd_scratch)
    every: List[int]  # k of each every:<k> mode
    order: np.ndarray  # the block costs, least bytes saved by full recompute first (recomputed_counts' order)
    none_kept: np.ndarray  # (D,) a block's kept bytes under none (0 for other layers)
    full: np.ndarray  # (4, D) under none / full: kept bytes, recompute seconds, working set (none, full)


def ordered_memory(costs: Sequence[LayerCost], prefix_counts: Sequence[Sequence[int]], modes) -> OrderedMemory:
    """:class:`OrderedMemory` of the distinct layer ``costs`` with their prefix counts in layer
    order (``Workload.variant_costs``) under recompute ``modes`` (plan forms the variant costs)."""
    per_layer = [r for r in modes if parse_recompute(r).kind != "every"]
    one = [compute_terms([(c, 1)], r) for c in costs for r in per_layer]
    shape = (len(costs), len(per_layer))

    def rows(values: List[float]) -> np.ndarray:
        return np.asarray(values, dtype=float).reshape(shape).T

    block = [c.block for c in costs for _ in per_layer]
    counts = np.asarray(prefix_counts, dtype=float).reshape(len(costs), -1)
    return OrderedMemory(
        counts=counts,
        params=np.array([float(c.num_params) for c in costs]) @ counts,
        kept=rows([t.act if b else 0.0 for t, b in zip(one, block)]),
        seconds=rows([t.recompute for t in one]),
        peak=rows([t.layer_peak for t in one]),
        every=[parse_recompute(r).every for r in modes if parse_recompute(r).kind == "every"],
        order=np.array(
            sorted(
                (d for d, c in enumerate(costs) if c.block),
                key=lambda d: costs[d].act_bytes["none"] - costs[d].act_bytes["full"],
            ),
            dtype=np.intp,
        ),
        none_kept=np.array([c.act_bytes["none"] if c.block else 0.0 for c in costs]),
        full=_none_full(costs) if any(parse_recompute(r).kind == "every" for r in modes) else np.zeros((4, 0)),
    )


def _none_full(costs: Sequence[LayerCost]) -> np.ndarray:
    """(4, D): each block's kept bytes under none less under full, full's recompute seconds, and
    each layer's one-layer working set under none and under full (``compute_terms``)."""
    none = [compute_terms([(c, 1)], "none") for c in costs]
    full = [compute_terms([(c, 1)], "full") for c in costs]
    return np.array(
        [
            [n.act - f.act if c.block else 0.0 for c, n, f in zip(costs, none, full)],
            [f.recompute if c.block else 0.0 for c, f in zip(costs, full)],
            [n.layer_peak for n in none],
            [f.layer_peak if c.block else n.layer_peak for c, n, f in zip(costs, none, full)],
        ]
    )


def _every(terms: OrderedMemory, held: np.ndarray, every: int, kept_none: np.ndarray, blocks=None):
    """(blocks' kept bytes, recompute seconds, one-layer working set) per range of ``held``
    (D, E) under every:<k>: ``stage_terms.recomputed_counts``' blocks under full, the rest under
    none, as ``compute_terms`` sums them. ``blocks``: :func:`_block_counts` of ``held`` when the
    caller has them (they do not depend on k)."""
    saved, seconds, peak_none, peak_full = terms.full
    blocks, total, before = _block_counts(terms, held) if blocks is None else blocks
    left = np.floor_divide(total, every)
    take = np.clip(left[None, :] - before, 0.0, blocks)
    full = np.zeros_like(held)
    full[terms.order] = take
    kept = kept_none - saved @ full
    peak = np.maximum(
        np.where(full > 0, peak_full[:, None], 0.0).max(axis=0, initial=0.0),
        np.where(held - full > 0, peak_none[:, None], 0.0).max(axis=0, initial=0.0),
    )
    return kept, seconds @ full, peak


def _block_counts(terms: OrderedMemory, held: np.ndarray):
    """(each block cost's layers per range in ``terms.order`` (B, E), their sum (E,), the blocks
    before each in that order (B, E)): what :func:`_every` reads for every k."""
    blocks = held[terms.order]
    return blocks, blocks.sum(axis=0), np.cumsum(blocks, axis=0) - blocks


def range_recompute(
    terms: OrderedMemory,
    begin: int,
    ends: np.ndarray,
    inflight: float,
    per_param: float,
    capacity: float,
    cache_share: float,
) -> np.ndarray:
    """Per end e of ``ends``: a lower bound on the recompute seconds per microbatch of a stage
    holding layers [begin, e) with ``inflight`` microbatches in flight, ``per_param`` bytes of
    states per parameter within ``capacity`` bytes (module docstring); inf where no mode fits."""
    held = terms.counts[:, ends] - terms.counts[:, [begin]]  # (D, E) layers of each cost in the range
    room = capacity - per_param * (terms.params[ends] - terms.params[begin])  # (E,)
    present = held > 0
    slack = 1e-9 * capacity  # float rounding of sums taken in another order
    peak = np.where(present[None], terms.peak[:, :, None], 0.0).max(axis=1, initial=0.0)  # (M, E)
    fits = inflight * (terms.kept @ held) + (1.0 + cache_share) * peak <= room + slack
    best = np.where(fits, terms.seconds @ held, math.inf).min(axis=0, initial=math.inf)
    if not terms.every or not np.any(best > 0):
        return best  # (a mode that re-runs nothing fits every range: every:<k> cannot do better)
    kept_none = terms.none_kept @ held
    blocks = _block_counts(terms, held)
    for k in terms.every:
        kept, seconds, peak = _every(terms, held, k, kept_none, blocks)
        ok = inflight * kept + (1.0 + cache_share) * peak <= room + slack
        best = np.minimum(best, np.where(ok, seconds, math.inf))
    return best
