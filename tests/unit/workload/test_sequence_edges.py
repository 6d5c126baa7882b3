"""The collectives at the ends of the sequence-parallel span (``workload.sequence_edges``): the
first block's slice (its backward all-gathers the embedding output's gradient) and the gather
before the tail, priced once per microbatch on the layer whose stage runs them. Counted against
the runtime in ``tests/distributed/apply/test_tp_input_once.py`` and
``test_pipeline_sequence_shards.py``."""

from collections import Counter

import pytest

import torch

from nest_fx.cluster import Cluster, load_cluster
from nest_fx.cost.step_time import comm_terms
from nest_fx.graph import trace
from nest_fx.workload import analytical_workload, load_workload, save_workload, workload_for_model
from nest_fx.workload.sequence_edges import GATHER, SLICE, sequence_edge
from nest_fx.workload.types import Comm, ModelDims, Variant, Workload
from tp_input_models import HIDDEN, SEQ, build_stack

SMALL = "llama:hidden=256,layers=4,heads=8,kv=4,seq=128,vocab=512"
ACTIVATION = 2 * 128 * 256 * 2  # two sequences of 128 tokens, hidden 256, bf16: the whole tensor


@pytest.fixture(scope="module")
def small():
    return workload_for_model(SMALL, load_cluster("dgx-a100:64"))


def _added(workload, index, variant):
    """The collectives layer ``index`` adds to its source's cost (the edges)."""
    own = workload.own_cost(index, variant).comms
    comms = workload.cost(index, variant).comms
    assert comms[: len(own)] == own
    return comms[len(own) :]


@pytest.mark.parametrize(
    "kinds, params, expected",
    [
        (["head", "block", "block", "tail"], [1, 1, 1, 1], [(), (SLICE,), (), (GATHER,)]),
        (["head", "block", "tail"], [1, 1, 1], [(), (SLICE,), (GATHER,)]),
        # the data enters the first block: no gradient to gather
        (["block", "block", "tail"], [1, 1, 1], [(), (), (GATHER,)]),
        (["head", "block", "block", "tail"], [0, 1, 1, 1], [(), (), (), (GATHER,)]),
        # no tail: the last block gathers its own output
        (["head", "block", "block"], [1, 1, 1], [(), (SLICE,), (GATHER,)]),
        (["head", "block"], [1, 1], [(), (SLICE, GATHER)]),
        (["head", "tail"], [1, 1], [(), ()]),
    ],
)
def test_edges_are_named_where_the_runtime_runs_them(kinds, params, expected):
    assert [sequence_edge(kinds, params, k) for k in range(len(kinds))] == expected


def test_the_first_block_and_the_tail_price_one_all_gather_each(small):
    v = Variant(4, 1, 2, True)
    assert _added(small, 1, v) == [Comm("all_gather", "tp", ACTIVATION, "bwd")]
    assert _added(small, 5, v) == [Comm("all_gather", "tp", ACTIVATION, "fwd")]
    for k in (0, 2, 3, 4):
        assert small.cost(k, v) is small.own_cost(k, v)
    # the first block is a distinct cost from the identical blocks after it
    assert small.cost(1, v) is not small.cost(2, v) and small.cost(2, v) is small.cost(4, v)
    # without sequence parallelism, or on one rank, nothing to slice or gather
    for other in (Variant(4, 1, 2, False), Variant(1, 1, 2, True)):
        assert all(small.cost(k, other) is small.own_cost(k, other) for k in range(len(small)))
    # loss parallel: the gather still runs (the final norm reads whole sequences)
    assert _added(small, 5, Variant(4, 1, 2, True, 1, True)) == [Comm("all_gather", "tp", ACTIVATION, "fwd")]
    # a context-parallel rank holds half of each sequence
    assert _added(small, 1, Variant(4, 1, 2, True, 2)) == [Comm("all_gather", "tp", ACTIVATION / 2, "bwd")]


def test_the_stage_holding_each_edge_prices_it(small):
    """Per stage (``Workload.range_costs``, what simulate and the solver's tables sum): a head-only
    first stage prices neither; the slice goes with the first block, the gather with the tail."""
    v = Variant(4, 1, 2, True)

    def edge_bytes(start, end):
        summed = Counter(
            c for cost, count in small.range_costs(start, end, v) for c in cost.comms for _ in range(count)
        )
        own = Counter(c for k in range(start, end) for c in small.own_cost(k, v).comms)
        return sorted((c.phase, c.nbytes) for c in (summed - own).elements())

    assert edge_bytes(0, 1) == []
    assert edge_bytes(1, 3) == [("bwd", ACTIVATION)]
    assert edge_bytes(3, 5) == []
    assert edge_bytes(3, 6) == [("fwd", ACTIVATION)]
    assert edge_bytes(0, 6) == [("bwd", ACTIVATION), ("fwd", ACTIVATION)]


def test_a_recompute_never_reruns_them(small):
    """The slice and the gather run in hooks outside a block's checkpoint: a stage's collectives
    under full recompute are the blocks' forward ones again, never the edges'. A chain ending on
    a block (no tail) gathers in that block's hook, marked never re-run."""
    v = Variant(4, 1, 2, True)
    gathers = lambda comm: comm.count if comm.kind == "all_gather" else 0  # noqa: E731 - count them
    for start, end in ((1, 2), (4, 6), (0, 6)):
        costs = small.range_costs(start, end, v)
        blocks = sum(count for cost, count in costs if cost.block)
        repeated = comm_terms(costs, "full", gathers)["tp"] - comm_terms(costs, "none", gathers)["tp"]
        assert repeated == 2 * blocks  # each block's two region gathers, not the edges'
    tailless = Workload("no tail", small.layers[:-1], small.dims, small.source)
    assert _added(tailless, 4, v) == [Comm("all_gather", "tp", ACTIVATION, "fwd", 1, 1)]
    costs = tailless.range_costs(4, 5, v)
    assert comm_terms(costs, "full", gathers)["tp"] - comm_terms(costs, "none", gathers)["tp"] == 2


def test_a_stack_without_parameters_around_it(small):
    """Layer stacks whose data enters the first block (their head and tail hold no parameters):
    the slice's backward gathers nothing, the gather runs once (counted in
    ``test_tp_input_once.py``'s custom stacks)."""
    graph = trace(build_stack("llama-like")[0], (torch.randn(2, SEQ, HIDDEN),))
    stack = analytical_workload(graph, ModelDims(seq_len=SEQ), Cluster.preset("cpu-gloo", 2), torch.float32)
    assert [(layer.kind, layer.num_params > 0) for layer in stack.layers] == [
        ("head", False),
        ("block", True),
        ("block", True),
        ("tail", False),
    ]
    v = Variant(2, 1, 2, True)
    assert [_added(stack, k, v) for k in range(3)] == [[], [], []]
    assert _added(stack, 3, v) == [Comm("all_gather", "tp", 2 * SEQ * HIDDEN * 4, "fwd")]


def test_a_layer_table_holds_the_layers_own_costs(tmp_path, small):
    """A written table keeps what the source gives (the first block is the block signature's first
    layer); read back, the edges are added once, as for the traced workload."""
    path = tmp_path / "w.json"
    save_workload(small, str(path), tps=(1, 4), mbss=(2,), sps=(False, True))
    loaded = load_workload(str(path))
    v = Variant(4, 1, 2, True)
    for k in range(len(small)):
        assert loaded.cost(k, v).comms == small.cost(k, v).comms
    assert len(loaded.cost(1, v).comms) == len(loaded.cost(2, v).comms) + 1
