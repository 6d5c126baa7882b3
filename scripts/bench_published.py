#!/usr/bin/env python
"""Published training runs (torchtitan, NeMo, AutoModel, Meta's Llama 3) against nest-fx's predictions, before and after.

Source of rows t1-t6: the torchtitan team's H100 benchmark of Llama 3.1 8B / 70B / 405B,
``benchmarks/llama3_h100_202412_torchtitan.md`` in github.com/pytorch/torchtitan (torch 1963fc8,
torchao eab345c, torchtitan 9dec370, December 2024), Tables 1-6: tokens/s per GPU (read at
iteration 90) and memory in GiB (torchtitan logs the caching allocator's peak *reserved*
memory; the largest over the ranks). Hardware as that page states it: Grand Teton hosts of 8
H100s on NVLink, 96 GB HBM2e at 2.4 TB/s per GPU, 400 Gb/s RDMA per GPU between hosts, 500 W
power limit. Its footnote says the GPUs' real peak lies between the SXM and the NVL figures;
this script takes the midpoint (bf16 912, fp8 1825 TFLOP/s dense; SXM 989/1979, NVL 835/1670,
NVIDIA's datasheets) and 95 GiB of device memory (what PyTorch reports for the 96 GB part).
The runs use torchtitan's defaults where the table does not say otherwise: sequence length
8192, AdamW, FSDP2 (ZeRO-3, mixed precision), sequence parallel and loss parallel with TP,
as many pipeline microbatches as the PP degree (torchtitan's default at 9dec370 when
``pipeline_parallel_microbatches`` is unset, for the interleaved schedule too: ``Row.pp_microbatches``),
the interleaved schedule with 2 stages per rank, selective
activation checkpointing = op-level SAC (``op``), "AsyncTP" = TP collectives overlapped.

For each row the published configuration is written as a plan (``nest-fx-plan/1``) and costed
by the cost model of this tree ("after") and by the cost model as merged before the change
(``--before-commit``, default 9abf3b6, run from a ``git archive`` of it; "before"). Where the old
model refused a field it did not cost, the nearest form it did cost is used and said so (op-level
SAC as ``selective``, loss parallel, torch.compile and Float8 dropped); context parallelism had
no such form: the row was not expressible. Then the planner searches the same model, cluster and
global batch (the same compile / Float8 / AsyncTP options, every device used) and its plan is
compared with the published one under the same (after) model.

Rows w1, w2 (held out: no factor of the cost model was measured on them): Trainy's Llama 3.1 8B runs
on 32 and 64 H200 in June 2025, ``benchmarks/llama3_8b_h200_2025-06_torchtitan.md`` in the same
repository (torch 2.8.0a0+5228986c39, torchtitan e7c0cae; tokens/s per GPU and reserved GiB at
iteration 100): FSDP over every GPU, local batch 2, torch.compile, Float8 tensorwise with fp8
all-gathers, as their command line says; sequence length 8192 and op-level SAC from torchtitan's
``llama3_8b.toml``; the loss compiled with the blocks (``loss_kernel=compile``: torchtitan compiles
it under ``--training.compile`` since PR #1033, April 2025); PyTorch's default fixed allocator
segments (their command runs torchrun directly, not ``run_train.sh``, which sets expandable
segments); SDPA's FlashAttention-2 (cuDNN became SDPA's default on Hopper in torch 2.9, PR #162073);
their hosts' NVLink and 400 Gb/s per GPU as ``trainy_h200`` writes them.

Held out too, with no memory figure (they ran, so they must fit): NVIDIA's rows
(``_published_nvidia_rows.py``, with what is stated and assumed for each): n1-n7 and n8-n10, NeMo
24.12's and 24.07's dense FP8 rows on DGX H100 (``fused``, Float8, ZeRO-1 as Megatron-Core's
distributed optimizer holds it, bf16 gradients, no recompute and TP communication exposed
assumed); r1-r5, Megatron-Bridge 25.11's on DGX H100, DGX B200 and GB200 NVL72 (the same stack);
r6, Megatron-Bridge 25.09's FP8 Qwen3-30B-A3B token-drop run on 16 H100 (PP 2, VP 24, EP 8);
a1, AutoModel's BF16 Qwen3-30B-A3B run with EP 8.

Meta's Llama 3 405B pre-training configurations (Grattafiori et al. 2024, Table 4: model TFLOP/s
per GPU, no memory figure: they ran, so they must be feasible) are rows m1-m3, costed with the
``fused`` kernel backend; what is assumed is in ``published_rows``, their cluster in ``meta_h100``
(``_published_clusters.py``): 8 model chunks of one layer per rank (derived from the paper's stage
split, see ``published_rows``), microbatch 1 (32, 16, 16 microbatches), ZeRO-2 with gradients
reduce-scattered in fp32 after every microbatch and accumulated sharded (``pp_shard_grads``;
stated: "we shard ... gradients", sec. 3.3.2, fp32 reduction and accumulation, sec. 3.3.4),
RMSNorms keeping their output, not their input (``norm_kernel=memory-efficient``; derived from the
stage inputs the paper deallocates, see ``Row.norm_kernel``). Their TFLOP/s are compared with the
cost model's model FLOPs, which count attention whole (non-causal), as PaLM's MFU does (Chowdhery et al. 2022, app.
B: 6 N + 12 L H Q T per token); counted as 6 N alone (the paper's 3.8 x 10^25 training FLOPs are
6 x 405B x 15.6T tokens) m1 / m2 / m3 would be -11.5 / -10.4 / -26.7% instead, counted with
causal attention (the masked half left out) -10.5 / -9.3 / +17.2%: no count puts all three within
10%. Every row
names its kernel backend (``nest_fx.workload.kernels``). Gradients are reduced in fp32 on every
row but NeMo's (torchtitan's default ``mixed_precision_reduce``; Meta's sec. 3.3.4).

Targets (issue 26): bf16 rows within 10% in throughput, all rows 15%; no published configuration
infeasible; every row expressible; the planner never slower than the published configuration.

    python scripts/bench_published.py                    # all rows, before and after (~5 min)
    python scripts/bench_published.py --rows t1 --no-before --no-planner

Writes ``OUT/bench_published.{md,json,png}`` (the figure: ``plot_published.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from typing import Dict, List, Optional

from nest_fx.common.errors import NestFxError
import nest_fx.cost.options as cost_options_module
from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import simulate
from nest_fx.plan import Plan, StagePlan
from nest_fx.solver import NoFeasiblePlan, SolverOptions, solve
from nest_fx.solver.recipes import block_split
from nest_fx.workload import workload_for_model

from _bench_common import write_json

# the rows and clusters live in _published_rows.py, _published_clusters.py; the tests read them from here
from _published_rows import MODELS, SOURCES, GiB, Row, published_rows, rows_named  # noqa: F401 (published_rows: re-exported)
from _published_clusters import cluster_of
from _published_report import summary, table
from plot_published import plot as plot_published


_WORKLOADS: Dict[tuple, object] = {}


def workload(row: Row, cluster):
    key = (row.model, row.seq, row.system, row.hardware)  # the analytical op times are the device's
    if key not in _WORKLOADS:
        _WORKLOADS[key] = workload_for_model(MODELS[row.model], cluster, seq=row.seq)
    return _WORKLOADS[key]


def published_plan(row: Row, work, **overrides):
    """The row's configuration as a plan (the blocks evenly over the stages, embedding first,
    output layer last, as torchtitan splits them)."""
    lp = row.tp > 1 if row.loss_parallel is None else row.loss_parallel
    fields = dict(
        dp=row.fsdp,
        zero=row.zero,
        microbatch_size=row.local_batch // row.num_microbatches,
        num_microbatches=row.num_microbatches,
        schedule=row.schedule,
        virtual_stages=row.virtual_stages,
        sequence_parallel=row.tp > 1,
        placement="stage-major",
        cp=row.cp,
        loss_parallel=lp,
        compile=row.compile,
        float8=row.float8,
    )
    if row.ep > 1:
        fields["ep"] = row.ep
    if row.precision and hasattr(Plan, "precision"):
        fields["precision"] = row.precision  # a cost model before the setting costs the cost options' bytes
    if row.backend:
        fields["kernels"] = row.backend
    if row.attention_kernel and hasattr(Plan, "attention_kernel"):
        fields["attention_kernel"] = row.attention_kernel
    if row.norm_kernel and hasattr(Plan, "norm_kernel"):
        fields["norm_kernel"] = row.norm_kernel  # a cost model before the setting priced the model's norm code
    if row.loss_kernel and hasattr(Plan, "loss_kernel"):
        fields["loss_kernel"] = row.loss_kernel  # a cost model before the setting priced the eager loss
    if row.cp > 1 and row.cp_mode and hasattr(Plan, "cp_mode"):
        fields["cp_mode"] = row.cp_mode  # a cost model before the setting prices the gathered keys
    if row.pp_shard_grads and hasattr(Plan, "pp_shard_grads"):
        fields["pp_shard_grads"] = True  # a cost model before the setting holds the gradients unsharded
    fields.update(overrides)
    if fields.get("kernels", "") is None or (fields.get("kernels") and not hasattr(Plan, "kernels")):
        fields.pop("kernels")  # a cost model without the kernels setting costs eager kernels
    recompute = fields.pop("recompute", row.recompute)
    if row.system == "llama3":
        split = even_split(work, row.pp, lighter_ends=True)
    elif row.system in ("nemo", "automodel"):
        split = even_split(work, row.pp)  # Megatron: the layers evenly, embedding first, output last
    else:
        split = block_split(work, row.pp) or even_split(work, row.pp)
    return Plan(stages=[StagePlan(a, b, row.tp, recompute) for a, b in split], num_layers=len(work), **fields)


def even_split(work, p: int, lighter_ends: bool = False):
    """The blocks as evenly as ``p`` stages allow when p does not divide them (the first stages
    take one more, as torchtitan's generated split points do), embedding first, output last.
    ``lighter_ends``: Llama 3's split (Grattafiori et al. 2024, sec. 3.3.2): the first and the
    last stage one block fewer than the others (126 blocks over 16 stages: 7, 8 x 14, 7)."""
    blocks = [i for i, layer in enumerate(work.layers) if layer.kind == "block"]
    if lighter_ends:
        per = (len(blocks) + 2) // p
        sizes = [per - 1] + [per] * (p - 2) + [len(blocks) - (per - 1) - per * (p - 2)]
    else:
        per, extra = divmod(len(blocks), p)
        sizes = [per + (1 if k < extra else 0) for k in range(p)]
    bounds = [blocks[0]]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    bounds[0], bounds[-1] = 0, len(work)
    return list(zip(bounds[:-1], bounds[1:]))


def cost_options(row: Row):
    """AdamW; async TP as the measured share of TP collectives it hides (``ASYNC_TP_OVERLAP``; a
    cost model before it had overlap as a switch: on); gradients reduced in fp32 (torchtitan, Meta)
    or bf16 (NeMo: ``Row.reduce_bytes``); Meta's pipeline frees each stage's output after sending it
    (torchtitan's keeps its shard); the allocator's segments the row's launch set; its expert dispatch."""
    # both systems reduce bf16 gradients in fp32: torchtitan's FSDP2 MixedPrecisionPolicy
    # (mixed_precision_reduce = "float32", its default), Meta's FSDP (Grattafiori et al. 2024,
    # sec. 3.3.4: "reduce-scatter gradients in FP32 across data parallel workers"). Meta: "we
    # proactively deallocate ... the input and output tensors of each pipeline stage" (sec. 3.3.2);
    # torchtitan runs torch's PipelineStage, which keeps them, and its sequence-parallel blocks
    # output their sequence shard (RowwiseParallel with output_layouts=Shard(1), a local tensor)
    wanted = dict(
        allocator_segments=row.allocator_segments,  # torchtitan's run_train.sh: expandable
        reduce_bytes=row.reduce_bytes,
        stage_outputs="sharded" if row.system == "torchtitan" else "freed",
        # Megatron-Core's distributed optimizer (NeMo, Megatron-Bridge): whole bf16 buffers, no FSDP shard copy
        state_buffers="distributed-optimizer" if row.system == "nemo" else "fsdp",
        expert_dispatch=row.expert_dispatch,  # DeepEP's all-to-all (a1)
        expert_routing=row.expert_routing,
    )
    # a cost model before a setting costs without it
    fields = dict(optimizer="adamw", **{k: v for k, v in wanted.items() if k in CostOptions.__dataclass_fields__})
    if row.async_tp and hasattr(CostOptions, "overlap_tp_comm"):
        fields["overlap_tp_comm"] = getattr(cost_options_module, "ASYNC_TP_OVERLAP", True)
    return CostOptions(**fields)


# what the cost model as merged did not cost, and the nearest form it did (in order)
FALLBACKS = (
    ("recompute", "op", "selective", "op-level SAC run as 'selective'"),
    ("loss_parallel", True, False, "loss parallel dropped"),
    ("compile", True, False, "torch.compile dropped"),
    ("float8", True, False, "Float8 dropped"),
    ("kernels", "fused", None, "fused kernels not costed: eager"),
)


def predict(row: Row, **option_overrides) -> dict:
    """The published configuration costed by the nest_fx this process imports (the installed
    tree, or the archive of the before commit): tokens/s per GPU and peak memory (reserved
    where the model has it); ``option_overrides``: cost options in place of the row's."""
    try:
        cluster = cluster_of(row)  # a cost model before a device preset does not have it
        work = workload(row, cluster)
    except NestFxError as exc:
        return {"expressible": False, "why": str(exc)}
    overrides: dict = {}
    notes: List[str] = []
    if row.backend and not hasattr(Plan, "kernels"):
        overrides["kernels"], notes = None, ["fused kernels not costed: eager"]
    while True:
        try:
            plan = published_plan(row, work, **overrides)
            result = simulate(plan, work, cluster, dataclasses.replace(cost_options(row), **option_overrides))
            break
        except NestFxError as exc:
            message = str(exc)
            step = next(
                (
                    (name, new, note)
                    for name, old, new, note in FALLBACKS
                    if name not in overrides and _uses(row, plan_field=name, value=old)
                ),
                None,
            )
            if step is None or row.cp > 1 and "cp" in message:
                return {"expressible": False, "why": message.splitlines()[0][:200]}
            overrides[step[0]] = step[1]
            notes.append(step[2])
    reserved = getattr(result, "peak_reserved", 0.0)
    # live bytes: the total less the allocator's cached blocks (a term of the total since 2026-11-26)
    live = max(s.memory["total"] - s.memory.get("allocator_cache", 0.0) for s in result.stages)
    tps = result.tokens_per_s / row.gpus
    return {
        "expressible": True,
        "notes": notes,
        "tps_per_gpu": tps,
        "tflops_per_gpu": result.model_flops_per_device / 1e12,
        "value": result.model_flops_per_device / 1e12 if row.tflops_per_gpu else tps,
        "memory_gib": (reserved or live) / GiB,
        "live_gib": live / GiB,
        "reserved_model": bool(reserved),
        "feasible": result.feasible,
        "step_s": result.step_s,
    }


def _uses(row: Row, plan_field: str, value) -> bool:
    return {
        "recompute": row.recompute,
        "loss_parallel": row.tp > 1 if row.loss_parallel is None else row.loss_parallel,
        "compile": row.compile,
        "float8": row.float8,
        "kernels": row.backend,
    }[plan_field] == value


def run_planner(row: Row, budget: float) -> dict:
    """The planner on the row's model, cluster and global batch, its options as the row's."""
    cluster = cluster_of(row)
    work = workload(row, cluster)
    options = SolverOptions(
        time_budget=budget,
        compile=row.compile,
        float8=row.float8,
        use_all_devices=True,
        **({"pp_shard_grads": True} if row.pp_shard_grads else {}),
        **({"precision": row.precision} if row.precision else {}),
        cost=cost_options(row),
        kernels=row.backend or None,
        attention_kernel=row.attention_kernel or None,
        **({"norm_kernel": row.norm_kernel} if row.norm_kernel else {}),
        **({"loss_kernel": row.loss_kernel} if row.loss_kernel else {}),
    )
    try:
        found = solve(work, cluster, row.global_batch, options)
    except NoFeasiblePlan as exc:
        return {"found": False, "why": str(exc)[:200]}
    p = found.plan
    what = (
        f"pp={p.pp} dp={p.dp} tp={p.stages[0].tp} cp={p.cp} zero={p.zero}"
        + (f" ep={p.ep}" if p.ep > 1 else "")
        + (f" dp_shard={p.dp_shard}" if p.dp_shard else "")
        + (" pp_shard_grads" if getattr(p, "pp_shard_grads", False) and p.pp > 1 and p.zero >= 2 else "")
        + f" mbs={p.microbatch_size} {p.schedule}"
        + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else "")
        + f" rc={'/'.join(sorted({s.recompute for s in p.stages}))}"
    )
    return {
        "found": True,
        "plan": what,
        "tps_per_gpu": found.result.tokens_per_s / row.gpus,
        "tflops_per_gpu": found.result.model_flops_per_device / 1e12,
        "memory_gib": found.result.peak_reserved / GiB,
        "search_s": found.seconds,
    }


def predictions_of(commit: str, keys: List[str]) -> Dict[str, dict]:
    """Run this script's ``--predict-only`` under the nest_fx of ``commit`` (a git archive on
    PYTHONPATH, so this tree's installed package is not used)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        archive = os.path.join(tmp, "tree.tar")
        subprocess.run(["git", "-C", root, "archive", "-o", archive, commit], check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(os.path.join(tmp, "tree"), filter="data")
        out = os.path.join(tmp, "before.json")
        # the before column needs the old commit's package, which no install provides: the child
        # process imports it from the archive (this process keeps the installed nest_fx)
        env = dict(os.environ, PYTHONPATH=os.path.join(tmp, "tree"))
        subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--predict-only", out, "--rows", *keys],
            check=True,
            env=env,
            cwd=tmp,
        )
        with open(out, encoding="utf-8") as fh:
            return json.load(fh)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="*", help="row keys or prefixes (t1, t2.3, ...); default all")
    parser.add_argument("--out", default="results", help="output folder (default results)")
    parser.add_argument(
        "--before-commit",
        default="9abf3b6",
        help="the cost model before the change (default: before kernel backends and overlap shares, issue 26)",
    )
    parser.add_argument("--no-before", action="store_true", help="skip the before column")
    parser.add_argument("--no-planner", action="store_true", help="skip the planner runs")
    parser.add_argument("--budget", type=float, default=30.0, help="planner seconds per row (default 30)")
    parser.add_argument("--predict-only", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rows = rows_named(args.rows)
    if args.predict_only:
        with open(args.predict_only, "w", encoding="utf-8") as fh:
            json.dump({r.key: predict(r) for r in rows}, fh)
        return 0
    after = {}
    for r in rows:
        after[r.key] = predict(r)
        print(f"{r.key}: after {after[r.key]}", flush=True)
    planner = {} if args.no_planner else {r.key: run_planner(r, args.budget) for r in rows}
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "bench_published_partial.json"), {"after": after, "planner": planner})
    before = {} if args.no_before else predictions_of(args.before_commit, [r.key for r in rows])
    text = table(rows, before, after, planner)
    stats = summary(rows, before, after, planner)
    print(text + "\n" + json.dumps(stats, indent=1))
    data = {
        "source": list(SOURCES),
        "rows": [r.__dict__ for r in rows],
        "before": before,
        "after": after,
        "planner": planner,
        "summary": stats,
        "before_commit": args.before_commit,
    }
    from published_bands import bands_table  # not above: --predict-only runs under an older nest_fx

    with open(os.path.join(args.out, "bench_published.md"), "w", encoding="utf-8") as fh:
        fh.write(
            "# Published runs against nest-fx\n\nWritten by `python scripts/bench_published.py`; see its "
            "docstring for the sources (torchtitan, NeMo, Megatron-Bridge, AutoModel, Meta) and the assumptions.\n\n"
            + text
            + "\n\n```\n"
            + json.dumps(stats, indent=1)
            + "\n```\n\n"
            "## The error bands these rows give (`scripts/published_bands.py`)\n\n" + bands_table(data) + "\n"
        )
    write_json(os.path.join(args.out, "bench_published.json"), data)
    plot_published(data, os.path.join(args.out, "bench_published.png"))  # predicted vs published, log axes
    return 0


if __name__ == "__main__":
    sys.exit(main())
