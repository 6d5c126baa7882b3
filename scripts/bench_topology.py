"""Topology benchmark: planning on the graph (with placement search) vs on its hierarchical approximation.

For each 1,024-GPU topology x model (global batch 4096 sequences):

(a) ``solve`` on the graph topology (``GraphCluster``), which also chooses the device order;
(b) ``solve`` on the topology's inferred levels as a plain hierarchical ``Cluster``, the plan
    then simulated on the graph (what that plan really costs on this network);

and report the predicted step time and throughput of both on the graph, their ratio, the search
seconds of each, and the DP-sync contention of both plans (``dp_sync_contention``: every DP
group of the step syncing at once, which the step-time model does not charge) with the step
time that contention would give (``contended_step_s``). Prints a table, writes
results/bench_topology.json and results/bench_topology.png.

    python scripts/bench_topology.py                    # 3 topologies x 3 models (a few minutes)
    python scripts/bench_topology.py --quick            # llama2-7b only
    python scripts/bench_topology.py --models llama3-70b --topologies fat-tree-2to1
"""

from __future__ import annotations

import argparse
import gc
import os
import time


from nest_fx.report import tables as report
from nest_fx.cluster import Cluster, load_cluster
from nest_fx.workload import workload_for_model
from nest_fx.report.plotting import pyplot_or_none
from nest_fx.cost.step_time import simulate
from nest_fx.solver import SolverOptions, solve
from nest_fx.cluster.topology import (
    GraphCluster,
    calibrate,
    collective_time,
    concurrent_collective_time,
    fat_tree,
    from_cluster,
    pairwise_figures,
    torus,
)
from nest_fx.cost.dp_sync_contention import contended_step_s

from _bench_common import print_table, write_json

MODELS = ["llama2-7b", "llama3-70b", "gpt3-175b"]
RAIL = "rail:128x8,group=32,spines=8"  # 4 scalable units of 32 DGX nodes, 8 rails each, 8 spines
TOPOLOGIES = {
    "rail": RAIL,
    "fat-tree-2to1": "fat-tree:128x8,oversub=2,spines=4",  # 32 leaves of 4 nodes, 2:1 to 4 spines
    "rail+slow-pair": RAIL,  # the same, with the NVLink route 0 <-> 1 measured at 1/30 (a synthetic fault)
}
SLOW_PAIR, SLOW_FACTOR = (0, 1), 30.0


def build(name: str) -> GraphCluster:
    cluster = load_cluster(TOPOLOGIES[name])
    if name.endswith("slow-pair"):
        bw, lat = pairwise_figures(cluster.topology, [SLOW_PAIR])[SLOW_PAIR]
        cluster = GraphCluster(calibrate({SLOW_PAIR: (bw / SLOW_FACTOR, lat)}, base=cluster.topology))
    return cluster


def run_case(topo_name: str, cluster: GraphCluster, model: str, work, batch: int, budget: float) -> dict:
    options = SolverOptions(time_budget=budget)
    gc.collect()
    graph = solve(work, cluster, batch, options)
    gc.collect()
    hier = solve(work, cluster.hierarchy, batch, options)
    on_graph = simulate(hier.plan, work, cluster)
    g_cont, g_report = contended_step_s(graph.plan, work, cluster)
    h_cont, h_report = contended_step_s(hier.plan, work, cluster)
    return {
        "topology": topo_name,
        "spec": TOPOLOGIES[topo_name],
        "model": model,
        "devices": cluster.num_devices,
        "graph_plan": report.plan_summary(graph.plan),
        "placement": graph.placement,
        "placements_searched": [p.name for p in graph.placements],
        "graph_step_s": graph.result.step_s,
        "graph_tokens_s": graph.result.tokens_per_s,
        "graph_search_s": graph.seconds,
        "graph_complete": graph.complete,
        "hier_plan": report.plan_summary(hier.plan),
        "hier_predicted_step_s": hier.result.step_s,
        "hier_step_on_graph_s": on_graph.step_s,
        "hier_tokens_on_graph_s": on_graph.tokens_per_s,
        "hier_search_s": hier.seconds,
        "hier_complete": hier.complete,
        "throughput_ratio": graph.result.tokens_per_s / on_graph.tokens_per_s,
        "graph_dp_slowdown": g_report.slowdown,
        "hier_dp_slowdown": h_report.slowdown,
        "graph_contended_step_s": g_cont,
        "hier_contended_step_s": h_cont,
        "contended_ratio": h_cont / g_cont,
    }


