#!/usr/bin/env python
"""TP all-reduces per layer and step time, each region's input prepared once against once per column.

    python scripts/bench_tp_collectives.py            # llama hidden=256, 4 layers, seq 128, TP2 on 2 gloo ranks
    python scripts/bench_tp_collectives.py --model llama:hidden=512,layers=4,heads=8,seq=256,vocab=4096

The same zoo model (one seed) is parallelised with ``auto_parallelize`` twice on 2 local ranks
(gloo, TP2, no sequence parallelism): ``once``, the runtime as it is (a region whose column
linears all read its input, ``graph.tp_inputs``, sums their partial input gradients locally and
all-reduces once: Megatron's f), and ``per-column``, the same run with that switched off
(``apply.tensor_parallel.once_input`` patched to "" while it is applied: every
column all-reduces its own input's gradient, as the runtime did before and still does where a
region cannot be prepared once). Both train in the same processes, alternating: ``--warmup``
steps each, then ``--rounds`` rounds of ``--steps`` steps each (the variant going first
alternates every round). A step is ``train_step`` + SGD ``step`` + ``zero_grad`` between two
barriers, its time the maximum over ranks.

Collectives per layer: one ``train_step`` counted (``profiler.step_collectives``) at ``layers``
and ``layers + 1`` layers, the difference; beside it the count the cost model prices for one
block (``LayerCost.collective_counts``). Writes ``results/bench_tp_collectives.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from typing import Dict, List
from unittest import mock

import torch
import torch.distributed as dist

import nest_fx.apply.tensor_parallel as tensor_parallel
from nest_fx.apply import auto_parallelize
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.cluster import Cluster
from nest_fx.graph.tp_inputs import once_input as once
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan
from nest_fx.workload import analytical_workload, dims_from_config
from nest_fx.workload.build import trace_model
from profiler.step_collectives import CollectiveCounter
from _bench_common import print_table, write_json  # next to this script

MODES = ("per-column", "once")


def _with_layers(model: str, layers: int) -> str:
    return re.sub(r"layers=\d+", f"layers={layers}", model)


def _parallel(model_name: str, mode: str, batch: int):
    model, cfg = build_seeded(model_name)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    plan = uniform_plan(cfg.layers + 2, tp=2, microbatch_size=batch, num_microbatches=1)
    with mock.patch.object(
        tensor_parallel, "once_input", lambda kind, pairs: "" if mode == "per-column" else once(kind, pairs)
    ):
        pm = auto_parallelize(model, x, global_batch_size=batch, loss_fn=lm_loss, plan=plan, verbose=False)
    return pm, torch.optim.SGD(pm.parameters(), lr=1e-3), x, cfg.layers


def _counted(pm, x) -> Dict[str, int]:
    pm.train_step(x, x)
    with CollectiveCounter() as counter:
        pm.train_step(x, x)
    return counter.counts


def _timed_step(pm, opt, x) -> float:
    dist.barrier()
    start = time.perf_counter()
    pm.train_step(x, x)
    opt.step()
    opt.zero_grad()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker(args: dict) -> dict:
    torch.set_num_threads(args["threads"])
    out: Dict[str, dict] = {}
    variants = {}
    for mode in MODES:
        pm, opt, x, layers = _parallel(args["model"], mode, args["batch"])
        deeper, _, x1, _ = _parallel(_with_layers(args["model"], layers + 1), mode, args["batch"])
        counts, counts_deeper = _counted(pm, x), _counted(deeper, x1)
        del deeper
        kinds = set(counts) | set(counts_deeper)
        out[mode] = {
            "step_collectives": counts,
            "per_layer": {k: counts_deeper.get(k, 0) - counts.get(k, 0) for k in sorted(kinds)},
            "times": [],
        }
        opt.zero_grad()
        for _ in range(args["warmup"]):
            _timed_step(pm, opt, x)
        variants[mode] = (pm, opt, x)
    for r in range(args["rounds"]):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            pm, opt, x = variants[mode]
            out[mode]["times"] += [_timed_step(pm, opt, x) for _ in range(args["steps"])]
    return out


def priced_per_layer(model: str, batch: int) -> Dict[str, int]:
    """The collectives the cost model prices for one block of ``model`` at TP2, no SP."""
    graph, cfg = trace_model(model, batch=batch, dtype=torch.float32)
    work = analytical_workload(
        graph, dims_from_config(cfg, seq_len=cfg.seq_len), Cluster.preset("cpu-gloo", 2), torch.float32
    )
    block = next(i for i, layer in enumerate(work.layers) if layer.kind == "block")
    return work.cost(block, tp=2, microbatch_size=batch).collective_counts()


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama:hidden=256,layers=4,heads=8,seq=128,vocab=1024")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=os.path.join("results", "bench_tp_collectives.json"))
    a = ap.parse_args(argv)
    args = {k: getattr(a, k) for k in ("model", "batch", "threads", "warmup", "steps", "rounds")}
    r0 = launch(worker, 2, args, timeout=3600)[0]
    priced = priced_per_layer(a.model, a.batch)
    rows = {}
    for mode in MODES:
        times = r0[mode]["times"]
        rows[mode] = {
            "all_reduces_per_layer": r0[mode]["per_layer"].get("all_reduce", 0),
            "collectives_per_layer": r0[mode]["per_layer"],
            "step_collectives": r0[mode]["step_collectives"],
            "median_step_s": statistics.median(times),
            "mean_step_s": statistics.mean(times),
            "steps_timed": len(times),
            "times_s": times,
        }
    print(f"{a.model}, TP2 on 2 gloo ranks x {a.threads} thread(s), batch {a.batch}, {len(times)} timed steps each")
    print_table(
        [
            (
                mode,
                row["all_reduces_per_layer"],
                priced.get("all_reduce", 0),
                f"{row['median_step_s']:.4f}",
                f"{row['mean_step_s']:.4f}",
            )
            for mode, row in rows.items()
        ],
        headers=["inputs prepared", "all-reduces / layer (run)", "priced", "median step s", "mean step s"],
    )
    speedup = rows["per-column"]["median_step_s"] / rows["once"]["median_step_s"]
    print(f"per-column / once median step time: {speedup:.3f}")
    write_json(
        a.out,
        {
            "model": a.model,
            "batch": a.batch,
            "threads": a.threads,
            "tp": 2,
            "priced_per_layer": priced,
            "rows": rows,
            "speedup_median": speedup,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
