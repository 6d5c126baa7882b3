#!/usr/bin/env python
"""Reproduce the NEST paper's planner experiments on the built-in cluster presets.

All figures are predictions of nest-fx's cost model (the same one for every planner), not
measurements. Global batch 4096 sequences, as in scripts/bench_planner.py.

* Figure 5: throughput vs device count (64 .. 1024) per model, nest-fx against the Megatron
  recipe ("Manual", as Megatron-LM runs it), the torchtitan recipe, a Phaze-style
  network-unaware search and MCMC, and against the best of them; per cluster preset.
* Figure 6: the best plan's throughput at a fixed microbatch size (1, 2, 4, 8) on 256 devices
  of the first cluster, for nest-fx and the searching baselines (the Megatron recipe always
  uses microbatch 1).
* Table 3: on h100-spine-leaf, Mixtral-8x7B at 128 and 1024 devices and GPT-3 175B at 128:
  throughput and search seconds of every planner.

Writes ``OUT/reproduce_nest.{md,json}`` and PNGs (``_quick`` in the names with ``--quick``).

    python scripts/reproduce_nest.py --budget 10                 # everything (tens of minutes)
    python scripts/reproduce_nest.py --quick                     # a small subset, ~1-2 minutes
    python scripts/reproduce_nest.py --parts fig6 --models llama2-7b
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import time
from typing import Dict, List, Optional, Sequence

from tabulate import tabulate

from nest_fx.cluster import load_cluster
from nest_fx.report import tables as report
from nest_fx.report.benchmark_case import CLUSTERS, DEVICES, MODELS, run_case
from nest_fx.report.plotting import pyplot_or_none
from nest_fx.solver import NoFeasiblePlan, SolverOptions, solve
from nest_fx.solver.baselines import mcmc, phaze
from nest_fx.workload import workload_for_model

from _bench_common import write_json

PLANNERS = ("nest", "megatron", "torchtitan", "phaze", "mcmc")
LABELS = {
    "nest": "nest-fx",
    "megatron": "Manual (Megatron)",
    "torchtitan": "torchtitan",
    "phaze": "Phaze-style",
    "mcmc": "MCMC",
}
MICROBATCHES = (1, 2, 4, 8)
FIG6_DEVICES = 256
TABLE3 = (("mixtral-8x7b", 128), ("mixtral-8x7b", 1024), ("gpt3-175b", 128))
TABLE3_CLUSTER = "h100-spine-leaf"
QUICK = {
    "models": ["bert-large", "llama2-7b"],
    "clusters": ["tpuv4-fat-tree"],
    "devices": [64, 256],
    "fig6_models": ["llama2-7b"],
    "table3": (("mixtral-8x7b", 128),),
    "budget": 2.0,
    "mcmc": 200,
}


# -- experiments ---------------------------------------------------------------------------


def figure5(
    models: Sequence[str],
    clusters: Sequence[str],
    devices: Sequence[int],
    batch: int,
    budget: float,
    mcmc_evals: int,
    workloads: dict,
    log=print,
) -> List[dict]:
    """One run_case row per (cluster, model, devices)."""
    rows = []
    for cl in clusters:
        for model in models:
            for n in devices:
                row = run_case(model, cl, n, batch, budget, mcmc_evals, workloads)
                rows.append(row)
                log(
                    f"fig5 {cl} {model} {n}: "
                    + (
                        row.get("error")
                        or f"{row['plan']}, {row['nest_tokens_s']:.3g} tok/s, search {row['search_s']:.1f} s"
                    )
                )
    return rows


def _workload(model: str, cluster_name: str, cluster, workloads: dict):
    key = (model, cluster_name)  # the same key run_case caches under
    if key not in workloads:
        workloads[key] = workload_for_model(model, cluster)
    return workloads[key]


def microbatch_case(
    model: str, cluster_name: str, devices: int, mbs: int, batch: int, budget: float, mcmc_evals: int, workloads: dict
) -> dict:
    """Best plan of nest-fx, Phaze-style and MCMC when every plan must use microbatch size ``mbs``."""
    cluster = load_cluster(f"{cluster_name}:{devices}")
    work = _workload(model, cluster_name, cluster, workloads)
    options = SolverOptions(time_budget=budget, microbatch_sizes=(mbs,))
    row: Dict[str, object] = {"model": model, "cluster": cluster_name, "devices": devices, "mbs": mbs}
    try:
        found = solve(work, cluster, batch, options)
        row.update(
            nest_tokens_s=found.result.tokens_per_s,
            search_s=found.seconds,
            complete=found.complete,
            plan=report.plan_summary(found.plan),
        )
    except NoFeasiblePlan as exc:
        row["error"] = str(exc)
    for name, run in (
        ("phaze", lambda: phaze(work, cluster, batch, options)),
        ("mcmc", lambda: mcmc(work, cluster, batch, options, evaluations=mcmc_evals)),
    ):
        start = time.perf_counter()
        b = run()
        row[f"{name}_search_s"] = time.perf_counter() - start
        row[f"{name}_tokens_s"] = b.result.tokens_per_s if b.result else None
        row[f"{name}_plan"] = report.plan_summary(b.plan) if b.plan else None
    return row


def figure6(
    models: Sequence[str], cluster_name: str, batch: int, budget: float, mcmc_evals: int, workloads: dict, log=print
) -> List[dict]:
    rows = []
    for model in models:
        for mbs in MICROBATCHES:
            row = microbatch_case(model, cluster_name, FIG6_DEVICES, mbs, batch, budget, mcmc_evals, workloads)
            rows.append(row)
            log(
                f"fig6 {cluster_name} {model} mbs={mbs}: "
                + (row.get("error") or f"{row['plan']}, {row['nest_tokens_s']:.3g} tok/s")
            )
    return rows


def table3(
    cases: Sequence[tuple], batch: int, budget: float, mcmc_evals: int, workloads: dict, done: Sequence[dict], log=print
) -> List[dict]:
    """Rows of the Table 3 cases, reusing Figure 5 rows that already cover them."""
    rows = []
    for model, n in cases:
        row = next((r for r in done if (r["model"], r["cluster"], r["devices"]) == (model, TABLE3_CLUSTER, n)), None)
        if row is None:
            row = run_case(model, TABLE3_CLUSTER, n, batch, budget, mcmc_evals, workloads)
            log(f"table3 {model} {n}: " + (row.get("error") or f"{row['nest_tokens_s']:.3g} tok/s"))
        rows.append(row)
    return rows


# -- output --------------------------------------------------------------------------------


def _tok(v: Optional[float]) -> str:
    return report.fmt_si(v) if v else "-"


def _ratio(row: dict, name: str) -> str:
    other = row.get(f"{name}_tokens_s")
    return f"{row['nest_tokens_s'] / other:.2f}x" if other and row.get("nest_tokens_s") else "-"


def summary(rows: Sequence[dict]) -> List[str]:
    """Per baseline, and for the best baseline of each case: cases where nest-fx is at least as
    fast, median and largest speedup."""
    out = []
    for name in PLANNERS[1:] + ("best",):
        if name == "best":
            ratios = [r["best_ratio"] for r in rows if r.get("best_ratio")]
        else:
            ratios = [
                r["nest_tokens_s"] / r[f"{name}_tokens_s"]
                for r in rows
                if r.get("nest_tokens_s") and r.get(f"{name}_tokens_s")
            ]
        if not ratios:
            continue
        ok = sum(x >= 1 - 1e-9 for x in ratios)
        out.append(
            f"vs {LABELS.get(name, 'the best baseline')}: nest-fx at least as fast in {ok}/{len(ratios)} cases; "
            f"speedup median {statistics.median(ratios):.2f}x, max {max(ratios):.2f}x, min {min(ratios):.2f}x"
        )
    return out


def _search(row: dict) -> str:
    """nest-fx's search seconds, '*' when the budget stopped it."""
    if "search_s" not in row:
        return "-"
    return f"{row['search_s']:.2f}" + ("" if row.get("complete") else "*")


