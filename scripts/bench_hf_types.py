#!/usr/bin/env python
"""How many transformers architectures ``hf:<model_type>`` builds and traces (single process, meta).

    python scripts/bench_hf_types.py                      # every model type with a text or image head
    python scripts/bench_hf_types.py --types llama,t5,vit

For every model type of the installed transformers that has a causal LM, masked LM,
sequence-to-sequence LM or image-classification class, the script builds ``hf:<model_type>`` (its
default config shrunk, on the meta device, batch 2) and traces it on fake tensors, and records
``traced`` (with the layer container and the number of layers found), or the stage that failed
(``build``: config or model construction; ``inputs``: no token or image input; ``trace``) with the
first line of the error. A progress line per type; ``results/bench_hf_types.json`` holds every
type's status and the counts.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any, Dict

import torch

from nest_fx.common.errors import NestFxError
from nest_fx.graph import trace
from nest_fx.models import build_any

from _bench_common import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
)


class _Slow(Exception):
    pass


def _alarm(signum, frame):
    raise _Slow()


def model_types_with_a_head():
    """Model types that have one of the :data:`TASKS` classes, sorted."""
    from transformers.models.auto import modeling_auto  # optional extra

    return sorted({t for task in TASKS for t in getattr(modeling_auto, task)})


def check(model_type: str, limit: float) -> Dict[str, Any]:
    """Build and trace ``hf:<model_type>``; the stage reached and the error, if any."""
    name = f"hf:{model_type}"
    stage = "build"
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        model, _, args, kwargs = build_any(name, batch=2, dtype=torch.float32)
        stage = "trace"
        graph = trace(model, args, kwargs, name=name)
        return {
            "status": "traced",
            "container": graph.block_container,
            "layers": len(graph.layer_blocks),
            "moe": any(b.is_moe for b in graph.blocks),
            "inputs": graph.input_names,
            "class": type(model).__name__,
        }
    except _Slow:
        return {"status": stage, "error": f"more than {limit:.0f} s"}
    except Exception as exc:  # noqa: BLE001 - every failure is a row of the report
        if isinstance(exc, NestFxError) and "example inputs" in str(exc):
            stage = "inputs"
        text = str(exc).strip().splitlines()
        return {"status": stage, "error": f"{type(exc).__name__}: {text[0][:300] if text else ''}"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: every type with a head)")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds per type")
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "bench_hf_types.json"))
    args = parser.parse_args(argv)
    types = args.types.split(",") if args.types else model_types_with_a_head()
    signal.signal(signal.SIGALRM, _alarm)
    rows: Dict[str, Dict[str, Any]] = {}
    start = time.perf_counter()
    for i, model_type in enumerate(types, 1):
        t0 = time.perf_counter()
        rows[model_type] = check(model_type, args.limit)
        rows[model_type]["seconds"] = round(time.perf_counter() - t0, 2)
        row = rows[model_type]
        print(
            f"[{i}/{len(types)}] {model_type:<28} {row['status']:<7} {row['seconds']:6.1f}s  "
            f"{row.get('error', row.get('class', ''))[:120]}",
            flush=True,
        )
    counts: Dict[str, int] = {}
    for row in rows.values():
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    write_json(args.out, {"counts": counts, "seconds": round(time.perf_counter() - start, 1), "types": rows}, indent=2)
    print(f"{counts} of {len(types)} model types")
    return 0


if __name__ == "__main__":
    sys.exit(main())
