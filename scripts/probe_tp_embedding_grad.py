#!/usr/bin/env python
"""Where the live tensors of a TP training step exceed the cost model's single-microbatch peak.

    python scripts/probe_tp_embedding_grad.py     # about a minute on 2 cores

A zoo Llama (hidden 1024, 4 layers, vocabulary 32000) in ``bf16-true``, one SGD step measured
with ``torch.profiler``'s memory events (live tensors before the step and their highest rise
during it): in one process with plain PyTorch, under nest-fx with tp=1, and under nest-fx with
tp=4. For one microbatch the cost model puts the peak at the parameters plus the larger of all
gradients and all activations (here the gradients). The script also lists the operators that
allocated 30 MiB or more on rank 0 under tp=4. Writes ``results/probe_tp_embedding_grad.json``.
"""

from __future__ import annotations

import os
import sys

import torch

from _bench_common import write_json
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from validate_cpu import _tensor_peak_bytes as tensor_peak_bytes

SPEC = "llama:hidden=1024,layers=4,heads=16,kv=4,seq=32,vocab=32000,ffn=2752"
MiB = 2**20
BIG = 30 * MiB


def _data():
    gen = torch.Generator().manual_seed(1)
    return (torch.randint(0, 32000, (4, 32), generator=gen), torch.randint(0, 32000, (4, 32), generator=gen))


def plain() -> dict:
    """One process, no nest-fx: the model in bf16, SGD."""
    from nest_fx.models import build_model

    model, _ = build_model(SPEC, device="cpu")
    model = model.to(torch.bfloat16)
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        lm_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    live, rise = tensor_peak_bytes(model, opt, step)
    return {"params_mib": live / MiB, "rise_mib": rise / MiB}


def _chain(event, depth: int = 5) -> str:
    """The operator and its callers, innermost first (``aten::empty < aten::zeros < ...``)."""
    names = []
    while event is not None and len(names) < depth:
        names.append(event.name)
        event = event.cpu_parent
    return " < ".join(names)


def parallel() -> dict:
    """nest-fx on meta, bf16-true, tp = the world size."""
    from torch.profiler import ProfilerActivity, profile

    from nest_fx.apply import auto_parallelize
    from nest_fx.models import build_model
    from nest_fx.plan import uniform_plan

    x, y = _data()
    model, _ = build_model(SPEC, device="meta")
    tp = int(os.environ["WORLD_SIZE"])
    pm = auto_parallelize(
        model,
        x,
        global_batch_size=4,
        loss_fn=lm_loss,
        verbose=False,
        plan=uniform_plan(6, tp=tp, microbatch_size=4, precision="bf16-true"),
    )
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)

    def step() -> None:
        pm.train_step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    live, rise = tensor_peak_bytes(pm, opt, step)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        step()
    big = sorted(
        {
            (_chain(e), round(e.cpu_memory_usage / MiB, 1))
            for e in prof.events()
            if e.cpu_memory_usage >= BIG and e.cpu_memory_usage - sum(c.cpu_memory_usage for c in e.cpu_children) >= BIG
        }
    )
    return {"params_mib": live / MiB, "rise_mib": rise / MiB, "allocations_of_30_mib_or_more": big}


def main() -> int:
    rows = {
        "plain, 1 process": plain(),
        "nest-fx tp=1": launch(parallel, 1, timeout=600)[0],
        "nest-fx tp=4 (rank 0)": launch(parallel, 4, timeout=600)[0],
    }
    for name, r in rows.items():
        print(
            f"{name}: parameters {r['params_mib']:.1f} MiB, rise during the step {r['rise_mib']:.1f} MiB "
            f"(gradients: {r['params_mib']:.1f} MiB; excess {r['rise_mib'] - r['params_mib']:.1f} MiB)"
        )
        for op in r.get("allocations_of_30_mib_or_more", []):
            print(f"    {op[1]} MiB: {op[0]}")
    write_json("results/probe_tp_embedding_grad.json", {"model": SPEC, "precision": "bf16-true", "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
