"""Parser fuzz benchmark: random valid and broken inputs for every reader of user data.

Each parser gets ``--inputs`` random inputs (mutations of valid documents plus random values and
text, made by ``scripts/_fuzz_inputs.py``): cluster dicts and files (YAML/JSON), plan dicts and
files, workload tables and files, and ``nest-fx simulate`` / ``nest-fx plan`` argument lists run
in-process through ``nest_fx.cli.main`` (``scripts/_fuzz_cli.py``). An input is *accepted*,
*rejected* with our own error (ClusterError,
PlanError, WorkloadError; for the CLI exit code 2 with exactly one ``error: ...`` line on
stderr, or an argparse usage error ending in its ``error:`` line), or a *crash*: any other
exception, a rejection message that is empty or not one line, a traceback on stderr, or an
accepted CLI run that writes to stderr. Accepted documents are also used (round trip, rank
layout, a small simulation whose figures must be finite and, when feasible, within the device
memory) so that values that parse but break later count as crashes too.

    python scripts/bench_fuzz.py                 # 2,000 inputs per parser, writes results/bench_fuzz.json
    python scripts/bench_fuzz.py --inputs 300 --parsers cluster-dict plan-file
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

from nest_fx.workload import build as workload_build
from nest_fx.cluster import Cluster, ClusterError
from nest_fx.cost.step_time import simulate
from nest_fx.plan import Plan, PlanError, uniform_plan
from nest_fx.workload import Workload, WorkloadError, load_workload, workload_from_table

from _bench_common import print_table, write_json
from _fuzz_cli import CliFiles, check_cli, cli_argv
from _fuzz_inputs import (
    fuzz_docs,
    fuzz_files,
    hand_table,
    valid_clusters,
    valid_plans,
    valid_workloads,
)

OUR_ERRORS = (ClusterError, PlanError, WorkloadError)

# -- outcomes -------------------------------------------------------------------------------


class Tally:
    """Counts per outcome and the first few crash tracebacks."""

    def __init__(self, name: str, keep: int):
        self.name, self.keep = name, keep
        self.inputs = self.accepted = self.rejected = self.crashes = 0
        self.examples: List[Dict[str, str]] = []
        self.seconds = 0.0

    def crash(self, given: Any, text: str) -> None:
        self.crashes += 1
        if len(self.examples) < self.keep:
            shown = repr(given)
            self.examples.append({"input": shown[:400] + ("..." if len(shown) > 400 else ""), "traceback": text})

    def run(self, given: Any, check: Callable[[], str]) -> None:
        """``check`` returns "accepted" or "rejected", or raises (a crash)."""
        self.inputs += 1
        try:
            outcome = check()
        except Exception:  # noqa: BLE001 - counting every unexpected exception is the point
            self.crash(given, traceback.format_exc())
            return
        if outcome == "accepted":
            self.accepted += 1
        elif outcome == "rejected":
            self.rejected += 1
        else:
            self.crash(given, outcome)

    def row(self) -> dict:
        return {
            "parser": self.name,
            "inputs": self.inputs,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "crashes": self.crashes,
            "seconds": round(self.seconds, 2),
            "examples": self.examples,
        }


def _one_line(exc: Exception) -> str:
    text = str(exc)
    return "rejected" if text and "\n" not in text else f"not a one-line message: {type(exc).__name__}: {text!r}"


# -- parsers under test ---------------------------------------------------------------------


def sane(result, cluster: Cluster) -> None:
    """What a simulation of accepted inputs must satisfy (nest_fx.common.limits keeps every formula in
    range): finite figures, a positive step time, and a plan called feasible within the usable
    device memory."""
    from nest_fx.cost.options import USABLE_MEMORY_FRACTION

    numbers = [result.step_s, result.tokens_per_s, *result.breakdown.values()]
    numbers += [v for s in result.stages for v in s.memory.values()]
    assert all(math.isfinite(x) for x in numbers), f"inf or NaN in the simulation: {result.breakdown}"
    assert result.step_s > 0, result.step_s
    if result.feasible:
        capacity = cluster.device.memory_bytes * USABLE_MEMORY_FRACTION
        assert all(s.memory["total"] <= capacity for s in result.stages), "feasible plan over the memory"


@functools.lru_cache(maxsize=None)
def _hand_workload() -> Workload:
    return workload_from_table(hand_table())


def use_cluster(c: Cluster) -> None:
    """Round trip, rank spans, and a small data-parallel plan simulated on the cluster."""
    assert Cluster.from_dict(c.to_dict()) == c
    c.levels_spanned(range(min(c.num_devices, 64)))
    work = _hand_workload()
    dp = 2 if c.num_devices >= 2 else 1
    sane(simulate(uniform_plan(len(work), pp=1, tp=1, dp=dp, num_microbatches=2), work, c), c)


def check_cluster_dict(doc: Any) -> str:
    try:
        c = Cluster.from_dict(doc, where="fuzz")
    except ClusterError as exc:
        return _one_line(exc)
    use_cluster(c)
    return "accepted"


def use_plan(p: Plan) -> None:
    again = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again.to_dict() == p.to_dict(), "round trip changed the plan"
    p.rank(p.pp - 1, p.dp - 1, p.stages[-1].tp - 1)


def check_plan_dict(doc: Any) -> str:
    try:
        p = Plan.from_dict(doc, where="fuzz")
    except PlanError as exc:
        return _one_line(exc)
    use_plan(p)
    return "accepted"


def use_workload(w: Workload) -> None:
    """Simulate a one-stage plan with a variant every layer has, on a small cluster."""
    tps = sorted({key[1] for key in w.source.entries if key[1] <= 64})
    for tp in tps:
        if not w.supports(tp):
            continue
        cluster = Cluster.preset("dgx-a100", max(8, tp))
        sane(simulate(uniform_plan(len(w), pp=1, tp=tp, dp=1, num_microbatches=2), w, cluster), cluster)
        return


def check_workload_dict(doc: Any) -> str:
    try:
        w = workload_from_table(doc, where="fuzz")
    except WorkloadError as exc:
        return _one_line(exc)
    use_workload(w)
    return "accepted"


def check_file(load: Callable[[str], Any], error, use: Callable[[Any], None], path: str) -> str:
    try:
        obj = load(path)
    except error as exc:
        return _one_line(exc)
    use(obj)
    return "accepted"


# -- driver --------------------------------------------------------------------------------


def run(parsers: List[str], n: int, seed: int, keep: int) -> List[Tally]:
    rng = random.Random(seed)
    os.environ.pop("NEST_FX_DEBUG", None)
    # Tracing is the slow part of a CLI call and the model names repeat: trace each one once.
    workload_build.trace_model = functools.lru_cache(maxsize=None)(workload_build.trace_model)
    tallies = []
    with tempfile.TemporaryDirectory(prefix="nest-fx-fuzz-") as root:
        files = CliFiles(root, rng)
        specs: Dict[str, Callable[[], Tuple[List[Any], Callable[[Any], Callable[[], str]]]]] = {
            "cluster-dict": lambda: (fuzz_docs(rng, valid_clusters(), n), lambda d: lambda: check_cluster_dict(d)),
            "cluster-file": lambda: (
                fuzz_files(rng, valid_clusters(), n, True),
                lambda f: _file_check(root, f, Cluster.load, ClusterError, use_cluster),
            ),
            "plan-dict": lambda: (fuzz_docs(rng, valid_plans(), n), lambda d: lambda: check_plan_dict(d)),
            "plan-file": lambda: (
                fuzz_files(rng, valid_plans(), n, False),
                lambda f: _file_check(root, f, Plan.load, PlanError, use_plan),
            ),
            "workload-dict": lambda: (fuzz_docs(rng, valid_workloads(), n), lambda d: lambda: check_workload_dict(d)),
            "workload-file": lambda: (
                fuzz_files(rng, valid_workloads(), n, False),
                lambda f: _file_check(root, f, load_workload, WorkloadError, use_workload),
            ),
            "cli-simulate": lambda: (
                [cli_argv(rng, "simulate", files) for _ in range(n)],
                lambda a: lambda: check_cli(a),
            ),
            "cli-plan": lambda: ([cli_argv(rng, "plan", files) for _ in range(n)], lambda a: lambda: check_cli(a)),
        }
        for name in parsers:
            tally = Tally(name, keep)
            inputs, make = specs[name]()
            start = time.perf_counter()
            for given in inputs:
                tally.run(given, make(given))
            tally.seconds = time.perf_counter() - start
            tallies.append(tally)
            print(f"{name}: {tally.inputs} inputs, {tally.crashes} crashes, {tally.seconds:.1f} s", file=sys.stderr)
    return tallies


def _file_check(root: str, given: Tuple[str, bytes], load, error, use) -> Callable[[], str]:
    ext, data = given
    path = os.path.join(root, "input" + ext)

    def check() -> str:
        with open(path, "wb") as fh:
            fh.write(data)
        return check_file(load, error, use, path)

    return check


PARSERS = [
    "cluster-dict",
    "cluster-file",
    "plan-dict",
    "plan-file",
    "workload-dict",
    "workload-file",
    "cli-simulate",
    "cli-plan",
]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=2000, help="random inputs per parser (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parsers", nargs="+", choices=PARSERS, default=PARSERS)
    ap.add_argument("--tracebacks", type=int, default=3, help="crash tracebacks kept per parser (default 3)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "bench_fuzz.json"))
    args = ap.parse_args(argv)
    start = time.perf_counter()
    tallies = run(args.parsers, args.inputs, args.seed, args.tracebacks)
    rows = [t.row() for t in tallies]
    print_table(
        [[r["parser"], r["inputs"], r["accepted"], r["rejected"], r["crashes"], r["seconds"]] for r in rows],
        headers=["parser", "inputs", "accepted", "rejected (our error)", "crashes", "seconds"],
        tablefmt="simple",
    )
    for r in rows:
        for ex in r["examples"]:
            print(f"\n--- crash in {r['parser']}: {ex['input']}\n{ex['traceback']}")
    write_json(
        args.out,
        {
            "seed": args.seed,
            "inputs_per_parser": args.inputs,
            "seconds": round(time.perf_counter() - start, 1),
            "parsers": rows,
        },
        indent=2,
    )
    return 1 if any(r["crashes"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
