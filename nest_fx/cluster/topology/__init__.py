"""Graph network topologies: devices, switches and links; routing, contention, collectives.

See docs/topology.md. The hierarchical model (:class:`nest_fx.cluster.Cluster`) stays the fast
path; a :class:`GraphCluster` plugs a graph into the same cost model (both are
:class:`~nest_fx.cluster.protocol.ClusterModel` s).
"""

from nest_fx.cluster.topology.algorithms import (
    CostCurve,
    collective_curve,
    collective_time,
    concurrent_collective_time,
    concurrent_times,
    p2p_time,
)
from nest_fx.cluster.topology.calibration import calibrate, pairwise_figures
from nest_fx.cluster.topology.fileformat import TOPOLOGY_FORMAT, from_dict, load_topology, save_topology, to_dict
from nest_fx.cluster.topology.generators import fat_tree, from_cluster, rail_optimized, spine_leaf, torus
from nest_fx.cluster.topology.graph_cluster import GraphCluster
from nest_fx.cluster.topology.model import Link, Topology, TopologyError, device_islands
from nest_fx.cluster.topology.orders import candidate_orders
from nest_fx.cluster.topology.routing import Router, router_of

__all__ = [
    "CostCurve",
    "GraphCluster",
    "Link",
    "Router",
    "TOPOLOGY_FORMAT",
    "Topology",
    "TopologyError",
    "calibrate",
    "candidate_orders",
    "collective_curve",
    "collective_time",
    "concurrent_collective_time",
    "concurrent_times",
    "device_islands",
    "fat_tree",
    "from_cluster",
    "from_dict",
    "load_topology",
    "p2p_time",
    "pairwise_figures",
    "rail_optimized",
    "router_of",
    "save_topology",
    "spine_leaf",
    "to_dict",
    "torus",
]
