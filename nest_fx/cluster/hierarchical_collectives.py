"""Collective communication times on a hierarchical cluster (alpha-beta model, SI units).

The network model of :class:`~nest_fx.cluster.Cluster` and its placed views; graph
topologies have their own (``nest_fx.cluster.topology.algorithms``). The cost model asks
through ``cluster.collective_time`` / ``cluster.p2p_time`` (``nest_fx.cost.collectives``).

Within one network level with per-device bandwidth ``B`` (bytes/s per direction) and latency
``alpha`` (s), ``n`` participants use the ring algorithms (Thakur, Rabenseifner & Gropp 2005,
"Optimization of Collective Communication Operations in MPICH"; the ring all-reduce is
bandwidth-optimal, Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for
clusters of workstations"):

    reduce-scatter / all-gather   (n-1)/n * S/B + (n-1) * alpha      S = full (unsharded) buffer
    all-reduce                  2 (n-1)/n * S/B + 2(n-1) * alpha     (= reduce-scatter + all-gather)
    all-to-all                    (n-1)/n * S/B + (n-1) * alpha      S = per-rank send buffer
    broadcast                   2 (n-1)/n * S/B + (ceil(log2 n) + n-1) * alpha
                                                                    (scatter + ring all-gather)

Across levels the algorithms are hierarchical, one step per level the rank set spans, each with
that level's fan-out ``f_i`` (:meth:`nest_fx.cluster.Cluster.span`) and latency.

**Paths.** A message that crosses level ``i`` also traverses every inner level on its way out of
its device and into the peer (a GPU's NIC traffic leaves through the node's fabric; a cross-spine
message goes through the leaf), so its bandwidth is the slowest on the path:
``path_bandwidth(levels, i) = min(B_0, ..., B_i)`` (:func:`path_bandwidth`). Every step of a
collective that crosses level ``i`` and every point-to-point transfer whose innermost common level
is ``i`` is charged at that bandwidth. A level's ``latency`` is the start-up of one message across
it, path included (how the presets and a calibration give it), so latencies are not summed.

Sizes are in bytes, results in seconds; no efficiency factor is applied (the figures are ideal
link rates). A group of one rank, or zero bytes, costs 0.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

if TYPE_CHECKING:  # types only: the cluster classes call these formulas
    from nest_fx.cluster.spec import Cluster, LevelSpan, NetworkLevel


def _check_bytes(nbytes: float) -> float:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes: must be a finite number of bytes >= 0, got {nbytes!r}")
    return float(nbytes)


def _spans(cluster: Cluster, ranks: Sequence[int], nbytes: float) -> List[LevelSpan]:
    """The rank set's per-level spans, or [] when the collective is free (one rank or 0 bytes)."""
    nbytes = _check_bytes(nbytes)
    spans = cluster.span(ranks)
    return spans if nbytes > 0 and spans[-1].max_ranks > 1 else []


def path_bandwidth(levels: Sequence[NetworkLevel], index: int) -> float:
    """Bytes/s of a transfer that crosses level ``index``: the slowest level on its path,
    ``min(levels[0..index].bandwidth)`` (see the module docstring)."""
    return min(lv.bandwidth for lv in levels[: index + 1])


def _path_bandwidths(spans: List[LevelSpan]) -> List[float]:
    """:func:`path_bandwidth` of each spanned level (spans list levels 0, 1, ... in order)."""
    out: List[float] = []
    for sp in spans:
        out.append(min(out[-1], sp.level.bandwidth) if out else sp.level.bandwidth)
    return out


def ring_pass(n: int, nbytes: float, level: NetworkLevel, bandwidth: Optional[float] = None) -> float:
    """One ring reduce-scatter or all-gather of an ``nbytes`` buffer among ``n`` devices of one level:
    (n-1)/n * S/B + (n-1) * alpha (Thakur, Rabenseifner & Gropp 2005). 0 when n <= 1. ``bandwidth``:
    the path's (:func:`path_bandwidth`; default the level's own)."""
    if n <= 1:
        return 0.0
    bw = level.bandwidth if bandwidth is None else bandwidth
    return (n - 1) / n * nbytes / bw + (n - 1) * level.latency


