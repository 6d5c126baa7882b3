"""Planner benchmark: NEST DP vs Megatron, torchtitan, Phaze-style and MCMC on the same cost model.

For each model x cluster x device count (global batch 4096 sequences): the chosen plan, the
predicted throughput of every planner, the ratio to nest-fx (also over the best baseline), and
search seconds (wall-clock and CPU); then the search time of the DP alone at larger device
counts (to 65,536), for every model and cluster, with its distribution per size; then the time
budget at 65,536 devices: the search and the baselines (what `nest-fx plan --time-budget B`
runs) against their budget. Prints tables, writes results/bench_planner.json and
results/bench_planner.png (throughput ratio vs devices, like the NEST paper's Figure 5).

    python scripts/bench_planner.py                       # everything (tens of minutes)
    python scripts/bench_planner.py --models llama2-7b --devices 64 128 --clusters tpuv4-fat-tree --scaling
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import time


from nest_fx.cluster import load_cluster
from nest_fx.report import tables as report
from nest_fx.report.benchmark_case import CLUSTERS, DEVICES, MODELS, run_case
from nest_fx.report.plotting import pyplot_or_none
from nest_fx.solver import SolverOptions, solve
from nest_fx.solver.baselines import run_baselines
from nest_fx.workload import workload_for_model

from _bench_common import environment_line, print_table, write_json


def _solve_timed(work, cluster, batch: int, budget: float):
    """(found, wall seconds, CPU seconds) of one search."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    found = solve(work, cluster, batch, SolverOptions(time_budget=budget))
    return found, time.perf_counter() - wall, time.process_time() - cpu


def _workload(model: str, cluster_name: str, workloads: dict):
    key = (model, cluster_name)  # the key run_case caches under
    if key not in workloads:
        workloads[key] = workload_for_model(model, load_cluster(f"{cluster_name}:64"))
    return workloads[key]


def scaling(model: str, cluster_name: str, sizes, batch: int, budget: float, workloads: dict):
    """Search time of the DP alone at larger device counts (no baselines)."""
    out = []
    work = _workload(model, cluster_name, workloads)
    for n in sizes:
        cluster = load_cluster(f"{cluster_name}:{n}")
        found, wall, cpu = _solve_timed(work, cluster, batch, budget)
        out.append(
            {
                "model": model,
                "cluster": cluster_name,
                "devices": n,
                "search_s": wall,
                "cpu_s": cpu,
                "complete": found.complete,
                "tokens_s": found.result.tokens_per_s,
                "plan": report.plan_summary(found.plan),
            }
        )
        print(
            f"scaling {cluster_name} {model} {n}: search {wall:.2f} s (CPU {cpu:.2f} s), complete {found.complete}",
            flush=True,
        )
    return out


def budget_runs(models, cluster_name: str, devices: int, batch: int, budgets, mcmc: int, workloads: dict):
    """What ``nest-fx plan --time-budget B`` runs (the search, then the four baselines against the
    same deadline), timed against B."""
    out = []
    for model in models:
        work = _workload(model, cluster_name, workloads)
        cluster = load_cluster(f"{cluster_name}:{devices}")
        for b in budgets:
            gc.collect()
            start = time.perf_counter()
            found = solve(work, cluster, batch, SolverOptions(time_budget=b))
            searched = time.perf_counter() - start
            run_baselines(work, cluster, batch, SolverOptions(), mcmc, deadline=start + b)
            total = time.perf_counter() - start
            out.append(
                {
                    "model": model,
                    "cluster": cluster_name,
                    "devices": devices,
                    "budget_s": b,
                    "search_s": searched,
                    "total_s": total,
                    "complete": found.complete,
                    "within_10pct": total <= 1.1 * b,
                }
            )
            print(
                f"budget {cluster_name}:{devices} {model} {b:g} s: search {searched:.2f} s, with baselines "
                f"{total:.2f} s",
                flush=True,
            )
    return out


def distribution(values) -> dict:
    """Median, 90th percentile and max of a list of seconds."""
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))],
        "max": ordered[-1],
    }


def plot(rows, path: str) -> None:
    plt = pyplot_or_none()
    if plt is None:
        return
    clusters = sorted({r["cluster"] for r in rows})
    fig, axes = plt.subplots(len(clusters), 1, figsize=(8, 4 * len(clusters)), squeeze=False)
    for ax, cl in zip(axes[:, 0], clusters):
        for model in sorted({r["model"] for r in rows}):
            pts = [
                (r["devices"], r["best_ratio"])
                for r in rows
                if r["cluster"] == cl and r["model"] == model and r.get("best_ratio")
            ]
            if pts:
                ax.plot(*zip(*pts), "-o", label=model)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{cl}: nest-fx throughput / the best baseline's", fontsize=10)
        ax.set_xlabel("devices")
        ax.set_ylabel("ratio")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


