"""The cost model's collectives: one entry point and one memo for every kind of cluster.

``collective_time(kind, cluster, ranks, nbytes)`` and ``p2p(cluster, src, dst, nbytes)`` ask
the cluster's own network model (:class:`~nest_fx.cluster.protocol.ClusterModel`): the
hierarchical ring algorithms of ``nest_fx.cluster.hierarchical_collectives`` on a
:class:`~nest_fx.cluster.Cluster` (their formulas and sources are in that module's docstring
and docs/cost_model.md), routes and contention on a graph topology
(``nest_fx.cluster.topology.algorithms``). Sizes are bytes, results seconds.

The solver asks for the same few rank groups millions of times at many sizes. On a hierarchical
cluster every collective is affine in the size, so each group's (alpha, beta) is memoised and
any size (or array of sizes) is one multiply-add; elsewhere every answer is memoised per size.
Both memos are keyed on (``cluster.cost_key``, kind, ranks): one key scheme, a string that names
the network's figures and the plan's device order, so a result is never served across two
clusters or two orders.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from nest_fx.cluster.hierarchical_collectives import COLLECTIVES
from nest_fx.cluster.protocol import ClusterModel
from nest_fx.cost.arrays import Count, per_value
from nest_fx.workload.types import Comm

_COLLECTIVE_CACHE: Dict[tuple, Dict[float, float]] = {}
_AFFINE_CACHE: Dict[tuple, Optional[Tuple[float, float]]] = {}
_CACHE_LIMIT = 2_000_000  # entries over all groups; the memo starts afresh beyond it
_cached_entries = 0


def collective_time(kind: str, cluster: ClusterModel, ranks: Sequence[int], nbytes: float) -> float:
    """Seconds of collective ``kind`` (all_reduce, all_gather, reduce_scatter, all_to_all,
    broadcast) over ``ranks`` on an ``nbytes`` buffer, as ``cluster``'s network model costs it."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {sorted(COLLECTIVES)}")
    return cluster.collective_time(kind, ranks, nbytes)


def p2p(cluster: ClusterModel, src: int, dst: int, nbytes: float) -> float:
    """Seconds of a point-to-point send of ``nbytes`` from rank ``src`` to rank ``dst``."""
    return cluster.p2p_time(src, dst, nbytes)


def _affine(
    kind: str, cluster: ClusterModel, ranks: Tuple[int, ...], cost_key: Optional[str] = None
) -> Optional[Tuple[float, float]]:
    """The cluster's (alpha, beta) of ``kind`` over ``ranks`` (memoised), or None when its cost is
    not affine in the size (graph topologies). ``cost_key``: ``cluster.cost_key`` when the caller
    has it (asking a cluster for it formats its figures)."""
    key = (cluster.cost_key if cost_key is None else cost_key, kind, ranks)
    if key not in _AFFINE_CACHE:
        if len(_AFFINE_CACHE) > _CACHE_LIMIT:
            _AFFINE_CACHE.clear()
        if kind == "p2p":
            _AFFINE_CACHE[key] = cluster.p2p_coefficients(ranks[0], ranks[1])
        else:
            _AFFINE_CACHE[key] = cluster.collective_coefficients(kind, ranks)
    return _AFFINE_CACHE[key]


def collective_line(kind: str, cluster: ClusterModel, group: Sequence[int]) -> Optional[Tuple[float, float]]:
    """The (alpha, beta) :func:`collective_fn` costs ``kind`` over ``group`` with (``alpha + beta
    * nbytes``, 0 for 0 bytes), or None where the cluster's cost is not affine in the size: two
    groups with the same line cost the same for every size."""
    return _affine(kind, cluster, tuple(group))


def _memo(kind: str, cluster: ClusterModel, ranks: Tuple[int, ...]) -> Dict[float, float]:
    """bytes -> seconds memo of collective ``kind`` over ``ranks`` (clusters without coefficients)."""
    global _cached_entries
    key = (cluster.cost_key, kind, ranks)
    memo = _COLLECTIVE_CACHE.get(key)
    if memo is None:
        if _cached_entries > _CACHE_LIMIT:
            _COLLECTIVE_CACHE.clear()
            _cached_entries = 0
        memo = _COLLECTIVE_CACHE[key] = {}
    return memo


