"""What a stage's costs are made of: the sums over its layers (:class:`LayerTerms`) and the rank
groups it communicates in (:class:`StageGroups`). ``simulate`` builds them for one plan's
stages, the solver's stage tables for every layer range at once (arrays; ``cost.arrays``)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import List, Optional, Sequence, Tuple

import numpy as np

from nest_fx.cost.arrays import Count
from nest_fx.graph.recompute_policies import cost_key, parse_recompute
from nest_fx.plan.vocabulary import V_SCHEDULES
from nest_fx.plan.plan import Plan
from nest_fx.workload.types import Comm, LayerCost


def _replicas_to_check(dp: int) -> List[int]:
    return sorted({0, dp // 2, dp - 1})


@dataclass(frozen=True)
class StageGroups:
    """The rank groups stage i's costs depend on, for the replicas the cost model checks (first,
    middle, last; ``_replicas_to_check``)."""

    tp: Tuple[Tuple[int, ...], ...]  # TP group per checked replica
    ep: Tuple[Tuple[int, ...], ...]  # EP group per checked replica; empty when ep == 1
    p2p: Tuple[Tuple[int, int], ...]  # (rank of stage i-1, rank of stage i), TP rank 0; empty for stage 0
    dp: Tuple[int, ...]  # the ranks the stage's gradients are reduced over (dp x cp, TP rank 0)
    expert_dp: Tuple[int, ...]  # the replicas holding the same experts (x cp)
    cp: Tuple[Tuple[int, ...], ...] = ()  # CP group per checked replica; empty when cp == 1
    shard: Tuple[int, ...] = ()  # HSDP: the first shard group (dp_shard x cp ranks); empty without HSDP
    replicate: Tuple[int, ...] = ()  # HSDP: the ranks holding the same shard across shard groups
    expert_shard: Tuple[int, ...] = ()  # HSDP x EP: the first shard group's ranks holding the same experts
    tied: Tuple[Tuple[int, int], ...] = ()  # (first-stage rank, last-stage rank) exchanging tied gradients


def stage_groups(plan: Plan, i: int, replicas: Optional[Sequence[int]] = None) -> StageGroups:
    """Stage i's rank groups under ``plan``'s placement (they depend on the stages' TP degrees,
    dp, ep, cp, dp_shard, the placement and i, not on the layer ranges)."""
    replicas = _replicas_to_check(plan.dp) if replicas is None else replicas
    by_cp = [plan.dp_group(i, 0, c) for c in range(plan.cp)]
    # (chain, not a generator: DP groups hold up to thousands of ranks and layouts are built per pair)
    dp = tuple(sorted(chain.from_iterable(by_cp)))
    expert = tuple(sorted(chain.from_iterable(group[:: plan.ep] for group in by_cp)))
    shard = replicate = expert_shard = ()
    if plan.replicate_degree > 1:
        shards = [plan.shard_group(i, 0, 0, c) for c in range(plan.cp)]
        shard = tuple(sorted(chain.from_iterable(shards)))
        replicate = tuple(by_cp[0][:: plan.shard_degree])
        if plan.ep > 1:  # ep divides dp_shard (plan.may_run): the shard group's replicas 0, ep, 2 ep, ...
            expert_shard = tuple(sorted(chain.from_iterable(group[:: plan.ep] for group in shards)))
    last = plan.pp - 1
    # the V schedules hold the first and the last chunk on device 0: one tied parameter, no exchange
    exchange = i in (0, last) and last and plan.schedule not in V_SCHEDULES
    tied = tuple((plan.rank(0, r, 0), plan.rank(last, r, 0)) for r in replicas) if exchange else ()
    return StageGroups(
        tp=tuple(tuple(plan.tp_group(i, r)) for r in replicas),
        ep=tuple(tuple(plan.ep_group(i, r)) for r in replicas) if plan.ep > 1 else (),
        p2p=tuple((plan.rank(i - 1, r, 0), plan.rank(i, r, 0)) for r in replicas) if i > 0 else (),
        dp=dp,
        expert_dp=expert,
        cp=tuple(tuple(plan.cp_group(i, r)) for r in replicas) if plan.cp > 1 else (),
        shard=shard,
        replicate=replicate,
        expert_shard=expert_shard,
        tied=tied,
    )


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
    act_root: Count = 0.0  # of act, the head's and tail's (the first / last chunk of an interleaved stage)
    fp8_params: Count = 0.0  # parameters FSDP all-gathers in fp8 (Float8 linears)
    tied_params: Count = 0.0  # a tied LM head's weight, when the stage holds the tail (a second copy under PP)


def recomputed_counts(distinct: Sequence[Tuple[LayerCost, Count]], every: int) -> List[Count]:
    """``every:<k>``: how many blocks of each distinct cost run under full recompute. The runtime
    recomputes ``n // k`` of the stage's ``n`` blocks by position (``Recompute.recomputed_blocks``);
    the layer counts say how many of each cost a stage holds, not where, so the recomputed ones are
    taken from the costs that save the least memory by it (exact for stages of identical blocks;
    otherwise the memory is an upper bound)."""
    blocks = [(k, c, count) for k, (c, count) in enumerate(distinct) if c.block]
    left = sum((count for _, _, count in blocks), 0) // every
    out: List[Count] = [0 for _ in distinct]
    for k, c, count in sorted(blocks, key=lambda x: x[1].act_bytes["none"] - x[1].act_bytes["full"]):
        take = np.minimum(left, count) if isinstance(left + count, np.ndarray) else min(left, count)
        out[k] = take
        left = left - take
    return out


def compute_terms(distinct: Sequence[Tuple[LayerCost, Count]], recompute: str) -> LayerTerms:
    """:class:`LayerTerms` of a stage's layers under ``recompute`` (any plan form).

    ``distinct``: (layer cost, count) pairs as ``Workload.range_costs`` gives them; a count may
    be an integer array (one entry per layer range), and a zero count adds exactly 0.

    ``layer_peak`` is what one layer's backward holds beyond the saved activations, largest over
    the stage's layers: what a recomputed layer rebuilds (``none``'s bytes less the policy's),
    plus the layer's own backward scratch (``LayerCost.bwd_scratch``, e.g. the loss's gradients of the logits).
    Layers run their backward one at a time, so only the largest counts. ``every:<k>`` runs
    :func:`recomputed_counts` of the blocks under ``full`` and the rest under ``none``."""
    spec = parse_recompute(recompute)
    if spec.kind == "every":
        full = recomputed_counts(distinct, spec.every)
        splits = [(c, [("full", f), ("none", count - f)]) for (c, count), f in zip(distinct, full)]
    else:
        key = cost_key(recompute)
        splits = [(c, [(key, count)]) for c, count in distinct]
    fwd = bwd = rec = params = expert = act = act_full = root = unit = blocks = act_root = fp8 = tied = 0.0
    for c, shares in splits:
        count = sum(n for _, n in shares)
        if not c.block:
            root = root + c.num_params * count
        else:
            blocks = blocks + count
            unit = _running_max(unit, c.num_params, count)
        fwd = fwd + c.fwd_s * count
        bwd = bwd + c.bwd_s * count
        params = params + c.num_params * count
        expert = expert + c.expert_params * count
        fp8 = fp8 + c.fp8_params * count
        tied = tied + c.tied_params * count
        for mode, n in shares:
            rec = rec + c.recompute_s[mode] * n
            act = act + c.act_bytes[mode] * n
            if not c.block:
                act_root = act_root + c.act_bytes[mode] * n
            # a recomputed layer rebuilds, for its backward, what it did not keep
            rebuilt = max(c.act_bytes["none"] - c.act_bytes[mode], 0.0) if mode != "none" else 0.0
            act_full = _running_max(act_full, rebuilt + c.bwd_scratch, n)
    return LayerTerms(
        fwd=fwd,
        bwd=bwd,
        recompute=rec,
        params=params,
        expert_params=expert,
        act=act,
        layer_peak=act_full,
        root_params=root,
        unit_params=unit,
        blocks=blocks,
        act_root=act_root,
        fp8_params=fp8,
        tied_params=tied,
    )


def _running_max(current: Count, value: float, count: Count) -> Count:
    """``max(current, value)`` where ``count > 0`` (elementwise for arrays)."""
    if isinstance(count, np.ndarray) or isinstance(current, np.ndarray):
        return np.maximum(current, np.where(np.asarray(count) > 0, value, 0.0))
    return max(current, value) if count > 0 else current


def repeated_share(comm: Comm, recompute: str) -> float:
    """Share of ``comm``'s ``count`` collectives a block's recompute runs again: none unless the
    policy re-runs it (:func:`forward_repeats`), and never the block's last forward collective
    when nothing in the block saves what it feeds (``Comm.unrecomputed``: the row output before
    a pre-norm block's residual add): torch's non-reentrant checkpoint stops once the saved
    tensors are rebuilt (counted on gloo ranks: ``tests/distributed/apply/test_tp_input_once.py``)."""
    if not forward_repeats(comm, recompute) or comm.count <= 0:
        return 0.0
    return (comm.count - comm.unrecomputed) / comm.count


def forward_repeats(comm: Comm, recompute: str) -> bool:
    """Whether a block's forward collective runs again in its recompute (``docs/cost_model.md``):
    under ``full`` every one; under a selective policy those whose outputs the policy does not
    keep: the context-parallel key/value all-gather and the expert all-to-all (c10d calls inside
    autograd functions, re-run by any recompute), and under the op policies also the TP
    all-gather / all-reduce (functional collectives they do not save; their reduce-scatters are
    saved). ``every:<k>`` is costed per block through ``full`` and ``none``."""
    if comm.phase != "fwd":
        return False
    kind = cost_key(recompute)
    if kind == "full":
        return True
    if kind == "none":
        return False
    if comm.group in ("cp", "ep"):
        return True
    return kind != "selective" and comm.kind in ("all_gather", "all_reduce")
