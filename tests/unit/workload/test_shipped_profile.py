"""The shipped H100 profile (profiles/h100-bf16.json) loads offline and costs llama2-7b from
measurements: the planner's per-layer costs equal the profile's own per-block sums, and
`nest-fx plan --profile` uses it."""

import os

import pytest
import torch

from nest_fx.cluster import load_cluster
from nest_fx.workload import workload_for_model
from nest_fx.cli import main
from nest_fx.workload.profile_file import Profile
from repo_root import ROOT

PATH = os.path.join(ROOT, "profiles", "h100-bf16.json")


@pytest.fixture(scope="module")
def shipped():
    return Profile.load(PATH)


def test_shipped_profile_is_a_measured_h100_bf16_profile(shipped):
    assert shipped.device == "cuda" and "H100" in shipped.device_name and shipped.dtype == "bf16"
    entries = [e for e in shipped.ops.values() if e.usable]
    assert len(entries) > 200
    assert all(e.fwd_host_s is not None for e in entries)  # kernel and host sides both measured
    steps = [b for b in shipped.blocks if b["kind"] == "step" and b["model"] == "llama2-7b"]
    assert {(b["tp"], b["mbs"]) for b in steps} == {(tp, m) for tp in (1, 2, 4, 8) for m in (1, 2)}
    for b in steps:  # each variant's per-op sum was checked against an eager step on the GPU
        assert 0.8 < b["ops_sum_s"] / b["eager_step_s"] < 1.25, b


def test_planner_costs_layers_from_the_shipped_profile(shipped):
    wl = workload_for_model("llama2-7b", load_cluster("dgx-h100:64"), dtype=torch.bfloat16, profile=shipped)
    for tp, mbs in ((1, 1), (1, 2), (2, 1), (8, 2)):
        assert wl.source.coverage(tp, mbs) > 0.99
        record = next(
            b
            for b in shipped.blocks
            if b["model"] == "llama2-7b" and b["block"] == "layers.0" and b["tp"] == tp and b["mbs"] == mbs
        )
        layer = next(i for i, layer in enumerate(wl.layers) if layer.kind == "block")
        # the profile measured the model's own RMSNorm code (the runtime's default, F.rms_norm, is priced fused)
        cost = wl.for_runtime(norm_kernel="model").cost(layer, tp=tp, mbs=mbs)
        assert cost.fwd_s == pytest.approx(record["fwd_s"], rel=1e-6)
        assert cost.bwd_s == pytest.approx(record["bwd_s"], rel=1e-6)


def test_plan_cli_with_the_shipped_profile(capsys):
    rc = main(
        [
            "plan",
            "--model",
            "llama2-7b",
            "--cluster",
            "dgx-h100:64",
            "--global-batch",
            "256",
            "--profile",
            PATH,
            # one microbatch size: each size localises the profile's graphs per TP degree again (half
            # this test's time); test_planner_costs_layers_from_the_shipped_profile checks sizes 1 and 2
            "--microbatch",
            "1",
            "--no-baselines",
            "--quiet",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "NVIDIA H100" in text and "measured" in text
