"""Step time and per-device memory of a plan: the one cost model every planner uses.

Per stage i (per microbatch, per device), from the workload's layer costs at the stage's TP
degree:

    F_i = sum_l fwd_s(l) + TP/EP collectives of the forward
    B_i = sum_l bwd_s(l) + recompute_s(l, mode) + TP/EP collectives of the backward
          (+ the forward collectives again under full recompute)
    P_i = p2p(boundary bytes / tp_{i-1}) from stage i-1 at the network level the two stages
          span, then an all-gather inside stage i's TP group (scatter/gather optimisation,
          Narayanan et al. 2021, sec. 4.1); P_0 = 0

Pipeline (t_i = F_i + B_i + 2 P_i; m microbatches; v model chunks per device):

    1F1B, GPipe:      T_pipe = (m - 1) max_i t_i + sum_i t_i          (Narayanan et al. 2021, eq. 1
                                                                      generalised to unequal stages)
    interleaved 1F1B: T_pipe = m max_i t_i + (sum_i t_i - max_i t_i) / v,  p2p counted v times
    bubble = T_pipe - m max_i t_i

Data-parallel gradient synchronisation of stage i over its DP group (ZeRO-0/1: one all-reduce
per step; ZeRO-2: a reduce-scatter per microbatch, since sharded gradients cannot be
accumulated locally, and one parameter all-gather; ZeRO-3: per microbatch a reduce-scatter
and two parameter all-gathers, prefetched under compute) starts with the stage's last
backward, so with overlap only ``max(0, sync_i - (B_i + R_i))`` is exposed (without overlap,
all of it), then the stage's optimizer step runs, memory-bound at the optimizer's update
bytes per locally updated parameter (``nest_fx.cost.optimizers``). Each stage's tail after its
last backward is

    q_i = exposed_sync_i + T_opt,i          T_step = T_pipe + max_i q_i

(conservative: a later stage finishes its last backward before stage 0 does and so could hide
more; ignoring that keeps the step time a function of per-stage terms, which the solver
needs to be exact).

Memory per device of stage i: model states (``memory.model_state_bytes``) + activations of
the stage's layers for one microbatch x in-flight microbatches of the schedule
(``memory.pipeline_inflight_microbatches``) + under full recompute one layer's full
activations (rebuilt during backward) + two boundary buffers.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from nest_fx.cluster.ordered import placed
from nest_fx.cluster.protocol import ClusterModel
from nest_fx.cost import memory
from nest_fx.cost.arrays import Count, positive_part
from nest_fx.cost.collectives import cached_collective, collective_fn, group_comm_time
from nest_fx.cost.options import CostOptions
from nest_fx.cost.results import SimResult, StageCost
from nest_fx.cost.stage_terms import LayerTerms, StageGroups, compute_terms, stage_groups
from nest_fx.plan.plan import Plan, PlanError
from nest_fx.plan.support import uncosted_fields
from nest_fx.workload.types import Comm, LayerCost, Workload

def comm_terms(distinct: Sequence[Tuple[LayerCost, Count]], recompute: str,
               seconds: Callable[[Comm], Count], overhead: Tuple[float, float] = (0.0, 0.0)) -> Tuple[Count, Count]:
    """(TP, EP) collective seconds of a stage's layers; ``seconds(comm)`` is one collective on
    the stage's slowest group (an array, one entry per stage, broadcasts against array counts).
    Full recomputation repeats the forward collectives. ``overhead``: the runtime's host work
    per call (``CostOptions.tp_call_overhead``), added to every collective that runs."""
    tp = ep = 0.0
    per_call, per_byte = overhead
    for c, count in distinct:
        weights = _host_call_weights(c.comms) if (per_call or per_byte) else None
        for k, comm in enumerate(c.comms):
            t = seconds(comm)
            if weights is not None:
                extra = weights[k] * comm.count * (per_call + per_byte * comm.nbytes)
                t = np.where(t > 0, t + extra, 0.0) if isinstance(t, np.ndarray) else (t + extra if t > 0 else t)
            repeat = 2 if (recompute == "full" and comm.phase == "fwd") else 1
            if comm.group == "tp":
                tp = tp + t * repeat * count
            else:
                ep = ep + t * repeat * count
    return tp, ep


def _host_call_weights(comms: Sequence[Comm]) -> List[float]:
    """Share of each collective that pays the runtime's host work per call. That work is per
    tensor-parallel region (the DTensor ops around it), not per collective: a sequence-parallel
    region's all-gather and reduce-scatter pair counts once, on the reduce-scatter; an
    all-gather without a partner (the logits) counts in full."""
    scatters: Dict[Tuple[str, str], int] = {}
    for comm in comms:
        if comm.kind == "reduce_scatter":
            scatters[(comm.group, comm.phase)] = scatters.get((comm.group, comm.phase), 0) + comm.count
    weights = []
    for comm in comms:
        paired = scatters.get((comm.group, comm.phase), 0) if comm.kind == "all_gather" else 0
        weights.append(max(comm.count - paired, 0) / comm.count if paired and comm.count else 1.0)
        if paired:
            scatters[(comm.group, comm.phase)] = max(paired - comm.count, 0)
    return weights


def stage_cost(workload: Workload, cluster: ClusterModel, plan: Plan, i: int, options: CostOptions) -> StageCost:
    """Per-microbatch time terms and per-device memory of stage i."""
    stage = plan.stages[i]
    sc = StageCost(index=i, layers=(stage.start, stage.end), tp=stage.tp, recompute=stage.recompute)
    groups = stage_groups(plan, i)
    variant = (plan.ep, plan.microbatch_size, plan.sequence_parallel)
    distinct = workload.range_costs(stage.start, stage.end, stage.tp, *variant)
    terms = compute_terms(distinct, stage.recompute)
    sc.tp_comm, sc.ep_comm = comm_terms(distinct, stage.recompute, lambda comm: group_comm_time(
        cluster, comm, groups.tp if comm.group == "tp" else groups.ep), options.tp_call_overhead)
    sc.fwd_compute, sc.bwd_compute, sc.recompute_s, sc.num_params = terms.fwd, terms.bwd, terms.recompute, terms.params
    if i > 0:
        prev = plan.stages[i - 1]
        sc.p2p = p2p_time(cluster, groups, workload.cost(prev.end - 1, prev.tp, *variant).out_bytes, prev.tp, stage.tp)
    # -- data-parallel sync -----------------------------------------------------------------
    dense = terms.params - terms.expert_params
    zero = memory.effective_zero_stage(plan.zero, plan.pp)
    sc.dp_sync = dp_sync_time(cluster, groups, dense, terms.expert_params, plan.dp, plan.ep, zero,
                              plan.num_microbatches, options, fsdp_units(terms))
    # -- memory -------------------------------------------------------------------------------
    inflight = memory.pipeline_inflight_microbatches(plan.schedule, i, plan.pp, plan.num_microbatches,
                                                     plan.virtual_stages)
    mem = sc.memory = memory.stage_memory(memory.model_states(dense, zero, plan.dp, options),
                                   memory.model_states(terms.expert_params, zero, max(plan.dp // plan.ep, 1), options),
                                   terms.act, terms.layer_peak, inflight,
                                   workload.cost(stage.end - 1, stage.tp, *variant).out_bytes,
                                   *memory.working_sets(terms, zero, plan.dp, options),
                                   num_microbatches=plan.num_microbatches)
    sc.fits, binding = memory.check_fits(mem, memory.usable_bytes(cluster.device.memory_bytes, options))
    sc.binding = binding or ""
    return sc


def p2p_time(cluster, groups: StageGroups, out_bytes: float, prev_tp: int, tp: int) -> float:
    """P_i: one microbatch's activations (``out_bytes``, the full tensor) from stage i-1, 1/prev_tp
    per rank point to point, then all-gathered in stage i's TP group (slowest replica checked)."""
    t = max(cached_collective("p2p", cluster, pair, out_bytes / prev_tp) for pair in groups.p2p)
    if tp > 1:
        t += max(cached_collective("all_gather", cluster, g, out_bytes) for g in groups.tp)
    return t


