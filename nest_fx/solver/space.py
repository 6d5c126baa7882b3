"""The search space: global knobs of a plan and lower bounds used to order and prune them."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from nest_fx.common.arith import divisors
from nest_fx.cost.options import CostOptions, with_async_tp
from nest_fx.cost.precision import compute_dtype, default_precision, priced_options
from nest_fx.cost.step_time import pipeline_span
from nest_fx.plan.constraints import Constraints
from nest_fx.plan.plan import Plan, StagePlan
from nest_fx.plan.settings import COSTED_FLAGS, SEARCHED, SEARCHED_RECOMPUTE, SETTINGS, add_fields  # noqa: F401
from nest_fx.plan.may_run import schedule_microbatch_problem, unrun_combination, unrun_schedule
from nest_fx.plan.vocabulary import ANY_INTERLEAVE, CHUNKED_SCHEDULES, V_SCHEDULES, model_chunks
from nest_fx.workload import Variant, Workload

# re-exported: ANY_INTERLEAVE (the search and the candidates read it here), SEARCHED_RECOMPUTE
# the options of a plan the planner takes as given, costs and records in every plan: precision, kernels
SEARCHED_OPTIONS = tuple(s.name for s in SEARCHED if s.role == "option")


# the fewest tokens per context-parallel rank at which long_context_cp searches CP degrees beyond
# cp_degrees: Llama 3 405B's long-context stage, 131,072 tokens over CP 16 (Grattafiori et al. 2024,
# sec. 3.3.2), the smallest share of a published run
LONG_CONTEXT_TOKENS = 8192


@dataclass
@add_fields(SEARCHED, search=True)
class SolverOptions:
    """What the planner may choose. Defaults follow common practice (Megatron-LM, torchtitan).

    One field per setting with a ``search`` (``nest_fx.plan.settings``), named and defaulted as
    declared: ``tp_degrees``, ``ep_degrees`` (None: every divisor of the expert count),
    ``cp_degrees`` (those the workload can cost), ``zero_stages``, ``loss_parallel`` (None:
    whenever tp > 1 and the model allows it, never slower), ``compile``, ``float8``, ``async_tp``
    (the user's choices of how to train: costed, recorded, never searched), ``precision`` (None:
    not recorded, costed as ``cost`` says; ``solve_constrained`` sets the device's default,
    ``cost.precision.default_precision``), ``kernels`` (None or '': what the runtime runs),
    ``microbatch_sizes``, ``schedules`` ((schedule, interleave factor) pairs; ANY_INTERLEAVE:
    every factor), ``sequence_parallel`` (True: whenever tp > 1, same traffic, less memory),
    ``placements``, ``recompute``. The fields below are the search's own."""

    # long sequences: also every power of two above max(cp_degrees) that leaves each CP rank at least
    # LONG_CONTEXT_TOKENS tokens (Llama 3 405B trained 131,072-token sequences on CP 16); see cp_searched
    long_context_cp: bool = True
    hsdp: bool = True  # search HSDP shard groups (shard_candidates) under ZeRO >= 2
    tp_within_node: bool = True  # keep TP groups inside the innermost network level
    max_stages: Optional[int] = None
    use_all_devices: bool = False  # the runtime needs world size == devices used (no idle ranks)
    time_budget: Optional[float] = None  # seconds; None = search to optimality
    search_placement: bool = True  # graph topologies: also choose the device order (solver.placement)
    cost: CostOptions = field(default_factory=CostOptions)
    # (lowest, highest) of a degree: "tp", "pp", "dp", "ep", "cp", "dp_shard"; absent = unbounded
    degree_bounds: Mapping[str, Tuple[int, int]] = field(default_factory=dict)
    constraints: Optional[Constraints] = None  # the user's, recorded in the plan (solver.constraints)

    def priced(self) -> "SolverOptions":
        """These options with the cost options priced in :attr:`precision` (the search and the
        baselines cost every plan in it); ``self`` when none is set or they already are."""
        cost = priced_options(self.precision or "", self.cost)
        if self.async_tp:  # micro-pipelined TP runs the TP collectives under the matmuls
            cost = with_async_tp(cost)
        return self if cost == self.cost else dataclasses.replace(self, cost=cost)

    def for_device(self, device) -> "SolverOptions":
        """These options with the device's default precision when none is set (``default_precision``)."""
        return self if self.precision else dataclasses.replace(self, precision=default_precision(device))

    def runtime_workload(self, workload: Workload) -> Workload:
        """``workload`` costed as plans of these options run (compile, Float8, the precision's dtype)."""
        return workload.for_runtime(
            self.compile,
            self.float8,
            compute_dtype(self.precision or ""),
            self.kernels or "",
            self.attention_kernel or "",
            self.norm_kernel or "",
            self.loss_kernel or "",
        )

    def cp_searched(self, seq_len: int) -> Tuple[int, ...]:
        """The CP degrees searched for sequences of ``seq_len`` tokens (0: unknown): ``cp_degrees``,
        and with :attr:`long_context_cp` the powers of two above them that leave every CP rank at
        least :data:`LONG_CONTEXT_TOKENS` tokens."""
        out = tuple(self.cp_degrees)
        if self.long_context_cp and out and seq_len:
            cp = max(out) * 2
            while seq_len >= cp * LONG_CONTEXT_TOKENS:
                out += (cp,)
                cp *= 2
        return out

    def allows(self, degree: str, value: int) -> bool:
        """Whether ``degree`` (tp, pp, dp, ep, cp, dp_shard) may take ``value`` under :attr:`degree_bounds`."""
        lo, hi = self.degree_bounds.get(degree, (1, value))
        return lo <= value <= hi


