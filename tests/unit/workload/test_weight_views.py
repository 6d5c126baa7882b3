"""Views of parameters move no bytes (``graph.op_kinds.is_weight_view``): HF stacked experts hand
``weight.transpose(-2, -1)`` to ``grouped_mm``, which reads the weight once with its strides; a
view of an activation keeps its in + out bytes (the eager rows were checked with them)."""

from __future__ import annotations

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.graph.op_kinds import VIEW_OPS, is_weight_view
from nest_fx.workload import workload_for_model


def _block_nodes(name: str):
    work = workload_for_model(name, load_cluster("dgx-h100:8"))
    block = next(i for i, layer in enumerate(work.layers) if layer.kind == "block")
    graph = work.source.graph
    facts = work.source.facts(block)
    return [(graph.graph.nodes[n], cost) for n, cost in zip(graph.blocks[block].nodes, facts.nodes)]


def test_a_stacked_expert_weight_transpose_moves_no_bytes():
    pytest.importorskip("transformers")
    nodes = _block_nodes("hf:qwen3_moe")
    weight_views = [(d, c) for d, c in nodes if is_weight_view(d)]
    transposes = [(d, c) for d, c in weight_views if d["op"] == "transpose"]
    assert len(transposes) >= 2, [d["name"] for d, _ in weight_views]  # gate_up and down
    for d, cost in weight_views:
        assert cost.bytes_moved == 0.0 and cost.flops == 0.0, d["name"]
        assert any(d["input_params"]) and not d.get("created")
    # a cast that allocates is priced, weight or not
    assert all(c.bytes_moved > 0 for d, c in nodes if d.get("op") in VIEW_OPS and d.get("created"))


def test_views_of_activations_keep_their_bytes():
    nodes = _block_nodes("llama:hidden=256,layers=2,heads=4,seq=128,vocab=512")
    transposes = [(d, c) for d, c in nodes if d.get("op") == "transpose"]
    assert transposes and not any(is_weight_view(d) for d, _ in transposes)
    for d, cost in transposes:
        assert cost.bytes_moved == pytest.approx(2 * d["out_bytes"]), d["name"]