def fsdp_units(terms: LayerTerms) -> Count:
    """FSDP units of a stage: one per block, plus the root when it holds parameters."""
    root = terms.root_params > 0
    return terms.blocks + (root.astype(float) if isinstance(root, np.ndarray) else float(root))


def dp_sync_time(cluster, groups: StageGroups, dense_params: Count, expert_params: Count, dp: int, ep: int,
                 zero: int, num_microbatches: int, options: CostOptions, units: Count = 1.0) -> Count:
    """Seconds of gradient (and ZeRO-3 parameter) traffic of a stage per step, not yet overlapped:
    dense parameters over its DP group, expert parameters over the replicas holding the same
    experts, plus the runtime's host work per FSDP collective (``options.fsdp_call_overhead``;
    ``units`` FSDP units each run their own). Arrays of parameter counts give an array."""
    if dp <= 1:
        return 0.0
    total = _sync_volume_time(cluster, groups.dp, dense_params, zero, num_microbatches, options)
    if dp // ep > 1 and (expert_params.any() if isinstance(expert_params, np.ndarray) else expert_params):
        total = total + _sync_volume_time(cluster, groups.expert_dp, expert_params, zero, num_microbatches, options)
    per_call, per_byte = options.fsdp_call_overhead
    if zero >= 1 and (per_call or per_byte):
        m, pbytes, gbytes = num_microbatches, options.param_bytes, options.grad_bytes
        # (all-gathers, reduce-scatters) per unit and step, as the runtime issues them
        gathers, scatters = {1: (1, 1), 2: (1, m), 3: (2 * m, m)}[zero]
        params = dense_params + expert_params
        total = total + units * (gathers + scatters) * per_call + per_byte * params * (
            gathers * pbytes + scatters * gbytes)
    return total


