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

Context parallelism (``cp > 1``) adds a ``cp`` dim between the data-parallel dims and ``tp``
(the plan's layout: TP innermost, then CP, inside a stage replica); HSDP (``dp_shard`` below
``dp``) splits ``dp`` into ``("dp_replicate", "dp_shard")``. The dims a rank reduces gradients
over are kept as flattened meshes (:func:`submesh` names): ``dp_cp`` (the data-parallel and CP
ranks: every rank holding the same parameters), ``edp_cp`` (the same for experts) and ``hsdp``
(the 2-D ``(dp_replicate, dp_shard x cp)`` mesh FSDP2 shards and replicates over).

HSDP with expert parallelism: the expert groups lie inside the shard groups (``ep`` divides
``dp_shard``), so replica ``r = i * dp_shard + j * ep + b`` sits at ``("dp_replicate",
"edp_shard", "ep") = (i, j, b)``. Dense parameters shard over ``("edp_shard", "ep")`` (the shard
group, flattened as ``dp_shard``) and replicate over ``dp_replicate``, as without experts; the
experts of rank ``b`` shard over ``edp_shard`` (the shard group's replicas owning the same
experts) and replicate over ``dp_replicate``: the 2-D mesh ``ehsdp``. ``edp`` (every replica
owning the same experts) is then ``(dp_replicate, edp_shard)`` flattened.

The runtime needs one TP degree for all stages (a stage boundary between different TP degrees
would need a resharding send that PipelineStage does not do); :func:`build_mesh` raises a
:class:`~nest_fx.plan.PlanError` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

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
    cp_rank: int = 0  # position in the context-parallel group (which sequence chunks it holds)


def require_uniform_tp(plan: Plan) -> int:
    tp = plan.uniform_tp
    if tp is None:
        raise PlanError(
            f"stages[*].tp: the runtime needs the same TP degree in every stage, got "
            f"{[s.tp for s in plan.stages]}; re-plan with one TP degree (e.g. uniform_plan(..., tp=N)) "
            "or merge stages"
        )
    return tp


def rank_table(plan: Plan) -> torch.Tensor:
    """Int tensor [pp, dp, tp] of plan ranks (default-group ranks) under the plan's placement;
    [pp, dp, cp, tp] when ``plan.cp > 1``."""
    tp = require_uniform_tp(plan)
    table = torch.empty(plan.pp, plan.dp, plan.cp, tp, dtype=torch.int64)
    for i in range(plan.pp):
        for r in range(plan.dp):
            for c in range(plan.cp):
                for j in range(tp):
                    table[i, r, c, j] = plan.rank(i, r, j, c)
    return table if plan.cp > 1 else table[:, :, 0]


