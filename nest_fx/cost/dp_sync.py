"""Data-parallel gradient synchronisation of a pipeline stage and its tail after the last backward.

The ranks a stage's states are sharded over (``shard_degree``, ``expert_shard_degree``), the
seconds of its gradient (and ZeRO-2/3 parameter) traffic per step over its DP x CP group or,
under HSDP, inside the shard group and across the replicas (``dp_sync_time``), the tied
embedding's gradient exchange between the first and last stage (``tied_sync_time``), and what
of it stays exposed after the backward, with the optimizer step (``tail_terms``): the q_i of
``step_time``'s module docstring. Numbers or arrays of them (the solver's stage tables).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from nest_fx.cost.arrays import Count, any_nonzero
from nest_fx.cost.collectives import collective_fn, collective_line
from nest_fx.cost.options import CostOptions
from nest_fx.cost.stage_terms import LayerTerms, StageGroups

# (kind, cluster, group) -> (bytes -> seconds): ``collectives.collective_fn``'s signature
CollectiveFn = Callable[[str, object, Sequence[int]], Callable[[Count], Count]]


def expert_shard_degree(dp: int, dp_shard: int, ep: int, cp: int) -> int:
    """Ranks ZeRO/FSDP shards an expert's states over: the replicas of its shard group (HSDP's
    ``dp_shard`` when it splits ``dp``, else ``dp``) that hold the same experts (one in ``ep``),
    at least one, times the CP ranks."""
    replicas = dp_shard if 0 < dp_shard < dp else dp
    return max(replicas // ep, 1) * cp


def shard_degree(plan_or_dp: int, dp_shard: int, cp: int) -> int:
    """Ranks ZeRO/FSDP shards a stage's states over: the HSDP shard group (``dp_shard``
    replicas), or all ``dp`` replicas, times the CP ranks (which hold the same parameters)."""
    return (dp_shard or plan_or_dp) * cp


def tied_sync_time(cluster, groups: StageGroups, params: Count, zero: int, shard: int, options: CostOptions) -> Count:
    """Seconds of the tied embedding's gradient exchange after backward (``apply.tied_weights``):
    the first and last stage's ranks at the same coordinates swap their local gradient shards
    (1/shard of it under FSDP), both directions at once; 0 on other stages, without pipelining or
    without a tie."""
    if not groups.tied or not any_nonzero(params):
        return 0.0
    nbytes = params * options.reduce_dtype_bytes() / (shard if zero >= 1 else 1)
    times = [collective_fn("p2p", cluster, pair)(nbytes) for pair in groups.tied]
    return np.maximum.reduce(times) if isinstance(nbytes, np.ndarray) else max(times)


def fsdp_units(terms: LayerTerms) -> Count:
    """FSDP units of a stage: one per block, plus the root when it holds parameters."""
    root = terms.root_params > 0
    return terms.blocks + (root.astype(float) if isinstance(root, np.ndarray) else float(root))


def dp_sync_time(
    cluster,
    groups: StageGroups,
    dense_params: Count,
    expert_params: Count,
    dp: int,
    ep: int,
    zero: int,
    num_microbatches: int,
    options: CostOptions,
    units: Count = 1.0,
    fp8_params: Count = 0.0,
    collective: CollectiveFn = collective_fn,
) -> Count:
    """Seconds of gradient (and ZeRO-2/3 parameter) traffic of a stage per step, not yet
    overlapped: dense parameters over its DP x CP group (or, under HSDP, inside the shard group
    and across the replicas), expert parameters over the replicas holding the same experts, plus
    the runtime's host work per FSDP collective (``options.fsdp_call_overhead``; ``units`` FSDP
    units each run their own). ``dp``: the ranks holding the stage's parameters (dp x cp);
    ``fp8_params``: parameters all-gathered in fp8 (Float8 linears). Arrays of parameter counts
    give an array. ``collective``: ``collectives.collective_fn`` or a memo of it (the solver's,
    per rank group it holds: the same functions, resolved once)."""
    if dp <= 1:
        return 0.0
    total = _sync_volume_time(cluster, groups, dense_params, zero, num_microbatches, options, fp8_params, collective)
    if dp // ep > 1 and any_nonzero(expert_params):
        # under HSDP the experts shard inside the shard group and replicate across (apply/mesh.py)
        experts = dataclasses.replace(
            groups,
            dp=groups.expert_dp,
            shard=groups.expert_shard,
            replicate=groups.replicate if groups.expert_shard else (),
        )
        total = total + _sync_volume_time(
            cluster, experts, expert_params, zero, num_microbatches, options, collective=collective
        )
    per_call, per_byte = options.fsdp_call_overhead
    if zero >= 1 and (per_call or per_byte):
        m, pbytes, gbytes = num_microbatches, options.param_bytes, options.reduce_dtype_bytes()
        # (all-gathers, reduce-scatters) per unit and step, as the runtime issues them
        gathers, scatters = {1: (1, 1), 2: (1, m), 3: (2 * m, m)}[zero]
        params = dense_params + expert_params
        total = (
            total + units * (gathers + scatters) * per_call + per_byte * params * (gathers * pbytes + scatters * gbytes)
        )
    return total


def sync_signature(
    cluster, groups: StageGroups, zero: int, experts: bool, line: Callable = collective_line
) -> Optional[tuple]:
    """What :func:`dp_sync_time` (with ``collectives.collective_fn``) reads of ``groups`` at ZeRO
    stage ``zero``: the group sizes and branches it takes and the (alpha, beta) line
    (``collectives.collective_line``) of each collective it asks, the expert parameters' too when
    ``experts`` (it asks them when ``dp // ep > 1`` and there are expert parameters). Two stage
    groups with equal signatures give equal seconds for every other argument; None when a
    collective is not affine in the size (no two groups are then known to cost alike).
    ``line``: ``collective_line`` or a memo of it."""
    parts = [_volume_signature(cluster, groups.dp, groups.shard, groups.replicate, zero, line)]
    if experts:
        replicate = groups.replicate if groups.expert_shard else ()
        parts.append(_volume_signature(cluster, groups.expert_dp, groups.expert_shard, replicate, zero, line))
    return None if None in parts else tuple(parts)


def _volume_signature(cluster, dp, shard, replicate, zero: int, line: Callable) -> Optional[tuple]:
    """:func:`sync_signature` of one :func:`_sync_volume_time` (the collectives it asks, in its branches)."""
    if len(dp) <= 1:
        return ()
    if replicate:
        asks = [("reduce_scatter", shard), ("all_reduce", replicate), ("all_gather", shard)]
    else:
        asks = [("all_reduce", dp)] if zero <= 1 else [("reduce_scatter", dp), ("all_gather", dp)]
    lines = tuple(line(kind, cluster, group) for kind, group in asks)
    return None if None in lines else (bool(replicate), len(shard) if replicate else 0, lines)


def _sync_volume_time(
    cluster,
    groups: StageGroups,
    params: Count,
    zero: int,
    m: int,
    options: CostOptions,
    fp8_params: Count = 0.0,
    collective: CollectiveFn = collective_fn,
) -> Count:
    """Seconds of one stage's gradient (and ZeRO-2/3 parameter) traffic for ``params``
    parameters (a number, or an array of them: ``collective_fn`` takes either) over
    ``groups.dp``, or under HSDP over ``groups.shard`` and ``groups.replicate``."""
    if len(groups.dp) <= 1:
        return 0.0
    gbytes, pbytes = options.reduce_dtype_bytes(), options.param_bytes
    grads = params * gbytes
    gathered = (params - fp8_params) * pbytes + fp8_params  # Float8 weights travel in 1 byte
    if groups.replicate:  # HSDP: reduce-scatter in the shard group, all-reduce the shard across
        shard = len(groups.shard)
        rs = collective("reduce_scatter", cluster, groups.shard)(grads)
        rs = rs + collective("all_reduce", cluster, groups.replicate)(grads / shard)
        ag = collective("all_gather", cluster, groups.shard)(gathered)
        if zero <= 1:
            return rs + ag
    else:
        if zero <= 1:
            return collective("all_reduce", cluster, groups.dp)(grads)
        rs = collective("reduce_scatter", cluster, groups.dp)(grads)
        ag = collective("all_gather", cluster, groups.dp)(gathered)
    if zero == 2:  # sharded gradients cannot accumulate: one reduce-scatter per microbatch
        return m * rs + ag
    return m * (rs + 2 * ag)  # ZeRO-3 also gathers parameters for each forward and backward


def reduce_spread(zero: int, num_stages: int, num_microbatches: int) -> int:
    """The backward passes a stage's DP traffic runs under: ``num_microbatches`` for a pipelined
    plan at an effective ZeRO stage >= 2 (``pp_shard_grads``: each microbatch's reduce-scatter is
    issued during that microbatch's backward, unit by unit, while the schedule goes on computing),
    else 1 (the reduction of the accumulated gradients starts with the last backward)."""
    return num_microbatches if num_stages > 1 and zero >= 2 else 1


def tail_terms(
    dp_sync: Count,
    bwd: Count,
    recompute_s: Count,
    num_params: Count,
    dp: int,
    zero: int,
    cluster,
    options: CostOptions,
    after_backward: Count = 0.0,
    spread: int = 1,
) -> Tuple[Count, Count]:
    """(exposed DP sync, optimizer step) after a stage's last backward, from its terms; ``dp``:
    the ranks the optimizer states are sharded over; ``after_backward``: work that runs after the
    backward and is never overlapped (the tied-gradient exchange), added to the exposed part;
    ``spread``: the backward passes (``bwd``, ``recompute_s``: one microbatch's) the sync runs
    under (:func:`reduce_spread`)."""
    # the runtime syncs ZeRO-0 gradients after backward (GradientSync); FSDP overlaps the share
    # overlap_grad_sync of its own with the backward
    share = float(options.overlap_grad_sync) if zero >= 1 else 0.0
    window = spread * (bwd + recompute_s)
    exposed = (
        np.maximum(dp_sync * (1 - share), dp_sync - window)
        if isinstance(dp_sync, np.ndarray) or isinstance(bwd, np.ndarray)
        else max(dp_sync * (1 - share), dp_sync - window)
    )
    exposed = exposed + after_backward
    updated = num_params / (dp if zero >= 1 else 1)
    t_opt = (
        updated
        * options.update_bytes_per_param(cluster.device)
        / (cluster.device.mem_bandwidth * options.optimizer_mem_efficiency)
    )
    return exposed, t_opt