def _sync_volume_time(cluster, group: Sequence[int], params: Count, zero: int, m: int,
                      options: CostOptions) -> Count:
    """Seconds of one stage's gradient (and ZeRO-2/3 parameter) traffic over ``group`` for
    ``params`` parameters (a number, or an array of them: ``collective_fn`` takes either)."""
    if len(group) <= 1:
        return 0.0
    gbytes, pbytes = options.grad_bytes, options.param_bytes
    if zero <= 1:
        return collective_fn("all_reduce", cluster, group)(params * gbytes)
    rs = collective_fn("reduce_scatter", cluster, group)(params * gbytes)
    ag = collective_fn("all_gather", cluster, group)(params * pbytes)
    if zero == 2:  # sharded gradients cannot accumulate: one reduce-scatter per microbatch
        return m * rs + ag
    return m * (rs + 2 * ag)  # ZeRO-3 also gathers parameters for each forward and backward


def tail_terms(dp_sync: Count, bwd: Count, recompute_s: Count, num_params: Count, dp: int, zero: int, cluster,
               options: CostOptions) -> Tuple[Count, Count]:
    """(exposed DP sync, optimizer step) after a stage's last backward, from its terms."""
    # the runtime syncs ZeRO-0 gradients after backward (GradientSync); FSDP overlaps its own
    window = bwd + recompute_s if options.overlap_grad_sync and zero >= 1 else 0.0
    exposed = positive_part(dp_sync - window)
    updated = num_params / (dp if zero >= 1 else 1)
    t_opt = updated * options.update_bytes_per_param() / (cluster.device.mem_bandwidth * options.optimizer_mem_efficiency)
    return exposed, t_opt


def stage_tail(sc: StageCost, plan: Plan, cluster, options: CostOptions) -> Tuple[float, float]:
    """(exposed DP sync, optimizer step) of a stage after its last backward: q_i's two terms."""
    return tail_terms(sc.dp_sync, sc.bwd_compute, sc.recompute_s, sc.num_params, plan.dp, plan.zero, cluster, options)


def pipeline_span(max_t: float, sum_t: float, m: int, schedule: str, v: int = 1) -> float:
    """T_pipe from max_i t_i and sum_i t_i (see module docstring); monotone in both."""
    if schedule == "interleaved" and v > 1:
        return m * max_t + (sum_t - max_t) / v
    return (m - 1) * max_t + sum_t


