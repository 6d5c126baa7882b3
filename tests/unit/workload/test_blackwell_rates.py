"""Blackwell's kernel rates: sourced, not measured here (``roofline`` module docstring, "Blackwell").

The B200's GEMM curve is the fit of published B200 GEMM timings (``results/sourced/``); the GB200's
and both devices' attention rates are derived from measured ones by documented ratios; each device
gets its own row of the tables, never a shorter name's (a GB200 is not priced as a B200)."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.cluster.kernel_fit import fit_gemm_curve
from nest_fx.workload.roofline import (
    B200_ATTENTION_SCALE,
    GB200_RATE_SCALE,
    SDPA_ATTENTION,
    AnalyticalCompute,
    rates_source,
)
from nest_fx.common.device_family import device_entry, device_family
from nest_fx.cost.error_bands import BANDED_FAMILIES, DEVICE_BANDS, error_band
from nest_fx.plan import uniform_plan
from repo_root import ROOT

SOURCED = os.path.join(ROOT, "results", "sourced", "b200_bf16_gemm_vllm.json")


def _timing(preset: str) -> AnalyticalCompute:
    return AnalyticalCompute.for_device(load_cluster(preset).device)


def test_the_b200_gemm_curve_is_the_fit_of_the_published_timings():
    with open(SOURCED) as fh:
        data = json.load(fh)
    peak = data["peak_bf16_flops"]
    rows = [(2 * r["m"] * r["n"] * r["k"], r["tflops"] * 1e12 / peak) for r in data["rows"]]
    top, ramp, error = fit_gemm_curve(rows, peak)
    b200 = _timing("dgx-b200:8")
    assert b200.peak_flops == peak
    assert b200.matmul_efficiency == pytest.approx(top, abs=0.002)
    assert b200.matmul_ramp_s == pytest.approx(ramp, rel=0.05)
    assert error < 0.02
    defaults = statistics.mean(abs(0.75 * f / (f + 2e9) / share - 1) for f, share in rows)
    assert defaults > 5 * error  # the defaults it replaces price these GEMMs 14% fast
    # the best shape of all reaches more than the curve's top: the fit is of Llama's shapes
    best_shape = data["best_shapes"]["B200 SXM"]
    assert best_shape["tflops"] / best_shape["peak"] > b200.matmul_efficiency


def test_the_gb200_runs_the_b200s_rates_scaled_by_their_best_matmul_shares():
    with open(SOURCED) as fh:
        shapes = json.load(fh)["best_shapes"]
    share = {name: s["tflops"] / s["peak"] for name, s in shapes.items() if name != "source"}
    assert GB200_RATE_SCALE == pytest.approx(share["GB200 SXM"] / share["B200 SXM"], abs=1e-3)
    b200, gb200 = _timing("dgx-b200:8"), _timing("gb200-nvl72:8")
    assert gb200.matmul_efficiency == pytest.approx(b200.matmul_efficiency * GB200_RATE_SCALE, abs=1e-3)
    assert gb200.matmul_ramp_s == b200.matmul_ramp_s  # the same silicon: the same ramp in time
    for kernel in ("cudnn", "flash"):
        for rate_b, rate_gb in zip(b200.sdpa_attention[kernel], gb200.sdpa_attention[kernel]):
            assert rate_gb == pytest.approx(rate_b * GB200_RATE_SCALE, abs=2e-3)


def test_blackwell_attention_is_hoppers_measured_share_scaled_by_the_best_kernels():
    assert B200_ATTENTION_SCALE == pytest.approx((1613 / 2250) / (740 / 989), abs=1e-3)
    b200 = _timing("dgx-b200:8")
    for kernel, table in SDPA_ATTENTION.items():
        hopper = device_entry(table, "H100-SXM5-80GB")[1:]
        assert b200.sdpa_attention[kernel] == pytest.approx(tuple(r * B200_ATTENTION_SCALE for r in hopper), abs=1e-3)
    fwd, bwd = b200.sdpa_attention["cudnn"]
    # FlashAttention-4's account: the backward (shared memory) below the forward (exponentials),
    # both below the GEMMs; kernels=fused (Transformer Engine) runs cuDNN's attention
    assert bwd < fwd < b200.matmul_efficiency
    assert b200.fa3_attention == (fwd, bwd)
    assert b200.attention_efficiency == fwd  # a plan naming no kernel: cuDNN


@pytest.mark.parametrize(
    "name, family",
    [
        ("GB200-186GB", "GB200"),
        ("NVIDIA GB200", "GB200"),
        ("B200-SXM-180GB", "B200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("A100-SXM4-80GB", None),
        ("NVIDIA GH200 480GB", None),  # a Grace Hopper superchip: no preset, not an H200
        ("h100", "H100"),
    ],
)
def test_each_device_gets_its_own_family_row(name, family):
    from nest_fx.workload.roofline import GEMM_RAMP_S

    rows = (("B200", 1), ("GB200", 2), ("H100", 3))
    entry = device_entry(rows, name)
    assert (entry[0] if entry else None) == family
    assert device_entry(tuple(reversed(rows)), name) == entry  # not the table's order
    if family:
        assert device_entry(GEMM_RAMP_S, name)[0] == family


@pytest.mark.parametrize(
    "name", ["NVIDIA GH200 480GB", "h100", "NVIDIA H200", "GB200-186GB", "TPUv4", "A100-SXM4-80GB"]
)
def test_a_device_gets_measured_rates_exactly_when_it_gets_a_band(name):
    """One reading of device names (``common.device_family``): the kernel rates and the error band
    of a name never disagree about which GPU it is."""
    plan = uniform_plan(4, dp=1, microbatch_size=1, num_microbatches=1)
    rated = not rates_source(name).startswith("no kernel rates")
    banded = error_band(plan, name).rel is not None
    assert rated <= banded  # rates from published or measured runs only where runs check them
    if rated:
        assert device_family(name) in set(BANDED_FAMILIES) | set(DEVICE_BANDS)


def test_unmeasured_devices_keep_the_documented_defaults():
    a100 = _timing("dgx-a100:8")
    assert (a100.matmul_efficiency, a100.matmul_half_flops) == (0.75, 2e9)
    assert a100.sdpa_attention == {} and a100.fa3_attention is None
    h100 = _timing("dgx-h100:8")
    assert h100.matmul_efficiency == 0.75 and h100.sdpa_attention["cudnn"] == (0.64, 0.52)


def test_a_b200_step_is_priced_slower_than_its_datasheet_alone_would_price_it():
    """The sourced rates, not the peak with the A100-era defaults: a Llama step on a B200 costs more
    than with e_max 0.75, a 2 GFLOP ramp and attention at e_max, and less than on an H100."""
    from nest_fx.cost.step_time import simulate
    from nest_fx.plan import uniform_plan
    from nest_fx.workload import workload_for_model

    model = "llama:hidden=2048,layers=2,heads=16,kv=4,ffn=5632,vocab=32000"
    times = {}
    for preset in ("dgx-b200:8", "dgx-h100:8"):
        cluster = load_cluster(preset)
        work = workload_for_model(model, cluster, seq=8192)
        plan = uniform_plan(len(work), dp=8, microbatch_size=1, num_microbatches=1)
        times[preset] = simulate(plan, work, cluster).step_s
    b200 = load_cluster("dgx-b200:8")
    b200.device.name = "Unmeasured-180GB"  # the same peaks under a name no table has
    work = workload_for_model(model, b200, seq=8192)
    plan = uniform_plan(len(work), dp=8, microbatch_size=1, num_microbatches=1)
    datasheet_only = simulate(plan, work, b200).step_s
    assert datasheet_only < times["dgx-b200:8"] < times["dgx-h100:8"]


def test_the_workload_says_where_its_kernel_rates_come_from():
    """The provenance `plan` prints in its first line: measured, derived, a cluster file's, or none."""
    import copy

    from nest_fx.cluster import KernelRates
    from nest_fx.workload import workload_for_model

    said = {}
    for preset in ("dgx-h100:8", "dgx-b200:8", "gb200-nvl72:8", "dgx-a100:8"):
        said[preset] = _timing(preset).rates_source
    assert "measured" in said["dgx-h100:8"]
    assert "derived from published" in said["dgx-b200:8"] == said["gb200-nvl72:8"]
    assert "no kernel rates measured" in said["dgx-a100:8"]
    a100 = load_cluster("dgx-a100:8")
    a100.device = copy.deepcopy(a100.device)
    a100.device.kernel_rates = KernelRates(gemm_efficiency=0.8)
    assert "cluster file" in AnalyticalCompute.for_device(a100.device).rates_source
    work = workload_for_model("llama:hidden=256,layers=2,heads=4,vocab=512", load_cluster("dgx-b200:8"), seq=512)
    assert work.provenance.endswith(said["dgx-b200:8"])
