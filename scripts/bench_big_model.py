#!/usr/bin/env python
"""A model no rank could train alone, started on ``meta`` from safetensors, trained, exported.

    python scripts/bench_big_model.py                    # Llama-shaped, 10 layers, 2.3 GB fp32, TP4
    python scripts/bench_big_model.py --plan zero3       # ZeRO-3 (FSDP2) over dp=4 (predicted 3.1 GB/rank)
    python scripts/bench_big_model.py --layers 4 --hidden 1024 --vocab 8000   # a quick small run

1. The parent writes a Llama-shaped model's weights (``transformers`` ``LlamaForCausalLM``,
   fp32, random values drawn tensor by tensor: the parent never holds the model either) as
   safetensors shards of at most 500 MB with their index and ``config.json``.
2. The cost model predicts each rank's training memory for the plan (``workload_for_model`` on
   the ``hf-config:`` spec, ``simulate`` with fp32 SGD: ``nest_fx.cost.memory``).
3. 4 CPU ranks (gloo, one thread each). Each rank first puts itself in a memory cgroup of its
   own (a child of the cgroup this script runs in) whose limit it cannot exceed: the kernel
   reclaims page cache and then kills the rank rather than let it pass the limit. The limit is
   ``1.25 x`` the rank's prediction plus ``--base-mib`` for what the process holds before any
   model (Python, torch, transformers, gloo: measured and reported). Then: build the model on
   ``meta``, ``auto_parallelize(..., weights=DIR)`` (each rank reads its shards only), 2 SGD
   steps, ``pm.save_pretrained`` (300 MB files).
4. Per rank: the resident-set high-water mark (``VmHWM``) of each phase (reset between phases
   through ``/proc/self/clear_refs``), minus the footprint before the model, against the
   prediction; bytes read against the bytes of its shard; load throughput; time to the end of
   the first optimizer step; the cgroup's own peak (which also counts page cache).
5. The export is checked: every tensor's float64 sum in the written files equals the trained
   parallel model's (full tensors, gathered one at a time after the measurements).

``--limit rlimit`` uses ``RLIMIT_AS`` instead: it fails before any training (the safetensors
reader maps whole weight files, torch and glibc reserve address space they never touch:
``results/bench_big_model_rlimit.json``). ``--limit watchdog`` (no writable cgroup): a thread
kills the rank when its RSS passes the limit (polled: an allocation can overshoot between polls).
Writes ``results/bench_big_model.json`` and ``.md`` (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

import torch

from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from validate_cpu import _tensor_peak_bytes as tensor_peak_bytes  # the script's own folder is on the path

MiB, GB = 2 ** 20, 10 ** 9
RANKS, BATCH, SEQ, STEPS, LR = 4, 4, 64, 2, 1e-3
WEIGHT_SHARD, EXPORT_SHARD = "500MB", "300MB"
TARGET = 1.25
SUM_TOL = 1e-12  # float64 sums of the same fp32 values, added in another order (a wrong tensor: >> 1e-8)


# -- memory limits and measurements -------------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _own_memory_cgroup() -> Optional[str]:
    """The directory of this process's memory cgroup (v1 ``memory`` controller, or v2)."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return "/sys/fs/cgroup/memory" + path
    for line in lines:
        if line.startswith("0::"):
            return "/sys/fs/cgroup" + line[3:]
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def join_cgroup(name: str, limit: int) -> str:
    """Move this process into a new child cgroup limited to ``limit`` bytes (swap included)."""
    base = _own_memory_cgroup()
    if base is None or not os.path.isdir(base):
        raise OSError("no memory cgroup found")
    path = os.path.join(base, name)
    os.makedirs(path, exist_ok=True)
    if os.path.exists(os.path.join(path, "memory.limit_in_bytes")):  # cgroup v1
        _write(os.path.join(path, "memory.limit_in_bytes"), str(limit))
        if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
            _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(limit))
    else:  # cgroup v2
        _write(os.path.join(path, "memory.max"), str(limit))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            _write(os.path.join(path, "memory.swap.max"), "0")
    _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
    return path


