"""The search space: global knobs of a plan and lower bounds used to order and prune them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Mapping, Optional, Sequence, Tuple

from nest_fx.common.arith import divisors
from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import pipeline_span
from nest_fx.plan.constraints import Constraints
from nest_fx.workload import Workload


@dataclass
class SolverOptions:
    """What the planner may choose. Defaults follow common practice (Megatron-LM, torchtitan)."""

    tp_degrees: Sequence[int] = (1, 2, 4, 8)
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8)
    zero_stages: Sequence[int] = (0, 1, 2, 3)
    recompute: Sequence[str] = ("none", "selective", "full")
    schedules: Sequence[Tuple[str, int]] = (("1f1b", 1), ("interleaved", 2))
    placements: Sequence[str] = ("stage-major", "replica-major")
    ep_degrees: Optional[Sequence[int]] = None  # None: every divisor of the expert count
    tp_within_node: bool = True  # keep TP groups inside the innermost network level
    sequence_parallel: bool = True  # use SP whenever tp > 1 (same traffic, less memory)
    max_stages: Optional[int] = None
    use_all_devices: bool = False  # the runtime needs world size == devices used (no idle ranks)
    time_budget: Optional[float] = None  # seconds; None = search to optimality
    search_placement: bool = True  # graph topologies: also choose the device order (solver.placement)
    cost: CostOptions = field(default_factory=CostOptions)
    # (lowest, highest) of a degree: "tp", "pp", "dp", "ep"; absent = unbounded (solver.constraints)
    degree_bounds: Mapping[str, Tuple[int, int]] = field(default_factory=dict)
    constraints: Optional[Constraints] = None  # the user's, recorded in the plan (solver.constraints)

    def allows(self, degree: str, value: int) -> bool:
        """Whether ``degree`` (tp, pp, dp, ep) may take ``value`` under :attr:`degree_bounds`."""
        lo, hi = self.degree_bounds.get(degree, (1, value))
        return lo <= value <= hi


@dataclass(frozen=True)
class GlobalConfig:
    """Knobs shared by all stages of a plan (the outer loop of the search)."""

    tp: int
    dp: int
    ep: int
    mbs: int
    zero: int
    schedule: str
    v: int
    placement: str
    sp: bool

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.mbs)


def global_configs(workload: Workload, cluster, global_batch: int, options: SolverOptions) -> Iterator[GlobalConfig]:
    """Every admissible combination of the global knobs."""
    node = cluster.levels[0].group_size
    if workload.is_moe:
        eps = list(options.ep_degrees) if options.ep_degrees else divisors(max(workload.dims.num_experts, 1))
    else:
        eps = [1]
    # (tp, ep) variants the workload has costs for (a layer table may list only some)
    variants = [(tp, ep) for tp in options.tp_degrees for ep in eps
                if tp <= cluster.num_devices and (not options.tp_within_node or tp <= node)
                and options.allows("tp", tp) and options.allows("ep", ep)
                and workload.supports(tp, ep, options.sequence_parallel and tp > 1)]
    for mbs in options.microbatch_sizes:
        if global_batch % mbs:
            continue
        for dp in (d for d in divisors(global_batch // mbs) if options.allows("dp", d)):
            for tp, ep in variants:
                if dp * tp > cluster.num_devices or dp % ep:
                    continue
                for zero in _undominated(options.zero_stages):
                    for schedule, v in options.schedules:
                        for placement in options.placements:
                            yield GlobalConfig(tp=tp, dp=dp, ep=ep, mbs=mbs, zero=zero, schedule=schedule,
                                               v=v if schedule == "interleaved" else 1, placement=placement,
                                               sp=options.sequence_parallel and tp > 1)


def in_space(plan, options: SolverOptions, cluster) -> bool:
    """Whether a plan lies in the search space the options define (so the search's optimum is
    never slower than it)."""
    return ((not options.use_all_devices or plan.devices_used == cluster.num_devices)
            and plan.placement in options.placements and plan.microbatch_size in options.microbatch_sizes
            and plan.zero in options.zero_stages and (plan.schedule, plan.virtual_stages) in options.schedules
            and all(s.tp in options.tp_degrees and s.recompute in options.recompute for s in plan.stages)
            and (not options.max_stages or plan.pp <= options.max_stages)
            and all(options.allows(name, value) for name, value in (("tp", plan.stages[0].tp), ("pp", plan.pp),
                                                                    ("dp", plan.dp), ("ep", plan.ep))))


def _undominated(zero_stages: Sequence[int]) -> List[int]:
    """ZeRO-1 costs what ZeRO-0 costs in communication, with less memory and a shorter
    optimizer step (it updates 1/dp of the parameters): ZeRO-0 is dominated when 1 is allowed."""
    return [z for z in zero_stages if not (z == 0 and 1 in zero_stages)]


def stage_counts(workload: Workload, cluster, g: GlobalConfig, global_batch: int,
                 options: SolverOptions) -> List[int]:
    """Pipeline depths p admissible for g: devices, layers, and the schedule's rules."""
    m = g.microbatches(global_batch)
    most = min(len(workload), cluster.num_devices // (g.dp * g.tp))
    if options.max_stages:
        most = min(most, options.max_stages)
    out = []
    for p in range(options.degree_bounds.get("pp", (1, 1))[0], most + 1):
        if g.schedule == "interleaved" and (p < 2 or m % p or len(workload) < p * g.v):
            continue
        if options.use_all_devices and g.dp * g.tp * p != cluster.num_devices:
            continue
        if p > 1 and g.zero >= 2 and 1 in options.zero_stages:
            continue  # pipelined ZeRO-2/3 runs as ZeRO-1 (memory.effective_zero_stage): a duplicate
        if p == 1 and g.placement != options.placements[0]:
            continue  # one stage lays its replicas out the same way under every placement: a duplicate
        out.append(p)
    return out


def objective(max_t: float, sum_t: float, max_q: float, m: int, schedule: str, v: int) -> float:
    """T_step from the per-stage aggregates: ``pipeline_span`` + the slowest stage tail."""
    return pipeline_span(max_t, sum_t, m, schedule, v) + max_q
