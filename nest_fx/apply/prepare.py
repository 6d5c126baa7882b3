"""``auto_parallelize``'s first step: everything decided before the device mesh is built.

``prepare(request)`` runs, in order: the process group (``init_distributed``), the trace, the
plan (given, re-planned under ``elastic=True``, or chosen by the planner), every check
(``checks.run_all``), the weights' start (``meta`` / ``weights=``) and the values the
memory-efficient norms start from (``norm_weights``), the ranks' agreement on their
settings (``agreement.agree``, one small all-gather on the default group) and the warnings and
the plan summary. What it returns, a :class:`Job`, is what the rewrites of
``nest_fx.apply.steps`` read. Nothing here builds a group or moves a parameter, so a plan that
cannot run fails on every rank with the same ``ApplyError`` before the first collective.
"""

from __future__ import annotations

import copy
import hashlib
import json
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from nest_fx.apply import checks
from nest_fx.apply.agreement import agree
from nest_fx.apply.collective_errors import named_collective_failures
from nest_fx.apply.distributed import init_distributed, job_timeout, rank_device
from nest_fx.apply.fingerprint import fingerprint, tensor_specs
from nest_fx.apply.losses import token_cross_entropy_problem
from nest_fx.apply.materialize import LoadedWeights, prepare_weights
from nest_fx.apply.norm_weights import check_start_weights
from nest_fx.graph import trace
from nest_fx.graph.tp_regions import unsharded_attention
from nest_fx.graph.training_mode import training_config
from nest_fx.plan.constraints import ConstraintError, Constraints
from nest_fx.plan.may_run import unrun_constraints
from nest_fx.plan.plan import Plan, uniform_plan
from nest_fx.plan.summary import plan_summary
from nest_fx.plan.support import batchnorm_modules, model_dims, parallel_support
from nest_fx.solver.runtime_planner import planner_for

Planner = Callable[[Any, Any, int, int], Plan]

# warnings name the line that called auto_parallelize: _warn_* <- prepare <- auto_parallelize <- caller
_CALLER = 4


@dataclass(frozen=True)
class Request:
    """``auto_parallelize``'s arguments, as the caller gave them (its docstring says what each means)."""

    model: nn.Module
    example_inputs: Any
    global_batch_size: int
    cluster: Any = None
    loss_fn: Optional[Callable] = None
    plan: Optional[Plan] = None
    planner: Optional[Planner] = None
    graph: Any = None
    verbose: bool = True
    timeout_s: Optional[float] = None
    constraints: Union[Constraints, dict, None] = None
    elastic: bool = False
    sync_batchnorm: bool = True
    weights: Optional[str] = None
    init_seed: int = 0


@dataclass(frozen=True)
class WeightStart:
    """Where the parameters' values come from: the model as built, or (``on_meta`` / ``loaded``)
    the file of ``weights=`` and the model's own initialisation seeded by ``init_seed``."""

    on_meta: bool
    loaded: Optional[LoadedWeights]
    skeleton: Optional[nn.Module]  # the whole model's modules, on meta, to initialise from
    path: Optional[str]
    init_seed: int

    @property
    def to_fill(self) -> bool:
        """Parameters to allocate or read on each rank after the rewrites (``steps.materialize_weights``)."""
        return self.on_meta or self.loaded is not None


@dataclass(frozen=True)
class Job:
    """What every rank agreed to run: the model, its trace, the checked plan and the settings the
    rewrites read (``nest_fx.apply.steps``)."""

    model: nn.Module
    graph: Any
    plan: Plan
    num_microbatches: int
    global_batch_size: int
    loss_fn: Optional[Callable]
    model_specs: Dict[str, Any]  # the whole model's tensors, before it is cut into stages and shards
    stage_layout: Any  # StageLayout of the pipeline cut (None when pp == 1)
    weights: WeightStart
    batchnorms: List[str]  # BatchNorm modules of the model
    sync_batchnorm: bool
    verbose: bool
    rank: int
    mesh_device: str  # "cuda" under NCCL, else "cpu"
    dry_run: bool  # a fake process group: no devices, no values (tests/unit/apply/test_apply_fake.py)


