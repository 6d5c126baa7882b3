"""User constraints in the search: :class:`~nest_fx.plan.constraints.Constraints` to solver options,
and, when nothing meets them, which constraint binds.

``constrained_options`` narrows :class:`SolverOptions` to the constraints (degrees fixed or
bounded, schedules, recompute modes, microbatch sizes, ZeRO stages, placements) and sets the
cost options they carry (optimizer, memory headroom). What can be told from the model and the
cluster alone is refused at once, naming the constraint as the command line writes it (a TP
degree larger than a node or one the model's shapes do not divide, a CP degree the sequence does
not split into, more devices than the cluster has, a batch no fixed degree divides, an unknown
recompute policy). ``compile`` and ``float8`` are how the model is trained, like the optimizer:
fixed on, they are costed (``SolverOptions.compile``/``float8``) and never relaxed.
``solve_constrained`` then searches; when no plan fits it re-plans with each constraint left
out in turn and names those whose removal gives a plan.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, List, Optional, Sequence, Tuple

from nest_fx.cost.options import CostOptions
from nest_fx.graph.recompute_policies import recompute_policy_problem
from nest_fx.plan.constraints import ConstraintError, Constraints, schedule_pairs
from nest_fx.plan.vocabulary import CHUNKED_SCHEDULES
from nest_fx.plan.settings import CHOICES, COSTED_FLAGS, DEGREES, FLAGS, OPTIONS
from nest_fx.plan.may_run import device_problems, unrun_combination
from nest_fx.solver.search import NoFeasiblePlan, SolveResult, solve
from nest_fx.solver.space import ANY_INTERLEAVE, SEARCHED_OPTIONS, SolverOptions
from nest_fx.workload import Variant, Workload

RELAXED_SOLVE_BUDGET_S = 10.0  # per re-plan when looking for the binding constraint
# how the model is trained, not a preference: every option (optimizer, precision, kernels, the
# overlap shares) but the memory headroom, the user's margin, and the flags the planner only costs
KEPT_OPTIONS = tuple(s.name for s in OPTIONS if s.name != "memory_headroom")
NEVER_RELAXED = KEPT_OPTIONS + tuple(f"fix.{flag}" for flag in COSTED_FLAGS)


def cost_options(constraints: Optional[Constraints], base: Optional[CostOptions] = None) -> CostOptions:
    """``base`` with the optimizer, memory headroom and overlap shares the constraints carry (a
    plan file's constraints give the options it was costed under)."""
    base = base or CostOptions()
    if not constraints:
        return base
    # the options recorded in the constraints only: CostOptions fields of the same names
    changes = {
        s.name: getattr(constraints, s.name)
        for s in OPTIONS
        if s.scope == "run" and getattr(constraints, s.name) is not None
    }
    return dataclasses.replace(base, **changes)


def _named(constraints: Constraints, *keys: str) -> str:
    """The command-line text of the constraints ``keys`` (those that are set)."""
    texts = dict(constraints.items())
    return ", ".join(texts[k] for k in keys if k in texts)


def _degree_keys(name: str) -> Tuple[str, ...]:
    return (f"fix.{name}", f"min.{name}", f"max.{name}")


def _check_recompute(c: Constraints) -> None:
    for mode in c.recompute or ():
        problem = recompute_policy_problem(mode)
        if problem:
            raise ConstraintError(f"--recompute {','.join(c.recompute)}: {problem}")


def _check_runtime_options(c: Constraints, options: SolverOptions, cluster) -> None:
    """ConstraintError for torch.compile / Float8 the plan cannot have: Float8 on a device without
    fp8 tensor cores, either with a fixed TP degree the runtime does not combine them with."""
    for problem in device_problems(cluster.device, float8=options.float8):
        raise ConstraintError(f"--fix {problem}")
    tp = c.fix.get("tp", max(options.tp_degrees))  # a fixed TP degree, else the most any plan may have
    problem = unrun_combination(
        tp=tp,
        ep=1,
        dp_shard=0,
        hsdp=False,
        compile=options.compile,
        float8=options.float8,
        async_tp=options.async_tp,
        sequence_parallel=options.sequence_parallel,
    )
    if problem:
        flags = [f"fix.{f}" for f in COSTED_FLAGS + ("sequence_parallel",) if f in c.fix]
        raise ConstraintError(f"{_named(c, *flags, 'fix.tp')}: {problem[0]}")


def _searched_degrees(
    c: Constraints, degree: str, tried: Sequence[int], what: str, fixed_problem: Callable[[int], str]
) -> Tuple[int, ...]:
    """The values of ``degree`` the search tries under ``c``: the fixed one (ConstraintError with
    ``fixed_problem(value)`` when that is not "") or those of ``tried`` inside its bounds."""
    lo, hi = c.bounds(degree)
    named = _named(c, *_degree_keys(degree))
    if degree in c.fix:
        problem = fixed_problem(lo)
        if problem:
            raise ConstraintError(f"{named}: {problem}")
        return (lo,)
    out = tuple(x for x in tried if lo <= x <= hi)
    if not out:
        raise ConstraintError(f"{named}: no {what} degree the planner tries ({list(tried)}) lies in {lo}..{hi}")
    return out


def _cp_degrees(c: Constraints, options: SolverOptions, workload: Workload) -> Tuple[int, ...]:
    return _searched_degrees(
        c,
        "cp",
        options.cp_searched(workload.dims.seq_len),
        "context-parallel",
        lambda cp: workload.variant_problem(Variant(cp=cp)) if cp > 1 else "",
    )


def _tp_degrees(c: Constraints, options: SolverOptions, workload: Workload, cluster) -> Tuple[int, ...]:
    node = min(cluster.levels[0].group_size, cluster.num_devices)

    def problem(tp: int) -> str:
        if options.tp_within_node and tp > node:
            return (
                f"tensor parallelism stays inside one {cluster.levels[0].name} of {node} devices on "
                f"{cluster.name}; use tp <= {node}"
            )
        return workload.variant_problem(Variant(tp, sequence_parallel=options.sequence_parallel and tp > 1))

    return _searched_degrees(c, "tp", options.tp_degrees, "tensor-parallel", problem)


def constrained_options(
    options: SolverOptions, constraints: Optional[Constraints], workload: Workload, cluster, global_batch: int
) -> SolverOptions:
    """``options`` narrowed to ``constraints`` (module docstring); ConstraintError naming the
    constraint when the model or the cluster already rules it out."""
    c = constraints
    options = options.for_device(cluster.device)  # the planner's precision: the user's, else the device's default
    if not c:
        return options
    _check_recompute(c)
    changes = {"constraints": c, "cost": cost_options(c, options.cost)}
    for flag in FLAGS:
        if flag in c.fix:
            changes[flag] = bool(c.fix[flag])
    for name in SEARCHED_OPTIONS:  # precision, kernels: the user's value is every plan's
        if getattr(c, name) is not None:
            changes[name] = getattr(c, name)
    options = dataclasses.replace(options, **{k: v for k, v in changes.items() if k != "constraints"})
    _check_runtime_options(c, options, cluster)
    changes["tp_degrees"] = _tp_degrees(c, options, workload, cluster)
    changes["cp_degrees"] = _cp_degrees(c, options, workload)
    bounds = {name: c.bounds(name) for name in DEGREES if name in c.fix or name in c.min or name in c.max}
    changes["degree_bounds"] = bounds
    lo_ep, hi_ep = c.bounds("ep")
    if "ep" in bounds:
        if not workload.is_moe and lo_ep > 1:
            raise ConstraintError(
                f"{_named(c, *_degree_keys('ep'))}: {workload.model} has no experts; "
                "expert parallelism needs a mixture-of-experts model"
            )
        if workload.is_moe:
            experts = max(workload.dims.num_experts, 1)
            eps = [e for e in range(1, experts + 1) if experts % e == 0 and lo_ep <= e <= hi_ep]
            if not eps:
                raise ConstraintError(
                    f"{_named(c, *_degree_keys('ep'))}: no degree in {lo_ep}..{hi_ep} divides "
                    f"the model's {experts} experts"
                )
            changes["ep_degrees"] = tuple(eps)
    lo_pp, hi_pp = c.bounds("pp")
    if lo_pp > len(workload):
        raise ConstraintError(
            f"{_named(c, *_degree_keys('pp'))}: the model has {len(workload)} layers, so at most "
            f"{len(workload)} pipeline stages"
        )
    if "pp" in bounds:
        changes["max_stages"] = min(hi_pp, options.max_stages or hi_pp)
    least = min(changes["tp_degrees"]) * lo_pp * c.bounds("dp")[0] * min(changes["cp_degrees"])
    if least > cluster.num_devices:
        keys = _degree_keys("tp") + _degree_keys("pp") + _degree_keys("dp") + _degree_keys("cp")
        raise ConstraintError(
            f"{_named(c, *keys)}: needs at least {least} devices, the cluster has {cluster.num_devices}"
        )
    if c.microbatch_sizes is not None:
        sizes = tuple(b for b in c.microbatch_sizes if global_batch % b == 0)
        if not sizes:
            raise ConstraintError(
                f"{_named(c, 'microbatch_sizes')}: no microbatch size divides the global batch {global_batch}"
            )
        changes["microbatch_sizes"] = sizes
    if "dp" in c.fix and not any(
        (global_batch // b) % c.fix["dp"] == 0
        for b in changes.get("microbatch_sizes", options.microbatch_sizes)
        if global_batch % b == 0
    ):
        raise ConstraintError(
            f"{_named(c, 'fix.dp', 'microbatch_sizes')}: dp={c.fix['dp']} does not divide the "
            f"global batch {global_batch} into whole microbatches"
        )
    if c.schedules is not None:
        factors = sorted({v for name, v in options.schedules if name in CHUNKED_SCHEDULES}) or [ANY_INTERLEAVE]
        changes["schedules"] = tuple(schedule_pairs(c.schedules, factors))
    for s in CHOICES:  # the other lists of allowed values (recompute, zero_stages, placements) as given
        if s.allowed not in changes and getattr(c, s.allowed) is not None:
            changes[s.allowed] = tuple(getattr(c, s.allowed))
    return dataclasses.replace(options, **changes)


def solve_constrained(
    workload: Workload,
    cluster,
    global_batch: int,
    constraints: Optional[Constraints],
    options: Optional[SolverOptions] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> SolveResult:
    """``solve`` within ``constraints``; the plan records them. When no plan fits, NoFeasiblePlan
    as without constraints if the unconstrained problem has none either, else ConstraintError
    naming the constraint(s) whose removal gives a plan (:func:`binding_constraints`, within what
    is left of ``options.time_budget``)."""
    options = options or SolverOptions()
    start = time.perf_counter()
    narrowed = constrained_options(options, constraints, workload, cluster, global_batch)
    try:
        return solve(workload, cluster, global_batch, narrowed, progress)
    except NoFeasiblePlan as exc:
        if not constraints or all(k in NEVER_RELAXED for k, _ in constraints.items()):
            raise
        deadline = start + options.time_budget if options.time_budget else None
        message = binding_constraints(workload, cluster, global_batch, constraints, options, exc, deadline)
        if message is None:  # no plan without the constraints either: the plain reason says more
            raise
        raise ConstraintError(message) from exc


def _relaxed(
    workload: Workload, cluster, global_batch: int, constraints: Constraints, options: SolverOptions, budget: float
) -> Optional[SolveResult]:
    """The plan found under ``constraints`` within ``budget`` seconds, or None."""
    try:
        narrowed = constrained_options(
            dataclasses.replace(options, time_budget=budget), constraints, workload, cluster, global_batch
        )
        return solve(workload, cluster, global_batch, narrowed)
    except (NoFeasiblePlan, ConstraintError):
        return None


def binding_constraints(
    workload: Workload,
    cluster,
    global_batch: int,
    constraints: Constraints,
    options: SolverOptions,
    failure: NoFeasiblePlan,
    deadline: Optional[float] = None,
) -> Optional[str]:
    """Why no plan meets ``constraints``: the constraints whose removal alone gives a plan (with
    that plan), else that they bind only together; None when no plan fits without them either.
    The optimizer, compile and float8 are facts of the training, not relaxed. Each re-plan gets an even share of the
    time left before ``deadline`` (a ``time.perf_counter()`` value), at most
    RELAXED_SOLVE_BUDGET_S."""
    keys = [(k, text) for k, text in constraints.items() if k not in NEVER_RELAXED]
    kept = Constraints(
        **{name: getattr(constraints, name) for name in KEPT_OPTIONS},
        fix={f: constraints.fix[f] for f in COSTED_FLAGS if f in constraints.fix},
    )
    trials = [kept] + [constraints.without(k) for k, _ in keys]
    found: List[Optional[SolveResult]] = []
    for k, trial in enumerate(trials):
        left = math.inf if deadline is None else deadline - time.perf_counter()
        if left <= 0:
            break
        found.append(
            _relaxed(
                workload, cluster, global_batch, trial, options, min(RELAXED_SOLVE_BUDGET_S, left / (len(trials) - k))
            )
        )
        if found[0] is None:
            return None
    stopped = len(found) < len(trials)
    note = (
        " (the time budget ran out before every constraint was tried: allow more with --time-budget)" if stopped else ""
    )
    binding = [f"{text} (without it: {_short(plan)})" for (_, text), plan in zip(keys, found[1:]) if plan is not None]
    if binding:
        verb = "binds" if len(binding) == 1 else "each bind"
        return f"no plan meets the constraints; {'; '.join(binding)} {verb}{note}"
    if stopped:
        return f"no plan meets the constraints ({', '.join(text for _, text in keys)}){note}"
    return (
        f"no plan meets the constraints together ({', '.join(text for _, text in keys)}); leaving out any one "
        f"of them does not help either: relax several ({failure})"
    )


def _short(found: SolveResult) -> str:
    """The plan's degrees, ZeRO stage, schedule and step time, briefly."""
    p = found.plan
    tp = p.uniform_tp if p.uniform_tp is not None else [s.tp for s in p.stages]
    schedule = p.schedule + (f" v={p.virtual_stages}" if p.schedule in CHUNKED_SCHEDULES else "")
    return (
        f"pp={p.pp} dp={p.dp} tp={tp}{f' ep={p.ep}' if p.ep > 1 else ''} zero={p.zero} "
        f"mbs={p.microbatch_size} {schedule}, {found.result.step_s:.3g} s/step"
    )