# the plan settings one configuration of the search fixes for every stage (its outer loop): every
# degree, flag, choice and option of a plan or stage but the per-stage recompute policy, and the
# interleave factor; a GlobalConfig has one field per setting, named and defaulted as declared
GLOBAL_SETTINGS = tuple(
    s for s in SETTINGS if (s.scope == "plan" and s.role != "record") or s.name in ("tp", "virtual_stages")
)


@dataclass(frozen=True)
@add_fields(GLOBAL_SETTINGS)
class GlobalConfig:
    """Settings shared by all stages of a plan (the outer loop of the search): the fields of
    :data:`GLOBAL_SETTINGS`. ``virtual_stages`` is the interleave factor (1 for 1F1B and GPipe;
    ``ANY_INTERLEAVE`` for the family of every factor of one (config, depth) pair, expanded by
    the search)."""

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.microbatch_size)

    @cached_property  # read many times per pair by the bounds' cache keys
    def variant(self) -> Variant:
        """The workload variant of this configuration (``Workload.cost``)."""
        return Variant(self.tp, self.ep, self.microbatch_size, self.sequence_parallel, self.cp, self.loss_parallel)

    @cached_property
    def shard(self) -> int:
        """Ranks ZeRO/FSDP shards over (``dp_sync.shard_degree``)."""
        return (self.dp_shard or self.dp) * self.cp

    def plan(self, stages: List[StagePlan], m: int, workload: Workload, cluster, **fields) -> Plan:
        """The plan of this configuration with ``stages`` and ``m`` microbatches."""
        shared = {s.name: getattr(self, s.name) for s in GLOBAL_SETTINGS if s.scope == "plan"}
        return Plan(
            stages=stages,
            num_microbatches=m,
            model=workload.model,
            model_fingerprint=workload.fingerprint,
            num_layers=len(workload),
            world_size=cluster.num_devices,
            **shared,
            **fields,
        )

    @classmethod
    def of(cls, plan: Plan) -> "GlobalConfig":
        """The configuration of a plan with uniform TP."""
        return cls(
            tp=plan.stages[0].tp, **{s.name: getattr(plan, s.name) for s in GLOBAL_SETTINGS if s.scope == "plan"}
        )


# the fields of a configuration that vary across :func:`config_rows`, in the order its rows hold them
CONFIG_ROW = (
    "microbatch_size",
    "dp",
    "tp",
    "ep",
    "cp",
    "loss_parallel",
    "sequence_parallel",
    "zero",
    "dp_shard",
    "schedule",
    "virtual_stages",
    "placement",
)


def global_configs(workload: Workload, cluster, global_batch: int, options: SolverOptions) -> Iterator[GlobalConfig]:
    """Every admissible combination of the global knobs (``docs/solver.md``): TP, EP and CP
    degrees the workload can cost, loss parallelism wherever allowed (never slower), HSDP shard
    groups at the network's levels under ZeRO >= 2, and only combinations the runtime runs
    (``plan.may_run.unrun_combination``). The configurations of :func:`config_rows`, in its order."""
    shared, rows = config_rows(workload, cluster, global_batch, options)
    return (config_of(row, shared) for row in rows)


