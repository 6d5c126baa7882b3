#!/usr/bin/env python
"""A model 3x larger than any rank may hold, started on ``meta`` from safetensors, trained, exported.

    python scripts/bench_big_model.py --workdir /tmp/nestfx-big    # 12 layers, hidden 4096: 9.6 GB fp32, TP4, bf16-true
    python scripts/bench_big_model.py --layers 2 --fraction 0      # a small run without a limit (overheads)

1. The parent writes a Llama-shaped model's weights (``transformers`` ``LlamaForCausalLM``,
   fp32, random values drawn tensor by tensor: the parent never holds the model either) as
   safetensors shards of at most 1 GB with their index and ``config.json``, then drops them
   from the page cache (the ranks read them from storage).
2. The cost model predicts each rank's training memory for the plan (``workload_for_model`` on
   the ``hf-config:`` spec traced in fp32, ``simulate`` of the plan with its ``precision``,
   SGD): ``--plan auto`` takes the plan with the smaller per-rank prediction of TP4 and ZeRO-3
   over dp=4.
3. An empty rank is measured first (torch, transformers, nest-fx, a gloo group, one
   all-reduce: ``big_model_memory.baseline_rank``): what any process holds before a model.
4. 4 CPU ranks (gloo, one thread each; ``big_model_rank.run_rank``). Each rank first moves itself
   into a memory cgroup of its own whose limit it cannot exceed (the kernel reclaims page cache,
   then kills the rank): the model's fp32 bytes / ``--fraction`` (3) minus the rank's RSS at that
   moment, so that the rank's whole resident memory stays under a third of the model. Each rank
   sets glibc's ``M_MMAP_THRESHOLD`` to ``--mmap-threshold`` (1 MiB; 0 keeps glibc's adaptive
   default). Then: build the model on ``meta``, ``auto_parallelize(..., weights=DIR)`` (each rank
   reads its boxes only), 2 SGD steps, ``pm.save_pretrained`` (100 MB files).
5. Per rank: peak RSS and its anonymous part per phase (setup: build, trace, parallelise; load;
   train; export), live-tensor peak of step 2 (``torch.profiler`` memory events), all against
   the prediction; bytes read (the reader's count, ``preadv``) against the shard's bytes in the
   file's dtype, and what the kernel fetched from storage (``/proc/self/io`` ``read_bytes``,
   readahead included); load throughput;
   time to the end of the first optimizer step; export time; the cgroup's peak.
6. The export is checked: every tensor's float64 sum in the written files equals the trained
   parallel model's (each rank's shard summed, the sums all-reduced: nothing gathered).

``--limit rlimit`` uses ``RLIMIT_AS`` (address space) instead of the cgroup; ``--limit
watchdog`` polls the RSS. Writes ``results/bench_big_model.json`` and ``.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List

import torch

from _bench_common import table, write_json
from big_model_memory import (
    MiB,
    baseline_rank,
    remove_cgroup,
)
from big_model_rank import STEPS, run_rank
from nest_fx.apply.launch import launch

GB = 10**9
RANKS = 4
WEIGHT_SHARD = "1GB"
TARGET = 1.25
SUM_TOL = 1e-12  # float64 sums of the same values, added in another order (a wrong tensor: >> 1e-8)


# -- the model and its weights file -----------------------------------------------------------


def llama_config(args):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )


def write_weights(config, directory: str) -> Dict[str, int]:
    """Random fp32 weights of ``LlamaForCausalLM(config)`` as safetensors shards, drawn and
    written a shard at a time, then dropped from the page cache; returns {"bytes", "params", "files"}."""
    import transformers
    from safetensors.torch import save_file

    from nest_fx.apply.hf_format import SHARD_NAME, parse_size

    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config)
    limit = parse_size(WEIGHT_SHARD)
    groups: List[List[tuple]] = [[]]
    size = 0
    for name, t in skeleton.state_dict().items():
        nbytes = t.numel() * 4
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, tuple(t.shape)))
        size += nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map, total, params = {}, 0, 0
    for i, group in enumerate(groups):
        file = SHARD_NAME.format(index=i + 1, count=len(groups))
        tensors = {}
        for name, shape in group:
            tensors[name] = (
                torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
            )
            weight_map[name] = file
            total += tensors[name].numel() * 4
            params += tensors[name].numel()
        save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
        del tensors
        drop_page_cache(os.path.join(directory, file))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total, "total_parameters": params}, "weight_map": weight_map}, fh)
    config.save_pretrained(directory)
    return {"bytes": total, "params": params, "files": len(groups)}


def drop_page_cache(path: str) -> None:
    """Write ``path`` out and drop its pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plan_for(kind: str, num_blocks: int, precision: str, batch: int):
    from nest_fx.plan import uniform_plan

    if kind == "tp4":
        return uniform_plan(num_blocks, tp=RANKS, microbatch_size=batch, num_microbatches=1, precision=precision)
    if kind == "zero3":
        return uniform_plan(
            num_blocks, dp=RANKS, zero=3, microbatch_size=batch // RANKS, num_microbatches=1, precision=precision
        )
    raise SystemExit(f"unknown plan {kind!r}")


