"""Human-readable tables and unit formatting shared by the CLI commands."""

from __future__ import annotations

from typing import List

from tabulate import tabulate

from nest_fx.cluster.topology.routing import router_of
from nest_fx.graph.opgraph import Block, OpGraph
from nest_fx.cost.error_bands import ErrorBand, within_error
from nest_fx.plan.vocabulary import CHUNKED_SCHEDULES
from nest_fx.solver.baseline_result import best_baseline


def fmt_bytes(n: float) -> str:
    """Bytes in binary units: 1.50 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_si(n: float, unit: str = "") -> str:
    """Decimal SI prefixes: 6.74 G, 312 TFLOP."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _pairs_text(graph: OpGraph, block: Block) -> str:
    pattern = graph.pattern_of(block)
    parts = []
    experts = [p for p in pattern.tp_pairs if p.kind == "expert"]
    for p in pattern.tp_pairs:
        if p.kind != "expert":
            cols = ",".join(c.rsplit(".", 1)[-1] for c in p.column)
            parts.append(f"{p.kind}: {cols}->{p.row.rsplit('.', 1)[-1]}")
    if experts:
        p = experts[0]
        cols = ",".join(c.rsplit(".", 1)[-1] for c in p.column)
        parts.append(f"experts x{len(experts)}: {cols}->{p.row.rsplit('.', 1)[-1]}")
    if pattern.routers:
        parts.append("router: " + ",".join(pattern.routers))
    whole = [block.rel(m) for m in (graph.replicated_attention or {}) if block.rel(m) != m]
    if whole:  # attention TP leaves whole on every rank (graph.tp_mha)
        parts.append("whole under TP: " + ",".join(whole))
    return "; ".join(parts) if parts else "-"


def _grouped(blocks: List[Block]) -> List[List[Block]]:
    """Runs of consecutive blocks with equal signatures."""
    runs: List[List[Block]] = []
    for b in blocks:
        if runs and runs[-1][0].signature == b.signature and b.kind == "block":
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


def trace_table(graph: OpGraph, seconds: float, compact: bool = True) -> str:
    """Per-block table (params, forward FLOPs, saved activations, boundary bytes, TP pairs)."""
    rows = []
    runs = _grouped(graph.blocks) if compact else [[b] for b in graph.blocks]
    for run in runs:
        b = run[0]
        name = b.name if len(run) == 1 else f"{b.name} .. {run[-1].name.rsplit('.', 1)[-1]}"
        rows.append(
            [
                name,
                b.kind + (" (MoE)" if b.is_moe else ""),
                len(run),
                fmt_si(b.num_params),
                fmt_si(b.flops, "FLOP"),
                fmt_bytes(b.saved_bytes),
                fmt_bytes(b.out_bytes),
                _pairs_text(graph, b) if b.kind == "block" else "-",
            ]
        )
    total_saved = sum(b.saved_bytes for b in graph.blocks)
    rows.append(
        [
            "total",
            "",
            len(graph.blocks),
            fmt_si(graph.num_params),
            fmt_si(graph.total_flops, "FLOP"),
            fmt_bytes(total_saved),
            "",
            "",
        ]
    )
    headers = [
        "block",
        "kind",
        "count",
        "params (each)",
        "fwd FLOPs (each)",
        "saved act. (each)",
        "boundary out",
        "tensor-parallel pairs",
    ]
    distinct = len(graph.distinct_blocks())
    head = (
        f"{graph.model_name}: {len(graph)} ops traced with {graph.method} in {fmt_seconds(seconds)}; "
        f"input {graph.input_shapes}; {len(graph.layer_blocks)} layers under '{graph.block_container}', "
        f"{distinct} distinct"
    )
    return head + "\n" + tabulate(rows, headers=headers, tablefmt="simple")


