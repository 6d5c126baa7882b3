"""``profile_model``: measure every distinct op of a model on a device, per TP degree and microbatch.

Only one instance of each distinct block is run: the model is rebuilt with just enough layers
to contain every distinct block signature (``distinct_depth``), and an op signature measured
once is never measured again (identical blocks, and other variants or models that share the
op, reuse the entry). For each TP degree the model is shrunk to one rank's shard
(``nest_fx.workload.localise``) so the ops run at the shapes a TP rank runs.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from nest_fx.workload import dims_from_config, trace_model
from nest_fx.workload.build import traced_seq_len
from nest_fx.workload.localise import LocaliseError, distinct_depth, local_graph
from nest_fx.workload.profile_file import OpEntry, Profile, block_seconds, op_key
from profiler.measure import measure_nodes, measure_step
from profiler.outliers import flag_outliers
from profiler.timer import Timer
import platform

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NOT_OPS = {"placeholder", "output", "get_attr"}


@dataclass
class ProfileOptions:
    """What to profile and how carefully."""

    tps: Sequence[int] = (1,)
    mbss: Sequence[int] = (1,)
    seq: Optional[int] = None
    dtype: str = "fp32"
    warmup: int = 2
    repeats: int = 5
    statistic: str = "median"  # or "min" on a loaded machine
    reuse: bool = True  # False: run the full-depth model and time every node (the benchmark's baseline)
    check_step: bool = True  # also time an eager step of the profiled model (per-op sum check)
    memory_fraction: float = 0.8  # of free GPU memory a variant may plan to use
    seed: int = 0


@dataclass
class ProfileStats:
    """How much work a profile took."""

    nodes_timed: int = 0
    nodes_reused: int = 0
    seconds: float = 0.0
    skipped: List[str] = field(default_factory=list)
    outliers: List[str] = field(default_factory=list)  # profiler.outliers: entries far slower than a larger peer


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def new_profile(device: torch.device, dtype: str) -> Profile:
    return Profile(
        device=device.type,
        device_name=device_description(device),
        dtype=dtype,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda or "",
    )


def _estimated_bytes(graph) -> float:
    """Parameters + gradients + every activation at once: a safe upper bound for the run."""
    g = graph.graph
    params = sum(d.get("param_bytes", 0.0) for _, d in g.nodes(data=True))
    acts = sum(d.get("out_bytes", 0.0) + d.get("saved_bytes", 0.0) for _, d in g.nodes(data=True))
    return 2 * params + acts


def profile_model(
    name: str,
    device: str | torch.device,
    options: Optional[ProfileOptions] = None,
    profile: Optional[Profile] = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> tuple[Profile, ProfileStats]:
    """Measure ``name``'s ops on ``device`` for every (tp, mbs) of ``options``; returns the profile
    (``profile`` extended when given) and the work statistics. Variants that do not fit in GPU
    memory, or TP degrees the model's shapes do not divide, are skipped with a warning."""
    options = options or ProfileOptions()
    device = torch.device(device)
    dtype = _DTYPES[options.dtype]
    profile = profile or new_profile(device, options.dtype)
    timer = Timer(device, options.warmup, options.repeats, statistic=options.statistic)
    stats = ProfileStats()
    start = time.perf_counter()
    full, cfg = trace_model(name, seq=options.seq, dtype=dtype)
    dims = dims_from_config(cfg, seq_len=options.seq or traced_seq_len(full))
    depth = distinct_depth(full) if options.reuse else None
    variants = [(tp, mbs) for tp in options.tps for mbs in options.mbss]
    for k, (tp, mbs) in enumerate(variants):
        label = f"{name} tp={tp} mbs={mbs}"
        if not dims.tp_ok(tp):
            _skip(profile, stats, f"{label}: {dims.tp_problem(tp)}; skipped")
            continue
        try:
            meta_graph, *_ = local_graph(name, tp, mbs, seq=options.seq, dtype=dtype, layers=depth)
        except LocaliseError as exc:
            _skip(profile, stats, f"{label}: {exc}; skipped")
            continue
        need = _estimated_bytes(meta_graph)
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
            if need > options.memory_fraction * free:
                _skip(profile, stats, f"{label}: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free; skipped")
                continue
        todo = _nodes_to_time(meta_graph, profile, options.reuse)
        stats.nodes_reused += sum(
            1 for _, d in meta_graph.graph.nodes(data=True) if d.get("fx_op") not in _NOT_OPS
        ) - len(todo)
        if progress:
            progress(k, len(variants), label)
        torch.manual_seed(options.seed)
        graph, model, args, kwargs = local_graph(
            name, tp, mbs, seq=options.seq, dtype=dtype, layers=depth, device=device
        )
        try:
            measured = measure_nodes(graph.module, args, kwargs, timer, nodes=set(todo))
            step_s = measure_step(model, args, kwargs, timer) if options.check_step else float("nan")
        except RuntimeError as exc:
            if "out of memory" not in str(exc).lower():
                raise
            _skip(profile, stats, f"{label}: out of memory while profiling; skipped")
            del model, graph
            torch.cuda.empty_cache()
            continue
        g = graph.graph
        for node, m in measured.items():
            profile.ops[op_key(g.nodes[node])] = OpEntry(
                op=g.nodes[node]["op"],
                fwd_s=m.fwd_s,
                bwd_s=m.bwd_s,
                peak_bytes=m.peak_bytes,
                flops=g.nodes[node].get("flops", 0.0),
                skipped=m.skipped,
                fwd_host_s=m.fwd_host_s,
                bwd_host_s=m.bwd_host_s,
            )
            if m.skipped:
                _skip(
                    profile,
                    stats,
                    f"{label}: op {node} ({g.nodes[node]['op']}) {m.skipped}; the analytical model covers it",
                )
        stats.nodes_timed += len(measured)
        profile.blocks += _block_records(name, graph, profile, tp, mbs, step_s, device)
        del model, graph
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if progress:
        progress(len(variants), len(variants), "done")
    stats.outliers = flag_outliers(profile)
    stats.seconds = time.perf_counter() - start
    return profile, stats


