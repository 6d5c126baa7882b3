"""Which forward TP collective a block's recompute never re-runs (``BlockFacts.tail_unsaved``,
``Comm.unrecomputed``, ``stage_terms.repeated_share``): the last row's, when nothing in the block
saves what it feeds. The runtime's counts are checked on gloo ranks in
``tests/distributed/apply/test_tp_input_once.py``; here the rule on block shapes."""

from __future__ import annotations

import pytest
import torch

from nest_fx.cost.stage_terms import repeated_share
from nest_fx.workload.block_facts import block_facts
from nest_fx.workload.build import trace_model
from nest_fx.workload.types import Comm


def _facts(spec: str):
    graph, _ = trace_model(spec, seq=16, dtype=torch.float32)
    return block_facts(graph, next(b for b in graph.blocks if b.kind == "block"))


def test_a_pre_norm_block_ends_on_an_unsaved_row_output():
    assert _facts("llama:hidden=64,layers=2,heads=4,seq=16,vocab=128").tail_unsaved
    assert _facts("gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128").tail_unsaved


def test_a_post_norm_block_saves_its_last_row_output():
    pytest.importorskip("transformers")  # the [hf] extra, installed by the README's commands
    assert not _facts("hf:bert:hidden=64,layers=2,heads=4,seq=16,vocab=128").tail_unsaved


def test_the_unrecomputed_collective_is_left_out_of_the_repeats():
    last = Comm("all_reduce", "tp", 1.0, "fwd", count=2, unrecomputed=1)
    assert repeated_share(last, "full") == 0.5
    assert repeated_share(last, "op") == 0.5
    assert repeated_share(last, "selective") == 0.0  # selective keeps TP outputs anyway
    assert repeated_share(Comm("all_reduce", "tp", 1.0, "fwd", count=2), "full") == 1.0
    assert repeated_share(Comm("all_reduce", "tp", 1.0, "bwd", count=2), "full") == 0.0
