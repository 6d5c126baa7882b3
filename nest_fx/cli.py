"""``nest-fx`` command line: trace, profile, plan, simulate, explain, export.

User errors (bad names, bad files, shapes that do not fit) print one line ``error: ...`` and
exit with code 2; no traceback. ``NEST_FX_DEBUG=1`` shows the traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Callable, List, Optional

import torch
from tqdm import tqdm

from nest_fx.apply.checkpoint import read_meta as read_checkpoint_meta, resolve as resolve_checkpoint
from nest_fx.apply.distributed import init_distributed
from nest_fx.apply.export_hf import export_checkpoint
from nest_fx.cluster import Cluster, GraphCluster, cluster_spec, load_cluster
from nest_fx.cluster.topology import from_cluster, save_topology
from nest_fx.common.errors import NestFxError
from nest_fx.common.fileio import one_line
from nest_fx.common.limits import MAX_COUNT
from nest_fx.cost.step_time import simulate
from nest_fx.graph import trace
from nest_fx.models import build_any, build_model
from nest_fx.plan import Plan
from nest_fx.report import explain
from nest_fx.report import tables as report
from nest_fx.report.layout import placement_lines
from nest_fx.plan.constraints import ConstraintError, Constraints, parse_assignments, parse_fraction, parse_list
from nest_fx.plan.vocabulary import OPTIMIZER_NAMES
from nest_fx.solver import NoFeasiblePlan, SolverOptions
from nest_fx.solver.baselines import run_baselines
from nest_fx.solver.constraints import constrained_options, cost_options, solve_constrained
from nest_fx.workload import Profile, load_workload, workload_for_model
from profiler.collectives import calibrate
from profiler.model_profile import ProfileOptions, profile_model
from profiler.pairwise import calibrate_pairwise

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


MODEL_HELP = ("zoo name (llama2-7b, ...), spec (gpt:hidden=..,layers=..), plain model (mlp:.., cnn:..), any "
              "transformers architecture as hf:<model_type>[:field=value,...] (its default config shrunk to a tiny "
              "model; e.g. hf:qwen2:hidden_size=64,num_hidden_layers=2, hf:t5, hf:vit, hf:mixtral-8x7b), or "
              "hf-config:PATH[:field=value,...] for a local config.json")


class UserError(NestFxError):
    """A mistake on the command line itself (a missing or conflicting option, an unwritable
    output); printed like every other :class:`NestFxError`."""


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}: use one of {sorted(DTYPES)}")
    return DTYPES[name]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{value} is larger than nest-fx handles (at most {MAX_COUNT:,})")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def _write(path: str, save: Callable[[str], None]) -> None:
    """``save(path)``, with an unwritable path (no such directory, a directory, no permission) as
    a UserError."""
    try:
        save(path)
    except OSError as exc:
        raise UserError(f"cannot write {path!r}: {exc.strerror or exc}") from exc


def _dump_json(data: object, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)


def cmd_trace(args: argparse.Namespace) -> int:
    """Trace a model on meta tensors and print a per-block table."""
    model, cfg, margs, mkwargs = build_any(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype)
    start = time.perf_counter()
    graph = trace(model, margs, mkwargs, method=args.method, leaf_modules=args.leaf or (), name=args.model)
    seconds = time.perf_counter() - start
    print(report.trace_table(graph, seconds, compact=not args.all_blocks))
    if args.json:
        summary = graph.summary()
        summary["trace_seconds"] = seconds
        _write(args.json, lambda path: _dump_json(summary, path))
        print(f"wrote {args.json}")
    return 0


def _load_workload(args: argparse.Namespace, cluster):
    if bool(args.model) == bool(args.workload):
        raise UserError("give exactly one of --model NAME or --workload FILE")
    if args.workload:
        return load_workload(args.workload)
    return workload_for_model(args.model, cluster, seq=args.seq, dtype=args.dtype, profile=getattr(args, "profile", None))


def _load_cluster(args: argparse.Namespace):
    return load_cluster(args.cluster, args.devices)


def _simulate_file(path: str, plan: Plan, workload, cluster):
    """``simulate`` of a plan file under the cost options its constraints record (optimizer,
    memory headroom), its errors (the plan does not fit this model, cluster or layer table)
    prefixed with the file's name."""
    try:
        return simulate(plan, workload, cluster, cost_options(plan.constraints))
    except NestFxError as exc:
        raise UserError(f"{path}: {exc}") from exc


