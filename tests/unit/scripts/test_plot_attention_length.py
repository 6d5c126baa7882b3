"""scripts/plot_attention_length.py: the attention length law against both GPUs' measured ratios,
drawn from the committed ``bench_gpu_vs_model.py`` JSONs."""

import os

import pytest

from repo_root import ROOT, import_script

GPU = os.path.join(ROOT, "results", "gpu")


@pytest.fixture(scope="module")
def plotter():
    pytest.importorskip("matplotlib")  # the [plot] extra
    return import_script("plot_attention_length")


def test_the_committed_runs_draw(plotter, tmp_path):
    out = str(tmp_path / "length.png")
    runs = [os.path.join(GPU, "gpu_vs_model.json"), os.path.join(GPU, "gpu_vs_model_h100.json")]
    assert plotter.main([out, *runs]) == 0
    with open(out, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 20_000


def test_a_json_without_length_or_ring_rows_draws_the_law_alone(plotter, tmp_path):
    out = str(tmp_path / "law.png")
    assert plotter.plot([{"measured_on": "NVIDIA X, torch 2.13"}], out)
    assert os.path.getsize(out) > 5_000
