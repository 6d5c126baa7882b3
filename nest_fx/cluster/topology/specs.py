"""Topology generator specs for the command line: ``rail:128x8,oversub=2`` -> a Topology.

Syntax: ``KIND:SHAPE[,KEY=VALUE...]``

    rail:NODES[xGPUS][,group=NODES][,spines=S][,oversub=R][,device=PRESET]
    fat-tree:NODES[xGPUS][,leaf=NODES][,spines=S][,oversub=R][,device=PRESET]   (alias spine-leaf)
    torus:D0[xD1[xD2]][,device=PRESET]

``GPUS`` defaults to 8 per node. ``group``: nodes per rail group (default: all nodes);
``leaf``: nodes per leaf switch (default 4); ``spines``: spine switches (default 1);
``oversub``: downlink / uplink bandwidth of a rail or leaf switch (default 1, >= 1);
``device``: the device spec of a cluster preset (default ``dgx-h100``; ``tpuv4-fat-tree`` for
the torus). Link figures are the generators' defaults (docs/topology.md). Errors are one line
(:class:`TopologyError`) naming the spec, the part that is wrong and an example.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

from nest_fx.cluster.spec import Cluster
from nest_fx.cluster.topology.generators import fat_tree, rail_optimized, torus
from nest_fx.cluster.topology.model import Topology, TopologyError

_NODE_OPTIONS = {
    "rail": ("group", "spines", "oversub", "device"),
    "fat-tree": ("leaf", "spines", "oversub", "device"),
    "spine-leaf": ("leaf", "spines", "oversub", "device"),
    "torus": ("device",),
}
EXAMPLES = {
    "rail": "rail:128x8,oversub=2",
    "fat-tree": "fat-tree:128x8,oversub=2,spines=4",
    "spine-leaf": "spine-leaf:32x8",
    "torus": "torus:8x8x16",
}


def is_topology_spec(spec: str) -> bool:
    """Whether ``spec`` names a generator (``rail:``, ``fat-tree:``, ``spine-leaf:``, ``torus:``)."""
    kind, sep, _ = spec.partition(":")
    return bool(sep) and kind in _NODE_OPTIONS


MAX_GRAPH_DEVICES = 65_536  # a graph topology holds every device and link: beyond this, use a preset
MAX_SWITCH_OPTION = 4_096  # spines, nodes per leaf / rail group


def _fail(spec: str, kind: str, problem: str) -> TopologyError:
    return TopologyError(f"cluster spec {spec!r}: {problem}; e.g. {EXAMPLES[kind]} (see docs/topology.md)")


def _int(spec: str, kind: str, what: str, text: str, most: int = MAX_GRAPH_DEVICES) -> int:
    try:
        value = int(text) if len(text) <= 12 else most + 1
    except ValueError:
        raise _fail(spec, kind, f"{what} must be a positive integer, got {text!r}") from None
    if value < 1:
        raise _fail(spec, kind, f"{what} must be a positive integer, got {value}")
    if value > most:
        raise _fail(spec, kind, f"{what} must be at most {most:,}, got {text}")
    return value


def _check_size(spec: str, kind: str, devices: int) -> None:
    if devices > MAX_GRAPH_DEVICES:
        raise _fail(
            spec,
            kind,
            f"{devices:,} devices: a graph topology is built device by device and link by "
            f"link, at most {MAX_GRAPH_DEVICES:,}; for larger clusters use a hierarchical preset "
            "(e.g. dgx-h100:131072)",
        )


def _options(spec: str, kind: str, parts) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not value.strip():
            raise _fail(spec, kind, f"option {part!r} must be KEY=VALUE")
        if key not in _NODE_OPTIONS[kind]:
            raise _fail(spec, kind, f"unknown option {key!r}; {kind} takes {', '.join(_NODE_OPTIONS[kind])}")
        if key in out:
            raise _fail(spec, kind, f"option {key!r} given twice")
        out[key] = value.strip()
    return out


def _device(spec: str, kind: str, name: str):
    try:
        return Cluster.preset(name, 1).device
    except ValueError as exc:
        raise _fail(spec, kind, f"device={name}: {exc}") from None


def _node_shape(spec: str, kind: str, shape: str) -> Tuple[int, int]:
    nodes, x, gpus = shape.partition("x")
    return _int(spec, kind, "NODES", nodes), _int(spec, kind, "GPUS", gpus) if x else 8


def topology_from_spec(spec: str) -> Topology:
    """The topology a generator spec names (see module docstring)."""
    if not is_topology_spec(spec):
        raise TopologyError(
            f"cluster spec {spec!r}: not a topology generator; use one of {', '.join(EXAMPLES.values())}"
        )
    kind, _, rest = spec.partition(":")
    shape, *parts = [p.strip() for p in rest.split(",")]
    if not shape:
        raise _fail(spec, kind, "the shape is missing")
    opts = _options(spec, kind, parts)
    kwargs: Dict[str, object] = {}
    if "device" in opts:
        kwargs["device"] = _device(spec, kind, opts["device"])
    if "spines" in opts:
        kwargs["spines"] = _int(spec, kind, "spines", opts["spines"], MAX_SWITCH_OPTION)
    if "oversub" in opts:
        try:
            kwargs["oversubscription"] = float(opts["oversub"])
        except ValueError:
            raise _fail(spec, kind, f"oversub must be a number >= 1, got {opts['oversub']!r}") from None
    build: Callable[..., Topology]
    if kind == "torus":
        dims = [_int(spec, kind, f"dimension {i}", d) for i, d in enumerate(shape.split("x"))]
        if len(dims) > 3:
            raise _fail(spec, kind, f"a torus has 1 to 3 dimensions, got {len(dims)}")
        _check_size(spec, kind, dims[0] * (dims[1] if len(dims) > 1 else 1) * (dims[2] if len(dims) > 2 else 1))
        build, args = torus, (dims,)
    else:
        nodes, gpus = _node_shape(spec, kind, shape)
        _check_size(spec, kind, nodes * gpus)
        if kind == "rail":
            if "group" in opts:
                kwargs["nodes_per_rail_group"] = _int(spec, kind, "group", opts["group"], MAX_SWITCH_OPTION)
            build = rail_optimized
        else:
            if "leaf" in opts:
                kwargs["nodes_per_leaf"] = _int(spec, kind, "leaf", opts["leaf"], MAX_SWITCH_OPTION)
            build = fat_tree
        args = (nodes, gpus)
    try:
        return build(*args, name=spec, **kwargs)
    except TopologyError as exc:
        raise _fail(spec, kind, str(exc)) from None
