#!/usr/bin/env python
"""How fast the command line answers: ``--help``, an argument error, a missing file, and a request
no cluster of that size can hold, against ``python -c pass``.

    python scripts/bench_cli.py                                  # this checkout only
    python scripts/bench_cli.py --before /work/main --repeats 7  # an earlier checkout side by side

Each case runs as ``python -m nest_fx ...`` in a fresh process (cwd: a scratch directory; the
checkout first on ``PYTHONPATH``), ``--repeats`` times, the checkouts interleaved run by run so
both see the same machine load. Reported per case: the median wall time, its ratio to the median
of ``python -c pass``, and the median CPU time (user + system) of the child, which load inflates
less. Target (issue 23): ``nest-fx --help`` and a missing-file error under 0.5 s. Exit status 1
when a case of this checkout misses it or exits with an unexpected code. Writes
results/bench_cli.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple
from _bench_common import environment_line, write_json  # next to this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_S = 0.5
MODEL = "llama2-7b"
# name -> (arguments after `python`, expected exit code, held to the target, slow: fewer repeats)
CASES: Dict[str, Tuple[List[str], int, bool, bool]] = {
    "python -c pass": (["-c", "pass"], 0, False, False),
    "nest-fx --help": (["-m", "nest_fx", "--help"], 0, True, False),
    "nest-fx plan --help": (["-m", "nest_fx", "plan", "--help"], 0, True, False),
    "argument error (--global-batch zero)": (
        ["-m", "nest_fx", "plan", "--model", MODEL, "--cluster", "dgx-a100:8", "--global-batch", "zero"],
        2,
        True,
        False,
    ),
    "missing plan file": (
        ["-m", "nest_fx", "simulate", "--plan", "missing.json", "--model", MODEL, "--cluster", "dgx-a100:8"],
        2,
        True,
        False,
    ),
    "impossible: gpt3-175b on cpu-gloo:2": (
        ["-m", "nest_fx", "plan", "--model", "gpt3-175b", "--cluster", "cpu-gloo:2", "--no-baselines", "--quiet"],
        2,
        False,
        True,
    ),
    "impossible: gpt3-175b on dgx-a100:8": (
        ["-m", "nest_fx", "plan", "--model", "gpt3-175b", "--cluster", "dgx-a100:8", "--no-baselines", "--quiet"],
        2,
        False,
        True,
    ),
}


def run_once(checkout: str, argv: List[str], cwd: str) -> Tuple[float, float, int, str]:
    """(wall seconds, child CPU seconds, exit code, last stderr line) of one fresh process."""
    env = dict(os.environ, PYTHONPATH=checkout)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return wall, cpu, done.returncode, last[:200]


def measure(checkouts: Dict[str, str], repeats: int, slow_repeats: int, cases: List[str]) -> dict:
    """{case: {checkout label: {wall_s: [...], cpu_s: [...], rc: [...], message}}}, interleaved."""
    out: dict = {name: {label: {"wall_s": [], "cpu_s": [], "rc": []} for label in checkouts} for name in cases}
    with tempfile.TemporaryDirectory() as cwd:
        for name in cases:
            argv, _, _, slow = CASES[name]
            for _ in range(slow_repeats if slow else repeats):
                for label, checkout in checkouts.items():
                    wall, cpu, rc, last = run_once(checkout, argv, cwd)
                    row = out[name][label]
                    row["wall_s"].append(wall)
                    row["cpu_s"].append(cpu)
                    row["rc"].append(rc)
                    row["message"] = last
            print(
                f"  {name}: "
                + ", ".join(f"{label} {statistics.median(out[name][label]['wall_s']):.2f} s" for label in checkouts),
                file=sys.stderr,
            )
    return out


def table(data: dict, labels: List[str]) -> Tuple[str, List[str]]:
    """The printed table and the target misses of the last checkout (this one)."""
    base = {label: statistics.median(data["python -c pass"][label]["wall_s"]) for label in labels}
    head = f"{'case':<40}" + "".join(f"{label + ' wall':>14}{'x pass':>9}{'cpu':>9}" for label in labels)
    lines, misses = [head, "-" * len(head)], []
    for name, per in data.items():
        _, expected, held, _ = CASES[name]
        cells = ""
        for label in labels:
            wall = statistics.median(per[label]["wall_s"])
            cpu = statistics.median(per[label]["cpu_s"])
            cells += f"{wall:>12.3f} s{wall / base[label]:>8.1f}x{cpu:>7.2f} s"
        lines.append(f"{name:<40}{cells}")
        mine = per[labels[-1]]
        if any(rc != expected for rc in mine["rc"]):
            misses.append(f"{name}: exit codes {mine['rc']}, expected {expected} ({mine.get('message', '')})")
        if held and statistics.median(mine["wall_s"]) >= TARGET_S:
            misses.append(f"{name}: {statistics.median(mine['wall_s']):.3f} s >= {TARGET_S} s")
    return "\n".join(lines), misses


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", metavar="CHECKOUT", help="an earlier checkout to time side by side (e.g. /work/main)")
    ap.add_argument("--repeats", type=int, default=7, help="runs per fast case and checkout (default 7)")
    ap.add_argument("--slow-repeats", type=int, default=3, help="runs per impossible-request case (default 3)")
    ap.add_argument("--skip-slow", action="store_true", help="leave out the impossible-request cases")
    ap.add_argument("--json", default=os.path.join(ROOT, "results", "bench_cli.json"))
    args = ap.parse_args(argv)
    checkouts = {"before": os.path.abspath(args.before)} if args.before else {}
    checkouts["after"] = ROOT
    cases = [name for name, (_, _, _, slow) in CASES.items() if not (slow and args.skip_slow)]
    data = measure(checkouts, args.repeats, args.slow_repeats, cases)
    text, misses = table(data, list(checkouts))
    print(text)
    print(f"target: --help and a missing-file error under {TARGET_S} s (median wall); {environment_line()}")
    for miss in misses:
        print(f"MISSED {miss}")
    result = {
        "checkouts": checkouts,
        "repeats": args.repeats,
        "slow_repeats": args.slow_repeats,
        "target_s": TARGET_S,
        "cases": {name: {"argv": CASES[name][0], **per} for name, per in data.items()},
        "medians": {
            name: {
                label: {"wall_s": statistics.median(v["wall_s"]), "cpu_s": statistics.median(v["cpu_s"])}
                for label, v in per.items()
            }
            for name, per in data.items()
        },
        "misses": misses,
    }
    write_json(args.json, result, indent=2)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
