"""Contention of a plan's data-parallel gradient synchronisation on a graph topology.

The step-time model charges each stage's DP all-reduce as if its group ran alone
(``dp_sync.dp_sync_time``, one group per stage). In a real step every DP group of every
stage (one per stage and TP rank) syncs at the same time, after the last backward; on an
oversubscribed network their rings share uplinks. This module costs both and reports the
slowdown. Gradients are the stage's dense parameters times ``options.grad_bytes``; expert
parameters are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

from nest_fx.cluster.ordered import placed
from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import pipeline_time, simulate, stage_tail, stage_variant
from nest_fx.plan import Plan
from nest_fx.cluster.topology import algorithms
from nest_fx.cluster.topology.graph_cluster import GraphCluster
from nest_fx.workload import Workload


@dataclass
class DpSyncContention:
    """Per-stage DP all-reduce seconds: one group alone vs all groups of the step at once."""

    isolated: List[float]  # stage i: its first DP group alone (what step_time charges)
    concurrent: List[float]  # stage i: its slowest DP group while every group syncs

    @property
    def slowdown(self) -> float:
        """max concurrent / max isolated (1 when there is nothing to sync)."""
        worst = max(self.isolated, default=0.0)
        return max(self.concurrent, default=0.0) / worst if worst > 0 else 1.0


def dp_groups(plan: Plan) -> List[Tuple[int, List[int]]]:
    """``(stage, ranks)`` of every DP group of the plan: one per stage and TP rank."""
    return [(i, plan.dp_group(i, j)) for i, stage in enumerate(plan.stages) for j in range(stage.tp)]


def stage_gradient_bytes(plan: Plan, workload: Workload, options: CostOptions) -> List[float]:
    """Bytes of dense gradients each device of stage i all-reduces per step."""
    out = []
    for i, stage in enumerate(plan.stages):
        costs = workload.range_costs(stage.start, stage.end, stage_variant(plan, i))
        dense = sum((c.num_params - c.expert_params) * count for c, count in costs)
        out.append(dense * options.reduce_dtype_bytes())
    return out


def dp_sync_contention(
    plan: Plan, workload: Workload, cluster: GraphCluster, options: Optional[CostOptions] = None
) -> DpSyncContention:
    """DP all-reduce of every stage, alone and with all DP groups of the step at once (plan
    ranks on the devices of the plan's ``device_order``)."""
    options = options or CostOptions()
    cluster = placed(cluster, plan.device_order)
    grads = stage_gradient_bytes(plan, workload, options)
    if plan.dp <= 1:
        return DpSyncContention([0.0] * plan.pp, [0.0] * plan.pp)
    isolated = [cluster.collective_time("all_reduce", plan.dp_group(i, 0), grads[i]) for i in range(plan.pp)]
    groups = dp_groups(plan)
    times = algorithms.concurrent_times(
        "all_reduce",
        cluster.topology,
        [cluster.devices_of(g) for _, g in groups],
        [grads[i] for i, _ in groups],
        all_to_all=cluster.all_to_all,
    )
    concurrent = [0.0] * plan.pp
    for (i, _), t in zip(groups, times):
        concurrent[i] = max(concurrent[i], t)
    return DpSyncContention(isolated, concurrent)


def contended_step_s(
    plan: Plan, workload: Workload, cluster: GraphCluster, options: Optional[CostOptions] = None
) -> Tuple[float, DpSyncContention]:
    """(step seconds with every stage's DP sync stretched by its contention, the contention).

    ``simulate`` charges each stage's DP traffic as one group alone; here stage i's
    ``dp_sync`` is multiplied by ``concurrent[i] / isolated[i]`` (all its groups and every other
    stage's syncing at once) and the step is rebuilt from the simulator's own pipeline time and
    stage tails (``step_time.pipeline_time``, ``stage_tail``). An estimate: the stretch of the
    gradient all-reduce is applied to the stage's whole sync volume (ZeRO-2/3 reduce-scatters
    and gathers are ring passes over the same groups).
    """
    options = options or CostOptions()
    result = simulate(plan, workload, cluster, options)
    report = dp_sync_contention(plan, workload, cluster, options)
    view = placed(cluster, plan.device_order)
    v = plan.virtual_stages  # model chunks per device (1 unless the schedule runs several)
    t_pipe, _ = pipeline_time(
        [s.per_microbatch(v) for s in result.stages],
        plan.num_microbatches,
        plan.schedule,
        v,
        [s.span(v) for s in result.stages],
    )
    tails = []
    for i, sc in enumerate(result.stages):
        stretch = report.concurrent[i] / report.isolated[i] if report.isolated[i] > 0 else 1.0
        tails.append(sum(stage_tail(replace(sc, dp_sync=sc.dp_sync * stretch), plan, view, options)))
    return t_pipe + max(tails), report