def config_of(row: tuple, shared: Mapping[str, object]) -> GlobalConfig:
    """The configuration of one :func:`config_rows` row (fields :data:`CONFIG_ROW`) and the shared fields."""
    return GlobalConfig(**dict(zip(CONFIG_ROW, row)), **shared)


def config_rows(
    workload: Workload, cluster, global_batch: int, options: SolverOptions
) -> Tuple[Dict[str, object], Iterator[tuple]]:
    """(the fields every configuration of :func:`global_configs` shares, an iterator over the
    others: one tuple per configuration, fields named by :data:`CONFIG_ROW`). The search's
    tier 0 reads the rows and builds a :class:`GlobalConfig` only for those with admissible
    depths (most have none)."""
    runtime = {flag: getattr(options, flag) for flag in COSTED_FLAGS}  # compile, float8, async_tp: as the user set them
    given = {name: getattr(options, name) or "" for name in SEARCHED_OPTIONS}  # precision, kernels ('' = not recorded)
    return {**given, **runtime}, _rows(workload, cluster, global_batch, options, runtime)


def _rows(workload: Workload, cluster, global_batch: int, options: SolverOptions, runtime) -> Iterator[tuple]:
    inner = inner_fields(options)
    for outer in _outer_rows(workload, cluster, global_batch, options, runtime):
        for ends in inner:
            yield outer + ends


