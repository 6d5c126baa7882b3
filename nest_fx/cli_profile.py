"""``nest-fx profile``: per-op times of a model on this machine's device, or the collectives of a
cluster (``--calibrate``, ``--pairwise``). Each handler imports torch and the profiler when it
runs, not at the top (start-up time: ``nest_fx.cli`` imports this module for ``--help``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

from nest_fx.common.errors import UserError
from nest_fx.common.fileio import write_with


def int_list(text: str) -> List[int]:
    """An argparse type: comma-separated positive integers (``--tp 1,2,4``)."""
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
    import torch
    from tqdm import tqdm

    from nest_fx.report import tables as report
    from nest_fx.workload import Profile
    from profiler.model_profile import ProfileOptions, profile_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible here; run on a GPU node or use --device cpu")
    options = ProfileOptions(
        tps=args.tp, mbss=args.mbs, seq=args.seq, dtype=args.dtype or "bf16", warmup=args.warmup, repeats=args.repeats
    )
    existing = None
    if args.append and os.path.exists(args.out):
        existing = Profile.load(args.out)
    bar = tqdm(desc="profiling", unit="variant", disable=args.quiet or not sys.stderr.isatty(), leave=False)

    def progress(done: int, total: int, label: str) -> None:
        bar.total = total
        bar.set_postfix_str(label)
        bar.update(done - bar.n)

    try:
        prof, stats = profile_model(args.model, device, options, profile=existing, progress=progress)
    finally:
        bar.close()
    write_with(args.out, prof.save, UserError)
    print(report.profile_table(prof, args.model))
    print(
        f"timed {stats.nodes_timed} ops, reused {stats.nodes_reused} (identical blocks / earlier entries) "
        f"in {stats.seconds:.1f} s; {len(stats.skipped)} variant(s)/op(s) skipped"
    )
    print(f"wrote {args.out} ({len(prof.ops)} op entries, {prof.device_name}, {prof.dtype})")
    return 0


def _calibrate_pairwise(args: argparse.Namespace) -> int:
    """Measure p2p between every pair of ranks and write a graph topology (--pairwise)."""
    if not args.out.endswith((".yaml", ".yml", ".json")):
        raise UserError(f"--out {args.out}: --pairwise writes a topology file: end it in .yaml, .yml or .json")
    import torch

    from nest_fx.apply.distributed import init_distributed
    from nest_fx.cluster import Cluster, GraphCluster, load_cluster
    from nest_fx.cluster.topology import from_cluster, save_topology
    from nest_fx.report import tables as report
    from profiler.pairwise import calibrate_pairwise

    base = device = None
    if args.cluster:  # the structure to derate: a topology, or a hierarchical cluster as a graph
        cluster = load_cluster(args.cluster, args.devices)
        base = cluster.topology if isinstance(cluster, GraphCluster) else from_cluster(cluster)
    elif torch.cuda.is_available():
        raise UserError(
            "--pairwise on GPUs needs --cluster (the topology or cluster whose device and links "
            "the measurements derate)"
        )
    else:
        device = Cluster.preset("cpu-gloo", 1).device
    if "WORLD_SIZE" in os.environ:  # under torchrun: the launched world measures itself
        init_distributed()
    topo, fits, samples = calibrate_pairwise(
        nproc=args.nproc, sizes=[s * 1024 for s in args.sizes_kib], base=base, device=device, repeats=args.repeats
    )
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return 0
    print(report.pairwise_table(fits, base))
    save_topology(topo, args.out)
    print(f"wrote {args.out} ({len(fits)} pairs, {len(samples)} samples; format nest-fx-topology/1)")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """Measure collectives and fit the cluster's levels (--calibrate)."""
    if args.pairwise:
        return _calibrate_pairwise(args)
    if not args.cluster:
        raise UserError("--calibrate needs --cluster (a preset NAME:DEVICES or a file) whose levels to fit")
    from nest_fx.cluster import load_cluster

    cluster = load_cluster(args.cluster, args.devices)
    from nest_fx.report import tables as report
    from profiler.collectives import calibrate

    sizes = [s * 1024 for s in args.sizes_kib]
    fitted, fits, samples = calibrate(cluster, nproc=args.nproc, sizes=sizes, repeats=args.repeats)
    print(report.calibration_table(cluster, fits))
    fitted.save(args.out)
    print(f"wrote {args.out} ({len(samples)} samples)")
    return 0
