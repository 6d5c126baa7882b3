#!/usr/bin/env python
"""The optimizer step on a GPU under each ``optimizer_kernel``: time and scratch measured, against
what the cost model prices (``nest_fx/cost/optimizers.py``).

    python scripts/bench_optimizer_kernels.py            # CUDA only; writes results/gpu/bench_optimizer_kernels_h100.json

AdamW (torch's defaults but lr 1e-4) over 64 fp32 parameters of 4096 x 4096 (1.07 G parameters,
a block stack's square projections), run as the for-loop (``foreach=False``), foreach, fused and
torch's default ('': neither given). Per implementation: the median of 10 steps after 3 warm-up
steps, the step's time as bytes per parameter at the device's datasheet bandwidth (``--bandwidth``,
H100 SXM: 3.35 TB/s), and the most memory the step allocated beyond what was allocated before it
(``torch.cuda.max_memory_allocated``) per parameter and per element of the largest tensor. The
prediction is ``update_bytes / optimizer_mem_efficiency`` bytes per parameter and
``optimizer_step_bytes`` of scratch. docs/cost_model.md, "Optimizer step", gives the figures.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

from nest_fx.cost.memory import optimizer_step_bytes
from nest_fx.cost.optimizers import resolved_kernel, step_cost
from nest_fx.cost.options import CostOptions

from _bench_common import print_table, write_json

KERNELS = (("for-loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True}), ("", {}))


def measure(tensors: int, side: int, bandwidth: float) -> dict:
    """Each implementation's step time and scratch (module docstring)."""
    params = [torch.nn.Parameter(torch.randn(side, side, device="cuda")) for _ in range(tensors)]
    n, largest = tensors * side * side, side * side
    out = {"default_fused_foreach": list(_default_to_fused_or_foreach(params, False, use_fused=False))}
    for name, arguments in KERNELS:
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, **arguments)
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            start = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        t = sorted(times)[len(times) // 2]
        extra = torch.cuda.max_memory_allocated() - base
        out[name] = {
            "ms": t * 1e3,
            "bytes_per_param_at_bandwidth": t * bandwidth / n,
            "scratch_B_per_param": extra / n,
            "scratch_B_per_largest": extra / largest,
        }
        del opt
        torch.cuda.empty_cache()
    return out


def predicted(tensors: int, side: int) -> dict:
    """What the cost model prices for the same step on a GPU (AdamW)."""
    n, largest = tensors * side * side, side * side
    efficiency = CostOptions().optimizer_mem_efficiency
    out = {}
    for name, _ in KERNELS:
        kernel = resolved_kernel(name)  # no device: a GPU's
        out[name] = {
            "bytes_per_param_at_bandwidth": step_cost("adamw", kernel).update_bytes / efficiency,
            "scratch_B_per_param": optimizer_step_bytes(n, "adamw", kernel, largest) / n,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--side", type=int, default=4096)
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM datasheet)")
    ap.add_argument("--out", default="results/gpu/bench_optimizer_kernels_h100.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs CUDA (the implementations differ on a GPU; on a CPU torch's default is the for-loop)")
    measured = measure(args.tensors, args.side, args.bandwidth)
    model = predicted(args.tensors, args.side)
    rows = [
        (
            repr(name),
            f"{measured[name]['ms']:.1f}",
            f"{measured[name]['bytes_per_param_at_bandwidth']:.1f}",
            f"{model[name]['bytes_per_param_at_bandwidth']:.1f}",
            f"{measured[name]['scratch_B_per_param']:.2f}",
            f"{model[name]['scratch_B_per_param']:.2f}",
        )
        for name, _ in KERNELS
    ]
    print_table(rows, headers=["kernel", "ms", "B/param measured", "priced", "scratch B/param", "priced"])
    write_json(args.out, {"device": torch.cuda.get_device_name(), "measured": measured, "predicted": model})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