def reduce_scatter(cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Hierarchical ring reduce-scatter of an ``nbytes`` buffer (full size; each rank keeps 1/n).

    Innermost level first: level i runs ``ring_pass(f_i, S_i)`` where ``S_0 = S`` and
    ``S_{i+1} = S / m_i``, ``m_i`` the fewest ranks of the set in one level-i group (the shard a
    rank holds after the inner steps; the smallest group gives the largest shard, so unbalanced
    rank sets are charged conservatively). Balanced sets on one level reduce to
    (n-1)/n * S/B + (n-1) alpha. Thakur, Rabenseifner & Gropp 2005.
    """
    return _hierarchical_passes(_spans(cluster, ranks, nbytes), float(nbytes))


def all_gather(cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Hierarchical ring all-gather producing an ``nbytes`` buffer on every rank (each holds 1/n).

    The mirror image of :func:`reduce_scatter` (outermost level first, on the smallest shards),
    hence the same cost: sum over levels of ``ring_pass(f_i, S_i)``. Thakur et al. 2005.
    """
    return _hierarchical_passes(_spans(cluster, ranks, nbytes), float(nbytes))


def all_reduce(cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Hierarchical all-reduce of ``nbytes``: reduce-scatter up the levels, all-gather back down.

    Equals :func:`reduce_scatter` + :func:`all_gather`; on one level this is the ring all-reduce
    2(n-1)/n * S/B + 2(n-1) alpha, bandwidth-optimal (Patarasuk & Yuan 2009; Thakur et al. 2005).
    The outermost step is an all-reduce of the 1/m shard left by the inner levels.
    """
    return reduce_scatter(cluster, ranks, nbytes) + all_gather(cluster, ranks, nbytes)


def _hierarchical_passes(spans: List[LevelSpan], nbytes: float) -> float:
    total, shard = 0.0, nbytes
    for sp, bw in zip(spans, _path_bandwidths(spans)):
        total += ring_pass(sp.fanout, shard, sp.level, bw)
        shard = nbytes / sp.min_ranks
    return total


def all_to_all(cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """All-to-all where each of the n ranks sends ``nbytes`` in total (nbytes/n to every rank).

    On one level: (n-1)/n * S/B + (n-1) alpha (pairwise exchange, Thakur et al. 2005). Across
    levels, at each level i where the set fans out (f_i > 1) the data leaving a rank's
    level-(i-1) group must cross level i:

        T = sum_i [ (1 - m_{i-1}/n) * S / B_i + (M_i - M_{i-1}) * alpha_i ]

    with ``m_{i-1}`` the fewest ranks of the set in one level-(i-1) group (``m_{-1} = 1``) and
    ``M_i`` the most ranks in one level-i group (``M_{-1} = 1``; ``M_i - M_{i-1}`` peers are
    reached through level i). Charging the crossing traffic at every level and summing (rather
    than taking the max over levels, which assumes perfect overlap of the levels) is the
    conservative choice; data bound for a far level is also charged at the inner ones.
    """
    spans = _spans(cluster, ranks, nbytes)
    if not spans:
        return 0.0
    n = spans[-1].max_ranks
    total, inner_min, inner_max = 0.0, 1, 1
    for sp, bw in zip(spans, _path_bandwidths(spans)):
        if sp.fanout > 1:
            total += (1 - inner_min / n) * nbytes / bw + (sp.max_ranks - inner_max) * sp.level.latency
        inner_min, inner_max = sp.min_ranks, sp.max_ranks
    return total


def broadcast(cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Broadcast of ``nbytes`` from one rank, hierarchical from the outermost level down.

    Per level, the long-message algorithm of van de Geijn (binomial scatter + ring all-gather,
    Thakur et al. 2005 sec. 4.1): 2(f-1)/f * S/B + (ceil(log2 f) + f - 1) alpha, summed over
    the levels with fan-out f > 1 (the whole buffer crosses each level once).
    """
    total = 0.0
    spans = _spans(cluster, ranks, nbytes)
    for sp, bw in zip(spans, _path_bandwidths(spans)):
        f = sp.fanout
        if f > 1:
            steps = math.ceil(math.log2(f)) + f - 1
            total += 2 * (f - 1) / f * nbytes / bw + steps * sp.level.latency
    return total


def p2p(cluster: Cluster, src: int, dst: int, nbytes: float) -> float:
    """Point-to-point send of ``nbytes``: alpha_L + S / path_bandwidth(L), L the innermost level
    holding both ranks (the message crosses L and every level inside it).

    0 when ``src == dst`` or ``nbytes == 0``.
    """
    nbytes = _check_bytes(nbytes)
    index = cluster.level_index_of_group(sorted({src, dst}))  # validates both ranks
    if src == dst or nbytes == 0:
        return 0.0
    return cluster.levels[index].latency + nbytes / path_bandwidth(cluster.levels, index)


COLLECTIVES: Dict[str, Callable[[Cluster, Sequence[int], float], float]] = {
    "all_reduce": all_reduce,
    "all_gather": all_gather,
    "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all,
    "broadcast": broadcast,
}


def collective_time(kind: str, cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Seconds for collective ``kind`` (a key of :data:`COLLECTIVES`) over ``ranks`` on ``nbytes``."""
    try:
        fn = COLLECTIVES[kind]
    except KeyError:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {sorted(COLLECTIVES)}") from None
    return fn(cluster, ranks, nbytes)
