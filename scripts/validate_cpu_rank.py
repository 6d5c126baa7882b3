"""One rank of ``validate_cpu.py``'s measurements (``run_plan``, launched on every rank): build the
model, parallelise it with the plan, train, and measure the step time and the peak of live tensor
bytes in a step (``_tensor_peak_bytes``: ``torch.profiler``'s memory events, the CPU counterpart of
``torch.cuda.max_memory_allocated``; ``bench_big_model.py`` uses it too)."""

from __future__ import annotations

import statistics
import time
from typing import Tuple

import torch

from nest_fx.plan import Plan


MEMORY_STEPS = 5  # profiled steps per plan; the peak is their median


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def run_plan(spec: dict) -> dict:
    """One rank: build, parallelise, train; returns step times (when ``spec["steps"]`` > 0) and
    peak memory in bytes (live tensors, and the resident-set high-water mark for reference)."""
    import torch.distributed as dist

    from nest_fx.apply import auto_parallelize
    from nest_fx.apply.distributed import init_distributed
    from nest_fx.apply.losses import lm_loss
    from nest_fx.models import build_seeded

    init_distributed()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the high-water mark
    except OSError:
        pass
    base = _rss_kib("VmRSS")
    model, cfg = build_seeded(spec["model"], seed=0)
    plan = Plan.from_dict(spec["plan"])
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.seq_len), generator=gen)
    pm = auto_parallelize(model, x, global_batch_size=spec["batch"], loss_fn=lm_loss, plan=plan, verbose=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def step():
        pm.train_step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for k in range(spec["steps"] + 2):
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if k >= 2:
            times.append(float(elapsed))
    rss_peak = torch.tensor([(_rss_kib("VmHWM") - base) * 1024.0], dtype=torch.float64)
    dist.all_reduce(rss_peak, op=dist.ReduceOp.MAX)
    if not spec.get("memory", True):
        return {"step_s": statistics.median(times), "times": times}
    # The peak moves from step to step by up to ~20% here: gloo collectives run on their own
    # threads and free their buffers when they finish, sometimes after the step's peak. The
    # median of several steps is the figure; the spread is kept.
    peaks = [sum(_tensor_peak_bytes(pm, opt, step)) for _ in range(MEMORY_STEPS)]
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, peaks)
    medians = [statistics.median(p) for p in per_rank]
    return {
        "step_s": statistics.median(times) if times else None,
        "times": times,
        "peak_bytes": max(medians),
        "peak_per_rank": medians,
        "peak_range": [min(min(p) for p in per_rank), max(max(p) for p in per_rank)],
        "rss_peak_bytes": float(rss_peak),
    }


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _tensor_peak_bytes(pm, opt, step) -> Tuple[float, float]:
    """Peak bytes of live tensors over one training step: the parameters and optimizer states
    alive before it, plus the highest point of the CPU allocator's allocations minus frees
    during it (``torch.profiler`` memory events). The CPU counterpart of
    ``torch.cuda.max_memory_allocated``; RSS would add the C allocator's retained pages.
    Returns (live bytes before the step, highest rise during it)."""
    from torch.profiler import ProfilerActivity, profile

    live = sum(_local_bytes(p) for p in pm.parameters())
    live += sum(
        _local_bytes(v)
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = highest = 0
    for _, nbytes in events:
        current += nbytes
        highest = max(highest, current)
    return float(live), float(highest)