def default_plan(graph, world_size: int, global_batch_size: int, model_name: str = "") -> Plan:
    """Pure data parallelism over the whole world (the fallback until a planner is passed)."""
    n = len(graph.blocks)
    if global_batch_size % world_size:
        raise checks.ApplyError(
            f"no plan given and the default plan (pure data parallel over {world_size} ranks) needs the global "
            f"batch ({global_batch_size}) divisible by {world_size}; fix: pass plan= or planner=, or a batch "
            f"that is a multiple of {world_size}"
        )
    return uniform_plan(
        n,
        pp=1,
        tp=1,
        dp=world_size,
        microbatch_size=global_batch_size // world_size,
        num_microbatches=1,
        model=model_name,
        world_size=world_size,
        notes="default: pure data parallel",
    )


def split_example(example_inputs) -> Tuple[tuple, dict]:
    """``example_inputs`` (a tensor, a tuple of tensors or a dict of keyword tensors) as (args, kwargs)."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    return tuple(example_inputs), {}


def _shapes(args: tuple, kwargs: dict) -> list:
    tensors = list(args) + [kwargs[k] for k in sorted(kwargs)]
    return [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in tensors]


def agreed_settings(
    plan: Plan, specs, global_batch_size: int, nmb: int, args: tuple, kwargs: dict, loss_fn: Callable
) -> dict:
    """The settings every rank must share, as the fields of the setup's agreement."""
    plan_text = json.dumps(plan.to_dict(), sort_keys=True, default=str)
    return {
        "global_batch_size": global_batch_size,
        "num_microbatches": nmb,
        "model fingerprint": fingerprint(specs),
        "example input shapes": _shapes(args, kwargs),
        "loss_fn": getattr(loss_fn, "__qualname__", type(loss_fn).__name__),
        "collective timeout": str(job_timeout()),
        "torch": torch.__version__,
        "plan": f"{plan_summary(plan, nmb).splitlines()[0]} [{hashlib.sha256(plan_text.encode()).hexdigest()[:12]}]",
    }


def _constraints(request: Request) -> Optional[Constraints]:
    """``constraints=`` as a :class:`Constraints`; refused beside ``plan=`` or ``planner=``, which would ignore them,
    and when they ask for what the runtime does not run on any model (``may_run.unrun_constraints``), before the
    trace, the search and the first collective."""
    constraints = request.constraints
    if constraints is not None and (request.plan is not None or request.planner is not None):
        raise checks.ApplyError(
            "constraints= shape the default planner's search; with plan= or planner= they "
            "would be ignored: pass constraints alone, or put them in your planner"
        )
    constraints = Constraints.from_dict(constraints) if isinstance(constraints, dict) else constraints
    found = unrun_constraints(constraints)
    if found:
        raise ConstraintError(f"constraints= {found[0]}: {found[1]}")
    return constraints


def resolve_plan(request: Request, graph, constraints: Optional[Constraints], world: int, rank: int) -> Plan:
    """The plan to run: ``plan=``, unless ``elastic=True`` and it was made for another world size;
    otherwise ``planner=``'s, or the default planner's (NEST DP under ``constraints``)."""
    plan = request.plan
    if request.elastic and plan is not None and plan.devices_used != world:
        if rank == 0 and request.verbose:
            print(
                f"elastic: the plan uses {plan.devices_used} devices, {world} ranks joined: re-planning for {world} "
                f"with global batch {request.global_batch_size}",
                flush=True,
            )
        plan = None
    if plan is not None:
        return plan
    planner = request.planner
    if planner is None:
        model, loss_fn = request.model, request.loss_fn
        vocab = model_dims(model)["vocab"] or 8
        planner = planner_for(
            model,
            constraints=constraints,
            one_microbatch=request.sync_batchnorm,
            loss_parallel=loss_fn is None or not token_cross_entropy_problem(loss_fn, vocab),
        )
    plan = planner(graph, request.cluster, world, request.global_batch_size)
    init_distributed(request.timeout_s, plan.device_order)  # a placed plan needs the group numbered for it
    return plan