def _with_runtime_switches(plan: Plan, args: argparse.Namespace) -> Plan:
    """``plan`` with torch.compile / Float8 switched on where ``--compile`` / ``--float8`` ask
    (what the plan would cost with them; the file itself is left as it is)."""
    changes = {flag: True for flag in ("compile", "float8") if getattr(args, flag)}
    return dataclasses.replace(plan, **changes) if changes else plan


def cmd_simulate(args: argparse.Namespace) -> int:
    """Predict step time and memory of a plan file."""
    plan = _with_runtime_switches(Plan.load(args.plan), args)
    cluster = _load_cluster(args)
    workload = _load_workload(args, cluster)
    result = _simulate_file(args.plan, plan, workload, cluster)
    print(report.sim_tables(result, plan, workload))
    if args.json:
        _write(args.json, lambda path: _dump_json({"plan": plan.to_dict(), "result": result.to_dict()}, path))
        print(f"wrote {args.json}")
    return 0 if result.feasible else 1


def _constraints(args: argparse.Namespace) -> Constraints:
    """The constraints given on the ``plan`` command line (``--fix``, ``--max``, ``--schedule``, ...)."""
    data: dict = {kind: parse_assignments(getattr(args, kind) or "", kind) for kind in ("fix", "min", "max")}
    for flag in ("compile", "float8"):  # --compile / --float8: shorthands for --fix compile=true, float8=true
        if getattr(args, flag):
            data["fix"][flag] = True
    for degree in ("tp", "pp"):
        value = getattr(args, f"max_{degree}")
        if value is not None:
            data["max"][degree] = value
    for name, flag in (("schedules", "schedule"), ("recompute", "recompute"), ("placements", "placement")):
        if getattr(args, flag) is not None:
            data[name] = parse_list(getattr(args, flag), f"--{flag}")
    for name, flag in (("microbatch_sizes", "microbatch"), ("zero_stages", "zero")):
        if getattr(args, flag) is not None:
            data[name] = parse_list(getattr(args, flag), f"--{flag}", integers=True)
    if args.memory_headroom is not None:
        data["memory_headroom"] = parse_fraction(args.memory_headroom)
    data["optimizer"] = args.optimizer  # recorded in the plan: simulate costs the same optimizer
    try:
        return Constraints(**data)
    except ConstraintError as exc:  # name the flag rather than the file form's path
        raise UserError(f"constraint {exc}") from None