def predict(spec: str, kinds: List[str], precision: str, batch: int, seq: int):
    """{kind: (plan, per-stage predicted memory terms)} from the cost model: SGD on cpu-gloo:4."""
    from nest_fx.cluster import load_cluster
    from nest_fx.cost.options import CostOptions
    from nest_fx.cost.step_time import simulate
    from nest_fx.workload import workload_for_model

    cluster = load_cluster(f"cpu-gloo:{RANKS}")
    workload = workload_for_model(spec, cluster, seq=seq, dtype=torch.float32)
    options = CostOptions.for_dtype(4, optimizer="sgd", overlap_grad_sync=False)  # the plan's precision re-prices it
    out = {}
    for kind in kinds:
        plan = plan_for(kind, len(workload), precision, batch)
        result = simulate(plan, workload, cluster, options)
        out[kind] = (plan, [dict(sc.memory) for sc in result.stages])
    return out


# -- the report -------------------------------------------------------------------------------


def check_export(directory: str, sums: Dict[str, float]) -> Dict[str, object]:
    """Every exported tensor's float64 sum against the trained model's (one tensor at a time)."""
    from safetensors import safe_open

    seen, worst, dtypes = set(), 0.0, set()
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(directory, name), "pt") as fh:
            for key in fh.keys():
                t = fh.get_tensor(key)
                dtypes.add(str(t.dtype))
                value = float(t.sum(dtype=torch.float64))
                want = sums[key]
                worst = max(worst, abs(value - want) / max(1e-30, abs(want)))
                seen.add(key)
    return {
        "tensors": len(seen),
        "dtypes": sorted(dtypes),
        "missing": sorted(set(sums) - seen)[:5],
        "extra": sorted(seen - set(sums))[:5],
        "max_rel_diff_of_sums": worst,
        "ok": seen == set(sums) and worst <= SUM_TOL,
    }


