"""Search time of the planner alone (no baselines, no time budget) with its work counters.

For every model x cluster x device count: CPU and wall seconds of ``solve`` run to optimality,
the stage tables built, the heap pops, the predicted step time and the plan (so a faster search
can be checked to return the same plans). The counters do not depend on the machine's load,
which the timings on a shared box do. Writes one JSON line per case to ``--out``.

    python scripts/bench_search_time.py --devices 1024 65536 --out results/bench_search_time.jsonl
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

from _bench_common import environment_line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--clusters", nargs="+", default=CLUSTERS)
    ap.add_argument("--devices", nargs="+", type=int, default=[1024, 65536])
    ap.add_argument("--global-batch", type=int, default=4096)
    ap.add_argument("--out", default="results/bench_search_time.jsonl")
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
                    row = {"cluster": cl, "model": model, "devices": n, "cpu": time.process_time() - cpu,
                           "wall": time.perf_counter() - wall, "step_s": found.result.step_s,
                           "tables": found.stats["tables"], "heap_pops": found.stats["heap_pops"],
                           "dp_runs": found.dp_runs, "plan": report.plan_summary(found.plan)}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(f"{cl} {model} {n}: CPU {row['cpu']:.2f} s (wall {row['wall']:.2f} s), {row['tables']} tables, "
                          f"{row['heap_pops']} pops, step {row['step_s']:.4g} s, {row['plan']}", flush=True)
    print(environment_line())


if __name__ == "__main__":
    main()
