"""scripts/bench_published_sensitivity.py: a published row costed with each value of an option the
source does not state; only rows the option touches move."""

import pytest

from repo_root import import_script


@pytest.fixture(scope="module")
def sensitivity():
    return import_script("bench_published_sensitivity")


def test_tp_overlap_moves_only_the_tp_rows(sensitivity, tmp_path):
    entries = {e["key"]: e for e in sensitivity.sensitivity(["n4", "n9"], "overlap_tp_comm", [0.0, 1.0])}
    assert set(entries) == {"n4", "n9"}
    no_tp, tp = entries["n4"]["predicted"], entries["n9"]["predicted"]
    assert no_tp["0.0"] == pytest.approx(no_tp["1.0"])  # no TP: nothing to hide
    assert tp["1.0"] > tp["0.0"] * 1.05  # NeMo's TP 2 row: its collectives hidden, faster
    text = sensitivity.table(list(entries.values()), "overlap_tp_comm", [0.0, 1.0])
    assert text.splitlines()[0].startswith("| row | tp | published | overlap_tp_comm=0.0")
    assert "| n9 | 2 | 5,851 |" in text
