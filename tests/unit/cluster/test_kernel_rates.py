"""A device's measured kernel rates in its cluster file (``device.kernel_rates``): loaded, checked,
written back, and priced by the roofline in place of its per-device-name tables."""

from __future__ import annotations

import copy
import pathlib
import re

import pytest
import yaml

from nest_fx.cluster import Cluster, ClusterError, KernelRates
from nest_fx.cost.step_time import simulate
from nest_fx.plan import uniform_plan
from nest_fx.workload import AnalyticalCompute, workload_for_model
from nest_fx.workload.attention_share import ATTENTION_HALF_RATE_TOKENS
from nest_fx.workload.roofline import FUSED_ATTENTION, GEMM_RAMP_S, SDPA_ATTENTION
from repo_root import ROOT


def _file(name: str = "MyGPU", rates=None) -> dict:
    device = {
        "name": name,
        "memory_bytes": "80GiB",
        "peak_flops": {"bf16": "1000T", "fp32": "60T"},
        "mem_bandwidth": "3TB/s",
    }
    if rates is not None:
        device["kernel_rates"] = rates
    return {
        "format": "nest-fx-cluster/1",
        "name": "lab",
        "num_devices": 8,
        "device": device,
        "levels": [{"name": "node", "group_size": 8, "bandwidth": "300GB/s", "latency": "5us"}],
    }


RATES = {
    "attention": {"cudnn": [0.5, 0.4], "fused": [0.7, 0.6]},
    "gemm_ramp": "8us",
    "gemm_efficiency": 0.7,
    "attention_half_tokens": 400,
}


def test_kernel_rates_load_and_round_trip(tmp_path):
    cluster = Cluster.from_dict(_file(rates=RATES))
    rates = cluster.device.kernel_rates
    assert rates == KernelRates({"cudnn": (0.5, 0.4), "fused": (0.7, 0.6)}, 8e-6, 0.7, 400)
    for suffix in (".yaml", ".json"):
        path = str(tmp_path / f"c{suffix}")
        cluster.save(path)
        assert Cluster.load(path).device.kernel_rates == rates
    assert "kernel_rates" not in Cluster.from_dict(_file()).to_dict()["device"]  # only what is set is written


@pytest.mark.parametrize(
    "rates, message",
    [
        ({"attention": {"flash3": [0.5, 0.4]}}, "device.kernel_rates.attention.flash3: unknown kernel"),
        (
            {"attention": {"cudnn": [0.5, 1.2]}},
            "device.kernel_rates.attention.cudnn backward: must be a fraction of peak",
        ),
        ({"attention": {"cudnn": [0.5]}}, "device.kernel_rates.attention.cudnn: must be [forward, backward]"),
        ({"attention": {"cudnn": ["fast", 0.4]}}, "device.kernel_rates.attention.cudnn forward: must be a number"),
        ({"attention": [0.5, 0.4]}, "device.kernel_rates.attention: must be a mapping"),
        ({"gemm_ramp": "-3us"}, "device.kernel_rates.gemm_ramp"),
        ({"gemm_ramp": 0}, "device.kernel_rates.gemm_ramp: must be > 0"),
        ({"gemm_rampp": "8us"}, "device.kernel_rates: unknown key(s) ['gemm_rampp']"),
        ({"gemm_efficiency": 1.2}, "device.kernel_rates.gemm_efficiency: must be a fraction of peak in (0, 1]"),
        ({"gemm_efficiency": 0}, "device.kernel_rates.gemm_efficiency: must be a fraction of peak"),
        ({"gemm_efficiency": "75%"}, "device.kernel_rates.gemm_efficiency: must be a number in (0, 1]"),
        ({"attention_half_tokens": -5}, "device.kernel_rates.attention_half_tokens: must be >= 0"),
        ({"attention_half_tokens": "1K"}, "device.kernel_rates.attention_half_tokens: must be a finite number"),
    ],
)
def test_bad_kernel_rates_are_refused_naming_the_field(rates, message):
    with pytest.raises(ClusterError) as err:
        Cluster.from_dict(_file(rates=rates))
    assert message in str(err.value)


def test_the_roofline_prices_the_files_rates_in_place_of_its_tables():
    plain = AnalyticalCompute.for_device(Cluster.from_dict(_file()).device, "bf16")
    assert plain.sdpa_attention == {} and plain.fa3_attention is None  # an unmeasured name: no rates
    assert plain.matmul_half_flops == AnalyticalCompute.matmul_half_flops
    timing = AnalyticalCompute.for_device(Cluster.from_dict(_file(rates=RATES)).device, "bf16")
    assert timing.attention_efficiency == 0.5  # cudnn: what a plan naming no attention kernel runs
    assert timing.attention_backward_factor == pytest.approx(2.5 * 0.5 / 0.4)
    assert timing.with_kernels(True).attention_efficiency == 0.7  # kernels=fused
    assert timing.matmul_half_flops == pytest.approx(1000e12 * 8e-6)
    assert (plain.matmul_efficiency, timing.matmul_efficiency) == (0.75, 0.7)
    assert (plain.attention_half_tokens, timing.attention_half_tokens) == (ATTENTION_HALF_RATE_TOKENS, 400)
    # an H100 keeps its measured tables where the file sets nothing
    h100 = copy.deepcopy(Cluster.preset("dgx-h100", 8).device)
    h100.kernel_rates = KernelRates({"flash": (0.3, 0.3)})
    tables = AnalyticalCompute.for_device(h100, "bf16")
    assert tables.sdpa_attention["flash"] == (0.3, 0.3)
    assert tables.sdpa_attention["cudnn"] == next(r[1:] for r in SDPA_ATTENTION["cudnn"] if r[0] == "H100")
    assert tables.fa3_attention == next(r[1:] for r in FUSED_ATTENTION if r[0] == "H100")
    assert tables.matmul_ramp_s == next(t for part, t in GEMM_RAMP_S if part == "H100")


def test_a_plans_step_time_follows_the_clusters_attention_rate():
    model = "llama:hidden=512,layers=2,heads=8,vocab=1024"
    slow = Cluster.from_dict(_file(rates={"attention": {"cudnn": [0.2, 0.2]}}))
    fast = Cluster.from_dict(_file(rates={"attention": {"cudnn": [0.6, 0.6]}}))
    times = []
    for cluster in (slow, fast):
        work = workload_for_model(model, cluster, seq=8192)
        plan = uniform_plan(len(work), dp=8, microbatch_size=1, num_microbatches=1)
        times.append(simulate(plan, work, cluster).step_s)
    assert times[0] > times[1]


def test_the_documented_kernel_rates_example_loads():
    text = (pathlib.Path(ROOT) / "docs" / "cluster_format.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S) if "kernel_rates" in b]
    cluster = Cluster.from_dict(yaml.safe_load(block))
    assert cluster.device.kernel_rates == KernelRates({"cudnn": (0.60, 0.48)}, 9e-6)


def test_a_topology_file_keeps_its_devices_kernel_rates(tmp_path):
    from nest_fx.cluster.topology import load_topology, save_topology, torus

    ring = torus([2, 2])
    ring.device.kernel_rates = KernelRates({"fused": (0.7, 0.5)}, 1e-5)
    path = str(tmp_path / "t.yaml")
    save_topology(ring, path)
    assert load_topology(path).device.kernel_rates == ring.device.kernel_rates