def sim_tables(result, plan, workload) -> str:
    """Step-time breakdown and per-stage memory of a simulated plan."""
    b = result.breakdown
    step = b["step"]
    rows = [[k, fmt_seconds(v), f"{100 * v / step:.1f}%"] for k, v in b.items() if k != "step"]
    rows.append(["step", fmt_seconds(step), "100%"])
    head = (
        f"plan: {plan_summary(plan)}; {result.devices_used}/{result.world_size} devices; "
        f"global batch {plan.global_batch}"
    )
    perf = (
        f"throughput {fmt_si(result.tokens_per_s)} tokens/s; model {fmt_si(result.model_flops_per_device, 'FLOP/s')} "
        f"per device ({fmt_si(result.hardware_flops_per_device, 'FLOP/s')} with recompute); step time error band "
        f"{ErrorBand(result.error_band, result.error_basis or 'not recorded').text()}"
    )
    # the runtime's working sets get a column when some stage has them (docs/cost_model.md)
    terms = ["weights", "grads", "optimizer", "activations", "buffers"]
    terms += [
        k
        for k in ("fsdp_unsharded", "optimizer_step", "allocator_cache")
        if any(st.memory.get(k, 0) for st in result.stages)
    ]
    names = {
        "buffers": "p2p buffers",
        "fsdp_unsharded": "FSDP unsharded",
        "optimizer_step": "opt. scratch",
        "allocator_cache": "alloc. cache",
    }
    mem_rows = []
    for s in result.stages:
        m = s.memory
        mem_rows.append(
            [s.index, f"{s.layers[0]}-{s.layers[1] - 1}", s.tp, s.recompute]
            + [fmt_bytes(m.get(k, 0.0)) for k in terms]
            + [fmt_bytes(m["total"]), fmt_bytes(s.reserved), "yes" if s.fits else f"NO ({s.binding})"]
        )
    status = "feasible" if result.feasible else f"INFEASIBLE: {result.binding}"
    return "\n".join(
        [
            head,
            perf,
            status,
            "",
            tabulate(rows, headers=["term", "time", "share"], tablefmt="simple"),
            "",
            tabulate(
                mem_rows,
                headers=["stage", "layers", "tp", "recompute"]
                + [names.get(k, k) for k in terms]
                + ["total", "reserved", "fits"],
                tablefmt="simple",
            ),
        ]
    )


def plan_summary(plan) -> str:
    """One line: the mesh and global options of a plan."""
    tp = plan.uniform_tp if plan.uniform_tp is not None else [s.tp for s in plan.stages]
    extra = f" v={plan.virtual_stages}" if plan.schedule in CHUNKED_SCHEDULES else ""
    modes = sorted({s.recompute for s in plan.stages})
    flags = [
        name
        for name, on in (
            ("sp", plan.sequence_parallel),
            ("loss-parallel", plan.loss_parallel),
            ("compile", plan.compile),
            ("float8", plan.float8),
            ("pp-shard-grads", plan.pp_shard_grads and plan.pp > 1 and plan.zero >= 2),
        )
        if on
    ]
    return (
        f"pp={plan.pp} dp={plan.dp} tp={tp}"
        + (f" cp={plan.cp}" if plan.cp > 1 else "")
        + (f" ep={plan.ep}" if plan.ep > 1 else "")
        + f" zero={plan.zero}"
        + (f" hsdp={plan.shard_degree}x{plan.replicate_degree}" if plan.replicate_degree > 1 else "")
        + f" mbs={plan.microbatch_size} m={plan.num_microbatches} {plan.schedule}{extra}"
        + "".join(f" {f}" for f in flags)
        + (f" {plan.precision}" if plan.precision else "")
        + (f" kernels={plan.kernels}" if plan.kernels else "")
        + (f" norm_kernel={plan.norm_kernel}" if plan.norm_kernel else "")
        + (f" loss_kernel={plan.loss_kernel}" if plan.loss_kernel else "")
        + f" {plan.placement}"
        + (f" rc={'/'.join(modes)}" if modes != ["none"] else "")
    )


def stages_table(plan, workload, result) -> str:
    """Stages with their layer names, recompute and memory per device."""
    rows = []
    for s, sc in zip(plan.stages, result.stages):
        first, last = workload.layers[s.start].name, workload.layers[s.end - 1].name
        rows.append(
            [
                sc.index,
                f"[{s.start}, {s.end})",
                first if s.end - s.start == 1 else f"{first} .. {last}",
                s.tp,
                s.recompute,
                fmt_seconds(sc.per_microbatch(plan.virtual_stages)),
                fmt_bytes(sc.memory["total"]),
            ]
        )
    return tabulate(
        rows,
        headers=["stage", "layers", "names", "tp", "recompute", "time / microbatch", "memory / device"],
        tablefmt="simple",
    )


