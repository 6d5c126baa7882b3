"""Link contention: the rate of each of a set of flows that run at the same time.

Equal-share model. Every flow is a directed transfer along its route; the load of an arc (one
direction of a link) is the number of concurrent flows crossing it. A flow's rate is

    rate_f = min( min_{a in route(f)} capacity_a / load_a ,  cap_f )        [bytes/s]

with ``cap_f`` the route's measured bandwidth (infinite when not measured). Loads are static:
a flow that finishes early does not hand its share to the others (conservative next to
max-min fairness, exact when the flows are symmetric, as in the rings of one collective).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from nest_fx.cluster.topology.routing import Route, Router


def arc_loads(routes: Sequence[Route]) -> Dict[int, int]:
    """Number of routes crossing each arc id."""
    load: Dict[int, int] = {}
    for r in routes:
        for a in r.arcs:
            load[a] = load.get(a, 0) + 1
    return load


def flow_rates(router: Router, routes: Sequence[Route]) -> List[float]:
    """Equal-share rate (bytes/s) of each route when all of them run at once."""
    load = arc_loads(routes)
    cap = router.capacity
    return [min(min(cap[a] / load[a] for a in r.arcs), r.cap) for r in routes]


def concurrent_flows(router: Router, pairs: Sequence[Tuple[int, int]]) -> List[Tuple[float, float]]:
    """``(rate bytes/s, latency s)`` of each ``(src, dst)`` flow when all of them run at once."""
    routes = [router.route(s, d) for s, d in pairs]
    return list(zip(flow_rates(router, routes), (r.latency for r in routes)))
