"""What may run for this model and cluster, and why not: the one question the planner and the
runtime's checks both ask.

:func:`may_run` answers for a model (and its traced graph; both optional: a model planned from
its name has neither) on a cluster's device (optional too). Every answer is ``""`` / ``[]``
(it runs, and computes what the single-device model computes) or the reason, naming the
module or setting and the fix:

* :meth:`MayRun.plan_problems`: everything the runtime would refuse in a plan before training
  (``nest_fx.apply.checks`` raises the first);
* :meth:`MayRun.degree_problem`: one setting's value (``tp``, ``pp``, ``ep``, ``cp``,
  ``sequence_parallel``, ``loss_parallel``, ``recompute``) on this model;
* :meth:`MayRun.allowed`: the values of a degree (or the recompute policies) the planner may
  search (``nest_fx.solver.runtime_planner.runtime_options``);
* :meth:`MayRun.constraint_problem`: a user's fixed setting the model rules out;
* :func:`unrun_combination`: settings the runtime does not combine (on any model);
* :func:`unrun_schedule`: a pipeline schedule with settings it does not run with;
* :func:`unrun_kernels`: a kernel backend the runtime does not run for the plan (or for the
  plans ``constraints`` ask for: :func:`unrun_constraints`, asked before planning, which also
  refuses options that price another system's runtime: ``nest_fx.plan.priced_only``);
* :func:`unrun_norm_kernel`: a way of running the RMSNorms the runtime does not combine with compile;
* :func:`schedule_microbatch_problem`: microbatch counts a pipeline schedule does not run;
* :meth:`MayRun.device_problems`: settings the device cannot run (Float8 without fp8 units).

The model-level verdicts themselves live in ``nest_fx.plan.support`` (:class:`ParallelSupport`:
how TP, PP, EP, CP and loss parallelism apply to this model's modules); this module is where
they are asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch.nn as nn

from nest_fx.graph.opgraph import OpGraph
from nest_fx.graph.recompute_mutations import recompute_mutation_problem
from nest_fx.graph.recompute_policies import parse_recompute, recompute_policy_problem
from nest_fx.plan.constraints import Constraints
from nest_fx.plan.plan import Plan
from nest_fx.plan.priced_only import priced_only_constraints
from nest_fx.plan.support import ParallelSupport, parallel_support
from nest_fx.plan.vocabulary import CHUNKED_SCHEDULES, SPLIT_BACKWARD_SCHEDULES
from nest_fx.workload.fused_norms import norm_kernel_problem

MODEL_DEGREES = ("tp", "pp", "ep", "cp")  # the degrees whose values depend on the model's modules


def unrun_combination(
    *,
    tp: int,
    ep: int,
    dp_shard: int,
    hsdp: bool,
    compile: bool,
    float8: bool,
    async_tp: bool = False,
    sequence_parallel: bool = False,
) -> List[str]:
    """[] when the runtime runs these degrees and options together, else why not (the planner
    searches only combinations it runs): HSDP with expert groups that cross the shard groups
    (``ep`` must divide ``dp_shard``: ``nest_fx.apply.mesh``). torch.compile and Float8 run with
    every degree (``nest_fx.apply.compile``, ``nest_fx.apply.float8``); whether the device runs
    Float8 at all is :func:`device_problems`' question. Async TP fuses sequence parallelism's
    collectives with the matmuls in inductor's graphs: it needs ``tp > 1``, sequence parallelism
    and compile (``nest_fx.apply.async_tp``; CUDA is the runtime's check)."""
    out = []
    if async_tp and (tp == 1 or not sequence_parallel or not compile):
        missing = [
            what
            for what, ok in (
                (f"tp > 1 (tp={tp})", tp > 1),
                ("sequence_parallel=true", sequence_parallel),
                ("compile=true", compile),
            )
            if not ok
        ]
        out.append(
            f"async_tp needs {', '.join(missing)}: it fuses sequence parallelism's all-gathers and "
            "reduce-scatters with the matmuls of torch.compile's graphs (set them, or async_tp=false)"
        )
    if hsdp and ep > 1 and dp_shard % ep:
        out.append(
            f"dp_shard={dp_shard} with ep={ep}: under HSDP the expert groups must lie inside the shard groups "
            f"(use a dp_shard that is a multiple of ep={ep}, dp_shard=0, or ep=1)"
        )
    return out


def unrun_schedule(
    schedule: str,
    *,
    pp: int,
    zero: int = 0,
    compile: bool = False,
    recompute: Sequence[str] = (),
    pp_shard_grads: bool = False,
) -> str:
    """'' when the runtime runs ``schedule`` on ``pp`` stages with these settings (on any model;
    ``recompute``: the stages' policies), else why not and the fix. The zero-bubble schedules
    (``interleaved-zb``, ``zbv``, ``dualpipev``) split each backward into an input-gradient and a
    later weight-gradient pass: under ZeRO-3 FSDP reshards and reduces a stage's gradients after
    the input-gradient pass, before the weight gradients exist (wrong gradients on torch 2.13,
    measured on 4 gloo ranks); selective activation checkpointing (``selective``, ``op``) frees
    what it saved at the first of the two passes (torch raises in the second); and torch's
    pipelining does not split a compiled backward. ``pp_shard_grads`` (ZeRO >= 2) reduce-scatters
    a chunk's gradients when FSDP's post-backward hook fires, which these schedules run after the
    input-gradient pass, before the weight gradients exist."""
    if pp < 2 or schedule not in SPLIT_BACKWARD_SCHEDULES:
        return ""
    sac = next((r for r in recompute if parse_recompute(r).kind in ("selective", "op")), None)
    if sac is not None:
        return (
            f"schedule {schedule} with recompute={sac}: selective activation checkpointing frees what it "
            "saved at the input-gradient pass, before the weight-gradient pass the zero-bubble schedules run "
            "after it; fix: recompute none, full or every:<k>, or schedule 1f1b or interleaved"
        )
    if pp_shard_grads and zero >= 2:
        return (
            f"schedule {schedule} with pp_shard_grads: FSDP would reduce-scatter each chunk's gradients after "
            "the input-gradient pass, before the weight gradients exist; fix: pp_shard_grads=false, or "
            "schedule 1f1b, gpipe or interleaved"
        )
    if zero >= 3:
        return (
            f"schedule {schedule} with zero=3: the zero-bubble schedules compute weight gradients after "
            "FSDP has resharded the stage and reduced its gradients; fix: zero <= 2, or schedule 1f1b or interleaved"
        )
    if compile:
        return (
            f"schedule {schedule} with compile: torch's pipelining does not split a compiled backward into "
            "input and weight gradients; fix: compile=false, or schedule 1f1b or interleaved"
        )
    return ""


def unrun_kernels(kernels: str, compile: bool, constraints: bool = False) -> str:
    """'' when nest-fx's runtime runs the kernels a plan is priced with (``""``: what it runs;
    ``eager`` without ``compile``, ``compile`` with it), else why not and the fix. Other backends
    (``fused``: Transformer-Engine-style kernels) price other systems for ``plan``/``simulate``;
    a run under them would not be what was priced. ``constraints``: the setting is a planner
    constraint of ``auto_parallelize`` (the reason is worded for ``constraints=``, without the
    setting's name, which :func:`unrun_constraints` returns beside it)."""
    runs = "compile" if compile else "eager"
    if kernels in ("", runs):
        return ""
    if constraints:
        fix = (
            "add fix compile=true to the constraints"
            if kernels == "compile"
            else f"drop kernels from constraints= (or set it to '' or {runs}); kernels={kernels} is for predicting "
            "other systems with nest-fx plan/simulate"
        )
        return (
            f"auto_parallelize would plan for {kernels} kernels but nest-fx's runtime runs {runs} kernels "
            f"(it runs eager, or compile with fix compile=true); fix: {fix}"
        )
    fix = "set compile=true" if kernels == "compile" else "use kernels '' (what nest-fx runs)"
    return (
        f"kernels={kernels}: the plan is priced for {kernels} kernels but nest-fx's runtime runs {runs} kernels "
        f"for it (that backend predicts other systems with nest-fx plan/simulate); fix: {fix}"
    )


def unrun_norm_kernel(norm_kernel: str, compile: bool) -> str:
    """'' when the runtime runs the plan's RMSNorms as ``norm_kernel`` says with ``compile``, else why
    not and the fix (``nest_fx.workload.fused_norms.norm_kernel_problem``, which the cost model asks
    too)."""
    return norm_kernel_problem(norm_kernel, "compile" if compile else "eager")


def unrun_constraints(constraints: Optional[Constraints]) -> Optional[Tuple[str, str]]:
    """(the constraint as the command line writes it, why not and the fix) when planner
    ``constraints`` ask for what nest-fx's runtime does not run on any model: an option that prices
    another system's runtime (``nest_fx.plan.priced_only``: expert dispatch, stage outputs, state
    buffers), kernels it does not run (:func:`unrun_kernels`; compile is a user's choice,
    ``fix.compile``, never searched); None when it runs them. ``auto_parallelize`` asks before it
    traces, plans or joins a collective; :meth:`MayRun.constraint_problem` asks it first, then the
    model-level verdicts."""
    if not constraints:
        return None
    priced = priced_only_constraints(constraints)
    if priced:
        return priced[0]
    if not constraints.kernels:
        return None
    reason = unrun_kernels(constraints.kernels, bool(constraints.fix.get("compile", False)), constraints=True)
    return (f"kernels={constraints.kernels}", reason) if reason else None


def schedule_microbatch_problem(schedule: str, pp: int, num_microbatches: int) -> str:
    """Why a pipeline schedule cannot run ``num_microbatches`` per step on ``pp`` stages ("" when it
    can): 1F1B needs at least one microbatch per stage (``torch.distributed.pipelining``'s
    Schedule1F1B), the interleaved schedule a multiple of ``pp``. The planner searches only what
    passes (``solver.space``); the runtime's checks refuse the rest."""
    if pp > 1 and schedule == "1f1b" and num_microbatches < pp:
        return (
            f"1F1B with pp={pp} stages needs at least {pp} microbatches per step, got {num_microbatches}; "
            f"fix: raise num_microbatches to >= {pp} or use schedule 'gpipe'"
        )
    if pp > 1 and schedule in CHUNKED_SCHEDULES and num_microbatches % pp:
        return f"the {schedule} schedule needs num_microbatches ({num_microbatches}) to be a multiple of pp={pp}"
    return ""


def unrun_fields(plan: Plan) -> List[str]:
    """Combinations of plan fields the runtime refuses on any model, each with the reason:
    unknown recompute policies, :func:`unrun_schedule` and :func:`unrun_combination`, and a plan
    priced with another system's runtime options (its constraints' ``expert_dispatch``,
    ``stage_outputs``, ``state_buffers``: ``nest_fx.plan.priced_only``)."""
    out = [
        f"stages[{i}]: {problem}"
        for i, s in enumerate(plan.stages)
        for problem in [recompute_policy_problem(s.recompute)]
        if problem
    ]
    if not out:  # the policies parse
        out += [
            p
            for p in [
                unrun_schedule(
                    plan.schedule,
                    pp=plan.pp,
                    zero=plan.zero,
                    compile=plan.compile,
                    recompute=[s.recompute for s in plan.stages],
                    pp_shard_grads=plan.pp_shard_grads,
                )
            ]
            if p
        ]
    out += [f"constraints: {problem}" for _, problem in priced_only_constraints(plan.constraints)]
    return out + unrun_combination(
        tp=max(s.tp for s in plan.stages),
        ep=plan.ep,
        dp_shard=plan.dp_shard,
        hsdp=plan.replicate_degree > 1,
        compile=plan.compile,
        float8=plan.float8,
        async_tp=plan.async_tp,
        sequence_parallel=plan.sequence_parallel,
    )


def device_problems(device, *, float8: bool = False) -> List[str]:
    """Settings a ``DeviceSpec`` cannot run: Float8 linears need an fp8 rate (tensor cores)."""
    if float8 and not device.peak_flops.get("fp8"):
        return [
            f"float8=true: the device {device.name} has no fp8 rate (its peak_flops list no 'fp8'); Float8 "
            "linears need fp8 tensor cores. fix: float8=false, or a device that has them"
        ]
    return []


@dataclass
class MayRun:
    """The verdicts for one model (module docstring); ``model`` None: no model-level verdict."""

    model: Optional[nn.Module] = None
    graph: Optional[OpGraph] = None
    cluster: object = None
    _support: Optional[ParallelSupport] = field(default=None, repr=False)

    @property
    def support(self) -> Optional[ParallelSupport]:
        if self._support is None and self.model is not None:
            self._support = parallel_support(self.model, self.graph)
        return self._support

    def degree_problem(self, name: str, value, dp: Optional[int] = None) -> str:
        """Why setting ``name`` cannot take ``value`` on this model ("" when it can): ``tp``,
        ``pp``, ``ep`` (``dp``: the data-parallel degree the fix should also divide), ``cp``,
        ``sequence_parallel`` (``value``: on/off, or the TP degree it runs under), ``tp_pp`` (``value``:
        a TP degree, beside a pipeline cut), ``loss_parallel``
        (``value``: the last stage's TP degree),
        ``num_microbatches`` (forwards per replica and step: BatchNorm statistics) and
        ``recompute`` (a policy: with a traced graph, no in-place op of the model may break it:
        ``graph.recompute_mutations``)."""
        if name == "recompute":
            problem = recompute_policy_problem(value)
            return problem or (recompute_mutation_problem(self.graph, value) if self.graph is not None else "")
        s = self.support
        if s is None:
            return ""
        if name == "tp":
            return s.tp_problem(value)
        if name == "pp":
            return s.pp_problem(value) if self.graph is not None or value == 1 else ""
        if name == "tp_pp":
            return s.tp_pp_problem(value) if self.graph is not None else ""
        if name == "ep":
            return s.ep_problem(value, dp)
        if name == "cp":
            return s.cp_problem(value)
        if name == "sequence_parallel":
            # value: on or off, or the TP degree it runs under (an uneven sequence refuses it there)
            return s.sp_problem(0 if value is True else int(value)) if value else ""
        if name == "loss_parallel":
            return s.loss_parallel_problem(value)
        if name == "num_microbatches":
            return s.microbatch_problem(value)
        return ""

    def allowed(self, name: str, values: Sequence) -> Tuple:
        """The values of degree ``name`` (of ``values``; or of ``recompute``) that run on this model."""
        return tuple(v for v in values if not self.degree_problem(name, v))

    def num_experts(self) -> Optional[int]:
        """Experts per MoE layer expert parallelism splits (None: a dense model, or no model)."""
        return self.support.num_experts() if self.support is not None else None

    def model_problems(self, plan: Plan) -> List[str]:
        """Why this model cannot run ``plan``'s degrees: TP of each stage (and sequence
        parallelism under it), EP, the pipeline cut and TP beside it, and each stage's recompute
        policy (the last two with a traced graph)."""
        out = [
            p for tp in sorted({s.tp for s in plan.stages if s.tp > 1}) for p in [self.degree_problem("tp", tp)] if p
        ]
        if plan.sequence_parallel:
            out += [
                p
                for tp in sorted({s.tp for s in plan.stages if s.tp > 1})
                for p in [self.degree_problem("sequence_parallel", tp)]
                if p
            ][:1]
        out += [p for p in [self.degree_problem("ep", plan.ep, plan.dp)] if p]
        if self.graph is not None:
            out += [p for p in [self.degree_problem("pp", plan.pp)] if p]
            if plan.pp > 1:
                tps = sorted({s.tp for s in plan.stages if s.tp > 1})
                out += [p for tp in tps for p in [self.degree_problem("tp_pp", tp)] if p][:1]
            first = {}  # a policy's first stage: one reason per policy
            for i, stage in enumerate(plan.stages):
                first.setdefault(stage.recompute, i)
            out += [
                f"stages[{i}]: {p}"
                for value, i in first.items()
                if not recompute_policy_problem(value)  # unrun_fields names unknown policies
                for p in [self.degree_problem("recompute", value)]
                if p
            ]
        return out

    def plan_problems(self, plan: Plan) -> List[str]:
        """Everything the runtime refuses in ``plan`` on this model and device, in the order the
        runtime checks it: settings it never combines, then the model's verdicts, then the device's."""
        out = unrun_fields(plan) + self.model_problems(plan)
        if self.cluster is not None:
            out += device_problems(self.cluster.device, float8=plan.float8)
        return out

    def constraint_problem(self, constraints: Optional[Constraints]) -> Optional[Tuple[str, str]]:
        """(the constraint as the command line writes it, why not) for the first setting the user
        fixed that this model rules out; None when every fixed setting runs."""
        if not constraints:
            return None
        found = unrun_constraints(constraints)
        if found:
            return found
        for degree in MODEL_DEGREES:
            value = constraints.fix.get(degree)
            reason = self.degree_problem(degree, int(value)) if value is not None else ""
            if reason:
                return f"fix {degree}={value}", reason
        if constraints.fix.get("loss_parallel"):
            reason = self.degree_problem("loss_parallel", 2)
            if reason:
                return "fix loss_parallel=true", reason
        for mode in constraints.recompute or ():
            reason = self.degree_problem("recompute", mode) if not recompute_policy_problem(mode) else ""
            if reason:
                return f"recompute {','.join(constraints.recompute)}", reason
        return None


def may_run(model: Optional[nn.Module] = None, graph: Optional[OpGraph] = None, cluster=None) -> MayRun:
    """What may run for ``model`` (traced as ``graph``) on ``cluster`` (module docstring)."""
    return MayRun(model, graph, cluster)
