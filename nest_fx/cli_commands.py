"""The handlers of ``nest-fx trace``, ``plan``, ``simulate``, ``explain`` and ``export`` (``profile``:
``cli_profile``), and what they share: loading the cluster and the workload, filling the inputs
a plan file records, costing a plan file.

Start-up time: ``nest_fx.cli`` imports this module before it parses the arguments, so only
torch-free modules are imported at the top; each handler imports the rest when it runs (the
function-local imports below; tests/unit/repo/test_architecture.py accepts them here and checks
that nothing at the top loads torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Callable, Optional

from nest_fx.common.errors import ModelError, NestFxError, UserError
from nest_fx.common.fileio import write_with
from nest_fx.plan.constraints import ConstraintError, Constraints, parse_assignments, parse_fraction, parse_list
from nest_fx.plan.plan import Plan
from nest_fx.plan.setting_flags import constraints_data, dest
from nest_fx.plan.settings import OPTIONS, OVERLAPS, SIMULATED_RUN_OPTIONS, setting
from nest_fx.report.plan_file import next_step_lines, not_for_training, plan_inputs


def _torch_dtype(name: Optional[str]):
    """The torch dtype of a --dtype value (default bf16)."""
    from nest_fx.workload.build import DTYPE_NAMES

    return {short: dtype for dtype, short in DTYPE_NAMES.items()}[name or "bf16"]


def _dump_json(data: object, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)


def cmd_trace(args: argparse.Namespace) -> int:
    """Trace a model on meta tensors and print a per-block table."""
    from nest_fx.graph import trace
    from nest_fx.models import build_any
    from nest_fx.report import tables as report

    model, cfg, margs, mkwargs = build_any(args.model, batch=args.batch, seq=args.seq, dtype=_torch_dtype(args.dtype))
    start = time.perf_counter()
    graph = trace(model, margs, mkwargs, method=args.method, leaf_modules=args.leaf or (), name=args.model)
    seconds = time.perf_counter() - start
    print(report.trace_table(graph, seconds, compact=not args.all_blocks))
    if args.json:
        summary = graph.summary()
        summary["trace_seconds"] = seconds
        write_with(args.json, lambda path: _dump_json(summary, path), UserError)
        print(f"wrote {args.json}")
    return 0


def _load_cluster(args: argparse.Namespace):
    from nest_fx.cluster import load_cluster

    return load_cluster(args.cluster, args.devices)


def _load_workload(args: argparse.Namespace, cluster, before_trace: Optional[Callable[[int], None]] = None):
    """The --workload table, or the --model traced and costed for ``cluster`` (a model spec the
    plan file gave that cannot be built here is named as the plan's)."""
    from nest_fx.workload import load_workload, workload_for_model

    if args.workload:
        return load_workload(args.workload)
    try:
        return workload_for_model(
            args.model,
            cluster,
            seq=args.seq,
            dtype=_torch_dtype(args.dtype),
            profile=getattr(args, "profile", None),
            before_trace=before_trace,
        )
    except ModelError as exc:
        if not getattr(args, "model_from_plan", False):
            raise
        raise UserError(
            f"{args.plan}: the plan's model {args.model!r} cannot be built here ({exc}): give --model "
            "NAME or --workload FILE"
        ) from exc


def _simulate_file(path: str, plan: Plan, workload, cluster):
    """``simulate`` of a plan file under the cost options its constraints record (optimizer,
    memory headroom), its errors (the plan does not fit this model, cluster or layer table)
    prefixed with the file's name."""
    from nest_fx.cost.step_time import simulate
    from nest_fx.solver.constraints import cost_options

    try:
        return simulate(plan, workload, cluster, cost_options(plan.constraints))
    except NestFxError as exc:
        raise UserError(f"{path}: {exc}") from exc


def _with_runtime_switches(plan: Plan, args: argparse.Namespace) -> Plan:
    """``plan`` with torch.compile / Float8 switched on where ``--compile`` / ``--float8`` ask, and
    the precision, kernel backend, overlap shares, optimizer implementation and expert dispatch the flags name
    (what the plan would cost with them; the file itself is left as it is)."""
    changes = {flag: True for flag in ("compile", "float8") if getattr(args, flag)}
    for s in OPTIONS:  # --precision, --kernels: the plan's own options
        if s.scope == "plan" and getattr(args, dest(s), None):
            changes[s.name] = getattr(args, dest(s))
    recorded = {
        name: parse_fraction(getattr(args, name), setting(name).flag)
        for name in OVERLAPS
        if getattr(args, name, None) is not None
    }
    for name in SIMULATED_RUN_OPTIONS:  # run options, recorded beside the shares
        if getattr(args, name, None):
            recorded[name] = getattr(args, name)
    if recorded:  # costed through the plan's constraints, as a plan made with these flags records them
        data = plan.constraints.to_dict() if plan.constraints else {}
        try:
            changes["constraints"] = Constraints.from_dict({**data, **recorded})
        except ConstraintError as exc:
            raise UserError(f"constraint {exc}") from None
    return dataclasses.replace(plan, **changes) if changes else plan


def _inputs_from_plan(args: argparse.Namespace, plan: Plan) -> None:
    """Fill the model, cluster, sequence length and dtype that ``args`` leaves out from what the
    plan records; one ``note:`` line per flag that overrides a recorded value."""
    if args.model and args.workload:
        raise UserError("give one of --model NAME or --workload FILE, not both")
    inputs = plan_inputs(
        plan,
        model=args.model,
        workload=args.workload,
        cluster=args.cluster,
        devices=args.devices,
        seq=args.seq,
        dtype=args.dtype,
    )
    if not inputs.model and not args.workload:
        raise UserError(f"{args.plan}: the plan does not record its model: give --model NAME or --workload FILE")
    for note in inputs.notes:
        print(f"note: {note}")
    args.model_from_plan = not args.model and not args.workload
    args.cluster, args.devices, args.model, args.seq, args.dtype = (
        inputs.cluster,
        inputs.devices,
        inputs.model,
        inputs.seq,
        inputs.dtype,
    )


def _note_table_seq(args: argparse.Namespace, plan: Plan, workload) -> None:
    """A note when a --workload table was made for another sequence length than the plan."""
    if args.workload and plan.seq_len and workload.dims.seq_len != plan.seq_len:
        print(f"note: the workload table is for sequence length {workload.dims.seq_len}, the plan for {plan.seq_len}")


def cmd_simulate(args: argparse.Namespace) -> int:
    """Predict step time and memory of a plan file (for the model, cluster, sequence length and
    precision it records, unless flags say otherwise)."""
    plan = _with_runtime_switches(Plan.load(args.plan), args)
    _inputs_from_plan(args, plan)
    cluster = _load_cluster(args)
    from nest_fx.report import tables as report

    workload = _load_workload(args, cluster)
    _note_table_seq(args, plan, workload)
    result = _simulate_file(args.plan, plan, workload, cluster)
    print(report.sim_tables(result, plan, workload))
    if why := not_for_training(plan):
        print(f"not for training with nest-fx: {why}")
    if args.json:
        write_with(
            args.json, lambda path: _dump_json({"plan": plan.to_dict(), "result": result.to_dict()}, path), UserError
        )
        print(f"wrote {args.json}")
    return 0 if result.feasible else 1


def _constraints(args: argparse.Namespace) -> Constraints:
    """The constraints given on the ``plan`` command line (``--fix``, ``--max``, ``--schedule``, ...)."""
    data = constraints_data(args, parse_assignments, parse_list, parse_fraction)  # from nest_fx.plan.settings
    try:
        return Constraints(**data)
    except ConstraintError as exc:  # name the flag rather than the file form's path
        raise UserError(f"constraint {exc}") from None


def _seq_source(args: argparse.Namespace) -> str:
    """Where the sequence length ``plan`` planned for came from."""
    from nest_fx.models.build import is_hf_name
    from nest_fx.models.inputs import PLAN_SEQ_CAP

    if args.seq:
        return "--seq"
    if args.workload:
        return "the workload table's"
    if is_hf_name(args.model):
        return f"the model config's positions, at most {PLAN_SEQ_CAP}; --seq to change"
    return "the model's; --seq to change"


def cmd_plan(args: argparse.Namespace) -> int:
    """Search the best plan within the constraints, compare it with the baselines, write the plan file."""
    if bool(args.model) == bool(args.workload):
        raise UserError("give exactly one of --model NAME or --workload FILE")
    constraints = _constraints(args)
    cluster = _load_cluster(args)
    from tqdm import tqdm

    from nest_fx.cluster import cluster_spec
    from nest_fx.report import tables as report
    from nest_fx.report.layout import placement_lines
    from nest_fx.solver import NoFeasiblePlan, SolverOptions
    from nest_fx.solver.baselines import run_baselines
    from nest_fx.solver.constraints import constrained_options, cost_options, solve_constrained
    from nest_fx.solver.search import states_bound

    options = SolverOptions(time_budget=args.time_budget)

    def cheap_bound(num_params: int) -> None:  # before the trace: a model the whole cluster cannot hold
        problem = states_bound(num_params, cluster, cost_options(constraints, options.cost))
        if problem:
            raise UserError(f"no plan fits: {problem}")

    workload = _load_workload(args, cluster, before_trace=cheap_bound)
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
    # what it was planned for, as given (the solver records seq_len and precision); simulate and
    # explain default to it
    plan.model, plan.cluster = args.model or workload.model, cluster_spec(args.cluster, cluster)
    levels = " > ".join(f"{lv.name} {lv.group_size} @ {report.fmt_si(lv.bandwidth, 'B/s')}" for lv in cluster.levels)
    print(
        f"model {plan.model} ({len(workload)} layers, {report.fmt_si(workload.num_params)} params; "
        f"{workload.provenance}) on {cluster.name}: {cluster.num_devices} x {cluster.device.name} "
        f"[{levels}]; global batch {args.global_batch} x {workload.dims.seq_len} tokens"
    )
    print(f"sequence length {plan.seq_len} ({_seq_source(args)}); precision {plan.precision}")
    print(f"constraints: {constraints.describe()}")
    coverage = getattr(workload.source, "coverage", None)
    if coverage is not None:
        tp = plan.uniform_tp or 1
        print(
            f"compute time of the chosen variant (tp={tp}, microbatch {plan.microbatch_size}): "
            f"{100 * coverage(tp, plan.microbatch_size, plan.sequence_parallel):.0f}% measured, the rest modelled"
        )
    what = "(config, depth, device order) triples" if len(found.placements) > 1 else "(config, depth) pairs"
    print(
        f"searched {found.candidates} {what}, {found.dp_runs} exact DP runs in "
        f"{found.seconds:.2f} s" + ("" if found.complete else " (time budget reached: best plan so far)")
    )
    if len(found.placements) > 1 or plan.device_order is not None:  # a graph topology: which devices
        print("\n".join(placement_lines(plan, cluster, found.placement, [p.name for p in found.placements])))
    print()
    print(report.stages_table(plan, workload, result))
    print()
    print(report.sim_tables(result, plan, workload))
    if not args.no_baselines:
        print()
        searched = constrained_options(options, constraints, workload, cluster, args.global_batch)
        baselines = run_baselines(
            workload, cluster, args.global_batch, searched, args.mcmc_evals, deadline=start + args.time_budget
        )
        print(report.baselines_table(found, found.seconds, baselines))
    path = None
    if args.json:
        write_with(args.json, plan.save, UserError)
        print(f"wrote {args.json}")
        path = args.json
    print()
    print("\n".join(next_step_lines(path, plan, cluster.levels[0].group_size)))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """Explain a plan file: rank layout per network level, memory, step time, pipeline timeline
    (for the model, cluster, sequence length and precision it records, unless flags say otherwise)."""
    plan = Plan.load(args.plan)
    _inputs_from_plan(args, plan)
    cluster = _load_cluster(args)
    from nest_fx.report import explain
    from nest_fx.solver.constraints import cost_options

    workload = _load_workload(args, cluster)
    _note_table_seq(args, plan, workload)
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
    import torch
    from nest_fx.apply.checkpoint import read_meta, resolve
    from nest_fx.apply.export_hf import export_checkpoint
    from nest_fx.models import build_model

    source, _ = resolve(os.path.abspath(args.checkpoint))
    spec = args.model or ((read_meta(source).get("plan") or {}).get("model") or "")
    if not spec:
        raise UserError(
            f"{source} does not record which model it holds (its plan has no model spec): give "
            "--model SPEC (e.g. hf:qwen2:..., hf-config:PATH/config.json)"
        )
    model = build_model(spec, device="meta")[0]  # names, shapes and the HF config only: no weights
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype or "")
    out = export_checkpoint(
        source,
        args.directory,
        model,
        args.max_shard_size,
        overwrite=args.overwrite,
        dtype=dtype,
        verify=not args.no_verify,
    )
    files = sorted(os.listdir(out))
    print(f"exported {source} ({spec}) to {out}: {', '.join(files)}")
    return 0