def costing_times(size: float = 2**30) -> dict:
    """Seconds to cost an all-reduce over 1,024 devices and 128 concurrent groups of 8 on each
    kind of topology (the target: well under a second, so the planner can cost many of them)."""
    builds = {
        "from_cluster(dgx-a100)": lambda: from_cluster(Cluster.preset("dgx-a100", 1024)),
        "fat_tree 4:1": lambda: fat_tree(128, 8, nodes_per_leaf=4, spines=4, oversubscription=4.0),
        "torus 8x8x16": lambda: torus([8, 8, 16]),
    }
    out = {}
    for name, build in builds.items():
        topo = build()
        gc.collect()  # a full collection of the interpreter's heap is not ours to time
        t0 = time.perf_counter()
        collective_time("all_reduce", topo, range(1024), size)
        t1 = time.perf_counter()
        concurrent_collective_time("all_reduce", topo, [[g + 128 * k for k in range(8)] for g in range(128)], size)
        out[name] = {"ring_s": t1 - t0, "groups_s": time.perf_counter() - t1}
    print_table(
        [[k, f"{v['ring_s'] * 1e3:.0f}", f"{v['groups_s'] * 1e3:.0f}"] for k, v in out.items()],
        headers=["1,024 devices", "ring all-reduce ms", "128 concurrent groups ms"],
    )
    return out


def plot(rows, path: str) -> None:
    plt = pyplot_or_none()
    if plt is None:
        return
    labels = [f"{r['topology']}\n{r['model']}" for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(rows)), 8))
    ax1.bar([i - 0.2 for i in x], [r["throughput_ratio"] for r in rows], 0.4, label="step-time model")
    ax1.bar([i + 0.2 for i in x], [r["contended_ratio"] for r in rows], 0.4, label="with DP-sync contention")
    ax1.axhline(1.0, color="grey", lw=0.5)
    ax1.set_ylabel("throughput: graph plan / hierarchical plan")
    ax1.set_title(
        "plans found on the graph (with placement search) vs on its hierarchical approximation, "
        "both costed on the graph",
        fontsize=9,
    )
    ax1.legend(fontsize=8)
    ax2.bar([i - 0.2 for i in x], [r["graph_search_s"] for r in rows], 0.4, label="graph + placement search")
    ax2.bar([i + 0.2 for i in x], [r["hier_search_s"] for r in rows], 0.4, label="hierarchical")
    ax2.axhline(10.0, color="red", lw=0.5, ls="--", label="10 s target")
    ax2.set_ylabel("search seconds (2 CPU cores)")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=list(TOPOLOGIES))
    ap.add_argument("--quick", action="store_true", help="llama2-7b only")
    ap.add_argument("--global-batch", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=60.0, help="search seconds per solve")
    ap.add_argument("--out", default="results/bench_topology.json")
    args = ap.parse_args()
    models = ["llama2-7b"] if args.quick else args.models
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows, workloads = [], {}
    for name in args.topologies:
        start = time.perf_counter()
        cluster = build(name)
        print(f"{name}: {cluster.topology!r} built in {time.perf_counter() - start:.2f} s", flush=True)
        for model in models:
            if model not in workloads:  # the workload depends on the device type only
                workloads[model] = workload_for_model(model, cluster)
            row = run_case(name, cluster, model, workloads[model], args.global_batch, args.budget)
            rows.append(row)
            print(
                f"  {model}: graph {row['graph_plan']} [{row['placement']}] {row['graph_search_s']:.2f} s; "
                f"hierarchical {row['hier_plan']} {row['hier_search_s']:.2f} s; "
                f"ratio {row['throughput_ratio']:.3f}",
                flush=True,
            )
    table = [
        [
            r["topology"],
            r["model"],
            r["graph_plan"],
            r["placement"],
            report.fmt_seconds(r["graph_step_s"]),
            r["hier_plan"],
            report.fmt_seconds(r["hier_predicted_step_s"]),
            report.fmt_seconds(r["hier_step_on_graph_s"]),
            f"{r['throughput_ratio']:.3f}x",
            f"{r['graph_search_s']:.2f}",
            f"{r['hier_search_s']:.2f}",
            f"{r['graph_dp_slowdown']:.2f} / {r['hier_dp_slowdown']:.2f}",
            f"{r['contended_ratio']:.3f}x",
        ]
        for r in rows
    ]
    print_table(
        table,
        headers=[
            "topology",
            "model",
            "graph plan",
            "device order",
            "step",
            "hierarchical plan",
            "step (hier. model)",
            "step on graph",
            "throughput ratio",
            "graph search s",
            "hier. search s",
            "DP-sync slowdown g / h",
            "ratio with contention",
        ],
    )
    worst = max(r["graph_search_s"] for r in rows)
    print(
        f"graph search (placement included) at {rows[0]['devices']} devices: max {worst:.2f} s; "
        f"all optimal: {all(r['graph_complete'] for r in rows)}"
    )
    write_json(
        args.out,
        {
            "global_batch": args.global_batch,
            "budget_s": args.budget,
            "topologies": {k: TOPOLOGIES[k] for k in args.topologies},
            "slow_pair": {"pair": list(SLOW_PAIR), "factor": SLOW_FACTOR},
            "cases": rows,
            "costing_1024": costing_times(),
        },
    )
    plot(rows, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
