"""Glue shared by the CLI and the Python API: names and files -> Cluster, OpGraph, Workload."""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from nest_fx.cost.compute import AnalyticalCompute
from nest_fx.graph import OpGraph, trace
from nest_fx.workload import Workload, dims_from_config, workload_from_graph

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def load_cluster(spec: str, devices: Optional[int] = None):
    """A preset name (``dgx-a100``), ``name:devices`` (``dgx-a100:1024``), a cluster or topology
    YAML/JSON file (``format: nest-fx-topology/1`` gives a graph), or a topology generator spec
    (``rail:128x8``, ``fat-tree:128x8,oversub=2``, ``torus:8x8x16``; ``nest_fx.topology.specs``).
    Graph topologies come back as a :class:`nest_fx.topology.GraphCluster`."""
    from nest_fx.cluster import PRESETS, Cluster, ClusterError

    if os.path.exists(spec) or spec.endswith((".yaml", ".yml", ".json")):
        from nest_fx.topology.specs import is_topology_file

        if is_topology_file(spec):
            from nest_fx.topology import GraphCluster, load_topology

            cluster = GraphCluster(load_topology(spec))
        else:
            cluster = Cluster.load(spec)
        if devices is not None and devices != cluster.num_devices:
            raise ValueError(f"--devices {devices} differs from num_devices={cluster.num_devices} in {spec}")
        return cluster
    from nest_fx.topology.specs import is_topology_spec

    if is_topology_spec(spec):
        from nest_fx.topology import GraphCluster
        from nest_fx.topology.specs import topology_from_spec

        cluster = GraphCluster(topology_from_spec(spec))
        if devices is not None and devices != cluster.num_devices:
            raise ValueError(f"--devices {devices} differs from the {cluster.num_devices} devices of {spec!r}: "
                             "leave --devices out (the spec gives the size)")
        return cluster
    name, _, count = spec.partition(":")
    if name not in PRESETS:
        raise ClusterError(f"unknown cluster preset {name!r} in {spec!r}: use NAME:DEVICES with NAME in "
                           f"{sorted(PRESETS)}, a topology spec (docs/topology.md) or a cluster file (.yaml, .yml or .json)")
    if count:
        try:
            devices = int(count)
        except ValueError:
            raise ValueError(f"cluster {spec!r}: expected NAME:DEVICES with an integer device count") from None
    if devices is None:
        raise ValueError(f"cluster preset {name!r} needs a device count: --cluster {name}:1024 or --devices 1024")
    return Cluster.preset(name, devices)


def cluster_spec(spec: str, cluster) -> str:
    """What :func:`load_cluster` needs to rebuild ``cluster`` (recorded in plan files): the file
    path or topology generator spec as given, or ``NAME:DEVICES`` for a preset."""
    from nest_fx.topology.specs import is_topology_spec

    if os.path.exists(spec) or spec.endswith((".yaml", ".yml", ".json")) or is_topology_spec(spec):
        return spec
    return f"{spec.partition(':')[0]}:{cluster.num_devices}"


def trace_model(name: str, *, batch: int = 1, seq: Optional[int] = None,
                dtype: torch.dtype = torch.bfloat16) -> Tuple[OpGraph, object]:
    """Trace a zoo/spec/hf model on meta tensors; returns (OpGraph, config)."""
    from nest_fx.models import build_any

    model, cfg, args, kwargs = build_any(name, batch=batch, seq=seq, dtype=dtype)
    return trace(model, args, kwargs, name=name), cfg


def workload_for_model(name: str, cluster, *, seq: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
                       attention: Optional[str] = None, profile=None) -> Workload:
    """Trace ``name`` and cost its layers for ``cluster``'s device: measured op times from
    ``profile`` (a ``profiler.Profile`` or a path) where it has them, the analytical roofline
    for the rest."""
    graph, cfg = trace_model(name, seq=seq, dtype=dtype)
    dims = dims_from_config(cfg, seq_len=seq or cfg.seq_len, dtype_bytes=torch.empty((), dtype=dtype).element_size())
    if profile is None:
        return analytical_workload(graph, dims, cluster, dtype, attention=attention)
    from profiler.profile_file import Profile
    from profiler.profiled_source import ProfiledSource

    if isinstance(profile, str):
        profile = Profile.load(profile)
    if profile.dtype != _DTYPE_NAMES.get(dtype, "fp32"):
        raise ValueError(f"the profile was taken in {profile.dtype} but the workload is "
                         f"{_DTYPE_NAMES.get(dtype, 'fp32')}: pass --dtype {profile.dtype} or re-profile")
    timing = AnalyticalCompute.for_device(cluster.device, _DTYPE_NAMES.get(dtype, "fp32"))
    source = ProfiledSource(graph, timing, profile, model_name=name, seq=seq, dtype=dtype,
                            attention=attention or ("traced" if profile.device == "cpu" else "flash"))
    return workload_from_graph(graph, timing, dims, attention=source.attention, source=source,
                               provenance=f"profile {profile.device_name} ({profile.dtype}) + analytical roofline")


def analytical_workload(graph: OpGraph, dims, cluster, dtype: torch.dtype, *,
                        attention: Optional[str] = None) -> Workload:
    """A traced graph costed for ``cluster``'s device with the analytical roofline.

    ``attention``: "flash" (the default on GPUs: fused attention keeps O(s) bytes) or "traced"
    (what the traced kernel saved: the CPU math kernel keeps the O(s^2) scores)."""
    timing = AnalyticalCompute.for_device(cluster.device, _DTYPE_NAMES.get(dtype, "fp32"))
    if attention is None:
        attention = "traced" if cluster.device.name.startswith("cpu") else "flash"
    return workload_from_graph(graph, timing, dims, attention=attention,
                               provenance=f"analytical roofline for {cluster.device.name}")