def _github(body: List[list], headers: List[str]) -> str:
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def _best(row: dict) -> str:
    return f"{row['best_ratio']:.2f}x ({row['best_baseline']})" if row.get("best_ratio") else "-"


def fig5_table(rows: Sequence[dict]) -> str:
    body = [
        [
            r["cluster"],
            r["model"],
            r["devices"],
            _tok(r.get("nest_tokens_s")),
            *[_tok(r.get(f"{name}_tokens_s")) for name in PLANNERS[1:]],
            *[_ratio(r, name) for name in PLANNERS[1:]],
            _best(r),
            _search(r),
            r.get("plan", r.get("error", "")),
        ]
        for r in rows
    ]
    return _github(
        body,
        [
            "cluster",
            "model",
            "devices",
            "nest-fx tok/s",
            "Manual",
            "torchtitan",
            "Phaze",
            "MCMC",
            "vs Manual",
            "vs torchtitan",
            "vs Phaze",
            "vs MCMC",
            "vs best",
            "search s",
            "nest-fx plan",
        ],
    )


def fig6_table(rows: Sequence[dict]) -> str:
    body = [
        [
            r["model"],
            r["mbs"],
            _tok(r.get("nest_tokens_s")),
            _tok(r.get("phaze_tokens_s")),
            _tok(r.get("mcmc_tokens_s")),
            _search(r),
            r.get("plan", r.get("error", "")),
        ]
        for r in rows
    ]
    return _github(body, ["model", "microbatch", "nest-fx tok/s", "Phaze", "MCMC", "search s", "nest-fx plan"])


