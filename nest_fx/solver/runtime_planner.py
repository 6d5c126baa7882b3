"""The planner as ``auto_parallelize`` uses it: model + traced graph -> a plan the runtime runs."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from nest_fx.cluster.protocol import ClusterModel
from nest_fx.cluster.spec import Cluster
from nest_fx.common.arith import divisors
from nest_fx.cost.precision import default_precision
from nest_fx.plan.constraints import ConstraintError, Constraints
from nest_fx.plan.plan import Plan
from nest_fx.plan.may_run import may_run
from nest_fx.solver.constraints import solve_constrained
from nest_fx.solver.search import NoFeasiblePlan
from nest_fx.solver.space import SolverOptions
from nest_fx.workload.build import analytical_workload, traced_seq_len
from nest_fx.workload.types import dims_from_config


def detect_cluster(world_size: int) -> ClusterModel:
    """A preset for the local device type and world size: dgx-h100 / dgx-a100 on those GPUs,
    dgx-a100 figures for other GPUs, cpu-gloo on CPU."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return Cluster.preset("dgx-h100" if "H100" in name or "H200" in name else "dgx-a100", world_size)
    return Cluster.preset("cpu-gloo", world_size)


def runtime_options(model: torch.nn.Module, graph, options: SolverOptions) -> SolverOptions:
    """``options`` narrowed to what the runtime runs on ``model`` (``nest_fx.plan.may_run``, the
    question the runtime's checks ask too): TP, EP and CP degrees it accepts, pipelining only
    where the model can be cut into stages (and, with TP, where no cut carries a value TP
    shards), sequence parallelism only where it runs, loss parallelism only where its LM head
    allows, recompute policies only where no in-place op of the model breaks them."""
    runs = may_run(model, graph)
    tps = runs.allowed("tp", options.tp_degrees)
    experts = runs.num_experts()
    eps = options.ep_degrees
    if eps is not None or experts:  # ep 1 always runs, so the tuple is never empty
        eps = runs.allowed("ep", eps if eps is not None else divisors(experts))
    cps = runs.allowed("cp", options.cp_degrees) or (1,)
    # a model whose pipeline cuts cannot carry TP-sharded values keeps TP and is not pipelined
    tp_pp = any(runs.degree_problem("tp_pp", t) for t in tps if t > 1)
    max_stages = 1 if tp_pp or runs.degree_problem("pp", 2) else options.max_stages
    loss_parallel = options.loss_parallel
    if any(runs.degree_problem("loss_parallel", t) for t in tps if t > 1):
        loss_parallel = False
    return dataclasses.replace(
        options,
        tp_degrees=tps or (1,),
        ep_degrees=eps,
        max_stages=max_stages,
        cp_degrees=cps,
        recompute=runs.allowed("recompute", options.recompute),
        loss_parallel=loss_parallel,
        sequence_parallel=options.sequence_parallel
        and not any(runs.degree_problem("sequence_parallel", t) for t in tps or (1,) if t > 1)
        and not runs.degree_problem("sequence_parallel", True),
    )


def check_runtime_constraints(constraints: Optional[Constraints], model: torch.nn.Module, graph) -> None:
    """ConstraintError when a degree the user fixed is one the runtime cannot run on ``model``
    (``nest_fx.plan.support``, the runtime's own verdict), with its reason."""
    found = may_run(model, graph).constraint_problem(constraints)
    if found:
        raise ConstraintError(f"{found[0]}: {found[1]}")


def planner_for(
    model: torch.nn.Module,
    options: Optional[SolverOptions] = None,
    constraints: Optional[Constraints] = None,
    *,
    one_microbatch: bool = True,
    loss_parallel: bool = True,
) -> Callable:
    """``planner(graph, cluster, world_size, global_batch) -> Plan`` for ``auto_parallelize``:
    the NEST DP restricted to what the runtime runs (:func:`runtime_options`; every rank used,
    uniform TP, the launched rank order: a device order needs the process group numbered for it
    before it exists) and to the user's ``constraints`` (``nest_fx.solver.constraints``). ``one_microbatch``: when the
    model's numbers depend on the microbatch split (``ParallelSupport.microbatch_problem``:
    BatchNorm), only plans with one microbatch per step. ``loss_parallel=False``: the training loss
    cannot be computed from vocabulary shards, so no plan with loss parallelism (unless the
    ``constraints`` fix it, which the runtime's checks then refuse with the reason)."""
    base = options or SolverOptions(time_budget=30.0)
    if not loss_parallel:
        base = dataclasses.replace(base, loss_parallel=False)

    def plan(graph, cluster, world_size: int, global_batch: int) -> Plan:
        check_runtime_constraints(constraints, model, graph)
        cluster = cluster or detect_cluster(world_size)
        param = next(iter(model.parameters()))
        seq = traced_seq_len(graph)
        nbytes = param.element_size()
        runs = may_run(model, graph, cluster)
        dims = dims_from_config(getattr(model, "config", None), seq_len=seq, dtype_bytes=nbytes)
        dims = dataclasses.replace(dims, num_experts=runs.num_experts() or 0)
        workload = analytical_workload(graph, dims, cluster, param.dtype)
        # precision: the user's, else bf16-true for a model already in bf16, else the device's default
        # (bf16-mixed on GPUs, fp32 on CPUs: cost.precision.default_precision); the plan records it
        precision = (
            base.precision
            or (constraints.precision if constraints else None)
            or ("bf16-true" if nbytes < 4 else default_precision(cluster.device))
        )
        # the process group exists by now (the world size comes from it) and cannot be renumbered
        # for a device order (apply.distributed.init_distributed): keep the launcher's placement
        opts = dataclasses.replace(
            runtime_options(model, graph, base), use_all_devices=True, search_placement=False, precision=precision
        )
        if one_microbatch and runs.degree_problem("num_microbatches", 2):
            return _one_microbatch_plan(workload, cluster, world_size, global_batch, opts, constraints)
        return solve_constrained(workload, cluster, global_batch, constraints, opts).plan

    return plan


def _one_microbatch_plan(
    workload,
    cluster,
    world_size: int,
    global_batch: int,
    opts: SolverOptions,
    constraints: Optional[Constraints] = None,
) -> Plan:
    """The fastest plan with one microbatch per step and no pipeline: one search per TP degree, whose
    data-parallel degree (world / tp) fixes the microbatch (global_batch / dp)."""
    found = []
    for tp in opts.tp_degrees:
        dp = world_size // tp
        if world_size % tp or global_batch % dp:
            continue
        narrowed = dataclasses.replace(
            opts,
            tp_degrees=(tp,),
            microbatch_sizes=(global_batch // dp,),
            max_stages=1,
            ep_degrees=tuple(e for e in (opts.ep_degrees or (1,)) if dp % e == 0) or (1,),
        )
        try:
            found.append(solve_constrained(workload, cluster, global_batch, constraints, narrowed))
        except (NoFeasiblePlan, ConstraintError):
            continue
    if not found:
        raise NoFeasiblePlan(
            f"no plan with one microbatch per step (the model's BatchNorm needs the whole batch "
            f"in one forward) fits {world_size} devices with a global batch of {global_batch}; fix: "
            "a global batch divisible by the data-parallel degree, more memory, or "
            "sync_batchnorm=False"
        )
    return min(found, key=lambda r: r.result.step_s).plan
