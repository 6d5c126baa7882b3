"""Device order of a plan: plan rank ``r`` runs on cluster rank ``order[r]``.

A plan lays its stages, replicas and TP ranks on *plan ranks* (``Plan.rank``); its optional
``device_order`` says which cluster rank (device) each plan rank runs on. The cost model works
on plan ranks throughout, so a placed plan is costed on a *view* of the cluster in which rank
``r`` is the cluster's rank ``order[r]``: :func:`placed`.

* a graph topology (:class:`nest_fx.cluster.topology.GraphCluster`) has such views natively
  (``with_order``, orders compose);
* a hierarchical :class:`~nest_fx.cluster.Cluster` gets an :class:`OrderedCluster`: the same
  levels, rank sets mapped through the order before the hierarchy is asked where they sit.

Both are :class:`~nest_fx.cluster.protocol.ClusterModel` s whose ``cost_key`` names the order,
so the cost model's collective memo never serves one order's result for another.
"""

from __future__ import annotations

import hashlib
from typing import List, Optional, Sequence, Tuple

from nest_fx.cluster import hierarchical_collectives
from nest_fx.cluster.errors import ClusterError
from nest_fx.cluster.protocol import ClusterModel
from nest_fx.cluster.spec import Cluster, DeviceMappedView, NetworkLevel
from nest_fx.cluster.topology.graph_cluster import GraphCluster


def is_identity(order: Optional[Sequence[int]]) -> bool:
    """Whether ``order`` is absent or maps every rank to itself."""
    return order is None or all(r == d for r, d in enumerate(order))


class OrderedCluster(DeviceMappedView):
    """A hierarchical cluster seen by a plan whose rank ``r`` runs on cluster rank ``order[r]``.

    A :class:`~nest_fx.cluster.protocol.ClusterModel`: rank sets are mapped through the order,
    then asked of the base cluster (its levels, its collective formulas).
    """

    def __init__(self, base: Cluster, order: Sequence[int]) -> None:
        if len(order) != base.num_devices or sorted(order) != list(range(base.num_devices)):
            raise ClusterError(f"order: must list each of the {base.num_devices} ranks once, got {list(order)[:8]}...")
        self.base = base
        self.order: Tuple[int, ...] = tuple(int(d) for d in order)
        self.name, self.device, self.num_devices = base.name, base.device, base.num_devices
        self.levels: List[NetworkLevel] = list(base.levels)
        self._token = "order:" + hashlib.sha1(repr(self.order).encode()).hexdigest()

    @property
    def cost_key(self) -> str:
        """The base cluster's key (its figures as they are now) and the order."""
        return f"{self._token}|{self.base.cost_key}"

    def devices_of(self, ranks: Sequence[int]) -> List[int]:
        """The cluster ranks that plan ranks ``ranks`` run on."""
        n = self.num_devices
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
                raise ClusterError(f"rank {r!r} out of range for a cluster of {n} devices")
        return [self.order[r] for r in ranks]

    def device_hierarchy(self) -> Cluster:
        """The base cluster: ``span`` and co. place the mapped ranks on its levels."""
        return self.base

    def collective_time(self, kind: str, ranks: Sequence[int], nbytes: float) -> float:
        """:meth:`Cluster.collective_time` of the cluster ranks ``ranks`` run on."""
        return hierarchical_collectives.collective_time(kind, self, ranks, nbytes)

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        """:meth:`Cluster.p2p_time` between the cluster ranks ``src`` and ``dst`` run on."""
        return hierarchical_collectives.p2p(self, src, dst, nbytes)

    def collective_coefficients(self, kind: str, ranks: Sequence[int]) -> Tuple[float, float]:
        """:meth:`Cluster.collective_coefficients` of the cluster ranks ``ranks`` run on."""
        return hierarchical_collectives.coefficients(kind, self, ranks)

    def p2p_coefficients(self, src: int, dst: int) -> Tuple[float, float]:
        """:meth:`Cluster.p2p_coefficients` between the cluster ranks ``src`` and ``dst`` run on."""
        return hierarchical_collectives.p2p_coefficients(self, src, dst)

    def __repr__(self) -> str:
        return f"OrderedCluster({self.base.name}:{self.num_devices}, order={list(self.order[:8])}...)"


def placed(cluster: ClusterModel, order: Optional[Sequence[int]]) -> ClusterModel:
    """``cluster`` as a plan with device order ``order`` sees it (``cluster`` itself for the
    identity). Orders compose: on a view with order ``o``, plan rank r runs on ``o[order[r]]``."""
    if is_identity(order):
        return cluster
    if len(order) != cluster.num_devices:
        raise ClusterError(f"device_order: {len(order)} entries for a cluster of {cluster.num_devices} devices")
    if isinstance(cluster, GraphCluster):
        return cluster.with_order([cluster.order[r] for r in order])
    if isinstance(cluster, OrderedCluster):
        return OrderedCluster(cluster.base, [cluster.order[r] for r in order])
    if isinstance(cluster, Cluster):
        return OrderedCluster(cluster, order)
    raise ClusterError(
        f"device_order: cannot place a plan on a {type(cluster).__name__}; expected a Cluster, "
        "an OrderedCluster or a GraphCluster"
    )
