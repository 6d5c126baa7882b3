"""Expert matmuls priced at the shape expert parallelism runs them (``workload.expert_gemms``):
the runtime hands each local expert the rows of every EP rank, and the cost model prices that GEMM."""

from __future__ import annotations

import pytest
import torch

import nest_fx.apply.expert_parallel as expert_parallel
from nest_fx.cluster import Cluster
from nest_fx.models.config import TransformerConfig
from nest_fx.models.moe import MoE
from nest_fx.workload import workload_for_model
from nest_fx.workload.expert_gemms import ep_shaped_times, has_expert_matmuls, one_expert_matmul

# Qwen3-30B-A3B's MoE layer, two of them: 128 experts of 768, top 8, 2,048 hidden
QWEN3_MOE = "llama:hidden=2048,layers=2,heads=32,kv=4,head_dim=128,ffn=6144,vocab=151936,experts=128,topk=8,moe_ffn=768"


@pytest.fixture(scope="module")
def moe_work():
    cluster = Cluster.preset("dgx-h100", 8)
    return workload_for_model(QWEN3_MOE, cluster, seq=4096), cluster


def _block(work):
    source = work.source
    layer = work.layers[1]
    block = next(b for b in source.graph.blocks if b.signature == layer.signature and b.kind == layer.kind)
    return source, layer, block


def test_the_runtime_runs_each_local_expert_on_the_rows_of_every_ep_rank(monkeypatch):
    """What the pricing assumes, on the runtime's own code: under EP 2 a rank's expert sees
    ``[ep B, C, H]``, twice the rows it sees without EP (the all-to-all made the identity here:
    one process, the shapes are what matter)."""
    cfg = TransformerConfig(hidden=16, heads=2, layers=1, num_experts=4, top_k=2, ffn_hidden=32, vocab_size=64)
    moe = MoE(cfg)
    seen = {}

    def record(name):
        def hook(_m, args):
            seen.setdefault(name, tuple(args[0].shape))

        return hook

    moe.experts[0].register_forward_pre_hook(record("plain"))
    x = torch.randn(3, 8, 16)
    moe(x)
    monkeypatch.setattr(expert_parallel, "all_to_all", lambda send, group, *a: send)
    expert_parallel._convert_zoo_moe(moe, ep=2, ep_rank=0, ep_group=None)
    moe.experts[0].register_forward_pre_hook(record("ep2"))
    moe(x)
    assert seen["ep2"][0] == 2 * seen["plain"][0] and seen["ep2"][1:] == seen["plain"][1:]


def test_single_expert_matmuls_are_found_and_dense_ones_are_not(moe_work):
    work, _ = moe_work
    source, _, block = _block(work)
    nodes = source.facts(block.index).nodes
    experts = [n for n in nodes if one_expert_matmul(n)]
    assert len(experts) == 128 * 3  # gate, up and down of every expert
    assert all(n.expert and n.params == 2048 * 768 for n in experts)
    assert not any(one_expert_matmul(n) for n in nodes if not n.expert)
    assert has_expert_matmuls(nodes)
    dense = workload_for_model("llama:hidden=256,layers=2,heads=4,vocab=512", Cluster.preset("dgx-h100", 8), seq=128)
    dsource, _, dblock = _block(dense)
    assert not has_expert_matmuls(dsource.facts(dblock.index).nodes)


def test_ep_shaped_time_is_the_roofline_of_ep_times_the_rows_over_ep(moe_work):
    work, _ = moe_work
    source, _, block = _block(work)
    nodes = source.facts(block.index).nodes
    shares = source.node_shares(block, 1, 4, False, 1)
    times = source.variant_times(block, 1, 4, False)
    assert ep_shaped_times(source.timing, nodes, times, shares, 1) == times
    shaped = ep_shaped_times(source.timing, nodes, times, shares, 8)
    timing = source.timing
    for n, share, (f, b), (f8, b8) in zip(nodes, shares, times, shaped):
        if not one_expert_matmul(n):
            assert (f8, b8) == (f, b)
            continue
        rows = (n.bytes_moved - n.param_bytes) * share
        plain = timing.op_seconds(n.flops * share, rows + n.param_bytes, True)
        big = timing.op_seconds(8 * n.flops * share, 8 * rows + n.param_bytes, True)
        assert f8 == pytest.approx(f * big / (8 * plain)) and b8 == pytest.approx(b * big / (8 * plain))
        assert f8 < f  # 8,192 rows per GEMM run nearer the peak than 1,024
    expert_fwd = sum(f for n, (f, _) in zip(nodes, times) if one_expert_matmul(n))
    expert_fwd8 = sum(f for n, (f, _) in zip(nodes, shaped) if one_expert_matmul(n))
    assert 2.5 < expert_fwd / expert_fwd8 < 4.5  # 17% -> 53% of peak, and 1/8 of the launches


def test_layer_cost_under_ep_prices_the_shaped_experts_and_keeps_the_rest(moe_work):
    work, _ = moe_work
    source, layer, block = _block(work)
    one = work.cost(1, tp=1, ep=1, mbs=4, sp=False)
    eight = work.cost(1, tp=1, ep=8, mbs=4, sp=False)
    nodes = source.facts(block.index).nodes
    times = source.variant_times(block, 1, 4, False)
    shaped = source.variant_times(block, 1, 4, False, 1, 8)
    saved = sum(f for f, _ in times) - sum(f for f, _ in shaped)
    assert saved > 0 and one.fwd_s - eight.fwd_s == pytest.approx(saved)
    assert one.act_bytes == eight.act_bytes  # the same tensors are kept
    assert eight.recompute_s["full"] == pytest.approx(eight.fwd_s)
    assert len(nodes) == len(shaped)
