#!/usr/bin/env python
"""Activation memory and step time of ``bf16-mixed`` against ``fp32``, side by side, on CPU.

    python scripts/bench_precision.py                      # llama hidden=256, 4 layers, seq 256, batch 8
    python scripts/bench_precision.py --world 2 --plan '{"dp": 2, "microbatch_size": 4}'
    python scripts/bench_precision.py --model gpt:hidden=256,layers=4,heads=8,seq=256,vocab=4096

The same zoo model (one seed) is parallelised with ``auto_parallelize`` twice on each of
``--world`` local ranks (gloo, one thread per rank unless ``--threads``), once per precision
(``plan.precision``), and the two are trained in the same processes, alternating: ``--warmup``
steps each, then ``--rounds`` rounds of ``--steps`` steps each (the variant going first
alternates every round). A step is ``train_step`` + AdamW ``step`` + ``zero_grad`` between two
barriers, its time the maximum over ranks.

Activation memory: the bytes autograd saves for backward during one ``train_step``
(``torch.autograd.graph.saved_tensors_hooks``; each storage counted once), split into
activations and weights (a parameter, or its bf16 cast: a ``ToCopy`` node fed by the
parameter's ``AccumulateGrad``), on rank 0. This is what the cost model's activation term
(``nest_fx/cost/memory.py``) prices; ``bf16-mixed`` also saves the bf16 copy of each weight a
layer uses, which FSDP2 holds as its unsharded parameter. Reported per precision: median and
mean step time, activation and weight bytes saved, the ratios bf16-mixed / fp32, and the final
losses. Writes ``results/bench_precision.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from nest_fx.apply import auto_parallelize
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan
from _bench_common import write_json  # next to this script

PRECISIONS = ("fp32", "bf16-mixed")


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, or the bf16 cast of one (what bf16-mixed's forward sees), or a view of either."""
    t = t._base if t._base is not None else t
    if t.grad_fn is None:
        return t.requires_grad
    fn = t.grad_fn
    return type(fn).__name__ == "ToCopyBackward0" and any(
        n is not None and type(n).__name__ == "AccumulateGrad" for n, _ in fn.next_functions
    )


def saved_bytes(pm, x: torch.Tensor) -> Dict[str, int]:
    """Bytes autograd saves for backward in one ``train_step(x, x)``: activations (also by dtype)
    and weights."""
    seen, out = set(), {"activations": 0, "weights": 0, "activations_by_dtype": {}}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            kind = "weights" if _is_weight(t) else "activations"
            out[kind] += storage.nbytes()
            if kind == "activations":
                by = out["activations_by_dtype"]
                by[str(t.dtype)] = by.get(str(t.dtype), 0) + storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.train_step(x, x)
    return out


def _timed_step(pm, opt, x) -> float:
    dist.barrier()
    start = time.perf_counter()
    loss = pm.train_step(x, x)
    opt.step()
    opt.zero_grad()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    pm.last_loss = float(loss)
    return float(t)


def worker(args: dict) -> dict:
    torch.set_num_threads(args["threads"])
    variants = {}
    for precision in PRECISIONS:
        model, cfg = build_seeded(args["model"])
        x = torch.randint(0, cfg.vocab_size, (args["batch"], cfg.seq_len), generator=torch.Generator().manual_seed(0))
        plan = uniform_plan(cfg.layers + 2, precision=precision, **args["plan"])
        pm = auto_parallelize(model, x, global_batch_size=args["batch"], loss_fn=lm_loss, plan=plan, verbose=False)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        variants[precision] = (pm, opt, x)
    out: Dict[str, dict] = {}
    for precision, (pm, opt, x) in variants.items():
        out[precision] = {"saved": saved_bytes(pm, x), "times": []}
        opt.zero_grad()
        for _ in range(args["warmup"]):
            _timed_step(pm, opt, x)
    for r in range(args["rounds"]):
        order = PRECISIONS if r % 2 == 0 else PRECISIONS[::-1]
        for precision in order:
            pm, opt, x = variants[precision]
            out[precision]["times"] += [_timed_step(pm, opt, x) for _ in range(args["steps"])]
    for precision, (pm, _, _) in variants.items():
        out[precision]["final_loss"] = pm.last_loss
    return out


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama:hidden=256,layers=4,heads=8,seq=256,vocab=4096")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--plan", default="{}", help="uniform_plan kwargs as JSON (default: one rank, batch in one step)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=os.path.join("results", "bench_precision.json"))
    a = ap.parse_args(argv)
    plan = json.loads(a.plan) or {"dp": a.world, "microbatch_size": a.batch // a.world}
    args = {
        "model": a.model,
        "plan": plan,
        "batch": a.batch,
        "threads": a.threads,
        "warmup": a.warmup,
        "steps": a.steps,
        "rounds": a.rounds,
    }
    per_rank = launch(worker, a.world, args, timeout=3600)
    r0 = per_rank[0]
    rows = {}
    for precision in PRECISIONS:
        times = r0[precision]["times"]
        rows[precision] = {
            "median_step_s": statistics.median(times),
            "mean_step_s": statistics.mean(times),
            "steps_timed": len(times),
            "activation_bytes": r0[precision]["saved"]["activations"],
            "weight_bytes_saved": r0[precision]["saved"]["weights"],
            "activation_bytes_by_dtype": r0[precision]["saved"]["activations_by_dtype"],
            "final_loss": r0[precision]["final_loss"],
            "times_s": times,
        }
    fp32, mixed = rows["fp32"], rows["bf16-mixed"]
    ratios = {
        "activation_bytes": mixed["activation_bytes"] / fp32["activation_bytes"],
        "median_step_s": mixed["median_step_s"] / fp32["median_step_s"],
    }
    print(
        f"{a.model}, plan {plan}, batch {a.batch}, {a.world} rank(s) x {a.threads} thread(s), "
        f"{len(fp32['times_s'])} timed steps each"
    )
    print(
        f"{'precision':<12}{'median step s':>15}{'mean step s':>13}{'activations MiB':>17}"
        f"{'weights saved MiB':>19}{'final loss':>12}"
    )
    for precision, row in rows.items():
        print(
            f"{precision:<12}{row['median_step_s']:>15.4f}{row['mean_step_s']:>13.4f}"
            f"{row['activation_bytes'] / 2**20:>17.2f}{row['weight_bytes_saved'] / 2**20:>19.2f}"
            f"{row['final_loss']:>12.4f}"
        )
    for precision, row in rows.items():
        print(
            f"{precision} activations by dtype (MiB): "
            + ", ".join(
                f"{k.removeprefix('torch.')} {v / 2**20:.2f}"
                for k, v in sorted(row["activation_bytes_by_dtype"].items())
            )
        )
    print(
        f"bf16-mixed / fp32: activations {ratios['activation_bytes']:.3f}, median step time "
        f"{ratios['median_step_s']:.3f}"
    )
    write_json(
        a.out,
        {
            "model": a.model,
            "plan": plan,
            "batch": a.batch,
            "world": a.world,
            "threads": a.threads,
            "rows": rows,
            "ratios": ratios,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
