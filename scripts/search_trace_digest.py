"""A digest of everything the search asks and gets back, per case, to show that a faster search
does the same work in the same order: every call the search loop makes to its bounds
(``network_bound``, ``network_bounds``, ``table_worth``, ``table_bound``), its stage tables
(``_Tables.get``) and the exact DP (``solve_partition``), with the arguments that vary (the
configuration, depth, microbatches, factors, incumbent, tier) and what each returned, hashed in
call order; plus the plan, predicted step time, tables built and heap pops. Run it in two
checkouts and compare the lines (``--compare``).

    PYTHONPATH=$PWD python scripts/search_trace_digest.py --devices 1024 65536 --out /tmp/branch.jsonl
    PYTHONPATH=/tmp/base python /tmp/base/scripts/search_trace_digest.py ... --out /tmp/base.jsonl
    python scripts/search_trace_digest.py --compare /tmp/base.jsonl /tmp/branch.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import nest_fx.solver.search as search
from nest_fx.cluster import load_cluster
from nest_fx.report import tables as report
from nest_fx.report.benchmark_case import CLUSTERS, MODELS
from nest_fx.solver import SolverOptions
from nest_fx.workload import workload_for_model

from _bench_common import add_search_case_arguments


def _value(x):
    """What a call returned, as text that is equal exactly when the values are (floats by repr)."""
    if hasattr(x, "step_s") and hasattr(x, "stages"):  # a DP result
        return repr((x.step_s, [(s.start, s.end, s.tp, s.recompute) for s in x.stages]))
    if hasattr(x, "g") and hasattr(x, "entries"):  # a stage table
        return repr((x.p, x.m, x.size, x.entries))
    return repr(x)


def _arg(x):
    """An argument as text that does not depend on object addresses: the caches, the search's
    memo and the table list by kind only (their contents show in what the calls return)."""
    if isinstance(x, dict) or hasattr(x, "workload") or hasattr(x, "caches"):
        return type(x).__name__
    return _value(x)


def _traced(log, name, fn):
    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        shown = [_arg(a) for a in args] + [f"{k}={_arg(v)}" for k, v in sorted(kwargs.items())]
        log.update(f"{name}{shown}->{_value(out)}\n".encode())
        return out

    return call


def run(models, clusters, devices, global_batch):
    rows = []
    for cl in clusters:
        for model in models:
            work = workload_for_model(model, load_cluster(f"{cl}:64"))
            for n in devices:
                log = hashlib.sha256()
                saved = {}
                for name in ("network_bound", "network_bounds", "table_worth", "table_bound", "solve_partition"):
                    saved[name] = getattr(search, name)
                    setattr(search, name, _traced(log, name, saved[name]))
                get = search._Tables.get
                search._Tables.get = _traced(log, "get", get)
                try:
                    found = search.solve(work, load_cluster(f"{cl}:{n}"), global_batch, SolverOptions(time_budget=None))
                finally:
                    for name, fn in saved.items():
                        setattr(search, name, fn)
                    search._Tables.get = get
                row = {
                    "cluster": cl,
                    "model": model,
                    "devices": n,
                    "trace": log.hexdigest(),
                    "step_s": repr(found.result.step_s),
                    "tables": found.stats["tables"],
                    "heap_pops": found.stats["heap_pops"],
                    "plan": report.plan_summary(found.plan),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def compare(a_path: str, b_path: str) -> int:
    """Print each case's equality; the number of cases that differ."""
    read = lambda p: {(r["cluster"], r["model"], r["devices"]): r for r in map(json.loads, open(p))}  # noqa: E731
    a, b = read(a_path), read(b_path)
    differ = 0
    for key in a:
        if key not in b:
            continue
        same = {f: a[key][f] == b[key][f] for f in ("trace", "step_s", "plan", "tables", "heap_pops")}
        differ += not all(same.values())
        print(*key, " ".join(f"{f}={'same' if s else 'DIFFERENT'}" for f, s in same.items()))
    print(f"{len([k for k in a if k in b])} cases compared, {differ} differ")
    return differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_search_case_arguments(ap, MODELS, CLUSTERS)
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("BASE", "BRANCH"))
    args = ap.parse_args()
    if args.compare:
        sys.exit(1 if compare(*args.compare) else 0)
    rows = run(args.models, args.clusters, args.devices, args.global_batch)
    if args.out:
        with open(args.out, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