def summarise(r: dict, pred: float, empty_rss: float, bound: int) -> dict:
    """Derived per-rank figures (bytes and ratios) of one rank's raw measurements."""
    peak = max(r["peak_rss_bytes"].values())
    anon = max(v["anon_bytes"] for v in r["sampled_peaks"].values())
    r.update(
        predicted_bytes=pred,
        peak_rss=peak,
        peak_anon=anon,
        peak_over_empty=peak - empty_rss,
        peak_over_bound=peak / bound if bound else None,
        ratio=(peak - empty_rss) / pred,
        ratio_with_empty=peak / pred,
        tensor_ratio=r["tensor_peak_bytes"] / pred,
        read_over_shard=r["bytes_read"] / r["shard_file_bytes"],
        load_mb_s=r["bytes_read"] / 1e6 / r["load_s"],
        trace_bytes=r["marks"]["after_trace"]["anon"] - r["marks"]["before_trace"]["anon"],
    )
    return r


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--precision", default="bf16-true", choices=("fp32", "bf16-true", "bf16-mixed"))
    parser.add_argument("--plan", choices=("auto", "tp4", "zero3"), default="auto")
    parser.add_argument("--limit", choices=("cgroup", "rlimit", "watchdog"), default="cgroup")
    parser.add_argument(
        "--fraction",
        type=float,
        default=3.0,
        help="each rank's whole memory is bounded by the model's fp32 bytes / this (0: no limit)",
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=2**20,
        help="glibc M_MMAP_THRESHOLD of each rank, bytes (0: glibc's adaptive default)",
    )
    parser.add_argument("--workdir", default=None, help="where the weights and the export go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the weights and the export")
    parser.add_argument("--out", default="results/bench_big_model")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)

    work = args.workdir or tempfile.mkdtemp(prefix="nestfx-big-")
    weights, export = os.path.join(work, "weights"), os.path.join(work, "export")
    shutil.rmtree(export, ignore_errors=True)
    config = llama_config(args)
    written = None
    if not os.path.isfile(os.path.join(weights, "model.safetensors.index.json")):
        os.makedirs(weights, exist_ok=True)
        start = time.perf_counter()
        written = write_weights(config, weights)
        written["seconds"] = time.perf_counter() - start
        print(
            f"wrote {written['params'] / 1e6:.0f} M parameters, {written['bytes'] / GB:.2f} GB fp32, in "
            f"{written['files']} files to {weights} ({written['seconds']:.0f} s)",
            flush=True,
        )
    else:
        for name in os.listdir(weights):
            if name.endswith(".safetensors"):
                drop_page_cache(os.path.join(weights, name))
    with open(os.path.join(weights, "model.safetensors.index.json")) as fh:
        model_bytes = json.load(fh)["metadata"]["total_size"]
    spec_name = f"hf-config:{os.path.join(weights, 'config.json')}"
    kinds = ["tp4", "zero3"] if args.plan == "auto" else [args.plan]
    predictions = predict(spec_name, kinds, args.precision, args.batch, args.seq)
    per_rank = {
        k: [terms[0 if p.pp == 1 else r // (RANKS // p.pp)]["total"] for r in range(RANKS)]
        for k, (p, terms) in predictions.items()
    }
    kind = min(kinds, key=lambda k: max(per_rank[k]))
    plan, predicted = predictions[kind]
    pred_bytes = per_rank[kind]
    bound = int(model_bytes / args.fraction) if args.fraction else 0
    print(
        f"predicted per rank ({args.precision}, SGD): "
        + ", ".join(f"{k} {max(v) / MiB:.0f} MiB" for k, v in per_rank.items())
        + f"; running {kind}; model {model_bytes / MiB:.0f} MiB fp32; each rank's bound "
        f"{bound / MiB:.0f} MiB ({args.limit})",
        flush=True,
    )
    empty = launch(baseline_rank, RANKS, timeout=300)
    empty_rss = max(e["gloo"]["rss"] for e in empty)
    print(f"an empty rank (torch, transformers, nest-fx, gloo): RSS {empty_rss / MiB:.0f} MiB", flush=True)
    token = f"{os.getpid()}"
    spec = {
        "model": spec_name,
        "vocab": args.vocab,
        "weights": weights,
        "export": export,
        "work": work,
        "plan": plan.to_dict(),
        "bound": bound,
        "limit": args.limit,
        "token": token,
        "batch": args.batch,
        "seq": args.seq,
        "mmap_threshold": args.mmap_threshold,
        "export_dtype": torch.bfloat16 if args.precision == "bf16-true" else None,
    }
    start = time.perf_counter()
    try:
        ranks = launch(run_rank, RANKS, spec, timeout=args.timeout)
    except RuntimeError:
        for r in range(RANKS):
            path = os.path.join(work, f"rank{r}.progress")
            if os.path.exists(path):
                with open(path) as fh:
                    print(f"rank {r} last seen: {fh.read()}", flush=True)
        raise
    finally:
        for r in range(RANKS):
            remove_cgroup(f"nestfx-bench-{token}-rank{r}")
    wall = time.perf_counter() - start
    result = {
        "machine": "2-core CPU box (Xeon, AMX), 24 GiB shared with other jobs; gloo, 4 ranks, 1 thread each",
        "plan": kind,
        "plan_dict": plan.to_dict(),
        "precision": args.precision,
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "ffn": args.ffn,
            "vocab": args.vocab,
            "bytes_fp32": model_bytes,
            "params": model_bytes // 4,
        },
        "written": written,
        "batch": args.batch,
        "seq": args.seq,
        "steps": STEPS,
        "optimizer": "SGD (no momentum)",
        "limit": args.limit,
        "fraction": args.fraction,
        "mmap_threshold": args.mmap_threshold,
        "bound_bytes": bound,
        "wall_s": wall,
        "predicted_per_rank": per_rank,
        "predicted_terms": predicted,
        "empty_rank": empty,
        "ranks": [],
    }
    if args.limit == "rlimit" and any("failed" in r for r in ranks):
        result["ranks"] = ranks
        print(json.dumps(ranks, indent=1))
        write_json(args.out + "_rlimit.json", result)
        return 1
    result["export_check"] = check = check_export(export, ranks[0].pop("sums"))
    for r in ranks:
        r.pop("sums", None)
        result["ranks"].append(summarise(r, pred_bytes[r["rank"]], empty_rss, bound))
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.out + ".json", result)
    write_markdown(args.out + ".md", result, empty_rss)
    return 0 if check["ok"] and all(r["ratio"] <= TARGET for r in result["ranks"]) else 1


