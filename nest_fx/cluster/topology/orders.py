"""Candidate device orders (placements) for a graph topology.

An order is a permutation ``perm`` of the devices: plan rank ``r`` runs on device ``perm[r]``
(:meth:`nest_fx.cluster.topology.graph_cluster.GraphCluster.with_order`). Plans keep their innermost groups
(TP, of ``block`` ranks) on consecutive ranks and stride their DP groups over blocks, so an
order decides which devices share the heavy TP traffic and which the DP rings. A planner
evaluates a plan under each candidate and keeps the cheapest.

Islands are the devices joined by their fastest links (:func:`~nest_fx.cluster.topology.model.device_islands`,
e.g. one NVLink domain).
"""

from __future__ import annotations

from typing import Dict, List, Optional

from nest_fx.cluster.topology.routing import router_of
from nest_fx.cluster.topology.model import Topology, TopologyError, device_islands

GREEDY_WINDOW = 32  # partners considered per pick: keeps the greedy O(devices * window * block)


def node_major_order(topo: Topology) -> List[int]:
    """Island after island, devices ascending inside: TP blocks stay inside an island."""
    return [d for island in device_islands(topo) for d in island]


def rail_aligned_order(topo: Topology, block: int) -> Optional[List[int]]:
    """Consecutive blocks of ``block`` ranks go to successive islands, at the same slot.

    Block q lands on island ``q mod I`` at positions ``(q div I) * block ..``, so the DP
    neighbours of a rank (the same position in the next block) sit at the same index of the
    next island: on a rail-optimized network, on the same rail. None when the islands differ in
    size or ``block`` does not divide it.
    """
    islands = device_islands(topo)
    size = len(islands[0])
    if any(len(isl) != size for isl in islands) or size % block:
        return None
    order = []
    for q in range(topo.num_devices // block):
        island, slot = islands[q % len(islands)], q // len(islands)
        order.extend(island[slot * block : (slot + 1) * block])
    return order


def _pair_bandwidth(topo: Topology, u: int, v: int) -> float:
    return min(router_of(topo).route(u, v).bandwidth, router_of(topo).route(v, u).bandwidth)


def slow_link_avoiding_order(topo: Topology, block: int) -> List[int]:
    """Inside each island, blocks of ``block`` devices chosen greedily to avoid slow pairs.

    A block starts at the lowest remaining device and repeatedly adds the remaining device
    whose slowest route to the block's members (alone, measured caps included) is fastest;
    ties go to the lower device. Candidates are the next :data:`GREEDY_WINDOW` remaining
    devices of the island.
    """
    order: List[int] = []
    for island in device_islands(topo):
        remaining = list(island)
        while remaining:
            chosen = [remaining.pop(0)]
            while len(chosen) < block and remaining:
                window = remaining[:GREEDY_WINDOW]
                best = max(window, key=lambda v: (min(_pair_bandwidth(topo, u, v) for u in chosen), -v))
                remaining.remove(best)
                chosen.append(best)
            order.extend(chosen)
    return order


def candidate_orders(topo: Topology, block: int = 1) -> Dict[str, List[int]]:
    """Named candidate orders for plans whose innermost groups have ``block`` ranks (the TP
    degree): ``node-major``, ``rail-aligned`` (when it applies) and ``slow-link-avoiding``.
    Orders equal to an earlier one are left out."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise TopologyError(f"block: must be an integer >= 1, got {block!r}")
    found: Dict[str, List[int]] = {}
    for name, order in (
        ("node-major", node_major_order(topo)),
        ("rail-aligned", rail_aligned_order(topo, block)),
        ("slow-link-avoiding", slow_link_avoiding_order(topo, block)),
    ):
        if order is not None and order not in found.values():
            found[name] = order
    return found
