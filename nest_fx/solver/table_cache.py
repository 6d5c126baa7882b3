"""What the stage tables of one search share (:class:`TableCache`).

What does not depend on the whole of (g, p) is computed once: range classes and compute sums
per layer variant (:mod:`nest_fx.solver.range_classes`), rank groups per layout (placement, tp,
dp, ep, p), collective seconds per (layout, collective), p2p per (layout, variant), model states
per (variant, ZeRO stage, dp), in-flight microbatches per (schedule, p, m). Caches of other
device orders of the same devices (``share=``) share the entries that do not depend on the
network. The cache also answers the per-pair lower bounds the search prunes with before it
builds a table: the recompute memory forces (``forced_recompute``) and one replica's work
(``replica_work``, ``replica_params``).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from nest_fx.cost import memory
from nest_fx.cost.collectives import collective_fn, group_comm_fn
from nest_fx.cost.dp_sync import dp_sync_time, expert_shard_degree, reduce_spread, sync_signature, tail_terms
from nest_fx.cost.memory import model_states, working_sets
from nest_fx.cost.options import CostOptions
from nest_fx.cost.stage_terms import StageGroups, stage_groups
from nest_fx.cost.step_time import comm_terms, held_terms, p2p_time
from nest_fx.plan import Plan, StagePlan
from nest_fx.plan.may_run import unrun_schedule
from nest_fx.solver.candidates import partition_floor, variant_of
from nest_fx.solver.range_classes import RangeClasses, ReplicaTerms, range_classes, replica_terms
from nest_fx.solver.space import GlobalConfig
from nest_fx.solver.memory_floors import MemoryFloors
from nest_fx.workload import Workload
from nest_fx.workload.expert_dispatch import dispatched_comm


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
    """A lower bound on one layer's collective seconds on the critical path: of each group's,
    the share its overlap option leaves exposed however much compute there is (``exposed_comms``)."""
    return sum(comms[k] * (1 - float(getattr(options, f"overlap_{k}_comm"))) for k in ("tp", "ep", "cp"))


class TableCache(MemoryFloors):
    """What stage tables of one search share (see module docstring); the memory floors of the
    per-pair bounds are :class:`~nest_fx.solver.memory_floors.MemoryFloors`'."""

    def __init__(self, workload: Workload, cluster, options: CostOptions, modes, share: Optional["TableCache"] = None):
        """``share``: a cache of the same workload and options on another view of the same
        devices (another device order): its network-independent entries (classes, layouts,
        model states, in-flight microbatches) are shared, the network's are not."""
        self.workload, self.cluster, self.options, self.modes = workload, cluster, options, tuple(modes)
        self.capacity = memory.usable_bytes(cluster.device.memory_bytes, options)
        if share is not None and (
            share.workload is not workload
            or share.options is not options
            or share.modes != self.modes
            or share.cluster.device != cluster.device
        ):
            raise ValueError(
                "TableCache(share=...): the shared cache must have the same workload, options, "
                "recompute modes and device"
            )
        self._classes: Dict[tuple, RangeClasses] = {} if share is None else share._classes
        self._replicas: Dict[tuple, ReplicaTerms] = {} if share is None else share._replicas
        self._replica_modes: Dict[tuple, object] = {} if share is None else share._replica_modes
        self._layouts: Dict[tuple, List[StageGroups]] = {} if share is None else share._layouts
        self._states: Dict[tuple, tuple] = {} if share is None else share._states
        self._comm_seconds: Dict[tuple, np.ndarray] = {}
        self._group_fns: Dict[tuple, list] = {}
        self._p2p: Dict[tuple, np.ndarray] = {}
        self._work: Dict[tuple, Tuple[float, float]] = {}
        self._comms: Dict[tuple, Dict[str, np.ndarray]] = {}
        self._forced: Dict[tuple, float] = {}
        self._tail_floor: Dict[tuple, float] = {}
        self._syncs: Dict[tuple, Tuple[float, float, bool]] = {}
        self._opt: Dict[tuple, float] = {}  # the tail floor's optimizer steps per (params, shard, ZeRO)
        self._sync_sigs: Dict[tuple, tuple] = {}  # (id(groups), zero <= 1, experts) -> (groups, sync_signature)
        self._sync_values: Dict[tuple, Tuple[float, float]] = {}  # (signature, sizes, ...) -> dp_sync_time at d, 2 d
        self._affine_dp: Dict[tuple, bool] = {}  # per layout: its DP groups' costs affine in the size
        self._hulls: Dict[tuple, tuple] = {}
        self._stage_floor: Dict[tuple, float] = {}
        self._room: Dict[tuple, float] = {}  # capacity less every stage's least receive buffers
        self._busiest: Dict[tuple, float] = {}
        self._prefix: Dict[tuple, List[float]] = {}
        self._recompute_floors: Dict[tuple, np.ndarray] = {}
        self._inflight: Dict[tuple, tuple] = {}
        self._sums: Dict[tuple, Tuple[float, float]] = {}  # per _inflight key: (sum 1 / f_i, max f_i)
        self._reach: Dict[tuple, object] = {}
        self._ordered: Dict[tuple, object] = {}
        self._ranged: Dict[tuple, Dict[tuple, np.ndarray]] = {}  # range_recompute per (variant, modes, states)
        self._modes_for: Dict[str, Tuple[str, ...]] = {}
        self._collectives: Dict[tuple, tuple] = {}  # (kind, id(group)) -> (group, its collective_fn)

    def comms(self, g: GlobalConfig, p: int, mode: str) -> Dict[str, np.ndarray]:
        """``step_time.comm_terms`` of every range class of g's variant under ``mode`` on each
        stage's groups, (p, classes) per key: shared by the pairs that differ only in schedule,
        interleave factor or ZeRO stage."""
        key = (self._layout_key(g, p), variant_of(g), mode)
        hit = self._comms.get(key)
        if hit is None:
            rc = self.classes(g)
            out = comm_terms(
                list(zip(rc.costs, rc.counts)),
                mode,
                lambda comm: self.comm_seconds(g, p, comm),
                self.options.tp_call_overhead,
            )
            hit = self._comms[key] = {
                k: np.broadcast_to(np.asarray(v, dtype=float), (p, rc.size)) for k, v in out.items()
            }
        return hit

    def collective(self, kind: str, cluster, group) -> Callable:
        """``collectives.collective_fn(kind, cluster, group)`` for this cache's cluster, once per
        rank group object the layouts hold (``dp_sync.dp_sync_time(collective=)``: the memo of
        ``collective_fn`` is keyed on the whole rank tuple, hashed at each ask)."""
        if cluster is not self.cluster:
            return collective_fn(kind, cluster, group)
        key = (kind, id(group))
        hit = self._collectives.get(key)
        if hit is None or hit[0] is not group:  # (the group is held in the entry: its id stays its own)
            hit = self._collectives[key] = (group, collective_fn(kind, cluster, group))
        return hit[1]

    def modes_for(self, g: GlobalConfig) -> Tuple[str, ...]:
        """The recompute modes g's schedule runs with (``plan.may_run.unrun_schedule``: no
        selective checkpointing under a split backward)."""
        hit = self._modes_for.get(g.schedule)
        if hit is None:
            hit = self._modes_for[g.schedule] = tuple(
                r for r in self.modes if not unrun_schedule(g.schedule, pp=2, recompute=(r,))
            )
        return hit

    def classes(self, g: GlobalConfig) -> RangeClasses:
        modes = self.modes_for(g)
        key = (variant_of(g), modes)
        if key not in self._classes:
            self._classes[key] = range_classes(self.workload, key[0], modes)
        return self._classes[key]

    def replica(self, g: GlobalConfig) -> ReplicaTerms:
        """The whole replica's terms of g's variant (what the per-pair bounds read; the range
        classes are built only for pairs that build a table)."""
        modes = self.modes_for(g)
        key = (variant_of(g), modes)
        hit = self._replicas.get(key)
        if hit is None:
            hit = self._replicas[key] = replica_terms(self.workload, key[0], modes, self._replica_modes)
        return hit

    @staticmethod
    def _layout_key(g: GlobalConfig, p: int) -> tuple:
        return g.placement, g.tp, g.dp, g.ep, p, g.cp, g.dp_shard

    def layout(self, g: GlobalConfig, p: int) -> List[StageGroups]:
        """Rank groups of each stage, for costing: they depend on placement, tp, dp, ep, cp,
        dp_shard and p only. A middle stage's groups are stage 1's moved by a multiple of the
        stage offset (every stage has g's TP degree); where the cluster costs such a move as the
        unmoved groups (``Cluster.shift_class``: the same class for every group), the entry is
        the earlier stage's own object: costs asked of it are the stage's, its ranks are not.
        Loops over the stages cost each distinct object once (``_distinct``)."""
        key = self._layout_key(g, p)
        if key not in self._layouts:
            plan = _LayoutPlan(
                stages=[StagePlan(k, k + 1, g.tp) for k in range(p)],
                dp=g.dp,
                ep=g.ep,
                cp=g.cp,
                dp_shard=g.dp_shard,
                zero=max(g.zero, 1 if g.dp_shard else 0),
                placement=g.placement,
                num_layers=p,
            )
            self._layouts[key] = _shared_layout(plan, p, getattr(self.cluster, "shift_class", None))
        return self._layouts[key]

    def comm_seconds(self, g: GlobalConfig, p: int, comm) -> np.ndarray:
        """(p, 1): one in-layer collective on each stage's slowest group (an expert all-to-all's bytes
        under the options' dispatch and routing: ``expert_dispatch.dispatched_comm``)."""
        comm = dispatched_comm(comm, self.options.expert_dispatch, self.options.expert_routing)
        layout = self._layout_key(g, p)
        key = (layout, comm.kind, comm.group, comm.nbytes, comm.count)
        hit = self._comm_seconds.get(key)
        if hit is None:
            fns = self._group_fns.get((layout, comm.kind, comm.group))
            if fns is None:
                objs, where = _distinct(self.layout(g, p))
                fns = self._group_fns[(layout, comm.kind, comm.group)] = (
                    [group_comm_fn(self.cluster, comm.kind, getattr(s, comm.group)) for s in objs],
                    where,
                )
            hit = self._comm_seconds[key] = np.array([[f(comm)] for f in fns[0]], dtype=float)[fns[1]]
        return hit

    def p2p(self, g: GlobalConfig, p: int) -> np.ndarray:
        """(p, D + 1): P_i by the distinct cost of the layer before the stage; 0 for stage 0, in
        the last column (ranges that start at layer 0, which only stage 0 holds) and for costs no
        layer follows (no range starts after them)."""
        key = (self._layout_key(g, p), variant_of(g))
        hit = self._p2p.get(key)
        if hit is None:
            rc, layout = self.replica(g), self.layout(g, p)
            hit = self._p2p[key] = np.zeros((p, len(rc.costs) + 1))
            senders = rc.senders.tolist()  # costs some layer follows
            done: Dict[int, int] = {}  # a shared layout entry's first stage: the same row
            for i in range(1, p):
                if id(layout[i]) in done:
                    hit[i] = hit[done[id(layout[i])]]
                    continue
                done[id(layout[i])] = i
                by_bytes: Dict[Tuple[float, bool], float] = {}
                for d in senders:
                    sent = (rc.costs[d].out_bytes / g.cp, g.sequence_parallel and rc.costs[d].block)
                    if sent not in by_bytes:
                        by_bytes[sent] = p2p_time(self.cluster, layout[i], sent[0], g.tp, g.tp, sent[1])
                    hit[i, d] = by_bytes[sent]
        return hit

    def replica_work(self, g: GlobalConfig, p: int, v: Optional[int] = None) -> Tuple[float, float]:
        """Lower bounds on (sum_i W_i, sum_i 2 v P_i) of any plan of (g, p) (``v``: that interleave
        factor instead of g's): every layer's forward
        and backward with its collectives on the stage where they are cheapest and in the cheapest
        mode, and each stage boundary i >= 1 at its cheapest incoming layer (2 v transfers per
        microbatch). ``sum_i s_i`` is at least their sum, ``max_i t_i`` at least the first's
        over p (and the sum's over p when sends are not overlapped: ``results.microbatch_time``).
        The same for every schedule's recompute modes (a stage's forward and backward seconds do
        not depend on its mode: ``compute_terms``), so not keyed on them."""
        key = (self._layout_key(g, p), variant_of(g))
        if key not in self._work:
            rc = self.replica(g)
            terms = rc.terms[rc.modes[0]]
            total = float(terms.fwd + terms.bwd)
            # each collective once ("none": no recompute re-runs one), the least of every mode's
            comms = []
            # per distinct stage object of the layout (a stage of each): the stages' least is theirs,
            # each a number (the (p, 1) columns of comm_seconds, entry by entry)
            _, where = _distinct(self.layout(g, p))
            rows = sorted({j: i for i, j in reversed(list(enumerate(where)))}.values())
            for d, c in enumerate(rc.costs):
                per_layer = min(
                    float(
                        _comm_work(
                            comm_terms([(c, 1)], "none", lambda x, i=i: float(self.comm_seconds(g, p, x)[i, 0])),
                            c.fwd_s + c.bwd_s,
                            self.options,
                        )
                    )
                    for i in rows
                )
                total += int(rc.counts[d]) * per_layer
                comms.append(per_layer)
            boundaries = float(self.p2p(g, p)[1:, rc.senders].min(axis=1).sum()) if p > 1 else 0.0
            self._work[key] = (total, boundaries, comms)
        total, boundaries, _ = self._work[key]
        return total, 2 * (g.virtual_stages if v is None else v) * boundaries

    def busiest_work(self, g: GlobalConfig, p: int) -> float:
        """A lower bound on max_i t_i of any plan of (g, p): ``candidates.partition_floor`` of the
        layers' forward + backward with each one's collectives as ``replica_work`` counts them
        (a stage's exposed collectives are at least the sum of its layers' there, each at least
        its least over the stages)."""
        key = (self._layout_key(g, p), variant_of(g))
        hit = self._busiest.get(key)
        if hit is None:
            hit = self._busiest[key] = partition_floor(self.layer_prefix(g, p), p)
        return hit

    def layer_prefix(self, g: GlobalConfig, p: int) -> List[float]:
        """(L + 1,) prefix sums, in layer order, of each layer's forward + backward with its
        collectives as ``replica_work`` counts them (at their least over the stages)."""
        key = (self._layout_key(g, p), variant_of(g))
        hit = self._prefix.get(key)
        if hit is None:
            self.replica_work(g, p)
            comms = self._work[key][2]
            costs, _, index = self.workload.variant_costs(variant_of(g))
            times = [costs[d].fwd_s + costs[d].bwd_s + comms[d] for d in index]
            hit = self._prefix[key] = np.concatenate([[0.0], np.cumsum(times)]).tolist()
        return hit

    def tail_floor(self, g: GlobalConfig, p: int, m: int) -> float:
        """A lower bound on max_i q_i (exposed DP sync + optimizer step) of any plan of (g, p).

        q_i = max((1 - share) y_i, y_i - k (B_i + R_i)) + O_i (``dp_sync.tail_terms``; the tied
        exchange only adds) with y_i the stage's DP sync seconds, B_i its backward and R_i its
        recompute seconds per microbatch (R_i <= the replica's most recompute, summed), k the
        backward passes the sync runs under (``dp_sync.reduce_spread``), O_i its optimizer step
        (linear in its parameters). Two bounds:

        * some stage holds at least D / p of the replica's D dense parameters, and y_i grows
          with them (collectives are monotone in their bytes): ``(1 - share) min_i y_i(D / p) +
          O(D / p)``; likewise for the E expert parameters;
        * where the network is affine in the size (``collective_coefficients``: hierarchical
          clusters), y_i >= b_i D_i + c_i E_i with b_i, c_i its slopes, so the stages' mean
          ``(min b D + min c E - k (B + R_max)) / p + O(N / p)`` bounds the largest q_i.

        The FSDP per-call overhead is left out (it only adds)."""
        zero = memory.effective_zero_stage(g.zero, p, g.pp_shard_grads)
        key = (self._layout_key(g, p), variant_of(g), self.modes_for(g), zero, m if zero >= 2 else 0, g.float8)
        hit = self._tail_floor.get(key)
        if hit is None:
            hit = self._tail_floor[key] = self._tail_floor_of(g, p, m, zero)
        return hit

    def _tail_floor_of(self, g: GlobalConfig, p: int, m: int, zero: int) -> float:
        rc, o, cluster = self.replica(g), self.options, self.cluster
        terms = rc.terms[rc.modes[0]]
        total_e = float(terms.expert_params)
        total_d = float(terms.params) - total_e
        share = float(o.overlap_grad_sync) if zero >= 1 else 0.0

        def opt(params: float) -> float:  # the optimizer step of params, once per (params, shard, ZeRO)
            hit = self._opt.get((params, g.shard, zero))
            if hit is None:
                hit = self._opt[(params, g.shard, zero)] = float(
                    tail_terms(0.0, 0.0, 0.0, params, g.shard, zero, cluster, o)[1]
                )
            return hit

        best = opt((total_d + total_e) / p)
        slopes, affine = 0.0, True
        for d, e in ((total_d / p, 0.0), (0.0, total_e / p)):
            if d + e > 0:
                least, slope, affine = self._stage_syncs(g, p, m, zero, d, e)
                best = max(best, (1 - share) * least + opt(d + e))
                slopes += slope * (d + e) * p
        if affine:
            work = (float(terms.bwd) + max(float(rc.terms[r].recompute) for r in rc.modes)) * reduce_spread(zero, p, m)
            best = max(best, (slopes - work) / p + opt((total_d + total_e) / p))
        return best

    def _stage_syncs(self, g: GlobalConfig, p: int, m: int, zero: int, d: float, e: float) -> Tuple[float, float, bool]:
        """(least DP sync seconds of d dense and e expert parameters over the stages, least slope in
        seconds per parameter where the network is affine in the size, whether it is), shared by
        the variants of one layout with the same parameters (microbatch sizes, loss parallel).
        The dense parameters' (``e == 0``) are shared by the EP degrees too: the DP, shard and
        replica groups do not depend on it (``Plan.rank``), nor does their traffic without experts."""
        layout_key = self._layout_key(g, p)
        if e == 0:
            layout_key = layout_key[:3] + (1,) + layout_key[4:]  # (placement, tp, dp, ep, ...): any ep
        key = (layout_key, d, e, zero, m if zero >= 2 else 0, g.float8)
        hit = self._syncs.get(key)
        if hit is None:
            layout, cluster = self.layout(g, p), self.cluster
            affine = self._affine_dp.get(layout_key)
            if affine is None:  # the same for every size and parameter split of the layout
                affine = self._affine_dp[layout_key] = (
                    len(layout[0].dp) < 2 or cluster.collective_coefficients("all_reduce", layout[0].dp) is not None
                )
            # each at the sizes d and 2 d (the slope's two points), one number at a time: what
            # an array [d, 2 d] gives entry by entry, without numpy's per-call overhead on two values;
            # once per what dp_sync_time reads of a stage's groups (sync_signature), over the layouts
            experts, at = g.dp * g.cp // g.ep > 1 and e != 0, []
            for groups in _distinct(layout)[0]:
                sig = self._sync_signature(groups, zero, experts)
                vkey = (sig, d, e, g.dp * g.cp, g.ep, zero, m if zero >= 2 else 0, g.float8)
                pair = self._sync_values.get(vkey) if sig is not None else None
                if pair is None:
                    pair = tuple(
                        float(
                            dp_sync_time(
                                cluster,
                                groups,
                                d * size,
                                e * size,
                                g.dp * g.cp,
                                g.ep,
                                zero,
                                m,
                                self.options,
                                0.0,
                                d * size if g.float8 else 0.0,
                                self.collective,
                            )
                        )
                        for size in (1.0, 2.0)
                    )
                    if sig is not None:
                        self._sync_values[vkey] = pair
                at.append(pair)
            least = min(y0 for y0, _ in at)
            slope = min(y1 - y0 for y0, y1 in at) / (d + e) if affine else 0.0
            hit = self._syncs[key] = (least, slope, affine)
        return hit

    def _sync_signature(self, groups, zero: int, experts: bool) -> Optional[tuple]:
        """``dp_sync.sync_signature`` of a stage's groups object of a layout this cache holds, once."""
        key = (id(groups), zero <= 1, experts)
        hit = self._sync_sigs.get(key)
        if hit is None or hit[0] is not groups:  # (the object is held in the entry: its id stays its own)
            hit = self._sync_sigs[key] = (groups, sync_signature(self.cluster, groups, zero, experts))
        return hit[1]

    def replica_params(self, g: GlobalConfig) -> float:
        """Parameters per device of one whole replica (all layers on one stage)."""
        rc = self.replica(g)
        return float(rc.terms[rc.modes[0]].params)

    def states(self, g: GlobalConfig, p: int) -> tuple:
        """(dense states, expert states, dense params, expert params, optimizer seconds, then
        ``step_time.working_sets``), (K,) each, at the ZeRO stage a depth-p pipeline really has
        (``memory.effective_zero_stage``), with a tied embedding's second copy under pipelining."""
        zero = memory.effective_zero_stage(g.zero, p, g.pp_shard_grads)
        key = (variant_of(g), zero, g.shard, g.dp // g.ep * g.cp, p > 1)
        if key not in self._states:
            rc = self.classes(g)
            terms = held_terms(rc.terms[rc.modes[0]], p)
            dense = terms.params - terms.expert_params
            opts = self.options
            t_opt = tail_terms(0.0, 0.0, 0.0, terms.params, g.shard, zero, self.cluster, opts)[1]
            self._states[key] = (
                model_states(dense, zero, g.shard, opts, p > 1),
                model_states(terms.expert_params, zero, expert_shard_degree(g.dp, g.dp_shard, g.ep, g.cp), opts, p > 1),
                dense,
                terms.expert_params,
                t_opt,
                *working_sets(terms, zero, g.shard, opts, self.cluster.device),
            )
        return self._states[key]


def _shared_layout(plan: Plan, p: int, shift_class) -> List[StageGroups]:
    """``stage_groups`` of each of ``plan``'s p stages, a middle stage (1 <= i < p - 1: no tied
    exchange) sharing the object of the first middle stage of its class under ``shift_class``
    (None: every stage its own). Stage i >= 1's groups are stage 1's moved by ``(i - 1) c``
    with c the stage offset, as ``Plan.rank`` is the stage offset plus a term free of the stage
    when the TP degrees are equal (tests/unit/solver/test_layout_classes.py checks it)."""
    step = plan.stage_offset(1) if p > 1 else 0
    if shift_class is None or p < 4 or any(plan.stage_offset(i) != i * step for i in range(p)):
        return [stage_groups(plan, i) for i in range(p)]
    first = stage_groups(plan, 1)
    spans = sorted({(min(grp), max(grp)) for grp in _groups_of(first)})  # a class is a function of these
    out = [stage_groups(plan, 0), first]
    seen: Dict[tuple, StageGroups] = {}
    for i in range(1, p - 1):
        cls = tuple(shift_class(lo, hi, (i - 1) * step) for lo, hi in spans)
        if cls not in seen:
            seen[cls] = first if i == 1 else stage_groups(plan, i)
        if i > 1:
            out.append(seen[cls])
    out.append(stage_groups(plan, p - 1))
    return out


def _groups_of(groups: StageGroups) -> List[Tuple[int, ...]]:
    """Every non-empty rank group (pairs included) of ``groups``."""
    out: List[Tuple[int, ...]] = []
    for f in fields(groups):
        value = getattr(groups, f.name)
        if value and isinstance(value[0], tuple):
            out += [grp for grp in value if grp]
        elif value:
            out.append(value)
    return out


def _distinct(layout: List[StageGroups]) -> Tuple[List[StageGroups], List[int]]:
    """(the distinct objects of ``layout``, each stage's index among them)."""
    index: Dict[int, int] = {}
    objs: List[StageGroups] = []
    where = []
    for groups in layout:
        k = index.get(id(groups))
        if k is None:
            k = index[id(groups)] = len(objs)
            objs.append(groups)
        where.append(k)
    return objs, where
