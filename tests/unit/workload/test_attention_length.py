"""Fused attention's rate by call length (``attention_share.attention_length_share``): one law,
fitted to the whole-sequence SDPA runs and the ring runs measured on an H100 and an H200, prices
short sequences and ring attention's chunk-pair calls (``Workload.for_runtime(cp_mode="ring")``);
the all-gather mode's calls see the whole sequence."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.cluster.kernel_fit import fit_attention_half_tokens, length_law_errors, length_ratios, ring_ratios
from nest_fx.cost.step_time import simulate
from nest_fx.plan import uniform_plan
from nest_fx.workload import Variant, workload_for_model
from nest_fx.workload.attention_share import (
    ATTENTION_HALF_RATE_TOKENS,
    ATTENTION_RATE_REF_TOKENS,
    attention_length_share,
    call_length_rate,
    ring_chunk_share,
    fused_call_keys,
)
from repo_root import ROOT

GPU = os.path.join(ROOT, "results", "gpu")
MODEL = "llama:hidden=512,layers=2,heads=8,kv=2,ffn=1408,vocab=1024"


def _measured_ratios():
    """The length and ring ratios of both GPUs' runs (``kernel_fit``)."""
    length, ring = [], []
    for run in ("bench_gpu_kernels_h200.json", "bench_gpu_kernels_h100.json"):
        with open(os.path.join(GPU, run)) as fh:
            measured = json.load(fh)
        length += length_ratios(measured["sdpa"]["rows"])
        ring += ring_ratios(measured)
    return length, ring


def test_the_half_rate_length_is_the_fit_of_both_gpus_sdpa_and_ring_runs():
    length, ring = _measured_ratios()
    assert len(ring) == 12 and len(length) == 24  # 3 kernels x 4 lengths x 2 GPUs
    half, error = fit_attention_half_tokens(length, ring)
    assert ATTENTION_HALF_RATE_TOKENS == half == 1050
    assert error < 0.03 < statistics.mean(length_law_errors(length, ring, 0))  # every length alike misses more
    ring_alone = statistics.mean(length_law_errors([], ring, half))
    length_alone = statistics.mean(length_law_errors(length, [], half))
    assert ring_alone < 0.03 and length_alone < 0.035  # each measurement alone
    # the grid's neighbours fit worse: the constant is the minimum, not a pick
    for other in (half - 100, half + 100):
        assert statistics.mean(length_law_errors(length, ring, other)) > error
    # the runs without short lengths or ring rows show no law
    assert fit_attention_half_tokens([r for r in length if r["tokens"] >= 8192], []) is None


def test_the_length_share_is_one_at_the_tabled_length_and_held_below_the_measured_range():
    assert attention_length_share(ATTENTION_RATE_REF_TOKENS) == 1.0
    assert attention_length_share(2048) == pytest.approx(0.68, abs=0.01)
    assert attention_length_share(64) == attention_length_share(2048)  # not measured below 2K
    assert attention_length_share(8192) < 1 < attention_length_share(131072)
    assert call_length_rate(0) == call_length_rate(2048)
    # a ring chunk's rate against one call over the whole sequence
    assert ring_chunk_share(8192, 8192) == 1.0
    assert ring_chunk_share(2048, 32768) == pytest.approx(attention_length_share(2048), rel=1e-12)
    # the keys of a call: a window's band, a ring chunk, else the sequence
    assert fused_call_keys(8192, 1, False) == 8192 and fused_call_keys(8192, 4, False) == 8192
    assert fused_call_keys(8192, 4, True) == 1024 and fused_call_keys(8192, 1, True, window=512) == 512
    assert fused_call_keys(1024, 1, False, window=4096) == 1024


def test_a_short_sequence_prices_its_attention_at_the_length_share(monkeypatch):
    import nest_fx.workload.traced_source as traced_source

    cluster = load_cluster("dgx-h100:8")
    fwd = {}
    for law in (True, False):
        if not law:
            monkeypatch.setattr(traced_source, "attention_length_share", lambda keys, half: 1.0)
        for seq in (2048, ATTENTION_RATE_REF_TOKENS):
            work = workload_for_model(MODEL, cluster, seq=seq)
            block = next(i for i, layer in enumerate(work.layers) if layer.kind == "block")
            fwd[law, seq] = work.cost(block, Variant()).fwd_s
    assert fwd[True, ATTENTION_RATE_REF_TOKENS] == fwd[False, ATTENTION_RATE_REF_TOKENS]  # the tabled length
    assert fwd[True, 2048] > fwd[False, 2048]  # the attention slower, the rest alike
    assert fwd[True, 2048] < fwd[False, 2048] / attention_length_share(2048)


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
    chunk_share = ring_chunk_share(8192 / 4, 8192)
    assert steps["ring"].fwd_compute < steps["allgather"].fwd_compute / chunk_share  # attention is a part only
