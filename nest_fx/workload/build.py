"""A model name and a device -> its traced graph and its costed Workload.

The command line, the runtime's planner, the profiler and the benchmarks all enter here:
``trace_model`` builds and traces a zoo, spec or ``hf:`` model on meta tensors;
``workload_for_model`` costs its layers for a cluster's device, from a measured profile where
one is given and the analytical roofline for the rest; ``analytical_workload`` costs an
already traced graph with the roofline alone.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch

from nest_fx.workload.roofline import AnalyticalCompute
from nest_fx.graph import OpGraph, trace
from nest_fx.models import build_any
from nest_fx.models.inputs import PLAN_SEQ_CAP
from nest_fx.workload.profile_file import Profile
from nest_fx.workload.profiled_source import ProfiledSource
from nest_fx.workload.traced_source import workload_from_graph
from nest_fx.workload.types import Workload, WorkloadError, dims_from_config

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def trace_model(
    name: str,
    *,
    batch: int = 1,
    seq: Optional[int] = None,
    dtype: torch.dtype = torch.bfloat16,
    seq_cap: Optional[int] = None,
    before_trace: Optional[Callable[[int], None]] = None,
) -> Tuple[OpGraph, object]:
    """Trace a zoo/spec/hf model on meta tensors; returns (OpGraph, config). ``seq_cap``: see
    ``models.build_any``; ``before_trace(parameter count)`` runs once the model is built, before
    the trace (a check that can refuse the model cheaply)."""
    model, cfg, args, kwargs = build_any(name, batch=batch, seq=seq, dtype=dtype, seq_cap=seq_cap)
    if before_trace is not None:
        before_trace(sum(p.numel() for p in model.parameters()))
    return trace(model, args, kwargs, name=name), cfg


def traced_seq_len(graph: OpGraph) -> int:
    """Tokens per sample of the traced example: dim 1 of a 2-D (token id) first input, else 1."""
    shape = graph.input_shapes[0] if graph.input_shapes else []
    return shape[1] if len(shape) == 2 else 1


def workload_for_model(
    name: str,
    cluster,
    *,
    seq: Optional[int] = None,
    dtype: torch.dtype = torch.bfloat16,
    attention: Optional[str] = None,
    profile: Union[Profile, str, None] = None,
    before_trace: Optional[Callable[[int], None]] = None,
) -> Workload:
    """Trace ``name`` and cost its layers for ``cluster``'s device: measured op times from
    ``profile`` (a :class:`Profile` or a path) where it has them, the analytical roofline for
    the rest. Without ``seq``: the model's sequence length (an HF model's configured positions,
    at most ``models.inputs.PLAN_SEQ_CAP``). ``before_trace``: see :func:`trace_model`."""
    graph, cfg = trace_model(name, seq=seq, dtype=dtype, seq_cap=PLAN_SEQ_CAP, before_trace=before_trace)
    seq = seq or traced_seq_len(graph)
    dims = dims_from_config(cfg, seq_len=seq, dtype_bytes=torch.empty((), dtype=dtype).element_size())
    if profile is None:
        return analytical_workload(graph, dims, cluster, dtype, attention=attention)
    if isinstance(profile, str):
        profile = Profile.load(profile)
    dtype_name = DTYPE_NAMES.get(dtype, "fp32")
    if profile.dtype != dtype_name:
        raise WorkloadError(
            f"the profile was taken in {profile.dtype} but the workload is {dtype_name}: "
            f"pass --dtype {profile.dtype} or re-profile"
        )
    timing = AnalyticalCompute.for_device(cluster.device, dtype_name)
    source = ProfiledSource(
        graph,
        timing,
        profile,
        model_name=name,
        seq=seq,
        dtype=dtype,
        attention=attention or ("traced" if profile.device == "cpu" else "flash"),
    )
    work = workload_from_graph(
        graph,
        timing,
        dims,
        attention=source.attention,
        source=source,
        provenance=f"profile {profile.device_name} ({profile.dtype}) + analytical roofline",
    )
    work.dtype = dtype_name
    return work


def analytical_workload(
    graph: OpGraph, dims, cluster, dtype: torch.dtype, *, attention: Optional[str] = None
) -> Workload:
    """A traced graph costed for ``cluster``'s device with the analytical roofline.

    ``attention``: "flash" (the default on GPUs: fused attention keeps O(s) bytes) or "traced"
    (what the traced kernel saved: the CPU math kernel keeps the O(s^2) scores)."""
    timing = AnalyticalCompute.for_device(cluster.device, DTYPE_NAMES.get(dtype, "fp32"))
    if attention is None:
        attention = "traced" if cluster.device.name.startswith("cpu") else "flash"
    work = workload_from_graph(
        graph,
        timing,
        dims,
        attention=attention,
        provenance=f"analytical roofline for {cluster.device.name}, {timing.rates_source}",
    )
    work.dtype = DTYPE_NAMES.get(dtype, "fp32")
    return work