def write_markdown(path: str, result: dict, empty_rss: float) -> None:
    """The per-rank table and the run's description."""
    m, rows = result["model"], []
    for r in result["ranks"]:
        cg = f"{r['cgroup_peak_bytes'] / MiB:.0f}" if r.get("cgroup_peak_bytes") else "-"
        rows.append(
            [
                r["rank"],
                f"{r['limit_bytes'] / MiB:.0f} + {r['at_join']['rss'] / MiB:.0f}",
                f"{r['predicted_bytes'] / MiB:.0f}",
                " / ".join(f"{v / MiB:.0f}" for v in r["peak_rss_bytes"].values()),
                f"{r['profiled_step_rss_bytes'] / MiB:.0f}",
                f"{r['peak_over_bound']:.2f}" if r["peak_over_bound"] else "-",
                f"{r['peak_over_empty'] / MiB:.0f}",
                f"{r['ratio']:.2f}",
                f"{r['ratio_with_empty']:.2f}",
                f"{r['peak_anon'] / MiB:.0f}",
                f"{r['tensor_peak_bytes'] / MiB:.0f}",
                f"{r['tensor_ratio']:.2f}",
                f"{r['trace_bytes'] / MiB:.0f}",
                f"{r['bytes_read'] / MiB:.0f} / {r['shard_file_bytes'] / MiB:.0f} ({r['read_over_shard']:.2f})",
                f"{r['storage_read_bytes'] / MiB:.0f}",
                f"{r['load_s']:.1f} ({r['load_mb_s']:.0f})",
                f"{r['first_step_end_s']:.0f}",
                " / ".join(f"{s:.1f}" for s in r["step_s"]),
                f"{r['export_s']:.1f}",
                cg,
            ]
        )
    head = [
        "rank",
        "limit + RSS at join MiB",
        "predicted MiB",
        "peak RSS setup / load / step 1 / export MiB",
        "RSS profiled step 2 MiB",
        "peak RSS / bound",
        "peak - empty rank MiB",
        "ratio (- empty)",
        "ratio (whole RSS)",
        "anon peak MiB",
        "live tensors MiB",
        "tensors ratio",
        "trace MiB",
        "read / shard MiB",
        "storage read MiB",
        "load s (MB/s)",
        "first step at s",
        "steps s",
        "export s",
        "cgroup peak MiB",
    ]
    bound = result["bound_bytes"]
    text = (
        f"# bench_big_model ({result['machine']})\n\n"
        f"Llama-shaped model, {m['layers']} layers, hidden {m['hidden']}, FFN {m['ffn']}, vocab {m['vocab']}: "
        f"{m['params'] / 1e9:.2f} B parameters, {m['bytes_fp32'] / GB:.2f} GB fp32 safetensors; plan "
        f"{result['plan']}, precision {result['precision']}; batch {result['batch']} x {result['seq']}; "
        f"{result['steps']} SGD steps. Each rank's bound (cgroup limit + RSS at the join): "
        f"{bound / MiB:.0f} MiB = model / {result['fraction']:g}. An empty rank (torch, transformers, "
        f"nest-fx, a gloo group): {empty_rss / MiB:.0f} MiB. Export check: {result['export_check']}.\n\n"
        + table(rows, head)
        + "\n"
    )
    with open(path, "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