def table3_table(rows: Sequence[dict]) -> str:
    body = []
    for r in rows:
        for name in PLANNERS:
            key = "search_s" if name == "nest" else f"{name}_search_s"
            plan = r.get("plan") if name == "nest" else r.get(f"{name}_plan")
            speed = "1.00x" if name == "nest" else _ratio(r, name)
            stopped = "*" if name == "nest" and not r.get("complete") else ""
            body.append(
                [
                    f"{r['model']} @ {r['devices']}",
                    LABELS[name],
                    _tok(r.get(f"{name}_tokens_s")),
                    speed,
                    f"{r[key]:.2f}{stopped}" if r.get(key) is not None else "-",
                    plan or r.get("error", "no feasible plan"),
                ]
            )
    return _github(body, ["case (h100-spine-leaf)", "planner", "tokens/s", "nest-fx speedup", "search s", "plan"])


def markdown(results: dict) -> str:
    """The report: command, settings, the three tables and the win/loss summary."""
    lines = [
        "# NEST paper experiments, reproduced with nest-fx",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Run {results['date']} in {results['seconds'] / 60:.1f} min; global batch {results['global_batch']} "
        f"sequences; search budget {results['budget_s']:g} s per nest-fx solve; MCMC "
        f"{results['mcmc_evals']} evaluations. Throughputs are predictions of nest-fx's cost model "
        "(analytical roofline compute), the same model for every planner; search times are wall-clock "
        "seconds on the machine that ran the script. `*` marks a nest-fx search stopped by the budget "
        "(best plan so far). The baselines run as their authors run them (docs/solver.md, Baselines): "
        "Megatron-LM with its stage split (blocks evenly, embedding first, output layer last), its "
        "interleaving and microbatch rules; torchtitan's Llama 3 recipes (op-level SAC costed as "
        'selective); "vs best" is the speedup over the fastest baseline of each case.',
        "",
    ]
    if results.get("fig5"):
        lines += ["## Figure 5: throughput vs devices", "", fig5_table(results["fig5"]), ""]
        lines += [f"- {x}" for x in summary(results["fig5"])] + [""]
        lines += [f"![Figure 5, {c}]({os.path.basename(p)})" for c, p in results.get("fig5_png", {}).items()] + [""]
    if results.get("fig6"):
        lines += [
            f"## Figure 6: fixed microbatch size, {FIG6_DEVICES} devices, {results['fig6'][0]['cluster']}",
            "",
            fig6_table(results["fig6"]),
            "",
        ]
        if results.get("fig6_png"):
            lines += [f"![Figure 6]({os.path.basename(results['fig6_png'])})", ""]
    if results.get("table3"):
        lines += ["## Table 3: h100-spine-leaf, throughput and search time", "", table3_table(results["table3"]), ""]
    return "\n".join(lines)


