"""The cost model prices a plan's precision (nest_fx.cost.precision): each term of fp32,
bf16-mixed and bf16-true by the factor its dtypes give."""

import dataclasses

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.cluster.presets import PRESETS
from nest_fx.cost import memory
from nest_fx.cost.options import CostOptions
from nest_fx.cost.precision import default_precision, priced_options
from nest_fx.cost.step_time import simulate
from nest_fx.plan import uniform_plan
from nest_fx.workload import AnalyticalCompute, workload_for_model

MODEL = "gpt:hidden=512,layers=8,heads=8,seq=512,vocab=8192"


@pytest.fixture(scope="module", params=["dgx-a100:8", "cpu-gloo:6"])
def runs(request):
    """(cluster, {precision: SimResult}) of one plan whose middle stage holds blocks only."""
    cluster = load_cluster(request.param)
    work = workload_for_model(MODEL, cluster)  # traced in bf16 (the default)
    out = {}
    for precision in ("fp32", "bf16-mixed", "bf16-true", ""):
        plan = uniform_plan(len(work), pp=3, dp=2, num_microbatches=6, precision=precision)
        out[precision] = simulate(plan, work, cluster)
    return cluster, out


def test_model_state_bytes_per_parameter():
    per = {
        p: memory.model_states(1.0, 0, 1, priced_options(p, CostOptions())) for p in ("fp32", "bf16-mixed", "bf16-true")
    }
    assert [per["fp32"][k] for k in ("weights", "grads", "optimizer")] == [4, 4, 8]  # fp32 Adam: no master copy
    # the ZeRO paper's 2+2+12, but the gradients land in fp32 on the master weights (memory.held_grad_bytes)
    assert [per["bf16-mixed"][k] for k in ("weights", "grads", "optimizer")] == [2, 4, 12]
    assert [per["bf16-true"][k] for k in ("weights", "grads", "optimizer")] == [2, 2, 4]  # bf16 Adam states


def test_memory_terms_scale_with_the_dtypes(runs):
    _, r = runs
    fp32, mixed, true = (r[p].stages[1].memory for p in ("fp32", "bf16-mixed", "bf16-true"))
    assert fp32["weights"] == pytest.approx(2 * mixed["weights"]) and true["weights"] == mixed["weights"]
    assert fp32["grads"] == pytest.approx(mixed["grads"]) and mixed["grads"] == pytest.approx(2 * true["grads"])
    assert fp32["optimizer"] == pytest.approx(mixed["optimizer"] * 8 / 12)
    assert true["optimizer"] == pytest.approx(mixed["optimizer"] * 4 / 12)
    # activations: 4 bytes per element against 2 (the middle stage holds blocks only, no fp32 loss)
    assert fp32["activations"] == pytest.approx(2 * mixed["activations"], rel=1e-9)
    assert true["activations"] == mixed["activations"]


def test_gradient_reduction_is_fp32_under_bf16_mixed(runs):
    _, r = runs
    fp32, mixed, true = (r[p].stages[1].dp_sync for p in ("fp32", "bf16-mixed", "bf16-true"))
    assert mixed == pytest.approx(fp32) and mixed > 1.5 * true  # twice the bytes (latency aside)
    # the optimizer step reads and writes bf16 states under bf16-true: half the bytes of fp32 states
    assert r["bf16-true"].breakdown["optimizer"] == pytest.approx(r["bf16-mixed"].breakdown["optimizer"] / 2)


def test_compute_runs_at_the_dtype_rate(runs):
    cluster, r = runs
    fp32, mixed = r["fp32"].stages[1].fwd_compute, r["bf16-mixed"].stages[1].fwd_compute
    assert r["bf16-true"].stages[1].fwd_compute == mixed
    ratio = cluster.device.peak("bf16") / cluster.device.peak("fp32")
    if ratio == 1:  # cpu-gloo: one rate; only the bytes moved double
        assert mixed < fp32 <= 2 * mixed
    else:  # A100: fp32 matmuls 16x slower, memory-bound ops 2x
        assert 2 * mixed < fp32 < ratio * mixed


