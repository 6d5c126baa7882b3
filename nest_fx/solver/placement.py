"""Placements the planner searches: which devices the plan ranks run on.

A plan keeps its TP groups on consecutive plan ranks and strides its DP and pipeline groups over
them (``nest_fx.plan``); a *placement* is a device order that decides which devices those
groups get (``Plan.device_order``: plan rank r on cluster rank ``device_order[r]``). On a
hierarchical cluster only the identity is searched (its levels are uniform, so the named orders
below have no slow link or rail to aim at; the solver's stage-major / replica-major layouts are
its placements). On a graph topology
(:class:`nest_fx.cluster.topology.GraphCluster`) the candidates for plans of TP degree t are the
cluster's own order plus :func:`nest_fx.cluster.topology.candidate_orders` for blocks of t
(node-major, rail-aligned, slow-link-avoiding); the search is exact over (plan, candidate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from nest_fx.cluster.ordered import is_identity
from nest_fx.cluster.protocol import ClusterModel
from nest_fx.cluster.topology import GraphCluster, candidate_orders


@dataclass(frozen=True)
class Placement:
    """A candidate device order and the cluster view it gives."""

    name: str  # e.g. "node-major", "rail-aligned/tp4", "identity"
    device_order: Optional[Tuple[int, ...]]  # plan rank r on cluster rank device_order[r]; None = identity
    cluster: object  # the cluster as plans with this order see it (``cost.placement.placed``)


def placements(
    cluster: ClusterModel, tp_degrees: Iterable[int], search: bool = True
) -> Tuple[List[Placement], Dict[int, List[int]]]:
    """(candidate placements, indices of the candidates for each TP degree).

    Index 0 is always the cluster's own order (the identity ``device_order``). Without
    ``search``, or on a cluster that is not a graph topology, it is the only candidate.
    Orders that give the same devices are listed once, under the first name found.
    """
    tps = sorted(set(tp_degrees))
    own = Placement("identity", None, cluster)
    if not search or not isinstance(cluster, GraphCluster):
        return [own], {t: [0] for t in tps}
    inverse = [0] * cluster.num_devices
    for rank, device in enumerate(cluster.order):
        inverse[device] = rank
    found: List[Placement] = [own]
    index: Dict[Tuple[int, ...], int] = {}
    by_tp: Dict[int, List[int]] = {}
    for t in tps:
        by_tp[t] = [0]
        for name, perm in candidate_orders(cluster.topology, t).items():
            order = tuple(inverse[d] for d in perm)  # in the cluster's rank numbering
            if is_identity(order):
                if found[0].name == "identity":  # name the cluster's own order after what it is
                    found[0] = Placement(name, None, cluster)
                continue
            if order not in index:
                label = name if name == "node-major" else f"{name}/tp{t}"
                index[order] = len(found)
                found.append(Placement(label, order, cluster.with_order(perm)))
            if index[order] not in by_tp[t]:
                by_tp[t].append(index[order])
    return found, by_tp
