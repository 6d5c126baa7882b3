"""One benchmark case: the planner next to the baselines on one model, cluster and device count.

``scripts/bench_planner.py`` and ``scripts/reproduce_nest.py`` tabulate these rows; the
workload of a (model, cluster type) is traced once and reused across device counts.
"""

from __future__ import annotations

import time
from typing import Dict, Tuple

from nest_fx.cluster import load_cluster
from nest_fx.report import tables as report
from nest_fx.solver import NoFeasiblePlan, SolverOptions, solve
from nest_fx.solver.baseline_result import best_baseline
from nest_fx.solver.baselines import run_baselines
from nest_fx.workload import Workload, workload_for_model

# the grid of the planner benchmark and the NEST reproduction (the NEST paper's Figure 5)
MODELS = ["bert-large", "llama2-7b", "llama3-70b", "mixtral-8x7b", "gpt3-175b"]
CLUSTERS = ["tpuv4-fat-tree", "h100-spine-leaf"]
DEVICES = [64, 128, 256, 512, 1024]


def run_case(
    model: str,
    cluster_name: str,
    devices: int,
    batch: int,
    budget: float,
    mcmc: int,
    workloads: Dict[Tuple[str, str], Workload],
) -> dict:
    """The planner's plan and throughput on ``model`` over ``cluster_name:devices`` next to each
    baseline's (``<name>_tokens_s``, ``<name>_ratio`` = planner / baseline, search seconds,
    plan, notes) and the best baseline's (``best_baseline``, ``best_ratio``), or ``error`` when
    nothing fits. ``workloads`` caches the traced workloads."""
    cluster = load_cluster(f"{cluster_name}:{devices}")
    key = (model, cluster_name)
    if key not in workloads:  # the workload depends on the device type only, not the count
        workloads[key] = workload_for_model(model, cluster)
    work = workloads[key]
    row = {"model": model, "cluster": cluster_name, "devices": devices}
    cpu = time.process_time()
    try:
        found = solve(work, cluster, batch, SolverOptions(time_budget=budget))
    except NoFeasiblePlan as exc:
        row["error"] = str(exc)
        return row
    row.update(
        plan=report.plan_summary(found.plan),
        nest_tokens_s=found.result.tokens_per_s,
        nest_step_s=found.result.step_s,
        search_s=found.seconds,
        search_cpu_s=time.process_time() - cpu,
        complete=found.complete,
        dp_runs=found.dp_runs,
    )
    baselines = run_baselines(work, cluster, batch, SolverOptions(time_budget=budget), mcmc)
    for b in baselines:
        row[f"{b.name}_tokens_s"] = b.result.tokens_per_s if b.result else None
        row[f"{b.name}_ratio"] = (found.result.tokens_per_s / b.result.tokens_per_s) if b.result else None
        row[f"{b.name}_search_s"] = b.seconds
        row[f"{b.name}_plan"] = report.plan_summary(b.plan) if b.plan else None
        if b.notes:
            row[f"{b.name}_notes"] = b.notes
    best = best_baseline(baselines)
    row["best_baseline"] = best.name if best else None
    row["best_ratio"] = found.result.tokens_per_s / best.result.tokens_per_s if best else None
    return row