def cmd_plan(args: argparse.Namespace) -> int:
    """Search the best plan within the constraints, compare it with the baselines, write the plan file."""
    cluster = _load_cluster(args)
    workload = _load_workload(args, cluster)
    constraints = _constraints(args)
    options = SolverOptions(time_budget=args.time_budget)
    bar = tqdm(desc="planning", unit="config", disable=args.quiet or not sys.stderr.isatty(), leave=False)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    start = time.perf_counter()  # --time-budget covers the search and the baselines
    try:
        found = solve_constrained(workload, cluster, args.global_batch, constraints, options, progress=progress)
    except NoFeasiblePlan as exc:
        raise UserError(f"no plan fits: {exc}") from exc
    finally:
        bar.close()
    plan, result = found.plan, found.result
    levels = " > ".join(f"{lv.name} {lv.group_size} @ {fmt_rate(lv.bandwidth)}" for lv in cluster.levels)
    print(f"model {workload.model} ({len(workload)} layers, {report.fmt_si(workload.num_params)} params; "
          f"{workload.provenance}) on {cluster.name}: {cluster.num_devices} x {cluster.device.name} "
          f"[{levels}]; global batch {args.global_batch} x {workload.dims.seq_len} tokens")
    print(f"constraints: {constraints.describe()}")
    coverage = getattr(workload.source, "coverage", None)
    if coverage is not None:
        tp = plan.uniform_tp or 1
        print(f"compute time of the chosen variant (tp={tp}, microbatch {plan.microbatch_size}): "
              f"{100 * coverage(tp, plan.microbatch_size, plan.sequence_parallel):.0f}% measured, the rest modelled")
    what = "(config, depth, device order) triples" if len(found.placements) > 1 else "(config, depth) pairs"
    print(f"searched {found.candidates} {what}, {found.dp_runs} exact DP runs in "
          f"{found.seconds:.2f} s" + ("" if found.complete else " (time budget reached: best plan so far)"))
    if len(found.placements) > 1 or plan.device_order is not None:  # a graph topology: which devices
        print("\n".join(placement_lines(plan, cluster, found.placement, [p.name for p in found.placements])))
    print()
    print(report.stages_table(plan, workload, result))
    print()
    print(report.sim_tables(result, plan, workload))
    if not args.no_baselines:
        print()
        searched = constrained_options(options, constraints, workload, cluster, args.global_batch)
        baselines = run_baselines(workload, cluster, args.global_batch, searched, args.mcmc_evals,
                                  deadline=start + args.time_budget)
        print(report.baselines_table(found, found.seconds, baselines))
    if args.json:
        plan.cluster = cluster_spec(args.cluster, cluster)
        _write(args.json, plan.save)
        print(f"wrote {args.json}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """Explain a plan file: rank layout per network level, memory, step time, pipeline timeline."""
    plan = Plan.load(args.plan)
    args.cluster, args.devices = explain.default_cluster(plan, args.cluster, args.devices)
    if not args.model and not args.workload:
        args.model = explain.default_model(plan)
        if not args.model:
            raise UserError(f"the plan's model {plan.model!r} is not a zoo model or spec: give --model or --workload")
    cluster = _load_cluster(args)
    workload = _load_workload(args, cluster)
    result = _simulate_file(args.plan, plan, workload, cluster)
    print(explain.explain_text(plan, workload, cluster, result, cost_options(plan.constraints)))
    if args.png:
        try:
            shown = explain.write_timeline_png(plan, cluster, result, args.png)
        except OSError as exc:  # an unwritable path
            raise UserError(f"cannot write {args.png!r}: {exc.strerror or exc}") from exc
        print(f"wrote {args.png} (timeline of {shown} microbatches)")
    return 0 if result.feasible else 1


def cmd_export(args: argparse.Namespace) -> int:
    """Write a nest-fx checkpoint's model in the HuggingFace format (no training script needed)."""
    source, _ = resolve_checkpoint(os.path.abspath(args.checkpoint))
    spec = args.model or ((read_checkpoint_meta(source).get("plan") or {}).get("model") or "")
    if not spec:
        raise UserError(f"{source} does not record which model it holds (its plan has no model spec): give "
                        "--model SPEC (e.g. hf:qwen2:..., hf-config:PATH/config.json)")
    model = build_model(spec, device="meta")[0]  # names, shapes and the HF config only: no weights
    out = export_checkpoint(source, args.directory, model, args.max_shard_size, overwrite=args.overwrite,
                            dtype=args.dtype, verify=not args.no_verify)
    files = sorted(os.listdir(out))
    print(f"exported {source} ({spec}) to {out}: {', '.join(files)}")
    return 0


def _int_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure per-op times of a model on a device (or collectives, with --calibrate)."""
    if args.calibrate:
        return _calibrate(args)
    if args.pairwise:
        raise UserError("--pairwise goes with --calibrate: nest-fx profile --calibrate --pairwise --out topo.yaml")
    if not args.model:
        raise UserError("give a MODEL to profile (or --calibrate --cluster C to measure collectives)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible here; run on a GPU node or use --device cpu")
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[args.dtype]
    options = ProfileOptions(tps=args.tp, mbss=args.mbs, seq=args.seq, dtype=dtype, warmup=args.warmup,
                             repeats=args.repeats)
    existing = None
    if args.append and os.path.exists(args.out):
        existing = Profile.load(args.out)
    bar = tqdm(desc="profiling", unit="variant", disable=args.quiet or not sys.stderr.isatty(), leave=False)

    def progress(done: int, total: int, label: str) -> None:
        bar.total = total
        bar.set_postfix_str(label)
        bar.update(done - bar.n)

    try:
        prof, stats = profile_model(args.model, args.device, options, profile=existing, progress=progress)
    finally:
        bar.close()
    _write(args.out, prof.save)
    print(report.profile_table(prof, args.model))
    print(f"timed {stats.nodes_timed} ops, reused {stats.nodes_reused} (identical blocks / earlier entries) "
          f"in {stats.seconds:.1f} s; {len(stats.skipped)} variant(s)/op(s) skipped")
    print(f"wrote {args.out} ({len(prof.ops)} op entries, {prof.device_name}, {prof.dtype})")
    return 0


def _calibrate_pairwise(args: argparse.Namespace) -> int:
    """Measure p2p between every pair of ranks and write a graph topology (--pairwise)."""
    if not args.out.endswith((".yaml", ".yml", ".json")):
        raise UserError(f"--out {args.out}: --pairwise writes a topology file: end it in .yaml, .yml or .json")
    base = device = None
    if args.cluster:  # the structure to derate: a topology, or a hierarchical cluster as a graph
        cluster = _load_cluster(args)
        base = cluster.topology if isinstance(cluster, GraphCluster) else from_cluster(cluster)
    elif torch.cuda.is_available():
        raise UserError("--pairwise on GPUs needs --cluster (the topology or cluster whose device and links "
                        "the measurements derate)")
    else:
        device = Cluster.preset("cpu-gloo", 1).device
    if "WORLD_SIZE" in os.environ:  # under torchrun: the launched world measures itself
        init_distributed()
    topo, fits, samples = calibrate_pairwise(nproc=args.nproc, sizes=[s * 1024 for s in args.sizes_kib],
                                             base=base, device=device, repeats=args.repeats)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return 0
    print(report.pairwise_table(fits, base))
    save_topology(topo, args.out)
    print(f"wrote {args.out} ({len(fits)} pairs, {len(samples)} samples; format nest-fx-topology/1)")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    if args.pairwise:
        return _calibrate_pairwise(args)
    if not args.cluster:
        raise UserError("--calibrate needs --cluster (a preset NAME:DEVICES or a file) whose levels to fit")
    cluster = _load_cluster(args)
    sizes = [s * 1024 for s in args.sizes_kib]
    fitted, fits, samples = calibrate(cluster, nproc=args.nproc, sizes=sizes, repeats=args.repeats)
    print(report.calibration_table(cluster, fits))
    fitted.save(args.out)
    print(f"wrote {args.out} ({len(samples)} samples)")
    return 0


def fmt_rate(bytes_per_s: float) -> str:
    return report.fmt_si(bytes_per_s, "B/s")


def _add_model_args(p: argparse.ArgumentParser, cluster_required: bool = True) -> None:
    p.add_argument("--model", help=MODEL_HELP + " (traced and costed analytically)")
    p.add_argument("--workload", metavar="FILE", help="a nest-fx-workload/1 layer table instead of --model")
    p.add_argument("--cluster", required=cluster_required, help="preset (dgx-a100, dgx-h100, h100-spine-leaf, "
                   "tpuv4-fat-tree, cpu-gloo) as NAME:DEVICES, a cluster or topology YAML/JSON file, or a "
                   "topology generator: rail:NODES[xGPUS][,group=N,spines=S,oversub=R], "
                   "fat-tree:NODES[xGPUS][,leaf=N,spines=S,oversub=R], torus:AxB[xC] (docs/topology.md)")
    p.add_argument("--devices", type=_positive, help="device count for a preset (or NAME:DEVICES)")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length (default: the model's)")
    p.add_argument("--dtype", type=_dtype, default=torch.bfloat16, help="training dtype (default bf16)")
    p.add_argument("--profile", metavar="P.json", help="measured op times from `nest-fx profile` (the analytical "
                   "model covers ops the profile lacks)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nest-fx", description="Trace, cost and plan hybrid parallelism for PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("trace", help="trace a model on meta tensors; per-block table")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--batch", type=_positive, default=1, help="batch size of the example input (default 1)")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length (default: the model's)")
    p.add_argument("--dtype", type=_dtype, default=torch.bfloat16, help="parameter/activation dtype (default bf16)")
    p.add_argument("--method", choices=("auto", "fx", "export"), default="auto", help="tracer (default auto)")
    p.add_argument("--leaf", action="append", metavar="FQN", help="treat this module as one op (repeatable)")
    p.add_argument("--all-blocks", action="store_true", help="one row per layer instead of grouping identical ones")
    p.add_argument("--json", metavar="FILE", help="write the OpGraph summary as JSON")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("plan", help="search the fastest plan that fits (NEST DP) and compare with baselines")
    _add_model_args(p)
    p.add_argument("--global-batch", type=_positive, default=4096, help="sequences per step (default 4096)")
    p.add_argument("--json", metavar="PLAN.json", help="write the plan (format nest-fx-plan/1)")
    p.add_argument("--time-budget", type=_seconds, default=60.0, help="seconds for the search and the baselines: "
                   "the best plan so far is returned when they run out, and the baselines stop with theirs (default 60)")
    p.add_argument("--no-baselines", action="store_true", help="skip the Megatron/torchtitan/Phaze/MCMC comparison")
    c = p.add_argument_group("constraints", "what the plan must satisfy (recorded in the plan file; "
                             "docs/solver.md#constraints)")
    c.add_argument("--optimizer", choices=OPTIMIZER_NAMES, default="adam",
                   help="the optimizer trained with: its state bytes and update traffic are costed (default adam; "
                   "sgd is PyTorch's SGD without momentum)")
    c.add_argument("--fix", metavar="K=V[,K=V]", help="fix degrees or flags: tp, pp, dp, ep, cp, dp_shard; "
                   "sequence_parallel, loss_parallel, compile, float8 (e.g. --fix tp=8,pp=16; --fix pp=1: no pipeline)")
    c.add_argument("--min", metavar="K=V[,K=V]", help="lower bounds on degrees (e.g. --min dp=8)")
    c.add_argument("--max", metavar="K=V[,K=V]", help="upper bounds on degrees (e.g. --max tp=4,pp=8)")
    c.add_argument("--max-tp", type=_positive, help="shorthand for --max tp=N")
    c.add_argument("--max-pp", type=_positive, help="shorthand for --max pp=N")
    c.add_argument("--schedule", metavar="S[,S]", help="pipeline schedules allowed: 1f1b, gpipe, interleaved "
                   "(the planner's interleave factors) or interleaved:V")
    c.add_argument("--recompute", metavar="R[,R]", help="recompute modes allowed per stage: none, full, every:K "
                   "(every K-th block), op (torchtitan's op-level selective checkpointing), op:POLICY, selective "
                   "(attention core only); default: all of them, those never better in time and memory dropped")
    c.add_argument("--compile", action="store_true", help="cost torch.compile on every block (fused elementwise "
                   "ops, fewer launches; docs/cost_model.md); shorthand for --fix compile=true")
    c.add_argument("--float8", action="store_true", help="cost Float8 linears (fp8 GEMM rate, casts, fp8 weight "
                   "all-gather; docs/cost_model.md); shorthand for --fix float8=true")
    c.add_argument("--microbatch", metavar="B[,B]", help="microbatch sizes allowed (e.g. 2)")
    c.add_argument("--zero", metavar="Z[,Z]", help="ZeRO stages allowed (e.g. 3)")
    c.add_argument("--placement", metavar="P[,P]", help="rank placements allowed: stage-major, replica-major")
    c.add_argument("--memory-headroom", metavar="F", help="device memory to leave unused, a fraction or a "
                   "percentage (default 0.05: the CUDA context and allocator fragmentation), e.g. 0.1 or 10%%")
    p.add_argument("--mcmc-evals", type=_positive, default=2000, help="MCMC baseline evaluations (default 2000)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("profile", help="measure per-op times of a model on this machine's device (JSON profile), "
                       "or collective bandwidth per network level (--calibrate, cluster YAML)")
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--out", required=True, help="profile JSON (or cluster YAML with --calibrate)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device to profile on (default: cuda when available)")
    p.add_argument("--tp", type=_int_list, default=[1], help="TP degrees whose local shard shapes to profile, e.g. 1,2,4,8")
    p.add_argument("--mbs", type=_int_list, default=[1], help="microbatch sizes to profile, e.g. 1,2,4")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length (default: the model's)")
    p.add_argument("--dtype", type=_dtype, default=torch.bfloat16, help="dtype (default bf16)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per op (default 2)")
    p.add_argument("--repeats", type=_positive, default=5, help="timed runs per op; the median is kept (default 5)")
    p.add_argument("--append", action="store_true", help="add to an existing profile at --out (reuse its entries)")
    p.add_argument("--calibrate", action="store_true", help="measure collectives and fit the cluster's levels")
    p.add_argument("--pairwise", action="store_true", help="with --calibrate: measure p2p bandwidth and latency "
                   "between every pair of ranks and write a graph topology (nest-fx-topology/1) to --out; "
                   "with --cluster its routes are derated to the measurements, without it the ranks get direct links")
    p.add_argument("--cluster", help="with --calibrate: the cluster to fit (NAME:DEVICES or file)")
    p.add_argument("--devices", type=_positive, help="device count for a preset")
    p.add_argument("--nproc", type=_positive, default=2, help="with --calibrate outside torchrun: local ranks (default 2)")
    p.add_argument("--sizes-kib", type=_int_list, default=[4, 64, 1024, 4096, 16384],
                   help="with --calibrate: message sizes in KiB (default 4,64,1024,4096,16384)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("simulate", help="predict step time and memory of a plan file")
    p.add_argument("--plan", required=True, metavar="PLAN.json", help="a nest-fx-plan/1 file")
    _add_model_args(p)
    p.add_argument("--json", metavar="FILE", help="write the prediction as JSON")
    p.add_argument("--compile", action="store_true", help="cost the plan with torch.compile on (as if plan.compile "
                   "were true; the file is not changed)")
    p.add_argument("--float8", action="store_true", help="cost the plan with Float8 linears (as if plan.float8 were "
                   "true; the file is not changed)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("explain", help="a plan in words: rank layout per network level, memory bars, "
                       "step-time breakdown, pipeline timeline (PNG)")
    p.add_argument("plan", metavar="PLAN.json", help="a nest-fx-plan/1 file")
    _add_model_args(p, cluster_required=False)
    p.add_argument("--png", metavar="OUT.png", help="draw the pipeline timeline (needs matplotlib: extra 'plot')")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("export", help="write a checkpoint's model as HuggingFace safetensors shards, their index and "
                       "config.json (transformers from_pretrained loads the directory)")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory (its newest checkpoint) or a step "
                   "directory")
    p.add_argument("--to", choices=("hf",), required=True, help="the format (hf: HuggingFace safetensors)")
    p.add_argument("directory", metavar="DIR", help="where to write; must not exist or be empty (see --overwrite)")
    p.add_argument("--model", help="the model the checkpoint holds (default: the spec its plan recorded); "
                   + MODEL_HELP)
    p.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors file: 5GB (default), 500MiB, ...")
    p.add_argument("--dtype", type=_dtype, default=None, help="write floating tensors in this dtype (default: as "
                   "saved)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty DIR as a whole")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint's files "
                   "(sizes are still checked)")
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except NestFxError as exc:
        if os.environ.get("NEST_FX_DEBUG"):
            raise
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
