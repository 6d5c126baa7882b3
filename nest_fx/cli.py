"""``nest-fx`` command line: trace (later: profile, plan, simulate, explain).

User errors (bad names, bad files, shapes that do not fit) print one line ``error: ...`` and
exit with code 2; no traceback. ``NEST_FX_DEBUG=1`` shows the traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional

import torch

from nest_fx import report

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


class UserError(Exception):
    """A mistake in what the user asked for; printed without a traceback, exit code 2."""


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
    return value


def cmd_trace(args: argparse.Namespace) -> int:
    """Trace a model on meta tensors and print a per-block table."""
    from nest_fx.graph import TraceError, trace
    from nest_fx.models import build_any

    try:
        model, cfg, margs, mkwargs = build_any(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype)
    except (ValueError, ImportError) as exc:
        raise UserError(str(exc)) from exc
    start = time.perf_counter()
    try:
        graph = trace(model, margs, mkwargs, method=args.method, leaf_modules=args.leaf or (), name=args.model)
    except TraceError as exc:
        raise UserError(str(exc)) from exc
    seconds = time.perf_counter() - start
    print(report.trace_table(graph, seconds, compact=not args.all_blocks))
    if args.json:
        summary = graph.summary()
        summary["trace_seconds"] = seconds
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


def _load_workload(args: argparse.Namespace, cluster):
    from nest_fx.builders import workload_for_model
    from nest_fx.graph import TraceError
    from nest_fx.workload import Workload, WorkloadError

    if bool(args.model) == bool(args.workload):
        raise UserError("give exactly one of --model NAME or --workload FILE")
    try:
        if args.workload:
            return Workload.load(args.workload)
        return workload_for_model(args.model, cluster, seq=args.seq, dtype=args.dtype)
    except (WorkloadError, TraceError, ValueError, ImportError) as exc:
        raise UserError(str(exc)) from exc


def _load_cluster(args: argparse.Namespace):
    from nest_fx.builders import load_cluster

    try:
        return load_cluster(args.cluster, args.devices)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc


def cmd_simulate(args: argparse.Namespace) -> int:
    """Predict step time and memory of a plan file."""
    from nest_fx.cost.step_time import simulate
    from nest_fx.plan import Plan, PlanError

    try:
        plan = Plan.load(args.plan)
    except PlanError as exc:
        raise UserError(str(exc)) from exc
    cluster = _load_cluster(args)
    workload = _load_workload(args, cluster)
    try:
        result = simulate(plan, workload, cluster)
    except PlanError as exc:
        raise UserError(f"{args.plan}: {exc}") from exc
    print(report.sim_tables(result, plan, workload))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"plan": plan.to_dict(), "result": result.to_dict()}, fh, indent=2)
        print(f"wrote {args.json}")
    return 0 if result.feasible else 1


def cmd_plan(args: argparse.Namespace) -> int:
    """Search the best plan, compare it with the baselines, write the plan file."""
    from tqdm import tqdm

    from nest_fx.solver import NoFeasiblePlan, SolverOptions, solve
    from nest_fx.solver.baselines import run_baselines

    cluster = _load_cluster(args)
    workload = _load_workload(args, cluster)
    options = SolverOptions(time_budget=args.time_budget)
    bar = tqdm(desc="planning", unit="config", disable=args.quiet or not sys.stderr.isatty(), leave=False)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        found = solve(workload, cluster, args.global_batch, options, progress=progress)
    except NoFeasiblePlan as exc:
        raise UserError(f"no plan fits: {exc}") from exc
    finally:
        bar.close()
    plan, result = found.plan, found.result
    levels = " > ".join(f"{lv.name} {lv.group_size} @ {fmt_rate(lv.bandwidth)}" for lv in cluster.levels)
    print(f"model {workload.model} ({len(workload)} layers, {report.fmt_si(workload.num_params)} params; "
          f"{workload.provenance}) on {cluster.name}: {cluster.num_devices} x {cluster.device.name} "
          f"[{levels}]; global batch {args.global_batch} x {workload.dims.seq_len} tokens")
    print(f"searched {found.candidates} (config, depth) pairs, {found.dp_runs} exact DP runs in "
          f"{found.seconds:.2f} s" + ("" if found.complete else " (time budget reached: best plan so far)"))
    print()
    print(report.stages_table(plan, workload, result))
    print()
    print(report.sim_tables(result, plan, workload))
    if not args.no_baselines:
        print()
        baselines = run_baselines(workload, cluster, args.global_batch, options, args.mcmc_evals)
        print(report.baselines_table(found, found.seconds, baselines))
    if args.json:
        plan.save(args.json)
        print(f"wrote {args.json}")
    return 0


def fmt_rate(bytes_per_s: float) -> str:
    return report.fmt_si(bytes_per_s, "B/s")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="zoo name, spec or hf:FAMILY (traced and costed analytically)")
    p.add_argument("--workload", metavar="FILE", help="a nest-fx-workload/1 layer table instead of --model")
    p.add_argument("--cluster", required=True, help="preset (dgx-a100, dgx-h100, h100-spine-leaf, tpuv4-fat-tree, "
                   "cpu-gloo) as NAME:DEVICES, or a cluster YAML/JSON file")
    p.add_argument("--devices", type=_positive, help="device count for a preset (or NAME:DEVICES)")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length (default: the model's)")
    p.add_argument("--dtype", type=_dtype, default=torch.bfloat16, help="training dtype (default bf16)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nest-fx", description="Trace, cost and plan hybrid parallelism for PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("trace", help="trace a model on meta tensors; per-block table")
    p.add_argument("model", help="zoo name (llama2-7b, ...), spec (gpt:hidden=..,layers=..) or hf:FAMILY")
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
    p.add_argument("--time-budget", type=float, default=60.0, help="search seconds before returning the best "
                   "plan so far (default 60)")
    p.add_argument("--no-baselines", action="store_true", help="skip the Megatron/Phaze/MCMC comparison")
    p.add_argument("--mcmc-evals", type=_positive, default=2000, help="MCMC baseline evaluations (default 2000)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="predict step time and memory of a plan file")
    p.add_argument("--plan", required=True, metavar="PLAN.json", help="a nest-fx-plan/1 file")
    _add_model_args(p)
    p.add_argument("--json", metavar="FILE", help="write the prediction as JSON")
    p.set_defaults(func=cmd_simulate)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        if os.environ.get("NEST_FX_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
