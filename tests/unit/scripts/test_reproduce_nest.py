"""scripts/reproduce_nest.py on a tiny case: rows, Table 3 reuse, markdown, JSON and figures."""

import importlib.util
import json
import os
import sys

import pytest

from repo_root import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "reproduce_nest.py")


@pytest.fixture(scope="module")
def repro():
    # loaded as `python scripts/reproduce_nest.py` runs it: with scripts/ first on the path (its helper module)
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        spec = importlib.util.spec_from_file_location("reproduce_nest", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    return module


def test_tiny_run_writes_tables_and_figures(repro, tmp_path):
    args = repro.parse_args(
        [
            "--quick",
            "--parts",
            "fig5",
            "fig6",
            "--models",
            "bert-large",
            "--clusters",
            "h100-spine-leaf",
            "--devices",
            "64",
            "--budget",
            "1",
            "--mcmc-evals",
            "20",
            "--out",
            str(tmp_path),
        ]
    )
    results = repro.run(args, log=lambda s: None)
    (row,) = results["fig5"]
    assert row["nest_tokens_s"] > 0 and row["search_s"] >= 0
    for name in ("megatron", "torchtitan", "phaze", "mcmc"):  # the cost model's optimum is never beaten
        assert row[f"{name}_tokens_s"] is None or row["nest_tokens_s"] >= row[f"{name}_tokens_s"] * (1 - 1e-9)
    assert [r["mbs"] for r in results["fig6"]] == [1, 2, 4, 8]
    assert all(f"mbs={r['mbs']}" in r["plan"] for r in results["fig6"])

    # Table 3 reuses a Figure 5 row of the same case instead of solving again.
    (again,) = repro.table3([("bert-large", 64)], 4096, 1.0, 20, {}, results["fig5"], log=lambda s: None)
    assert again is row
    table = repro.table3_table([row])
    assert "Manual (Megatron)" in table and "torchtitan" in table and "Phaze-style" in table and "MCMC" in table
    assert row["best_ratio"] >= 1 - 1e-9 and row["best_baseline"] in ("megatron", "torchtitan", "phaze", "mcmc")

    md = (tmp_path / "reproduce_nest_quick.md").read_text()
    assert "python scripts/reproduce_nest.py --quick --budget 1.0" in md
    assert "## Figure 5" in md and "## Figure 6" in md and "search s" in md
    assert md.count("nest-fx at least as fast in 1/1 cases") == 5  # four baselines and the best of them
    data = json.loads((tmp_path / "reproduce_nest_quick.json").read_text())
    assert data["global_batch"] == 4096 and len(data["fig5"]) == 1
    pytest.importorskip("matplotlib")
    assert (tmp_path / "reproduce_nest_quick_fig5_h100-spine-leaf.png").stat().st_size > 0
    assert (tmp_path / "reproduce_nest_quick_fig6.png").stat().st_size > 0
