"""Which TP regions the runtime prepares once, and the backward all-reduces the cost model prices.

A region whose column linears all read the tensor the region (or, failing that, the columns'
own common module) is given, and nothing else in it reads it (q/k/v of an attention, gate/up of
a SwiGLU MLP; BERT's ``attention.self``), sums its columns' partial input gradients locally and
all-reduces once (``graph.tp_inputs``); otherwise each column all-reduces its own. The traced
cost source prices exactly that per backward, and one all-reduce per row forward. The run's
count on 2 gloo ranks: tests/distributed/apply/test_tp_input_once.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nest_fx.graph import trace
from nest_fx.graph.tp_inputs import (
    ColumnInputs,
    column_input_reduces,
    column_inputs,
    once_input,
    prepares_input_once,
)
from nest_fx.graph.tp_regions import block_regions
from nest_fx.plan.support import parallel_support
from nest_fx.workload.roofline import AnalyticalCompute
from nest_fx.workload.traced_source import TracedSource, workload_from_graph
from nest_fx.workload.types import ModelDims

from tp_input_models import (
    HIDDEN,
    Attention,
    InnerResidualSwiGLU,
    NormedKeyAttention,
    PostNormAttention,
    Stack,
    SwiGLU,
)

CASES = [
    # (attention, MLP, {region: the module whose input is prepared once}, ColumnInputs without / with SP)
    (Attention, SwiGLU, {"attn": "attn", "mlp": "mlp"}, ColumnInputs(2, 0, 0), ColumnInputs(2, 0, 0)),
    (NormedKeyAttention, SwiGLU, {"attn": "", "mlp": "mlp"}, ColumnInputs(1, 1, 3), ColumnInputs(1, 1, 3)),
    (Attention, InnerResidualSwiGLU, {"attn": "attn", "mlp": ""}, ColumnInputs(1, 1, 2), ColumnInputs(1, 1, 2)),
    # the columns' own module: once without SP; with SP the region gathers, so they reduce alone
    (PostNormAttention, SwiGLU, {"attn": "attn.core", "mlp": "mlp"}, ColumnInputs(2, 0, 0), ColumnInputs(1, 1, 3)),
]
IDS = ["llama-like", "normed-kv", "inner-residual", "post-norm"]


def _priced(graph, block, sp: bool):
    timing = AnalyticalCompute(peak_flops=1e12, mem_bandwidth=1e11)
    layer = next(x for x in workload_from_graph(graph, timing, ModelDims(seq_len=8)).layers if x.name == block.name)
    cost = TracedSource(graph, timing).cost(layer, 2, 1, 2, sp)
    return {(c.kind, c.phase): c.count for c in cost.comms}, cost


@pytest.mark.parametrize("attn,mlp,once,inputs,sp_inputs", CASES, ids=IDS)
def test_regions_prepared_once_and_the_priced_backward_all_reduces(attn, mlp, once, inputs, sp_inputs):
    model = Stack(attn, mlp)
    graph = trace(model, (torch.randn(2, 8, HIDDEN),))
    block = graph.layer_blocks[0]
    pattern = graph.pattern_of(block)
    assert not any(p.problem for p in pattern.tp_pairs)
    assert {region: once_input(kind, pairs) for region, kind, pairs in block_regions(pattern)} == once
    assert {
        region: prepares_input_once(region, kind, pairs, True) for region, kind, pairs in block_regions(pattern)
    } == {region: module == region for region, module in once.items()}
    assert column_inputs(pattern) == inputs
    assert column_inputs(pattern, sequence_parallel=True) == sp_inputs
    reduces = column_input_reduces(pattern)
    assert reduces == inputs.once + inputs.column_reduces
    by_phase, cost = _priced(graph, block, False)
    assert by_phase == {("all_reduce", "fwd"): 2, ("all_reduce", "bwd"): reduces}
    assert cost.collective_counts() == {"all_reduce": 2 + reduces}
    # sequence parallel: a region not prepared once gathers to a plain tensor, its columns all-reduce alone
    by_phase, _ = _priced(graph, block, True)
    expected = {
        ("all_gather", "fwd"): 2,
        ("reduce_scatter", "fwd"): 2,
        ("all_gather", "bwd"): 2,
        ("reduce_scatter", "bwd"): 2 - sp_inputs.alone,
    }
    if sp_inputs.column_reduces:
        expected[("all_reduce", "bwd")] = sp_inputs.column_reduces
    assert by_phase == expected


def test_sequence_parallel_refuses_a_region_adding_its_own_input_to_its_output():
    """The row reduce-scatters the output over the sequence; the gathered input added beside it
    is a whole sequence: refused before training, naming the op and the row."""
    model = Stack(Attention, InnerResidualSwiGLU)
    support = parallel_support(model, trace(model, (torch.randn(2, 8, HIDDEN),)))
    assert support.sp_problem(2) == (
        "sequence parallelism reduce-scatters each TP region's output over the sequence at its row linear, but in "
        "layers.0.mlp op 'add' in module layers.0.mlp reaches the region's output without passing the row "
        "layers.0.mlp.down (a whole sequence added to one rank's share); fix: sequence_parallel=false"
    )
    model = Stack(PostNormAttention, SwiGLU)
    problem = parallel_support(model, trace(model, (torch.randn(2, 8, HIDDEN),))).sp_problem(2)
    assert "in layers.0.attn op 'add' in module layers.0.attn.out reaches" in problem
    for attn, mlp in ((Attention, SwiGLU), (NormedKeyAttention, SwiGLU)):
        model = Stack(attn, mlp)
        assert parallel_support(model, trace(model, (torch.randn(2, 8, HIDDEN),))).sp_problem(2) == ""


def test_a_layer_that_is_its_own_region_keeps_one_reduction_per_column():
    """q/k/v/o directly in the layer module: the region is the layer, whose input the residual
    outside it also reads; the runtime hooks region modules below the layer only, so each
    column keeps its own reduction (and is priced so)."""

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Attention() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x

    graph = trace(Flat(), (torch.randn(2, 8, HIDDEN),))
    pattern = graph.pattern_of(graph.layer_blocks[0])
    assert [p.input_module for p in pattern.tp_pairs] == [""]
    assert column_input_reduces(pattern) == 3
