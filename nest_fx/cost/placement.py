"""Device order of a plan: plan rank ``r`` runs on cluster rank ``order[r]``.

A plan lays its stages, replicas and TP ranks on *plan ranks* (``Plan.rank``); its optional
``device_order`` says which cluster rank (device) each plan rank runs on. The cost model works
on plan ranks throughout, so a placed plan is costed on a *view* of the cluster in which rank
``r`` is the cluster's rank ``order[r]``: :func:`placed`.

* a graph topology (:class:`nest_fx.topology.GraphCluster`) has such views natively
  (``with_order``, orders compose);
* a hierarchical :class:`~nest_fx.cluster.Cluster` gets an :class:`OrderedCluster`: the same
  levels, rank sets mapped through the order before the hierarchy is asked where they sit.

Views carry a key in their levels' latencies (:class:`KeyedFloat`): ``step_time``'s collective
memo is keyed on the level figures, and must never serve one order's result for another.
"""
from __future__ import annotations

import hashlib
from typing import List, Optional, Sequence, Tuple

from nest_fx.cluster import Cluster, ClusterError, DeviceSpec, LevelSpan, NetworkLevel


class KeyedFloat(float):
    """A float that compares and hashes together with a key.

    ``step_time.cached_collective`` memoises on ``(num_devices, level figures, ...)``. Views of
    a cluster (a graph topology, another device order) carry their own key in their levels'
    latency this way, so results are never served across them. Arithmetic gives plain floats.
    """

    __slots__ = ("key",)

    def __new__(cls, value: float, key: str) -> "KeyedFloat":
        obj = super().__new__(cls, value)
        obj.key = key
        return obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyedFloat) and other.key == self.key and float(self) == float(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((float(self), self.key))

    def __reduce__(self):
        return (KeyedFloat, (float(self), self.key))

    def __repr__(self) -> str:
        return repr(float(self))


def is_identity(order: Optional[Sequence[int]]) -> bool:
    """Whether ``order`` is absent or maps every rank to itself."""
    return order is None or all(r == d for r, d in enumerate(order))


class OrderedCluster:
    """A hierarchical cluster seen by a plan whose rank ``r`` runs on cluster rank ``order[r]``.

    Exposes what the cost model and the layout tools read (``name``, ``device``,
    ``num_devices``, ``levels``, ``span``, ``levels_spanned``, ``level_index_of_group``); rank
    sets are mapped through the order, then asked of the base cluster.
    """

    def __init__(self, base: Cluster, order: Sequence[int]) -> None:
        if len(order) != base.num_devices or sorted(order) != list(range(base.num_devices)):
            raise ClusterError(f"order: must list each of the {base.num_devices} ranks once, got {list(order)[:8]}...")
        self.base = base
        self.order: Tuple[int, ...] = tuple(int(d) for d in order)
        token = "order:" + hashlib.sha1(repr(self.order).encode()).hexdigest()
        self.levels: List[NetworkLevel] = [NetworkLevel(lv.name, lv.group_size, lv.bandwidth,
                                                        KeyedFloat(lv.latency, token)) for lv in base.levels]
        # step_time's collective memo key: the order and the level figures as they are now
        self.cost_key = f"{token}|{base.num_devices}|" + repr([(lv.group_size, float(lv.bandwidth), float(lv.latency))
                                                              for lv in base.levels])

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def device(self) -> DeviceSpec:
        return self.base.device

    @property
    def num_devices(self) -> int:
        return self.base.num_devices

    def devices_of(self, ranks: Sequence[int]) -> List[int]:
        """The cluster ranks that plan ranks ``ranks`` run on."""
        n = self.num_devices
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
                raise ClusterError(f"rank {r!r} out of range for a cluster of {n} devices")
        return [self.order[r] for r in ranks]

    def span(self, ranks: Sequence[int]) -> List[LevelSpan]:
        """:meth:`Cluster.span` of the cluster ranks ``ranks`` run on."""
        return self.base.span(self.devices_of(ranks))

    def levels_spanned(self, ranks: Sequence[int]) -> List[Tuple[NetworkLevel, int]]:
        """:meth:`Cluster.levels_spanned` of the cluster ranks ``ranks`` run on."""
        return self.base.levels_spanned(self.devices_of(ranks))

    def level_index_of_group(self, ranks: Sequence[int]) -> int:
        """:meth:`Cluster.level_index_of_group` of the cluster ranks ``ranks`` run on."""
        return self.base.level_index_of_group(self.devices_of(ranks))

    def __repr__(self) -> str:
        return f"OrderedCluster({self.base.name}:{self.num_devices}, order={list(self.order[:8])}...)"


def placed(cluster, order: Optional[Sequence[int]]):
    """``cluster`` as a plan with device order ``order`` sees it (``cluster`` itself for the
    identity). Orders compose: on a view with order ``o``, plan rank r runs on ``o[order[r]]``."""
    if is_identity(order):
        return cluster
    if len(order) != cluster.num_devices:
        raise ClusterError(f"device_order: {len(order)} entries for a cluster of {cluster.num_devices} devices")
    if hasattr(cluster, "with_order"):  # a graph topology (nest_fx.topology.GraphCluster)
        return cluster.with_order([cluster.order[r] for r in order])
    if isinstance(cluster, OrderedCluster):
        return OrderedCluster(cluster.base, [cluster.order[r] for r in order])
    return OrderedCluster(cluster, order)
