#!/usr/bin/env python
"""nest-fx's own runtime on one GPU against the cost model's price of the same plan.

    torchrun --standalone --nproc_per_node=1 scripts/bench_gpu_runtime.py --out results/gpu
    torchrun --standalone --nproc_per_node=1 scripts/bench_gpu_runtime.py --smoke --out /tmp/r   # CPU, tiny

The zoo Llama with Llama 3 8B's layer shape (hidden 4096, 32 heads, 8 KV heads, FFN 14,336; 2 layers,
32K vocabulary, 8,192 tokens, one sequence per step) is parallelised with ``auto_parallelize`` under a
given one-device plan (bf16-mixed, no recompute) once per SDPA attention kernel
(``plan.attention_kernel``: '' = cuDNN, flash, then '' again: a later call must not hold more
memory), then with ``compile`` (on CUDA), and trained with AdamW: ``--warmup`` steps, then
``--steps`` timed steps (``train_step`` + ``step`` + ``zero_grad``, CUDA-synchronised). Two more
rows: AdamW with ``fused=True`` (the optimizer step timed apart in every row: torch's foreach
default against the fused kernel), and the same model with 6 blocks (the allocator's
reserved-to-allocated ratio on a fuller device). Recorded per run: the median step time and
optimizer step time, the peak allocated and reserved memory, and the cost model's step time and
peak memory for the same plan on the measured device's preset (``simulate``). Writes
``<out>/bench_gpu_runtime<tag>.json``; run it once as is and once under
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True --tag _expandable --rows default fused deep``
to compare the caching allocator's two segment modes (``docs/cost_model.md``, "Memory the
allocator sees").
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
from nest_fx.apply.allocator import configured_expandable
from nest_fx.apply.losses import lm_loss
from nest_fx.cluster import load_cluster
from nest_fx.cost.memory import live_bytes
from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import simulate
from nest_fx.models.zoo import build_model
from nest_fx.plan import Plan, StagePlan
from nest_fx.plan.constraints import Constraints
from nest_fx.workload import workload_for_model

from _bench_common import write_json

GiB = 2**30
# run label: (attention kernel, compile, fused AdamW, blocks, vocabulary, recompute, microbatches);
# the default kernel again after flash: a later run in the same process must not hold more memory
ROWS = {
    "default": ("", False, False, 2, 32000, "none", 1),
    "flash": ("flash", False, False, 2, 32000, "none", 1),
    "default-again": ("", False, False, 2, 32000, "none", 1),
    "compile": ("", True, False, 2, 32000, "none", 1),
    "fused": ("", False, True, 2, 32000, "none", 1),
    "deep": ("", False, False, 6, 32000, "none", 1),
    "deeper": ("", False, False, 10, 32000, "none", 1),
    "vocab128k": ("", False, False, 6, 128256, "none", 1),  # Llama 3's vocabulary: 4x the logits
    "recompute": ("", False, False, 6, 128256, "full", 1),
    "accumulate": ("", False, False, 6, 32000, "none", 4),  # 4 microbatches of 8,192 tokens
}


def allocator_segments() -> str:
    """The segment mode this process runs: the environment's where it names one (read as the
    runtime reads it), else the one the runtime turns on (expandable)."""
    return "fixed" if configured_expandable(os.environ) is False else "expandable"


def one_kernel(
    spec: str,
    seq: int,
    kernel: str,
    args,
    device: torch.device,
    cluster,
    compile: bool = False,
    fused: bool = False,
    recompute: str = "none",
    microbatches: int = 1,
) -> dict:
    """Train ``spec`` under a one-device plan pinning ``kernel`` (and compiling each block when
    ``compile``; AdamW's fused kernel when ``fused``; ``recompute``; ``microbatches`` sequences
    a step, one per microbatch); measured and priced figures."""
    torch.manual_seed(0)
    model, cfg = build_model(spec, device=device)
    work = workload_for_model(spec, cluster, seq=seq)
    plan = Plan(
        stages=[StagePlan(0, len(work), 1, recompute)],
        num_layers=len(work),
        num_microbatches=microbatches,
        constraints=Constraints(allocator_segments=allocator_segments()),
        precision="bf16-mixed" if device.type == "cuda" else "fp32",
        attention_kernel=kernel,
        compile=compile,
    )
    options = CostOptions(optimizer="adamw", allocator_segments=allocator_segments())
    priced = simulate(plan, work, cluster, options)
    tokens = torch.randint(0, cfg.vocab_size, (microbatches, seq), device=device)
    pm = auto_parallelize(model, tokens, global_batch_size=microbatches, loss_fn=lm_loss, plan=plan, verbose=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, **({"fused": True} if fused else {}))
    opt_times = []

    def step():
        loss = pm.train_step(tokens, tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        opt_times.append(time.perf_counter() - start)
        opt.zero_grad()
        return loss

    for _ in range(args.warmup):
        step()
    times, opt_times[:] = [], []
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
        optimizer="adamw fused" if fused else "adamw (torch default)",
        recompute=recompute,
        microbatches=microbatches,
        allocator_segments=allocator_segments(),
        layers_in_workload=len(work),
        blocks=cfg.layers,
        params=sum(p.numel() for p in pm.parameters()),
        measured_step_s=statistics.median(times),
        measured_optimizer_step_s=statistics.median(opt_times),
        priced_step_s=priced.step_s,
        loss=float(loss),
    )
    row["step_err_pct"] = 100 * (row["priced_step_s"] / row["measured_step_s"] - 1)
    if device.type == "cuda":
        row["measured_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        row["measured_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
        row["priced_total_gib"] = live_bytes(priced.stages[0].memory) / GiB
        row["priced_reserved_gib"] = priced.peak_reserved / GiB
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/gpu")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cluster", default="", help="the device's preset (default: dgx-h200:1 or dgx-h100:1)")
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS), help="which runs (default all)")
    parser.add_argument("--tag", default="", help="suffix of the JSON's name (e.g. _expandable)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        spec, seq = "llama:hidden=4096,layers={layers},heads=32,kv=8,ffn=14336,seq=8192,vocab={vocab}", 8192
        name = torch.cuda.get_device_name(device)
        cluster = load_cluster(args.cluster or ("dgx-h200:1" if "H200" in name else "dgx-h100:1"))
    else:
        spec, seq = "llama:hidden=64,layers={layers},heads=4,kv=2,ffn=128,seq=64,vocab={vocab}", 64
        name, cluster = "cpu", load_cluster(args.cluster or "cpu-gloo:1")
    rows = []
    for label in args.rows:
        kernel, compile, fused, layers, vocab, recompute, microbatches = ROWS[label]
        if compile and not cuda:
            continue  # inductor on CPU takes minutes; the smoke run checks the eager path
        rows.append(
            dict(
                row=label,
                **one_kernel(
                    spec.format(layers=layers, vocab=vocab if cuda else 128),
                    seq,
                    kernel,
                    args,
                    device,
                    cluster,
                    compile,
                    fused,
                    recompute,
                    microbatches,
                ),
            )
        )
        gc.collect()  # the previous model's cycles (module hooks) before the next one allocates
        if cuda:
            torch.cuda.empty_cache()
    for row in rows:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    first = next((r for r in rows if r["row"] == "default"), None)
    for row in rows:
        if first is not None and row["row"] in ("flash", "compile", "fused"):
            ratio_measured = row["measured_step_s"] / first["measured_step_s"]
            ratio_priced = row["priced_step_s"] / first["priced_step_s"]
            print(f"{row['row']} / default: measured {ratio_measured:.3f}x, priced {ratio_priced:.3f}x")
    write_json(
        os.path.join(args.out, f"bench_gpu_runtime{args.tag}.json"),
        dict(
            device=name,
            model=spec,
            seq=seq,
            cluster=cluster.name,
            allocator_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", "")),
            rows=rows,
        ),
    )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
