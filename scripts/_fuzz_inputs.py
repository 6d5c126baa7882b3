"""Inputs for scripts/bench_fuzz.py: awkward values, mutations of documents and of their text,
and the valid documents (clusters, plans, workload tables) the mutations start from.

The random draws are made in a fixed order from the caller's ``random.Random``, so a seed gives
the same inputs every run.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
from typing import Any, Callable, List, Optional, Tuple

import yaml

from nest_fx.cluster import Cluster
from nest_fx.plan import uniform_plan
from nest_fx.workload import build as workload_build
from nest_fx.workload import workload_to_table

MODEL = "llama:hidden=64,layers=2,heads=4,seq=32,vocab=128"
OTHER_MODEL = "gpt:hidden=64,layers=3,heads=4,seq=32,vocab=128"

# -- random values -------------------------------------------------------------------------

_SCALARS: List[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    3,
    4,
    7,
    8,
    16,
    64,
    1000,
    2**31,
    2**63,
    10**30,
    10**400,
    0.5,
    1.5,
    -0.0,
    -2.5,
    1e-300,
    1e-30,
    1e30,
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    " ",
    "0",
    "1",
    "-1",
    "8",
    "abc",
    "80GiB",
    "80G",
    "-3GB",
    "5us",
    "-5us",
    "300GB/s",
    "200Gb/s",
    "1e999",
    "nan",
    "inf",
    "-inf",
    "312T",
    "1_000",
    "\u0663",
    "\x00",
    "a" * 300,
    "none",
    "full",
    "selective",
    "1f1b",
    "interleaved",
    "gpipe",
    "stage-major",
    "replica-major",
    "tp",
    "ep",
    "fwd",
    "bwd",
    "all_reduce",
    "all_to_all",
    "head",
    "block",
    "tail",
    "nest-fx-plan/1",
    "nest-fx-cluster/1",
    "nest-fx-workload/1",
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
        options: List[Callable[[], Any]] = [
            lambda: -value,
            lambda: 0,
            lambda: value * 10**30,
            lambda: str(value),
            lambda: [value],
            lambda: float("nan"),
            lambda: value + 0.5,
        ]
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
            text = text[:i] + text[i + rng.randint(1, 20) :]
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


_SPECIAL_TEXTS = [
    b"",
    b"   \n",
    b"null",
    b"[]",
    b"{}",
    b"0",
    b'"x"',
    b"- a\n- b",
    b"\xff\xfe\x00",
    b"[" * 5000,
    b"{" * 100 + b"}" * 100,
    b"a: &a [*a]",
    b"!!python/object/apply:os.system ['true']",
    b"a: 1\na: 2",
    b"? [1, 2]\n: 3",
    b"1" * 5000,
    b"format: " + b"9" * 5000,
    b"NaN",
    b"Infinity",
    b"\xef\xbb\xbf{}",
    b"x: !!binary aGVsbG8=",
    b"x: 2024-01-01",
    b"---\n...\n---\n",
]


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
    docs = [
        Cluster.preset(name, n).to_dict()
        for name, n in (
            ("dgx-a100", 8),
            ("dgx-h100", 64),
            ("tpuv4-fat-tree", 33),
            ("cpu-gloo", 2),
            ("h100-spine-leaf", 4),
        )
    ]
    return docs + [HUMAN_CLUSTER]


def valid_plans(num_layers: int = 4) -> List[dict]:
    plans = [
        uniform_plan(num_layers, pp=2, tp=1, dp=2, num_microbatches=4, model=MODEL, world_size=8),
        uniform_plan(num_layers, pp=1, tp=2, dp=4, zero=3, recompute="full", model=MODEL, world_size=8),
        uniform_plan(
            num_layers,
            pp=2,
            tp=2,
            dp=2,
            schedule="interleaved",
            virtual_stages=2,
            num_microbatches=4,
            sequence_parallel=True,
            placement="replica-major",
        ),
        uniform_plan(num_layers, pp=4, tp=1, dp=1, num_microbatches=8, schedule="gpipe", recompute="selective"),
    ]
    return [json.loads(json.dumps(p.to_dict())) for p in plans]


def _variant(tp: int, mbs: int = 1, scale: float = 1.0, comms: bool = True) -> dict:
    v = {
        "tp": tp,
        "ep": 1,
        "mbs": mbs,
        "sp": False,
        "fwd_s": 1e-3 * scale / tp,
        "bwd_s": 2e-3 * scale / tp,
        "num_params": 1e6 / tp,
        "param_bytes": 2e6 / tp,
        "act_bytes": {"none": 4e6 / tp, "selective": 3e6 / tp, "full": 1e5},
        "recompute_s": {"none": 0.0, "selective": 1e-4, "full": 1e-3 / tp},
        "out_bytes": 1e5,
        "comms": [],
        "expert_params": 0.0,
    }
    if comms and tp > 1:
        v["comms"] = [
            {"kind": "all_reduce", "group": "tp", "nbytes": 1e5, "phase": p, "count": 2} for p in ("fwd", "bwd")
        ]
    return v


def hand_table(blocks: int = 2) -> dict:
    """A small hand-written ``nest-fx-workload/1`` table (head, ``blocks`` blocks, tail)."""
    layers = (
        [{"name": "head", "kind": "head", "signature": "emb", "num_params": 1e6, "flops_per_sample": 0}]
        + [
            {
                "name": f"layers.{i}",
                "kind": "block",
                "signature": "dec",
                "num_params": 1e6,
                "flops_per_sample": 1e9,
                "is_moe": False,
            }
            for i in range(blocks)
        ]
        + [{"name": "tail", "kind": "tail", "signature": "lmh", "num_params": 1e6, "flops_per_sample": 1e8}]
    )
    costs = {
        key: [_variant(tp, scale=s) for tp in (1, 2)]
        for key, s in (("head:emb", 0.1), ("block:dec", 1.0), ("tail:lmh", 0.5))
    }
    costs["block:dec"].append(_variant(1, mbs=2, scale=2.0))
    return {
        "format": "nest-fx-workload/1",
        "model": MODEL,
        "provenance": "hand-written",
        "dims": {
            "seq_len": 32,
            "hidden": 64,
            "heads": 4,
            "kv_heads": 4,
            "ffn_hidden": 256,
            "num_experts": 0,
            "vocab_size": 128,
            "dtype_bytes": 2,
        },
        "layers": layers,
        "costs": costs,
    }


@functools.lru_cache(maxsize=None)
def traced_table() -> str:
    work = workload_build.workload_for_model(MODEL, Cluster.preset("dgx-a100", 8))
    return json.dumps(workload_to_table(work, tps=(1, 2), mbss=(1, 2)))


def valid_workloads() -> List[dict]:
    return [hand_table(), hand_table(1), json.loads(traced_table())]


# -- many inputs ---------------------------------------------------------------------------


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