def pipeline_time(stage_times: Sequence[float], m: int, schedule: str, v: int = 1) -> Tuple[float, float]:
    """(T_pipe, bubble) for per-microbatch stage times t_i."""
    t_max = max(stage_times)
    total = pipeline_span(t_max, sum(stage_times), m, schedule, v)
    return total, total - m * t_max


def check_variants(plan: Plan, workload: Workload) -> None:
    """PlanError when a stage asks for a (tp, ep) variant the workload has no cost for: a degree
    that does not divide the model's heads/FFN/experts, or one a layer table does not list; or
    for a parallelism the cost model does not cost yet."""
    unsupported = uncosted_fields(plan)
    if unsupported:
        raise PlanError(f"{', '.join(unsupported)}: the cost model does not cost this yet; plan without it")
    for i, stage in enumerate(plan.stages):
        problem = workload.variant_problem(stage.tp, plan.ep, plan.sequence_parallel)
        if problem:
            raise PlanError(f"stages[{i}]: {problem} (a plan for another model, or a layer table "
                            "without this variant?)")


def simulate(plan: Plan, workload: Workload, cluster: ClusterModel, options: Optional[CostOptions] = None) -> SimResult:
    """Predict step time, throughput and per-device memory of ``plan`` (validated first), with
    its plan ranks on the cluster ranks its ``device_order`` names (``cost.placement.placed``)."""
    options = options or CostOptions()
    plan.validate(num_layers=len(workload), world_size=cluster.num_devices)
    plan.check_model(workload.fingerprint, f"the workload ({workload.model})")
    check_variants(plan, workload)
    cluster = placed(cluster, plan.device_order)
    stages = [stage_cost(workload, cluster, plan, i, options) for i in range(plan.pp)]
    v = plan.virtual_stages if plan.schedule == "interleaved" else 1
    times = [s.per_microbatch(v) for s in stages]
    m = plan.num_microbatches
    t_pipe, bubble = pipeline_time(times, m, plan.schedule, v)
    tails = [stage_tail(s, plan, cluster, options) for s in stages]
    last = max(range(len(stages)), key=lambda k: tails[k][0] + tails[k][1])
    exposed, t_opt = tails[last]
    step = t_pipe + exposed + t_opt
    b = max(range(len(stages)), key=lambda k: times[k])
    bott = stages[b]
    breakdown = {
        "compute": m * (bott.fwd_compute + bott.bwd_compute),
        "recompute": m * bott.recompute_s,
        "tp_comm": m * bott.tp_comm,
        "ep_comm": m * bott.ep_comm,
        "p2p": m * 2 * bott.p2p * v,
        "bubble": bubble,
        "dp_sync_exposed": exposed,
        "optimizer": t_opt,
        "step": step,
    }
    tokens = plan.global_batch * workload.dims.seq_len
    model_flops = 3 * workload.flops_per_sample * plan.global_batch
    recompute_flops = sum(_recompute_flops(workload, plan, s) for s in plan.stages) * plan.dp * m
    used = plan.devices_used
    infeasible = [s for s in stages if not s.fits]
    binding = ""
    if infeasible:
        worst = max(infeasible, key=lambda s: s.memory["total"])
        binding = (f"stage {worst.index}: memory {worst.memory['total'] / 2**30:.1f} GiB > "
                   f"{memory.usable_bytes(cluster.device.memory_bytes, options) / 2**30:.1f} GiB usable "
                   f"(largest term: {worst.binding})")
    return SimResult(
        step_s=step, breakdown=breakdown, tokens_per_s=tokens / step,
        model_flops_per_device=model_flops / step / used,
        hardware_flops_per_device=(model_flops + recompute_flops) / step / used,
        stages=stages, feasible=not infeasible, binding=binding, devices_used=used,
        world_size=cluster.num_devices)


def _recompute_flops(workload: Workload, plan: Plan, stage) -> float:
    """Forward FLOPs redone in backward per microbatch and replica (full: all; selective: ~0)."""
    if stage.recompute != "full":
        return 0.0
    return sum(workload.layers[k].flops_per_sample for k in range(stage.start, stage.end)) * plan.microbatch_size
