"""What the ``fused`` kernel backend keeps as Transformer Engine and Megatron-Core keep it
(``nest_fx.workload.kernels``): Float8 linear inputs quantized, the router weights inside the
experts' activation (``workload/routed_weighting.py``), the loss in place at every TP degree."""

from __future__ import annotations

import dataclasses

import pytest

from nest_fx.cluster import load_cluster
from nest_fx.workload import workload_for_model
from nest_fx.workload.fp8_kept import fp8_input_shares
from nest_fx.workload.kernels import KERNEL_BACKENDS
from nest_fx.workload.routed_weighting import routed_weighting_bytes

# Llama 3 8B's shape ratios (ffn 3.5 h, 4 query heads per key/value head)
LLAMA_SHAPED = "llama:hidden=512,layers=2,heads=8,kv=2,ffn=1792,vocab=1024,seq=1024"
MOE = "llama:hidden=64,layers=2,heads=4,seq=32,vocab=128,experts=4,topk=2,moe_ffn=32"
S, H, F, KV_PER_HEAD = 1024, 512, 1792, 2 / 8


@pytest.fixture(scope="module")
def shaped():
    return workload_for_model(LLAMA_SHAPED, load_cluster("dgx-h100:8"))


def _per_token_hidden(work, **runtime) -> float:
    return work.for_runtime(norm_kernel="model", **runtime).cost(1, mbs=1).act_bytes["none"] / (S * H)


def test_float8_linear_inputs_are_kept_quantized_only_by_the_fused_backend(shaped):
    """Per token per hidden unit, a Llama block under Transformer Engine's FP8: the two norm
    outputs (the QKV and gate/up inputs) 1 + 1 instead of 2 + 2, the down projection's input f/h
    instead of 2 f/h, and the attention output kept twice, bf16 by the attention kernel and FP8 by
    the projection (2 + 1 instead of one shared 2): 11 + 4 kv/heads + 5 f/h, against 12 + 4 kv/heads
    + 6 f/h in bf16. torchao's Float8 (nest-fx's runtime) keeps the bf16 inputs: no change."""
    fused = _per_token_hidden(shaped, kernels="fused")
    fused_fp8 = _per_token_hidden(shaped, kernels="fused", float8=True)
    assert fused == pytest.approx(12 + 4 * KV_PER_HEAD + 6 * F / H, abs=0.1)
    assert fused_fp8 == pytest.approx(11 + 4 * KV_PER_HEAD + 5 * F / H, abs=0.1)
    for backend in ("eager", "compile"):
        assert _per_token_hidden(shaped, kernels=backend, float8=True) == _per_token_hidden(shaped, kernels=backend)


def test_the_router_weighting_is_found_in_the_routers_module_only():
    work = workload_for_model(MOE, load_cluster("dgx-h100:8"))
    graph = work.source.graph
    block = next(b for b in graph.blocks if b.kind == "block")
    found = routed_weighting_bytes(graph.graph, block.nodes, block.is_moe)
    hits = [graph.graph.nodes[block.nodes[k]] for k, b in enumerate(found) if b]
    assert [d["module"] for d in hits] == ["layers.0.moe"]  # the combine; not the RMSNorms' x * rsqrt
    batch = graph.input_shapes[0][0]
    assert sum(found) == batch * 32 * 2 * 64 * 2  # the expert outputs: k rows of H per token, bf16
    assert routed_weighting_bytes(graph.graph, block.nodes, False) == [0.0] * len(block.nodes)


def test_the_fused_moe_keeps_no_expert_output_for_the_router_weights(monkeypatch):
    """Megatron-Core multiplies the weights into the experts' activation: the block keeps exactly
    the traced combine's expert outputs less than the same backend weighting them afterwards."""
    cluster = load_cluster("dgx-h100:8")
    work = workload_for_model(MOE, cluster)
    block = next(b for b in work.source.graph.blocks if b.kind == "block")
    routed = (
        sum(routed_weighting_bytes(work.source.graph.graph, block.nodes, True)) / work.source.graph.input_shapes[0][0]
    )
    megatron = work.for_runtime(kernels="fused").cost(1, mbs=1).act_bytes["none"]
    monkeypatch.setitem(
        KERNEL_BACKENDS, "fused", dataclasses.replace(KERNEL_BACKENDS["fused"], expert_probs_in_activation=False)
    )
    weighted_after = workload_for_model(MOE, cluster).for_runtime(kernels="fused").cost(1, mbs=1).act_bytes["none"]
    assert routed > 0 and weighted_after - megatron == pytest.approx(routed)


def test_the_fused_backend_runs_the_loss_in_place_without_tensor_parallelism(shaped):
    """Megatron-LM's vocabulary-parallel cross entropy at TP 1: its backward holds only the
    gradient cast to the logits' dtype (2 bytes a bf16 logit), not the eager loss's two fp32
    gradients (8); ``loss_kernel=eager`` under the same backend prices the op-by-op loss."""
    tail = len(shaped) - 1
    logits = S * 1024  # the vocabulary

    def scratch(**runtime) -> float:
        return shaped.for_runtime(**runtime).cost(tail, mbs=1).bwd_scratch / logits

    assert scratch(kernels="fused") == pytest.approx(2.0)
    assert scratch(kernels="fused", loss_kernel="eager") == pytest.approx(8.0)
    assert scratch(kernels="eager") == pytest.approx(8.0)


def test_a_moe_router_keeps_its_input_unquantized():
    """Megatron-Core runs the router's linear unquantized: under FP8 its saved input keeps its
    width while the experts' linears keep one byte an element."""
    sixteen = MOE.replace("experts=4", "experts=16")  # a router Float8 would take (16 outputs)
    work = workload_for_model(sixteen, load_cluster("dgx-h100:8")).for_runtime(kernels="fused", float8=True)
    source = work.source
    block = next(b for b in source.graph.blocks if b.kind == "block")
    nodes = source.facts(block.index).nodes
    shares = fp8_input_shares(source.graph.graph, block, nodes, source.runtime, source.byte_scale, 16)
    shares = dict(zip(block.nodes, shares))
    modules = {name: source.graph.graph.nodes[name].get("module", "") for name in block.nodes}
    gate = next(n for n in block.nodes if modules[n] == "layers.0.moe.gate")
    router = [shares[gate]]
    experts = [shares[n] for n in block.nodes if ".experts." in modules[n] and shares[n] is not None]
    assert router == [None] and source.runtime.float8_node("block", nodes[block.nodes.index(gate)])
    assert experts and set(experts) == {0.5}  # bf16 inputs kept as FP8
