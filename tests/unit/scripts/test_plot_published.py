"""scripts/plot_published.py: the published-runs benchmark's figure, drawn from its JSON."""

import json
import os

import pytest

from repo_root import ROOT, import_script


@pytest.fixture(scope="module")
def plotter():
    pytest.importorskip("matplotlib")  # the [plot] extra; the benchmark still writes its tables without it
    return import_script("plot_published")


def test_the_committed_results_draw(plotter, tmp_path):
    with open(os.path.join(ROOT, "results", "bench_published.json"), encoding="utf-8") as fh:
        data = json.load(fh)
    out = str(tmp_path / "fig.png")
    assert plotter.plot(data, out)
    with open(out, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 20_000


def test_rows_not_expressible_have_no_point(plotter):
    row = {"key": "x", "tps_per_gpu": 100.0}
    assert plotter.predicted_value(row, {"expressible": False}) is None
    assert plotter.predicted_value(row, None) is None
    assert plotter.predicted_value(row, {"expressible": True, "tps_per_gpu": 90.0}) == 90.0
    tf = {"key": "m", "tps_per_gpu": 0.0, "tflops_per_gpu": 400.0}
    assert plotter.published_value(tf) == 400.0
    assert plotter.predicted_value(tf, {"expressible": True, "tps_per_gpu": 150.0, "tflops_per_gpu": 380.0}) == 380.0
