"""Stage costs of one (global config g, pipeline depth p) for every stage slot and layer range,
computed with numpy: the table the NEST DP reads.

Stage i's cost depends on its layer range [b, e) only through the range's class
(:mod:`nest_fx.solver.range_classes`). Per (stage index, class, recompute mode) the table
assembles the simulator's own terms (``stage_terms.compute_terms``, ``step_time.comm_terms``,
``microbatch_time``, ``memory.model_states``, ``stage_memory``, ``dp_sync.dp_sync_time``,
``tail_terms``) on arrays, so every entry equals ``step_time.stage_cost`` exactly (``tests/unit/solver/test_stage_table.py``).
What the tables of one search share is in :class:`~nest_fx.solver.table_cache.TableCache`.

A table only holds the classes that can be part of a plan faster than the best plan known when
it is built (``live``): a stage of more than L - p + 1 layers leaves another stage empty, one of
fewer than v layers cannot be cut into the interleaved schedule's v model chunks, and a
stage whose forward + backward time t alone gives ``pipeline_span(t, t) + T_opt >= best`` is
too slow (max_i t_i >= t, sum_i t_i >= t, max_i q_i >= its optimizer step). The bounds the DP
prunes with as ``best`` decreases are in :mod:`nest_fx.solver.stage_bounds`.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from nest_fx.cost.recv_buffers import recv_buffer_bytes
from nest_fx.cost import inflight, memory
from nest_fx.cost.dp_sync import dp_sync_time, fsdp_units, reduce_spread, tail_terms, tied_sync_time
from nest_fx.cost.memory import held_per_microbatch, stage_memory
from nest_fx.cost.results import microbatch_time, stage_work
from nest_fx.cost.step_time import COMM_KEYS, exposed_comms, held_terms
from nest_fx.solver.range_classes import subset_terms
from nest_fx.solver.space import GlobalConfig, objective
from nest_fx.solver.stage_bounds import INF, SLACK, StageBounds
from nest_fx.solver.table_cache import TableCache


class StageTable(StageBounds):
    """t_i (per-microbatch time), fits and q_i (tail) of every (stage i, live class, recompute)
    of one (g, p). Arrays are (p, K + 1) over the K live classes, column K the "no range"
    sentinel (t = inf, no fit); ``cls`` maps ranges to live classes (K when not live). What can
    still be part of a plan faster than a given ``best`` (and the bounds the DP prunes with) are
    the methods of :class:`~nest_fx.solver.stage_bounds.StageBounds`."""

    def __init__(self, cache: TableCache, g: GlobalConfig, p: int, m: int, best: float = INF):
        self.cache, self.g, self.p, self.m = cache, g, p, m
        self.n = n = len(cache.workload)
        rc = cache.classes(g)
        self.modes = rc.modes
        states, estates, dense, expert, t_opt, gathered, unsharded, scratch = cache.states(g, p)
        self.zero = memory.effective_zero_stage(g.zero, p, g.pp_shard_grads)
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
        self._units = fsdp_units(subset_terms(rc.terms[self.modes[0]], live))
        self.terms = {r: held_terms(subset_terms(rc.terms[r], live), p) for r in self.modes}
        p2p = cache.p2p(g, p)[:, rc.prev[live]]
        states = {key: v[live] for key, v in states.items()}
        estates = {key: v[live] for key, v in estates.items()}
        opts = cache.options
        self._fp8 = self.terms[self.modes[0]].fp8_params if g.float8 else 0.0
        self._tied = [
            tied_sync_time(cache.cluster, groups, rc.tied, self.zero, g.shard, opts) for groups in cache.layout(g, p)
        ]
        # every recompute mode at once: (M, p, K) arrays, mode first; each entry is the same
        # elementwise arithmetic one mode's (p, K) table does (a mode's terms are (M, 1, K))
        modes = self.modes

        def per_mode(name: str) -> np.ndarray:  # (M, K): one term of every mode's layer sums
            values = [getattr(self.terms[r], name) for r in modes]
            if all(isinstance(x, np.ndarray) and x.shape == (k,) for x in values):
                return np.stack(values)
            return np.stack([np.broadcast_to(x, (k,)) for x in values])  # a number: the same for every class

        fwd, bwd, rec = (per_mode(name)[:, None, :] for name in ("fwd", "bwd", "recompute"))
        self._tail_terms = np.stack([bwd[:, 0], rec[:, 0], per_mode("params")])  # (3, M, K): what q_i reads
        comms = {key: np.stack([cache.comms(g, p, r)[key][:, live] for r in modes]) for key in COMM_KEYS}
        exposed = exposed_comms(comms, fwd + bwd + rec, opts)
        work = stage_work(fwd, bwd, rec, exposed["tp"], exposed["ep"], exposed["cp"])
        t, s = np.full((len(modes), p, k + 1), INF), np.full((len(modes), p, k + 1), INF)
        t[:, :, :k], s[:, :, :k] = microbatch_time(work, p2p, g.virtual_stages, opts.overlap_p2p)
        held_act = held_per_microbatch(
            per_mode("act"), rc.out_bytes[live], p, g.virtual_stages, opts, g.tp if g.sequence_parallel else 1
        )
        act_root = per_mode("act_root")
        held = np.empty((len(modes), p, k))
        for i in range(p):
            held[:, i] = inflight.held_activation_bytes(held_act, act_root, g.schedule, i, p, m, g.virtual_stages)
        sp = g.tp if g.sequence_parallel else 1
        out_b, in_b = rc.out_bytes[live], rc.in_bytes[live]
        buffers = np.stack(
            [recv_buffer_bytes(out_b, in_b, i, p, m, g.virtual_stages, g.schedule, opts, sp) for i in range(p)]
        )
        mem = stage_memory(
            states,
            estates,
            held,
            per_mode("layer_peak")[:, None, :],
            rc.out_bytes[live],
            gathered[live],
            unsharded[live],
            scratch[live],
            num_microbatches=m,
            options=opts,
            buffers=buffers,
        )
        fits = np.zeros((len(modes), p, k + 1), dtype=bool)
        fits[:, :, :k] = mem["total"] <= cache.capacity
        self.t: Dict[str, np.ndarray] = {r: t[j] for j, r in enumerate(modes)}
        self.s: Dict[str, np.ndarray] = {r: s[j] for j, r in enumerate(modes)}
        self.fits: Dict[str, np.ndarray] = {r: fits[j] for j, r in enumerate(modes)}
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

    def _tail_values(self, i: int, cols: np.ndarray) -> Dict[str, np.ndarray]:
        """q_i per mode for classes ``cols`` (exact; DP sync computed once per (stage, class))."""
        g, cache = self.g, self.cache
        todo = cols[np.isnan(self._sync[i, cols])]
        if todo.size:
            fp8 = self._fp8[todo] if isinstance(self._fp8, np.ndarray) else 0.0
            self._sync[i, todo] = dp_sync_time(
                cache.cluster,
                cache.layout(g, self.p)[i],
                self._dense[todo],
                self._expert[todo],
                g.dp * g.cp,
                g.ep,
                self.zero,
                self.m,
                cache.options,
                self._units[todo],
                fp8,
                cache.collective,
            )
        bwd, recompute, params = self._tail_terms[:, :, cols]  # (M, C) each: every mode at once
        exposed, t_opt = tail_terms(
            self._sync[i, cols],
            bwd,
            recompute,
            params,
            g.shard,
            self.zero,
            cache.cluster,
            cache.options,
            self._tied[i],
            reduce_spread(self.zero, self.p, self.m),
        )
        q = exposed + t_opt
        return {r: q[j] for j, r in enumerate(self.modes)}
