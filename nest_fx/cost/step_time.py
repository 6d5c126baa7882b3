"""Step time and per-device memory of a plan: the one cost model every planner uses.

Per stage i (per microbatch, per device), from the workload's layer costs at the stage's
variant (TP degree, EP, microbatch, SP, CP degree, loss parallelism; ``Workload.cost``):

    W_i = sum_l fwd_s(l) + bwd_s(l) + recompute_s(l, policy) + TP/EP/CP collectives
          (a block's forward collectives again where its recompute re-runs them:
          ``stage_terms.repeated_share``; of each, the part its overlap share leaves
          exposed: ``exposed_comms``)
    P_i = p2p(boundary bytes / cp) from each TP rank of stage i-1 to its peer in stage i, at
          the network level the two stages span, as the runtime sends it (``p2p_time``): under
          sequence parallelism a layer block's output is each rank's sequence shard (1 / tp of
          it, no collective at the boundary); otherwise (no SP, or the head's output) the whole
          tensor; P_0 = 0
    (t_i, s_i) = results.microbatch_time(W_i, P_i, v, overlap_p2p)

Pipeline (m microbatches; v model chunks per device):

    1F1B, GPipe:      T_pipe = (m - 1) max_i t_i + sum_i s_i       (Narayanan et al. 2021, eq. 1
                                                                   generalised to unequal stages)
    interleaved 1F1B: T_pipe = m max_i t_i + (sum_i s_i - max_i t_i) / v
    zero bubble (interleaved-zb, zbv, dualpipev): the same with the factor of ``cost/schedules.py``
    bubble = T_pipe - m max_i t_i

Data-parallel gradient synchronisation (``cost/dp_sync.py``) of stage i over its DP x CP group (ZeRO-0/1: one
all-reduce per step; ZeRO-2: a reduce-scatter per microbatch, since sharded gradients cannot be
accumulated locally, and one parameter all-gather; ZeRO-3: per microbatch a reduce-scatter
and two parameter all-gathers, prefetched under compute; HSDP: the same inside the shard group
plus an all-reduce of the shard across the replicas) starts with the stage's last backward, so
with overlap only ``max(0, sync_i - (B_i + R_i))`` is exposed (without overlap, all of it); a
tied embedding's gradient is then exchanged between the first and last stage; then the
stage's optimizer step runs, memory-bound at the optimizer's update bytes per locally updated
parameter (``nest_fx.cost.optimizers``). Each stage's tail after its last backward is

    q_i = exposed_sync_i + tied_sync_i + T_opt,i          T_step = T_pipe + max_i q_i

(conservative: a later stage finishes its last backward before stage 0 does and so could hide
more; ignoring that keeps the step time a function of per-stage terms, which the solver
needs to be exact).

Memory per device of stage i: model states (``memory.model_state_bytes``, sharded over the DP x
CP ranks or the HSDP shard group; a tied LM head's second copy on the last stage) + the
activations the schedule keeps in flight (``inflight.held_activation_bytes``) + the largest
one-layer backward working set + two boundary buffers + the runtime's working sets; it fits when
what the caching allocator reserves for it fits (``memory.usable_bytes``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from nest_fx.cluster.ordered import placed
from nest_fx.cluster.protocol import ClusterModel
from nest_fx.cost import inflight, memory
from nest_fx.cost.arrays import Count, any_nonzero, positive_part
from nest_fx.cost.collectives import cached_collective, group_comm_time
from nest_fx.cost.recv_buffers import recv_buffer_bytes
from nest_fx.workload.expert_dispatch import dispatched_comm
from nest_fx.cost.dp_sync import (
    dp_sync_time,
    expert_shard_degree,
    fsdp_units,
    reduce_spread,
    shard_degree,
    tail_terms,
    tied_sync_time,
)
from nest_fx.cost.error_bands import error_band
from nest_fx.cost.options import CostOptions, with_async_tp
from nest_fx.cost.precision import compute_dtype, priced_options
from nest_fx.cost.results import SimResult, StageCost
from nest_fx.cost.schedules import bubble_factor
from nest_fx.cost.stage_terms import (
    LayerTerms,
    StageGroups,
    compute_terms,
    repeated_share,
    recomputed_counts,
    stage_groups,
)
from nest_fx.graph.recompute_policies import cost_key, parse_recompute, recompute_policy_problem
from nest_fx.plan.may_run import device_problems
from nest_fx.plan.plan import Plan, PlanError
from nest_fx.workload.types import Comm, LayerCost, Variant, Workload, WorkloadError

COMM_KEYS = ("tp", "ep", "cp")


def comm_terms(
    distinct: Sequence[Tuple[LayerCost, Count]],
    recompute: str,
    seconds: Callable[[Comm], Count],
    overhead: Tuple[float, float] = (0.0, 0.0),
) -> Dict[str, Count]:
    """TP, EP and CP collective seconds of a stage's layers (keys ``tp``, ``ep``, ``cp``);
    ``seconds(comm)`` is one collective on the stage's slowest group (an array, one entry per
    stage, broadcasts against array counts). A block's forward collectives run again where its
    recompute re-runs them (``stage_terms.repeated_share``; ``every:<k>`` for the blocks it
    recomputes). ``overhead``: the runtime's host work per call (``CostOptions.tp_call_overhead``),
    added to every collective that runs."""
    out: Dict[str, Count] = dict.fromkeys(COMM_KEYS, 0.0)
    per_call, per_byte = overhead
    spec = parse_recompute(recompute)
    full = recomputed_counts(distinct, spec.every) if spec.kind == "every" else None
    for j, (c, count) in enumerate(distinct):
        weights = _host_call_weights(c.comms) if (per_call or per_byte) else None
        for k, comm in enumerate(c.comms):
            t = seconds(comm)
            if weights is not None:
                extra = weights[k] * comm.count * (per_call + per_byte * comm.nbytes)
                t = np.where(t > 0, t + extra, 0.0) if isinstance(t, np.ndarray) else (t + extra if t > 0 else t)
            if not c.block:
                runs = count
            elif full is not None:
                runs = count + full[j] * repeated_share(comm, "full")
            else:
                runs = count * (1 + repeated_share(comm, recompute))
            out[comm.group] = out[comm.group] + t * runs
    return out


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


def held_terms(terms: LayerTerms, num_stages: int) -> LayerTerms:
    """A stage's terms with the parameters it holds: under pipelining the last stage keeps its own
    copy of a tied embedding (``apply.tied_weights``; weights, gradients and optimizer states, in
    its root FSDP unit), which the trace counts once, at the head."""
    if num_stages == 1 or not any_nonzero(terms.tied_params):
        return terms
    return dataclasses.replace(
        terms, params=terms.params + terms.tied_params, root_params=terms.root_params + terms.tied_params
    )


def exposed_comms(comms: Dict[str, Count], work: Count, options: CostOptions) -> Dict[str, Count]:
    """The TP, EP and CP collective seconds left on the critical path (``docs/cost_model.md``,
    "Overlap"): of each group's seconds ``c``, the share ``f`` its overlap option names
    (``overlap_tp_comm``, ``overlap_ep_comm``, ``overlap_cp_comm``) may run under the stage's
    compute ``work``, which hides at most itself once over all groups (TP first, then EP, then
    CP): exposed = c - min(f c, compute not yet used). All shares 0 (the runtime): all of them."""
    left = work
    out: Dict[str, Count] = {}
    for key in COMM_KEYS:
        share = float(getattr(options, f"overlap_{key}_comm"))
        c = comms[key]
        if share <= 0:
            out[key] = c
            continue
        hidden = (
            np.minimum(share * c, left)
            if isinstance(c, np.ndarray) or isinstance(left, np.ndarray)
            else min(share * c, left)
        )
        out[key] = c - hidden
        left = left - hidden
    return out


def exposed_ring(cp_comm: Count, fwd: Count) -> Count:
    """CP seconds left on the critical path under ring attention (``plan.cp_mode = "ring"``,
    ``apply/ring_attention.py``): the K/V bytes are those the all-gather mode moves (``cp_comm``:
    the forward gather and the backward reduce-scatter, half each); the forward's block transfers
    run under the stage's forward compute, the backward's reverse shifts are not overlapped."""
    return cp_comm / 2 + positive_part(cp_comm / 2 - fwd)


def stage_cost(workload: Workload, cluster: ClusterModel, plan: Plan, i: int, options: CostOptions) -> StageCost:
    """Per-microbatch time terms and per-device memory of stage i (``workload`` already costed
    for the plan's compile/float8: ``Workload.for_runtime``)."""
    stage = plan.stages[i]
    sc = StageCost(
        index=i,
        layers=(stage.start, stage.end),
        tp=stage.tp,
        recompute=stage.recompute,
        overlap_p2p=options.overlap_p2p,
    )
    groups = stage_groups(plan, i)
    variant = stage_variant(plan, i)
    distinct = workload.range_costs(stage.start, stage.end, variant)
    terms = held_terms(compute_terms(distinct, stage.recompute), plan.pp)
    by_group = {"tp": groups.tp, "ep": groups.ep, "cp": groups.cp}
    comms = comm_terms(
        distinct,
        stage.recompute,
        lambda comm: group_comm_time(
            cluster, dispatched_comm(comm, options.expert_dispatch, options.expert_routing), by_group[comm.group]
        ),
        options.tp_call_overhead,
    )
    sc.fwd_compute, sc.bwd_compute, sc.recompute_s, sc.num_params = terms.fwd, terms.bwd, terms.recompute, terms.params
    exposed = exposed_comms(comms, terms.fwd + terms.bwd + terms.recompute, options)
    sc.tp_comm, sc.ep_comm, sc.cp_comm = exposed["tp"], exposed["ep"], exposed["cp"]
    if plan.cp_mode == "ring":
        sc.cp_comm = exposed_ring(comms["cp"], terms.fwd)
    if i > 0:
        prev = plan.stages[i - 1]
        before = workload.cost(prev.end - 1, variant._replace(tp=prev.tp))
        sc.p2p = p2p_time(
            cluster,
            groups,
            before.out_bytes / plan.cp,
            prev.tp,
            stage.tp,
            plan.sequence_parallel and before.block,
            stage_groups(plan, i - 1).tp if prev.tp != stage.tp else (),
        )
    # -- data-parallel sync -----------------------------------------------------------------
    dense = terms.params - terms.expert_params
    zero = memory.effective_zero_stage(plan.zero, plan.pp, plan.pp_shard_grads)
    shard = shard_degree(plan.dp, plan.dp_shard, plan.cp)
    sc.dp_sync = dp_sync_time(
        cluster,
        groups,
        dense,
        terms.expert_params,
        plan.dp * plan.cp,
        plan.ep,
        zero,
        plan.num_microbatches,
        options,
        fsdp_units(terms),
        terms.fp8_params if plan.float8 else 0.0,
    )
    sc.tied_sync = tied_sync_time(cluster, groups, tied_params(workload, variant), zero, shard, options)
    # -- memory -------------------------------------------------------------------------------
    out_bytes = workload.cost(stage.end - 1, variant).out_bytes / plan.cp
    sp_degree = stage.tp if plan.sequence_parallel else 1
    act = memory.held_per_microbatch(terms.act, out_bytes, plan.pp, plan.virtual_stages, options, sp_degree)
    held = inflight.held_activation_bytes(
        act, terms.act_root, plan.schedule, i, plan.pp, plan.num_microbatches, plan.virtual_stages
    )
    piped = plan.pp > 1
    in_bytes = workload.cost(stage.start - 1, variant).out_bytes / plan.cp if stage.start > 0 else 0.0
    buffers = recv_buffer_bytes(
        out_bytes, in_bytes, i, plan.pp, plan.num_microbatches, plan.virtual_stages, plan.schedule, options, sp_degree
    )
    mem = sc.memory = memory.stage_memory(
        memory.model_states(dense, zero, shard, options, piped),
        memory.model_states(
            terms.expert_params, zero, expert_shard_degree(plan.dp, plan.dp_shard, plan.ep, plan.cp), options, piped
        ),
        held,
        terms.layer_peak,
        out_bytes,
        *memory.working_sets(terms, zero, shard, options, cluster.device),
        num_microbatches=plan.num_microbatches,
        options=options,
        buffers=buffers,
    )
    sc.reserved = memory.reserved_bytes(mem["total"], options)
    sc.fits, binding = memory.check_fits(mem, memory.usable_bytes(cluster.device.memory_bytes, options))
    sc.binding = binding or ""
    return sc


def stage_variant(plan: Plan, i: int) -> Variant:
    """The workload variant stage ``i`` of ``plan`` runs (``Workload.cost``)."""
    return Variant(
        plan.stages[i].tp, plan.ep, plan.microbatch_size, plan.sequence_parallel, plan.cp, plan.loss_parallel
    )


def tied_params(workload: Workload, variant: Variant) -> float:
    """Parameters of the embedding a tied LM head shares (``LayerCost.tied_params`` of the
    tail; 0 when untied)."""
    return workload.cost(len(workload) - 1, variant).tied_params


def p2p_time(
    cluster,
    groups: StageGroups,
    out_bytes: float,
    prev_tp: int,
    tp: int,
    sequence_shard: bool = False,
    prev_tp_groups: Sequence[Sequence[int]] = (),
) -> float:
    """P_i: one microbatch's activation (``out_bytes``, one CP rank's full tensor) crossing from
    stage i-1 into stage i, as nest-fx's runtime sends it (slowest replica checked; the TP ranks'
    sends run side by side). ``sequence_shard``: sequence parallelism and the tensor is a layer
    block's output: each TP rank sends its ``1 / tp`` shard to its peer and no collective runs
    at the boundary (the next block's first region all-gathers its input anyway, priced per
    layer; ``apply.tensor_parallel.sharded_cut``). Otherwise every TP rank sends the whole
    tensor, which its TP group holds replicated (no SP) or which is the head's full output.

    Stages of different TP degrees (which the runtime refuses: ``apply.mesh.require_uniform_tp``)
    are priced as the gather/slice boundary such a runtime keeps: the whole tensor per rank and,
    under sequence parallelism, the sender's all-gather (forward, in ``prev_tp_groups``) and the
    receiver's slice's backward all-gather (in stage i's groups), split over P_i's two crossings."""
    if prev_tp != tp:
        t = max(cached_collective("p2p", cluster, pair, out_bytes) for pair in groups.p2p)
        if sequence_shard:
            gathers = [
                max(cached_collective("all_gather", cluster, g, out_bytes) for g in side)
                for side in (prev_tp_groups, groups.tp)
                if side and len(side[0]) > 1
            ]
            t += sum(gathers) / 2
        return t
    nbytes = boundary_bytes(out_bytes, tp, sequence_shard)
    return max(cached_collective("p2p", cluster, pair, nbytes) for pair in groups.p2p)


def boundary_bytes(out_bytes: float, tp: int, sequence_shard: bool) -> float:
    """Bytes each TP rank sends across a stage boundary per microbatch and direction (the
    activation forward, its gradient backward) between stages of TP degree ``tp``: its sequence
    shard under sequence parallelism after a layer block, else the whole tensor (``p2p_time``)."""
    return out_bytes / tp if sequence_shard else out_bytes


def stage_tail(sc: StageCost, plan: Plan, cluster, options: CostOptions) -> Tuple[float, float]:
    """(exposed DP sync and tied exchange, optimizer step) of a stage after its last backward:
    q_i's terms."""
    return tail_terms(
        sc.dp_sync,
        sc.bwd_compute,
        sc.recompute_s,
        sc.num_params,
        shard_degree(plan.dp, plan.dp_shard, plan.cp),
        plan.zero,
        cluster,
        options,
        sc.tied_sync,
        reduce_spread(
            memory.effective_zero_stage(plan.zero, plan.pp, plan.pp_shard_grads), plan.pp, plan.num_microbatches
        ),
    )


def pipeline_span(max_t: float, sum_s: float, m: int, schedule: str, v: int = 1) -> float:
    """T_pipe from max_i t_i and sum_i s_i (see module docstring); monotone in both."""
    return m * max_t + (sum_s - max_t) * bubble_factor(schedule, v)


def pipeline_time(
    stage_times: Sequence[float], m: int, schedule: str, v: int = 1, spans: Optional[Sequence[float]] = None
) -> Tuple[float, float]:
    """(T_pipe, bubble) for per-microbatch stage times t_i and spans s_i (``microbatch_time``;
    default: the times, as without overlapped sends)."""
    t_max = max(stage_times)
    total = pipeline_span(t_max, sum(stage_times if spans is None else spans), m, schedule, v)
    return total, total - m * t_max


def check_variants(plan: Plan, workload: Workload) -> None:
    """PlanError when a stage asks for a variant the workload has no cost for: a TP/EP/CP degree
    that does not divide the model's heads/FFN/experts/sequence, one a layer table does not
    list, loss parallelism on a tied LM head, or a recompute policy the runtime does not know or
    a layer table does not cost."""
    for i, stage in enumerate(plan.stages):
        variant = stage_variant(plan, i)
        problem = workload.variant_problem(variant._replace(loss_parallel=plan.loss_parallel and i == plan.pp - 1))
        if problem:
            raise PlanError(
                f"stages[{i}]: {problem} (a plan for another model, or a layer table without this variant?)"
            )
        have = workload.recompute_policies(variant)
        problem = recompute_policy_problem(stage.recompute)
        if problem:
            raise PlanError(f"stages[{i}]: {problem}")
        spec = parse_recompute(stage.recompute)
        needed = ("none", "full") if spec.kind == "every" else (cost_key(stage.recompute),)
        missing = [k for k in needed if k not in have]
        if missing:
            raise PlanError(
                f"stages[{i}].recompute={stage.recompute}: the layer table gives no costs for "
                f"{missing[0]!r}; it costs {list(have)}"
            )


def simulate(plan: Plan, workload: Workload, cluster: ClusterModel, options: Optional[CostOptions] = None) -> SimResult:
    """Predict step time, throughput and per-device memory of ``plan`` (validated first), with
    its plan ranks on the cluster ranks its ``device_order`` names (``cost.placement.placed``),
    its layers costed as the plan runs them (``kernels``, ``compile``, ``float8``, the compute dtype of its
    ``precision``: ``Workload.for_runtime``) and its model states and gradient traffic in the
    bytes of its precision (``cost.precision``; a plan that records none: ``options`` as given)."""
    options = priced_options(plan.precision, options or CostOptions())
    if plan.async_tp:  # micro-pipelined TP: the TP collectives run under the matmuls (exposed_comms)
        options = with_async_tp(options)
    plan.validate(num_layers=len(workload), world_size=cluster.num_devices)
    plan.check_model(workload.fingerprint, f"the workload ({workload.model})")
    for problem in device_problems(cluster.device, float8=plan.float8):
        raise PlanError(problem)
    try:
        workload = workload.for_runtime(
            plan.compile,
            plan.float8,
            compute_dtype(plan.precision),
            plan.kernels,
            plan.attention_kernel,
            plan.norm_kernel,
            plan.loss_kernel,
            plan.cp_mode if plan.cp > 1 else "",
        )
    except WorkloadError as exc:
        raise PlanError(str(exc)) from None
    check_variants(plan, workload)
    cluster = placed(cluster, plan.device_order)
    try:
        stages = [stage_cost(workload, cluster, plan, i, options) for i in range(plan.pp)]
    except ValueError as exc:  # e.g. float8 on a device without an fp8 rate
        raise PlanError(str(exc)) from None
    v = plan.virtual_stages  # model chunks per device (1 unless the schedule runs several)
    times = [s.per_microbatch(v) for s in stages]
    m = plan.num_microbatches
    t_pipe, bubble = pipeline_time(times, m, plan.schedule, v, [s.span(v) for s in stages])
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
        "cp_comm": m * bott.cp_comm,
        "p2p": m * (times[b] - bott.work),
        "bubble": bubble,
        "dp_sync_exposed": exposed - stages[last].tied_sync,
        "tied_grad_sync": stages[last].tied_sync,
        "optimizer": t_opt,
        "step": step,
    }
    tokens = plan.global_batch * workload.dims.seq_len
    model_flops = 3 * workload.flops_per_sample * plan.global_batch
    recompute_flops = sum(_recompute_flops(workload, plan, s, sc) for s, sc in zip(plan.stages, stages)) * plan.dp * m
    used = plan.devices_used
    infeasible = [s for s in stages if not s.fits]
    binding = ""
    if infeasible:
        worst = max(infeasible, key=lambda s: s.memory["total"])
        binding = (
            f"stage {worst.index}: memory {worst.memory['total'] / 2**30:.1f} GiB (reserved "
            f"{worst.reserved / 2**30:.1f} GiB) > "
            f"{memory.usable_bytes(cluster.device.memory_bytes, options) / 2**30:.1f} GiB usable "
            f"(largest term: {worst.binding})"
        )
    band = error_band(plan, cluster.device.name)
    return SimResult(
        error_band=band.rel,
        error_basis=band.basis,
        step_s=step,
        breakdown=breakdown,
        tokens_per_s=tokens / step,
        model_flops_per_device=model_flops / step / used,
        hardware_flops_per_device=(model_flops + recompute_flops) / step / used,
        stages=stages,
        feasible=not infeasible,
        peak_reserved=max(s.reserved for s in stages),
        binding=binding,
        devices_used=used,
        world_size=cluster.num_devices,
    )


def _recompute_flops(workload: Workload, plan: Plan, stage, sc: StageCost) -> float:
    """Forward FLOPs redone in backward per microbatch and replica: the stage's forward FLOPs in
    the proportion of its recompute seconds to its forward seconds."""
    if sc.recompute_s <= 0 or sc.fwd_compute <= 0:
        return 0.0
    flops = sum(workload.layers[k].flops_per_sample for k in range(stage.start, stage.end)) * plan.microbatch_size
    return flops * sc.recompute_s / sc.fwd_compute
