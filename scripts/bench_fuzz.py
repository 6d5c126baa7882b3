"""Parser fuzz benchmark: random valid and broken inputs for every reader of user data.

Each parser gets ``--inputs`` random inputs (mutations of valid documents plus random values and
text, made by ``scripts/_fuzz_inputs.py``): cluster dicts and files (YAML/JSON), plan dicts and
files, workload tables and files, and ``nest-fx simulate`` / ``nest-fx plan`` argument lists run
in-process through ``nest_fx.cli.main``. An input is *accepted*, *rejected* with our own error (ClusterError,
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
import contextlib
import functools
import io
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml


from nest_fx.workload import build as workload_build
from nest_fx.cli import main as cli_main
from nest_fx.cluster import Cluster, ClusterError
from nest_fx.cost.step_time import simulate
from nest_fx.plan import Plan, PlanError, uniform_plan
from nest_fx.workload import Workload, WorkloadError, load_workload, workload_from_table

from _bench_common import print_table, write_json
from _fuzz_inputs import (
    HUMAN_CLUSTER,
    MODEL,
    OTHER_MODEL,
    fuzz_docs,
    fuzz_files,
    hand_table,
    mutate,
    traced_table,
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


class CliFiles:
    """Files the CLI fuzz points at: valid ones, broken ones, directories, missing paths."""

    def __init__(self, root: str, rng: random.Random):
        self.root = root
        os.makedirs(os.path.join(root, "dir.json"))
        self.counter = 0
        table = json.loads(traced_table())
        good_plan = uniform_plan(
            len(table["layers"]), pp=2, tp=1, dp=2, num_microbatches=4, model=MODEL, world_size=8
        ).to_dict()
        # each list is (plausible, broken); a plausible file may still not fit the model or cluster
        self.plans = (
            [
                self.write("plan.json", json.dumps(good_plan)),
                self.write("plan_tp2.json", json.dumps(valid_plans(len(table["layers"]))[1])),
                self.write("plan_other.json", json.dumps(dict(good_plan, model=OTHER_MODEL))),
                self.write("plan_big.json", json.dumps(dict(good_plan, world_size=4096))),
                self.write(
                    "plan_tp8.json",
                    json.dumps(uniform_plan(len(table["layers"]), tp=8, model=MODEL, world_size=8).to_dict()),
                ),
            ],
            [
                self.write("empty.json", ""),
                self.write("latin1.json", b"\xff\xfe{}"),
                os.path.join(root, "dir.json"),
                os.path.join(root, "missing.json"),
                "-",
            ],
        )
        self.workloads = (
            [
                self.write("w.json", json.dumps(table)),
                self.write("w_hand.json", json.dumps(hand_table())),
                self.write(
                    "w_tp1.json",
                    json.dumps(
                        dict(table, costs={k: [v for v in vs if v["tp"] == 1] for k, vs in table["costs"].items()})
                    ),
                ),
            ],
            [
                self.write("w_bad.json", json.dumps(mutate(rng, table, 2))),
                self.write("empty.json", ""),
                os.path.join(root, "dir.json"),
                os.path.join(root, "missing.json"),
            ],
        )
        small = Cluster.preset("dgx-a100", 8).to_dict()
        self.clusters = (
            [
                "dgx-a100:8",
                "cpu-gloo:2",
                "dgx-h100:16",
                "tpuv4-fat-tree:4",
                "dgx-a100: 8",
                self.write("c.yaml", yaml.safe_dump(HUMAN_CLUSTER)),
                self.write("c.json", json.dumps(small)),
            ],
            [
                "dgx-a100",
                "nope:8",
                "dgx-a100:abc",
                "dgx-a100:0",
                "dgx-a100:-3",
                "dgx-a100:1e3",
                "dgx-a100:8:9",
                "dgx-a100:99999999999999999999",
                "",
                ":",
                self.write("c_bad.yaml", "levels: [1"),
                self.write("c.txt", "x"),
                self.write("c_empty.yaml", ""),
                os.path.join(root, "dir.json"),
                os.path.join(root, "missing.yaml"),
            ],
        )

    def write(self, name: str, content) -> str:
        path = os.path.join(self.root, name)
        with open(path, "wb") as fh:
            fh.write(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
        return path

    def fresh_plan(self, rng: random.Random) -> str:
        self.counter += 1
        with open(self.plans[0][0], encoding="utf-8") as fh:
            base = json.load(fh)
        return self.write(f"p{self.counter % 50}.json", json.dumps(mutate(rng, base)))


_GOOD_NUMBERS = ["1", "2", "4", "8", "16", " 4", "\u0664"]  # int() reads " 4" and the Arabic-Indic digit 4
_BAD_NUMBERS = [
    "0",
    "-1",
    "-8",
    "1.5",
    "nan",
    "inf",
    "-inf",
    "1e3",
    "abc",
    "",
    "0x10",
    "99999999999999999999999",
    "1_0",
]
_BUDGETS = (["0.05", "0.1", "0.2", "1e-9"], ["0", "-1", "nan", "inf", "-inf", "abc", "1e400", ""])
_MODELS = (
    [MODEL, OTHER_MODEL, "llama:hidden=64,layers=3,heads=4,kv=2,seq=16,vocab=128"],
    [
        "no-such-model",
        "gpt:hidden=64,heads=3",
        "gpt:hiden=64",
        "llama:heads=0",
        "llama:hidden=64,layers=2,heads=4,kv=0,seq=32,vocab=128",
        "llama:hidden=-64,heads=4",
        "gpt:",
        "llama:hidden=64,layers=2,heads=4,seq=32,vocab=128,norm_eps=nan",
        "hf:nope",
        "",
        ":",
        "gpt:layers=1e3",
    ],
)


def _pick(rng: random.Random, choices: Tuple[List[str], List[str]], good: float = 0.8) -> str:
    """A value from ``choices`` = (plausible, broken): plausible with probability ``good``."""
    return rng.choice(choices[0] if rng.random() < good else choices[1])


def cli_argv(rng: random.Random, command: str, files: CliFiles) -> List[str]:
    """A random ``nest-fx simulate``/``plan`` command line: each part plausible most of the time
    and broken otherwise, so that about a third of the commands run through to a result."""
    argv = [command]
    if command == "simulate" and rng.random() < 0.97:
        argv += ["--plan", files.fresh_plan(rng) if rng.random() < 0.2 else _pick(rng, files.plans)]
    pick = rng.random()
    if pick < 0.45:
        argv += ["--workload", _pick(rng, files.workloads)]
    elif pick < 0.9:
        argv += ["--model", _pick(rng, _MODELS)]
    elif pick < 0.95:
        argv += ["--workload", _pick(rng, files.workloads), "--model", MODEL]
    if rng.random() < 0.97:
        argv += ["--cluster", _pick(rng, files.clusters)]
    numbers = (_GOOD_NUMBERS, _BAD_NUMBERS)
    options = [
        ("--devices", numbers),
        ("--seq", (_GOOD_NUMBERS + ["32"], _BAD_NUMBERS)),
        ("--dtype", (["fp32", "bf16"], ["int8", ""])),
        (
            "--json",
            (
                [os.path.join(files.root, "out.json")],
                [os.path.join(files.root, "dir.json"), os.path.join(files.root, "no", "such", "d.json")],
            ),
        ),
    ]
    if command == "plan":
        options += [
            ("--global-batch", (_GOOD_NUMBERS + ["32", "64", "7", "4096"], _BAD_NUMBERS)),
            ("--time-budget", _BUDGETS),
            ("--mcmc-evals", (["10", "20"], ["0", "-5", "x"])),
        ]
    for flag, values in options:
        if rng.random() < 0.25:
            argv += [flag, _pick(rng, values, good=0.8)]
    if command == "plan":
        if "--time-budget" not in argv:
            argv += ["--time-budget", "0.2"]
        if rng.random() < 0.8:
            argv.append("--no-baselines")
        elif "--mcmc-evals" not in argv:
            argv += ["--mcmc-evals", "20"]
        argv.append("--quiet")
    if rng.random() < 0.05:
        argv.insert(rng.randint(1, len(argv)), rng.choice(["--bogus", "-x", "--", "--seq"]))
    return argv


def check_cli(argv: List[str]) -> str:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli_main(argv)
    except SystemExit as exc:  # argparse: the usage, then one "nest-fx ...: error: ..." line, exit code 2
        text = err.getvalue()
        lines = text.strip().splitlines()
        if exc.code == 2 and lines and ": error: " in lines[-1] and "Traceback" not in text:
            return "rejected"
        return f"SystemExit({exc.code}): {text!r}"
    text = err.getvalue()
    if "Traceback" in text:
        return f"a traceback on stderr (exit {rc}): {text!r}"
    if rc == 2:
        lines = text.splitlines()
        if len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) > 12:
            return "rejected"
        return f"exit 2 without one 'error: ...' line: {text!r}"
    if rc in (0, 1) and not text.strip():
        return "accepted"
    return f"exit {rc}, stderr {text!r}"


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
