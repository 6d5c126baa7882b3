"""What the zero-bubble schedules change in the planner's choice: the best plan the search finds
with the schedules of before (1F1B and interleaved) and with every schedule the runtime runs
(interleaved-zb, zbv, dualpipev added), its predicted step time, bubble and search time.

    python scripts/bench_schedules.py [--quick]

Predictions of the cost model (docs/cost_model.md, "Zero-bubble schedules"), not measured step
times; the search times are the machine's. Writes results/bench_schedules.json.
"""

from __future__ import annotations

import argparse
import time

from _bench_common import print_table, write_json

from nest_fx.cluster import load_cluster
from nest_fx.solver import SolverOptions, solve
from nest_fx.workload import workload_for_model

BEFORE = (("1f1b", 1), ("interleaved", 0))
EVERY = BEFORE + (("interleaved-zb", 0), ("zbv", 2), ("dualpipev", 2))
CASES = [("llama2-7b", "dgx-h100:64", 256), ("llama3-70b", "dgx-h100:256", 1024), ("gpt3-175b", "dgx-h100:512", 1536)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first case only")
    args = parser.parse_args()
    rows, cases = [], []
    for model, cluster_name, batch in CASES[:1] if args.quick else CASES:
        cluster = load_cluster(cluster_name)
        work = workload_for_model(model, cluster)
        for label, schedules in (("1f1b, interleaved", BEFORE), ("every schedule", EVERY)):
            start = time.perf_counter()
            found = solve(work, cluster, batch, SolverOptions(schedules=schedules))
            seconds = time.perf_counter() - start
            p, r = found.plan, found.result
            chosen = p.schedule + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else "")
            case = {
                "model": model,
                "cluster": cluster_name,
                "global_batch": batch,
                "schedules": label,
                "chosen": chosen,
                "pp": p.pp,
                "tp": p.stages[0].tp,
                "dp": p.dp,
                "m": p.num_microbatches,
                "step_s": r.step_s,
                "bubble_s": r.breakdown["bubble"],
                "search_s": seconds,
            }
            cases.append(case)
            rows.append(
                [
                    model,
                    cluster_name,
                    label,
                    chosen,
                    f"pp{p.pp} tp{p.stages[0].tp} dp{p.dp} m{p.num_microbatches}",
                    f"{r.step_s:.4f}",
                    f"{r.breakdown['bubble']:.4f}",
                    f"{seconds:.1f}",
                ]
            )
    print_table(
        rows, headers=["model", "cluster", "schedules searched", "chosen", "degrees", "step s", "bubble s", "search s"]
    )
    write_json("results/bench_schedules.json", {"cases": cases})


if __name__ == "__main__":
    main()
