"""``GraphCluster``: a graph topology behind the interface the cost model expects of a Cluster.

The cost model (``nest_fx.cost.step_time``) and the solvers read ``name``, ``device``,
``num_devices`` and ``levels`` (``levels[0].group_size`` is the node size that bounds TP), and
cost communication through ``nest_fx.cost.collectives.collective_time`` / ``p2p``, which hand
the call to ``cluster.collective_time`` / ``cluster.p2p_time`` when the cluster has them. So
``simulate(plan, workload, GraphCluster(topology))`` costs every collective on the graph.
``span`` / ``levels_spanned`` / ``level_index_of_group`` (read by layout and report tools)
answer from the topology's hierarchy hint, for the devices the ranks run on.

Placement: ``order[r]`` is the device that plan rank ``r`` runs on (identity by default);
:meth:`GraphCluster.with_order` gives the same topology under another permutation, sharing its
route cache and its collective cost curves. Its ``cost_key`` names the topology and the
order, so the cost model's collective memo never mixes orders.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Sequence, Tuple, Union

from nest_fx.cluster.spec import Cluster, DeviceMappedView, NetworkLevel
from nest_fx.cluster.topology import algorithms
from nest_fx.cluster.topology.model import Topology, TopologyError

CURVE_CACHE_LIMIT = 200_000  # (kind, group) curves kept per topology; the cache starts afresh beyond it


class GraphCluster(DeviceMappedView):
    """A :class:`Topology` seen as a cluster (a :class:`~nest_fx.cluster.protocol.ClusterModel`),
    plan rank ``r`` on device ``order[r]``."""

    def __init__(
        self,
        topology: Topology,
        order: Optional[Sequence[int]] = None,
        *,
        all_to_all: str = "staged",
        _curves: Optional[Dict[tuple, algorithms.CostCurve]] = None,
    ) -> None:
        if not isinstance(topology, Topology):
            raise TopologyError(f"topology: must be a Topology, got {type(topology).__name__}")
        n = topology.num_devices
        perm = tuple(range(n)) if order is None else tuple(topology.check_devices(order, "order"))
        if len(perm) != n:
            raise TopologyError(f"order: must list each of the {n} devices once, got {len(perm)} entries")
        if all_to_all not in algorithms.ALL_TO_ALL:
            raise TopologyError(f"all_to_all: {all_to_all!r}, use one of {algorithms.ALL_TO_ALL}")
        self.topology = topology
        self.name, self.device, self.num_devices = topology.name, topology.device, n
        self.order: Tuple[int, ...] = perm
        self.all_to_all = all_to_all
        digest = hashlib.sha1(f"{topology.fingerprint()}|{perm}|{all_to_all}".encode()).hexdigest()
        self.cache_token: str = f"graph:{digest}"
        self.cost_key: str = self.cache_token  # the collective memo's key (the view is immutable)
        self.levels: List[NetworkLevel] = topology.hierarchy()
        self._hierarchy: Optional[Cluster] = None
        # cost curves per (kind, devices), shared by every order of this topology (with_order)
        self._curves: Dict[tuple, algorithms.CostCurve] = {} if _curves is None else _curves

    # -- the ClusterModel interface used by the cost model ------------------------------------
    def devices_of(self, ranks: Sequence[int]) -> List[int]:
        """The devices plan ranks run on (TopologyError for a rank out of range or repeated)."""
        return [self.order[r] for r in self.topology.check_devices(ranks, "ranks")]

    def collective_time(self, kind: str, ranks: Sequence[int], nbytes: float) -> float:
        """Seconds of collective ``kind`` over plan ranks ``ranks`` on the graph (the group's
        :class:`~nest_fx.cluster.topology.algorithms.CostCurve` is built once and kept)."""
        devices = tuple(self.devices_of(ranks))
        curve = self._curves.get((kind, devices))
        if curve is None:
            if len(self._curves) >= CURVE_CACHE_LIMIT:
                self._curves.clear()
            curve = self._curves[(kind, devices)] = algorithms.collective_curve(
                kind, self.topology, devices, all_to_all=self.all_to_all
            )
        return curve(nbytes)

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds of a send of ``nbytes`` from plan rank ``src`` to plan rank ``dst``."""
        if src == dst:
            self.devices_of([src])
            return algorithms.p2p_time(self.topology, src, src, nbytes)
        a, b = self.devices_of([src, dst])
        return algorithms.p2p_time(self.topology, a, b, nbytes)

    def collective_coefficients(self, kind: str, ranks: Sequence[int]) -> None:
        """None: on a graph the cost is piecewise linear in the size (the cheapest algorithm
        changes with it), not one affine function; ask :meth:`collective_time` per size."""
        return None

    def p2p_coefficients(self, src: int, dst: int) -> None:
        """None: see :meth:`collective_coefficients`."""
        return None

    def concurrent_collective_time(
        self, kind: str, groups: Sequence[Sequence[int]], nbytes: Union[float, Sequence[float]]
    ) -> float:
        """Seconds until the last of ``groups`` (plan ranks) finishes ``kind``, all started at once."""
        return algorithms.concurrent_collective_time(
            kind, self.topology, [self.devices_of(g) for g in groups], nbytes, all_to_all=self.all_to_all
        )

    # -- the hierarchy hint's view (for reports and layout tools; costs come from the graph) --
    @property
    def hierarchy(self) -> Cluster:
        """The topology's levels hint as a plain Cluster (over devices, not plan ranks)."""
        if self._hierarchy is None:
            self._hierarchy = Cluster(self.name, self.device, self.num_devices, self.topology.hierarchy())
        return self._hierarchy

    def device_hierarchy(self) -> Cluster:
        """The hierarchy hint: ``span`` and co. place the devices ranks run on on its levels."""
        return self.hierarchy

    # -- placement -------------------------------------------------------------------------
    def with_order(self, order: Sequence[int]) -> "GraphCluster":
        """The same topology with plan rank ``r`` on device ``order[r]``."""
        return GraphCluster(self.topology, order, all_to_all=self.all_to_all, _curves=self._curves)

    def __repr__(self) -> str:
        ident = self.order == tuple(range(self.num_devices))
        return f"GraphCluster({self.topology!r}, order={'identity' if ident else list(self.order)})"
