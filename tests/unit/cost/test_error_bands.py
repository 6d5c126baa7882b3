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
from repo_root import ROOT, import_script

RESULTS = os.path.join(ROOT, "results", "bench_published.json")


@pytest.fixture(scope="module")
def published():
    """The benchmark's results and the bands they give (scripts/published_bands.py)."""
    bands = import_script("published_bands")
    with open(RESULTS, encoding="utf-8") as fh:
        data = json.load(fh)
    return bands, data


def test_every_band_is_the_one_its_published_rows_give(published):
    """Each band nest-fx carries is its rows' widest error rounded up: not narrower (a row outside
    its band) and not a point or more wider (stale after a change that improved the rows)."""
    bands, data = published
    derived = bands.derived_bands(data)
    for name, carried in bands.carried_bands().items():
        if name == "A100":  # Narayanan et al.'s rows: tests/unit/cost/test_published.py
            assert name not in derived
            continue
        if carried is None:
            assert name not in derived, f"{name}: published rows check it now; give it a band"
            continue
        assert name in derived, f"{name}: no published row checks it"
        assert carried == derived[name].rel, (name, carried, derived[name])
    assert set(derived) <= set(bands.carried_bands())


def test_the_derivation_rounds_up_and_charges_the_last_feature(published):
    bands, _ = published
    assert bands.rounded_up(0.171) == 0.18 and bands.rounded_up(0.0601) == 0.07
    assert bands.rounded_up(0.06) == 0.06  # 100 x 0.06 is 6.000000000000001 in floats
    row = {"float8": True, "tp": 8, "pp": 8, "cp": 2, "ep": 1, "hardware": "grand-teton", "compile": True}
    assert bands.row_features(row) == ["float8", "tp", "pp", "cp"] and bands.row_band(row) == "cp"
    assert bands.row_band({**row, "hardware": "dgx-b200"}) == "B200"
    assert bands.row_band({**row, "float8": False, "tp": 1, "pp": 1, "cp": 1}) == "compile"
    assert list(FEATURE_BANDS) == ["float8", "tp", "ep", "pp", "cp"]


def test_a_row_is_charged_to_the_least_sure_feature_it_uses(published):
    """The feature order runs from the best-predicted to the worst: the last feature's band is the
    widest, so the rows that also use it (the 405B long-context rows pipeline too) do not widen the
    band of an earlier feature (a plain pipelined plan's)."""
    bands, data = published
    widest = max(FEATURE_BANDS.values(), key=lambda b: b.rel)
    assert widest is FEATURE_BANDS[list(FEATURE_BANDS)[-1]]
    errors = bands.row_errors(data)
    hopper = [(row, e) for row, e in errors if row["hardware"] not in bands.DEVICE_OF_HARDWARE]
    cp_rows = [e for row, e in hopper if "cp" in bands.row_features(row)]
    assert FEATURE_BANDS["pp"].rel < max(cp_rows) <= FEATURE_BANDS["cp"].rel
    assert error_band(uniform_plan(4, pp=2, dp=4)).rel == FEATURE_BANDS["pp"].rel
    assert error_band(uniform_plan(4, pp=2, dp=2, cp=2)).rel == FEATURE_BANDS["cp"].rel


def test_the_bands_table_marks_a_band_that_differs(published):
    bands, data = published
    text = bands.bands_table(data)
    assert "| cp |" in text and "(differs)" not in text
    moved = json.loads(json.dumps(data))
    key = next(r["key"] for r in moved["rows"] if r["key"] == "t5.2")
    moved["after"][key]["tps_per_gpu"] *= 1.5  # t5.2 (the widest PP row) now 83% off
    assert "83% (differs) | 22% |" in bands.bands_table(moved)


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