BASELINE_COLUMNS = ("megatron", "torchtitan", "phaze", "mcmc")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--clusters", nargs="+", default=CLUSTERS)
    ap.add_argument(
        "--devices",
        nargs="*",
        type=int,
        default=DEVICES,
        help="device counts of the planner comparison (none: only the search-time scaling)",
    )
    ap.add_argument("--global-batch", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=30.0, help="search seconds per planner per case")
    ap.add_argument("--mcmc-evals", type=int, default=1000)
    ap.add_argument("--scaling", nargs="*", type=int, default=[1024, 4096, 16384, 65536])
    ap.add_argument(
        "--budget-check",
        nargs="*",
        type=float,
        default=[5.0, 30.0],
        help="time budgets checked at 65,536 devices (search + baselines)",
    )
    ap.add_argument("--out", default="results/bench_planner.json")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows, workloads = [], {}
    for cl in args.clusters:
        for model in args.models:
            for n in args.devices:
                row = run_case(model, cl, n, args.global_batch, args.budget, args.mcmc_evals, workloads)
                rows.append(row)
                print(
                    f"{cl} {model} {n}: "
                    + (
                        row.get("error")
                        or f"{row['plan']} {row['nest_tokens_s']:.3g} tok/s, search {row['search_s']:.2f} s"
                    ),
                    flush=True,
                )
    table = [
        [
            r["cluster"],
            r["model"],
            r["devices"],
            r.get("plan", r.get("error", ""))[:60],
            f"{r['nest_tokens_s']:.3g}" if "nest_tokens_s" in r else "-",
            *[f"{r[f'{k}_ratio']:.2f}x" if r.get(f"{k}_ratio") else "-" for k in BASELINE_COLUMNS],
            f"{r['best_ratio']:.2f}x ({r['best_baseline']})" if r.get("best_ratio") else "-",
            f"{r['search_s']:.2f}" if "search_s" in r else "-",
        ]
        for r in rows
    ]
    print_table(
        table,
        headers=[
            "cluster",
            "model",
            "devices",
            "nest-fx plan",
            "tokens/s",
            "vs Megatron",
            "vs torchtitan",
            "vs Phaze",
            "vs MCMC",
            "vs best",
            "search s",
        ],
    )
    summary = {}
    at_1024 = [r["search_s"] for r in rows if "search_s" in r and r["devices"] == 1024]
    if at_1024:
        summary["search_1024"] = distribution(at_1024)
        d = summary["search_1024"]
        print(
            f"search time at 1024 devices (wall, {d['n']} cases): median {d['median']:.2f} s, "
            f"p90 {d['p90']:.2f} s, max {d['max']:.2f} s"
        )
    solved = [r for r in rows if "search_s" in r]
    print(f"proved optimal within the {args.budget:g} s budget: {sum(r['complete'] for r in solved)}/{len(solved)}")
    best = [r["best_ratio"] for r in rows if r.get("best_ratio")]
    if best:
        summary["best_ratio"] = {
            "min": min(best),
            "median": statistics.median(best),
            "max": max(best),
            "geomean": math.exp(statistics.mean(math.log(x) for x in best)),
        }
        print(
            f"throughput nest-fx / best baseline: min {min(best):.3f}, median {statistics.median(best):.3f}, "
            f"geomean {summary['best_ratio']['geomean']:.3f}, max {max(best):.3f}; never below 1: {min(best) >= 1.0}"
        )
    scale_rows = []
    if args.scaling:
        for cl in args.clusters:
            for model in args.models:
                scale_rows += scaling(model, cl, args.scaling, args.global_batch, args.budget, workloads)
        print_table(
            [
                [
                    r["cluster"],
                    r["model"],
                    r["devices"],
                    f"{r['search_s']:.2f}",
                    f"{r['cpu_s']:.2f}",
                    r["complete"],
                    r["plan"],
                ]
                for r in scale_rows
            ],
            headers=["cluster", "model", "devices", "search s", "CPU s", "complete", "plan"],
        )
        summary["scaling"] = {}
        for n in args.scaling:
            mine = [r for r in scale_rows if r["devices"] == n]
            summary["scaling"][n] = {
                "wall": distribution([r["search_s"] for r in mine]),
                "cpu": distribution([r["cpu_s"] for r in mine]),
            }
            w, c = summary["scaling"][n]["wall"], summary["scaling"][n]["cpu"]
            print(
                f"search time at {n} devices ({w['n']} cases): wall median {w['median']:.2f} s, p90 {w['p90']:.2f} s, "
                f"max {w['max']:.2f} s; CPU median {c['median']:.2f} s, max {c['max']:.2f} s"
            )
    budget_rows = []
    if args.budget_check:
        cl = "h100-spine-leaf" if "h100-spine-leaf" in args.clusters else args.clusters[0]
        budget_rows = budget_runs(
            [m for m in ("mixtral-8x7b", "gpt3-175b") if m in args.models] or args.models[:1],
            cl,
            65536,
            args.global_batch,
            args.budget_check,
            2000,
            workloads,
        )
        print_table(
            [
                [r["model"], r["budget_s"], f"{r['search_s']:.2f}", f"{r['total_s']:.2f}", r["within_10pct"]]
                for r in budget_rows
            ],
            headers=["model (65,536 devices)", "budget s", "search s", "search + baselines s", "within budget + 10%"],
        )
    print(environment_line())
    write_json(
        args.out,
        {
            "global_batch": args.global_batch,
            "budget_s": args.budget,
            "cases": rows,
            "scaling": scale_rows,
            "budget_check": budget_rows,
            "summary": summary,
        },
    )
    plot(rows, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
