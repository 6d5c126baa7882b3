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
all of it), then the stage's optimizer step runs, memory-bound at ``bytes_per_param_update``
bytes per locally updated parameter. Each stage's tail after its last backward is

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

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from nest_fx.cost import collectives, memory
from nest_fx.plan import Plan
from nest_fx.workload import Comm, Workload

USABLE_MEMORY_FRACTION = 0.95  # CUDA context and allocator fragmentation take the rest


@dataclass
class CostOptions:
    """Knobs of the cost model that are not part of the plan."""

    optimizer: str = "adam"
    param_bytes: int = 2  # training dtype (bf16)
    grad_bytes: int = 2
    overlap_grad_sync: bool = True
    bytes_per_param_update: float = 36.0  # Adam, mixed precision: read/write fp32 p, m, v + grads + bf16 copy
    optimizer_mem_efficiency: float = 0.7
    usable_memory_fraction: float = USABLE_MEMORY_FRACTION


@dataclass
class StageCost:
    """Per-microbatch time and per-device memory of one stage."""

    index: int
    layers: Tuple[int, int]
    tp: int
    recompute: str
    fwd_compute: float = 0.0
    bwd_compute: float = 0.0
    recompute_s: float = 0.0
    tp_comm: float = 0.0
    ep_comm: float = 0.0
    p2p: float = 0.0
    dp_sync: float = 0.0
    num_params: float = 0.0
    memory: Dict[str, float] = field(default_factory=dict)
    fits: bool = True
    binding: str = ""

    def per_microbatch(self, v: int = 1) -> float:
        """t_i: forward + backward + recompute + collectives + both p2p directions (v chunks)."""
        return self.fwd_compute + self.bwd_compute + self.recompute_s + self.tp_comm + self.ep_comm + 2 * self.p2p * v


@dataclass
class SimResult:
    """Step-time breakdown, throughput and memory of one plan."""

    step_s: float
    breakdown: Dict[str, float]
    tokens_per_s: float
    model_flops_per_device: float  # 6*N-style model FLOPs (no recompute) per second per device
    hardware_flops_per_device: float  # including recomputation
    stages: List[StageCost]
    feasible: bool
    binding: str  # "" when feasible, else "stage i: <term>"
    devices_used: int
    world_size: int

    def to_dict(self) -> dict:
        return asdict(self)


_COLLECTIVE_CACHE: Dict[tuple, float] = {}


def cached_collective(kind: str, cluster, group: Sequence[int], nbytes: float) -> float:
    """``collectives.collective_time`` (or ``p2p`` for kind "p2p", group = (src, dst)) memoised per
    (cluster, kind, group, bytes): the solver asks for the same few groups millions of times."""
    key = (cluster.num_devices, tuple((lv.group_size, lv.bandwidth, lv.latency) for lv in cluster.levels),
           kind, tuple(group), nbytes)
    t = _COLLECTIVE_CACHE.get(key)
    if t is None:
        if len(_COLLECTIVE_CACHE) > 1_000_000:
            _COLLECTIVE_CACHE.clear()
        if kind == "p2p":
            t = collectives.p2p(cluster, group[0], group[1], nbytes)
        else:
            t = collectives.collective_time(kind, cluster, group, nbytes)
        _COLLECTIVE_CACHE[key] = t
    return t


def comm_time(cluster, comm: Comm, group: Sequence[int]) -> float:
    """Seconds of one in-layer collective (``count`` repetitions) over ``group``."""
    if len(group) <= 1:
        return 0.0
    return comm.count * cached_collective(comm.kind, cluster, group, comm.nbytes)


