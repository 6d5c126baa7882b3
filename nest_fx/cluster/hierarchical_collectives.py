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

Sizes are in bytes, results in seconds; no efficiency factor is applied: a level's bandwidth is
the bus bandwidth its collectives reach (nccl-tests' ``busbw``; the DGX presets' levels carry
NCCL's published figures, not the link rates: docs/cluster_format.md). A group of one rank, or
zero bytes, costs 0.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:  # types only: the cluster classes call these formulas
    from nest_fx.cluster.spec import Cluster, LevelSpan, NetworkLevel


Affine = Tuple[float, float]  # (alpha, beta): seconds = alpha + beta * bytes for a buffer of > 0 bytes


def _check_bytes(nbytes: float) -> float:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes: must be a finite number of bytes >= 0, got {nbytes!r}")
    return float(nbytes)


def evaluate(coefficients: Affine, nbytes: float) -> float:
    """Seconds of a collective with these coefficients on ``nbytes`` (0 for an empty buffer)."""
    alpha, beta = coefficients
    return alpha + beta * nbytes if nbytes > 0 else 0.0


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


# Every algorithm below is affine in the buffer size: a sum over levels of latency terms and of
# a share of the buffer over a bandwidth. Each kind gives its (alpha, beta) from the rank set's
# spans, so a group is resolved once and costed at any size (the solver asks for thousands).


def _ring_coefficients(spans: List[LevelSpan]) -> Affine:
    """Reduce-scatter / all-gather: sum over levels of ``ring_pass(f_i, S_i)``, S_0 = S and
    S_{i+1} = S / m_i (see :func:`reduce_scatter`)."""
    alpha = beta = 0.0
    share = 1.0  # S_i / S
    for sp, bw in zip(spans, _path_bandwidths(spans)):
        if sp.fanout > 1:
            alpha += (sp.fanout - 1) * sp.level.latency
            beta += (sp.fanout - 1) / sp.fanout * share / bw
        share = 1.0 / sp.min_ranks
    return alpha, beta


def _all_reduce_coefficients(spans: List[LevelSpan]) -> Affine:
    alpha, beta = _ring_coefficients(spans)
    return 2 * alpha, 2 * beta


def _all_to_all_coefficients(spans: List[LevelSpan]) -> Affine:
    """sum over levels with f_i > 1 of (1 - m_{i-1}/n) S / B_i + (M_i - M_{i-1}) alpha_i."""
    n = spans[-1].max_ranks
    alpha = beta = 0.0
    inner_min, inner_max = 1, 1
    for sp, bw in zip(spans, _path_bandwidths(spans)):
        if sp.fanout > 1:
            alpha += (sp.max_ranks - inner_max) * sp.level.latency
            beta += (1 - inner_min / n) / bw
        inner_min, inner_max = sp.min_ranks, sp.max_ranks
    return alpha, beta


def _broadcast_coefficients(spans: List[LevelSpan]) -> Affine:
    """sum over levels with f > 1 of 2(f-1)/f S/B + (ceil(log2 f) + f - 1) alpha."""
    alpha = beta = 0.0
    for sp, bw in zip(spans, _path_bandwidths(spans)):
        f = sp.fanout
        if f > 1:
            alpha += (math.ceil(math.log2(f)) + f - 1) * sp.level.latency
            beta += 2 * (f - 1) / f / bw
    return alpha, beta


_COEFFICIENTS: Dict[str, Callable[[List[LevelSpan]], Affine]] = {
    "all_reduce": _all_reduce_coefficients,
    "all_gather": _ring_coefficients,
    "reduce_scatter": _ring_coefficients,
    "all_to_all": _all_to_all_coefficients,
    "broadcast": _broadcast_coefficients,
}


def coefficients(kind: str, cluster: Cluster, ranks: Sequence[int]) -> Affine:
    """(alpha, beta) of collective ``kind`` over ``ranks``: ``alpha + beta * S`` seconds for a
    buffer of S > 0 bytes; (0, 0) for a single rank."""
    try:
        fn = _COEFFICIENTS[kind]
    except KeyError:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {sorted(_COEFFICIENTS)}") from None
    spans = cluster.span(ranks)
    return fn(spans) if spans[-1].max_ranks > 1 else (0.0, 0.0)


def p2p_coefficients(cluster: Cluster, src: int, dst: int) -> Affine:
    """(alpha_L, 1 / path_bandwidth(L)) of a send from ``src`` to ``dst``, L the innermost level
    holding both; (0, 0) when ``src == dst``."""
    index = cluster.level_index_of_group(sorted({src, dst}))  # validates both ranks
    if src == dst:
        return 0.0, 0.0
    return cluster.levels[index].latency, 1.0 / path_bandwidth(cluster.levels, index)


def reduce_scatter(cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Hierarchical ring reduce-scatter of an ``nbytes`` buffer (full size; each rank keeps 1/n).

    Innermost level first: level i runs ``ring_pass(f_i, S_i)`` where ``S_0 = S`` and
    ``S_{i+1} = S / m_i``, ``m_i`` the fewest ranks of the set in one level-i group (the shard a
    rank holds after the inner steps; the smallest group gives the largest shard, so unbalanced
    rank sets are charged conservatively). Balanced sets on one level reduce to
    (n-1)/n * S/B + (n-1) alpha. Thakur, Rabenseifner & Gropp 2005.
    """
    return collective_time("reduce_scatter", cluster, ranks, nbytes)


def all_gather(cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Hierarchical ring all-gather producing an ``nbytes`` buffer on every rank (each holds 1/n).

    The mirror image of :func:`reduce_scatter` (outermost level first, on the smallest shards),
    hence the same cost: sum over levels of ``ring_pass(f_i, S_i)``. Thakur et al. 2005.
    """
    return collective_time("all_gather", cluster, ranks, nbytes)


def all_reduce(cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Hierarchical all-reduce of ``nbytes``: reduce-scatter up the levels, all-gather back down.

    Twice :func:`reduce_scatter`; on one level this is the ring all-reduce 2(n-1)/n * S/B +
    2(n-1) alpha, bandwidth-optimal (Patarasuk & Yuan 2009; Thakur et al. 2005). The outermost
    step is an all-reduce of the 1/m shard left by the inner levels.
    """
    return collective_time("all_reduce", cluster, ranks, nbytes)


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
    return collective_time("all_to_all", cluster, ranks, nbytes)


def broadcast(cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Broadcast of ``nbytes`` from one rank, hierarchical from the outermost level down.

    Per level, the long-message algorithm of van de Geijn (binomial scatter + ring all-gather,
    Thakur et al. 2005 sec. 4.1): 2(f-1)/f * S/B + (ceil(log2 f) + f - 1) alpha, summed over
    the levels with fan-out f > 1 (the whole buffer crosses each level once).
    """
    return collective_time("broadcast", cluster, ranks, nbytes)


def p2p(cluster: Cluster, src: int, dst: int, nbytes: float) -> float:
    """Point-to-point send of ``nbytes``: alpha_L + S / path_bandwidth(L), L the innermost level
    holding both ranks (the message crosses L and every level inside it).

    0 when ``src == dst`` or ``nbytes == 0``.
    """
    nbytes = _check_bytes(nbytes)
    return evaluate(p2p_coefficients(cluster, src, dst), nbytes)


COLLECTIVES: Dict[str, Callable[[Cluster, Sequence[int], float], float]] = {
    "all_reduce": all_reduce,
    "all_gather": all_gather,
    "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all,
    "broadcast": broadcast,
}


def collective_time(kind: str, cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Seconds for collective ``kind`` (a key of :data:`COLLECTIVES`) over ``ranks`` on ``nbytes``."""
    nbytes = _check_bytes(nbytes)
    return evaluate(coefficients(kind, cluster, ranks), nbytes)
