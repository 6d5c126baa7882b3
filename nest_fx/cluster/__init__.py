"""Cluster: the devices and the network a plan runs on.

``spec`` (a device type on a hierarchy of network levels, ``format: nest-fx-cluster/1``),
``hardware`` (its device type and network levels), ``kernel_rates`` (a device's measured kernel
rates), ``fields`` (their field checks),
``quantities`` (``"80GiB"``-style values in files), ``presets`` (named clusters),
``hierarchical_collectives`` (the levels' network model), ``ordered`` (a cluster seen under a
plan's device order), ``topology`` (graph networks of devices, switches and links),
``protocol`` (:class:`ClusterModel`, the interface every kind offers the cost model) and
``load`` (a ``--cluster`` argument to a cluster). See docs/cluster_format.md.
"""

from nest_fx.cluster import presets  # noqa: F401  (fills spec.PRESETS, which Cluster.preset reads)
from nest_fx.cluster.errors import ClusterError
from nest_fx.cluster.kernel_rates import KernelRates
from nest_fx.cluster.load import cluster_spec, load_cluster
from nest_fx.cluster.ordered import OrderedCluster, is_identity, placed
from nest_fx.cluster.presets import A100_80GB, H100_SXM
from nest_fx.cluster.protocol import ClusterModel
from nest_fx.cluster.quantities import UNITS, parse_quantity
from nest_fx.cluster.spec import CLUSTER_FORMAT, MAX_DEVICES, PRESETS, Cluster, DeviceSpec, LevelSpan, NetworkLevel
from nest_fx.cluster.topology import GraphCluster, Topology, TopologyError

__all__ = [
    "A100_80GB",
    "CLUSTER_FORMAT",
    "Cluster",
    "ClusterError",
    "ClusterModel",
    "DeviceSpec",
    "GraphCluster",
    "H100_SXM",
    "KernelRates",
    "LevelSpan",
    "MAX_DEVICES",
    "NetworkLevel",
    "OrderedCluster",
    "PRESETS",
    "Topology",
    "TopologyError",
    "UNITS",
    "cluster_spec",
    "is_identity",
    "load_cluster",
    "parse_quantity",
    "placed",
]