def plot_fig5(rows: Sequence[dict], cluster: str, path: str) -> bool:
    """Throughput vs devices, one panel per model, one line per planner."""
    plt = pyplot_or_none()
    if plt is None:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows if r["cluster"] == cluster))
    fig, axes = plt.subplots(1, len(models), figsize=(3.4 * len(models), 3.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["cluster"] == cluster and r["model"] == model]
        for name, style in zip(PLANNERS, ("-o", "--s", "-.x", "-.^", ":v")):
            pts = [(r["devices"], r[f"{name}_tokens_s"]) for r in mine if r.get(f"{name}_tokens_s")]
            if pts:
                ax.plot(*zip(*pts), style, label=LABELS[name], markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("devices")
    axes[0][0].set_ylabel("tokens/s (predicted)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Figure 5 on {cluster}: throughput vs devices", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_fig6(rows: Sequence[dict], path: str) -> bool:
    """Throughput per microbatch size, one panel per model, bars per planner."""
    plt = pyplot_or_none()
    if plt is None:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    names = ("nest", "phaze", "mcmc")
    fig, axes = plt.subplots(1, len(models), figsize=(3.4 * len(models), 3.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for k, name in enumerate(names):
            xs = [i + (k - 1) * 0.27 for i in range(len(mine))]
            ax.bar(xs, [r.get(f"{name}_tokens_s") or 0 for r in mine], width=0.27, label=LABELS[name])
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels([str(r["mbs"]) for r in mine])
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("microbatch size")
    axes[0][0].set_ylabel("tokens/s (predicted)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Figure 6: fixed microbatch size, {FIG6_DEVICES} devices", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- main ----------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--budget", type=float, default=None, help="search seconds per nest-fx solve (default 10; quick: 2)"
    )
    ap.add_argument("--mcmc-evals", type=int, default=None, help="MCMC evaluations (default 500; quick: 200)")
    ap.add_argument("--quick", action="store_true", help="a small subset for a smoke run (~1-2 minutes)")
    ap.add_argument("--out", default="results", help="output folder (default results/)")
    ap.add_argument("--parts", nargs="+", choices=("fig5", "fig6", "table3"), default=["fig5", "fig6", "table3"])
    ap.add_argument("--models", nargs="+", help="Figure 5/6 models (default the paper's five)")
    ap.add_argument("--clusters", nargs="+", help="Figure 5 clusters; Figure 6 uses the first")
    ap.add_argument("--devices", nargs="+", type=int, help="Figure 5 device counts (default 64 .. 1024)")
    ap.add_argument("--global-batch", type=int, default=4096)
    return ap.parse_args(argv)


def run(args: argparse.Namespace, log=print) -> dict:
    """Run the selected parts and write the outputs; returns the results dict (also the JSON)."""
    quick = args.quick
    models = args.models or (QUICK["models"] if quick else MODELS)
    clusters = args.clusters or (QUICK["clusters"] if quick else CLUSTERS)
    devices = args.devices or (QUICK["devices"] if quick else DEVICES)
    budget = args.budget if args.budget is not None else (QUICK["budget"] if quick else 10.0)
    evals = args.mcmc_evals if args.mcmc_evals is not None else (QUICK["mcmc"] if quick else 500)
    fig6_models = args.models or (QUICK["fig6_models"] if quick else MODELS)
    stem = os.path.join(args.out, "reproduce_nest" + ("_quick" if quick else ""))
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    workloads: dict = {}
    results: dict = {
        "command": shlex.join(["python", "scripts/reproduce_nest.py", *_argv(args)]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "global_batch": args.global_batch,
        "budget_s": budget,
        "mcmc_evals": evals,
        "quick": quick,
    }
    if "fig5" in args.parts:
        results["fig5"] = figure5(models, clusters, devices, args.global_batch, budget, evals, workloads, log)
        results["fig5_png"] = {}
        for cl in clusters:
            path = f"{stem}_fig5_{cl}.png"
            if plot_fig5(results["fig5"], cl, path):
                results["fig5_png"][cl] = path
    if "fig6" in args.parts:
        results["fig6"] = figure6(fig6_models, clusters[0], args.global_batch, budget, evals, workloads, log)
        if plot_fig6(results["fig6"], f"{stem}_fig6.png"):
            results["fig6_png"] = f"{stem}_fig6.png"
    if "table3" in args.parts:
        cases = QUICK["table3"] if quick else TABLE3
        results["table3"] = table3(cases, args.global_batch, budget, evals, workloads, results.get("fig5", []), log)
    results["seconds"] = time.perf_counter() - start
    write_json(stem + ".json", results, quiet=True)
    with open(stem + ".md", "w", encoding="utf-8") as fh:
        fh.write(markdown(results) + "\n")
    log(f"wrote {stem}.md, {stem}.json ({results['seconds']:.0f} s)")
    return results


def _argv(args: argparse.Namespace) -> List[str]:
    """The options of ``args`` as a command line (for the report)."""
    out: List[str] = []
    if args.quick:
        out.append("--quick")
    for flag, value in (
        ("--budget", args.budget),
        ("--mcmc-evals", args.mcmc_evals),
        ("--out", args.out),
        ("--global-batch", args.global_batch if args.global_batch != 4096 else None),
    ):
        if value is not None:
            out += [flag, str(value)]
    for flag, values in (
        ("--parts", args.parts if len(args.parts) < 3 else None),
        ("--models", args.models),
        ("--clusters", args.clusters),
        ("--devices", args.devices),
    ):
        if values:
            out += [flag, *map(str, values)]
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    results = run(args, log=lambda s: print(s, flush=True))
    for part, table in (("fig5", fig5_table), ("fig6", fig6_table), ("table3", table3_table)):
        if results.get(part):
            print(table(results[part]))
    for line in summary(results.get("fig5", [])):
        print(line)


if __name__ == "__main__":
    main()