def locate(plan: Plan, rank: int) -> RankInfo:
    """(stage, replica, TP rank, CP rank) of a global rank; PlanError for a rank the plan leaves idle."""
    table = rank_table(plan)
    hits = (table == rank).nonzero()
    if hits.numel() == 0:
        raise PlanError(f"rank {rank} is not used by the plan (it uses {plan.devices_used} devices)")
    coords = [int(v) for v in hits[0]]
    i, r, j = coords[0], coords[1], coords[-1]
    c = coords[2] if plan.cp > 1 else 0
    return RankInfo(rank=rank, stage=i, replica=r, tp_rank=j, ep_rank=r % plan.ep, edp_rank=r // plan.ep, cp_rank=c)


def _dp_dims(plan: Plan) -> Tuple[Tuple[str, ...], Tuple[int, ...]]:
    """How the mesh splits the plan's ``dp`` replicas: names and sizes of the dims."""
    if plan.ep > 1:
        if plan.dp % plan.ep:
            raise PlanError(f"ep={plan.ep} must divide dp={plan.dp}")
        if plan.replicate_degree > 1:
            if plan.shard_degree % plan.ep:
                raise PlanError(
                    f"dp_shard={plan.dp_shard} with ep={plan.ep}: the expert groups must lie inside the "
                    f"HSDP shard groups; fix: a dp_shard that is a multiple of ep={plan.ep}"
                )
            return ("dp_replicate", "edp_shard", "ep"), (plan.replicate_degree, plan.shard_degree // plan.ep, plan.ep)
        return ("edp", "ep"), (plan.dp // plan.ep, plan.ep)
    if plan.replicate_degree > 1:
        return ("dp_replicate", "dp_shard"), (plan.replicate_degree, plan.shard_degree)
    return ("dp",), (plan.dp,)


def build_mesh(plan: Plan, device_type: Optional[str] = None) -> DeviceMesh:
    """DeviceMesh with dims ("pp", "dp", "tp"); "dp" is ("edp", "ep") when ep > 1,
    ("dp_replicate", "dp_shard") under HSDP and ("dp_replicate", "edp_shard", "ep") under both
    (each then also kept flattened as "dp"), and a "cp"
    dim sits before "tp" when cp > 1 (see the module docstring for the flattened meshes).

    Needs an initialised default process group whose size equals ``plan.devices_used``. Every
    group it creates gets the job's timeout (``distributed.with_job_timeout``).
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    table = rank_table(plan)
    dp_names, dp_sizes = _dp_dims(plan)
    cp_names = ("cp",) if plan.cp > 1 else ()
    shape = (plan.pp, *dp_sizes, *((plan.cp,) if plan.cp > 1 else ()), table.shape[-1])
    mesh = DeviceMesh(device_type, table.reshape(shape), mesh_dim_names=("pp", *dp_names, *cp_names, "tp"))
    # keep flattened dims ourselves: slicing a flattened dim from the root mesh is deprecated
    flat: Dict[str, DeviceMesh] = {}
    if len(dp_names) > 1:
        flat["dp"] = mesh[dp_names]._flatten("dp")
    hsdp_ep = plan.replicate_degree > 1 and plan.ep > 1
    edp_names = ("dp_replicate", "edp_shard") if hsdp_ep else ("edp",)
    if hsdp_ep:
        flat["edp"] = mesh[edp_names]._flatten("edp")
    if cp_names:
        flat["dp_cp"] = mesh[(*dp_names, "cp")]._flatten("dp_cp")
        if plan.ep > 1:
            flat["edp_cp"] = mesh[(*edp_names, "cp")]._flatten("edp_cp")
    if plan.replicate_degree > 1:
        shard_names = ("edp_shard", "ep") if hsdp_ep else ("dp_shard",)
        flat["hsdp"] = DeviceMesh._concatenate(
            [mesh["dp_replicate"], _flat(mesh, (*shard_names, *cp_names), "dp_shard_cp" if cp_names else "dp_shard")]
        )
        if hsdp_ep:
            flat["ehsdp"] = DeviceMesh._concatenate(
                [mesh["dp_replicate"], _flat(mesh, ("edp_shard", *cp_names), "edp_shard_cp")]
            )
    mesh._nest_fx_flat = flat
    return with_job_timeout(mesh)


def _flat(mesh: DeviceMesh, names: Tuple[str, ...], name: str) -> DeviceMesh:
    """The dims ``names`` of ``mesh`` as one dim (the dim itself when there is one)."""
    return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten(name)


def data_parallel_mesh(mesh: DeviceMesh, plan: Plan, experts: bool = False) -> DeviceMesh:
    """The mesh a parameter's gradient is averaged over: every rank holding the same parameter
    (its data-parallel replicas and, with context parallelism, their CP ranks). FSDP2 shards
    over it; under HSDP it is the 2-D (replicate, shard) mesh. ``experts``: for expert
    parameters (replicas owning the same experts: ``edp``)."""
    if experts:
        if plan.replicate_degree > 1:
            return submesh(mesh, "ehsdp")
        return submesh(mesh, "edp_cp" if plan.cp > 1 else "edp")
    if plan.replicate_degree > 1:
        return submesh(mesh, "hsdp")
    return submesh(mesh, "dp_cp" if plan.cp > 1 else "dp")


def submesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The mesh of dim ``name`` for this rank: a dim ("pp", "dp", "cp", "tp", "ep", "edp",
    "dp_replicate", "dp_shard", "edp_shard") or a flattened one ("dp", "dp_cp", "edp", "edp_cp",
    "hsdp", "ehsdp")."""
    flat = getattr(mesh, "_nest_fx_flat", {})
    return flat[name] if name in flat else mesh[name]


def dim_group(mesh: DeviceMesh, name: str):
    """ProcessGroup of this rank along a named mesh dim."""
    return submesh(mesh, name).get_group()
