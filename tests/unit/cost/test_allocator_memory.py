"""What the CUDA caching allocator reserves beyond the live bytes (nest_fx.cost.allocator), per segment
mode, against the H100 runs it was measured from (results/gpu/bench_gpu_runtime_h100*.json)."""

from __future__ import annotations

import functools
import glob
import json
import os

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.cost.allocator import ALLOCATOR_SLACK, allocator_slack
from nest_fx.cost.memory import live_bytes
from nest_fx.cost.options import CostOptions
from nest_fx.cost.stage_terms import compute_terms
from nest_fx.cost.step_time import simulate, stage_variant
from nest_fx.plan import Plan, StagePlan
from nest_fx.workload import workload_for_model
from repo_root import ROOT

GiB = 2**30
SPEC = "llama:hidden=4096,layers={blocks},heads=32,kv=8,ffn=14336,seq=8192,vocab={vocab}"


def _runs():
    """(segments, blocks, vocabulary, recompute, microbatches, allocated GiB, reserved GiB) of every
    measured H100 run that names its model."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "results", "gpu", "bench_gpu_runtime_h100*.json"))):
        data = json.load(open(path))
        conf = data.get("allocator_conf", "")
        for row in data["rows"]:
            if row.get("compile") or row.get("attention_kernel") != "(default)":
                continue
            segments = row.get("allocator_segments") or (
                "expandable" if "expandable_segments:True" in conf else "fixed"
            )
            vocab = 128256 if row["row"] in ("vocab128k", "recompute") else 32000
            out.append(
                (
                    segments,
                    row["blocks"],
                    vocab,
                    row.get("recompute", "none"),
                    row.get("microbatches", 1),
                    row["measured_allocated_gib"],
                    row["measured_reserved_gib"],
                )
            )
    return out


@pytest.fixture(scope="module")
def h100():
    return load_cluster("dgx-h100:1")


@functools.lru_cache(maxsize=None)
def _workload(blocks: int, vocab: int):
    """The traced workload of a measured run's model: four distinct ones among the 16 runs, each
    traced once for the module (tracing dominated these tests' time)."""
    return workload_for_model(SPEC.format(blocks=blocks, vocab=vocab), load_cluster("dgx-h100:1"), seq=8192)


def _priced(h100, blocks, vocab, recompute, microbatches, segments):
    work = _workload(blocks, vocab)
    plan = Plan(
        stages=[StagePlan(0, len(work), 1, recompute)],
        num_layers=len(work),
        precision="bf16-mixed",
        num_microbatches=microbatches,
    )
    options = CostOptions(optimizer="adamw", allocator_segments=segments)
    peak = compute_terms(work.range_costs(0, len(work), stage_variant(plan, 0)), recompute).layer_peak
    return simulate(plan, work, h100, options).stages[0], peak


def test_the_measured_runs_are_there():
    runs = _runs()
    assert {r[0] for r in runs} == {"expandable", "fixed"} and len(runs) >= 12


@pytest.mark.parametrize("segments", sorted(ALLOCATOR_SLACK))
def test_the_cache_term_is_the_measured_share_of_the_largest_working_set(h100, segments):
    stage, peak = _priced(h100, 2, 32000, "none", 1, segments)
    slack = allocator_slack(segments)
    assert peak > GiB  # the loss's logits gradients: 8,192 x 32,000 fp32, twice
    assert stage.memory["allocator_cache"] == pytest.approx(slack.peak_share * peak)
    assert stage.reserved == pytest.approx(stage.memory["total"] * (1 + slack.ratio))
    assert live_bytes(stage.memory) == pytest.approx(stage.memory["total"] - slack.peak_share * peak)


def test_each_measured_excess_lies_within_the_priced_one(h100):
    """The envelope: what the allocator reserved beyond the live bytes in each H100 run is at most
    what the cost model adds for that run's segment mode at those live bytes (so a plan it calls
    feasible fits), and some run of each mode reaches it within 5%."""
    closest = {}
    for segments, blocks, vocab, recompute, microbatches, allocated, reserved in _runs():
        _, peak = _priced(h100, blocks, vocab, recompute, microbatches, segments)
        slack = allocator_slack(segments)
        priced = (slack.peak_share * peak / GiB + allocated) * (1 + slack.ratio) - allocated
        measured = reserved - allocated
        assert measured <= priced + 0.01, (segments, blocks, vocab, recompute, microbatches, measured, priced)
        closest[segments] = max(closest.get(segments, 0.0), measured / priced)
    assert min(closest.values()) >= 0.95, closest


def test_unknown_segments_are_refused_naming_the_modes():
    with pytest.raises(ValueError, match="expandable"):
        CostOptions(allocator_segments="huge")


def test_the_priced_live_bytes_are_the_measured_ones(h100):
    """Live bytes (max_memory_allocated) of each H100 run, priced within 2%: the gradients held in
    fp32 on the master weights (memory.held_grad_bytes; 4 microbatches: 37.32 GiB measured) and the
    bf16 weight casts freed before the optimizer step (full recompute, where the step is the peak)."""
    seen = set()
    for segments, blocks, vocab, recompute, microbatches, allocated, _ in _runs():
        key = (blocks, vocab, recompute, microbatches)
        if key in seen:
            continue
        seen.add(key)
        stage, _ = _priced(h100, blocks, vocab, recompute, microbatches, segments)
        assert live_bytes(stage.memory) / GiB == pytest.approx(allocated, rel=0.02), key
    assert {(6, 32000, "none", 4), (6, 128256, "full", 1)} <= seen
