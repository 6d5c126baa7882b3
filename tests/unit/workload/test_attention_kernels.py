"""The SDPA attention kernel a plan is priced and run with (``plan.attention_kernel``)."""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch

from nest_fx.apply.sdpa_kernel import pinned_attention, sdpa_order
from nest_fx.cluster import load_cluster
from nest_fx.cost.step_time import simulate
from nest_fx.plan import Plan, StagePlan
from nest_fx.workload import workload_for_model
from nest_fx.workload.roofline import DEFAULT_ATTENTION_KERNEL, SDPA_ATTENTION
from repo_root import ROOT

MEASURED = os.path.join(ROOT, "results", "gpu", "bench_gpu_kernels_h200.json")
LLAMA = "llama:hidden=1024,layers=2,heads=8,kv=2,ffn=2816,seq=8192,vocab=32000"


def test_the_priced_rates_are_the_measured_ones():
    """SDPA_ATTENTION holds the medians (8K-131K tokens) of the H200 run, to two decimals."""
    with open(MEASURED) as fh:
        rows = json.load(fh)["sdpa"]["rows"]
    for kernel, table in SDPA_ATTENTION.items():
        runs = [r for r in rows if r["backend"] == kernel and r["seq"] >= 8192]
        assert len(runs) == 3, kernel
        fwd = statistics.median(r["fwd_share"] for r in runs)
        bwd = statistics.median(r["bwd_share"] for r in runs)
        for part, f, b in table:
            assert (f, b) == pytest.approx((fwd, bwd), abs=0.006), (kernel, part)


@pytest.fixture(scope="module")
def llama_h100():
    cluster = load_cluster("dgx-h100:8")
    return workload_for_model(LLAMA, cluster, seq=8192), cluster


def _plan(work, **fields):
    return Plan(stages=[StagePlan(0, len(work), 1, "none")], num_layers=len(work), dp=8, **fields)


def test_flash_attention_is_priced_slower_than_the_default(llama_h100):
    work, cluster = llama_h100
    default = simulate(_plan(work), work, cluster)
    named = simulate(_plan(work, attention_kernel=DEFAULT_ATTENTION_KERNEL), work, cluster)
    flash = simulate(_plan(work, attention_kernel="flash"), work, cluster)
    assert named.step_s == default.step_s  # '' is the default kernel
    assert flash.step_s > default.step_s * 1.02
    # the same workload object for '' and the default's name; another for flash
    assert work.for_runtime(attention_kernel="cudnn") is work
    flash_work = work.for_runtime(attention_kernel="flash")
    assert flash_work is not work and flash_work.attention_kernel == "flash"
    assert work.for_runtime(kernels="compile", attention_kernel="flash").base is work


def test_the_runtime_pins_the_plans_kernel_first():
    from torch.nn.attention import SDPBackend

    assert sdpa_order("")[0] == SDPBackend.CUDNN_ATTENTION
    assert sdpa_order("flash")[0] == SDPBackend.FLASH_ATTENTION
    assert SDPBackend.CUDNN_ATTENTION not in sdpa_order("flash")  # torch >= 2.11 would pick it first
    assert SDPBackend.MATH in sdpa_order("flash") and SDPBackend.FLASH_ATTENTION in sdpa_order("cudnn")
    # on CPU nothing is pinned (SDPA's CPU kernels; no CUDA rate priced)
    with pinned_attention("flash", torch.device("cpu")):
        q = torch.randn(1, 2, 8, 4)
        assert torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).shape == q.shape


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="SDPA's CUDA kernel choice needs a GPU (CPU path tested above)"
)
def test_on_cuda_the_pinned_kernel_is_the_one_sdpa_runs():
    """The backward node autograd records names the kernel the forward ran."""
    q = torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for kernel, node in (("flash", "Flash"), ("cudnn", "Cudnn"), ("", "Cudnn")):
        with pinned_attention(kernel, q.device):
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert node in type(out.grad_fn).__name__, (kernel, type(out.grad_fn).__name__)


def test_the_gemm_ramp_is_the_measured_fit():
    """On Hopper F_half = peak x GEMM_RAMP_S: the best fit (mean relative error) of e_max F / (F + F_half)
    to the H200's 40 measured GEMMs, to 1 GFLOP; the old 2 GFLOP fits them worse; fp32 scales it."""
    from nest_fx.workload.roofline import AnalyticalCompute

    with open(MEASURED) as fh:
        gemms = json.load(fh)["gemm"]["rows"]
    timing = AnalyticalCompute.for_device(load_cluster("dgx-h200:1").device)

    def error(half: float) -> float:
        return statistics.mean(abs(0.75 * r["flops"] / (r["flops"] + half) / r["share"] - 1) for r in gemms)

    best = min((h * 1e9 for h in range(1, 31)), key=error)
    assert timing.matmul_half_flops == pytest.approx(best, abs=1e9)
    assert error(timing.matmul_half_flops) < error(2e9) / 2
    fp32 = timing.in_dtype("fp32")
    assert fp32.matmul_half_flops == pytest.approx(timing.matmul_half_flops * 67e12 / 989e12)
    a100 = AnalyticalCompute.for_device(load_cluster("dgx-a100:8").device)
    assert a100.matmul_half_flops == 2e9  # not measured there
