#!/usr/bin/env python
"""How many HuggingFace architectures get each TP region's column input prepared once.

    python scripts/bench_tp_inputs.py                    # every type results/bench_hf_types.json lists as traced
    python scripts/bench_tp_inputs.py --types bert,llama,t5

For each ``hf:<model_type>`` the script builds the model (its default config shrunk, batch 2),
traces it and reads the first layer's TP regions (``graph.tp_inputs.column_inputs``): regions
whose input the runtime prepares once (one backward all-reduce for all their columns), regions
whose columns each reduce their own input, and the module that takes the input once. Types that
fail to build or trace are counted by error. Writes ``results/bench_tp_inputs.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import warnings
from collections import Counter
from typing import Dict

import torch

from nest_fx.graph import trace
from nest_fx.graph.tp_inputs import column_inputs, once_input
from nest_fx.graph.tp_regions import block_regions
from nest_fx.models import build_any
from _bench_common import write_json  # next to this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _timeout(*_):
    raise TimeoutError("over the time limit")


def inspect(model_type: str) -> Dict:
    """The first layer's regions of ``hf:<model_type>``: kind, the module taking the input once."""
    model, _, args, kwargs = build_any(f"hf:{model_type}", batch=2)
    graph = trace(model, args, kwargs, name=model_type)
    if not graph.layer_blocks:
        return {"status": "no layers"}
    pattern = graph.pattern_of(graph.layer_blocks[0])
    counts = column_inputs(pattern)
    return {
        "status": "ok",
        "once": counts.once,
        "alone": counts.alone,
        "regions": {region: [kind, once_input(kind, pairs)] for region, kind, pairs in block_regions(pattern)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="", help="comma-separated model types (default: the traced ones)")
    ap.add_argument("--limit-s", type=int, default=60, help="seconds per type")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench_tp_inputs.json"))
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    if a.types:
        types = a.types.split(",")
    else:
        with open(os.path.join(ROOT, "results", "bench_hf_types.json"), encoding="utf-8") as fh:
            types = [t for t, row in json.load(fh)["types"].items() if row["status"] == "traced"]
    signal.signal(signal.SIGALRM, _timeout)
    rows: Dict[str, Dict] = {}
    for model_type in types:
        signal.alarm(a.limit_s)
        try:
            rows[model_type] = inspect(model_type)
        except Exception as e:  # a type that does not build or trace here is counted, not fatal
            rows[model_type] = {"status": f"error {type(e).__name__}", "error": str(e).splitlines()[0][:200]}
        finally:
            signal.alarm(0)
    ok = [r for r in rows.values() if r["status"] == "ok"]
    summary = {
        "types": len(rows),
        "traced": len(ok),
        "every_region_once": sum(1 for r in ok if r["once"] and not r["alone"]),
        "a_region_per_column": sum(1 for r in ok if r["alone"]),
        "no_tp_region": sum(1 for r in ok if not r["once"] and not r["alone"]),
        "failed": dict(Counter(r["status"] for r in rows.values() if r["status"] != "ok")),
    }
    print(json.dumps(summary, indent=1))
    write_json(a.out, {"summary": summary, "types": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
