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
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from nest_fx.cost import collectives, memory
from nest_fx.cost.placement import placed
from nest_fx.plan import Plan, PlanError
from nest_fx.workload import Comm, LayerCost, Workload

USABLE_MEMORY_FRACTION = 0.95  # CUDA context and allocator fragmentation take the rest


@dataclass
class CostOptions:
    """Knobs of the cost model that are not part of the plan."""

    optimizer: str = "adam"
    param_bytes: int = 2  # training dtype (bf16)
    grad_bytes: int = 2
    master_weights: bool = True  # mixed precision keeps an fp32 copy of the weights in the optimizer
    overlap_grad_sync: bool = True
    bytes_per_param_update: float = 36.0  # Adam, mixed precision: read/write fp32 p, m, v + grads + bf16 copy
    optimizer_mem_efficiency: float = 0.7
    usable_memory_fraction: float = USABLE_MEMORY_FRACTION
    # Host-side work the runtime adds to each collective call, as (seconds per call, seconds per
    # byte of the collective's buffer): DTensor dispatch and copies around a TP/EP collective,
    # FSDP's copy-in/out and bookkeeping around each unit's all-gather/reduce-scatter.
    # 0 by default (on GPUs the host runs ahead of the device); profiler.runtime_overhead
    # measures them where they show (CPU ranks).
    tp_call_overhead: Tuple[float, float] = (0.0, 0.0)
    fsdp_call_overhead: Tuple[float, float] = (0.0, 0.0)

    @classmethod
    def for_dtype(cls, dtype_bytes: int, **overrides) -> "CostOptions":
        """Options for training whose parameters are ``dtype_bytes`` wide: 2 (bf16/fp16) is mixed
        precision (fp32 master weights in the optimizer, the default); 4 is plain fp32 training,
        where the optimizer keeps no second copy of the weights (K = 8 for Adam)."""
        if dtype_bytes not in (2, 4):
            raise ValueError(f"dtype_bytes: 2 (bf16/fp16) or 4 (fp32), got {dtype_bytes!r}")
        fields = dict(param_bytes=dtype_bytes, grad_bytes=dtype_bytes, master_weights=dtype_bytes < 4)
        fields.update(overrides)
        return cls(**fields)


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
        return microbatch_time(self.fwd_compute, self.bwd_compute, self.recompute_s, self.tp_comm, self.ep_comm,
                               self.p2p, v)


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


Count = Union[int, float, np.ndarray]  # a number, or an array of them (the solver's stage tables)

_COLLECTIVE_CACHE: Dict[tuple, Dict[float, float]] = {}
_GROUP_VIEWS: Dict[tuple, "_GroupView"] = {}
_CACHE_LIMIT = 2_000_000  # entries over all groups; the caches start afresh beyond it
_cached_entries = 0


class _GroupView:
    """The cluster as the collective model sees it for one rank group, with ``span`` of that
    group resolved once: the model asks for it at every message size, and resolving a group of
    thousands of ranks takes milliseconds. Everything else is the cluster's own."""

    def __init__(self, cluster, ranks: Tuple[int, ...]):
        self._cluster, self._ranks, self._spans = cluster, ranks, None

    def span(self, ranks: Sequence[int]):
        if ranks is not self._ranks and tuple(ranks) != self._ranks:
            return self._cluster.span(ranks)
        if self._spans is None:
            self._spans = self._cluster.span(ranks)
        return self._spans

    def __getattr__(self, name: str):
        return getattr(self._cluster, name)


def _memo(kind: str, cluster, group: Sequence[int]) -> Tuple[Dict[float, float], tuple, Tuple[int, ...]]:
    """(bytes -> seconds memo, network key, ranks) of collective ``kind`` over ``group``."""
    global _cached_entries
    ranks = tuple(group)
    # immutable views (graph topologies, device orders) carry their key, a string hashed once
    network = getattr(cluster, "cost_key", None) or \
        (cluster.num_devices, tuple((lv.group_size, lv.bandwidth, lv.latency) for lv in cluster.levels))
    key = (network, kind, ranks)
    memo = _COLLECTIVE_CACHE.get(key)
    if memo is None:
        if _cached_entries > _CACHE_LIMIT:
            _COLLECTIVE_CACHE.clear()
            _GROUP_VIEWS.clear()
            _cached_entries = 0
        memo = _COLLECTIVE_CACHE[key] = {}
    return memo, network, ranks


