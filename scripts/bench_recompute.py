#!/usr/bin/env python
"""Bytes each recompute policy keeps per block, and what its recomputation costs (CPU, fp32).

    python scripts/bench_recompute.py                        # llama, gpt, moe blocks; seq 256
    python scripts/bench_recompute.py --seq 512 --hidden 512 --reps 5

For one block of each zoo model (batch ``--batch``, sequence ``--seq``), every policy the runtime
applies (``none``, ``selective``, ``op``, ``op:matmuls``, ``op:attention``, ``full``;
``nest_fx.graph.recompute_policies``) is measured with the runtime's own checkpoint wrapping:

* kept bytes: ``profiler.recompute_memory.kept_bytes``, the storages the forward created that are
  alive when it returns (autograd's saved tensors, the selective-checkpoint cache), without the
  block's input and output; ``none`` is cross-checked with ``saved_tensors_hooks``
  (``packed_bytes``);
* step time: median over ``--reps`` of one forward + backward of the block (one thread), and its
  ratio to ``none`` (the price of the recomputation).

These are the numbers the cost model's per-policy activation bytes and recompute time are
compared with (docs/runtime.md, Activation checkpointing). Writes
``results/bench_recompute.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from nest_fx.apply.activation_checkpoint import checkpoint_module
from nest_fx.models import build_seeded
from profiler.recompute_memory import kept_bytes, packed_bytes

from _bench_common import print_table, write_json

POLICIES = ("none", "selective", "op", "op:matmuls", "op:attention", "full")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_seconds(block: torch.nn.Module, x: torch.Tensor, recompute: str, reps: int) -> float:
    """Median seconds of one forward + backward of a copy of ``block`` under ``recompute``."""
    module = copy.deepcopy(block)
    checkpoint_module(module, recompute)
    times = []
    for _ in range(reps + 1):  # the first run warms up
        inp = x.detach().requires_grad_()
        start = time.perf_counter()
        module(inp).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench_recompute.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = f"hidden={args.hidden},layers=1,heads={args.heads},seq={args.seq},vocab=256"
    models = {
        "llama": f"llama:{shape}",
        "gpt": f"gpt:{shape}",
        "moe": f"moe:{shape},experts=4,top_k=2,capacity_factor=2.0",
    }
    rows, records = [], []
    for label, spec in models.items():
        model, _ = build_seeded(spec)
        block = model.layers[0]
        x = torch.randn(args.batch, args.seq, args.hidden)
        packed = packed_bytes(block, [x])
        measured = {p: (kept_bytes(block, [x], p), step_seconds(block, x, p, args.reps)) for p in POLICIES}
        none_bytes, none_s = measured["none"]
        assert none_bytes == packed, f"{label}: storage census {none_bytes} != saved_tensors_hooks {packed}"
        for policy, (kept, seconds) in measured.items():
            records.append(
                {
                    "model": label,
                    "spec": spec,
                    "policy": policy,
                    "kept_bytes": kept,
                    "kept_vs_none": kept / none_bytes,
                    "step_s": seconds,
                    "step_vs_none": seconds / none_s,
                }
            )
            rows.append(
                [
                    label,
                    policy,
                    f"{kept / 2**20:.2f}",
                    f"{kept / none_bytes:.2f}",
                    f"{seconds * 1e3:.1f}",
                    f"{seconds / none_s:.2f}",
                ]
            )
    print_table(rows, headers=["block", "recompute", "kept MiB", "vs none", "fwd+bwd ms", "vs none"], tablefmt="simple")
    write_json(args.out, {"args": vars(args), "records": records}, indent=2)


if __name__ == "__main__":
    main()
