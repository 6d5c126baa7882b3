"""Stage costs of one (global config g, pipeline depth p) for every stage slot and layer range,
computed with numpy: the table the NEST DP reads.

Stage i's cost depends on its layer range [b, e) only through the range's *class*: how many
layers of each distinct layer cost it holds, the cost of layer b - 1 (the boundary it
receives) and of layer e - 1 (the boundary buffer it sends). With identical blocks there are
O(L) classes for L layers instead of O(L^2) ranges. Per (stage index, class, recompute mode)
the table evaluates the simulator's own terms (``step_time.compute_terms``, ``comm_terms``,
``microbatch_time``, ``model_states``, ``stage_memory``, ``dp_sync_time``, ``tail_terms``) on
arrays, so every entry equals ``step_time.stage_cost`` exactly (``tests/test_stage_table.py``).

A table only holds the classes that can be part of a plan faster than the best plan known when
it is built (``live``): a stage of more than L - p + 1 layers leaves another stage empty, one of
fewer than v layers cannot be cut into the interleaved schedule's v model chunks, and a
stage whose forward + backward time t alone gives ``pipeline_span(t, t) + T_opt >= best`` is
too slow (max_i t_i >= t, sum_i t_i >= t, max_i q_i >= its optimizer step). Every bound and
the DP below are about plans faster than a given ``best``, which only decreases.

What does not depend on the whole of (g, p) is shared through :class:`TableCache`: range
classes and compute sums per layer variant, rank groups per layout (placement, tp, dp, ep, p),
collective seconds per (layout, collective), p2p per (layout, variant), model states per
(variant, ZeRO stage, dp), in-flight microbatches per (schedule, p, m). Caches of other device
orders of the same devices (``share=``) share the entries that do not depend on the network.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Dict, List, Optional, Tuple

import numpy as np

from nest_fx.cost import memory
from nest_fx.cost.collectives import group_comm_fn
from nest_fx.cost.memory import model_states, stage_memory, working_sets
from nest_fx.cost.options import CostOptions
from nest_fx.cost.results import microbatch_time, stage_work
from nest_fx.cost.stage_terms import LayerTerms, StageGroups, compute_terms, forward_repeats, stage_groups
from nest_fx.cost.step_time import (comm_terms, dp_sync_time, exposed_tp, fsdp_units, held_terms, p2p_time, tail_terms,
                                    tied_sync_time)
from nest_fx.graph.recompute_policies import cost_key, parse_recompute
from nest_fx.plan import Plan, StagePlan
from nest_fx.solver.candidates import variant_of
from nest_fx.solver.space import GlobalConfig, objective
from nest_fx.workload import LayerCost, Variant, Workload

INF = math.inf
# Bounds add in another order than a plan's own sums; never prune on a last-ulp difference.
SLACK = 1.0 - 1e-12


@dataclass
class RangeClasses:
    """Layer ranges of one :class:`Variant` grouped by what a stage's cost depends on."""

    costs: List[LayerCost]  # distinct layer costs, in ``Workload.variant_costs`` order
    cls: np.ndarray  # (L+1, L+1): class of range [b, e); K (no class) where e <= b
    counts: np.ndarray  # (D, K): layers of each distinct cost in the class
    prev: np.ndarray  # (K,) distinct cost of the layer before the range; -1 when it starts at 0
    out_bytes: np.ndarray  # (K,) bytes the range's last layer hands on (the stage's buffers)
    length: np.ndarray  # (K,) layers in the class's ranges
    terms: Dict[str, LayerTerms]  # per recompute mode: network-independent sums, (K,) each
    modes: Tuple[str, ...] = ()  # the modes worth searching (undominated_modes)
    tied: float = 0.0  # parameters of a tied embedding (the tail's LayerCost.tied_params)

    @property
    def size(self) -> int:
        return len(self.prev)


