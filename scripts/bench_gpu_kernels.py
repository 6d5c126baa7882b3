#!/usr/bin/env python
"""Measure on one GPU the kernel rates the cost model assumes (issue 26: "each factor measured").

    python scripts/bench_gpu_kernels.py --out results/gpu           # one CUDA device, ~5 min
    python scripts/bench_gpu_kernels.py --smoke --out /tmp/k        # tiny shapes on CPU (a check of the script)
    python scripts/bench_gpu_kernels.py --rates-from RUN.json --out /tmp/k   # any machine: fit a run's rates

A GPU run (and ``--rates-from``) ends with the device's fitted kernel rates, the block a cluster
file takes under ``device:`` (``<out>/kernel_rates.yaml``; ``nest_fx.cluster.kernel_fit``: the
GEMM curve and the attention medians the roofline's tables were made with), so a device no table
measures (or one whose table is derived, as Blackwell's) gets its own rates. Shares are of the
datasheet peaks of the device's preset (A100, H100, H200, B200, GB200, by name); another GPU
needs ``--peak-bf16``, ``--peak-fp8`` and ``--hbm``.

Sections (each one written to ``<out>/bench_gpu_kernels.json`` as soon as it ends, so a run cut
short keeps what it measured; a section that fails records its error and the next one runs):

``gemm``       bf16 matmuls of the Llama 3 linears' shapes (8B whole, 70B and 405B TP-8 shards)
               at 512-16,384 tokens: achieved share of the device's dense bf16 peak, against the
               roofline's ``e_max F / (F + F_half)`` (``workload/roofline.py``).
``fp8``        the same shapes through ``torch._scaled_mm`` (e4m3, tensor-wise and row-wise
               scales), the ratio to bf16, and the cast of one activation (amax, scale, cast)
               that a Float8 linear adds.
``elementwise`` bf16 add, fp32 up-cast and SiLU x mul on 2^28 elements: achieved share of the
               memory bandwidth (the roofline's ``e_mem``).
``sdpa``       causal SDPA forward and forward + backward, head dim 128, 2K-128K tokens, per
               backend (flash, cuDNN, memory-efficient): share of the bf16 peak
               (``roofline.SDPA_ATTENTION`` holds the medians of this section).
``ring``       one context-parallel rank's attention work with the load-balanced layout
               (rank i holds chunks i and 2cp-1-i; step 0 causal over its own block, then cp-1
               non-causal half-block calls and the log-sum-exp merges), computed on this one
               GPU without communication: its time against the ideal (the whole causal
               attention through the same kernel, divided by cp).
``block``      the zoo Llama (Llama 3 8B's layer shape: hidden 4096, 32 heads, 8 KV heads,
               FFN 14,336) at 8,192 tokens, eager and ``torch.compile`` per block as the runtime
               compiles it: forward + backward time and the bytes saved for backward per layer
               (layers=3 minus layers=1, halved), per token per hidden unit; the same eager
               with the norms swapped to ``F.rms_norm`` as nest-fx's runtime runs them by default
               (``eager_fused_norm``: ``apply/fused_norms.py``, ``plan.norm_kernel``) and to
               norms keeping their output (``eager_memory_efficient_norm``,
               ``norm_kernel=memory-efficient``); also ``F.rms_norm`` and the output-saving norm
               against the zoo's fp32 RMSNorm.

The predictions these figures are compared with are computed on any machine from the JSON
(``docs/cost_model.md``, "Measured on a GPU").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
import yaml

from nest_fx.apply.fused_norms import use_fused_norms
from nest_fx.cluster import ClusterError
from nest_fx.cluster.kernel_fit import kernel_rates_from_run
from nest_fx.cluster.presets import A100_80GB, B200, GB200, H100_SXM, H200_SXM
from nest_fx.common.device_family import device_entry
from nest_fx.apply.output_saving_norm import output_saving_rms_norm
from nest_fx.apply.losses import lm_loss
from profiler.recompute_memory import packed_bytes

from _bench_common import write_json
from _ring_attention_bench import ring

# the presets whose datasheet peaks a run's shares are of, by the device name's family
# (common.device_family; nest_fx.cluster.presets: dense bf16 / fp8 peaks and HBM bandwidth)
PRESET_DEVICES = (("A100", A100_80GB), ("H100", H100_SXM), ("H200", H200_SXM), ("B200", B200), ("GB200", GB200))


class Timer:
    """Median time of a callable: CUDA events on a GPU, wall clock otherwise."""

    def __init__(self, device: torch.device, warmup: int, repeats: int):
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def __call__(self, fn: Callable[[], object], repeats: int = 0) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(repeats or self.repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def preset_peaks(name: str, override: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """bf16 and fp8 peak FLOP/s and HBM bytes/s of the GPU called ``name``: its family's preset
    (``PRESET_DEVICES``), each replaced by ``override`` where given; a GPU no preset names needs
    all three (SystemExit naming the flags)."""
    override = {k: v for k, v in (override or {}).items() if v}
    entry = device_entry(PRESET_DEVICES, name)
    if entry is None:
        if set(override) >= {"bf16", "fp8", "hbm"}:
            return override
        raise SystemExit(
            f"no preset names {name!r}: give its dense peaks, e.g. --peak-bf16 989e12 --peak-fp8 1979e12 --hbm 3.35e12"
        )
    spec = entry[1]
    return {"bf16": spec.peak("bf16"), "fp8": spec.peak_flops.get("fp8", 0.0), "hbm": spec.mem_bandwidth, **override}


def peaks_of(device: torch.device, override: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """The peaks the shares are of: :func:`preset_peaks` of the CUDA device; placeholders on CPU."""
    if device.type != "cuda":
        return {"bf16": 1e12, "fp8": 2e12, "hbm": 1e11}  # placeholders: the smoke run checks code paths only
    return preset_peaks(torch.cuda.get_device_name(device), override)


def gemm(ctx) -> dict:
    """bf16 matmul share of peak per (tokens, in, out) shape."""
    rows = []
    for m in ctx.tokens:
        for name, k, n in ctx.linears:
            a = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16)
            b = torch.randn(k, n, device=ctx.device, dtype=torch.bfloat16)
            t = ctx.timer(lambda: a @ b)
            flops = 2.0 * m * k * n
            rows.append(dict(linear=name, m=m, k=k, n=n, flops=flops, s=t, share=flops / t / ctx.peak["bf16"]))
    return {"rows": rows}


def fp8(ctx) -> dict:
    """``torch._scaled_mm`` against bf16 at the same shapes, and one activation's cast."""
    e4m3 = torch.float8_e4m3fn
    rows = []
    for m in ctx.tokens[-2:]:
        for name, k, n in ctx.linears:
            a = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16)
            b = torch.randn(n, k, device=ctx.device, dtype=torch.bfloat16)
            a8, b8 = a.to(e4m3), b.to(e4m3).t()  # b8 column-major, as _scaled_mm wants it
            one = torch.ones((), device=ctx.device)
            row = dict(linear=name, m=m, k=k, n=n)
            row["bf16_s"] = ctx.timer(lambda: a @ b.t())
            row["tensorwise_s"] = ctx.timer(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
            sa = torch.ones(m, 1, device=ctx.device)
            sb = torch.ones(1, n, device=ctx.device)
            try:
                row["rowwise_s"] = ctx.timer(lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16))
            except RuntimeError as exc:
                row["rowwise_error"] = str(exc).splitlines()[0]

            def cast():
                scale = 448.0 / a.abs().amax().float().clamp(min=1e-12)
                return (a.float() * scale).to(e4m3)

            row["cast_s"] = ctx.timer(cast)
            rows.append(row)
    return {"rows": rows}