def _replicas_to_check(dp: int) -> List[int]:
    return sorted({0, dp // 2, dp - 1})


def stage_cost(workload: Workload, cluster, plan: Plan, i: int, options: CostOptions) -> StageCost:
    """Per-microbatch time terms and per-device memory of stage i."""
    stage = plan.stages[i]
    sc = StageCost(index=i, layers=(stage.start, stage.end), tp=stage.tp, recompute=stage.recompute)
    replicas = _replicas_to_check(plan.dp)
    tp_groups = [plan.tp_group(i, r) for r in replicas]
    ep_groups = [plan.ep_group(i, r) for r in replicas] if plan.ep > 1 else []
    act = 0.0
    act_full_layer = 0.0
    expert_params = 0.0
    distinct = workload.range_costs(stage.start, stage.end, stage.tp, plan.ep, plan.microbatch_size,
                                    plan.sequence_parallel)
    for c, count in distinct:
        sc.fwd_compute += c.fwd_s * count
        sc.bwd_compute += c.bwd_s * count
        sc.recompute_s += c.recompute_s[stage.recompute] * count
        sc.num_params += c.num_params * count
        expert_params += c.expert_params * count
        act += c.act_bytes[stage.recompute] * count
        act_full_layer = max(act_full_layer, c.act_bytes["none"])
        for comm in c.comms:
            groups = tp_groups if comm.group == "tp" else ep_groups
            t = max((comm_time(cluster, comm, g) for g in groups), default=0.0)
            repeat = 2 if (stage.recompute == "full" and comm.phase == "fwd") else 1
            if comm.group == "tp":
                sc.tp_comm += t * repeat * count
            else:
                sc.ep_comm += t * repeat * count
    last = workload.cost(stage.end - 1, stage.tp, plan.ep, plan.microbatch_size, plan.sequence_parallel)
    if i > 0:
        sc.p2p = boundary_time(workload, cluster, plan, i, replicas)
    # -- data-parallel sync -----------------------------------------------------------------
    dense = sc.num_params - expert_params
    sc.dp_sync = _dp_sync_time(cluster, plan, i, dense, expert_params, options)
    # -- memory -------------------------------------------------------------------------------
    states = memory.model_state_bytes(dense, zero_stage=plan.zero, dp=plan.dp, optimizer=options.optimizer,
                                      param_dtype_bytes=options.param_bytes, grad_dtype_bytes=options.grad_bytes)
    expert_dp = max(plan.dp // plan.ep, 1)
    estates = memory.model_state_bytes(expert_params, zero_stage=plan.zero, dp=expert_dp, optimizer=options.optimizer,
                                       param_dtype_bytes=options.param_bytes, grad_dtype_bytes=options.grad_bytes)
    inflight = memory.pipeline_inflight_microbatches(plan.schedule, i, plan.pp, plan.num_microbatches,
                                                     plan.virtual_stages)
    mem = {k: states[k] + estates[k] for k in ("weights", "grads", "optimizer")}
    mem["activations"] = act * inflight
    if stage.recompute == "full":
        mem["activations"] += act_full_layer
    mem["buffers"] = 2 * last.out_bytes
    mem["total"] = sum(mem.values())
    sc.memory = mem
    capacity = cluster.device.memory_bytes * options.usable_memory_fraction
    sc.fits = mem["total"] <= capacity
    if not sc.fits:
        sc.binding = max(("weights", "grads", "optimizer", "activations", "buffers"), key=lambda k: mem[k])
    return sc


def boundary_time(workload: Workload, cluster, plan: Plan, i: int, replicas: Sequence[int]) -> float:
    """P: one microbatch's activations from stage i-1 to stage i (slowest replica checked)."""
    prev, stage = plan.stages[i - 1], plan.stages[i]
    full = workload.cost(prev.end - 1, prev.tp, plan.ep, plan.microbatch_size, plan.sequence_parallel).out_bytes
    t = max(cached_collective("p2p", cluster, (plan.rank(i - 1, r, 0), plan.rank(i, r, 0)), full / prev.tp)
            for r in replicas)
    if stage.tp > 1:
        t += max(cached_collective("all_gather", cluster, plan.tp_group(i, r), full) for r in replicas)
    return t


def _dp_sync_time(cluster, plan: Plan, i: int, dense_params: float, expert_params: float,
                  options: CostOptions) -> float:
    """Seconds of gradient (and ZeRO-3 parameter) traffic of stage i per step, not yet overlapped."""
    if plan.dp <= 1:
        return 0.0
    gbytes = options.grad_bytes
    replicas_group = plan.dp_group(i, 0)
    total = _sync_volume_time(cluster, replicas_group, dense_params, gbytes, options.param_bytes, plan)
    if expert_params and plan.dp // plan.ep > 1:
        group = plan.dp_group(i, 0)[::plan.ep]
        total += _sync_volume_time(cluster, group, expert_params, gbytes, options.param_bytes, plan)
    return total


def _sync_volume_time(cluster, group: List[int], params: float, gbytes: int, pbytes: int, plan: Plan) -> float:
    if len(group) <= 1 or params <= 0:
        return 0.0
    if plan.zero <= 1:
        return cached_collective("all_reduce", cluster, group, params * gbytes)
    rs = cached_collective("reduce_scatter", cluster, group, params * gbytes)
    ag = cached_collective("all_gather", cluster, group, params * pbytes)
    m = plan.num_microbatches
    if plan.zero == 2:  # sharded gradients cannot accumulate: one reduce-scatter per microbatch
        return m * rs + ag
    return m * (rs + 2 * ag)  # ZeRO-3 also gathers parameters for each forward and backward


def stage_tail(sc: StageCost, plan: Plan, cluster, options: CostOptions) -> Tuple[float, float]:
    """(exposed DP sync, optimizer step) of a stage after its last backward: q_i's two terms."""
    window = sc.bwd_compute + sc.recompute_s if options.overlap_grad_sync else 0.0
    exposed = max(0.0, sc.dp_sync - window)
    updated = sc.num_params / (plan.dp if plan.zero >= 1 else 1)
    t_opt = updated * options.bytes_per_param_update / (cluster.device.mem_bandwidth * options.optimizer_mem_efficiency)
    return exposed, t_opt


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


def simulate(plan: Plan, workload: Workload, cluster, options: Optional[CostOptions] = None) -> SimResult:
    """Predict step time, throughput and per-device memory of ``plan`` (validated first)."""
    options = options or CostOptions()
    plan.validate(num_layers=len(workload), world_size=cluster.num_devices)
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
                   f"{cluster.device.memory_bytes * options.usable_memory_fraction / 2**30:.1f} GiB usable "
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
