"""DeviceMesh of a Plan: named dims ``pp``, ``dp``, ``tp`` (and ``ep``/``edp`` for MoE).

The mesh tensor is built from :meth:`Plan.rank`, so it follows the plan's placement exactly:

    stage-major    mesh[i, r, j] = off_i + r * tp + j        (TP ranks adjacent, then DP)
    replica-major  mesh[i, r, j] = r * pp * tp + i * tp + j   (the same dims, another order)

Either way the dims are always named ``("pp", "dp", "tp")`` and indexed (stage, replica, TP
rank); only the rank numbers inside differ. The ranks are *plan ranks*, the ranks of the default
process group. A plan with a ``device_order`` (chosen by the planner on a graph topology) runs
plan rank r on the process torchrun launched as global rank ``device_order[r]``:
``distributed.init_distributed`` makes that process join the default group as rank r (see its
docstring for why the group is renumbered rather than the mesh permuted), so the table below
needs no mapping and its rank sets are increasing along every dim, as DeviceMesh, DTensor and
PipelineStage assume (group rank == mesh coordinate).

Expert parallelism folds ``ep`` out of ``dp``: the plan groups ``ep`` consecutive replicas, so
replica ``r = a * ep + b`` sits at ``edp = a``, ``ep = b``; the mesh is then 4-D
``("pp", "edp", "ep", "tp")`` and ``dp`` is the flattened ``("edp", "ep")`` dim. ``edp``
(expert-data-parallel) holds the replicas that own the same experts, over which expert
gradients are reduced.

The runtime needs one TP degree for all stages (a stage boundary between different TP degrees
would need a resharding send that PipelineStage does not do); :func:`build_mesh` raises a
:class:`~nest_fx.plan.PlanError` otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from nest_fx.apply.distributed import with_job_timeout
from nest_fx.plan.plan import Plan, PlanError


@dataclass
class RankInfo:
    """Where a rank sits in the plan: its stage, replica (DP index) and TP rank."""

    rank: int
    stage: int
    replica: int
    tp_rank: int
    ep_rank: int = 0  # index inside the expert group (replica % ep)
    edp_rank: int = 0  # index of the expert group (replica // ep)


def require_uniform_tp(plan: Plan) -> int:
    tp = plan.uniform_tp
    if tp is None:
        raise PlanError(
            f"stages[*].tp: the runtime needs the same TP degree in every stage, got "
            f"{[s.tp for s in plan.stages]}; re-plan with one TP degree (e.g. uniform_plan(..., tp=N)) "
            "or merge stages")
    return tp


def rank_table(plan: Plan) -> torch.Tensor:
    """Int tensor [pp, dp, tp] of plan ranks (default-group ranks) under the plan's placement."""
    tp = require_uniform_tp(plan)
    table = torch.empty(plan.pp, plan.dp, tp, dtype=torch.int64)
    for i in range(plan.pp):
        for r in range(plan.dp):
            for j in range(tp):
                table[i, r, j] = plan.rank(i, r, j)
    return table


def locate(plan: Plan, rank: int) -> RankInfo:
    """(stage, replica, TP rank) of a global rank; PlanError for a rank the plan leaves idle."""
    table = rank_table(plan)
    hits = (table == rank).nonzero()
    if hits.numel() == 0:
        raise PlanError(f"rank {rank} is not used by the plan (it uses {plan.devices_used} devices)")
    i, r, j = (int(v) for v in hits[0])
    return RankInfo(rank=rank, stage=i, replica=r, tp_rank=j, ep_rank=r % plan.ep, edp_rank=r // plan.ep)


def build_mesh(plan: Plan, device_type: Optional[str] = None) -> DeviceMesh:
    """DeviceMesh with dims ("pp", "dp", "tp"), plus "ep"/"edp" (and flattened "dp") when ep > 1.

    Needs an initialised default process group whose size equals ``plan.devices_used``. Every
    group it creates gets the job's timeout (``distributed.with_job_timeout``).
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    table = rank_table(plan)
    if plan.ep == 1:
        return with_job_timeout(DeviceMesh(device_type, table, mesh_dim_names=("pp", "dp", "tp")))
    if plan.dp % plan.ep:
        raise PlanError(f"ep={plan.ep} must divide dp={plan.dp}")
    pp, dp, tp = table.shape
    table4 = table.reshape(pp, dp // plan.ep, plan.ep, tp)
    mesh = DeviceMesh(device_type, table4, mesh_dim_names=("pp", "edp", "ep", "tp"))
    # keep the flattened dim ourselves: slicing a flattened dim from the root mesh is deprecated
    mesh._nest_fx_flat = {"dp": mesh["edp", "ep"]._flatten("dp")}
    return with_job_timeout(mesh)


def submesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1-D mesh of dim ``name`` ("pp", "dp", "tp", "ep", "edp") for this rank."""
    flat = getattr(mesh, "_nest_fx_flat", {})
    return flat[name] if name in flat else mesh[name]


def dim_group(mesh: DeviceMesh, name: str):
    """ProcessGroup of this rank along a named mesh dim."""
    return submesh(mesh, name).get_group()
