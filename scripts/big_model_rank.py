"""One rank of ``bench_big_model.py`` (``run_rank``, launched on every rank): join the memory limit,
start the model on ``meta``, ``auto_parallelize`` it with its weights read from safetensors, train
``STEPS`` SGD steps, export it, and measure each phase's memory, reads and times (the parent
script's docstring, steps 4-6)."""

from __future__ import annotations

import os
import resource
import time
from typing import Dict

import torch

from big_model_memory import (
    Sampler,
    cgroup_peak,
    io_counters,
    join_cgroup,
    memory_now,
    reset_peak,
    set_mmap_threshold,
    status_kib,
    watchdog,
)
from nest_fx.apply.losses import lm_loss
from validate_cpu_rank import _tensor_peak_bytes as tensor_peak_bytes

STEPS, LR = 2, 1e-3
EXPORT_SHARD = "100MB"


def run_rank(spec: dict) -> dict:
    import transformers  # noqa: F401 - imported before the join: part of the process, not of the model

    import nest_fx.apply.api  # noqa: F401

    rank = int(os.environ["RANK"])
    out: Dict[str, object] = {"rank": rank, "limit_kind": spec["limit"]}
    if spec["mmap_threshold"]:
        out["mmap_threshold_set"] = set_mmap_threshold(spec["mmap_threshold"])
    out["at_join"] = memory_now()
    limit = max(0, spec["bound"] - out["at_join"]["rss"]) if spec["bound"] else 0
    out["limit_bytes"] = limit
    cgroup = None
    if limit and spec["limit"] == "cgroup":
        cgroup = out["cgroup_path"] = join_cgroup(f"nestfx-bench-{spec['token']}-rank{rank}", limit)
    elif limit and spec["limit"] == "rlimit":
        resource.setrlimit(resource.RLIMIT_AS, (spec["bound"], spec["bound"]))
    elif limit and spec["limit"] == "watchdog":
        watchdog(spec["bound"])
    t0 = time.perf_counter()
    try:
        _train_and_export(spec, out, t0)
    except BaseException as e:  # noqa: BLE001 - an address-space limit is reported where it failed
        if spec["limit"] != "rlimit":
            raise
        out["failed"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        out["vm_peak_kib"] = status_kib("VmPeak")
        out["rss_kib"] = status_kib("VmRSS")
        return out
    out["cgroup_peak_bytes"] = cgroup_peak(cgroup)
    return out


def _train_and_export(spec: dict, out: dict, t0: float) -> None:
    import torch.distributed as dist

    import nest_fx.apply.prepare as prepare_module
    import nest_fx.apply.steps as steps
    from nest_fx.apply import auto_parallelize
    from nest_fx.models import build_model
    from nest_fx.plan import Plan

    hwm: Dict[str, int] = {}
    marks: Dict[str, Dict[str, int]] = {}
    sampler = Sampler(
        progress=os.path.join(spec["work"], f"rank{os.environ['RANK']}.progress"), cgroup=out.get("cgroup_path")
    )
    sampler.phase = "setup"
    out["peak_reset_works"] = reset_peak()
    timing: Dict[str, float] = {}
    original_trace, original_materialize = prepare_module.trace, steps.materialize

    def traced(*args, **kwargs):
        marks["before_trace"] = memory_now()
        graph = original_trace(*args, **kwargs)
        marks["after_trace"] = memory_now()
        return graph

    def timed_materialize(*args, **kwargs):
        hwm["setup"] = status_kib("VmHWM") * 1024
        marks["before_load"] = memory_now()
        sampler.phase = "load"
        reset_peak()
        io_before = io_counters()
        start = time.perf_counter()
        counts = original_materialize(*args, **kwargs)
        timing["load_s"] = time.perf_counter() - start
        io_after = io_counters()
        timing["rchar"] = io_after.get("rchar", 0) - io_before.get("rchar", 0)
        timing["storage_read_bytes"] = io_after.get("read_bytes", 0) - io_before.get("read_bytes", 0)
        marks["after_load"] = memory_now()
        return counts

    prepare_module.trace, steps.materialize = traced, timed_materialize

    model, _ = build_model(spec["model"], device="meta")
    gen = torch.Generator().manual_seed(1)
    batch, seq = spec["batch"], spec["seq"]
    x = torch.randint(0, spec["vocab"], (batch, seq), generator=gen)
    y = torch.randint(0, spec["vocab"], (batch, seq), generator=gen)
    out["phase"] = "auto_parallelize"
    pm = auto_parallelize(
        model,
        {"input_ids": x},
        global_batch_size=batch,
        loss_fn=lm_loss,
        plan=Plan.from_dict(spec["plan"]),
        weights=spec["weights"],
        verbose=False,
    )
    del model
    t_ready = time.perf_counter()
    hwm["load"] = status_kib("VmHWM") * 1024
    sampler.phase = "train"
    reset_peak()
    local = [p.to_local() if hasattr(p, "to_local") else p for p in pm.parameters()]
    out["param_bytes"] = sum(t.numel() * t.element_size() for t in local)
    out["shard_file_bytes"] = sum(t.numel() for t in local) * 4  # the same elements in the file (fp32)
    del local
    out["bytes_read"] = int(pm.materialized["bytes_read"])
    out.update({k: timing.get(k) for k in ("load_s", "rchar", "storage_read_bytes")})
    out["setup_s"] = t_ready - t0
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses, step_s = [], []

    def one_step() -> None:
        losses.append(float(pm.train_step({"input_ids": x}, y)))
        opt.step()
        opt.zero_grad(set_to_none=True)

    for step in range(STEPS):
        out["phase"] = f"step {step + 1}"
        start = time.perf_counter()
        if step == STEPS - 1 and spec["limit"] != "rlimit":
            # the last step under torch.profiler's memory events: live tensor bytes, without the
            # C allocator's retained pages (what max_memory_allocated reports on a GPU); the
            # profiler's own buffers make its RSS a phase of its own ("profiled step")
            hwm["train"] = status_kib("VmHWM") * 1024
            sampler.phase = "profiled step"
            reset_peak()
            live, rise = tensor_peak_bytes(pm, opt, one_step)
            out["tensor_peak_bytes"] = live + rise
        else:
            one_step()
        step_s.append(time.perf_counter() - start)
        if step == 0:
            out["first_step_end_s"] = time.perf_counter() - t0
    out["profiled_step_rss_bytes"] = status_kib("VmHWM") * 1024
    hwm.setdefault("train", out["profiled_step_rss_bytes"])
    sampler.phase = "export"
    reset_peak()
    out["phase"] = "export"
    start = time.perf_counter()
    pm.save_pretrained(spec["export"], max_shard_size=EXPORT_SHARD, dtype=spec["export_dtype"])
    out["export_s"] = time.perf_counter() - start
    hwm["export"] = status_kib("VmHWM") * 1024
    sampler.phase = "done"
    out["sampled_peaks"] = {k: v for k, v in sampler.report().items() if k not in ("done", "profiled step")}
    out["profiled_step_anon_bytes"] = sampler.report().get("profiled step", {}).get("anon_bytes")
    out["phase"] = "done"
    out["peak_rss_bytes"] = hwm
    out["marks"] = marks
    out["losses"], out["step_s"] = losses, step_s
    # after the measurements: each parameter's float64 sum, for the check of the export: the sum
    # of the rank's shard, summed over the mesh dimensions the parameter is sharded on (nothing
    # gathered: the whole embedding on every rank would not fit the limit)
    sums = {}
    for name, p in sorted(pm.named_parameters(), key=lambda kv: kv[0]):
        local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        total = local.sum(dtype=torch.float64).reshape(1)
        for dim, placement in enumerate(getattr(p, "placements", ())):
            if placement.is_shard():
                dist.all_reduce(total, group=p.device_mesh.get_group(dim))
        sums[name] = float(total)
    out["sums"] = sums if dist.get_rank() == 0 else None