def _device_type_of(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def weight_start(request: Request) -> WeightStart:
    """How the parameters get their values: ``weights=`` opened and matched against the whole
    model (an ``ApplyError`` listing what does not fit), and a copy of a model built on meta."""
    model = request.model
    on_meta = _device_type_of(model) == "meta"
    loaded = prepare_weights(request.weights, model) if request.weights is not None else None
    return WeightStart(
        on_meta=on_meta,
        loaded=loaded,
        skeleton=copy.deepcopy(model) if on_meta else None,
        path=request.weights,
        init_seed=request.init_seed,
    )


def _warn_batchnorm(job: Job) -> None:
    norms, plan = job.batchnorms, job.plan
    if norms and not job.sync_batchnorm and (plan.dp > 1 or job.num_microbatches > 1) and job.rank == 0:
        warnings.warn(
            f"sync_batchnorm=False: BatchNorm layers {norms[:4]}{' ...' if len(norms) > 4 else ''} normalise "
            f"each microbatch of {plan.microbatch_size} samples on its own replica, not the global batch of "
            f"{job.global_batch_size} (the numbers differ from the single-device run)",
            stacklevel=_CALLER,
        )


def _warn_unsharded_attention(job: Job) -> None:
    replicated = unsharded_attention(job.graph) if any(s.tp > 1 for s in job.plan.stages) else []
    if replicated and job.rank == 0:
        why = (getattr(job.graph, "replicated_attention", None) or {}).get(replicated[0])
        warnings.warn(
            f"tensor parallelism shards the linear pairs of each layer, but the attention of {replicated[:3]}"
            f"{' ...' if len(replicated) > 3 else ''} is no pair nest-fx can shard"
            f"{f' ({replicated[0]}: {why})' if why else ''}: it runs whole on every TP rank, as the cost "
            "model priced it",
            stacklevel=_CALLER,
        )


def prepare(request: Request) -> Job:
    """Plan, check and agree (module docstring); returns the :class:`Job` every rank runs."""
    constraints = _constraints(request)
    world, rank = init_distributed(request.timeout_s, request.plan.device_order if request.plan is not None else None)
    model, loss_fn = request.model, request.loss_fn
    args, kwargs = split_example(request.example_inputs)
    training_config(model)  # HF models as loaded (use_cache=True): no key/value cache while training
    specs = tensor_specs(model)  # the whole model, before it is cut into stages and shards
    graph = request.graph if request.graph is not None else trace(model, args, kwargs, name=type(model).__name__)
    plan = resolve_plan(request, graph, constraints, world, rank)
    nmb = checks.run_all(
        plan,
        model,
        graph,
        world,
        request.global_batch_size,
        model_loss=loss_fn is None,
        batch_statistics=request.sync_batchnorm,
    )
    mesh_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    checks.check_runtime_options(plan, model, graph, loss_fn, mesh_device)  # before the first agreement collective
    layout = parallel_support(model, graph).stage_layout() if plan.pp > 1 else None
    start = weight_start(request)
    check_start_weights(  # memory-efficient norms: no zero entries in the weights they will start from
        model,
        plan.norm_kernel,
        loaded=start.loaded,
        skeleton=start.skeleton,
        device=rank_device(mesh_device),
        init_seed=start.init_seed,
    )
    settings = agreed_settings(plan, specs, request.global_batch_size, nmb, args, kwargs, loss_fn)
    settings.update({"weights": str(request.weights), "start on meta": start.on_meta, "init_seed": request.init_seed})
    with named_collective_failures("auto_parallelize, comparing the ranks' settings"):
        agree(settings, what="auto_parallelize, before building the device mesh")
    job = Job(
        model=model,
        graph=graph,
        plan=plan,
        num_microbatches=nmb,
        global_batch_size=request.global_batch_size,
        loss_fn=loss_fn,
        model_specs=specs,
        stage_layout=layout,
        weights=start,
        batchnorms=batchnorm_modules(model),
        sync_batchnorm=request.sync_batchnorm,
        verbose=request.verbose,
        rank=rank,
        mesh_device=mesh_device,
        dry_run=dist.get_backend() == "fake",
    )
    _warn_batchnorm(job)
    if rank == 0 and request.verbose:
        print(plan_summary(plan, nmb), flush=True)
    _warn_unsharded_attention(job)
    return job
