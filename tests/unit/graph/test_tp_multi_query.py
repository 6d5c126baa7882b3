"""Falcon's multi-query layout under tensor parallelism, in one process: what the tracer finds
(query rows sharded by heads, the shared key/value rows kept whole), the fused layout that holds
them, the local shapes the profiler and the rehearsal use, and what the cost model prices."""

from __future__ import annotations

import functools

import pytest
import torch

from nest_fx.apply.fused_params import FusedLayout
from nest_fx.cluster import load_cluster
from nest_fx.graph import trace
from nest_fx.models import build_seeded
from nest_fx.plan.support import parallel_support
from nest_fx.workload import workload_for_model
from nest_fx.workload.block_facts import block_facts
from nest_fx.workload.localise import localise_tp

pytestmark = pytest.mark.hf
QKV = "self_attention.query_key_value.weight"


@functools.lru_cache(maxsize=None)
def _traced(name: str = "hf:falcon"):
    pytest.importorskip("transformers")
    model, cfg = build_seeded(name)  # 4 query heads of 16, one shared key and value head
    return model, cfg, trace(model, (torch.randint(0, cfg.vocab_size, (2, 8)),))


def _qkv_spec(graph):
    pair = next(p for p in graph.pattern_of(graph.layer_blocks[0]).tp_pairs if p.kind == "attention")
    return pair, next(p for p in pair.params if p.name == QKV)


def test_the_query_rows_are_sharded_by_heads_and_the_shared_rows_kept_whole():
    model, _, graph = _traced()
    pair, spec = _qkv_spec(graph)
    assert pair.problem == ""
    assert (spec.dim, spec.parts, spec.units, spec.whole) == (0, [64, 16, 16], [16, 16, 16], [1, 2])
    assert spec.whole_size() == 32
    support = parallel_support(model, graph)
    assert support.tp_problem(2) == "" and support.tp_problem(4) == ""
    _, _, classic = _traced("hf:falcon:multi_query=False")
    assert not any(p.whole for pair in classic.pattern_of(classic.layer_blocks[0]).tp_pairs for p in pair.params)


def test_fused_layout_with_whole_parts_holds_them_on_every_rank_and_round_trips():
    layout = FusedLayout(dim=0, parts=(8, 2, 2), tp=2, whole=(1, 2))  # 4 query heads of 2, one k and v head
    weight = torch.arange(12.0).unsqueeze(1).expand(12, 3).contiguous()
    assert layout.rank_rows(0) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert layout.rank_rows(1) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert layout.whole_rows() == [4, 5, 6, 7]
    shards = [layout.local(weight, r) for r in range(2)]
    assert torch.equal(shards[1][:, 0], torch.tensor([4.0, 5, 6, 7, 8, 9, 10, 11]))
    glued = torch.cat(shards)  # the DTensor's global tensor: the shared rows twice
    assert tuple(layout.original_shape(glued.shape)) == (12, 3)
    assert torch.equal(layout.to_original(glued), weight)
    # each shared part is a run of its own at the same original offset on every rank (written once)
    assert layout.runs(0, 8) == [(0, 0, 4), (4, 8, 2), (6, 10, 2)]
    assert layout.runs(8, 8) == [(8, 4, 4), (12, 8, 2), (14, 10, 2)]


@pytest.mark.parametrize("tp, rows", [(2, 2 * 16 + 32), (4, 16 + 32)])
def test_one_rank_copy_holds_its_query_heads_and_the_whole_key_and_value(tp, rows):
    model, cfg, graph = _traced()
    local, _ = build_seeded("hf:falcon")
    localise_tp(local, graph, tp, cfg.vocab_size)
    assert tuple(local.get_parameter(f"transformer.h.0.{QKV}").shape) == (rows, 64)
    out = local(torch.randint(0, cfg.vocab_size, (2, 8)))  # the rank's copy runs (its own head counts)
    assert out.logits.shape[-1] in (cfg.vocab_size, -(-cfg.vocab_size // tp))


def test_the_cost_model_prices_the_shared_rows_whole_and_their_gradient_all_reduce():
    _, _, graph = _traced()
    block = graph.layer_blocks[0]
    facts = block_facts(graph, block)
    qkv = [n for name, n in zip(block.nodes, facts.nodes) if graph.graph.nodes[name].get("weight", "").endswith(QKV)]
    assert [n.tp_work for n in qkv] == [pytest.approx(64 / 96)]
    assert qkv[0].tp_divisor(2) == pytest.approx(1.5)  # 2/3 of its rows divided by 2, 1/3 run whole
    # the query rows, the output projection and the MLP; the shared rows are not divided
    assert sum(n.tp_params for n in facts.nodes) == 64 * 64 + 64 * 64 + 2 * 64 * 256
    assert facts.grad_comms == (32 * 64 * 4,)  # fp32 gradient of the shared rows
    wl = workload_for_model("hf:falcon", load_cluster("dgx-a100:64"))
    one, two = wl.cost(1, tp=1), wl.cost(1, tp=2)
    norms = 2 * 64
    assert two.num_params == pytest.approx((one.num_params - norms - 32 * 64) / 2 + norms + 32 * 64)
    grads = [c for c in two.comms if c.phase == "bwd" and c.count == 1 and c.kind == "all_reduce"]
    assert len(grads) == 1 and not [c for c in one.comms]
