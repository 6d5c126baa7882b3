"""Which pipeline cuts carry the TP ranks' sequence shards (``tensor_parallel.sharded_cut``), and
the receiving stage's check of a shard's shape (``graph.stage_sides.same_shape``). The runs are in
``tests/distributed/apply/test_pipeline_sequence_shards.py``."""

from __future__ import annotations

import pytest
import torch

from nest_fx.apply.tensor_parallel import sharded_cut
from nest_fx.graph.stage_sides import same_shape
from nest_fx.graph.stand_in import SplitError
from nest_fx.workload.build import trace_model


def test_cuts_after_a_layer_block_without_side_values_carry_shards():
    graph, _ = trace_model("llama:hidden=64,layers=3,heads=4,seq=16,vocab=128", seq=16, dtype=torch.float32)
    kinds = [b.kind for b in graph.blocks]
    assert kinds == ["head", "block", "block", "block", "tail"]
    assert [sharded_cut(graph, c, ()) for c in range(len(kinds) + 1)] == [False, False, True, True, True, False]
    assert not sharded_cut(graph, 2, (("model.encoder", 1),))  # a value passed beside it: full sequences


def test_a_received_shard_is_checked_against_its_share_of_the_sequence():
    full = torch.empty(2, 17, 8)
    same_shape(full, torch.empty(2, 17, 8), "layers.1")
    same_shape(full, torch.empty(2, 9, 8), "layers.1", seq_shards=2)  # torch.chunk: 9 and 8
    same_shape(full, torch.empty(2, 8, 8), "layers.1", seq_shards=2)
    for wrong, shards in [((2, 9, 8), 1), ((2, 7, 8), 2), ((2, 9, 4), 2), ((1, 9, 8), 2)]:
        with pytest.raises(SplitError, match="layers.1"):
            same_shape(full, torch.empty(*wrong), "layers.1", seq_shards=shards)
