"""Layer ranges of one layer variant grouped into classes: what a pipeline stage's cost depends on.

Stage i's cost depends on its layer range [b, e) only through the range's *class*: how many
layers of each distinct layer cost it holds, the cost of layer b - 1 (the boundary it
receives) and of layer e - 1 (the boundary buffer it sends). With identical blocks there are
O(L) classes for L layers instead of O(L^2) ranges. Per class and recompute mode the
network-independent layer sums (``cost.stage_terms.compute_terms``) are computed once, on
arrays; :mod:`nest_fx.solver.stage_table` assembles them into stage costs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, List, Optional, Tuple

import numpy as np

from nest_fx.cost.stage_terms import LayerTerms, compute_terms, repeated_share
from nest_fx.graph.recompute_policies import cost_key, parse_recompute
from nest_fx.workload import LayerCost, Variant, Workload


@dataclass
class RangeClasses:
    """Layer ranges of one :class:`Variant` grouped by what a stage's cost depends on."""

    costs: List[LayerCost]  # distinct layer costs, in ``Workload.variant_costs`` order
    cls: np.ndarray  # (L+1, L+1): class of range [b, e); K (no class) where e <= b
    counts: np.ndarray  # (D, K): layers of each distinct cost in the class
    prev: np.ndarray  # (K,) distinct cost of the layer before the range; -1 when it starts at 0
    out_bytes: np.ndarray  # (K,) bytes the range's last layer hands on (the stage's buffers)
    in_bytes: np.ndarray  # (K,) bytes the layer before the range hands on (0 when it starts at 0)
    length: np.ndarray  # (K,) layers in the class's ranges
    terms: Dict[str, LayerTerms]  # per recompute mode: network-independent sums, (K,) each
    modes: Tuple[str, ...] = ()  # the modes worth searching (undominated_modes)
    tied: float = 0.0  # parameters of a tied embedding (the tail's LayerCost.tied_params)

    @property
    def size(self) -> int:
        return len(self.prev)


def undominated_modes(costs: List[LayerCost], modes) -> Tuple[str, ...]:
    """The recompute modes worth searching for a variant: a per-layer policy is dropped when
    another keeps no more bytes, re-runs no more seconds and repeats no more collectives on every
    layer (and less of one of them somewhere, or comes earlier in ``modes``): it is never better
    in time or memory (e.g. ``selective`` with fused attention keeps more than ``none`` and
    re-runs the attention). ``every:<k>`` mixes ``none`` and ``full`` over a stage and stays."""
    per_layer = [r for r in modes if parse_recompute(r).kind != "every"]

    def profile(r: str) -> List[float]:
        key = cost_key(r)
        return [
            x
            for c in costs
            for x in (
                c.act_bytes[key],
                c.recompute_s[key],
                float(sum(repeated_share(m, r) * m.count for m in c.comms if c.block)),
            )
        ]

    profiles = {r: profile(r) for r in per_layer}
    keep = []
    for k, r in enumerate(per_layer):
        beaten = any(
            all(a <= b for a, b in zip(profiles[o], profiles[r])) and (profiles[o] != profiles[r] or j < k)
            for j, o in enumerate(per_layer)
            if o != r
        )
        if not beaten:
            keep.append(r)
    return tuple(r for r in modes if r in keep or parse_recompute(r).kind == "every")


def costed_modes(workload: Workload, variant: Variant, modes) -> Tuple[str, ...]:
    """The modes of ``modes`` the workload costs in a variant (a layer table may give only some
    policies; ``every:<k>`` needs ``none`` and ``full``)."""
    have = set(workload.recompute_policies(variant))
    return tuple(
        r for r in modes if ({"none", "full"} if parse_recompute(r).kind == "every" else {cost_key(r)}) <= have
    )