def elementwise(ctx) -> dict:
    """Achieved bandwidth of three memory-bound ops."""
    n = ctx.elements
    x = torch.randn(n, device=ctx.device, dtype=torch.bfloat16)
    y = torch.randn(n, device=ctx.device, dtype=torch.bfloat16)
    cases = {
        "add bf16": (lambda: x + y, 6 * n),
        "to fp32": (lambda: x.float(), 6 * n),
        "silu(x) * y bf16": (lambda: F.silu(x) * y, 10 * n),  # two kernels: silu writes, mul reads it back
    }
    rows = []
    for name, (fn, traffic) in cases.items():
        t = ctx.timer(fn)
        rows.append(dict(op=name, bytes=traffic, s=t, share=traffic / t / ctx.peak["hbm"]))
    return {"rows": rows}


def attention_flops(b: int, h: int, q: int, kv: int, d: int, causal: bool) -> float:
    """Forward FLOPs of attention: two matmuls of q x kv x d per head, half of them under a causal mask."""
    flops = 4.0 * b * h * q * kv * d
    return flops / 2 if causal else flops


def _backends():
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }


def sdpa(ctx) -> dict:
    """Causal SDPA share of the bf16 peak, forward and forward + backward, per backend."""
    from torch.nn.attention import sdpa_kernel

    rows = []
    for b, s in ctx.attention_shapes:
        h, d = ctx.heads, 128 if not ctx.smoke else 16
        q, k, v = (
            torch.randn(b, h, s, d, device=ctx.device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        grad = torch.randn_like(q)
        fwd_flops = attention_flops(b, h, s, s, d, causal=True)
        for name, backend in _backends().items():
            if name not in ctx.sdpa_backends:
                continue
            row = dict(backend=name, batch=b, heads=h, seq=s, head_dim=d, fwd_flops=fwd_flops)
            try:
                with sdpa_kernel([backend]):
                    row["fwd_s"] = ctx.timer(
                        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats=ctx.long_repeats
                    )
                    row["fwd_bwd_s"] = ctx.timer(
                        lambda: torch.autograd.backward(F.scaled_dot_product_attention(q, k, v, is_causal=True), grad),
                        repeats=ctx.long_repeats,
                    )
                row["fwd_share"] = fwd_flops / row["fwd_s"] / ctx.peak["bf16"]
                # backward = 2.5 x forward FLOPs (FlashAttention-2's count: 5 matmuls, one recomputed)
                row["fwd_bwd_share"] = 3.5 * fwd_flops / row["fwd_bwd_s"] / ctx.peak["bf16"]
                row["bwd_share"] = 2.5 * fwd_flops / (row["fwd_bwd_s"] - row["fwd_s"]) / ctx.peak["bf16"]
            except RuntimeError as exc:
                row["error"] = str(exc).splitlines()[0][:200]
            rows.append(row)
    return {"rows": rows}


def _block_run(ctx, layers: int, compiled: bool, norm_kernel: str = "model") -> dict:
    from nest_fx.models.zoo import build_model

    torch.manual_seed(0)
    model, cfg = build_model(ctx.llama.format(layers=layers), device=ctx.device, dtype=torch.bfloat16)
    if norm_kernel != "model":  # '' (the runtime's default): F.rms_norm; memory-efficient: output-saving norms
        use_fused_norms(model, norm_kernel)
    if compiled:
        for block in model.layers:
            block.forward = torch.compile(block.forward)
    tokens = torch.randint(0, cfg.vocab_size, (1, ctx.seq), device=ctx.device)

    def step():
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        return loss

    first = time.perf_counter()
    step()  # compiles, if compiled
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - first
    t = ctx.timer(step)
    saved = 0
    if ctx.device.type == "cuda":
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        logits = model(tokens)
        torch.cuda.synchronize()
        saved = torch.cuda.memory_allocated() - before - logits.numel() * logits.element_size()
        del logits
    else:  # no allocator to read: the storages autograd packs (parameters, buffers, inputs left out)
        saved = packed_bytes(model, [tokens])
    return dict(
        layers=layers,
        compiled=compiled,
        fused_norms=norm_kernel == "",
        norm_kernel=norm_kernel,
        first_step_s=first,
        step_s=t,
        saved_bytes=saved,
    )


def block(ctx) -> dict:
    """Per-layer forward + backward time and saved bytes of the zoo Llama: eager (the model's own
    RMSNorm code), compiled, eager with F.rms_norm (``eager_fused_norm``) and eager with the norms
    keeping their output (``eager_memory_efficient_norm``, ``norm_kernel=memory-efficient``)."""
    rows, per_layer = [], {}
    for label, compiled, norm_kernel in (
        ("eager", False, "model"),
        ("compile", True, "model"),
        ("eager_fused_norm", False, ""),
        ("eager_memory_efficient_norm", False, "memory-efficient"),
    ):
        runs = {n: _block_run(ctx, n, compiled, norm_kernel) for n in (1, 3)}
        rows.extend(runs.values())
        per_layer[label] = dict(
            step_s=(runs[3]["step_s"] - runs[1]["step_s"]) / 2,
            saved_bytes=(runs[3]["saved_bytes"] - runs[1]["saved_bytes"]) / 2,
        )
        per_layer[label]["bytes_per_token_hidden"] = per_layer[label]["saved_bytes"] / (ctx.seq * ctx.hidden)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    norm = _norms(ctx)
    return {"rows": rows, "per_layer": per_layer, "norm": norm, "model": ctx.llama, "seq": ctx.seq}


def _norms(ctx) -> dict:
    from nest_fx.models.layers import RMSNorm

    x = torch.randn(ctx.seq, ctx.hidden, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    module = RMSNorm(ctx.hidden).to(ctx.device, torch.bfloat16)
    weight = module.weight
    out = {}
    out["zoo_rmsnorm_fwd_bwd_s"] = ctx.timer(lambda: torch.autograd.backward(module(x), g))
    out["f_rms_norm_fwd_bwd_s"] = ctx.timer(
        lambda: torch.autograd.backward(F.rms_norm(x, (ctx.hidden,), weight, 1e-5), g)
    )
    out["output_saving_rms_norm_fwd_bwd_s"] = ctx.timer(
        lambda: torch.autograd.backward(output_saving_rms_norm(x, (ctx.hidden,), weight, 1e-5), g)
    )
    return out


SECTIONS = {"gemm": gemm, "fp8": fp8, "elementwise": elementwise, "sdpa": sdpa, "ring": ring, "block": block}


class Context:
    """Shapes and timing for a full GPU run or a CPU smoke run."""

    def __init__(self, smoke: bool, device: torch.device, peaks: Optional[Dict[str, float]] = None):
        self.smoke, self.device = smoke, device
        self.peak = peaks_of(device, peaks)
        if smoke:
            self.timer = Timer(device, warmup=1, repeats=2)
            self.tokens = [64, 128]
            self.linears = [("tiny", 64, 96)]
            self.elements = 1 << 16
            self.heads, self.attention_shapes, self.long_repeats = 2, [(1, 64)], 1
            self.ring_seqs, self.ring_cps = [64], [2, 4]
            self.sdpa_backends = ("math",)
            self.llama = "llama:hidden=64,layers={layers},heads=4,kv=2,ffn=128,seq=64,vocab=128"
            self.seq, self.hidden = 64, 64
        else:
            self.timer = Timer(device, warmup=3, repeats=10)
            self.tokens = [512, 2048, 8192, 16384]
            self.linears = [
                ("8B q/o", 4096, 4096),
                ("8B k/v", 4096, 1024),
                ("8B gate/up", 4096, 14336),
                ("8B down", 14336, 4096),
                ("70B/TP8 qkv", 8192, 1280),
                ("70B/TP8 gate/up", 8192, 3584),
                ("70B/TP8 down", 3584, 8192),
                ("405B/TP8 o", 2048, 16384),
                ("405B/TP8 gate/up", 16384, 6656),
                ("405B/TP8 down", 6656, 16384),
            ]
            self.elements = 1 << 28
            self.heads, self.long_repeats = 32, 3
            self.attention_shapes = [(8, 2048), (2, 8192), (1, 32768), (1, 131072)]
            self.ring_seqs, self.ring_cps = [32768, 131072], [2, 4, 8]
            self.sdpa_backends = ("flash", "cudnn", "efficient")
            self.llama = "llama:hidden=4096,layers={layers},heads=32,kv=8,ffn=14336,seq=8192,vocab=32000"
            self.seq, self.hidden = 8192, 4096


def write_kernel_rates(run: dict, out: str) -> str:
    """The run's fitted rates as a ``device.kernel_rates`` block (docs/cluster_format.md), written
    to ``<out>/kernel_rates.yaml`` and printed; the path."""
    rates = kernel_rates_from_run(run)
    text = yaml.safe_dump({"kernel_rates": rates.to_dict()}, sort_keys=False, default_flow_style=None)
    path = os.path.join(out, "kernel_rates.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"# {run.get('device', 'the device')}: paste under device: in a cluster file\n{text}")
    print(f"kernel rates of {run.get('device')} (device.kernel_rates):\n{text}wrote {path}")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/gpu", help="folder for bench_gpu_kernels.json and kernel_rates.yaml")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (on CPU when no GPU): checks the code paths")
    parser.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument(
        "--rates-from", metavar="JSON", help="no run: fit the kernel rates of an earlier run's JSON (any machine)"
    )
    for flag, what in (
        ("--peak-bf16", "dense bf16 FLOP/s"),
        ("--peak-fp8", "dense fp8 FLOP/s"),
        ("--hbm", "HBM bytes/s"),
    ):
        parser.add_argument(
            flag, type=float, help=f"the GPU's {what} (default: its preset's; needed where none names it)"
        )
    args = parser.parse_args(argv)
    if args.rates_from:
        with open(args.rates_from, encoding="utf-8") as fh:
            run = json.load(fh)
        os.makedirs(args.out, exist_ok=True)
        write_kernel_rates(run, args.out)
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: this benchmark measures a GPU (use --smoke to check the script on CPU)")
        return 2
    ctx = Context(args.smoke, device, {"bf16": args.peak_bf16, "fp8": args.peak_fp8, "hbm": args.hbm})
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_gpu_kernels.json")
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cuda": torch.version.cuda,
        "peak": ctx.peak,
        "smoke": args.smoke,
    }
    for name in args.sections:
        start = time.perf_counter()
        try:
            result[name] = SECTIONS[name](ctx)
        except Exception as exc:  # a failed section must not lose the others' figures
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-2000:]}
        result[name]["section_s"] = time.perf_counter() - start
        print(
            f"{name}: {result[name]['section_s']:.1f} s",
            "ERROR " + result[name]["error"] if "error" in result[name] else "",
        )
        sys.stdout.flush()
        write_json(path, result, quiet=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {path}")
    if not args.smoke and ("gemm" in args.sections or "sdpa" in args.sections):
        try:
            write_kernel_rates(result, args.out)
        except ClusterError as exc:  # both sections failed: the JSON says why
            print(f"no kernel rates: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