def _collective_miss(kind: str, cluster, network: tuple, ranks: Tuple[int, ...], memo: Dict[float, float],
                     nbytes: float) -> float:
    """Ask the collective model (``collectives.p2p`` for kind "p2p", group = (src, dst)) and memoise."""
    global _cached_entries
    if kind == "p2p":
        t = collectives.p2p(cluster, ranks[0], ranks[1], nbytes)
    else:
        view = _GROUP_VIEWS.get((network, ranks))
        if view is None:
            view = _GROUP_VIEWS[(network, ranks)] = _GroupView(cluster, ranks)
        t = collectives.collective_time(kind, view, view._ranks, nbytes)
    memo[nbytes] = t
    _cached_entries += 1
    return t


def collective_fn(kind: str, cluster, group: Sequence[int]) -> Callable[[float], float]:
    """``nbytes -> seconds`` of ``collectives.collective_time`` (or ``collectives.p2p`` for kind
    "p2p", group = (src, dst)) over ``group``, memoised per (cluster, kind, group, bytes). The
    solver asks for the same few groups millions of times; resolving a group once and then
    asking for many sizes saves hashing it (and the model resolving its span) each time."""
    memo, network, ranks = _memo(kind, cluster, group)

    def seconds(nbytes: float) -> float:
        t = memo.get(nbytes)
        return _collective_miss(kind, cluster, network, ranks, memo, nbytes) if t is None else t

    return seconds


def cached_collective(kind: str, cluster, group: Sequence[int], nbytes: float) -> float:
    """Seconds of one collective, memoised (see :func:`collective_fn`)."""
    memo, network, ranks = _memo(kind, cluster, group)
    t = memo.get(nbytes)
    return _collective_miss(kind, cluster, network, ranks, memo, nbytes) if t is None else t


def comm_time(cluster, comm: Comm, group: Sequence[int]) -> float:
    """Seconds of one in-layer collective (``count`` repetitions) over ``group``."""
    if len(group) <= 1:
        return 0.0
    return comm.count * cached_collective(comm.kind, cluster, group, comm.nbytes)


def group_comm_time(cluster, comm: Comm, groups: Sequence[Sequence[int]]) -> float:
    """Seconds of one in-layer collective on the slowest of ``groups`` (0 when there is none)."""
    return max((comm_time(cluster, comm, g) for g in groups), default=0.0)


def group_comm_fn(cluster, kind: str, groups: Sequence[Sequence[int]]) -> Callable[[Comm], float]:
    """``comm -> group_comm_time(cluster, comm, groups)`` for collectives of ``kind``, with the
    groups resolved once (:func:`comm_time` of each group: single-rank groups cost 0)."""
    fns = [collective_fn(kind, cluster, g) for g in groups if len(g) > 1]
    return lambda comm: max((comm.count * f(comm.nbytes) for f in fns), default=0.0)


