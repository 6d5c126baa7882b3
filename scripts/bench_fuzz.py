"""Parser fuzz benchmark: random valid and broken inputs for every reader of user data.

Each parser gets ``--inputs`` random inputs (mutations of valid documents plus random values and
text): cluster dicts and files (YAML/JSON), plan dicts and files, workload tables and files,
and ``nest-fx simulate`` / ``nest-fx plan`` argument lists run in-process through
``nest_fx.cli.main``. An input is *accepted*, *rejected* with our own error (ClusterError,
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
import copy
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
from nest_fx.workload import Workload, WorkloadError, load_workload, workload_from_table, workload_to_table

from _bench_common import print_table, write_json

OUR_ERRORS = (ClusterError, PlanError, WorkloadError)
MODEL = "llama:hidden=64,layers=2,heads=4,seq=32,vocab=128"
OTHER_MODEL = "gpt:hidden=64,layers=3,heads=4,seq=32,vocab=128"

# -- random values -------------------------------------------------------------------------

_SCALARS: List[Any] = [
    None, True, False, 0, 1, -1, 2, 3, 4, 7, 8, 16, 64, 1000, 2**31, 2**63, 10**30, 10**400, 0.5, 1.5, -0.0,
    -2.5, 1e-300, 1e-30, 1e30, 1e308, float("nan"), float("inf"), float("-inf"),
    "", " ", "0", "1", "-1", "8", "abc", "80GiB", "80G", "-3GB", "5us", "-5us", "300GB/s", "200Gb/s", "1e999",
    "nan", "inf", "-inf", "312T", "1_000", "\u0663", "\x00", "a" * 300, "none", "full", "selective", "1f1b",
    "interleaved", "gpipe", "stage-major", "replica-major", "tp", "ep", "fwd", "bwd", "all_reduce",
    "all_to_all", "head", "block", "tail", "nest-fx-plan/1", "nest-fx-cluster/1", "nest-fx-workload/1",
]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A scalar from the pool of awkward values, or a small list/dict of them."""
    roll = rng.random()
    if depth < 3 and roll < 0.12:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 3 and roll < 0.22:
        keys = ["a", "name", "start", "end", "tp", "none", "fwd_s", "group_size", "seq_len", "1"]
        return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if roll < 0.3:
        return rng.choice([rng.randint(-10, 100), rng.uniform(-1e3, 1e3), 10 ** rng.randint(0, 40)])
    return rng.choice(_SCALARS)


