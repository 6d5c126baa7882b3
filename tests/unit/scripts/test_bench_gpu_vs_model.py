"""scripts/bench_gpu_vs_model.py: a GPU run's measured kernel rates against what the cost model
prices for the device the run is compared with (on any machine, from the committed JSON)."""

import json
import os

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.workload import AnalyticalCompute
from repo_root import ROOT, import_script

MEASURED = os.path.join(ROOT, "results", "gpu", "bench_gpu_kernels_h200.json")


@pytest.fixture(scope="module")
def script():
    return import_script("bench_gpu_vs_model")


def _sdpa(script, tmp_path, cluster: str) -> dict:
    out = str(tmp_path / cluster.replace(":", "_"))
    assert script.main(["--measured", MEASURED, "--cluster", cluster, "--out", out]) == 0
    with open(out + ".json") as fh:
        return {row["kernel"]: row for row in json.load(fh)["sdpa"]}


def test_the_sdpa_rows_compare_with_the_compared_devices_rates(script, tmp_path):
    h200 = _sdpa(script, tmp_path, "dgx-h200:1")
    assert (h200["cudnn"]["model_fwd"], h200["cudnn"]["model_bwd"]) == (0.64, 0.52)
    assert h200["cudnn"]["measured_fwd"] == pytest.approx(0.64, abs=0.006)  # the table is the measurement
    # the same measurement against a B200's priced (derived) rates, not the Hopper table's
    b200 = _sdpa(script, tmp_path, "dgx-b200:1")
    assert b200["cudnn"]["model_fwd"] == pytest.approx(0.613, abs=1e-3)
    assert b200["flash"]["measured_fwd"] == h200["flash"]["measured_fwd"]


def test_the_ring_rows_compare_with_the_same_kernel_over_the_whole_sequence(script):
    timing = AnalyticalCompute.for_device(load_cluster("dgx-h200:1").device)
    with open(MEASURED) as fh:
        rows = {(r["tokens"], r["cp"]): r for r in script.ring_rows(json.load(fh), timing)}
    assert rows[(131072, 2)]["efficiency_fwd_bwd"] == pytest.approx(1.0, abs=0.05)  # long chunks: no split cost
    assert rows[(32768, 8)]["efficiency_fwd_bwd"] < 0.7  # 2K-token chunks: a third slower
    assert rows[(32768, 8)]["chunk_tokens"] == 2048
    # the model prices the split (attention_share's length law): within 10% of every row
    assert all(r["model"] == pytest.approx(r["efficiency_fwd_bwd"], rel=0.1) for r in rows.values())
    assert rows[(32768, 8)]["model"] < rows[(32768, 2)]["model"] < 1.0
    shrinking = [rows[(32768, cp)]["efficiency_fwd_bwd"] for cp in (2, 4, 8)]
    assert shrinking == sorted(shrinking, reverse=True)
