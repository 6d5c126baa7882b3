"""Reading and writing topology files (``format: nest-fx-topology/1``, YAML or JSON).

The device and the optional ``levels`` hint have the cluster file's schema
(docs/cluster_format.md); quantities may be strings such as ``"300GB/s"`` or ``"5us"``
(:func:`nest_fx.cluster.parse_quantity`). See docs/topology.md for the fields.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import yaml

from nest_fx.cluster.errors import ClusterError
from nest_fx.cluster.quantities import parse_quantity
from nest_fx.cluster.spec import CLUSTER_FORMAT, Cluster
from nest_fx.common.fileio import read_document
from nest_fx.common.names import close_matches
from nest_fx.cluster.topology.model import Link, Topology, TopologyError

TOPOLOGY_FORMAT = "nest-fx-topology/1"
_TOP = ("format", "name", "device", "nodes", "links")
_TOP_OPTIONAL = ("levels", "measured")


def to_dict(topo: Topology) -> dict:
    """The file form, numbers in SI units; ``weight`` only where it is not 1."""
    out: Dict[str, Any] = {
        "format": TOPOLOGY_FORMAT,
        "name": topo.name,
        "device": topo.device.to_dict(),
        "nodes": {"devices": topo.num_devices, "device_forwarding": topo.device_forwarding, "switches": topo.switches},
        "links": [
            {
                "a": ln.a,
                "b": ln.b,
                "bandwidth": ln.bandwidth,
                "latency": ln.latency,
                **({"weight": ln.weight} if ln.weight != 1.0 else {}),
            }
            for ln in topo.links
        ],
    }
    if topo.levels is not None:
        out["levels"] = [
            {"name": lv.name, "group_size": lv.group_size, "bandwidth": lv.bandwidth, "latency": lv.latency}
            for lv in topo.levels
        ]
    if topo.measured:
        out["measured"] = [
            {"src": s, "dst": t, "bandwidth": bw, "latency": lat} for (s, t), (bw, lat) in sorted(topo.measured.items())
        ]
    return out


def _mapping(data: object, path: str, required: Tuple[str, ...], optional: Tuple[str, ...] = ()) -> dict:
    if not isinstance(data, dict):
        raise TopologyError(f"{path}: expected a mapping with keys {list(required)}, got {type(data).__name__}")
    missing = [k for k in required if k not in data]
    if missing:
        raise TopologyError(f"{path}: missing key(s) {missing}")
    unknown = sorted(set(data) - set(required) - set(optional))
    if unknown:
        raise TopologyError(
            f"{path}: unknown key(s) {unknown}{close_matches(unknown[0], required + optional)}; "
            f"expected {list(required + optional)}"
        )
    return data


def _quantity(value: object, unit: str, path: str) -> float:
    try:
        return parse_quantity(value, unit, path)  # type: ignore[arg-type]
    except ClusterError as exc:
        raise TopologyError(str(exc)) from None


def _list(value: object, path: str) -> list:
    if not isinstance(value, list):
        raise TopologyError(f"{path}: must be a list, got {type(value).__name__}")
    return value


def from_dict(data: object) -> Topology:
    """Build and validate a Topology from the file form; errors name the field path."""
    d = _mapping(data, "topology", _TOP, _TOP_OPTIONAL)
    if d["format"] != TOPOLOGY_FORMAT:
        raise TopologyError(f"format: must be {TOPOLOGY_FORMAT!r}, got {d['format']!r}")
    nodes = _mapping(d["nodes"], "nodes", ("devices", "switches"), ("device_forwarding",))
    n = nodes["devices"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TopologyError(f"nodes.devices: must be an integer >= 1, got {n!r}")
    # The cluster reader checks the device and the levels hint with the same field paths.
    levels = d.get("levels")
    try:
        cluster = Cluster.from_dict(
            {
                "format": CLUSTER_FORMAT,
                "name": d["name"],
                "num_devices": nodes["devices"],
                "device": d["device"],
                "levels": levels
                if levels is not None
                else [{"name": "all", "group_size": nodes["devices"], "bandwidth": 1, "latency": 0}],
            }
        )
    except ClusterError as exc:
        raise TopologyError(str(exc).replace("(num_devices)", "(nodes.devices)")) from None
    links: List[Link] = []
    for i, raw in enumerate(_list(d["links"], "links")):
        ln = _mapping(raw, f"links[{i}]", ("a", "b", "bandwidth", "latency"), ("weight",))
        links.append(
            Link(
                ln["a"],
                ln["b"],
                _quantity(ln["bandwidth"], "B/s", f"links[{i}].bandwidth"),
                _quantity(ln["latency"], "s", f"links[{i}].latency"),
                ln.get("weight", 1.0),
            )
        )
    measured = {}
    for i, raw in enumerate(_list(d.get("measured", []), "measured")):
        m = _mapping(raw, f"measured[{i}]", ("src", "dst", "bandwidth", "latency"))
        measured[(m["src"], m["dst"])] = (
            _quantity(m["bandwidth"], "B/s", f"measured[{i}].bandwidth"),
            _quantity(m["latency"], "s", f"measured[{i}].latency"),
        )
    return Topology(
        d["name"],
        cluster.device,
        nodes["devices"],
        _list(nodes["switches"], "nodes.switches"),
        links,
        levels=cluster.levels if levels is not None else None,
        device_forwarding=nodes.get("device_forwarding", False),
        measured=measured,
    )


def topology_from_document(data: object, path: str) -> Topology:
    """:func:`from_dict` of a document read from ``path``; errors start with the path."""
    try:
        return from_dict(data)
    except TopologyError as exc:
        raise TopologyError(f"{path}: {exc}") from None


def load_topology(path: str) -> Topology:
    """Read a topology file: YAML for .yaml/.yml, JSON for .json. Errors start with the path."""
    return topology_from_document(read_document(path, TopologyError, "topology"), path)


def save_topology(topo: Topology, path: str) -> None:
    """Write :func:`to_dict` as YAML (.yaml/.yml) or JSON (.json)."""
    if path.endswith((".yaml", ".yml")):
        text = yaml.safe_dump(to_dict(topo), sort_keys=False)
    elif path.endswith(".json"):
        text = json.dumps(to_dict(topo), indent=1) + "\n"
    else:
        raise TopologyError(f"{path}: topology files must end in .yaml, .yml or .json")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
