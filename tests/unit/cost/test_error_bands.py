"""Error bands of step-time predictions (nest_fx.cost.error_bands) against the published-run
benchmark's own results (results/bench_published.json), and how plan/explain show them."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.common.device_family import device_family
from nest_fx.cost.error_bands import (
    BACKEND_BANDS,
    DEVICE_BANDS,
    FEATURE_BANDS,
    ErrorBand,
    error_band,
    within_error,
)
from nest_fx.cost.step_time import simulate
from nest_fx.plan import uniform_plan
from nest_fx.report.tables import baselines_table
from nest_fx.solver.baseline_result import Baseline
from nest_fx.workload import workload_for_model
from repo_root import ROOT

RESULTS = os.path.join(ROOT, "results", "bench_published.json")


def _features(row: dict) -> set:
    return {
        name
        for name, on in (
            ("float8", row["float8"]),
            ("cp", row["cp"] > 1),
            ("pp", row["pp"] > 1),
            ("tp", row["tp"] > 1),
            ("ep", row.get("ep", 1) > 1),
        )
        if on
    }


def _backend(row: dict) -> str:
    return row.get("backend") or ("compile" if row["compile"] else "eager")


def _errors():
    with open(RESULTS, encoding="utf-8") as fh:
        data = json.load(fh)
    out = []
    for row in data["rows"]:
        pred = data["after"][row["key"]]
        published = row.get("tflops_per_gpu") or row["tps_per_gpu"]
        value = pred["tflops_per_gpu"] if row.get("tflops_per_gpu") else pred["tps_per_gpu"]
        out.append((row, abs(value / published - 1)))
    return out


DEVICES = {"dgx-b200": "B200", "gb200-nvl72": "GB200"}  # the rows' hardware with bands of their own


def test_every_band_covers_the_published_rows_it_names():
    everything = _errors()
    for name in DEVICES.values():  # A100's band: Narayanan et al.'s rows (tests/unit/cost/test_published.py)
        rows = [e for row, e in everything if DEVICES.get(row["hardware"]) == name]
        assert rows and 0 <= DEVICE_BANDS[name].rel - max(rows) < 0.01, name
    errors = [(row, e) for row, e in everything if row["hardware"] not in DEVICES]
    for name, band in BACKEND_BANDS.items():
        rows = [e for row, e in errors if _backend(row) == name and not _features(row)]
        if band.rel is None:
            assert not rows, f"{name}: published rows check it now; give it a band"
            continue
        assert rows and 0 <= band.rel - max(rows) < 0.01, name
    order = list(FEATURE_BANDS)
    assert order == ["float8", "tp", "ep", "pp", "cp"]
    for k, (name, band) in enumerate(FEATURE_BANDS.items()):
        rows = [e for row, e in errors if name in _features(row) and not _features(row) & set(order[k + 1 :])]
        # rounded up from the widest row: a band wider than that by a point or more is stale
        assert rows and 0 <= band.rel - max(rows) < 0.01, name


def test_a_row_is_charged_to_the_least_sure_feature_it_uses():
    """The feature order runs from the best-predicted to the worst: the last feature's band is the
    widest, so the rows that also use it (the 405B long-context rows pipeline too) do not widen the
    band of an earlier feature (a plain pipelined plan's)."""
    widest = max(FEATURE_BANDS.values(), key=lambda b: b.rel)
    assert widest is FEATURE_BANDS[list(FEATURE_BANDS)[-1]]
    errors = [(row, e) for row, e in _errors() if row["hardware"] not in DEVICES]
    cp_rows = [e for row, e in errors if "cp" in _features(row)]
    pp_alone = [e for row, e in errors if "pp" in _features(row) and "cp" not in _features(row)]
    assert FEATURE_BANDS["pp"].rel < max(cp_rows) <= FEATURE_BANDS["cp"].rel
    assert max(pp_alone) <= FEATURE_BANDS["pp"].rel
    assert error_band(uniform_plan(4, pp=2, dp=4)).rel == FEATURE_BANDS["pp"].rel
    assert error_band(uniform_plan(4, pp=2, dp=2, cp=2)).rel == FEATURE_BANDS["cp"].rel


def test_a_plans_band_is_the_widest_of_its_backend_and_features():
    plan = uniform_plan(4, dp=8)
    assert error_band(plan) == BACKEND_BANDS["eager"]
    assert error_band(dataclasses.replace(plan, compile=True)) == BACKEND_BANDS["compile"]
    assert error_band(dataclasses.replace(plan, float8=True)).rel == max(
        BACKEND_BANDS["eager"].rel, FEATURE_BANDS["float8"].rel
    )
    assert error_band(dataclasses.replace(plan, kernels="fused")).rel is None  # no published fused run checks it
    assert error_band(uniform_plan(4, pp=2, tp=2, dp=2)).rel == max(FEATURE_BANDS["pp"].rel, FEATURE_BANDS["tp"].rel)
    assert error_band(uniform_plan(4, dp=8, ep=8)).rel == max(BACKEND_BANDS["eager"].rel, FEATURE_BANDS["ep"].rel)
    # on a Blackwell or A100 preset its device's band joins in; a Hopper device has none of its own
    assert error_band(plan, "GB200-186GB") == DEVICE_BANDS["GB200"]
    assert error_band(plan, "A100-SXM4-80GB") == DEVICE_BANDS["A100"]
    for hopper in ("H100-SXM5-80GB", "NVIDIA H100 80GB HBM3", "H200-SXM-141GB"):
        assert error_band(plan, hopper) == BACKEND_BANDS["eager"], hopper


@pytest.mark.parametrize(
    "name, family",
    [
        ("H100-SXM5-80GB", "H100"),
        ("NVIDIA H100 80GB HBM3", "H100"),  # what torch.cuda.get_device_name says (profile --calibrate)
        ("H100-96GB-HBM2e-500W", "H100"),
        ("GB200-186GB", "GB200"),
        ("B200-SXM-180GB", "B200"),
        ("A100-SXM4-80GB", "A100"),
        ("TPUv4", ""),
        ("cpu", ""),
        ("NVIDIA A10G", ""),
    ],
)
def test_the_device_family_is_read_from_the_name(name, family):
    assert device_family(name) == family


def test_a_device_no_published_run_checks_has_no_band():
    """The Hopper rows say nothing about a TPU's or a CPU's rates: their plans are unchecked, and a
    gain of any size is within the model's error there."""
    plan = uniform_plan(4, dp=8)
    for device in ("TPUv4", "cpu", "NVIDIA L40S"):
        band = error_band(plan, device)
        assert band.rel is None and f"no published run on {device} checked" in band.text(), device
        assert within_error(10.0, band)
    cpu = load_cluster("cpu-gloo:8")
    work = workload_for_model("gpt:hidden=64,layers=2,heads=4,seq=32,vocab=128", cpu)
    result = simulate(uniform_plan(len(work), dp=8), work, cpu)
    assert result.error_band is None and "no published run on cpu checked" in result.error_basis


@pytest.mark.parametrize(
    "gain, rel, inside",
    [
        (1.05, 0.06, True),
        (1.13, 0.06, False),
        (1.12, 0.06, True),
        (3.0, None, True),
        (1.0, 0.0, True),
        (1.01, 0.0, False),
    ],
)
def test_a_gain_is_within_the_error_when_both_predictions_may_be_off_by_the_band(gain, rel, inside):
    assert within_error(gain, ErrorBand(rel, "x")) is inside


def test_plan_says_measure_both_when_its_gain_lies_inside_the_band():
    cluster = load_cluster("dgx-h100:8")
    work = workload_for_model("gpt:hidden=256,layers=4,heads=8,seq=256,vocab=4096", cluster)
    plan = uniform_plan(len(work), dp=8, microbatch_size=1, num_microbatches=1)
    result = simulate(plan, work, cluster)
    assert result.error_band == BACKEND_BANDS["eager"].rel and result.error_basis == BACKEND_BANDS["eager"].basis
    nest = type("Found", (), {"plan": plan, "result": result})()
    for factor, shown in ((1.05, True), (1.5, False)):
        slower = dataclasses.replace(result, step_s=result.step_s * factor)
        text = baselines_table(nest, 0.1, [Baseline("megatron", plan, slower, 1)])
        assert (f"within the model's error ({BACKEND_BANDS['eager'].text()}" in text) is shown, text


def test_explain_shows_the_backend_and_its_band():
    from nest_fx.report.explain import explain_text

    cluster = load_cluster("dgx-h100:8")
    work = workload_for_model("gpt:hidden=256,layers=4,heads=8,seq=256,vocab=4096", cluster)
    plan = uniform_plan(len(work), dp=8, microbatch_size=1, num_microbatches=1)
    text = explain_text(plan, work, cluster, simulate(plan, work, cluster))
    assert f"kernels eager; error band of the step time: {BACKEND_BANDS['eager'].text()}" in text
    assert "(torchtitan Llama 3.1 8B eager rows" in text
    fused = dataclasses.replace(plan, kernels="fused")
    assert "kernels fused; error band of the step time: unchecked (" in explain_text(
        fused, work, cluster, simulate(fused, work, cluster)
    )
