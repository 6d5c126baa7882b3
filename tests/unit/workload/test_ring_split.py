"""Ring attention's cost of splitting (``attention_share.ring_split_share``): the constant is the
fit of the shares measured on an H100 and an H200, and a ring plan's context-parallel attention
is priced at it (``Workload.for_runtime(cp_mode="ring")``), the all-gather mode's as traced."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.cost.step_time import simulate
from nest_fx.plan import uniform_plan
from nest_fx.workload import Variant, workload_for_model
from nest_fx.workload.attention_share import RING_SPLIT_HALF_TOKENS, ring_split_share
from repo_root import ROOT, import_script

GPU = os.path.join(ROOT, "results", "gpu")
MODEL = "llama:hidden=512,layers=2,heads=8,kv=2,ffn=1408,vocab=1024"


def test_the_split_constant_is_the_fit_of_both_gpus_ring_runs():
    script = import_script("bench_gpu_vs_model")
    rows = []
    for run in ("bench_gpu_kernels_h200.json", "bench_gpu_kernels_h100.json"):
        with open(os.path.join(GPU, run)) as fh:
            rows += script.ring_rows(json.load(fh))
    assert len(rows) == 12

    def error(half: float) -> float:
        return statistics.mean(
            abs(r["chunk_tokens"] / (r["chunk_tokens"] + half) / r["efficiency_fwd_bwd"] - 1) for r in rows
        )

    best = min(range(0, 3001, 10), key=error)
    assert RING_SPLIT_HALF_TOKENS == pytest.approx(best, abs=20)
    assert error(RING_SPLIT_HALF_TOKENS) < 0.03 < error(0)  # pricing no split cost misses by more
    assert ring_split_share(2048) == pytest.approx(0.68, abs=0.01) and ring_split_share(0) == 1.0


def test_a_ring_plan_prices_its_cp_attention_at_the_split_share():
    cluster = load_cluster("dgx-h100:8")
    work = workload_for_model(MODEL, cluster, seq=8192)
    ring = work.for_runtime(cp_mode="ring")
    assert ring is not work and work.for_runtime(cp_mode="allgather") is work
    assert "ring attention" in ring.provenance
    block = next(i for i, layer in enumerate(work.layers) if layer.kind == "block")
    for cp in (1, 2, 4):
        plain, split = work.cost(block, Variant(cp=cp)), ring.cost(block, Variant(cp=cp))
        if cp == 1:
            assert split.fwd_s == plain.fwd_s  # no split without CP
        else:
            assert split.fwd_s > plain.fwd_s and split.bwd_s > plain.bwd_s
    # the step: cp_mode=ring costs more compute than allgather by the attention's split alone
    steps = {}
    for mode in ("allgather", "ring"):
        plan = uniform_plan(len(work), dp=4, microbatch_size=1, num_microbatches=1, cp=2, cp_mode=mode)
        steps[mode] = simulate(plan, work, cluster).stages[0]
    assert steps["ring"].fwd_compute > steps["allgather"].fwd_compute
    chunk_share = ring_split_share(8192 / 4)
    assert steps["ring"].fwd_compute < steps["allgather"].fwd_compute / chunk_share  # attention is a part only
