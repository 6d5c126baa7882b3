"""Graph network topologies: devices, switches and links; routing, contention, collectives.

See docs/topology.md. The hierarchical model (``nest_fx.cluster`` + ``nest_fx.cost.collectives``)
stays the fast path; a :class:`GraphCluster` plugs a graph into the same cost model.
"""
from nest_fx.topology.adapter import GraphCluster
from nest_fx.topology.algorithms import (
    CostCurve,
    collective_curve,
    collective_time,
    concurrent_collective_time,
    concurrent_times,
    p2p_time,
)
from nest_fx.topology.calibration import calibrate, pairwise_figures
from nest_fx.topology.dp_sync import DpSyncContention, contended_step_s, dp_sync_contention
from nest_fx.topology.fileformat import TOPOLOGY_FORMAT, from_dict, load_topology, save_topology, to_dict
from nest_fx.topology.generators import fat_tree, from_cluster, rail_optimized, spine_leaf, torus
from nest_fx.topology.model import Link, Topology, TopologyError, device_islands
from nest_fx.topology.orders import candidate_orders

__all__ = [
    "CostCurve", "DpSyncContention", "GraphCluster", "Link", "TOPOLOGY_FORMAT", "Topology", "TopologyError",
    "calibrate", "candidate_orders", "collective_curve", "collective_time", "contended_step_s",
    "concurrent_collective_time", "concurrent_times",
    "device_islands", "dp_sync_contention", "fat_tree", "from_cluster", "from_dict", "load_topology",
    "p2p_time", "pairwise_figures", "rail_optimized", "save_topology", "spine_leaf", "to_dict", "torus",
]
