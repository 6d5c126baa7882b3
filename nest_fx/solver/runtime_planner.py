"""The planner as ``auto_parallelize`` uses it: model + traced graph -> a plan the runtime runs."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from nest_fx.cost.compute import AnalyticalCompute
from nest_fx.plan import Plan
from nest_fx.solver.search import solve
from nest_fx.solver.space import SolverOptions
from nest_fx.workload import ModelDims, workload_from_graph

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def detect_cluster(world_size: int):
    """A preset for the local device type and world size: dgx-h100 / dgx-a100 on those GPUs,
    dgx-a100 figures for other GPUs, cpu-gloo on CPU."""
    from nest_fx.cluster import Cluster

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return Cluster.preset("dgx-h100" if "H100" in name or "H200" in name else "dgx-a100", world_size)
    return Cluster.preset("cpu-gloo", world_size)


def model_dims(model: torch.nn.Module, seq_len: int, dtype_bytes: int) -> ModelDims:
    """Divisibility facts from a zoo ``TransformerConfig`` or a HuggingFace config."""
    cfg = getattr(model, "config", None)
    get = (lambda *names: next((int(getattr(cfg, n)) for n in names if getattr(cfg, n, None)), 0))
    return ModelDims(seq_len=seq_len, hidden=get("hidden", "hidden_size", "n_embd"),
                     heads=get("heads", "num_attention_heads", "n_head"),
                     kv_heads=get("kv_heads", "num_key_value_heads", "heads", "num_attention_heads"),
                     ffn_hidden=get("ffn_hidden", "intermediate_size", "n_inner"),
                     num_experts=get("num_experts", "num_local_experts"), vocab_size=get("vocab_size"),
                     dtype_bytes=dtype_bytes)


def planner_for(model: torch.nn.Module, options: Optional[SolverOptions] = None) -> Callable:
    """``planner(graph, cluster, world_size, global_batch) -> Plan`` for ``auto_parallelize``:
    the NEST DP restricted to what the runtime runs (every rank used, uniform TP)."""
    base = options or SolverOptions(time_budget=30.0)

    def plan(graph, cluster, world_size: int, global_batch: int) -> Plan:
        cluster = cluster or detect_cluster(world_size)
        param = next(iter(model.parameters()))
        dtype = _DTYPES.get(param.dtype, "fp32")
        seq = graph.input_shapes[0][1] if graph.input_shapes and len(graph.input_shapes[0]) > 1 else 1
        timing = AnalyticalCompute.for_device(cluster.device, dtype)
        attention = "traced" if cluster.device.name.startswith("cpu") else "flash"
        dims = model_dims(model, seq, param.element_size())
        workload = workload_from_graph(graph, timing, dims, attention=attention)
        nbytes = param.element_size()
        opts = dataclasses.replace(base, use_all_devices=True,
                                   cost=dataclasses.replace(base.cost, param_bytes=nbytes, grad_bytes=nbytes))
        return solve(workload, cluster, global_batch, opts).plan

    return plan