def _replicas_to_check(dp: int) -> List[int]:
    return sorted({0, dp // 2, dp - 1})


def per_value(fn: Callable[[float], float], x: Count) -> Count:
    """``fn(x)`` for a number; for an array, ``fn`` of each distinct entry, in x's shape (``fn``
    need not be vectorised: it may ask the collective model, one size at a time)."""
    if not isinstance(x, np.ndarray):
        return fn(x)
    values, inverse = np.unique(x.ravel(), return_inverse=True)
    return np.array([fn(float(v)) for v in values], dtype=float)[inverse].reshape(x.shape)


@dataclass(frozen=True)
class StageGroups:
    """The rank groups stage i's costs depend on, for the replicas the cost model checks (first,
    middle, last; ``_replicas_to_check``)."""

    tp: Tuple[Tuple[int, ...], ...]  # TP group per checked replica
    ep: Tuple[Tuple[int, ...], ...]  # EP group per checked replica; empty when ep == 1
    p2p: Tuple[Tuple[int, int], ...]  # (rank of stage i-1, rank of stage i), TP rank 0; empty for stage 0
    dp: Tuple[int, ...]  # the stage's data-parallel group (TP rank 0)
    expert_dp: Tuple[int, ...]  # every ep-th member of dp: the replicas holding the same experts


def stage_groups(plan: Plan, i: int, replicas: Optional[Sequence[int]] = None) -> StageGroups:
    """Stage i's rank groups under ``plan``'s placement (they depend on the stages' TP degrees,
    dp, ep, the placement and i, not on the layer ranges)."""
    replicas = _replicas_to_check(plan.dp) if replicas is None else replicas
    dp = tuple(plan.dp_group(i, 0))
    return StageGroups(
        tp=tuple(tuple(plan.tp_group(i, r)) for r in replicas),
        ep=tuple(tuple(plan.ep_group(i, r)) for r in replicas) if plan.ep > 1 else (),
        p2p=tuple((plan.rank(i - 1, r, 0), plan.rank(i, r, 0)) for r in replicas) if i > 0 else (),
        dp=dp, expert_dp=dp[::plan.ep])


@dataclass
class LayerTerms:
    """Network-independent sums over a stage's layers, per microbatch and device, for one
    recompute mode. Entries are numbers, or arrays when the layer counts are arrays (one entry
    per layer range); the collectives come from :func:`comm_terms`."""

    fwd: Count = 0.0
    bwd: Count = 0.0
    recompute: Count = 0.0
    params: Count = 0.0
    expert_params: Count = 0.0
    act: Count = 0.0  # saved activation bytes of one microbatch
    layer_peak: Count = 0.0  # the largest one-layer backward working set (see compute_terms)
    root_params: Count = 0.0  # parameters outside every block (head, tail): the FSDP root unit
    blocks: Count = 0.0  # block layers (each its own FSDP unit)
    unit_params: Count = 0.0  # the largest block's parameters: the largest FSDP unit


def compute_terms(distinct: Sequence[Tuple[LayerCost, Count]], recompute: str) -> LayerTerms:
    """:class:`LayerTerms` of a stage's layers.

    ``distinct``: (layer cost, count) pairs as ``Workload.range_costs`` gives them; a count may
    be an integer array (one entry per layer range), and a zero count adds exactly 0.

    ``layer_peak`` is what one layer's backward holds beyond the saved activations, largest over
    the stage's layers: under full recompute the full activations a checkpointed layer rebuilds,
    plus the layer's own backward scratch (``LayerCost.bwd_scratch``, e.g. the loss's gradients
    of the logits). Layers run their backward one at a time, so only the largest counts."""
    fwd = bwd = rec = params = expert = act = act_full = root = unit = blocks = 0.0
    for c, count in distinct:
        if not c.block:
            root = root + c.num_params * count
        else:
            blocks = blocks + count
            if isinstance(count, np.ndarray):
                unit = np.maximum(unit, np.where(count > 0, c.num_params, 0.0))
            elif count > 0:
                unit = max(unit, c.num_params)
        fwd = fwd + c.fwd_s * count
        bwd = bwd + c.bwd_s * count
        rec = rec + c.recompute_s[recompute] * count
        params = params + c.num_params * count
        expert = expert + c.expert_params * count
        act = act + c.act_bytes[recompute] * count
        # under full recompute a checkpointed layer rebuilds its full activations for its backward
        rebuilt = c.act_bytes["none"] if recompute == "full" and c.act_bytes["full"] < c.act_bytes["none"] else 0.0
        peak = rebuilt + c.bwd_scratch
        if isinstance(count, np.ndarray):
            act_full = np.maximum(act_full, np.where(count > 0, peak, 0.0))
        elif count > 0:
            act_full = max(act_full, peak)
    return LayerTerms(fwd=fwd, bwd=bwd, recompute=rec, params=params, expert_params=expert, act=act,
                      layer_peak=act_full, root_params=root, unit_params=unit, blocks=blocks)


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


def microbatch_time(fwd: Count, bwd: Count, recompute: Count, tp_comm: Count, ep_comm: Count, p2p: Count,
                    v: int = 1) -> Count:
    """t_i: forward + backward + recompute + collectives + both p2p directions (v chunks)."""
    return fwd + bwd + recompute + tp_comm + ep_comm + 2 * p2p * v


_STATES_CACHE: Dict[tuple, Tuple[float, float, float, float]] = {}
_STATE_KEYS = ("weights", "grads", "optimizer", "total")


def model_states(params: Count, zero: int, dp: int, options: CostOptions) -> Dict[str, Count]:
    """``memory.model_state_bytes`` under the cost options; for an array, per distinct entry
    (memoised: the solver's tables ask for the same parameter counts over and over)."""
    if not isinstance(params, np.ndarray):
        return memory.model_state_bytes(params, zero_stage=zero, dp=dp, optimizer=options.optimizer,
                                        param_dtype_bytes=options.param_bytes, grad_dtype_bytes=options.grad_bytes,
                                        master_weights=options.master_weights)
    values, inverse = np.unique(params.ravel(), return_inverse=True)
    rows = np.empty((len(values), len(_STATE_KEYS)))
    for j, v in enumerate(values.tolist()):
        key = (v, zero, dp, options.optimizer, options.param_bytes, options.grad_bytes, options.master_weights)
        row = _STATES_CACHE.get(key)
        if row is None:
            if len(_STATES_CACHE) > 1_000_000:
                _STATES_CACHE.clear()
            states = model_states(v, zero, dp, options)
            row = _STATES_CACHE[key] = tuple(states[k] for k in _STATE_KEYS)
        rows[j] = row
    return {k: rows[inverse, c].reshape(params.shape) for c, k in enumerate(_STATE_KEYS)}


MEMORY_TERMS = ("weights", "grads", "optimizer", "activations", "buffers", "fsdp_unsharded", "optimizer_step")


def working_sets(terms: LayerTerms, zero: int, dp: int, options: CostOptions) -> Tuple[Count, Count, Count]:
    """(FSDP unsharded parameter bytes, FSDP unsharded gradient bytes, optimizer scratch bytes)
    of a stage: ``memory.fsdp_unsharded_bytes`` of its dense parameters at ``zero`` (the
    effective stage) and ``memory.optimizer_step_bytes`` of the parameters it updates."""
    dense = terms.params - terms.expert_params
    params, grads = memory.fsdp_unsharded_bytes(dense, terms.root_params, terms.unit_params, zero_stage=zero, dp=dp,
                                                param_dtype_bytes=options.param_bytes,
                                                grad_dtype_bytes=options.grad_bytes)
    scratch = memory.optimizer_step_bytes(terms.params / (dp if zero >= 1 else 1), options.optimizer)
    return params, grads, scratch


def stage_memory(states: Dict[str, Count], expert_states: Dict[str, Count], act: Count, layer_peak: Count,
                 inflight: Count, out_bytes: Count, unsharded_params: Count = 0.0, unsharded_grads: Count = 0.0,
                 optimizer_scratch: Count = 0.0, *, num_microbatches: int) -> Dict[str, Count]:
    """Per-device memory terms of a stage at its peak (see module docstring) and their total.

    The peak is model states + the larger of the forward/backward working set (activations,
    buffers, FSDP's unsharded parameters and gradients) and the optimizer step's scratch, which
    is allocated after backward has freed the former. ``optimizer_step`` is what the scratch
    adds beyond the forward/backward working set, so the terms still sum to the peak.

    With one microbatch nothing accumulates: backward writes the gradients as it frees the
    activations, so the peak is at its start (all activations, no gradients yet) or at its end
    (all gradients, no activations), and the terms are those of the larger moment. With more,
    the gradients of the first microbatch are there while the others' activations are. FSDP's
    unsharded gradients build up as a microbatch's backward frees its activations (the root's
    are reduced last): ``fsdp_unsharded`` is the gathered parameters plus what those gradients
    add beyond the activations."""
    mem = {k: states[k] + expert_states[k] for k in ("weights", "grads", "optimizer")}
    grads = mem["grads"]  # all there during the optimizer step
    mem["activations"] = act * inflight + layer_peak
    if num_microbatches == 1:
        grads_later = mem["grads"] >= mem["activations"]
        mem["activations"], mem["grads"] = (np.where(grads_later, 0.0, mem["activations"]),
                                            np.where(grads_later, mem["grads"], 0.0))
        if not isinstance(grads_later, np.ndarray):
            mem["activations"], mem["grads"] = float(mem["activations"]), float(mem["grads"])
    mem["buffers"] = 2 * out_bytes
    late = unsharded_grads - mem["activations"]
    mem["fsdp_unsharded"] = unsharded_params + (np.maximum(late, 0.0) if isinstance(late, np.ndarray)
                                                else max(late, 0.0))
    during = mem["grads"] + mem["activations"] + mem["buffers"] + mem["fsdp_unsharded"]
    excess = grads + optimizer_scratch - during
    mem["optimizer_step"] = np.maximum(excess, 0.0) if isinstance(excess, np.ndarray) else max(excess, 0.0)
    mem["total"] = sum(mem[k] for k in MEMORY_TERMS)
    return mem


def stage_cost(workload: Workload, cluster, plan: Plan, i: int, options: CostOptions) -> StageCost:
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
    mem = sc.memory = stage_memory(model_states(dense, zero, plan.dp, options),
                                   model_states(terms.expert_params, zero, max(plan.dp // plan.ep, 1), options),
                                   terms.act, terms.layer_peak, inflight,
                                   workload.cost(stage.end - 1, stage.tp, *variant).out_bytes,
                                   *working_sets(terms, zero, plan.dp, options),
                                   num_microbatches=plan.num_microbatches)
    sc.fits = bool(mem["total"] <= cluster.device.memory_bytes * options.usable_memory_fraction)  # not np.bool_
    if not sc.fits:
        sc.binding = max(MEMORY_TERMS, key=lambda k: mem[k])
    return sc


def p2p_time(cluster, groups: StageGroups, out_bytes: float, prev_tp: int, tp: int) -> float:
    """P_i: one microbatch's activations (``out_bytes``, the full tensor) from stage i-1, 1/prev_tp
    per rank point to point, then all-gathered in stage i's TP group (slowest replica checked)."""
    t = max(cached_collective("p2p", cluster, pair, out_bytes / prev_tp) for pair in groups.p2p)
    if tp > 1:
        t += max(cached_collective("all_gather", cluster, g, out_bytes) for g in groups.tp)
    return t


def boundary_time(workload: Workload, cluster, plan: Plan, i: int, replicas: Sequence[int]) -> float:
    """P: one microbatch's activations from stage i-1 to stage i (slowest replica checked)."""
    prev, stage = plan.stages[i - 1], plan.stages[i]
    full = workload.cost(prev.end - 1, prev.tp, plan.ep, plan.microbatch_size, plan.sequence_parallel).out_bytes
    return p2p_time(cluster, stage_groups(plan, i, replicas), full, prev.tp, stage.tp)


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


def _dp_sync_time(cluster, plan: Plan, i: int, dense_params: float, expert_params: float,
                  options: CostOptions) -> float:
    """:func:`dp_sync_time` of stage i of ``plan`` (the former helper's signature)."""
    return dp_sync_time(cluster, stage_groups(plan, i), dense_params, expert_params, plan.dp, plan.ep,
                        memory.effective_zero_stage(plan.zero, plan.pp),
                        plan.num_microbatches, options)


def _sync_volume_time(cluster, group: Sequence[int], params: Count, zero: int, m: int,
                      options: CostOptions) -> Count:
    if len(group) <= 1:
        return 0.0
    gbytes, pbytes = options.grad_bytes, options.param_bytes
    if zero <= 1:
        all_reduce = collective_fn("all_reduce", cluster, group)
        return per_value(lambda x: all_reduce(x * gbytes) if x > 0 else 0.0, params)
    reduce_scatter = collective_fn("reduce_scatter", cluster, group)
    all_gather = collective_fn("all_gather", cluster, group)

    def one(x: float) -> float:
        if x <= 0:
            return 0.0
        rs, ag = reduce_scatter(x * gbytes), all_gather(x * pbytes)
        if zero == 2:  # sharded gradients cannot accumulate: one reduce-scatter per microbatch
            return m * rs + ag
        return m * (rs + 2 * ag)  # ZeRO-3 also gathers parameters for each forward and backward

    return per_value(one, params)


def tail_terms(dp_sync: Count, bwd: Count, recompute_s: Count, num_params: Count, dp: int, zero: int, cluster,
               options: CostOptions) -> Tuple[Count, Count]:
    """(exposed DP sync, optimizer step) after a stage's last backward, from its terms."""
    # the runtime syncs ZeRO-0 gradients after backward (GradientSync); FSDP overlaps its own
    window = bwd + recompute_s if options.overlap_grad_sync and zero >= 1 else 0.0
    gap = dp_sync - window
    exposed = np.maximum(gap, 0.0) if isinstance(gap, np.ndarray) else max(0.0, gap)
    updated = num_params / (dp if zero >= 1 else 1)
    t_opt = updated * options.bytes_per_param_update / (cluster.device.mem_bandwidth * options.optimizer_mem_efficiency)
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
    that does not divide the model's heads/FFN/experts, or one a layer table does not list."""
    for i, stage in enumerate(plan.stages):
        problem = workload.variant_problem(stage.tp, plan.ep, plan.sequence_parallel)
        if problem:
            raise PlanError(f"stages[{i}]: {problem} (a plan for another model, or a layer table "
                            "without this variant?)")


def simulate(plan: Plan, workload: Workload, cluster, options: Optional[CostOptions] = None) -> SimResult:
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
