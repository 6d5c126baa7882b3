"""A ``--cluster`` argument -> a :class:`~nest_fx.cluster.protocol.ClusterModel`, and back.

A preset (``dgx-a100:1024``), a cluster or topology file (``.yaml``/``.yml``/``.json``), or a
topology generator spec (``rail:128x8``); see docs/cluster_format.md and docs/topology.md.
"""

from __future__ import annotations

import os
from typing import Optional

from nest_fx.cluster.errors import ClusterError
from nest_fx.cluster.protocol import ClusterModel
from nest_fx.cluster.spec import PRESETS, Cluster
from nest_fx.cluster.topology.fileformat import TOPOLOGY_FORMAT, topology_from_document
from nest_fx.cluster.topology.graph_cluster import GraphCluster
from nest_fx.cluster.topology.specs import is_topology_spec, topology_from_spec
from nest_fx.common.fileio import read_document
from nest_fx.common.names import close_matches


def _is_file_spec(spec: str) -> bool:
    return os.path.exists(spec) or spec.endswith((".yaml", ".yml", ".json"))


def _load_file(path: str) -> ClusterModel:
    """A cluster or topology file, read and parsed once; its ``format`` decides which."""
    data = read_document(path, ClusterError, "cluster")
    if isinstance(data, dict) and data.get("format") == TOPOLOGY_FORMAT:
        return GraphCluster(topology_from_document(data, path))
    return Cluster.from_dict(data, where=path)


def load_cluster(spec: str, devices: Optional[int] = None) -> ClusterModel:
    """A preset name (``dgx-a100``), ``name:devices`` (``dgx-a100:1024``), a cluster or topology
    YAML/JSON file (``format: nest-fx-topology/1`` gives a graph), or a topology generator spec
    (``rail:128x8``, ``fat-tree:128x8,oversub=2``, ``torus:8x8x16``;
    ``nest_fx.cluster.topology.specs``). Graph topologies come back as a :class:`GraphCluster`."""
    if _is_file_spec(spec):
        cluster = _load_file(spec)
        if devices is not None and devices != cluster.num_devices:
            raise ClusterError(f"--devices {devices} differs from num_devices={cluster.num_devices} in {spec}")
        return cluster
    if is_topology_spec(spec):
        cluster = GraphCluster(topology_from_spec(spec))
        if devices is not None and devices != cluster.num_devices:
            raise ClusterError(
                f"--devices {devices} differs from the {cluster.num_devices} devices of {spec!r}: "
                "leave --devices out (the spec gives the size)"
            )
        return cluster
    name, _, count = spec.partition(":")
    if name not in PRESETS:
        raise ClusterError(
            f"unknown cluster preset {name!r} in {spec!r}{close_matches(name, PRESETS)}: "
            f"use NAME:DEVICES with NAME in "
            f"{sorted(PRESETS)}, a topology spec (docs/topology.md) or a cluster file (.yaml, .yml "
            "or .json)"
        )
    if count:
        try:
            devices = int(count)
        except ValueError:
            raise ClusterError(f"cluster {spec!r}: expected NAME:DEVICES with an integer device count") from None
    if devices is None:
        raise ClusterError(f"cluster preset {name!r} needs a device count: --cluster {name}:1024 or --devices 1024")
    return Cluster.preset(name, devices)


def cluster_spec(spec: str, cluster: ClusterModel) -> str:
    """What :func:`load_cluster` needs to rebuild ``cluster`` (recorded in plan files): the file
    path or topology generator spec as given, or ``NAME:DEVICES`` for a preset."""
    if _is_file_spec(spec) or is_topology_spec(spec):
        return spec
    return f"{spec.partition(':')[0]}:{cluster.num_devices}"