def cgroup_peak(path: Optional[str]) -> Optional[int]:
    """The cgroup's peak usage (v1 ``max_usage_in_bytes``, v2 ``peak``); it counts page cache too."""
    if path is None:
        return None
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        try:
            with open(os.path.join(path, name)) as fh:
                return int(fh.read().strip())
        except OSError:
            continue
    return None


class Sampler:
    """Peak anonymous (heap: tensors, allocator) and file-backed (pages of mapped weight files,
    reclaimable) resident memory of this process per phase, sampled every ``period`` s."""

    def __init__(self, period: float = 0.01):
        self.phase, self.peaks = "start", {}
        threading.Thread(target=self._run, args=(period,), daemon=True).start()

    def _run(self, period: float) -> None:
        while True:
            anon, file = _status_kib("RssAnon") * 1024, _status_kib("RssFile") * 1024
            peak = self.peaks.setdefault(self.phase, [0, 0])
            peak[0], peak[1] = max(peak[0], anon), max(peak[1], file)
            time.sleep(period)


def watchdog(limit: int, period: float = 0.005) -> None:
    """Kill this process when its RSS passes ``limit`` (polled every ``period`` s)."""
    page = os.sysconf("SC_PAGE_SIZE")

    def run() -> None:
        while True:
            with open("/proc/self/statm") as fh:
                rss = int(fh.read().split()[1]) * page
            if rss > limit:
                print(f"watchdog: RSS {rss / MiB:.0f} MiB > limit {limit / MiB:.0f} MiB: killing rank", flush=True)
                os._exit(137)
            time.sleep(period)
    threading.Thread(target=run, daemon=True).start()


# -- the model and its weights file -----------------------------------------------------------

def llama_config(args):
    import transformers
    return transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=2048, tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")


def write_weights(config, directory: str) -> Dict[str, int]:
    """Random fp32 weights of ``LlamaForCausalLM(config)`` as safetensors shards, drawn and
    written a shard at a time; returns {"bytes", "params", "files"}."""
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
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape)
            else:
                tensors[name] = torch.randn(shape, generator=gen) * 0.02
            weight_map[name] = file
            total += tensors[name].numel() * 4
            params += tensors[name].numel()
        save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
        del tensors
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total, "total_parameters": params}, "weight_map": weight_map}, fh)
    config.save_pretrained(directory)
    return {"bytes": total, "params": params, "files": len(groups)}


