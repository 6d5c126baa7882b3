"""Search time of two checkouts side by side: ``scripts/bench_search_time.py`` run in a base
checkout and in this one, alternating model by model for several rounds, so that a shared
machine's load falls on both alike. Prints (and writes as markdown) per case the CPU seconds of
each (min / median over the rounds), the stage tables each built, and whether the plan and the
predicted step time are the same in every run; every run's rows go to ``--out`` (JSON lines,
``tree`` and ``round`` added).

    git archive BASE_COMMIT | tar -x -C /tmp/base
    python scripts/bench_search_interleaved.py --base /tmp/base --rounds 3 --devices 1024 65536 \\
        --out results/bench_search_time_round6.jsonl --table results/bench_search_time_round6_table.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from nest_fx.report.benchmark_case import CLUSTERS, MODELS

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tree: str, model: str, devices, clusters) -> list:
    """One ``bench_search_time.py`` run of ``model`` in checkout ``tree``: its JSON rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        cmd = [sys.executable, "scripts/bench_search_time.py", "--models", model, "--out", out]
        cmd += ["--devices", *map(str, devices), "--clusters", *clusters]
        subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": tree}, check=True, capture_output=True)
        with open(out) as fh:
            return [json.loads(line) for line in fh if line.strip()]


def table(rows: list) -> str:
    """The markdown table of ``rows`` (both trees, every round): one line per case."""
    cases = {}
    for r in rows:
        cases.setdefault((r["cluster"], r["model"], r["devices"]), {}).setdefault(r["tree"], []).append(r)
    lines = [
        "| cluster | model | devices | CPU s base (min / median) | CPU s branch (min / median) | "
        "tables base -> branch | heap pops base -> branch | same plan | same step time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (cl, model, n), by in cases.items():
        base, branch = by.get("base", []), by.get("branch", [])
        if not base or not branch:
            continue
        cpu = {k: [r["cpu"] for r in v] for k, v in (("base", base), ("branch", branch))}
        every = base + branch
        lines.append(
            f"| {cl} | {model} | {n} | {min(cpu['base']):.2f} / {statistics.median(cpu['base']):.2f} | "
            f"{min(cpu['branch']):.2f} / {statistics.median(cpu['branch']):.2f} | "
            f"{'/'.join(sorted({str(r['tables']) for r in base}))} -> "
            f"{'/'.join(sorted({str(r['tables']) for r in branch}))} | "
            f"{base[0]['heap_pops']} -> {branch[0]['heap_pops']} | "
            f"{'yes' if len({r['plan'] for r in every}) == 1 else 'no'} | "
            f"{'yes' if len({r['step_s'] for r in every}) == 1 else 'no'} |"
        )
    for n in sorted({k[2] for k in cases}):
        for tree in ("base", "branch"):
            per_case = [
                [r["cpu"] for r in by.get(tree, [])] for (_, _, m), by in cases.items() if m == n and by.get(tree)
            ]
            if per_case:
                lines.append(
                    f"\nmax over the cases at {n} devices, {tree}: {max(min(c) for c in per_case):.2f} s "
                    f"(min of runs), {max(statistics.median(c) for c in per_case):.2f} s (median), "
                    f"{max(max(c) for c in per_case):.2f} s (slowest run)"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other checkout (e.g. a git archive of the base commit)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--clusters", nargs="+", default=CLUSTERS)
    ap.add_argument("--devices", nargs="+", type=int, default=[1024, 65536])
    ap.add_argument("--out", default="results/bench_search_interleaved.jsonl")
    ap.add_argument("--table", help="also write the markdown table here")
    args = ap.parse_args()
    rows = []
    for rnd in range(1, args.rounds + 1):
        for model in args.models:
            for tree, path in (("base", os.path.abspath(args.base)), ("branch", HERE)):
                got = _run(path, model, args.devices, args.clusters)
                rows += [{**r, "tree": tree, "round": rnd} for r in got]
                print(f"round {rnd} {tree} {model}: " + ", ".join(f"{r['cpu']:.2f}" for r in got), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    text = table(rows)
    print(text)
    if args.table:
        with open(args.table, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