def _miss(kind: str, cluster: ClusterModel, ranks: Tuple[int, ...], memo: Dict[float, float], nbytes: float) -> float:
    """Ask the network model (``p2p`` for kind "p2p", group = (src, dst)) and memoise."""
    global _cached_entries
    t = p2p(cluster, ranks[0], ranks[1], nbytes) if kind == "p2p" else collective_time(kind, cluster, ranks, nbytes)
    memo[nbytes] = t
    _cached_entries += 1
    return t


def collective_fn(kind: str, cluster: ClusterModel, group: Sequence[int]) -> Callable[[Count], Count]:
    """``nbytes -> seconds`` of collective ``kind`` (or ``p2p`` for kind "p2p", group = (src,
    dst)) over ``group``, for a number of bytes or an array of them. The group is resolved once:
    on a cluster whose costs are affine in the size (hierarchical levels) the function is
    ``alpha + beta * nbytes`` (0 for 0 bytes), elementwise on arrays; otherwise each size is asked
    of the network model once and memoised."""
    ranks = tuple(group)
    coefficients = _affine(kind, cluster, ranks)
    if coefficients is not None:
        alpha, beta = coefficients

        def affine(nbytes: Count) -> Count:
            if isinstance(nbytes, np.ndarray):
                return np.where(nbytes > 0, alpha + beta * nbytes, 0.0)
            return alpha + beta * nbytes if nbytes > 0 else 0.0

        return affine
    memo = _memo(kind, cluster, ranks)

    def seconds(nbytes: float) -> float:
        t = memo.get(nbytes)
        return _miss(kind, cluster, ranks, memo, nbytes) if t is None else t

    return lambda nbytes: per_value(seconds, nbytes)


def cached_collective(kind: str, cluster: ClusterModel, group: Sequence[int], nbytes: float) -> float:
    """Seconds of one collective, memoised (see :func:`collective_fn`)."""
    return collective_fn(kind, cluster, group)(nbytes)


def comm_time(cluster: ClusterModel, comm: Comm, group: Sequence[int]) -> float:
    """Seconds of one in-layer collective (``count`` repetitions) over ``group``."""
    if len(group) <= 1:
        return 0.0
    return comm.count * cached_collective(comm.kind, cluster, group, comm.nbytes)


def group_comm_time(cluster: ClusterModel, comm: Comm, groups: Sequence[Sequence[int]]) -> float:
    """Seconds of one in-layer collective on the slowest of ``groups`` (0 when there is none)."""
    return max((comm_time(cluster, comm, g) for g in groups), default=0.0)


def group_comm_fn(cluster: ClusterModel, kind: str, groups: Sequence[Sequence[int]]) -> Callable[[Comm], float]:
    """``comm -> group_comm_time(cluster, comm, groups)`` for collectives of ``kind``, with the
    groups resolved once (:func:`comm_time` of each group: single-rank groups cost 0)."""
    distinct = list(dict.fromkeys(tuple(g) for g in groups if len(g) > 1))
    cost_key = cluster.cost_key
    lines = [_affine(kind, cluster, g, cost_key) for g in distinct]
    if distinct and all(line is not None for line in lines):
        # affine costs: only the upper envelope of the (alpha, beta) lines can be the slowest group
        # (a data-parallel layout at 65,536 devices has thousands of groups, a few distinct lines)
        kept = [
            (a, b)
            for a, b in set(lines)
            if not any(a2 >= a and b2 >= b and (a2, b2) != (a, b) for a2, b2 in set(lines))
        ]
        return lambda comm: max(comm.count * (a + b * comm.nbytes) for a, b in kept) if comm.nbytes > 0 else 0.0
    fns = [collective_fn(kind, cluster, g) for g in distinct]
    return lambda comm: max((comm.count * f(comm.nbytes) for f in fns), default=0.0)
