"""Planner benchmark: NEST DP vs Megatron, Phaze-style and MCMC on the same cost model.

For each model x cluster x device count (global batch 4096 sequences): the chosen plan, the
predicted throughput of every planner, the ratio to nest-fx, and search seconds; then the
search time of the DP alone at larger device counts, for every model and cluster. Prints
tables, writes results/bench_planner.json and results/bench_planner.png (throughput ratio vs
devices per model, like the NEST paper's Figure 5).

    python scripts/bench_planner.py                       # the full grid (tens of minutes)
    python scripts/bench_planner.py --models llama2-7b --devices 64 128 --clusters tpuv4-fat-tree
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from tabulate import tabulate

from nest_fx.cluster import load_cluster
from nest_fx.report import tables as report
from nest_fx.report.benchmark_case import CLUSTERS, DEVICES, MODELS, run_case
from nest_fx.report.plotting import pyplot_or_none
from nest_fx.solver import SolverOptions, solve
from nest_fx.workload import workload_for_model



def scaling(model: str, cluster_name: str, sizes, batch: int, budget: float, workloads: dict):
    """Search time of the DP alone at larger device counts (no baselines)."""
    out = []
    key = (model, cluster_name)
    if key not in workloads:
        workloads[key] = workload_for_model(model, load_cluster(f"{cluster_name}:{sizes[0]}"))
    work = workloads[key]
    for n in sizes:
        cluster = load_cluster(f"{cluster_name}:{n}")
        start = time.perf_counter()
        found = solve(work, cluster, batch, SolverOptions(time_budget=budget))
        out.append({"model": model, "cluster": cluster_name, "devices": n, "search_s": time.perf_counter() - start,
                    "complete": found.complete, "tokens_s": found.result.tokens_per_s,
                    "plan": report.plan_summary(found.plan)})
        print(f"scaling {cluster_name} {model} {n}: search {out[-1]['search_s']:.2f} s, complete {found.complete}",
              flush=True)
    return out


def plot(rows, path: str) -> None:
    plt = pyplot_or_none()
    if plt is None:
        return
    clusters = sorted({r["cluster"] for r in rows})
    fig, axes = plt.subplots(len(clusters), 1, figsize=(8, 4 * len(clusters)), squeeze=False)
    for ax, cl in zip(axes[:, 0], clusters):
        for model in sorted({r["model"] for r in rows}):
            for base, style in (("megatron", "-o"), ("phaze", "--s"), ("mcmc", ":^")):
                pts = [(r["devices"], r.get(f"{base}_ratio")) for r in rows
                       if r["cluster"] == cl and r["model"] == model and r.get(f"{base}_ratio")]
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{model} vs {base}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{cl}: nest-fx throughput / baseline throughput")
        ax.set_xlabel("devices")
        ax.set_ylabel("ratio")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--clusters", nargs="+", default=CLUSTERS)
    ap.add_argument("--devices", nargs="+", type=int, default=DEVICES)
    ap.add_argument("--global-batch", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=30.0, help="search seconds per planner per case")
    ap.add_argument("--mcmc-evals", type=int, default=1000)
    ap.add_argument("--scaling", nargs="*", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--out", default="results/bench_planner.json")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows, workloads = [], {}
    for cl in args.clusters:
        for model in args.models:
            for n in args.devices:
                row = run_case(model, cl, n, args.global_batch, args.budget, args.mcmc_evals, workloads)
                rows.append(row)
                print(f"{cl} {model} {n}: " + (row.get("error") or
                      f"{row['plan']} {row['nest_tokens_s']:.3g} tok/s, search {row['search_s']:.2f} s"), flush=True)
    table = [[r["cluster"], r["model"], r["devices"], r.get("plan", r.get("error", ""))[:60],
              f"{r['nest_tokens_s']:.3g}" if "nest_tokens_s" in r else "-",
              *[f"{r[k]:.2f}x" if r.get(k) else "-" for k in ("megatron_ratio", "phaze_ratio", "mcmc_ratio")],
              f"{r['search_s']:.2f}" if "search_s" in r else "-"] for r in rows]
    print(tabulate(table, headers=["cluster", "model", "devices", "nest-fx plan", "tokens/s", "vs Megatron",
                                   "vs Phaze", "vs MCMC", "search s"], tablefmt="github"))
    searches = [r["search_s"] for r in rows if "search_s" in r and r["devices"] == 1024]
    if searches:
        print(f"search time at 1024 devices: median {statistics.median(searches):.2f} s, "
              f"max {max(searches):.2f} s")
    solved = [r for r in rows if "search_s" in r]
    print(f"proved optimal within the {args.budget:g} s budget: {sum(r['complete'] for r in solved)}/{len(solved)}")
    ratios = [r[k] for r in rows for k in ("megatron_ratio", "phaze_ratio", "mcmc_ratio") if r.get(k)]
    if ratios:
        print(f"throughput ratio nest-fx / baseline: min {min(ratios):.3f}, never below 1: {min(ratios) >= 1.0}")
    scale_rows = []
    if args.scaling:
        for cl in args.clusters:
            for model in args.models:
                scale_rows += scaling(model, cl, args.scaling, args.global_batch, args.budget, workloads)
        print(tabulate([[r["cluster"], r["model"], r["devices"], f"{r['search_s']:.2f}", r["complete"], r["plan"]]
                        for r in scale_rows],
                       headers=["cluster", "model", "devices", "search s", "complete", "plan"], tablefmt="github"))
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"global_batch": args.global_batch, "budget_s": args.budget, "cases": rows,
                   "scaling": scale_rows}, fh, indent=1)
    print(f"wrote {args.out}")
    plot(rows, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