def plan_for(kind: str, num_blocks: int):
    from nest_fx.plan import uniform_plan
    if kind == "tp4":
        return uniform_plan(num_blocks, tp=RANKS, microbatch_size=BATCH, num_microbatches=1)
    if kind == "zero3":
        return uniform_plan(num_blocks, dp=RANKS, zero=3, microbatch_size=BATCH // RANKS, num_microbatches=1)
    raise SystemExit(f"unknown plan {kind!r}")


def predict(spec: str, plan_kind: str):
    """(plan, per-stage predicted memory terms) from the cost model: fp32 SGD on cpu-gloo:4."""
    from nest_fx.cluster import load_cluster
    from nest_fx.cost.options import CostOptions
    from nest_fx.cost.step_time import simulate
    from nest_fx.workload import workload_for_model

    cluster = load_cluster(f"cpu-gloo:{RANKS}")
    workload = workload_for_model(spec, cluster, seq=SEQ, dtype=torch.float32)
    plan = plan_for(plan_kind, len(workload))
    options = CostOptions.for_dtype(4, optimizer="sgd", overlap_grad_sync=False)
    result = simulate(plan, workload, cluster, options)
    return plan, [dict(sc.memory) for sc in result.stages]


# -- one rank ---------------------------------------------------------------------------------

def run_rank(spec: dict) -> dict:
    import transformers  # noqa: F401 - imported before the baseline: part of the process, not of the model

    import nest_fx.apply.api  # noqa: F401
    rank = int(os.environ["RANK"])
    limit = spec["limits"][rank]
    out: Dict[str, object] = {"rank": rank, "limit_bytes": limit, "limit_kind": spec["limit"]}
    cgroup = None
    if spec["limit"] == "cgroup":
        cgroup = join_cgroup(f"nestfx-bench-{spec['token']}-rank{rank}", limit)
    elif spec["limit"] == "rlimit":
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    elif spec["limit"] == "watchdog":
        watchdog(limit)
    t0 = time.perf_counter()
    try:
        _train_and_export(spec, out, t0)
    except BaseException as e:  # noqa: BLE001 - the rlimit probe reports where it failed
        if spec["limit"] != "rlimit":
            raise
        out["failed"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        out["vm_peak_kib"] = _status_kib("VmPeak")
        out["rss_kib"] = _status_kib("VmRSS")
        return out
    out["cgroup_peak_bytes"] = cgroup_peak(cgroup)
    return out


def _train_and_export(spec: dict, out: dict, t0: float) -> None:
    import torch.distributed as dist

    import nest_fx.apply.steps as steps
    from nest_fx.apply import auto_parallelize
    from nest_fx.models import build_model
    from nest_fx.plan import Plan

    phases: Dict[str, int] = {}
    out["base_rss_bytes"] = _status_kib("VmRSS") * 1024
    out["base_anon_bytes"] = _status_kib("RssAnon") * 1024
    sampler = Sampler()
    sampler.phase = "load"
    out["peak_reset_works"] = _reset_peak()
    timing = {}
    original = steps.materialize

    def timed_materialize(*args, **kwargs):
        start = time.perf_counter()
        counts = original(*args, **kwargs)
        timing["load_s"] = time.perf_counter() - start
        timing.update(counts)
        return counts
    steps.materialize = timed_materialize

    model, _ = build_model(spec["model"], device="meta")
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, spec["vocab"], (BATCH, SEQ), generator=gen)
    y = torch.randint(0, spec["vocab"], (BATCH, SEQ), generator=gen)
    out["phase"] = "auto_parallelize"
    pm = auto_parallelize(model, {"input_ids": x}, global_batch_size=BATCH, loss_fn=lm_loss,
                          plan=Plan.from_dict(spec["plan"]), weights=spec["weights"], verbose=False)
    del model
    t_ready = time.perf_counter()
    phases["load"] = _status_kib("VmHWM") * 1024
    sampler.phase = "train"
    _reset_peak()
    local = [p.to_local() if hasattr(p, "to_local") else p for p in pm.parameters()]
    out["shard_bytes"] = sum(t.numel() * t.element_size() for t in local)
    out["bytes_read"] = int((getattr(pm, "materialized", None) or timing).get("bytes_read", 0))
    out["load_s"] = timing.get("load_s")
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
            # C allocator's retained pages (what max_memory_allocated reports on a GPU)
            live, rise = tensor_peak_bytes(pm, opt, one_step)
            out["tensor_peak_bytes"] = live + rise
        else:
            one_step()
        step_s.append(time.perf_counter() - start)
        if step == 0:
            out["first_step_end_s"] = time.perf_counter() - t0
        if spec["limit"] == "rlimit":
            out["rlimit_survived"] = True
            return
    phases["train"] = _status_kib("VmHWM") * 1024
    sampler.phase = "export"
    _reset_peak()
    out["phase"] = "export"
    start = time.perf_counter()
    pm.save_pretrained(spec["export"], max_shard_size=EXPORT_SHARD)
    out["export_s"] = time.perf_counter() - start
    phases["export"] = _status_kib("VmHWM") * 1024
    sampler.phase = "done"
    out["sampled_peaks"] = {k: {"anon_bytes": v[0], "file_bytes": v[1]} for k, v in sampler.peaks.items()
                            if k != "done"}
    out["phase"] = "done"
    out["peak_rss_bytes"] = phases
    out["losses"], out["step_s"] = losses, step_s
    # after the measurements: each parameter's float64 sum, for the check of the export
    sums = {}
    for name, p in sorted(pm.named_parameters(), key=lambda kv: kv[0]):
        full = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        sums[name] = float(full.sum(dtype=torch.float64))
        del full
    out["sums"] = sums if dist.get_rank() == 0 else None
    out["stage"] = pm.rank_info.stage


# -- the report -------------------------------------------------------------------------------

def check_export(directory: str, sums: Dict[str, float]) -> Dict[str, object]:
    """Every exported tensor's float64 sum against the trained model's (one tensor at a time)."""
    from safetensors import safe_open

    seen, worst = set(), 0.0
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(directory, name), "pt") as fh:
            for key in fh.keys():
                value = float(fh.get_tensor(key).sum(dtype=torch.float64))
                want = sums[key]
                worst = max(worst, abs(value - want) / max(1e-30, abs(want)))
                seen.add(key)
    return {"tensors": len(seen), "missing": sorted(set(sums) - seen)[:5], "extra": sorted(seen - set(sums))[:5],
            "max_rel_diff_of_sums": worst, "ok": seen == set(sums) and worst <= SUM_TOL}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--plan", choices=("tp4", "zero3"), default="tp4")
    parser.add_argument("--limit", choices=("cgroup", "rlimit", "watchdog"), default="cgroup")
    parser.add_argument("--base-mib", type=int, default=768, help="allowance for the process before any model")
    parser.add_argument("--workdir", default=None, help="where the weights and the export go (default: a temp dir)")
    parser.add_argument("--out", default="results/bench_big_model")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)

    work = args.workdir or tempfile.mkdtemp(prefix="nestfx-big-")
    weights, export = os.path.join(work, "weights"), os.path.join(work, "export")
    shutil.rmtree(export, ignore_errors=True)
    config = llama_config(args)
    if not os.path.isfile(os.path.join(weights, "model.safetensors.index.json")):
        os.makedirs(weights, exist_ok=True)
        start = time.perf_counter()
        written = write_weights(config, weights)
        print(f"wrote {written['params'] / 1e6:.0f} M parameters, {written['bytes'] / GB:.2f} GB fp32, in "
              f"{written['files']} files to {weights} ({time.perf_counter() - start:.0f} s)", flush=True)
    with open(os.path.join(weights, "model.safetensors.index.json")) as fh:
        model_bytes = json.load(fh)["metadata"]["total_size"]
    spec_name = f"hf-config:{os.path.join(weights, 'config.json')}"
    plan, predicted = predict(spec_name, args.plan)
    pred_bytes = [predicted[0 if plan.pp == 1 else r // (RANKS // plan.pp)]["total"] for r in range(RANKS)]
    limits = [int(TARGET * p + args.base_mib * MiB) for p in pred_bytes]
    print(f"plan {args.plan}: predicted per rank {[f'{p / MiB:.0f} MiB' for p in pred_bytes]}; limits "
          f"{[f'{lim / MiB:.0f} MiB' for lim in limits]} ({args.limit}); model {model_bytes / MiB:.0f} MiB fp32", flush=True)
    token = f"{os.getpid()}"
    spec = {"model": spec_name, "vocab": args.vocab, "weights": weights, "export": export, "plan": plan.to_dict(),
            "limits": limits, "limit": args.limit, "token": token}
    start = time.perf_counter()
    try:
        ranks = launch(run_rank, RANKS, spec, timeout=args.timeout)
    finally:
        if args.limit == "cgroup":
            base = _own_memory_cgroup()
            for r in range(RANKS):
                try:
                    os.rmdir(os.path.join(base, f"nestfx-bench-{token}-rank{r}"))
                except OSError:
                    pass
    wall = time.perf_counter() - start
    result = {"machine": "2-core CPU box, 24 GiB shared (gloo, 4 ranks, 1 thread each)", "plan": args.plan,
              "model": {"layers": args.layers, "hidden": args.hidden, "ffn": args.ffn, "vocab": args.vocab,
                        "bytes_fp32": model_bytes},
              "batch": BATCH, "seq": SEQ, "steps": STEPS, "optimizer": "SGD (no momentum)", "limit": args.limit,
              "base_allowance_bytes": args.base_mib * MiB, "wall_s": wall, "predicted_terms": predicted,
              "ranks": []}
    if args.limit == "rlimit":
        result["ranks"] = ranks
        print(json.dumps(ranks, indent=1))
        _save(args.out + "_rlimit", result, None)
        return 0
    check = check_export(export, ranks[0]["sums"])
    result["export_check"] = check
    rows = []
    for r in ranks:
        r.pop("sums", None)
        pred = pred_bytes[r["rank"]]
        peak = max(r["peak_rss_bytes"].values())
        r["predicted_bytes"] = pred
        r["peak_over_base_bytes"] = peak - r["base_rss_bytes"]
        r["ratio"] = (peak - r["base_rss_bytes"]) / pred
        anon = max(v["anon_bytes"] for v in r["sampled_peaks"].values())
        r["anon_over_base_bytes"] = anon - r["base_anon_bytes"]
        r["anon_ratio"] = (anon - r["base_anon_bytes"]) / pred
        r["file_peak_bytes"] = max(v["file_bytes"] for v in r["sampled_peaks"].values())
        r["tensor_ratio"] = r["tensor_peak_bytes"] / pred
        r["read_over_shard"] = r["bytes_read"] / r["shard_bytes"] if r["shard_bytes"] else None
        r["load_mb_s"] = r["bytes_read"] / 1e6 / r["load_s"] if r.get("load_s") else None
        result["ranks"].append(r)
        rows.append(r)
    result["model_over_limit"] = model_bytes / max(limits)
    result["weights_and_grads_over_limit"] = 2 * model_bytes / max(limits)
    _save(args.out, result, rows)
    return 0 if check["ok"] and all(r["ratio"] <= TARGET for r in rows) else 1


def _save(out: str, result: dict, rows) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as fh:
        json.dump(result, fh, indent=1)
    if rows is None:
        return
    head = ("| rank | limit MiB | base MiB | RSS peak load / train / export MiB (over base) | predicted MiB | ratio | "
            "anon peak over base MiB | anon ratio | file-backed peak MiB | live tensors peak MiB | tensors ratio | "
            "read MiB | shard MiB | read/shard | load MB/s | first step s | export s | cgroup peak MiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        base = r["base_rss_bytes"]
        peaks = " / ".join(f"{(v - base) / MiB:.0f}" for v in r["peak_rss_bytes"].values())
        cg = f"{r['cgroup_peak_bytes'] / MiB:.0f}" if r.get("cgroup_peak_bytes") else "-"
        lines.append(f"| {r['rank']} | {r['limit_bytes'] / MiB:.0f} | {base / MiB:.0f} | {peaks} | "
                     f"{r['predicted_bytes'] / MiB:.0f} | {r['ratio']:.2f} | {r['anon_over_base_bytes'] / MiB:.0f} | "
                     f"{r['anon_ratio']:.2f} | {r['file_peak_bytes'] / MiB:.0f} | {r['tensor_peak_bytes'] / MiB:.0f} | "
                     f"{r['tensor_ratio']:.2f} | {r['bytes_read'] / MiB:.0f} | "
                     f"{r['shard_bytes'] / MiB:.0f} | {r['read_over_shard']:.2f} | {r['load_mb_s']:.0f} | "
                     f"{r['first_step_end_s']:.1f} | {r['export_s']:.1f} | {cg} |")
    m = result["model"]
    text = (f"# bench_big_model ({result['machine']})\n\n"
            f"Llama-shaped model, {m['layers']} layers, hidden {m['hidden']}, vocab {m['vocab']}: "
            f"{m['bytes_fp32'] / GB:.2f} GB fp32; plan {result['plan']}; batch {result['batch']} x {result['seq']}; "
            f"{result['steps']} SGD steps; limit: {result['limit']}. Model / rank limit = "
            f"{result['model_over_limit']:.2f}x; weights + gradients / rank limit = "
            f"{result['weights_and_grads_over_limit']:.2f}x. Export check: {result['export_check']}.\n\n"
            + "\n".join(lines) + "\n")
    with open(out + ".md", "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
