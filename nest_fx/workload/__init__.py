"""Workload: the chain of layers the solver plans over, each with its costs per variant.

``types`` (the chain, its layer costs and model dims), ``traced_source`` (costs from a traced
graph and the analytical roofline), ``profile_file`` and ``profiled_source`` (costs from a
measured profile), ``localise`` (a model shrunk to one TP rank's shapes, to match profiled
ops), ``table`` (the ``nest-fx-workload/1`` file form) and ``build`` (a model name to a
costed workload).
"""

from nest_fx.workload.roofline import AnalyticalCompute
from nest_fx.workload.build import DTYPE_NAMES, analytical_workload, trace_model, workload_for_model
from nest_fx.workload.profile_file import OpEntry, Profile, ProfileError, op_key
from nest_fx.workload.profiled_source import ProfiledSource
from nest_fx.workload.table import TableSource, load_workload, save_workload, workload_from_table, workload_to_table
from nest_fx.workload.traced_source import TracedSource, workload_from_graph
from nest_fx.workload.types import (
    RECOMPUTE_MODES,
    WORKLOAD_FORMAT,
    Comm,
    Layer,
    LayerCost,
    ModelDims,
    Variant,
    Workload,
    WorkloadError,
    chain_fingerprint,
    dims_from_config,
)

__all__ = [
    "AnalyticalCompute",
    "Comm",
    "DTYPE_NAMES",
    "Layer",
    "LayerCost",
    "ModelDims",
    "OpEntry",
    "Profile",
    "ProfileError",
    "ProfiledSource",
    "RECOMPUTE_MODES",
    "TableSource",
    "TracedSource",
    "Variant",
    "WORKLOAD_FORMAT",
    "Workload",
    "WorkloadError",
    "analytical_workload",
    "chain_fingerprint",
    "dims_from_config",
    "load_workload",
    "op_key",
    "save_workload",
    "trace_model",
    "workload_for_model",
    "workload_from_graph",
    "workload_from_table",
    "workload_to_table",
]