def baselines_table(nest, nest_seconds: float, baselines) -> str:
    """NEST's plan next to each baseline with speedup ratios (baseline step / NEST step), then
    the speedup over the best baseline and the notes of baselines run other than as written."""
    rows = [
        [
            "nest-fx (DP)",
            plan_summary(nest.plan),
            fmt_seconds(nest.result.step_s),
            fmt_si(nest.result.tokens_per_s),
            "1.00x",
            f"{nest_seconds:.2f}",
        ]
    ]
    notes = []
    for b in baselines:
        name = b.name + (f" [{len(notes) + 1}]" if b.notes else "")
        if b.notes:
            notes.append(f"[{len(notes) + 1}] {b.name}: {b.notes}")
        if b.result is None:
            rows.append([name, "no feasible plan", "-", "-", "-", f"{b.seconds:.2f}"])
            continue
        rows.append(
            [
                name,
                plan_summary(b.plan),
                fmt_seconds(b.result.step_s),
                fmt_si(b.result.tokens_per_s),
                f"{b.result.step_s / nest.result.step_s:.2f}x",
                f"{b.seconds:.2f}",
            ]
        )
    lines = [
        tabulate(
            rows, headers=["planner", "plan", "step", "tokens/s", "nest-fx speedup", "search s"], tablefmt="simple"
        )
    ]
    best = best_baseline(baselines)
    if best is not None:
        gain = best.result.step_s / nest.result.step_s
        lines.append(f"speedup over the best baseline ({best.name}): {gain:.2f}x")
        band = ErrorBand(nest.result.error_band, nest.result.error_basis or "not recorded")
        if within_error(gain, band):
            lines.append(f"within the model's error ({band.text()}): measure both")
    return "\n".join(lines + notes)


def profile_table(profile, model: str) -> str:
    """Per-block measured forward/backward per (tp, microbatch), and the per-op sum vs eager step."""
    rows = []
    for b in profile.blocks:
        if b.get("model") != model:
            continue
        if b["kind"] == "step":
            eager = b.get("eager_step_s", float("nan"))
            ratio = b["ops_sum_s"] / eager if eager == eager and eager > 0 else float("nan")
            rows.append(
                [
                    f"(whole {b['layers']}-layer model)",
                    b["tp"],
                    b["mbs"],
                    "",
                    "",
                    fmt_seconds(b["ops_sum_s"]),
                    "-" if eager != eager else f"{fmt_seconds(eager)} ({ratio:.2f}x)",
                ]
            )
        else:
            rows.append(
                [
                    b["block"],
                    b["tp"],
                    b["mbs"],
                    fmt_seconds(b["fwd_s"]),
                    fmt_seconds(b["bwd_s"]),
                    fmt_seconds(b["fwd_s"] + b["bwd_s"]),
                    "",
                ]
            )
    return tabulate(
        rows, headers=["block", "tp", "mbs", "fwd", "bwd", "sum of ops", "eager step (ops/eager)"], tablefmt="simple"
    )


def pairwise_table(fits, base=None) -> str:
    """Fitted bandwidth/latency per measured rank pair, next to the base topology's route alone."""
    rows = []
    for f in fits:
        row = [
            f"{f.src} - {f.dst}",
            fmt_si(f.bandwidth, "B/s"),
            fmt_seconds(f.latency),
            f.samples,
            f"{100 * f.mean_abs_error:.0f}%",
        ]
        if base is not None:
            route = router_of(base).route(f.src, f.dst)
            row[1:1] = [fmt_si(route.bandwidth, "B/s")]
            row[3:3] = [fmt_seconds(route.latency)]
        rows.append(row)
    headers = ["pair", "bandwidth (fit)", "latency (fit)", "samples", "mean |error|"]
    if base is not None:
        headers = [
            "pair",
            "bandwidth (model)",
            "bandwidth (fit)",
            "latency (model)",
            "latency (fit)",
            "samples",
            "mean |error|",
        ]
    return tabulate(rows, headers=headers, tablefmt="simple")


def calibration_table(cluster, fits) -> str:
    """Fitted bandwidth/latency per measured level next to the cluster's previous figures."""
    before = {lv.name: lv for lv in cluster.levels}
    rows = [
        [
            f.level,
            fmt_si(before[f.level].bandwidth, "B/s"),
            fmt_si(f.bandwidth, "B/s"),
            fmt_seconds(before[f.level].latency),
            fmt_seconds(f.latency),
            f.samples,
            f"{100 * f.mean_abs_error:.0f}%",
        ]
        for f in fits
    ]
    return tabulate(
        rows,
        headers=[
            "level",
            "bandwidth (was)",
            "bandwidth (fit)",
            "latency (was)",
            "latency (fit)",
            "samples",
            "mean |error|",
        ],
        tablefmt="simple",
    )
