"""A device's kernel rates fitted from a ``bench_gpu_kernels.py`` run (``cluster/kernel_fit.py``):
the same fits reproduce the roofline's tables from the runs they were made with (the B200's from the
published timings: tests/unit/workload/test_blackwell_rates.py), and the block the script writes
loads into a cluster file whose rates the roofline then prices."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from nest_fx.cluster import Cluster, ClusterError, KernelRates, load_cluster
from nest_fx.cluster.kernel_fit import attention_shares, fit_gemm_curve, kernel_rates_from_run
from nest_fx.workload import AnalyticalCompute
from nest_fx.workload.attention_share import ATTENTION_HALF_RATE_TOKENS
from nest_fx.common.device_family import device_entry
from nest_fx.workload.roofline import GEMM_RAMP_S, SDPA_ATTENTION
from repo_root import ROOT, import_script

GPU = os.path.join(ROOT, "results", "gpu")


def _run(name: str) -> dict:
    with open(os.path.join(GPU, name)) as fh:
        return json.load(fh)


@pytest.mark.parametrize("run", ["bench_gpu_kernels_h200.json", "bench_gpu_kernels_h100.json"])
def test_the_fit_of_each_hopper_run_is_the_tables_curve(run):
    data = _run(run)
    top, ramp, error = fit_gemm_curve(((r["flops"], r["share"]) for r in data["gemm"]["rows"]), data["peak"]["bf16"])
    assert top == pytest.approx(0.75, abs=0.005)  # the default e_max the Hopper rows keep
    assert ramp == pytest.approx(device_entry(GEMM_RAMP_S, data["device"])[1], rel=0.05)
    assert error < 0.08


def test_the_attention_medians_are_the_sdpa_table():
    shares = attention_shares(_run("bench_gpu_kernels_h200.json")["sdpa"]["rows"])
    for kernel, table in SDPA_ATTENTION.items():
        assert shares[kernel] == pytest.approx(device_entry(table, "NVIDIA H200")[1:], abs=0.006)
    assert attention_shares([{"backend": "cudnn", "seq": 2048, "fwd_share": 0.5, "bwd_share": 0.4}]) == {}


def test_a_runs_rates_load_as_a_cluster_file_and_price_the_device(tmp_path):
    script = import_script("bench_gpu_kernels")
    assert script.main(["--rates-from", os.path.join(GPU, "bench_gpu_kernels_h100.json"), "--out", str(tmp_path)]) == 0
    with open(tmp_path / "kernel_rates.yaml") as fh:
        block = yaml.safe_load(fh)
    rates = KernelRates.from_dict(block["kernel_rates"])
    assert rates.attention["fused"] == rates.attention["cudnn"]  # Transformer Engine's attention is cuDNN's
    cluster = load_cluster("dgx-b200:8").to_dict()
    cluster["device"]["kernel_rates"] = block["kernel_rates"]
    device = Cluster.from_dict(cluster).device
    timing = AnalyticalCompute.for_device(device)
    assert timing.matmul_efficiency == rates.gemm_efficiency
    assert timing.matmul_ramp_s == rates.gemm_ramp
    assert timing.sdpa_attention["cudnn"] == rates.attention["cudnn"]  # measured replaces derived
    assert timing.attention_half_tokens == rates.attention_half_tokens  # the H100 run's own length law
    assert rates.attention_half_tokens == pytest.approx(ATTENTION_HALF_RATE_TOKENS, rel=0.2)


def test_runs_that_measured_nothing_are_refused():
    with pytest.raises(ClusterError, match="--smoke run measures no kernel rates"):
        kernel_rates_from_run({"smoke": True, "gemm": {"rows": []}})
    with pytest.raises(ClusterError, match="neither a 'gemm' nor an 'sdpa' section"):
        kernel_rates_from_run({"peak": {"bf16": 1e15}, "gemm": {"error": "OOM"}, "sdpa": {"error": "OOM"}})
    with pytest.raises(ClusterError, match="two or more measured GEMMs"):
        fit_gemm_curve([(1e9, 0.5)], 1e15)
    only_sdpa = kernel_rates_from_run(
        {
            "peak": {"bf16": 1e15},
            "sdpa": {"rows": [{"backend": "flash", "seq": 8192, "fwd_share": 0.3, "bwd_share": 0.2}]},
        }
    )
    assert only_sdpa == KernelRates({"flash": (0.3, 0.2)})  # the GEMM curve and the length law left to the tables


def test_the_scripts_peaks_are_the_presets_by_name():
    script = import_script("bench_gpu_kernels")
    assert script.preset_peaks("NVIDIA B200") == {"bf16": 2.25e15, "fp8": 4.5e15, "hbm": 8e12}
    assert script.preset_peaks("NVIDIA GB200")["bf16"] == 2.5e15  # not the B200's
    assert script.preset_peaks("NVIDIA H100 80GB HBM3", {"bf16": 756e12})["bf16"] == 756e12  # an H100 PCIe's
    with pytest.raises(SystemExit, match="--peak-bf16"):
        script.preset_peaks("NVIDIA RTX PRO 6000")
    named = {"bf16": 1e15, "fp8": 2e15, "hbm": 1.6e12}
    assert script.preset_peaks("NVIDIA RTX PRO 6000", named) == named


def test_a_smoke_run_on_cpu_measures_the_sections_but_fits_nothing(tmp_path):
    """The script's CPU path (the GPU run is the same code at full shapes)."""
    script = import_script("bench_gpu_kernels")
    assert script.main(["--smoke", "--out", str(tmp_path), "--sections", "gemm", "sdpa", "ring"]) == 0
    with open(tmp_path / "bench_gpu_kernels.json") as fh:
        run = json.load(fh)
    assert run["smoke"] and run["gemm"]["rows"] and run["sdpa"]["rows"] and run["ring"]["rows"]
    assert not (tmp_path / "kernel_rates.yaml").exists()  # tiny CPU shapes are no device's rates
