"""What a stage's costs are made of: the sums over its layers (:class:`LayerTerms`) and the rank
groups it communicates in (:class:`StageGroups`). ``simulate`` builds them for one plan's
stages, the solver's stage tables for every layer range at once (arrays; ``cost.arrays``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from nest_fx.cost.arrays import Count
from nest_fx.plan.plan import Plan
from nest_fx.workload.types import LayerCost

def _replicas_to_check(dp: int) -> List[int]:
    return sorted({0, dp // 2, dp - 1})


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