def test_the_roofline_in_another_dtype():
    device = load_cluster("dgx-a100:8").device
    bf16 = AnalyticalCompute.for_device(device, "bf16")
    fp32 = bf16.in_dtype("fp32")
    assert fp32.peak_flops == device.peak("fp32")
    gemm = (1e13, 1e6)  # compute-bound: the matmul rate ratio
    assert (fp32.op_seconds(*gemm, True) - fp32.launch_s) / (
        bf16.op_seconds(*gemm, True) - bf16.launch_s
    ) == pytest.approx(device.peak("bf16") / device.peak("fp32"))
    # elementwise ops run on the fp32 units (at most the fp32 peak), bf16 at the vector share of its peak
    assert fp32.peak_flops * fp32.vector_fraction == device.peak("fp32")
    assert fp32.in_dtype("bf16") == bf16
    assert AnalyticalCompute.for_device(device, "fp32").in_dtype("bf16").peak_flops == device.peak("bf16")


def test_a_plan_without_precision_is_costed_as_before(runs):
    _, r = runs
    old, mixed = r[""], r["bf16-mixed"]
    # the default options: bf16-mixed's memory with bf16 gradients (bf16-mixed holds them in fp32)
    same = {k: v for k, v in old.stages[1].memory.items() if k not in ("grads", "total")}
    assert same == {k: v for k, v in mixed.stages[1].memory.items() if k not in ("grads", "total")}
    assert old.stages[1].memory["grads"] == pytest.approx(mixed.stages[1].memory["grads"] / 2)
    assert old.stages[1].fwd_compute == mixed.stages[1].fwd_compute
    assert old.stages[1].dp_sync == r["bf16-true"].stages[1].dp_sync  # ... with bf16 gradient reduction


def test_default_precision_per_device():
    for name, make in PRESETS.items():
        expected = "fp32" if name == "cpu-gloo" else "bf16-mixed"
        assert default_precision(make(8).device) == expected, name


def test_priced_options_leave_other_options():
    base = CostOptions(optimizer="sgd", overlap_grad_sync=False)
    priced = priced_options("fp32", base)
    assert (priced.optimizer, priced.overlap_grad_sync) == ("sgd", False)
    assert priced_options("", base) is base
    assert dataclasses.replace(priced, param_bytes=2) != priced


SMALL = "gpt:hidden=256,layers=4,heads=4,seq=256,vocab=4096"


@pytest.mark.parametrize("cluster, expected", [("cpu-gloo:4", "fp32"), ("dgx-a100:8", "bf16-mixed")])
def test_the_planner_records_the_device_default(tmp_path, cluster, expected):
    from nest_fx.cli import main
    from nest_fx.plan import Plan

    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--model",
                SMALL,
                "--cluster",
                cluster,
                "--global-batch",
                "16",
                "--quiet",
                "--no-baselines",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert Plan.load(str(out)).precision == expected


def test_precision_flags_on_plan_and_simulate(tmp_path, capsys):
    import json

    from nest_fx.cli import main
    from nest_fx.plan import Plan

    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--model",
                SMALL,
                "--cluster",
                "dgx-a100:8",
                "--global-batch",
                "16",
                "--quiet",
                "--no-baselines",
                "--precision",
                "bf16-true",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    plan = Plan.load(str(out))
    assert plan.precision == "bf16-true" and plan.constraints.precision == "bf16-true"
    peaks = {}
    for precision in ("bf16-true", "fp32"):
        sim = tmp_path / f"{precision}.json"
        main(
            [
                "simulate",
                "--plan",
                str(out),
                "--model",
                SMALL,
                "--cluster",
                "dgx-a100:8",
                "--precision",
                precision,
                "--json",
                str(sim),
            ]
        )
        peaks[precision] = json.loads(sim.read_text())["result"]["stages"][0]["memory"]["weights"]
    assert peaks["fp32"] == pytest.approx(2 * peaks["bf16-true"])
    assert Plan.load(str(out)).precision == "bf16-true"  # --precision costs; the file is not changed


@pytest.mark.parametrize("cluster, expected", [("cpu-gloo:2", "fp32"), ("dgx-a100:2", "bf16-mixed")])
def test_the_runtime_planner_records_the_device_default(cluster, expected):
    import torch

    from nest_fx.graph import trace
    from nest_fx.models import build_model
    from nest_fx.solver.runtime_planner import planner_for

    model, cfg = build_model("gpt:hidden=32,layers=2,heads=4,seq=16,vocab=64")
    graph = trace(model, (torch.zeros(2, cfg.seq_len, dtype=torch.long),))
    plan = planner_for(model)(graph, load_cluster(cluster), 2, 4)
    assert plan.precision == expected
    bf16 = planner_for(model.to(torch.bfloat16))(graph, load_cluster(cluster), 2, 4)
    assert bf16.precision == "bf16-true"  # a model already in bf16 trains in bf16
