"""Per-pair calibration: measured p2p bandwidth and latency written into a topology.

Measurements are ``{(src, dst): (bandwidth bytes/s, latency s)}`` for ordered device pairs, as
a p2p benchmark between ranks reports them. Two ways to use them:

* with a ``base`` topology (the structure is known): each measured pair derates its route.
  The route keeps its links (so it still shares them with other flows) but its rate is capped
  at the measured bandwidth and its latency is the measured one. A measurement above what the
  links allow changes nothing but the latency: the links still bind.
* without a base: a topology of direct links, one per measured unordered pair, with the slower
  of the two directions' bandwidth and the larger latency. Pairs never measured have no route.

A measurement given for ``(i, j)`` only is also used for ``(j, i)``. Save the result with
:func:`nest_fx.cluster.topology.fileformat.save_topology`; the ``measured`` table is part of the file.
"""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional, Tuple

from nest_fx.cluster.spec import DeviceSpec
from nest_fx.cluster.topology.routing import router_of
from nest_fx.cluster.topology.model import Figures, Link, Pair, Topology, TopologyError

Measurements = Mapping[Pair, Figures]


def _symmetric(measurements: Measurements) -> Dict[Pair, Figures]:
    out: Dict[Pair, Figures] = {}
    for key, figs in measurements.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TopologyError(f"measurements[{key!r}]: the key must be a (src, dst) pair of device numbers")
        out[key] = figs
    for (i, j), figs in list(out.items()):
        out.setdefault((j, i), figs)
    return out


def calibrate(
    measurements: Measurements,
    base: Optional[Topology] = None,
    *,
    device: Optional[DeviceSpec] = None,
    name: Optional[str] = None,
) -> Topology:
    """A topology carrying ``measurements`` (see module docstring). Without ``base``, ``device``
    is required and the devices are ``0 .. max measured device``."""
    if not measurements:
        raise TopologyError("measurements: empty; expected {(src, dst): (bandwidth, latency)}")
    table = _symmetric(measurements)
    if base is not None:
        return base.with_measured(table, name=name or f"{base.name}+measured")
    if device is None:
        raise TopologyError("device: a topology built from measurements alone needs the device spec")
    try:
        n = 1 + max(max(pair) for pair in table)
    except TypeError:  # a non-numeric device in a key; Topology names it precisely
        n = 1
    links = []
    for (i, j), (bw, lat) in sorted(table.items()):
        if i < j:
            back_bw, back_lat = table[(j, i)]
            links.append(Link(i, j, min(bw, back_bw), max(lat, back_lat)))
    return Topology(name or "measured", device, n, [], links)


def pairwise_figures(topo: Topology, pairs: Optional[Iterable[Pair]] = None) -> Dict[Pair, Tuple[float, float]]:
    """What a p2p benchmark would measure on ``topo``: ``(bandwidth, latency)`` of each route
    alone, for ``pairs`` (default: every ordered pair of distinct devices)."""
    if pairs is None:
        pairs = [(i, j) for i in range(topo.num_devices) for j in range(topo.num_devices) if i != j]
    out = {}
    for i, j in pairs:
        route = router_of(topo).route(*topo.check_devices([i, j], "pairs"))
        out[(i, j)] = (route.bandwidth, route.latency)
    return out