def undominated_modes(costs: List[LayerCost], modes) -> Tuple[str, ...]:
    """The recompute modes worth searching for a variant: a per-layer policy is dropped when
    another keeps no more bytes, re-runs no more seconds and repeats no more collectives on every
    layer (and less of one of them somewhere, or comes earlier in ``modes``): it is never better
    in time or memory (e.g. ``selective`` with fused attention keeps more than ``none`` and
    re-runs the attention). ``every:<k>`` mixes ``none`` and ``full`` over a stage and stays."""
    per_layer = [r for r in modes if parse_recompute(r).kind != "every"]

    def profile(r: str) -> List[float]:
        key = cost_key(r)
        return [x for c in costs for x in (c.act_bytes[key], c.recompute_s[key],
                                           float(sum(forward_repeats(m, r) * m.count for m in c.comms if c.block)))]

    profiles = {r: profile(r) for r in per_layer}
    keep = []
    for k, r in enumerate(per_layer):
        beaten = any(all(a <= b for a, b in zip(profiles[o], profiles[r]))
                     and (profiles[o] != profiles[r] or j < k) for j, o in enumerate(per_layer) if o != r)
        if not beaten:
            keep.append(r)
    return tuple(r for r in modes if r in keep or parse_recompute(r).kind == "every")


def costed_modes(workload: Workload, variant: Variant, modes) -> Tuple[str, ...]:
    """The modes of ``modes`` the workload costs in a variant (a layer table may give only some
    policies; ``every:<k>`` needs ``none`` and ``full``)."""
    have = set(workload.recompute_policies(variant))
    return tuple(r for r in modes if ({"none", "full"} if parse_recompute(r).kind == "every" else {cost_key(r)}) <= have)


def range_classes(workload: Workload, variant: Variant, modes) -> RangeClasses:
    """Classes of all ranges [b, e), 0 <= b < e <= L, for one layer variant."""
    costs, prefix, index = workload.variant_costs(variant)
    n, d = len(workload), len(costs)
    counts = np.array(prefix, dtype=np.int64).reshape(d, n + 1)
    layer = np.array(index, dtype=np.int64)
    b, e = np.triu_indices(n + 1, 1)
    held = counts[:, e] - counts[:, b]  # (D, ranges)
    prev = np.where(b > 0, layer[np.maximum(b - 1, 0)], -1)
    keys = np.vstack([held, prev[None, :], layer[e - 1][None, :]]).T
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    cls = np.full((n + 1, n + 1), len(uniq), dtype=np.intp)
    cls[b, e] = inverse.ravel()
    per_cost = np.ascontiguousarray(uniq[:, :d].T)
    out_bytes = np.array([c.out_bytes for c in costs], dtype=float)[uniq[:, d + 1]] / variant.cp
    searched = undominated_modes(costs, costed_modes(workload, variant, modes))
    terms = {r: compute_terms(list(zip(costs, per_cost)), r) for r in searched}
    return RangeClasses(costs=costs, cls=cls, counts=per_cost, prev=uniq[:, d].copy(), out_bytes=out_bytes,
                        length=per_cost.sum(axis=0), terms=terms, modes=searched, tied=costs[index[-1]].tied_params)


def _subset(terms: LayerTerms, idx: np.ndarray) -> LayerTerms:
    return LayerTerms(**{f.name: getattr(terms, f.name)[idx] if isinstance(getattr(terms, f.name), np.ndarray)
                         else getattr(terms, f.name) for f in fields(LayerTerms)})