def _skip(profile: Profile, stats: ProfileStats, message: str) -> None:
    warnings.warn(message, stacklevel=3)
    profile.warnings.append(message)
    stats.skipped.append(message)


def _nodes_to_time(graph, profile: Profile, reuse: bool) -> List[str]:
    todo, keys = [], set()
    for n, d in graph.graph.nodes(data=True):
        if d.get("fx_op") in _NOT_OPS:
            continue
        key = op_key(d)
        if reuse and (key in keys or profile.lookup(key) is not None):
            continue
        keys.add(key)
        todo.append(n)
    return todo


def _block_records(name: str, graph, profile: Profile, tp: int, mbs: int, step_s: float, device) -> List[dict]:
    """Per-block sums of the op entries, and the whole profiled model's per-op sum vs its eager step."""
    records = []
    total = 0.0
    for b in graph.blocks:
        entries = [e for e in (profile.lookup(op_key(graph.graph.nodes[n])) for n in b.nodes) if e is not None]
        fwd, bwd = block_seconds([(e.fwd_s, e.bwd_s) for e in entries], [e.host for e in entries])
        total += fwd + bwd
        records.append(
            dict(
                model=name,
                block=b.name,
                kind=b.kind,
                signature=b.signature,
                tp=tp,
                mbs=mbs,
                fwd_s=fwd,
                bwd_s=bwd,
                flops=b.flops,
            )
        )
    records.append(
        dict(
            model=name,
            block="<step>",
            kind="step",
            tp=tp,
            mbs=mbs,
            ops_sum_s=total,
            eager_step_s=step_s,
            layers=len(graph.layer_blocks),
        )
    )
    return records
