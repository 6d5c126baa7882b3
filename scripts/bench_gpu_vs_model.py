#!/usr/bin/env python
"""The cost model's figures against what ``bench_gpu_kernels.py`` measured on a GPU (any machine).

    python scripts/bench_gpu_vs_model.py                                   # results/gpu/bench_gpu_kernels_h200.json
    python scripts/bench_gpu_vs_model.py --measured OTHER.json --cluster dgx-h100:1

Compares, for the device the JSON was measured on (``--cluster``: its preset):

* the zoo Llama block of the ``block`` section (Llama 3 8B's layer shape, 8,192 tokens): forward +
  backward time per layer, eager and compiled, and the bytes it saves for backward per token per
  hidden unit, against ``Workload.for_runtime(kernels=...).cost`` of the same model (SDPA at the
  default attention kernel, which PyTorch picked in the measured run; ``norm_kernel=model``: the
  measured model ran its own RMSNorm code), and, where the JSON has it (``eager_fused_norm``), the
  eager layer with ``F.rms_norm`` against the runtime's default price;
* one RMSNorm's forward + backward at 8,192 x 4,096 (``block.norm``: the zoo's fp32 code and
  ``F.rms_norm``) against the price of one norm of that layer (``workload/fused_norms.py``);
* SDPA's measured rates (``sdpa``) against the rates the roofline prices for the device;
* fused attention's rate by call length (``attention_share.attention_length_share``): SDPA over
  each length against its median over >= 8K tokens (``sdpa``), and ring attention's cost of
  splitting (``ring`` against the ``sdpa`` section's FlashAttention-2 row: a CP rank's chunked
  attention against the whole attention / cp);
* the bf16 GEMMs (``gemm``) against the roofline's ``e_mm(F)``, and the memory-bound ops
  (``elementwise``) against ``e_mem``.

Writes ``results/gpu/gpu_vs_model.json`` and ``.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import List, Optional

from nest_fx.cluster import load_cluster
from nest_fx.cluster.kernel_fit import attention_shares, length_ratios, ring_ratios
from nest_fx.workload import workload_for_model
from nest_fx.workload.attention_share import attention_length_share, ring_chunk_share
from nest_fx.workload.roofline import SDPA_ATTENTION, AnalyticalCompute
from nest_fx.workload.types import Variant

from _bench_common import print_table, write_json


def block_rows(measured: dict, cluster) -> List[dict]:
    """Per-layer time and saved bytes, measured and predicted, per kernel backend."""
    block = measured["block"]
    spec = block["model"].format(layers=3)
    seq, hidden = block["seq"], 4096
    work = workload_for_model(spec, cluster, seq=seq)
    rows = []
    runs = [("eager", "eager", "model"), ("compile", "compile", "model"), ("eager_fused_norm", "eager", "")]
    for label, backend, norm_kernel in runs:
        if label not in block["per_layer"]:  # measured before the runtime ran F.rms_norm
            continue
        w = work.for_runtime(kernels=backend, norm_kernel=norm_kernel)
        index = next(i for i, layer in enumerate(w.layers) if layer.kind == "block")
        cost = w.cost(index, Variant())
        got = block["per_layer"][label]
        predicted_s = cost.fwd_s + cost.bwd_s
        predicted_b = cost.act_bytes["none"] / (seq * hidden)
        rows.append(
            dict(
                what=f"Llama 3 8B layer, {label}",
                measured_ms=got["step_s"] * 1e3,
                predicted_ms=predicted_s * 1e3,
                time_err_pct=100 * (predicted_s / got["step_s"] - 1),
                measured_bytes=got["bytes_per_token_hidden"],
                predicted_bytes=predicted_b,
                bytes_err_pct=100 * (predicted_b / got["bytes_per_token_hidden"] - 1),
            )
        )
    return rows


def norm_row(measured: dict, cluster) -> dict:
    """One RMSNorm's forward + backward (8,192 x 4,096, bf16), measured (the zoo's code, F.rms_norm:
    a leaf input, so each timed call also accumulates its gradient) and priced (a norm of the layer,
    as the model's ops and as the fused op)."""
    block = measured["block"]
    work = workload_for_model(block["model"].format(layers=3), cluster, seq=block["seq"])
    priced = {}
    for norm_kernel in ("model", ""):
        src = work.for_runtime(norm_kernel=norm_kernel).source
        graph_block = next(b for b in src.graph.blocks if b.kind == "block")
        times = src.variant_times(graph_block, 1, 1, False)
        group = src.facts(graph_block.index).norms[0]
        priced[norm_kernel or "fused"] = sum(f + b for k, (f, b) in enumerate(times) if k in group.members)
    got = block["norm"]
    return dict(
        zoo_measured_ms=got["zoo_rmsnorm_fwd_bwd_s"] * 1e3,
        zoo_priced_ms=priced["model"] * 1e3,
        f_rms_norm_measured_ms=got["f_rms_norm_fwd_bwd_s"] * 1e3,
        f_rms_norm_priced_ms=priced["fused"] * 1e3,
        measured_ratio=got["zoo_rmsnorm_fwd_bwd_s"] / got["f_rms_norm_fwd_bwd_s"],
        priced_ratio=priced["model"] / priced["fused"],
    )


def sdpa_rows(measured: dict, timing: AnalyticalCompute) -> List[dict]:
    """Median measured SDPA rates over the lengths >= 8K (``kernel_fit.attention_shares``, the
    medians a run's fitted rates take) against the rates the roofline prices for the model's device
    (its measured or derived table row, or its cluster file's)."""
    shares = attention_shares(measured["sdpa"]["rows"])
    rows = []
    for kernel in SDPA_ATTENTION:
        model = timing.sdpa_attention.get(kernel)
        if kernel not in shares or model is None:
            continue
        fwd, bwd = shares[kernel]
        rows.append(dict(kernel=kernel, measured_fwd=fwd, model_fwd=model[0], measured_bwd=bwd, model_bwd=model[1]))
    return rows


def length_rows(measured: dict, timing: AnalyticalCompute) -> List[dict]:
    """SDPA's forward + backward rate per (kernel, tokens) against the kernel's median over the
    lengths >= 8K (``kernel_fit.length_ratios``), and the share the model prices for the compared
    device (``attention_length_share``)."""
    return [
        dict(r, model=attention_length_share(r["tokens"], timing.attention_half_tokens))
        for r in length_ratios(measured["sdpa"]["rows"])
    ]


def ring_rows(measured: dict, timing: AnalyticalCompute) -> List[dict]:
    """Ring attention's cost of splitting per (tokens, cp) (``kernel_fit.ring_ratios``), and the
    model's price: the chunk's rate over the sequence's (``ring_chunk_share``)."""
    half = timing.attention_half_tokens
    return [dict(r, model=ring_chunk_share(r["chunk_tokens"], r["tokens"], half)) for r in ring_ratios(measured)]


def gemm_summary(measured: dict, timing: AnalyticalCompute) -> dict:
    """Mean and largest error of e_mm(F) against the measured GEMM shares."""
    errs = [100 * (timing.matmul_eff(r["flops"]) / r["share"] - 1) for r in measured["gemm"]["rows"]]
    large = [100 * (timing.matmul_eff(r["flops"]) / r["share"] - 1) for r in measured["gemm"]["rows"] if r["m"] >= 8192]
    return dict(
        gemms=len(errs),
        mean_abs_err_pct=statistics.mean(abs(e) for e in errs),
        max_abs_err_pct=max(abs(e) for e in errs),
        mean_abs_err_pct_8k_tokens_up=statistics.mean(abs(e) for e in large),
        memory_shares={r["op"]: r["share"] for r in measured["elementwise"]["rows"]},
        model_memory_efficiency=timing.memory_efficiency,
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", default="results/gpu/bench_gpu_kernels_h200.json")
    parser.add_argument("--cluster", default="dgx-h200:1", help="the preset of the measured device")
    parser.add_argument("--out", default="results/gpu/gpu_vs_model")
    args = parser.parse_args(argv)
    with open(args.measured) as fh:
        measured = json.load(fh)
    cluster = load_cluster(args.cluster)
    timing = AnalyticalCompute.for_device(cluster.device, "bf16")
    result = dict(
        measured_on=f"{measured['device']}, torch {measured.get('torch') or measured['environment']['torch']}",
        cluster=args.cluster,
        block=block_rows(measured, cluster),
        norm=norm_row(measured, cluster),
        sdpa=sdpa_rows(measured, timing),
        length=length_rows(measured, timing),
        ring=ring_rows(measured, timing),
        gemm=gemm_summary(measured, timing),
    )
    print(f"measured on {result['measured_on']}; model: {args.cluster}")
    print_table([list(r.values()) for r in result["block"]], list(result["block"][0]), floatfmt=".2f")
    print_table([list(result["norm"].values())], list(result["norm"]), floatfmt=".3f")
    print_table([list(r.values()) for r in result["sdpa"]], list(result["sdpa"][0]), floatfmt=".3f")
    print(json.dumps(result["gemm"], indent=1))
    write_json(args.out + ".json", result)
    with open(args.out + ".md", "w") as fh:
        fh.write(f"# Cost model against one GPU ({result['measured_on']})\n\n")
        fh.write("Written by `python scripts/bench_gpu_vs_model.py` from `scripts/bench_gpu_kernels.py`'s JSON.\n\n")
        fh.write("| layer | measured ms | predicted ms | err | measured B/token/hidden | predicted | err |\n")
        fh.write("|---|---:|---:|---:|---:|---:|---:|\n")
        for r in result["block"]:
            fh.write(
                f"| {r['what']} | {r['measured_ms']:.2f} | {r['predicted_ms']:.2f} | {r['time_err_pct']:+.1f}% | "
                f"{r['measured_bytes']:.2f} | {r['predicted_bytes']:.2f} | {r['bytes_err_pct']:+.2f}% |\n"
            )
        n = result["norm"]
        fh.write(
            "\n| one RMSNorm, 8,192 x 4,096, fwd + bwd | measured ms | priced ms |\n|---|---:|---:|\n"
            f"| the zoo's fp32 code | {n['zoo_measured_ms']:.3f} | {n['zoo_priced_ms']:.3f} |\n"
            f"| F.rms_norm | {n['f_rms_norm_measured_ms']:.3f} | {n['f_rms_norm_priced_ms']:.3f} |\n"
            f"| ratio | {n['measured_ratio']:.2f}x | {n['priced_ratio']:.2f}x |\n"
        )
        fh.write("\n| SDPA kernel | measured fwd | model fwd | measured bwd | model bwd |\n|---|---:|---:|---:|---:|\n")
        for r in result["sdpa"]:
            fh.write(
                f"| {r['kernel']} | {r['measured_fwd']:.3f} | {r['model_fwd']:.2f} | {r['measured_bwd']:.3f} | "
                f"{r['model_bwd']:.2f} |\n"
            )
        if result["length"]:
            fh.write("\n| SDPA kernel | tokens | fwd + bwd rate / its median >= 8K | model |\n|---|---:|---:|---:|\n")
            for r in result["length"]:
                fh.write(f"| {r['kernel']} | {r['tokens']:,} | {r['measured']:.2f} | {r['model']:.2f} |\n")
        if result["ring"]:
            fh.write(
                "\n| ring attention, tokens | cp | chunk tokens | fwd vs whole / cp | fwd + bwd | model |\n"
                "|---:|---:|---:|---:|---:|---:|\n"
            )
            for r in result["ring"]:
                fh.write(
                    f"| {r['tokens']:,} | {r['cp']} | {r['chunk_tokens']:,} | {r['efficiency_fwd']:.2f} | "
                    f"{r['efficiency_fwd_bwd']:.2f} | {r['model']:.2f} |\n"
                )
        g = result["gemm"]
        fh.write(
            f"\nbf16 GEMMs ({g['gemms']}, 512-16,384 tokens): e_mm(F) off by {g['mean_abs_err_pct']:.1f}% on average "
            f"(largest {g['max_abs_err_pct']:.1f}%; {g['mean_abs_err_pct_8k_tokens_up']:.1f}% at >= 8,192 tokens). "
            f"Memory-bound ops: {', '.join(f'{k} {v:.2f}' for k, v in g['memory_shares'].items())} of the "
            f"bandwidth (model e_mem {g['model_memory_efficiency']}).\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
