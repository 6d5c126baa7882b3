"""A network topology as a graph: devices, switches and full-duplex links.

Nodes are the devices (the integers ``0 .. num_devices-1``, the ranks of an identity
placement) and named switches (strings). A link joins two nodes and is **full duplex**: its
``bandwidth`` (bytes/s) is available in each direction independently, so traffic u->v and
v->u never compete; its ``latency`` (s) is added once per traversal. ``weight`` is the routing
metric (default 1: routes are fewest-hop paths).

Switches always forward traffic. Devices only send and receive, unless ``device_forwarding`` is
set (TPU-style tori, where each chip relays its neighbours' traffic).

Optional extras:

* ``levels``: a hierarchy hint in :class:`~nest_fx.cluster.NetworkLevel` form (device ids
  numbered innermost level first, as in a Cluster). Hierarchical collectives partition a group
  by it; the planner reads its node size. Without one, :meth:`Topology.hierarchy` infers a
  coarse one.
* ``measured``: per ordered device pair ``(src, dst)`` a measured ``(bandwidth, latency)``
  (see :mod:`nest_fx.cluster.topology.calibration`): the route's rate is capped at the measured
  bandwidth and its latency replaced by the measured one.

A Topology is immutable once built (routes are cached on it). See docs/topology.md.
"""

from __future__ import annotations

import hashlib
import math
import operator
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import networkx as nx

from nest_fx.cluster.errors import ClusterError
from nest_fx.cluster.spec import Cluster, DeviceSpec, NetworkLevel

Node = Union[int, str]
Pair = Tuple[int, int]
Figures = Tuple[float, float]  # (bandwidth bytes/s, latency s)


class TopologyError(ClusterError):
    """A malformed topology or an impossible query; the message names the field or the devices.

    A :class:`~nest_fx.cluster.ClusterError` (hence a ``ValueError``), so callers that report
    cluster mistakes report topology mistakes the same way.
    """


class Link(NamedTuple):
    """A full-duplex link: ``bandwidth`` bytes/s per direction, ``latency`` s per traversal."""

    a: Node
    b: Node
    bandwidth: float
    latency: float
    weight: float = 1.0


def _finite(value: object, path: str, *, strict: bool) -> float:
    bound = "> 0" if strict else ">= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TopologyError(f"{path}: must be a finite number {bound}, got {value!r}")
    if value < 0 or (strict and value == 0):
        raise TopologyError(f"{path}: must be {bound}, got {value!r}")
    return float(value)


def _is_device_id(node: object) -> bool:
    return isinstance(node, int) and not isinstance(node, bool)