def range_classes(workload: Workload, variant: Variant, modes) -> RangeClasses:
    """Classes of all ranges [b, e), 0 <= b < e <= L, for one layer variant."""
    costs, prefix, index = workload.variant_costs(variant)
    n, d = len(workload), len(costs)
    counts = np.array(prefix, dtype=np.int64).reshape(d, n + 1)
    layer = np.array(index, dtype=np.int64)
    b, e = np.triu_indices(n + 1, 1)
    held = counts[:, e] - counts[:, b]  # (D, ranges)
    # the layers before and at the end of a range count through what they send (the boundary
    # and its buffers): costs that send alike share a class (the first block under sequence
    # parallelism differs from the others by its slice only: workload.sequence_edges)
    sends = np.array(_alike_senders(costs), dtype=np.int64)
    prev = np.where(b > 0, sends[layer[np.maximum(b - 1, 0)]], -1)
    keys = np.vstack([held, prev[None, :], sends[layer[e - 1]][None, :]]).T
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    cls = np.full((n + 1, n + 1), len(uniq), dtype=np.intp)
    cls[b, e] = inverse.ravel()
    per_cost = np.ascontiguousarray(uniq[:, :d].T)
    sent = np.array([c.out_bytes for c in costs] + [0.0], dtype=float) / variant.cp  # [-1]: no layer before
    out_bytes = sent[uniq[:, d + 1]]
    searched = undominated_modes(costs, costed_modes(workload, variant, modes))
    terms = {r: compute_terms(list(zip(costs, per_cost)), r) for r in searched}
    return RangeClasses(
        costs=costs,
        cls=cls,
        counts=per_cost,
        prev=uniq[:, d].copy(),
        out_bytes=out_bytes,
        in_bytes=sent[uniq[:, d]],
        length=per_cost.sum(axis=0),
        terms=terms,
        modes=searched,
        tied=costs[index[-1]].tied_params,
    )


def _alike_senders(costs: List[LayerCost]) -> List[int]:
    """For each distinct cost, the first distinct cost that hands on what it does (its
    ``out_bytes`` and whether it is a block: all a pipeline boundary's price and a stage's
    buffers read of the layer before and at the end of a stage)."""
    first: Dict[Tuple[float, bool], int] = {}
    return [first.setdefault((c.out_bytes, c.block), k) for k, c in enumerate(costs)]


@dataclass
class ReplicaTerms:
    """The one range the search's per-pair bounds read (all L layers of a :class:`Variant` on one
    stage): what :class:`RangeClasses` holds of its class ``cls[0, L]``, without the classes of
    the other ranges (the bounds of the many pairs that never build a table need no more)."""

    costs: List[LayerCost]  # distinct layer costs, in ``Workload.variant_costs`` order
    counts: np.ndarray  # (D,) layers of each distinct cost
    senders: np.ndarray  # distinct costs some layer follows (the layer before a stage boundary)
    terms: Dict[str, LayerTerms]  # per recompute mode: the layers' sums (scalars)
    modes: Tuple[str, ...] = ()  # the modes worth searching (undominated_modes)


def replica_terms(
    workload: Workload, variant: Variant, modes, memo: Optional[Dict[tuple, LayerTerms]] = None
) -> ReplicaTerms:
    """:class:`ReplicaTerms` of one layer variant: the same sums, in the same order, as
    :func:`range_classes` gives the range [0, L). ``memo``: the sums per (variant, mode) already
    made (the schedules' mode sets overlap); read only."""
    costs, prefix, index = workload.variant_costs(variant)
    n = len(workload)
    counts = np.array(prefix, dtype=np.int64).reshape(len(costs), n + 1)
    whole = counts[:, n] - counts[:, 0]
    searched = undominated_modes(costs, costed_modes(workload, variant, modes))
    memo = {} if memo is None else memo
    # the counts as Python ints: the same sums as numpy's integers give, without numpy scalar arithmetic
    distinct = list(zip(costs, whole.tolist()))
    for r in searched:
        if (variant, r) not in memo:
            memo[(variant, r)] = compute_terms(distinct, r)
    return ReplicaTerms(
        costs=costs,
        counts=whole,
        senders=np.unique(np.array(index[:-1], dtype=np.int64)),
        terms={r: memo[(variant, r)] for r in searched},
        modes=searched,
    )


def subset_terms(terms: LayerTerms, idx: np.ndarray) -> LayerTerms:
    """``terms`` with every per-class array indexed by ``idx`` (scalars kept)."""
    values = {}
    for name in _TERM_FIELDS:
        value = getattr(terms, name)
        values[name] = value[idx] if isinstance(value, np.ndarray) else value
    return LayerTerms(**values)


_TERM_FIELDS = tuple(f.name for f in fields(LayerTerms))
