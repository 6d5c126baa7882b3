#!/usr/bin/env python
"""Benchmark the tracer on large zoo models: trace time and peak memory, one fresh process each.

    python scripts/bench_trace.py                       # llama2-7b, llama3-70b, mixtral-8x7b, gpt3-175b
    python scripts/bench_trace.py --models llama2-7b --seq 4096 --json results/bench_trace.json

Every model is built on the meta device (bf16, batch 1, its own context length unless --seq is
given) and traced in a fresh Python subprocess, so the peak RSS reported (``ru_maxrss`` of that
child, which includes importing torch) belongs to that model alone. Target (the tracer issue):
llama2-7b at seq 4096 traces in under 30 s using under 2 GiB. Exit status 1 if a target is missed
or a child fails.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from _bench_common import table as github_table, write_json

MODELS = ["llama2-7b", "llama3-70b", "mixtral-8x7b", "gpt3-175b"]
# model -> (max trace seconds, max peak RSS GiB)
TARGETS: Dict[str, Tuple[float, float]] = {"llama2-7b": (30.0, 2.0)}
GIB = 2**30


def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def child(name: str, batch: int, seq: Optional[int], dtype_name: str, method: str) -> dict:
    """Build and trace one model in this process; return the measurements."""
    import torch

    from nest_fx.graph import trace
    from nest_fx.models import build_any

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    rss_import = _max_rss_bytes()
    start = time.perf_counter()
    model, cfg, args, kwargs = build_any(name, batch=batch, seq=seq, dtype=dtype, device="meta")
    build_s = time.perf_counter() - start
    rss_build = _max_rss_bytes()
    start = time.perf_counter()
    graph = trace(model, args, kwargs, method=method, name=name)
    trace_s = time.perf_counter() - start
    num_params = sum(p.numel() for p in model.parameters())
    return {
        "model": name,
        "batch": batch,
        "seq": int(args[0].shape[1]) if args else int(next(iter(kwargs.values())).shape[1]),
        "dtype": dtype_name,
        "method": graph.method,
        "ops": len(graph),
        "layers": len(graph.layer_blocks),
        "distinct_blocks": len(graph.distinct_blocks()),
        "moe_layers": sum(b.is_moe for b in graph.layer_blocks),
        "params": graph.num_params,
        "params_match_model": graph.num_params == num_params,
        "fwd_flops": graph.total_flops,
        "saved_bytes": graph.total("saved_bytes"),
        "build_s": build_s,
        "trace_s": trace_s,
        "rss_after_import_gib": rss_import / GIB,
        "rss_after_build_gib": rss_build / GIB,
        "peak_rss_gib": _max_rss_bytes() / GIB,
    }


def run_child(name: str, opts: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        name,
        "--batch",
        str(opts.batch),
        "--dtype",
        opts.dtype,
        "--method",
        opts.method,
    ]
    if opts.seq:
        cmd += ["--seq", str(opts.seq)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout)
    wall = time.perf_counter() - start
    children_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # max over children so far
    if proc.returncode != 0:
        return {"model": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["wall_s"] = wall
    row["children_max_rss_gib"] = children_rss * (1 if sys.platform == "darwin" else 1024) / GIB
    return row


def verdict(row: dict) -> str:
    if "error" in row:
        return "FAIL (error)"
    if not row["params_match_model"]:
        return "FAIL (params)"
    target = TARGETS.get(row["model"])
    if target is None:
        return "- (no target)"
    max_s, max_gib = target
    misses = []
    if row["trace_s"] >= max_s:
        misses.append(f"time >= {max_s:g} s")
    if row["peak_rss_gib"] >= max_gib:
        misses.append(f"RSS >= {max_gib:g} GiB")
    return "FAIL (" + ", ".join(misses) + ")" if misses else f"pass (<{max_s:g} s, <{max_gib:g} GiB)"


def table(rows: List[dict]) -> str:
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["model"]] + ["-"] * 8 + [verdict(r)])
            continue
        out.append(
            [
                r["model"],
                r["seq"],
                r["ops"],
                r["layers"],
                r["distinct_blocks"],
                f"{r['params'] / 1e9:.2f} B",
                f"{r['fwd_flops'] / 1e12:.1f}",
                f"{r['trace_s']:.2f}",
                f"{r['peak_rss_gib']:.2f}",
                r["verdict"],
            ]
        )
    headers = [
        "model",
        "seq",
        "ops",
        "layers",
        "distinct blocks",
        "params",
        "fwd TFLOPs",
        "trace s",
        "peak RSS GiB",
        "target",
    ]
    return github_table(out, headers)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS, help=f"zoo names (default {' '.join(MODELS)})")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: each model's context)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--method", choices=("auto", "fx", "export"), default="auto")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per model")
    parser.add_argument("--json", default=os.path.join("results", "bench_trace.json"), help="output JSON path")
    parser.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)

    if opts.child:
        print(json.dumps(child(opts.child, opts.batch, opts.seq, opts.dtype, opts.method)))
        return 0

    rows = []
    for name in opts.models:
        row = run_child(name, opts)
        row["verdict"] = verdict(row)
        rows.append(row)
        print(f"{name}: {row['verdict']}", file=sys.stderr, flush=True)
    print(table(rows))
    report = {
        "format": "nest-fx-bench-trace/1",
        "targets": {k: {"trace_s": s, "peak_rss_gib": g} for k, (s, g) in TARGETS.items()},
        "rows": rows,
    }
    write_json(opts.json, report, indent=2)
    failed = any(r["verdict"].startswith("FAIL") for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