def _paths(node: Any, prefix: Tuple = ()) -> List[Tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _get(node: Any, path: Tuple) -> Any:
    for k in path:
        node = node[k]
    return node


def _tweak(rng: random.Random, value: Any) -> Any:
    """A near miss of ``value``: wrong sign, zero, huge, fractional, as a string, wrapped."""
    if isinstance(value, bool):
        return rng.choice([not value, int(value), str(value).lower()])
    if isinstance(value, (int, float)):
        options: List[Callable[[], Any]] = [lambda: -value, lambda: 0, lambda: value * 10**30, lambda: str(value),
                                            lambda: [value], lambda: float("nan"), lambda: value + 0.5]
        if isinstance(value, int):
            options += [lambda: value * 10**400, lambda: float(value) if abs(value) < 1e300 else value]
        else:
            options += [lambda: value * 1e300, lambda: int(value) if math.isfinite(value) else value]
        return rng.choice(options)()
    if isinstance(value, str):
        return rng.choice(["", value.upper(), value + "x", value[:-1], " " + value, value * 2, [value]])
    return random_value(rng)


def mutate(rng: random.Random, doc: Any, edits: Optional[int] = None) -> Any:
    """``doc`` with 1-3 random edits: replace, delete, add an unknown key, tweak, duplicate, swap."""
    doc = copy.deepcopy(doc)
    for _ in range(edits or rng.choice([1, 1, 1, 2, 3])):
        paths = _paths(doc)
        path = rng.choice(paths)
        op = rng.random()
        if not path:
            if op < 0.5:
                doc = random_value(rng)
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        if op < 0.3:
            parent[key] = random_value(rng)
        elif op < 0.45:
            del parent[key]
        elif op < 0.7:
            parent[key] = _tweak(rng, parent[key])
        elif op < 0.8 and isinstance(parent, dict):
            parent[rng.choice(["extra", "Name", "bandwith", "tp ", "stage", "fwd", key + "_"])] = random_value(rng)
        elif op < 0.9 and isinstance(parent, list):
            parent.insert(rng.randint(0, len(parent)), copy.deepcopy(parent[key]))
        else:
            other = _get(doc, rng.choice(paths))
            parent[key] = copy.deepcopy(other)
    return doc


_TEXT_NOISE = list("{}[]:,-'\"\n\t #&*!|>%@`?\\0123456789.eE+abcxyz") + ["\n  ", ": ", "- ", "\ufeff", "µ"]


def mutate_text(rng: random.Random, text: str) -> bytes:
    """Bytes of ``text`` with character-level damage: cut, insert, drop, duplicate, bad UTF-8."""
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        i = rng.randint(0, len(text))
        if op < 0.25:
            text = text[:i]
        elif op < 0.55:
            text = text[:i] + "".join(rng.choice(_TEXT_NOISE) for _ in range(rng.randint(1, 4))) + text[i:]
        elif op < 0.8:
            text = text[:i] + text[i + rng.randint(1, 20):]
        else:
            lines = text.splitlines(True)
            if lines:
                k = rng.randrange(len(lines))
                lines.insert(k, lines[k])
                text = "".join(lines)
    data = text.encode("utf-8", "surrogatepass")
    if rng.random() < 0.05:
        k = rng.randint(0, len(data))
        data = data[:k] + rng.choice([b"\xff", b"\xc3", b"\x80\x80", b"\xed\xa0\x80"]) + data[k:]
    return data


_SPECIAL_TEXTS = [b"", b"   \n", b"null", b"[]", b"{}", b"0", b'"x"', b"- a\n- b", b"\xff\xfe\x00", b"[" * 5000,
                  b"{" * 100 + b"}" * 100, b"a: &a [*a]", b"!!python/object/apply:os.system ['true']",
                  b"a: 1\na: 2", b"? [1, 2]\n: 3", b"1" * 5000, b"format: " + b"9" * 5000, b"NaN", b"Infinity",
                  b"\xef\xbb\xbf{}", b"x: !!binary aGVsbG8=", b"x: 2024-01-01", b"---\n...\n---\n"]


def _dump(rng: random.Random, doc: Any, yaml_ok: bool) -> bytes:
    if yaml_ok and rng.random() < 0.5:
        text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
    else:
        text = json.dumps(doc, indent=rng.choice([None, 1]))
    return text.encode("utf-8", "surrogatepass")


# -- valid documents ------------------------------------------------------------------------

HUMAN_CLUSTER = yaml.safe_load("""
format: nest-fx-cluster/1
name: my-a100s
num_devices: 16
device: {name: A100, memory_bytes: 80GiB, peak_flops: {bf16: 312TFLOPS, fp32: 19.5e12}, mem_bandwidth: 2039GB/s}
levels:
  - {name: node, group_size: 8, bandwidth: 300GB/s, latency: 5us}
  - {name: rack, group_size: 32, bandwidth: 200Gb/s, latency: 0.01ms}
""")


def valid_clusters() -> List[dict]:
    docs = [Cluster.preset(name, n).to_dict() for name, n in
            (("dgx-a100", 8), ("dgx-h100", 64), ("tpuv4-fat-tree", 33), ("cpu-gloo", 2), ("h100-spine-leaf", 4))]
    return docs + [HUMAN_CLUSTER]


def valid_plans(num_layers: int = 4) -> List[dict]:
    plans = [
        uniform_plan(num_layers, pp=2, tp=1, dp=2, num_microbatches=4, model=MODEL, world_size=8),
        uniform_plan(num_layers, pp=1, tp=2, dp=4, zero=3, recompute="full", model=MODEL, world_size=8),
        uniform_plan(num_layers, pp=2, tp=2, dp=2, schedule="interleaved", virtual_stages=2, num_microbatches=4,
                     sequence_parallel=True, placement="replica-major"),
        uniform_plan(num_layers, pp=4, tp=1, dp=1, num_microbatches=8, schedule="gpipe", recompute="selective"),
    ]
    return [json.loads(json.dumps(p.to_dict())) for p in plans]


def _variant(tp: int, mbs: int = 1, scale: float = 1.0, comms: bool = True) -> dict:
    v = {"tp": tp, "ep": 1, "mbs": mbs, "sp": False, "fwd_s": 1e-3 * scale / tp, "bwd_s": 2e-3 * scale / tp,
         "num_params": 1e6 / tp, "param_bytes": 2e6 / tp,
         "act_bytes": {"none": 4e6 / tp, "selective": 3e6 / tp, "full": 1e5},
         "recompute_s": {"none": 0.0, "selective": 1e-4, "full": 1e-3 / tp}, "out_bytes": 1e5,
         "comms": [], "expert_params": 0.0}
    if comms and tp > 1:
        v["comms"] = [{"kind": "all_reduce", "group": "tp", "nbytes": 1e5, "phase": p, "count": 2}
                      for p in ("fwd", "bwd")]
    return v


def hand_table(blocks: int = 2) -> dict:
    """A small hand-written ``nest-fx-workload/1`` table (head, ``blocks`` blocks, tail)."""
    layers = ([{"name": "head", "kind": "head", "signature": "emb", "num_params": 1e6, "flops_per_sample": 0}]
              + [{"name": f"layers.{i}", "kind": "block", "signature": "dec", "num_params": 1e6,
                  "flops_per_sample": 1e9, "is_moe": False} for i in range(blocks)]
              + [{"name": "tail", "kind": "tail", "signature": "lmh", "num_params": 1e6, "flops_per_sample": 1e8}])
    costs = {key: [_variant(tp, scale=s) for tp in (1, 2)] for key, s in
             (("head:emb", 0.1), ("block:dec", 1.0), ("tail:lmh", 0.5))}
    costs["block:dec"].append(_variant(1, mbs=2, scale=2.0))
    return {"format": "nest-fx-workload/1", "model": MODEL, "provenance": "hand-written",
            "dims": {"seq_len": 32, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn_hidden": 256,
                     "num_experts": 0, "vocab_size": 128, "dtype_bytes": 2},
            "layers": layers, "costs": costs}


@functools.lru_cache(maxsize=None)
def traced_table() -> str:
    work = workload_build.workload_for_model(MODEL, Cluster.preset("dgx-a100", 8))
    return json.dumps(workload_to_table(work, tps=(1, 2), mbss=(1, 2)))


def valid_workloads() -> List[dict]:
    return [hand_table(), hand_table(1), json.loads(traced_table())]


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
        return {"parser": self.name, "inputs": self.inputs, "accepted": self.accepted, "rejected": self.rejected,
                "crashes": self.crashes, "seconds": round(self.seconds, 2), "examples": self.examples}


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
        good_plan = uniform_plan(len(table["layers"]), pp=2, tp=1, dp=2, num_microbatches=4, model=MODEL,
                                 world_size=8).to_dict()
        # each list is (plausible, broken); a plausible file may still not fit the model or cluster
        self.plans = ([self.write("plan.json", json.dumps(good_plan)),
                       self.write("plan_tp2.json", json.dumps(valid_plans(len(table["layers"]))[1])),
                       self.write("plan_other.json", json.dumps(dict(good_plan, model=OTHER_MODEL))),
                       self.write("plan_big.json", json.dumps(dict(good_plan, world_size=4096))),
                       self.write("plan_tp8.json", json.dumps(
                           uniform_plan(len(table["layers"]), tp=8, model=MODEL, world_size=8).to_dict()))],
                      [self.write("empty.json", ""), self.write("latin1.json", b"\xff\xfe{}"),
                       os.path.join(root, "dir.json"), os.path.join(root, "missing.json"), "-"])
        self.workloads = ([self.write("w.json", json.dumps(table)),
                           self.write("w_hand.json", json.dumps(hand_table())),
                           self.write("w_tp1.json", json.dumps(dict(table, costs={
                               k: [v for v in vs if v["tp"] == 1] for k, vs in table["costs"].items()})))],
                          [self.write("w_bad.json", json.dumps(mutate(rng, table, 2))),
                           self.write("empty.json", ""), os.path.join(root, "dir.json"),
                           os.path.join(root, "missing.json")])
        small = Cluster.preset("dgx-a100", 8).to_dict()
        self.clusters = (["dgx-a100:8", "cpu-gloo:2", "dgx-h100:16", "tpuv4-fat-tree:4", "dgx-a100: 8",
                          self.write("c.yaml", yaml.safe_dump(HUMAN_CLUSTER)), self.write("c.json", json.dumps(small))],
                         ["dgx-a100", "nope:8", "dgx-a100:abc", "dgx-a100:0", "dgx-a100:-3", "dgx-a100:1e3",
                          "dgx-a100:8:9", "dgx-a100:99999999999999999999", "", ":",
                          self.write("c_bad.yaml", "levels: [1"), self.write("c.txt", "x"),
                          self.write("c_empty.yaml", ""), os.path.join(root, "dir.json"),
                          os.path.join(root, "missing.yaml")])

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
_BAD_NUMBERS = ["0", "-1", "-8", "1.5", "nan", "inf", "-inf", "1e3", "abc", "", "0x10", "99999999999999999999999",
                "1_0"]
_BUDGETS = (["0.05", "0.1", "0.2", "1e-9"], ["0", "-1", "nan", "inf", "-inf", "abc", "1e400", ""])
_MODELS = ([MODEL, OTHER_MODEL, "llama:hidden=64,layers=3,heads=4,kv=2,seq=16,vocab=128"],
           ["no-such-model", "gpt:hidden=64,heads=3", "gpt:hiden=64", "llama:heads=0",
            "llama:hidden=64,layers=2,heads=4,kv=0,seq=32,vocab=128", "llama:hidden=-64,heads=4", "gpt:",
            "llama:hidden=64,layers=2,heads=4,seq=32,vocab=128,norm_eps=nan", "hf:nope", "", ":", "gpt:layers=1e3"])


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
    options = [("--devices", numbers), ("--seq", (_GOOD_NUMBERS + ["32"], _BAD_NUMBERS)),
               ("--dtype", (["fp32", "bf16"], ["int8", ""])),
               ("--json", ([os.path.join(files.root, "out.json")], [os.path.join(files.root, "dir.json"),
                                                                    os.path.join(files.root, "no", "such", "d.json")]))]
    if command == "plan":
        options += [("--global-batch", (_GOOD_NUMBERS + ["32", "64", "7", "4096"], _BAD_NUMBERS)),
                    ("--time-budget", _BUDGETS), ("--mcmc-evals", (["10", "20"], ["0", "-5", "x"]))]
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


def fuzz_docs(rng: random.Random, bases: List[dict], n: int) -> List[Any]:
    docs = []
    for k in range(n):
        roll = rng.random()
        if k < len(bases):
            docs.append(copy.deepcopy(bases[k]))
        elif roll < 0.08:
            docs.append(random_value(rng))
        else:
            docs.append(mutate(rng, rng.choice(bases)))
    return docs


def fuzz_files(rng: random.Random, bases: List[dict], n: int, yaml_ok: bool) -> List[Tuple[str, bytes]]:
    out = []
    for k in range(n):
        roll = rng.random()
        ext = rng.choice([".yaml", ".yml", ".json"]) if yaml_ok else ".json"
        if k < len(_SPECIAL_TEXTS):
            data = _SPECIAL_TEXTS[k]
        elif roll < 0.4:
            data = _dump(rng, mutate(rng, rng.choice(bases)), yaml_ok and ext != ".json")
        elif roll < 0.8:
            data = mutate_text(rng, _dump(rng, rng.choice(bases), yaml_ok and ext != ".json").decode("utf-8"))
        else:
            data = _dump(rng, copy.deepcopy(rng.choice(bases)), yaml_ok and ext != ".json")
        if yaml_ok and rng.random() < 0.03:
            ext = rng.choice([".toml", "", ".YAML"])
        out.append((ext, data))
    return out


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
            "cluster-file": lambda: (fuzz_files(rng, valid_clusters(), n, True), lambda f: _file_check(
                root, f, Cluster.load, ClusterError, use_cluster)),
            "plan-dict": lambda: (fuzz_docs(rng, valid_plans(), n), lambda d: lambda: check_plan_dict(d)),
            "plan-file": lambda: (fuzz_files(rng, valid_plans(), n, False), lambda f: _file_check(
                root, f, Plan.load, PlanError, use_plan)),
            "workload-dict": lambda: (fuzz_docs(rng, valid_workloads(), n), lambda d: lambda: check_workload_dict(d)),
            "workload-file": lambda: (fuzz_files(rng, valid_workloads(), n, False), lambda f: _file_check(
                root, f, load_workload, WorkloadError, use_workload)),
            "cli-simulate": lambda: ([cli_argv(rng, "simulate", files) for _ in range(n)],
                                     lambda a: lambda: check_cli(a)),
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


PARSERS = ["cluster-dict", "cluster-file", "plan-dict", "plan-file", "workload-dict", "workload-file",
           "cli-simulate", "cli-plan"]


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
    print_table([[r["parser"], r["inputs"], r["accepted"], r["rejected"], r["crashes"], r["seconds"]] for r in rows],
                headers=["parser", "inputs", "accepted", "rejected (our error)", "crashes", "seconds"],
                tablefmt="simple")
    for r in rows:
        for ex in r["examples"]:
            print(f"\n--- crash in {r['parser']}: {ex['input']}\n{ex['traceback']}")
    write_json(args.out, {"seed": args.seed, "inputs_per_parser": args.inputs,
                          "seconds": round(time.perf_counter() - start, 1), "parsers": rows}, indent=2)
    return 1 if any(r["crashes"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
