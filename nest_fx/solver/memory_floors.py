"""The per-pair bounds of the search that see memory (:class:`MemoryFloors`, a part of
``table_cache.TableCache``): the recompute the pooled memory forces on every plan of a pair
(``forced_recompute``), the busiest stage with each stage's own memory by layer count
(``stage_floor``) and in layer order with the layers' collectives (``splits_fit``). The
arguments are in ``solver.stage_reach``; the cache's dicts memoise them per search."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import numpy as np

from nest_fx.cost import memory
from nest_fx.cost.recv_buffers import least_recv_buffer_bytes
from nest_fx.solver.candidates import variant_of
from nest_fx.solver.range_classes import costed_modes
from nest_fx.solver.ordered_memory import OrderedMemory, ordered_memory, range_recompute
from nest_fx.solver.space import GlobalConfig
from nest_fx.solver.stage_reach import (
    busiest_floor,
    hull_modes,
    reach_terms,
    recompute_floors,
    recompute_hull,
    splits_fit,
    stage_memory_terms,
)


class MemoryFloors:
    """Memory-aware lower bounds of :class:`~nest_fx.solver.table_cache.TableCache` (which holds
    the memo dicts, ``capacity``, ``replica``, ``layer_prefix`` these read)."""

    def forced_recompute(self, g: GlobalConfig, p: int, m: int, v: Optional[int] = None) -> float:
        """A lower bound on the recompute seconds per microbatch that any plan of (g, p) spends to
        fit in memory (inf when none fits), summed over its stages; ``v``: at that interleave
        factor instead of g's (a family's members share one call's other terms).

        Stage i holds its parameters' model states (at least ``k`` bytes each: g's ZeRO stage over
        all its shard ranks) and ``f_i`` in-flight microbatches of its blocks' activations
        (``inflight.pipeline_inflight_microbatches``; other terms only add), so
        ``A_i <= (C - k P_i) / f_i``; summed over the stages, the blocks' activations per
        microbatch obey ``sum_l a_l <= C sum_i 1 / f_i - k P / max_i f_i``. The cheapest way to
        meet that, choosing per block a recompute mode (fractionally: the LP relaxation, solved
        greedily on each block's lower convex hull of (kept bytes, recompute seconds)), bounds
        the recompute time of every plan from below."""
        v = g.virtual_stages if v is None else v
        # keyed by what the effective ZeRO stage is made of: asked it only when missing
        key = (g.variant, g.zero, g.pp_shard_grads, g.shard, p, m, g.schedule, v)
        hit = self._forced.get(key)
        if hit is None:
            zero = memory.effective_zero_stage(g.zero, p, g.pp_shard_grads)
            hit = self._forced[key] = self._forced_recompute(g, p, m, zero, v)
        return hit

    def _forced_recompute(self, g: GlobalConfig, p: int, m: int, zero: int, v: int) -> float:
        per_param, inflight = self._memory_terms(g, p, m, zero, v)
        params, kept, segments = self._recompute_hull(g)
        share, most = self._inflight_sums(g, p, m, zero, v)
        budget = self._room_left(g, p, m, v) * share - per_param * params / most
        excess = kept - budget
        seconds = 0.0
        for rate, saved in segments:
            if excess <= 0:
                break
            take = min(saved, excess)
            seconds += rate * take
            excess -= take
        return seconds if excess <= 0 else math.inf

    def _memory_terms(self, g: GlobalConfig, p: int, m: int, zero: int, v: int) -> Tuple[float, List[float]]:
        """``stage_reach.stage_memory_terms``, once per (ZeRO, shard, p, m, schedule, v): the
        variants of a pair share it."""
        key = (zero, g.shard, p, m, g.schedule, v)
        hit = self._inflight.get(key)
        if hit is None:
            hit = self._inflight[key] = stage_memory_terms(g, p, m, zero, v, self.options)
        return hit

    def _inflight_sums(self, g: GlobalConfig, p: int, m: int, zero: int, v: int) -> Tuple[float, float]:
        """(sum_i 1 / f_i, max_i f_i) of :meth:`_memory_terms`' in-flight microbatches, once per
        its key (every variant of a pair's memory terms reads them)."""
        key = (zero, g.shard, p, m, g.schedule, v)
        hit = self._sums.get(key)
        if hit is None:
            inflight = self._memory_terms(g, p, m, zero, v)[1]
            hit = self._sums[key] = (sum(1.0 / f for f in inflight), max(inflight))
        return hit

    def stage_floor(self, g: GlobalConfig, p: int, m: int, v: Optional[int] = None) -> float:
        """A lower bound on max_i t_i of any plan of (g, p) (``v``: at that interleave factor)
        that sees each stage's own memory (``stage_reach``); inf when no split fits."""
        zero, v = memory.effective_zero_stage(g.zero, p, g.pp_shard_grads), g.virtual_stages if v is None else v
        key = (variant_of(g), zero, g.shard, p, m, g.schedule, v)
        hit = self._stage_floor.get(key)
        if hit is None:
            per_param, inflight = self._memory_terms(g, p, m, zero, v)
            reach = self._reach_terms(g)
            # a stage leaves every other stage a layer and holds one per model chunk at least (StageTable)
            hit = self._stage_floor[key] = busiest_floor(
                reach, inflight, per_param, self._room_left(g, p, m, v), max(v, 1), len(self.workload) - p + 1
            )
        return hit

    def _room_left(self, g: GlobalConfig, p: int, m: int, v: int) -> float:
        """The usable bytes less the receive buffers every stage of a plan of (g, p) holds at least
        (``cost.recv_buffers``: ``m`` per direction and receiving chunk, at least ``2 v - 1`` of
        them per rank, ``2 v - 2`` under a V schedule, each at least the smallest tensor a layer
        other than the last hands on); the capacity itself without pipelining."""
        key = (variant_of(g), p, m, g.schedule, v)
        hit = self._room.get(key)
        if hit is None:
            costs, _, index = self.workload.variant_costs(variant_of(g))
            sent = [c.out_bytes / g.cp for k, c in enumerate(costs) if k != index[-1] and c.out_bytes > 0]
            least = min(sent, default=0.0)
            sp = g.tp if g.sequence_parallel else 1
            buffers = least_recv_buffer_bytes(least, p, m, max(v, 1), g.schedule, self.options, sp)
            hit = self._room[key] = self.capacity - buffers
        return hit

    def _recompute_hull(self, g: GlobalConfig) -> Tuple[float, float, List[Tuple[float, float]]]:
        """``stage_reach.recompute_hull`` of g's variant (what ``forced_recompute`` reads), once."""
        rc = self.replica(g)
        key = (variant_of(g), rc.modes)
        hit = self._hulls.get(key)
        if hit is None:
            hit = self._hulls[key] = recompute_hull(rc.costs, rc.counts, rc.modes)
        return hit

    def splits_fit(self, g: GlobalConfig, p: int, m: int, v: int, cap: float) -> bool:
        """Whether some split of (g, p) at interleave factor v may have every stage's time at most
        ``cap`` (``stage_reach.splits_fit``): each stage's layers in order with their collectives
        (``layer_prefix``) and the recompute its own memory forces for its layer count
        (``stage_reach.recompute_floors``: the blocks' least kept activations and parameters for
        that count, stage i's in-flight microbatches), and what each range's own layers force
        (``ordered_memory.range_recompute``). False proves max_i t_i > cap."""
        zero = memory.effective_zero_stage(g.zero, p, g.pp_shard_grads)
        per_param, inflight = self._memory_terms(g, p, m, zero, v)
        # what recompute_floors reads: the variant's reach terms, the in-flight counts (shared by
        # schedules, microbatch counts and factors that give the same ones) and the states per parameter
        room = self._room_left(g, p, m, v)
        key = (variant_of(g), self.replica(g).modes, per_param, tuple(inflight), room)
        floors = self._recompute_floors.get(key)
        if floors is None:
            floors = self._recompute_floors[key] = recompute_floors(self._reach_terms(g), inflight, per_param, room)
        ordered, share = self._ordered_memory(g), self.options.allocator_peak_share
        memo = self._ranged.setdefault((variant_of(g), self.modes_for(g), per_param, room), {})

        def ranged(i: int, begin: int, ends: np.ndarray) -> np.ndarray:
            # the same (range, in-flight count) recurs across the pairs of one variant and states
            # (ZeRO stage, shard degree), and the greedy asks consecutive ends: memoised as asked
            key = (inflight[i], begin, int(ends[0]), int(ends[-1]), len(ends))
            hit = memo.get(key)
            if hit is None:
                hit = memo[key] = range_recompute(ordered, begin, ends, inflight[i], per_param, room, share)
            return hit

        return splits_fit(self.layer_prefix(g, p), floors, cap, ranged)

    def _ordered_memory(self, g: GlobalConfig) -> OrderedMemory:
        """``ordered_memory.ordered_memory`` of g's variant (the layers in order), once."""
        rc = self.replica(g)
        key = (variant_of(g), self.modes_for(g))
        hit = self._ordered.get(key)
        if hit is None:
            _, prefix, _ = self.workload.variant_costs(key[0])
            # every mode the schedule may run (the table searches the undominated ones of these)
            modes = costed_modes(self.workload, key[0], self.modes_for(g))
            hit = self._ordered[key] = ordered_memory(rc.costs, prefix, modes)
        return hit

    def _reach_terms(self, g: GlobalConfig):
        rc = self.replica(g)
        key = (variant_of(g), rc.modes)
        hit = self._reach.get(key)
        if hit is None:
            hit = self._reach[key] = reach_terms(rc.costs, rc.counts, hull_modes(rc.modes))
        return hit
