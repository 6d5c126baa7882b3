"""Topology generators: hierarchical presets as graphs, fat-tree / spine-leaf, rail-optimized, torus.

Every generator numbers devices node by node (GPU j of node n is device ``n * gpus_per_node +
j``; torus chips with the first coordinate fastest) and sets the ``levels`` hint to match.
Bandwidths are bytes/s per direction of a full-duplex link, latencies seconds per link.
Routing weights: a network hop weighs 1 and an NVLink hop 0.5, so traffic between the GPUs of
one node stays on NVLink (fewest-hop routing alone would tie NVSwitch and leaf switch).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from nest_fx.cluster.hierarchical_collectives import path_bandwidth
from nest_fx.cluster.presets import H100_NVLINK_BUS_BANDWIDTH, NDR_400G_BUS_BANDWIDTH
from nest_fx.cluster.spec import Cluster, DeviceSpec, NetworkLevel
from nest_fx.cluster.topology.model import Link, Topology, TopologyError

NVLINK_WEIGHT = 0.5


def _default_device(preset: str) -> DeviceSpec:
    return Cluster.preset(preset, 1).device


def _positive(value: object, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TopologyError(f"{path}: must be an integer >= 1, got {value!r}")
    return value


def _ratio(value: object, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
        raise TopologyError(f"{path}: must be a number >= 1 (downlink / uplink bandwidth), got {value!r}")
    return float(value)


def _levels(spec: Sequence[tuple]) -> List[NetworkLevel]:
    """NetworkLevels from (name, size, bandwidth, latency), dropping sizes that do not grow."""
    out: List[NetworkLevel] = []
    for name, size, bw, lat in spec:
        if not out or size > out[-1].group_size:
            out.append(NetworkLevel(name, size, bw, lat))
    return out


def from_cluster(cluster: Cluster) -> Topology:
    """The hierarchical cluster as a graph with the same per-device bandwidth semantics.

    A level's ``bandwidth`` is what *each* device can send through that level's fabric, and a
    transfer crossing level i also traverses the inner levels, so the hierarchical model charges
    ``S / min(B_0 .. B_i)`` per device at level i (``hierarchical_collectives.path_bandwidth``).
    Each level is a separate non-blocking plane: one switch per level-i group, linked to every
    device of the group at that path bandwidth with latency ``alpha_i / 2`` (a route, device ->
    switch -> device, then takes ``alpha_i``) and routing weight ``i + 1`` (the innermost common
    level wins). A single tree with shared uplinks could not match: an aggregated uplink would let
    one device exceed its share of the level.
    """
    names = [lv.name for lv in cluster.levels]
    distinct = len(set(names)) == len(names)
    n = cluster.num_devices
    switches: List[str] = []
    links: List[Link] = []
    for i, lv in enumerate(cluster.levels):
        bandwidth = path_bandwidth(cluster.levels, i)
        for g in range(-(-n // lv.group_size)):
            sw = f"{lv.name}{g}" if distinct else f"L{i}-{lv.name}{g}"
            switches.append(sw)
            links.extend(
                Link(d, sw, bandwidth, lv.latency / 2, i + 1)
                for d in range(g * lv.group_size, min((g + 1) * lv.group_size, n))
            )
    levels = [NetworkLevel(lv.name, lv.group_size, lv.bandwidth, lv.latency) for lv in cluster.levels]
    return Topology(cluster.name, cluster.device, n, switches, links, levels=levels)


def _nvlink_islands(nodes: int, gpus_per_node: int, bandwidth: float, latency: float) -> Tuple[List[str], List[Link]]:
    """One NVSwitch ``nvsw{n}`` per node joined to its GPUs (none for one GPU per node): the
    switch names and the links, ``latency / 2`` per link so a GPU-GPU route costs ``latency``."""
    switches: List[str] = []
    links: List[Link] = []
    for node in range(nodes if gpus_per_node > 1 else 0):
        switches.append(f"nvsw{node}")
        links.extend(
            Link(node * gpus_per_node + j, f"nvsw{node}", bandwidth, latency / 2, NVLINK_WEIGHT)
            for j in range(gpus_per_node)
        )
    return switches, links


def fat_tree(
    nodes: int,
    gpus_per_node: int = 8,
    *,
    nodes_per_leaf: int = 4,
    spines: int = 1,
    oversubscription: float = 1.0,
    device: Optional[DeviceSpec] = None,
    nvlink_bandwidth: float = H100_NVLINK_BUS_BANDWIDTH,
    nic_bandwidth: float = NDR_400G_BUS_BANDWIDTH,
    nvlink_latency: float = 5e-6,
    hop_latency: float = 5e-6,
    name: str = "fat-tree",
) -> Topology:
    """Two-tier fat tree (spine-leaf): NVSwitch nodes, one NIC per GPU to the node's leaf switch.

    Links: GPU - ``nvsw{n}`` (``nvlink_bandwidth``, latency ``nvlink_latency / 2``, so a GPU to
    GPU message in a node takes ``nvlink_latency``); GPU - ``leaf{l}`` (``nic_bandwidth``,
    ``hop_latency``); when there are several leaves, every leaf - ``spine{s}`` with bandwidth
    ``nodes_per_leaf * gpus_per_node * nic_bandwidth / (oversubscription * spines)`` (a full
    leaf's uplinks carry 1/oversubscription of its downlinks). Defaults: the ``dgx-h100`` preset's
    figures (what NCCL reaches over NVLink4 and one 400 Gb/s NDR NIC per GPU), 5 us per hop (an
    assumption).
    """
    _positive(nodes, "nodes")
    _positive(gpus_per_node, "gpus_per_node")
    _positive(nodes_per_leaf, "nodes_per_leaf")
    _positive(spines, "spines")
    over = _ratio(oversubscription, "oversubscription")
    g, n = gpus_per_node, nodes * gpus_per_node
    leaves = -(-nodes // nodes_per_leaf)
    switches, links = _nvlink_islands(nodes, g, nvlink_bandwidth, nvlink_latency)
    for leaf in range(leaves):
        switches.append(f"leaf{leaf}")
        first, last = leaf * nodes_per_leaf * g, min((leaf + 1) * nodes_per_leaf * g, n)
        links.extend(Link(d, f"leaf{leaf}", nic_bandwidth, hop_latency) for d in range(first, last))
    if leaves > 1:
        uplink = nodes_per_leaf * g * nic_bandwidth / (over * spines)
        switches.extend(f"spine{s}" for s in range(spines))
        links.extend(
            Link(f"leaf{leaf}", f"spine{s}", uplink, hop_latency) for leaf in range(leaves) for s in range(spines)
        )
    leaf_size = nodes_per_leaf * g
    levels = _levels(
        [
            ("node", g, nvlink_bandwidth, nvlink_latency),
            ("leaf", leaf_size, nic_bandwidth, 2 * hop_latency),
            ("spine", leaves * leaf_size, nic_bandwidth / over, 4 * hop_latency),
        ]
    )
    return Topology(name, device or _default_device("dgx-h100"), n, switches, links, levels=levels)


spine_leaf = fat_tree


def rail_optimized(
    nodes: int,
    gpus_per_node: int = 8,
    *,
    nodes_per_rail_group: Optional[int] = None,
    spines: int = 1,
    oversubscription: float = 1.0,
    device: Optional[DeviceSpec] = None,
    nvlink_bandwidth: float = H100_NVLINK_BUS_BANDWIDTH,
    nic_bandwidth: float = NDR_400G_BUS_BANDWIDTH,
    nvlink_latency: float = 5e-6,
    hop_latency: float = 5e-6,
    name: str = "rail-optimized",
) -> Topology:
    """Rail-optimized network: GPU j of every node in a rail group plugs into rail switch j.

    Nodes are cut into rail groups of ``nodes_per_rail_group`` (default: all nodes, one group).
    Links: GPU - ``nvsw{n}`` (NVLink, as in :func:`fat_tree`); GPU j of node n -
    ``rail{group}.{j}`` (``nic_bandwidth``, ``hop_latency``); when there is more than one rail
    switch, every rail switch - ``spine{s}`` with ``nodes_per_rail_group * nic_bandwidth /
    (oversubscription * spines)``. Same-rail traffic takes one rail switch; cross-rail traffic
    between nodes goes through a spine (devices do not relay, so there is no NVLink detour).
    """
    _positive(nodes, "nodes")
    _positive(gpus_per_node, "gpus_per_node")
    per_group = _positive(nodes_per_rail_group if nodes_per_rail_group is not None else nodes, "nodes_per_rail_group")
    _positive(spines, "spines")
    over = _ratio(oversubscription, "oversubscription")
    g, n = gpus_per_node, nodes * gpus_per_node
    groups = -(-nodes // per_group)
    switches, links = _nvlink_islands(nodes, g, nvlink_bandwidth, nvlink_latency)
    rails = [f"rail{grp}.{j}" for grp in range(groups) for j in range(g)]
    switches.extend(rails)
    for node in range(nodes):
        links.extend(Link(node * g + j, f"rail{node // per_group}.{j}", nic_bandwidth, hop_latency) for j in range(g))
    if len(rails) > 1:
        uplink = per_group * nic_bandwidth / (over * spines)
        switches.extend(f"spine{s}" for s in range(spines))
        links.extend(Link(r, f"spine{s}", uplink, hop_latency) for r in rails for s in range(spines))
    levels = _levels(
        [
            ("node", g, nvlink_bandwidth, nvlink_latency),
            ("rail-group", per_group * g, nic_bandwidth, 2 * hop_latency),
            ("spine", groups * per_group * g, nic_bandwidth / over, 4 * hop_latency),
        ]
    )
    return Topology(name, device or _default_device("dgx-h100"), n, switches, links, levels=levels)


def torus(
    dims: Sequence[int],
    *,
    device: Optional[DeviceSpec] = None,
    link_bandwidth: float = 50e9,
    link_latency: float = 1e-6,
    name: str = "torus",
) -> Topology:
    """A 1-, 2- or 3-D torus (TPU style): chips relay traffic, links wrap around in every dimension.

    Chip ``(c_0, c_1, ...)`` is device ``c_0 + d_0 * (c_1 + d_1 * ...)``. Each chip links to its
    ``+1`` neighbour in every dimension of size > 2 (the last one wraps to 0). A dimension of
    size 2 has both links between the same two chips; they are merged into one link of twice
    the bandwidth. The levels hint is one level per dimension of size > 1 (cumulative sizes),
    so the hierarchical ring is the dimension-by-dimension torus ring. Defaults (50 GB/s,
    1 us per link, a TPUv4 chip) are assumptions of the usual order, not measurements.
    """
    if not isinstance(dims, (list, tuple)) or not 1 <= len(dims) <= 3:
        raise TopologyError(f"dims: must be a list of 1 to 3 sizes, got {dims!r}")
    for i, d in enumerate(dims):
        _positive(d, f"dims[{i}]")
    n = math.prod(dims)
    strides = [math.prod(dims[:i]) for i in range(len(dims))]
    links: List[Link] = []
    for dev in range(n):
        for size, stride in zip(dims, strides):
            c = dev // stride % size
            if size > 2 or (size == 2 and c == 0):
                nxt = dev + ((c + 1) % size - c) * stride
                links.append(Link(dev, nxt, link_bandwidth * (2 if size == 2 else 1), link_latency))
    if not links:
        raise TopologyError(f"dims: {list(dims)} is a single chip; a topology needs links")
    levels = _levels(
        [(f"dim{i}", strides[i] * size, link_bandwidth, link_latency) for i, size in enumerate(dims) if size > 1]
    )
    return Topology(
        name, device or _default_device("tpuv4-fat-tree"), n, [], links, levels=levels, device_forwarding=True
    )