def _outer_rows(workload: Workload, cluster, global_batch: int, options: SolverOptions, runtime) -> Iterator[tuple]:
    node = cluster.levels[0].group_size
    if workload.is_moe:
        eps = list(options.ep_degrees) if options.ep_degrees else divisors(max(workload.dims.num_experts, 1))
    else:
        eps = [1]
    # (tp, ep, cp, lp) variants the workload has costs for (a layer table may list only some)
    variants = []
    cps = options.cp_searched(workload.dims.seq_len)
    for tp, ep, cp in ((tp, ep, cp) for tp in options.tp_degrees for ep in eps for cp in cps):
        sp = options.sequence_parallel and tp > 1
        if (
            tp * cp > cluster.num_devices
            or (options.tp_within_node and tp > node)
            or not all(options.allows(k, x) for k, x in (("tp", tp), ("ep", ep), ("cp", cp)))
            or unrun_combination(
                tp=tp,
                ep=ep,
                dp_shard=0,
                hsdp=False,
                sequence_parallel=sp,
                compile=options.compile,
                float8=options.float8,
                async_tp=options.async_tp,
            )
            or not workload.supports(Variant(tp, ep, sequence_parallel=sp, cp=cp))
        ):
            continue
        lp = (
            tp > 1
            and options.loss_parallel is not False
            and workload.supports(Variant(tp, ep, sequence_parallel=sp, cp=cp, loss_parallel=True))
        )
        if options.loss_parallel and tp > 1 and not lp:
            continue  # loss parallel required but not possible here
        variants.append((tp, ep, cp, lp, sp))
    zeros, shard_memo = _undominated(options.zero_stages), {}
    for mbs in options.microbatch_sizes:
        if global_batch % mbs:
            continue
        for dp in (d for d in divisors(global_batch // mbs) if options.allows("dp", d)):
            for tp, ep, cp, lp, sp in variants:
                if dp * tp * cp > cluster.num_devices or dp % ep:
                    continue
                for zero in zeros:
                    key = (dp, tp, cp, ep, zero)  # the microbatch sizes and lp share them
                    shards = shard_memo.get(key)
                    if shards is None:
                        shards = shard_memo[key] = shard_candidates(cluster, dp, tp, cp, ep, zero, options)
                    for dp_shard in shards:
                        yield (mbs, dp, tp, ep, cp, lp, sp, zero, dp_shard)


def inner_fields(options: SolverOptions) -> List[Tuple[str, int, str]]:
    """The (schedule, virtual_stages, placement) ends of :func:`config_rows`' rows, in its order:
    every outer row of :func:`config_blocks` takes each of them."""
    schedules = [(schedule, model_chunks(schedule, v)) for schedule, v in options.schedules]
    return [(schedule, v, placement) for schedule, v in schedules for placement in options.placements]


def config_blocks(
    workload: Workload, cluster, global_batch: int, options: SolverOptions
) -> Tuple[Dict[str, object], List[Tuple[str, int, str]], Iterator[tuple]]:
    """:func:`config_rows` in blocks: (the shared fields, :func:`inner_fields`, an iterator over
    the first nine fields of :data:`CONFIG_ROW`); the rows are every outer row followed by each
    inner one, in that order (tier 0 reads what depends on the outer fields once per block)."""
    shared, _ = config_rows(workload, cluster, global_batch, options)
    runtime = {flag: shared[flag] for flag in COSTED_FLAGS}
    return shared, inner_fields(options), _outer_rows(workload, cluster, global_batch, options, runtime)


def shard_candidates(cluster, dp: int, tp: int, cp: int, ep: int, zero: int, options: SolverOptions) -> List[int]:
    """HSDP shard groups searched (``dp_shard``; 0 = shard over all of dp), multiples of ``ep``
    (the expert groups lie inside the shard groups: ``plan.may_run``). By default, under
    ZeRO >= 2: per network level, the largest number of whole replicas dividing dp whose ranks fit in one group of that
    level. A smaller group inside the same level holds more states for traffic on the same
    levels, and under ZeRO-0/1 HSDP moves what a hierarchical all-reduce moves, with more memory.
    A user's bound on ``dp_shard`` searches every divisor of dp inside it (under ZeRO >= 1)."""
    if "dp_shard" in options.degree_bounds:
        lo, hi = options.degree_bounds["dp_shard"]
        if zero < 1:
            return [0] if lo <= dp <= hi else []
        return [0 if d == dp else d for d in divisors(dp) if lo <= d <= hi and d % ep == 0]
    out = [0]
    if not options.hsdp or zero < 2 or dp < 2:
        return out
    unit = tp * cp
    for level in cluster.levels:
        fits = [
            d
            for d in divisors(dp)
            if d < dp and d % ep == 0 and d * unit <= level.group_size and level.group_size % (d * unit) == 0
        ]
        if fits and fits[-1] > 1 and fits[-1] not in out:
            out.append(fits[-1])
    return out


def in_space(plan, options: SolverOptions, cluster) -> bool:
    """Whether a plan lies in the search space the options define (so the search's optimum is
    never slower than it)."""
    interleaved = plan.schedule in CHUNKED_SCHEDULES
    schedule_ok = (plan.schedule, plan.virtual_stages) in options.schedules or (
        interleaved and (plan.schedule, ANY_INTERLEAVE) in options.schedules
    )
    return (
        (not options.use_all_devices or plan.devices_used == cluster.num_devices)
        and plan.placement in options.placements
        and plan.microbatch_size in options.microbatch_sizes
        and plan.zero in options.zero_stages
        and schedule_ok
        and plan.cp in options.cp_searched(plan.seq_len)
        and all(getattr(plan, flag) == getattr(options, flag) for flag in COSTED_FLAGS)
        and (options.precision is None or plan.precision == options.precision)
        and not unrun_schedule(
            plan.schedule,
            pp=plan.pp,
            zero=plan.zero,
            compile=plan.compile,
            recompute=[s.recompute for s in plan.stages],
            pp_shard_grads=plan.pp_shard_grads,
        )
        and not schedule_microbatch_problem(plan.schedule, plan.pp, plan.num_microbatches)
        and (plan.kernels or "") == (options.kernels or "")
        and (plan.attention_kernel or "") == (options.attention_kernel or "")
        and (plan.norm_kernel or "") == (options.norm_kernel or "")
        and (plan.loss_kernel or "") == (options.loss_kernel or "")
        and not unrun_combination(
            tp=max(s.tp for s in plan.stages),
            ep=plan.ep,
            dp_shard=plan.dp_shard,
            hsdp=plan.replicate_degree > 1,
            compile=plan.compile,
            float8=plan.float8,
            async_tp=plan.async_tp,
            sequence_parallel=plan.sequence_parallel,
        )
        and (
            plan.dp_shard == 0
            or plan.dp_shard
            in shard_candidates(cluster, plan.dp, plan.stages[0].tp, plan.cp, plan.ep, plan.zero, options)
        )
        and all(s.tp in options.tp_degrees and s.recompute in options.recompute for s in plan.stages)
        and (not options.max_stages or plan.pp <= options.max_stages)
        and all(
            options.allows(name, value)
            for name, value in (
                ("tp", plan.stages[0].tp),
                ("pp", plan.pp),
                ("dp", plan.dp),
                ("ep", plan.ep),
                ("cp", plan.cp),
            )
        )
    )


def _undominated(zero_stages: Sequence[int]) -> List[int]:
    """ZeRO-1 costs what ZeRO-0 costs in communication, with less memory and a shorter
    optimizer step (it updates 1/dp of the parameters): ZeRO-0 is dominated when 1 is allowed."""
    return [z for z in zero_stages if not (z == 0 and 1 in zero_stages)]


def stage_counts(workload: Workload, cluster, g: GlobalConfig, global_batch: int, options: SolverOptions) -> List[int]:
    """Pipeline depths p admissible for g: devices, layers, and the schedule's rules."""
    m = g.microbatches(global_batch)
    most = min(len(workload), cluster.num_devices // (g.dp * g.tp * g.cp))
    if options.max_stages:
        most = min(most, options.max_stages)
    out = []
    recompute, layers = tuple(options.recompute), len(workload)
    chunked, v_shaped = g.schedule in CHUNKED_SCHEDULES, g.schedule in V_SCHEDULES
    for p in range(options.degree_bounds.get("pp", (1, 1))[0], most + 1):
        if chunked and (p < 2 or m % p or layers < p * max(g.virtual_stages, 2)):
            continue
        if v_shaped and (p < 2 or m < 2 * p or layers < 2 * p):
            continue  # Plan.validate: a V of 2 chunks per device, a microbatch per chunk at least
        if p > 1 and g.zero >= 2 and 1 in options.zero_stages and not g.pp_shard_grads:
            continue  # pipelined ZeRO-2/3 runs as ZeRO-1 (memory.effective_zero_stage): a duplicate
        if p == 1 and g.placement != options.placements[0]:
            continue  # one stage lays its replicas out the same way under every placement: a duplicate
        if options.use_all_devices and g.dp * g.tp * g.cp * p != cluster.num_devices:
            continue
        if _unrun_at(g.schedule, p, g.zero, g.compile, g.pp_shard_grads, recompute):
            continue  # the runtime does not run the schedule with these settings, or with any recompute mode
        if g.schedule == "1f1b" and schedule_microbatch_problem(g.schedule, p, m):
            continue  # the runtime refuses it (checks.run_all)
        out.append(p)
    return out


@functools.lru_cache(maxsize=4096)
def _unrun_at(
    schedule: str, p: int, zero: int, compile: bool, pp_shard_grads: bool, recompute: Tuple[str, ...]
) -> bool:
    """Whether the runtime refuses ``schedule`` on p stages with these settings, or with every
    recompute mode (``plan.may_run.unrun_schedule``, a function of its arguments: asked once)."""
    return bool(unrun_schedule(schedule, pp=p, zero=zero, compile=compile, pp_shard_grads=pp_shard_grads)) or all(
        unrun_schedule(schedule, pp=p, recompute=(r,)) for r in recompute
    )


def interleave_factors(workload: Workload, p: int) -> List[int]:
    """The interleave factors the runtime runs on ``p`` stages: every v from 2 to the layers of
    the shortest stage, at most ``len(workload) // p`` (``Plan.validate``,
    ``apply.pipeline.interleaved_ranges``)."""
    return list(range(2, len(workload) // p + 1))


def concrete(g: GlobalConfig, workload: Workload, p: int) -> List[GlobalConfig]:
    """``g`` with each interleave factor it stands for at depth ``p`` (itself when concrete)."""
    if g.schedule not in CHUNKED_SCHEDULES or g.virtual_stages != ANY_INTERLEAVE:
        return [g]
    return [dataclasses.replace(g, virtual_stages=v) for v in interleave_factors(workload, p)]


def objective(max_t: float, sum_s: float, max_q: float, m: int, schedule: str, v: int) -> float:
    """T_step from the per-stage aggregates: ``pipeline_span`` + the slowest stage tail."""
    return pipeline_span(max_t, sum_s, m, schedule, v) + max_q
