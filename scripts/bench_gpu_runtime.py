#!/usr/bin/env python
"""nest-fx's own runtime on one GPU against the cost model's price of the same plan.

    torchrun --standalone --nproc_per_node=1 scripts/bench_gpu_runtime.py --out results/gpu
    torchrun --standalone --nproc_per_node=1 scripts/bench_gpu_runtime.py --smoke --out /tmp/r   # CPU, tiny

The zoo Llama with Llama 3 8B's layer shape (hidden 4096, 32 heads, 8 KV heads, FFN 14,336; 2 layers,
32K vocabulary, 8,192 tokens, one sequence per step) is parallelised with ``auto_parallelize`` under a
given one-device plan (bf16-mixed, no recompute) once per SDPA attention kernel
(``plan.attention_kernel``: '' = cuDNN, flash, then '' again: a later call must not hold more
memory), then with ``compile`` (on CUDA), and trained with AdamW: ``--warmup`` steps, then
``--steps`` timed steps (``train_step`` + ``step`` + ``zero_grad``, CUDA-synchronised). Recorded
per run: the median step time, the peak allocated and reserved memory, and the cost model's step
time and peak memory for the same plan on the measured device's preset (``simulate``). Writes
``<out>/bench_gpu_runtime.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

from nest_fx.apply import auto_parallelize
from nest_fx.apply.losses import lm_loss
from nest_fx.cluster import load_cluster
from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import simulate
from nest_fx.models.zoo import build_model
from nest_fx.plan import Plan, StagePlan
from nest_fx.workload import workload_for_model

from _bench_common import write_json

GiB = 2**30


def one_kernel(spec: str, seq: int, kernel: str, args, device: torch.device, cluster, compile: bool = False) -> dict:
    """Train ``spec`` under a one-device plan pinning ``kernel`` (and compiling each block when
    ``compile``); measured and priced figures."""
    torch.manual_seed(0)
    model, cfg = build_model(spec, device=device)
    work = workload_for_model(spec, cluster, seq=seq)
    plan = Plan(
        stages=[StagePlan(0, len(work), 1, "none")],
        num_layers=len(work),
        precision="bf16-mixed" if device.type == "cuda" else "fp32",
        attention_kernel=kernel,
        compile=compile,
    )
    priced = simulate(plan, work, cluster, CostOptions(optimizer="adamw"))
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), device=device)
    pm = auto_parallelize(model, tokens, global_batch_size=1, loss_fn=lm_loss, plan=plan, verbose=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def step():
        loss = pm.train_step(tokens, tokens)
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(args.warmup):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    row = dict(
        attention_kernel=kernel or "(default)",
        compile=compile,
        layers_in_workload=len(work),
        blocks=cfg.layers,
        measured_step_s=statistics.median(times),
        priced_step_s=priced.step_s,
        loss=float(loss),
    )
    row["step_err_pct"] = 100 * (row["priced_step_s"] / row["measured_step_s"] - 1)
    if device.type == "cuda":
        row["measured_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        row["measured_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
        row["priced_total_gib"] = priced.stages[0].memory["total"] / GiB
        row["priced_reserved_gib"] = priced.peak_reserved / GiB
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/gpu")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cluster", default="", help="the device's preset (default: dgx-h200:1 or dgx-h100:1)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        spec, seq = "llama:hidden=4096,layers=2,heads=32,kv=8,ffn=14336,seq=8192,vocab=32000", 8192
        name = torch.cuda.get_device_name(device)
        cluster = load_cluster(args.cluster or ("dgx-h200:1" if "H200" in name else "dgx-h100:1"))
    else:
        spec, seq = "llama:hidden=64,layers=2,heads=4,kv=2,ffn=128,seq=64,vocab=128", 64
        name, cluster = "cpu", load_cluster(args.cluster or "cpu-gloo:1")
    # the default kernel again last: a later run in the same process may differ (allocator state)
    rows = []
    for kernel, compile in (("", False), ("flash", False), ("", False), ("", True)):
        if compile and not cuda:
            continue  # inductor on CPU takes minutes; the smoke run checks the eager path
        rows.append(one_kernel(spec, seq, kernel, args, device, cluster, compile))
        gc.collect()  # the previous model's cycles (module hooks) before the next one allocates
        if cuda:
            torch.cuda.empty_cache()
    for row in rows:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    for label, i in (("flash", 1), ("compile", 3)):
        if i < len(rows):
            ratio_measured = rows[i]["measured_step_s"] / rows[0]["measured_step_s"]
            ratio_priced = rows[i]["priced_step_s"] / rows[0]["priced_step_s"]
            print(f"{label} / default: measured {ratio_measured:.3f}x, priced {ratio_priced:.3f}x")
    write_json(
        os.path.join(args.out, "bench_gpu_runtime.json"),
        dict(device=name, model=spec, seq=seq, cluster=cluster.name, rows=rows),
    )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