class _LayoutPlan(Plan):
    """A plan whose stages never change (the solver's layout template): ``Plan``'s own stage
    offsets and replica size, each computed once instead of summed on every rank lookup."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._offsets = [Plan.stage_offset(self, i) for i in range(len(self.stages))]
        self._replica = Plan.devices_per_replica.fget(self)

    @property
    def devices_per_replica(self) -> int:
        return self._replica

    def stage_offset(self, i: int) -> int:
        return self._offsets[i]


def _comm_work(comms: Dict[str, np.ndarray], compute: float, options: CostOptions):
    """A lower bound on one layer's collective seconds on the critical path: TP's only without
    async-TP overlap (with it the stage's compute may hide all of it), EP's and CP's."""
    tp = 0.0 if options.overlap_tp_comm else comms["tp"]
    return tp + comms["ep"] + comms["cp"]


class TableCache:
    """What stage tables of one search share (see module docstring)."""

    def __init__(self, workload: Workload, cluster, options: CostOptions, modes,
                 share: Optional["TableCache"] = None):
        """``share``: a cache of the same workload and options on another view of the same
        devices (another device order): its network-independent entries (classes, layouts,
        model states, in-flight microbatches) are shared, the network's are not."""
        self.workload, self.cluster, self.options, self.modes = workload, cluster, options, tuple(modes)
        self.capacity = memory.usable_bytes(cluster.device.memory_bytes, options)
        if share is not None and (share.workload is not workload or share.options is not options
                                  or share.modes != self.modes or share.cluster.device != cluster.device):
            raise ValueError("TableCache(share=...): the shared cache must have the same workload, options, "
                             "recompute modes and device")
        self._classes: Dict[tuple, RangeClasses] = {} if share is None else share._classes
        self._layouts: Dict[tuple, List[StageGroups]] = {} if share is None else share._layouts
        self._states: Dict[tuple, tuple] = {} if share is None else share._states
        self._comm_seconds: Dict[tuple, np.ndarray] = {}
        self._group_fns: Dict[tuple, list] = {}
        self._p2p: Dict[tuple, np.ndarray] = {}
        self._work: Dict[tuple, Tuple[float, float]] = {}
        self._comms: Dict[tuple, Dict[str, np.ndarray]] = {}
        self._forced: Dict[tuple, float] = {}

    def comms(self, g: GlobalConfig, p: int, mode: str) -> Dict[str, np.ndarray]:
        """``step_time.comm_terms`` of every range class of g's variant under ``mode`` on each
        stage's groups, (p, classes) per key: shared by the pairs that differ only in schedule,
        interleave factor or ZeRO stage."""
        key = (self._layout_key(g, p), variant_of(g), mode)
        hit = self._comms.get(key)
        if hit is None:
            rc = self.classes(g)
            out = comm_terms(list(zip(rc.costs, rc.counts)), mode, lambda comm: self.comm_seconds(g, p, comm),
                             self.options.tp_call_overhead)
            hit = self._comms[key] = {k: np.broadcast_to(np.asarray(v, dtype=float), (p, rc.size))
                                      for k, v in out.items()}
        return hit

    def classes(self, g: GlobalConfig) -> RangeClasses:
        key = variant_of(g)
        if key not in self._classes:
            self._classes[key] = range_classes(self.workload, key, self.modes)
        return self._classes[key]

    @staticmethod
    def _layout_key(g: GlobalConfig, p: int) -> tuple:
        return g.placement, g.tp, g.dp, g.ep, p, g.cp, g.dp_shard

    def layout(self, g: GlobalConfig, p: int) -> List[StageGroups]:
        """Rank groups of each stage: they depend on placement, tp, dp, ep, cp, dp_shard and p only."""
        key = self._layout_key(g, p)
        if key not in self._layouts:
            plan = _LayoutPlan(stages=[StagePlan(k, k + 1, g.tp) for k in range(p)], dp=g.dp, ep=g.ep, cp=g.cp,
                               dp_shard=g.dp_shard, zero=max(g.zero, 1 if g.dp_shard else 0),
                               placement=g.placement, num_layers=p)
            self._layouts[key] = [stage_groups(plan, i) for i in range(p)]
        return self._layouts[key]

    def comm_seconds(self, g: GlobalConfig, p: int, comm) -> np.ndarray:
        """(p, 1): one in-layer collective on each stage's slowest group."""
        layout = self._layout_key(g, p)
        key = (layout, comm.kind, comm.group, comm.nbytes, comm.count)
        hit = self._comm_seconds.get(key)
        if hit is None:
            fns = self._group_fns.get((layout, comm.kind, comm.group))
            if fns is None:
                fns = self._group_fns[(layout, comm.kind, comm.group)] = [
                    group_comm_fn(self.cluster, comm.kind, getattr(s, comm.group)) for s in self.layout(g, p)]
            hit = self._comm_seconds[key] = np.array([[f(comm)] for f in fns], dtype=float)
        return hit

    def p2p(self, g: GlobalConfig, p: int) -> np.ndarray:
        """(p, D + 1): P_i by the distinct cost of the layer before the stage; 0 for stage 0, in
        the last column (ranges that start at layer 0, which only stage 0 holds) and for costs no
        layer follows (no range starts after them)."""
        key = (self._layout_key(g, p), variant_of(g))
        hit = self._p2p.get(key)
        if hit is None:
            rc, layout = self.classes(g), self.layout(g, p)
            hit = self._p2p[key] = np.zeros((p, len(rc.costs) + 1))
            senders = np.unique(rc.prev[rc.prev >= 0]).tolist()  # costs some layer follows
            for i in range(1, p):
                by_bytes: Dict[float, float] = {}
                for d in senders:
                    nbytes = rc.costs[d].out_bytes / g.cp
                    if nbytes not in by_bytes:
                        by_bytes[nbytes] = p2p_time(self.cluster, layout[i], nbytes, g.tp, g.tp)
                    hit[i, d] = by_bytes[nbytes]
        return hit

    def forced_recompute(self, g: GlobalConfig, p: int, m: int) -> float:
        """A lower bound on the recompute seconds per microbatch that any plan of (g, p) spends to
        fit in memory (inf when none fits), summed over its stages.

        Stage i holds its parameters' model states (at least ``k`` bytes each: g's ZeRO stage over
        all its shard ranks) and ``f_i`` in-flight microbatches of its blocks' activations
        (``memory.pipeline_inflight_microbatches``; other terms only add), so
        ``A_i <= (C - k P_i) / f_i``; summed over the stages, the blocks' activations per
        microbatch obey ``sum_l a_l <= C sum_i 1 / f_i - k P / max_i f_i``. The cheapest way to
        meet that, choosing per block a recompute mode (fractionally: the LP relaxation, solved
        greedily on each block's lower convex hull of (kept bytes, recompute seconds)), bounds
        the recompute time of every plan from below."""
        zero = memory.effective_zero_stage(g.zero, p)
        key = (variant_of(g), zero, g.shard, p, m, g.schedule, g.virtual_stages)
        hit = self._forced.get(key)
        if hit is None:
            hit = self._forced[key] = self._forced_recompute(g, p, m, zero)
        return hit

    def _forced_recompute(self, g: GlobalConfig, p: int, m: int, zero: int) -> float:
        o, rc, n = self.options, self.classes(g), len(self.workload)
        whole = rc.cls[0, n]
        per_param = memory.model_state_bytes(1.0, zero_stage=zero, dp=g.shard, optimizer=o.optimizer,
                                             param_dtype_bytes=o.param_bytes, grad_dtype_bytes=o.grad_bytes,
                                             master_weights=o.master_weights,
                                             state_dtype_bytes=o.state_bytes)["total"]
        inflight = [memory.pipeline_inflight_microbatches(g.schedule, i, p, m, g.virtual_stages) for i in range(p)]
        params = sum(int(rc.counts[d, whole]) * c.num_params for d, c in enumerate(rc.costs))
        budget = self.capacity * sum(1.0 / f for f in inflight) - per_param * params / max(inflight)
        modes = {cost_key(r) for r in rc.modes if parse_recompute(r).kind != "every"}
        if len(modes) < len(rc.modes):  # every:<k> runs blocks as none or full
            modes |= {"none", "full"}
        kept = 0.0
        segments: List[Tuple[float, float]] = []  # (seconds per byte saved, bytes it can save)
        for d, c in enumerate(rc.costs):
            count = int(rc.counts[d, whole])
            if not c.block or not count:
                continue
            points = {(c.act_bytes[r], c.recompute_s[r]) for r in modes if r in c.act_bytes}
            start = min(points, key=lambda x: (x[1], x[0]))  # the cheapest in time (none)
            kept += count * start[0]
            hull = [(0.0, start[1])]  # (bytes saved, seconds): the lower convex hull from the start
            last = 0.0
            for saved, t in sorted((start[0] - a, t) for a, t in points if a < start[0]):
                if saved == last:
                    continue  # the same bytes at more seconds
                last = saved
                while len(hull) >= 2 and _slope(hull[-2], hull[-1]) >= _slope(hull[-1], (saved, t)):
                    hull.pop()
                hull.append((saved, t))
            segments += [(_slope(u, w), count * (w[0] - u[0])) for u, w in zip(hull, hull[1:])]
        excess = kept - budget
        seconds = 0.0
        for rate, saved in sorted(segments):
            if excess <= 0:
                break
            take = min(saved, excess)
            seconds += rate * take
            excess -= take
        return seconds if excess <= 0 else math.inf

    def replica_work(self, g: GlobalConfig, p: int) -> Tuple[float, float]:
        """Lower bounds on (sum_i W_i, sum_i 2 v P_i) of any plan of (g, p): every layer's forward
        and backward with its collectives on the stage where they are cheapest and in the cheapest
        mode, and each stage boundary i >= 1 at its cheapest incoming layer (2 v transfers per
        microbatch). ``sum_i s_i`` is at least their sum, ``max_i t_i`` at least the first's
        over p (and the sum's over p when sends are not overlapped: ``results.microbatch_time``)."""
        key = (self._layout_key(g, p), variant_of(g))
        if key not in self._work:
            rc, n = self.classes(g), len(self.workload)
            whole = rc.cls[0, n]
            terms = rc.terms[rc.modes[0]]
            total = float(terms.fwd[whole] + terms.bwd[whole])
            # each collective once ("none": no recompute re-runs one), the least of every mode's
            for d, c in enumerate(rc.costs):
                per_layer = float(np.min(_comm_work(comm_terms([(c, 1)], "none", lambda x: self.comm_seconds(g, p, x)),
                                                    c.fwd_s + c.bwd_s, self.options)))
                total += int(rc.counts[d, whole]) * per_layer
            senders = np.unique(rc.prev[rc.prev >= 0])
            boundaries = float(self.p2p(g, p)[1:, senders].min(axis=1).sum()) if p > 1 else 0.0
            self._work[key] = (total, boundaries)
        total, boundaries = self._work[key]
        return total, 2 * g.virtual_stages * boundaries

    def replica_params(self, g: GlobalConfig) -> float:
        """Parameters per device of one whole replica (all layers on one stage)."""
        rc = self.classes(g)
        return float(rc.terms[rc.modes[0]].params[rc.cls[0, len(self.workload)]])

    def states(self, g: GlobalConfig, p: int) -> tuple:
        """(dense states, expert states, dense params, expert params, optimizer seconds, then
        ``step_time.working_sets``), (K,) each, at the ZeRO stage a depth-p pipeline really has
        (``memory.effective_zero_stage``), with a tied embedding's second copy under pipelining."""
        zero = memory.effective_zero_stage(g.zero, p)
        key = (variant_of(g), zero, g.shard, g.dp // g.ep * g.cp, p > 1)
        if key not in self._states:
            rc = self.classes(g)
            terms = held_terms(rc.terms[rc.modes[0]], p)
            dense = terms.params - terms.expert_params
            opts = self.options
            t_opt = tail_terms(0.0, 0.0, 0.0, terms.params, g.shard, zero, self.cluster, opts)[1]
            self._states[key] = (model_states(dense, zero, g.shard, opts),
                                 model_states(terms.expert_params, zero, max(g.dp // g.ep, 1) * g.cp, opts),
                                 dense, terms.expert_params, t_opt, *working_sets(terms, zero, g.shard, opts))
        return self._states[key]


class StageTable:
    """t_i (per-microbatch time), fits and q_i (tail) of every (stage i, live class, recompute)
    of one (g, p). Arrays are (p, K + 1) over the K live classes, column K the "no range"
    sentinel (t = inf, no fit); ``cls`` maps ranges to live classes (K when not live)."""

    def __init__(self, cache: TableCache, g: GlobalConfig, p: int, m: int, best: float = INF):
        self.cache, self.g, self.p, self.m = cache, g, p, m
        self.n = n = len(cache.workload)
        rc = cache.classes(g)
        self.modes = rc.modes
        states, estates, dense, expert, t_opt, gathered, unsharded, scratch = cache.states(g, p)
        self.zero = memory.effective_zero_stage(g.zero, p)
        base = rc.terms[self.modes[0]]
        compute = base.fwd + base.bwd
        # a stage leaves every other stage a layer, and under the interleaved schedule holds one
        # layer per model chunk at least (Plan.validate, the runtime's interleaved_ranges)
        ok = (rc.length <= n - p + 1) & (rc.length >= g.virtual_stages)
        if best < INF:
            with np.errstate(invalid="ignore"):
                ok &= objective(compute, compute, t_opt, m, g.schedule, g.virtual_stages) * SLACK < best
        live = np.flatnonzero(ok)
        k = len(live)
        remap = np.full(rc.size + 1, k, dtype=np.intp)
        remap[live] = np.arange(k)
        self.cls = remap[rc.cls]
        self.length = rc.length[live]
        self._dense, self._expert = dense[live], expert[live]
        self._units = fsdp_units(_subset(rc.terms[self.modes[0]], live))
        self.terms = {r: held_terms(_subset(rc.terms[r], live), p) for r in self.modes}
        p2p = cache.p2p(g, p)[:, rc.prev[live]]
        states = {key: v[live] for key, v in states.items()}
        estates = {key: v[live] for key, v in estates.items()}
        opts = cache.options
        self._fp8 = self.terms[self.modes[0]].fp8_params if g.float8 else 0.0
        self._tied = [tied_sync_time(cache.cluster, groups, rc.tied, self.zero, g.shard, opts)
                      for groups in cache.layout(g, p)]
        self.t: Dict[str, np.ndarray] = {}
        self.s: Dict[str, np.ndarray] = {}
        self.fits: Dict[str, np.ndarray] = {}
        for r in self.modes:
            terms = self.terms[r]
            comms = {key: v[:, live] for key, v in cache.comms(g, p, r).items()}
            tp = exposed_tp(comms["tp"], terms.fwd + terms.bwd + terms.recompute, opts)
            work = stage_work(terms.fwd, terms.bwd, terms.recompute, tp, comms["ep"], comms["cp"])
            t, s = np.full((p, k + 1), INF), np.full((p, k + 1), INF)
            t[:, :k], s[:, :k] = microbatch_time(work, p2p, g.virtual_stages, opts.overlap_p2p)
            held = np.array([memory.held_activation_bytes(terms.act, terms.act_root, g.schedule, i, p, m, g.virtual_stages)
                             for i in range(p)]).reshape(p, k)
            mem = stage_memory(states, estates, held, terms.layer_peak, rc.out_bytes[live],
                               gathered[live], unsharded[live], scratch[live], num_microbatches=m)
            fits = np.zeros((p, k + 1), dtype=bool)
            fits[:, :k] = mem["total"] <= cache.capacity
            self.t[r], self.s[r], self.fits[r] = t, s, fits
        self.t_opt = np.append(t_opt[live], INF)
        self.entries = p * k * len(self.modes)
        self._fastest = np.minimum.reduce([self.fitting_times(r) for r in self.modes])
        self._fastest_s = np.minimum.reduce([np.where(self.fits[r], self.s[r], INF) for r in self.modes])
        self._sync = np.full((p, k + 1), np.nan)
        self._memo: Dict[tuple, object] = {}
        self._memo_best = INF

    @property
    def size(self) -> int:
        """K, the number of live classes (the sentinel's index)."""
        return len(self.length)

    def fitting_times(self, r: str) -> np.ndarray:
        """t where the stage fits in memory under mode r, else inf; (p, K + 1)."""
        return np.where(self.fits[r], self.t[r], INF)

    def _memoised(self, key: tuple, best: float, compute):
        """Per-``best`` memo: what a table derives for one incumbent (``best`` only decreases)."""
        if best != self._memo_best:
            self._memo, self._memo_best = {}, best
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    # -- what can still matter --------------------------------------------------------------
    def alive(self, best: float = INF) -> np.ndarray:
        """(p, K + 1): whether stage i holding class c could be part of a plan faster than
        ``best``: some mode fits, and the stage's own time t and span s in their fastest fitting
        modes do not already give ``pipeline_span(t, s) + T_opt >= best``."""
        def compute():
            t = self._fastest
            ok = np.isfinite(t)
            if best < INF:
                with np.errstate(invalid="ignore"):
                    ok &= objective(t, self._fastest_s, self.t_opt, self.m, self.g.schedule, self.g.virtual_stages) * SLACK < best
            return ok
        return self._memoised(("alive",), best, compute)

    def too_short(self, best: float = INF) -> bool:
        """Whether the longest alive class of each stage, together, hold fewer than L layers:
        then no partition of the layers is made of alive stages (a cheap infeasibility proof)."""
        longest = np.where(self.alive(best)[:, :-1], self.length, 0).max(axis=1, initial=0)
        return int(longest.sum()) < self.n

    def bands(self, best: float = INF) -> Tuple[np.ndarray, np.ndarray]:
        """Ranges each stage may hold in a plan faster than ``best``: (classes, ends), both
        (p, L - p + 1, kmax), entry [i, r, k - 1] for range [i + r, i + r + k); the sentinel K
        where the range is out of stage i's reach (stage 0 starts at layer 0, the last stage
        ends at L, every stage holds a layer) or its class is not :meth:`alive`. kmax is the
        longest alive class, so deep pipelines scan short bands."""
        def compute():
            n, p, size = self.n, self.p, self.size
            alive = self.alive(best)
            width = n - p + 1
            longest = int(np.where(alive[:, :size], self.length, 0).max(initial=0))
            stage = np.arange(p)[:, None, None]
            row = np.arange(width)[None, :, None]
            starts = stage + row
            ends = starts + np.arange(1, min(longest, width) + 1)[None, None, :]
            first = np.where(stage == p - 1, n, stage + 1)
            last = np.where(stage == p - 1, n, n - p + stage + 1)
            reach = (ends >= first) & (ends <= last) & ((stage > 0) | (row == 0))
            ends = np.minimum(ends, n)
            cols = np.where(reach, self.cls[starts, ends], size)
            live = np.take_along_axis(alive, cols.reshape(p, -1), axis=1).reshape(cols.shape)
            return np.where(live, cols, size), ends
        return self._memoised(("bands",), best, compute)

    def band(self, i: int, best: float = INF) -> Tuple[int, np.ndarray, np.ndarray]:
        """Stage i's part of :meth:`bands`: (first layer b of row 0, classes, ends)."""
        cols, ends = self.bands(best)
        return i, cols[i], ends[i]

    def viable(self, i: int, best: float = INF) -> np.ndarray:
        """Stage i's :meth:`band` classes, with the sentinel K also where the range [b, e) cannot
        be part of a plan faster than ``best``: the prefix bounds at (i, b), the stage's fastest
        fitting time and optimizer step, and the suffix bounds at (i + 1, e) (both with q bounded
        by the optimizer step) already give a step time >= ``best``."""
        def compute():
            b0, cols, ends = self.band(i, best)
            if not cols.size:
                return cols
            t_pre, s_pre, q_pre = self.prefix_bounds(best)[i][:, b0:b0 + cols.shape[0], None]
            t_suf, s_suf, q_suf = self.suffix_bounds(best, exact_tails=False)[i + 1][:, ends]
            t, s, q = self._fastest[i][cols], self._fastest_s[i][cols], self.t_opt[cols]
            with np.errstate(invalid="ignore"):
                lb = objective(np.maximum(np.maximum(t_pre, t), t_suf), s_pre + s + s_suf,
                               np.maximum(np.maximum(q_pre, q), q_suf), self.m, self.g.schedule, self.g.virtual_stages)
            return np.where(lb * SLACK < best, cols, self.size)
        return self._memoised(("viable", i), best, compute)

    def tails(self, i: int, best: float = INF) -> Dict[str, np.ndarray]:
        """q_i = exposed DP sync + optimizer step per mode, (K + 1,) over classes: exact for the
        classes :meth:`viable` for stage i, inf for the others. The DP sync asks the network, so
        it is computed once per (stage, class), on demand."""
        def compute():
            cols = np.unique(self.viable(i, best))
            cols = cols[cols < self.size]
            out = {}
            for r, q in self._tail_values(i, cols).items():
                out[r] = np.full(self.size + 1, INF)
                out[r][cols] = q
            return out
        return self._memoised(("tails", i), best, compute)

    def _tail_values(self, i: int, cols: np.ndarray) -> Dict[str, np.ndarray]:
        """q_i per mode for classes ``cols`` (exact; DP sync computed once per (stage, class))."""
        g, cache = self.g, self.cache
        todo = cols[np.isnan(self._sync[i, cols])]
        if todo.size:
            fp8 = self._fp8[todo] if isinstance(self._fp8, np.ndarray) else 0.0
            self._sync[i, todo] = dp_sync_time(cache.cluster, cache.layout(g, self.p)[i], self._dense[todo],
                                               self._expert[todo], g.dp * g.cp, g.ep, self.zero, self.m,
                                               cache.options, self._units[todo], fp8)
        out = {}
        for r in self.modes:
            terms = self.terms[r]
            exposed, t_opt = tail_terms(self._sync[i, cols], terms.bwd[cols], terms.recompute[cols],
                                        terms.params[cols], g.shard, self.zero, cache.cluster, cache.options,
                                        self._tied[i])
            out[r] = exposed + t_opt
        return out

    # -- bounds -----------------------------------------------------------------------------
    def suffix_bounds(self, best: float = INF, exact_tails: bool = True) -> np.ndarray:
        """(p + 1, 3, L + 1): entry [i, :, b] bounds (max t, sum s, max q) from below over the
        stages i..p-1 of any feasible completion holding layers [b, L) that could belong to a
        plan faster than ``best``. Each is an exact single-criterion optimum over the bands
        (each stage's mode chosen for that criterion alone), so together they bound every such
        completion. Without ``exact_tails`` q is bounded by the optimizer step (no network)."""
        return self._memoised(("bounds", exact_tails), best, lambda: self._suffix_bounds(best, exact_tails))

    def _suffix_bounds(self, best: float, exact_tails: bool) -> np.ndarray:
        n, p = self.n, self.p
        cols, ends = self.bands(best)
        t_min = self._fastest
        if exact_tails:
            cols = np.array([self.viable(i, best) for i in range(p)]).reshape(cols.shape)
            q_min = np.array([np.minimum.reduce([np.where(self.fits[r][i], q, INF)
                                                 for r, q in self.tails(i, best).items()]) for i in range(p)])
        else:
            q_min = np.where(np.isfinite(t_min), self.t_opt, INF)
        out = np.full((p + 1, 3, n + 1), INF)
        out[p, :, n] = 0.0
        if not cols.shape[2]:
            return out
        t_band = np.take_along_axis(t_min, cols.reshape(p, -1), axis=1).reshape(cols.shape)
        s_band = np.take_along_axis(self._fastest_s, cols.reshape(p, -1), axis=1).reshape(cols.shape)
        q_band = np.take_along_axis(q_min, cols.reshape(p, -1), axis=1).reshape(cols.shape)
        width = cols.shape[1]
        for i in range(p - 1, -1, -1):
            after = out[i + 1][:, ends[i]]  # (3, rows, kmax): the best completion after each range
            np.maximum(t_band[i], after[0], out=after[0])
            after[1] += s_band[i]
            np.maximum(q_band[i], after[2], out=after[2])
            out[i, :, i:i + width] = after.min(axis=2)
        return out

    def prefix_bounds(self, best: float = INF) -> np.ndarray:
        """(p + 1, 3, L + 1): entry [i, :, b] bounds (max t, sum s, max q) from below over stages
        0..i-1 of any feasible start holding layers [0, b) (q bounded by the optimizer step);
        the mirror image of :meth:`suffix_bounds`."""
        def compute():
            n, p = self.n, self.p
            cols, ends = self.bands(best)
            out = np.full((p + 1, 3, n + 1), INF)
            out[0, :, 0] = 0.0
            if not cols.shape[2]:
                return out
            t_band = np.take_along_axis(self._fastest, cols.reshape(p, -1), axis=1).reshape(cols.shape)
            s_band = np.take_along_axis(self._fastest_s, cols.reshape(p, -1), axis=1).reshape(cols.shape)
            q_band = np.where(np.isfinite(t_band), self.t_opt[cols], INF)
            width = cols.shape[1]
            criteria = np.arange(3)[:, None, None]
            for i in range(p):
                reach = out[i][:, i:i + width, None]  # (3, rows, 1): the best start before each range
                step = np.stack([np.maximum(reach[0], t_band[i]), reach[1] + s_band[i],
                                 np.maximum(reach[2], q_band[i])])
                np.minimum.at(out[i + 1], (criteria, ends[i][None]), step)
            return out
        return self._memoised(("prefix",), best, compute)

    def even_split(self, best: float = INF) -> Optional[Tuple[float, float, float, List[StagePlan]]]:
        """The even layer split, each stage with the first mode (in option order) that fits:
        (max t, sum s, max q, stages), or None when a stage fits in no mode, is not live, or the
        split cannot beat ``best`` even with q at the optimizer step (then its DP sync is never
        asked of the network)."""
        n, p = self.n, self.p
        bounds = [i * n // p for i in range(p + 1)]
        cols = [self.cls[bounds[i], bounds[i + 1]] for i in range(p)]
        modes = [next((r for r in self.modes if self.fits[r][i, c]), None) for i, c in enumerate(cols)]
        if None in modes:
            return None
        times = [float(self.t[r][i, c]) for i, (r, c) in enumerate(zip(modes, cols))]
        spans = [float(self.s[r][i, c]) for i, (r, c) in enumerate(zip(modes, cols))]
        if objective(max(times), sum(spans), float(self.t_opt[cols].max()), self.m, self.g.schedule,
                     self.g.virtual_stages) * SLACK >= best:
            return None
        max_t = sum_s = max_q = 0.0
        for i, (r, c, t, s) in enumerate(zip(modes, cols, times, spans)):
            q = float(self._tail_values(i, np.array([c]))[r][0])
            max_t, sum_s, max_q = max(max_t, t), sum_s + s, max(max_q, q)
        return max_t, sum_s, max_q, [StagePlan(a, b, self.g.tp, r) for a, b, r in zip(bounds, bounds[1:], modes)]


def _slope(u: Tuple[float, float], w: Tuple[float, float]) -> float:
    """Seconds per byte saved from hull point ``u`` to ``w`` (each: bytes saved, seconds)."""
    return (w[1] - u[1]) / (w[0] - u[0])

