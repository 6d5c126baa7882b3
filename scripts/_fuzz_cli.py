"""The command-line part of ``bench_fuzz.py``: the files a fuzzed ``nest-fx simulate`` / ``nest-fx
plan`` command line points at (``CliFiles``), random command lines (``cli_argv``) and the check of
one in-process run (``check_cli``: accepted, rejected with one ``error:`` line, or a crash)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
from typing import List, Tuple

import yaml

from nest_fx.cli import main as cli_main
from nest_fx.cluster import Cluster
from nest_fx.plan import uniform_plan

from _fuzz_inputs import HUMAN_CLUSTER, MODEL, OTHER_MODEL, hand_table, mutate, traced_table, valid_plans


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
