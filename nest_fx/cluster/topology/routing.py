"""Deterministic routes between devices of a :class:`~nest_fx.cluster.topology.model.Topology`, cached.

A route is a least-``weight`` path (fewest hops with the default weight 1) whose intermediate
nodes all forward traffic (switches, and devices only under ``device_forwarding``). There is
no ECMP hashing: when several least-weight next hops exist, the route to device ``t`` takes the
``(h mod k)``-th of the ``k`` candidates (in link order), with ``h`` the port index of ``t`` on
the switch the route enters it from (``t`` itself when that last hop is not a switch) at the
first choice and ``h //= k`` after each choice. This is D-mod-k routing (Zahavi et al.,
"Optimized InfiniBand fat-tree routing for shift all-to-all communication patterns", 2010)
with host addresses numbered per switch port: traffic to the hosts of one switch spreads over
the parallel uplinks, traffic to one destination converges.

Each direction of a link is an *arc* with an integer id; :attr:`Router.capacity` holds its
bandwidth (bytes/s). A route knows its arcs, its latency (sum of link latencies, or the
measured one) and its bandwidth alone (bottleneck arc, capped by a measured bandwidth).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from nest_fx.cluster.topology.model import Node, Topology, TopologyError

_MAX_CACHED = 2_000_000  # ~N^2 routes for an all-to-all over N devices; bounds the memory
_MAX_TABLES = 4096  # per-destination distance tables (one entry per switch each)


class Route(NamedTuple):
    """A directed route between two devices."""

    src: int
    dst: int
    nodes: Tuple[Node, ...]  # src, the switches (or relaying devices) crossed, dst
    arcs: Tuple[int, ...]  # arc ids, in path order
    latency: float  # s
    bandwidth: float  # bytes/s with no other traffic: min(bottleneck arc, cap)
    cap: float  # measured bandwidth cap (inf when not measured)


class Router:
    """Route cache of one topology (use :func:`router_of`)."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.capacity: List[float] = []
        self._arc: Dict[Tuple[Node, Node], int] = {}
        self._arc_latency: List[float] = []
        self._adj: Dict[Node, List[Tuple[Node, float]]] = {n: [] for n in topo.graph.nodes}
        for link in topo.links:
            for u, v in ((link.a, link.b), (link.b, link.a)):
                self._arc[(u, v)] = len(self.capacity)
                self.capacity.append(link.bandwidth)
                self._arc_latency.append(link.latency)
                self._adj[u].append((v, link.weight))
        self._relay_adj = {u: [(v, w) for v, w in nbrs if topo.forwards(v)] for u, nbrs in self._adj.items()}
        self._weight = {u: dict(nbrs) for u, nbrs in self._adj.items()}
        self._port = {
            s: {v: i for i, v in enumerate(v for v, _ in self._adj[s] if isinstance(v, int))} for s in topo.switches
        }
        self._from_relay: Dict[Node, Dict[Node, float]] = {}
        self._to_device: Dict[int, Dict[Node, float]] = {}
        self._cache: Dict[Tuple[int, int], Route] = {}

    def route(self, src: int, dst: int) -> Route:
        """The route from device ``src`` to device ``dst`` (``src != dst``); TopologyError if none."""
        key = (src, dst)
        r = self._cache.get(key)
        if r is None:
            if len(self._cache) >= _MAX_CACHED:
                self._cache.clear()
            r = self._cache[key] = self._build(src, dst)
        return r

    def _build(self, src: int, dst: int) -> Route:
        path = self._path(src, dst)
        arcs = tuple(self._arc[(u, v)] for u, v in zip(path, path[1:]))
        bottleneck = min(self.capacity[a] for a in arcs)
        measured = self.topo.measured.get((src, dst))
        if measured is None:
            return Route(src, dst, tuple(path), arcs, sum(self._arc_latency[a] for a in arcs), bottleneck, math.inf)
        cap, latency = measured
        return Route(src, dst, tuple(path), arcs, latency, min(bottleneck, cap), cap)

    def _relay_distances(self, origin: Node, stop: Optional[Node] = None) -> Dict[Node, float]:
        """Least-weight distances from ``origin`` (Dijkstra), expanding forwarding nodes only.

        With ``stop`` (a device), the search also enters ``stop`` from any neighbour and ends
        once it is settled; every node on a least-weight origin-stop path is settled by then.
        """
        settled: Dict[Node, float] = {}
        best: Dict[Node, float] = {origin: 0.0}
        heap: List[Tuple[float, int, Node]] = [(0.0, 0, origin)]
        tick = 1
        stop_weight = self._weight[stop] if stop is not None else {}
        while heap:
            d, _, u = heapq.heappop(heap)
            if u in settled:
                continue
            settled[u] = d
            if u == stop or (u != origin and not self.topo.forwards(u)):
                if u == stop:
                    break
                continue
            steps = self._relay_adj[u]
            if u in stop_weight:
                steps = steps + [(stop, stop_weight[u])]
            for v, w in steps:
                nd = d + w
                if v not in settled and nd < best.get(v, math.inf):
                    best[v] = nd
                    heapq.heappush(heap, (nd, tick, v))
                    tick += 1
        return settled

    def _distance_to(self, src: int, dst: int) -> Callable[[Node], float]:
        """Least-weight distance to ``dst`` from ``src`` and from forwarding nodes (inf if none).

        Switch networks: a table per ``dst`` from the distances of its forwarding neighbours, each
        computed once over the (small) switch graph. Relaying devices (tori): a search from
        ``dst`` that stops at ``src`` (a full search per device would cost O(devices) each).
        """
        if self.topo.forwards(dst):
            settled = self._relay_distances(dst, stop=src)
            return lambda v: settled.get(v, math.inf)
        table = self._to_device.get(dst)
        if table is None:
            table = {}
            for b, w in self._relay_adj[dst]:
                from_b = self._from_relay.get(b)
                if from_b is None:
                    from_b = self._from_relay[b] = self._relay_distances(b)
                for v, d in from_b.items():
                    if d + w < table.get(v, math.inf):
                        table[v] = d + w
            if len(self._to_device) >= _MAX_TABLES:
                self._to_device.clear()
            self._to_device[dst] = table
        return lambda v: table.get(v, math.inf)

    def _walk(self, src: int, dst: int, dist: Callable[[Node], float], h: int) -> List[Node]:
        """Follow least-weight next hops from ``src``; the k-way choices consume ``h`` (D-mod-k)."""
        path: List[Node] = [src]
        u: Node = src
        here = min([w + dist(v) for v, w in self._relay_adj[src]] + [self._weight[src].get(dst, math.inf)])
        if here == math.inf:
            raise TopologyError(
                f"no route from device {src} to device {dst} (devices relay traffic only "
                f"when nodes.device_forwarding is true)"
            )
        while u != dst:
            tol = 1e-9 * max(1.0, here)
            direct = self._weight[u].get(dst)
            if direct is not None and abs(direct - here) <= tol:
                path.append(dst)
                break
            cands = []
            for v, w in self._relay_adj[u]:
                dv = dist(v)
                if abs(dv + w - here) <= tol:
                    cands.append((v, dv))
            u, here = cands[h % len(cands)]
            h //= len(cands)
            path.append(u)
        return path

    def _path(self, src: int, dst: int) -> List[Node]:
        """The route's nodes. D-mod-k's key is the destination's port index on the switch the
        route enters it from (its address on that switch, as consecutive host addresses on a
        leaf would be); ``dst`` itself when the last hop is not a switch."""
        if src == dst:
            raise TopologyError(f"a route needs two different devices, got {src} twice")
        dist = self._distance_to(src, dst)
        path = self._walk(src, dst, dist, dst)
        port = self._port.get(path[-2], {}).get(dst, dst)
        return path if port == dst else self._walk(src, dst, dist, port)


def router_of(topo: Topology) -> Router:
    """The topology's route cache, built on first use and kept on the topology (it is immutable)."""
    if topo._router is None:
        topo._router = Router(topo)
    return topo._router