class Topology:
    """Devices, switches and links (see module docstring); validated on construction."""

    def __init__(
        self,
        name: str,
        device: DeviceSpec,
        num_devices: int,
        switches: Sequence[str],
        links: Iterable[Link],
        *,
        levels: Optional[Sequence[NetworkLevel]] = None,
        device_forwarding: bool = False,
        measured: Optional[Mapping[Pair, Figures]] = None,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise TopologyError(f"name: must be a non-empty string, got {name!r}")
        if not isinstance(device, DeviceSpec):
            raise TopologyError(f"device: must be a DeviceSpec, got {type(device).__name__}")
        if not _is_device_id(num_devices) or num_devices < 1:
            raise TopologyError(f"nodes.devices: must be an integer >= 1, got {num_devices!r}")
        if not isinstance(device_forwarding, bool):
            raise TopologyError(f"nodes.device_forwarding: must be true or false, got {device_forwarding!r}")
        self.name = name
        self.device = device
        self.num_devices = num_devices
        self.device_forwarding = device_forwarding
        self.graph = nx.Graph()
        self.graph.add_nodes_from(range(num_devices), kind="device")
        self._add_switches(list(switches))
        self._links: List[Link] = []
        for i, link in enumerate(links):
            self._add_link(i, Link(*link))
        self._check_attached()
        self.levels: Optional[List[NetworkLevel]] = self._check_levels(levels)
        self.measured: Dict[Pair, Figures] = self._check_measured(measured or {})
        self._router = None  # the route cache, built on first use by routing.router_of
        self._hierarchy: Optional[List[NetworkLevel]] = None
        self._fingerprint: Optional[str] = None

    # -- construction checks --------------------------------------------------------------
    def _add_switches(self, switches: List[str]) -> None:
        for i, s in enumerate(switches):
            if not isinstance(s, str) or not s.strip():
                raise TopologyError(f"nodes.switches[{i}]: must be a non-empty name, got {s!r}")
            if s.strip().lstrip("+-").isdigit():
                raise TopologyError(
                    f"nodes.switches[{i}]: {s!r} looks like a device number; switch names must not be numbers"
                )
            if s in self.graph:
                raise TopologyError(f"nodes.switches[{i}]: duplicate switch name {s!r}")
            self.graph.add_node(s, kind="switch")

    def _check_node(self, node: object, path: str) -> Node:
        try:
            known = node in self.graph and not isinstance(node, bool)
        except TypeError:  # unhashable, e.g. a list
            known = False
        if not known:
            raise TopologyError(
                f"{path}: unknown node {node!r} (devices are 0..{self.num_devices - 1}, "
                f"switches are the names under nodes.switches)"
            )
        return node  # type: ignore[return-value]

    def _add_link(self, i: int, link: Link) -> None:
        a = self._check_node(link.a, f"links[{i}].a")
        b = self._check_node(link.b, f"links[{i}].b")
        if a == b:
            raise TopologyError(f"links[{i}]: a link must join two different nodes, got {a!r} twice")
        if self.graph.has_edge(a, b):
            raise TopologyError(
                f"links[{i}]: a second link between {a!r} and {b!r}; "
                f"merge parallel links into one with the summed bandwidth"
            )
        bw = _finite(link.bandwidth, f"links[{i}].bandwidth", strict=True)
        lat = _finite(link.latency, f"links[{i}].latency", strict=False)
        weight = _finite(link.weight, f"links[{i}].weight", strict=True)
        self.graph.add_edge(a, b, bandwidth=bw, latency=lat, weight=weight)
        self._links.append(Link(a, b, bw, lat, weight))

    def _check_attached(self) -> None:
        lonely = [d for d in range(self.num_devices) if self.graph.degree(d) == 0]
        if lonely:
            raise TopologyError(f"links: device(s) {lonely[:8]} have no link")
        if not nx.is_connected(self.graph):
            parts = sorted(nx.connected_components(self.graph), key=len)
            raise TopologyError(
                f"links: the graph is not connected; e.g. {sorted(map(str, parts[0]))[:8]} are cut off from the rest"
            )

    def _check_levels(self, levels: Optional[Sequence[NetworkLevel]]) -> Optional[List[NetworkLevel]]:
        if levels is None:
            return None
        try:  # a Cluster checks exactly the rules a hierarchy hint must follow
            Cluster(self.name, self.device, self.num_devices, list(levels))
        except ClusterError as exc:
            raise TopologyError(str(exc)) from None
        return list(levels)

    def _check_measured(self, measured: Mapping[Pair, Figures]) -> Dict[Pair, Figures]:
        out: Dict[Pair, Figures] = {}
        for key, figures in measured.items():
            path = f"measured[{key!r}]"
            if not (isinstance(key, tuple) and len(key) == 2 and all(_is_device_id(r) for r in key)):
                raise TopologyError(f"{path}: the key must be a (src, dst) pair of device numbers")
            src, dst = key
            for end, r in (("src", src), ("dst", dst)):
                if not 0 <= r < self.num_devices:
                    raise TopologyError(f"{path}.{end}: {r} is not a device (0..{self.num_devices - 1})")
            if src == dst:
                raise TopologyError(f"{path}: src and dst must differ")
            if not (isinstance(figures, (tuple, list)) and len(figures) == 2):
                raise TopologyError(f"{path}: must be a (bandwidth, latency) pair, got {figures!r}")
            out[(src, dst)] = (
                _finite(figures[0], f"{path}.bandwidth", strict=True),
                _finite(figures[1], f"{path}.latency", strict=False),
            )
        return out

    # -- queries ---------------------------------------------------------------------------
    @property
    def switches(self) -> List[str]:
        """Switch names in the order given."""
        return [n for n, kind in self.graph.nodes(data="kind") if kind == "switch"]

    @property
    def links(self) -> List[Link]:
        """Links in the order given (routing ties are broken in this order)."""
        return list(self._links)

    def forwards(self, node: Node) -> bool:
        """Whether traffic between two other nodes may pass through ``node``."""
        return self.device_forwarding or not _is_device_id(node)

    def check_devices(self, devices: Iterable[object], what: str = "ranks") -> List[int]:
        """The devices as a list of distinct ints in range; TopologyError naming ``what`` otherwise."""
        out: List[int] = []
        for d in devices:
            try:
                if isinstance(d, bool):
                    raise TypeError
                d = operator.index(d)  # accepts numpy integers too
            except TypeError:
                raise TopologyError(f"{what}: {d!r} is not a device number") from None
            if not 0 <= d < self.num_devices:
                raise TopologyError(f"{what}: {d} is not a device of this topology (0..{self.num_devices - 1})")
            out.append(d)
        if len(set(out)) != len(out):
            raise TopologyError(f"{what}: duplicate device(s) in {out}")
        return out

    def hierarchy(self) -> List[NetworkLevel]:
        """The ``levels`` hint, or one inferred from the links (:func:`infer_levels`)."""
        if self._hierarchy is None:
            self._hierarchy = list(self.levels) if self.levels is not None else infer_levels(self)
        return list(self._hierarchy)

    def fingerprint(self) -> str:
        """A digest of everything that affects costs (equal topologies share it)."""
        if self._fingerprint is None:
            d = self.device
            f = float  # files may hold ints where generators hold floats: same figures, same digest
            flops = sorted((k, f(v)) for k, v in d.peak_flops.items())
            parts = [
                self.name,
                d.name,
                repr(f(d.memory_bytes)),
                repr(flops),
                repr(f(d.mem_bandwidth)),
                str(self.num_devices),
                str(self.device_forwarding),
                repr(self.switches),
                repr(self._links),
                repr([(lv.name, lv.group_size, f(lv.bandwidth), f(lv.latency)) for lv in self.levels or []]),
                repr(sorted(self.measured.items())),
            ]
            self._fingerprint = hashlib.sha1("\n".join(parts).encode()).hexdigest()
        return self._fingerprint

    def with_measured(self, measured: Mapping[Pair, Figures], name: Optional[str] = None) -> "Topology":
        """A copy whose ``measured`` table is this one updated with ``measured``."""
        return Topology(
            name or self.name,
            self.device,
            self.num_devices,
            self.switches,
            self._links,
            levels=self.levels,
            device_forwarding=self.device_forwarding,
            measured={**self.measured, **measured},
        )

    def __repr__(self) -> str:
        return (
            f"Topology({self.name!r}, {self.num_devices} devices, {len(self.switches)} switches, "
            f"{len(self._links)} links)"
        )


def device_islands(topo: Topology) -> List[List[int]]:
    """Devices grouped by their fastest link: devices whose fastest link goes to the same switch
    (or that are joined by their fastest links) form one island, e.g. one NVLink domain.

    Islands are sorted by their smallest device; devices inside by number.
    """
    parent = list(range(topo.num_devices))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    by_switch: Dict[str, int] = {}
    for d in range(topo.num_devices):
        best = max(topo.graph[d].items(), key=lambda kv: kv[1]["bandwidth"])[0]
        if _is_device_id(best):
            parent[find(d)] = find(best)
        elif best in by_switch:
            parent[find(d)] = find(by_switch[best])
        else:
            by_switch[best] = d
    groups: Dict[int, List[int]] = {}
    for d in range(topo.num_devices):
        groups.setdefault(find(d), []).append(d)
    return sorted(groups.values(), key=lambda g: g[0])


def infer_levels(topo: Topology) -> List[NetworkLevel]:
    """A coarse hierarchy hint for a topology without one.

    Two levels, ``island`` and ``network``, when the :func:`device_islands` are contiguous
    blocks of one size k (1 < k < num_devices); otherwise a single ``network`` level. The
    figures are rough (island: the slowest device's fastest link; network: the slowest device
    link; latencies twice the largest device-link latency): the graph, not the hint, gives
    costs.
    """
    n = topo.num_devices
    incident = [[data for _, _, data in topo.graph.edges(d, data=True)] for d in range(n)]
    fast = min(max(e["bandwidth"] for e in es) for es in incident)
    slow = min(e["bandwidth"] for es in incident for e in es)
    lat = 2 * max(e["latency"] for es in incident for e in es)
    islands = device_islands(topo)
    k = len(islands[0])
    contiguous = all(isl == list(range(i * k, (i + 1) * k)) for i, isl in enumerate(islands))
    if 1 < k < n and n % k == 0 and contiguous:
        return [NetworkLevel("island", k, fast, lat), NetworkLevel("network", n, slow, lat)]
    return [NetworkLevel("network", n, slow, lat)]
