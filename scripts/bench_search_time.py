"""Search time of the planner alone (no baselines, no time budget) with its work counters.

For every model x cluster x device count: CPU and wall seconds of ``solve`` run to optimality,
the stage tables built, the heap pops, the predicted step time and the plan (so a faster search
can be checked to return the same plans). The counters do not depend on the machine's load,
which the timings on a shared box do. Writes one JSON line per case to ``--out``.

    python scripts/bench_search_time.py --devices 1024 65536 --out results/bench_search_time.jsonl \
        --before results/bench_search_time_before.jsonl   # and the side-by-side markdown table
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

from nest_fx.cluster import load_cluster
from nest_fx.report import tables as report
from nest_fx.report.benchmark_case import CLUSTERS, MODELS
from nest_fx.solver import SolverOptions, solve
from nest_fx.workload import workload_for_model

from _bench_common import add_search_case_arguments, environment_line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_search_case_arguments(ap, MODELS, CLUSTERS)
    ap.add_argument("--out", default="results/bench_search_time.jsonl")
    ap.add_argument("--before", help="a JSON-lines file of an earlier run: print the side-by-side table")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as out:
        for cl in args.clusters:
            for model in args.models:
                work = workload_for_model(model, load_cluster(f"{cl}:64"))
                for n in args.devices:
                    cluster = load_cluster(f"{cl}:{n}")
                    gc.collect()
                    wall, cpu = time.perf_counter(), time.process_time()
                    found = solve(work, cluster, args.global_batch, SolverOptions(time_budget=None))
                    row = {
                        "cluster": cl,
                        "model": model,
                        "devices": n,
                        "cpu": time.process_time() - cpu,
                        "wall": time.perf_counter() - wall,
                        "step_s": found.result.step_s,
                        "tables": found.stats["tables"],
                        "heap_pops": found.stats["heap_pops"],
                        "dp_runs": found.dp_runs,
                        "plan": report.plan_summary(found.plan),
                    }
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(
                        f"{cl} {model} {n}: CPU {row['cpu']:.2f} s (wall {row['wall']:.2f} s), {row['tables']} tables, "
                        f"{row['heap_pops']} pops, step {row['step_s']:.4g} s, {row['plan']}",
                        flush=True,
                    )
    print(environment_line())
    if args.before:
        print(compare(_read(args.before), _read(args.out)))


def _read(path: str) -> dict:
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return {(r["cluster"], r["model"], r["devices"]): r for r in rows}


def compare(before: dict, after: dict) -> str:
    """A markdown table of the cases run both times: CPU seconds, the work counters, the step
    time and whether the plan is the same; then the largest CPU time per device count."""
    lines = [
        "| cluster | model | devices | CPU s before | CPU s after | tables before -> after | "
        "heap pops before -> after | predicted step s before | after | same plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = [k for k in after if k in before]
    for k in keys:
        b, a = before[k], after[k]
        lines.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {b['cpu']:.2f} | {a['cpu']:.2f} | {b['tables']} -> {a['tables']} | "
            f"{b['heap_pops']} -> {a['heap_pops']} | {b['step_s']:.6g} | {a['step_s']:.6g} | "
            f"{b['plan'] == a['plan']} |"
        )
    for n in sorted({k[2] for k in keys}):
        at = [k for k in keys if k[2] == n]
        lines.append(
            f"\nmax CPU s at {n}: before {max(before[k]['cpu'] for k in at):.2f}, after "
            f"{max(after[k]['cpu'] for k in at):.2f}; sum before {sum(before[k]['cpu'] for k in at):.2f}, "
            f"after {sum(after[k]['cpu'] for k in at):.2f}"
        )
    worse = [k for k in keys if after[k]["step_s"] > before[k]["step_s"] * (1 + 1e-9)]
    lines.append(f"\ncases with a worse predicted step time after: {worse or 'none'}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
