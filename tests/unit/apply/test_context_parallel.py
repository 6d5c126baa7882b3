"""Context parallelism in one process: the sharding arithmetic, the attention of one rank's
chunks, the sites CP rewrites, the verdicts of ``cp_problem`` and the mesh's ``cp`` dim.
Multi-rank parity runs are in ``tests/distributed/apply/test_runtime_features.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nest_fx.apply import ApplyError, checks
from nest_fx.apply.context_parallel import (
    ContextParallel,
    gathered_order,
    load_balanced_indices,
    local_causal_attention,
)
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.mesh import build_mesh, data_parallel_mesh, locate, rank_table
from nest_fx.graph import trace
from nest_fx.graph.context_sites import attention_sites, position_sites
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan
from nest_fx.plan.support import parallel_support


def _traced(spec: str, seq: int = 32):
    model, cfg = build_seeded(spec)
    tokens = torch.randint(0, cfg.vocab_size, (2, seq))
    hf = spec.startswith("hf:")
    return model, trace(model, () if hf else (tokens,), {"input_ids": tokens} if hf else None)


# -- sharding arithmetic ---------------------------------------------------------------------


def test_load_balanced_chunks_cover_the_sequence_with_equal_causal_work():
    assert load_balanced_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (2, 3, 4):
        seq = 2 * cp * 3
        shards = [load_balanced_indices(seq, cp, r) for r in range(cp)]
        assert sorted(torch.cat(shards).tolist()) == list(range(seq))
        # causal work of a rank: keys each of its queries attends to
        assert len({int((s + 1).sum()) for s in shards}) == 1
    with pytest.raises(ApplyError, match="not divisible by 2 x cp = 4"):
        load_balanced_indices(10, 2, 0)


def test_gathered_order_puts_the_ranks_tokens_in_position_order():
    cp, seq = 3, 12
    gathered = torch.cat([load_balanced_indices(seq, cp, r) for r in range(cp)])  # rank-major, as all-gathered
    assert gathered[gathered_order(seq // cp, cp)].tolist() == list(range(seq))


@pytest.mark.parametrize("cp", [2, 4])
def test_local_attention_of_every_rank_equals_full_causal_attention(cp):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for rank in range(cp):
        index = load_balanced_indices(16, cp, rank)
        out = local_causal_attention(q[:, :, index], k, v, rank, cp)
        torch.testing.assert_close(out, full[:, :, index], rtol=0, atol=1e-6)
    # GQA passes through: 2 kv heads for 4 query heads
    kv, vv = k[:, :2], v[:, :2]
    full = F.scaled_dot_product_attention(q, kv, vv, is_causal=True, enable_gqa=True)
    index = load_balanced_indices(16, cp, 1)
    torch.testing.assert_close(
        local_causal_attention(q[:, :, index], kv, vv, 1, cp, enable_gqa=True), full[:, :, index], rtol=0, atol=1e-6
    )


def test_positions_and_token_shards_follow_the_layout():
    cp = ContextParallel(group=None, cp=2, rank=1)
    tokens = torch.arange(16).reshape(2, 8)
    assert cp.shard(tokens).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert cp.positions(4, "cpu").tolist() == [2, 3, 4, 5]


def test_the_intercept_accepts_only_causal_calls():
    cp = ContextParallel(group=None, cp=2, rank=0)
    q = torch.randn(1, 2, 4, 8)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    cp._check_causal("attn", 4, None, True, q.device)
    cp._check_causal("attn", 4, causal, False, q.device)  # HF may build the plain causal mask
    with pytest.raises(ApplyError, match="layers.0.attn calls scaled_dot_product_attention with is_causal=False"):
        cp._check_causal("layers.0.attn", 4, None, False, q.device)
    window = causal & torch.ones(4, 4, dtype=torch.bool).triu(-1)  # a sliding window of 2
    with pytest.raises(ApplyError, match="not the causal mask"):
        cp._check_causal("attn", 4, window, False, q.device)


# -- what CP rewrites --------------------------------------------------------------------------


def test_sites_of_zoo_and_hf_models():
    model, graph = _traced("llama:hidden=32,layers=2,heads=2,seq=32,vocab=64")
    assert [(s.module, s.causal) for s in attention_sites(graph)] == [("layers.0.attn", True), ("layers.1.attn", True)]
    assert [(s.module, s.kind) for s in position_sites(model, graph)] == [
        ("layers.0.attn.rotary", "rope-table"),
        ("layers.1.attn.rotary", "rope-table"),
    ]
    model, graph = _traced("gpt:hidden=32,layers=2,heads=2,seq=32,vocab=64")
    assert [(s.module, s.kind) for s in position_sites(model, graph)] == [("embed.pos", "learned")]


@pytest.mark.hf
def test_sites_of_hf_llama():
    pytest.importorskip("transformers")
    model, graph = _traced("hf:llama:hidden=32,layers=2,heads=2,kv=1,seq=32,vocab=64")
    assert [(s.module, s.kind) for s in position_sites(model, graph)] == [("model.rotary_emb", "rope-position-ids")]
    assert {s.module for s in attention_sites(graph)} == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert parallel_support(model, graph).cp_problem(2) == ""


def test_position_readers_see_the_positions_of_the_ranks_tokens():
    from nest_fx.apply.context_parallel import apply_context_parallel

    cp = ContextParallel(group=None, cp=2, rank=1)
    positions = load_balanced_indices(32, 2, 1)  # [8..15, 16..23]
    model, graph = _traced("llama:hidden=32,layers=2,heads=2,seq=32,vocab=64")
    rotary = model.layers[0].attn.rotary
    x = torch.randn(2, 2, 32, 16)
    full = rotary(x)
    done = apply_context_parallel(model, graph, cp)
    assert done["attention"] == ["layers.0.attn", "layers.1.attn"]
    torch.testing.assert_close(rotary(x[:, :, positions]), full[:, :, positions])
    model, graph = _traced("gpt:hidden=32,layers=2,heads=2,seq=32,vocab=64")
    apply_context_parallel(model, graph, cp)
    torch.testing.assert_close(model.embed.pos(torch.arange(16)), model.embed.pos.weight[positions])


@pytest.mark.hf
def test_hf_rotary_reads_the_positions_of_the_ranks_tokens():
    pytest.importorskip("transformers")
    from nest_fx.apply.context_parallel import apply_context_parallel

    model, graph = _traced("hf:llama:hidden=32,layers=2,heads=2,kv=1,seq=32,vocab=64")
    rotary, x = model.model.rotary_emb, torch.randn(1, 16, 32)
    full_cos, full_sin = rotary(x, torch.arange(32)[None])
    apply_context_parallel(model, graph, ContextParallel(group=None, cp=2, rank=0))
    cos, sin = rotary(x, position_ids=torch.arange(16)[None])
    positions = load_balanced_indices(32, 2, 0)
    torch.testing.assert_close(cos, full_cos[:, positions])
    torch.testing.assert_close(sin, full_sin[:, positions])
    with pytest.raises(ApplyError, match="position ids up to 20 for 16 local tokens"):
        rotary(x, position_ids=torch.arange(5, 21)[None])


# -- verdicts ------------------------------------------------------------------------------------


def test_cp_problem_accepts_causal_models():
    for spec in (
        "llama:hidden=32,layers=2,heads=2,seq=32,vocab=64",
        "gpt:hidden=32,layers=2,heads=2,seq=32,vocab=64",
        "moe:hidden=32,layers=2,heads=2,seq=32,vocab=64,experts=4,top_k=2,capacity_factor=2.0",
    ):
        model, graph = _traced(spec)
        assert parallel_support(model, graph).cp_problem(2) == "", spec


@pytest.mark.parametrize(
    "spec,seq,cp,match",
    [
        (
            "gpt:hidden=32,layers=2,heads=2,seq=32,vocab=64,causal=0",
            32,
            2,
            "layers.0.attn computes attention without a causal mask",
        ),
        (
            "moe:hidden=32,layers=2,heads=2,seq=32,vocab=64,experts=4,top_k=2,capacity_factor=1.0",
            32,
            2,
            "which tokens are dropped depends on the part of the sequence",
        ),
        (
            "llama:hidden=32,layers=2,heads=2,seq=32,vocab=64",
            30,
            2,
            "sequence length 30 is not divisible by 2 x cp = 4",
        ),
    ],
)
def test_cp_problem_names_what_it_cannot_shard(spec, seq, cp, match):
    model, graph = _traced(spec, seq)
    problem = parallel_support(model, graph).cp_problem(cp)
    assert match in problem and "fix:" in problem


@pytest.mark.hf
def test_cp_problem_refuses_hf_sliding_windows_and_eager_attention():
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=32,
        sliding_window=8,
        use_cache=False,
    )
    model = transformers.MistralForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    tokens = torch.randint(0, 64, (2, 32))
    graph = trace(model, (), {"input_ids": tokens})
    assert "sliding window of 8 tokens" in parallel_support(model, graph).cp_problem(2)
    model, _ = build_seeded("hf:llama:hidden=32,layers=2,heads=2,kv=1,seq=32,vocab=64")
    model.config._attn_implementation = "eager"
    graph = trace(model, (), {"input_ids": tokens})
    assert "layer model.layers.0 has no scaled_dot_product_attention call" in parallel_support(model, graph).cp_problem(
        2
    )


def test_runtime_refuses_a_loss_that_is_not_a_token_mean():
    model, graph = _traced("llama:hidden=32,layers=2,heads=2,seq=32,vocab=64")
    plan = uniform_plan(4, cp=2, microbatch_size=2)
    checks.check_context_parallel(plan, model, graph, lm_loss)
    checks.check_context_parallel(plan, model, graph, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))

    def last_token(out, y):
        return F.cross_entropy(out[:, -1], y[:, -1])

    with pytest.raises(ApplyError, match="loss_fn is not a mean over tokens"):
        checks.check_context_parallel(plan, model, graph, last_token)


# -- mesh ----------------------------------------------------------------------------------------


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int, world: int):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_mesh_has_a_cp_dim_between_dp_and_tp(fake_world):
    plan = uniform_plan(4, tp=2, cp=2, dp=2)
    table = rank_table(plan)
    assert table.shape == (1, 2, 2, 2) and table.flatten().tolist() == list(range(8))
    info = locate(plan, 5)
    assert (info.replica, info.cp_rank, info.tp_rank) == (1, 0, 1)
    fake_world(5, 8)
    mesh = build_mesh(plan, "cpu")
    assert mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
    assert mesh["cp"].mesh.tolist() == [5, 7] and mesh["tp"].mesh.tolist() == [4, 5]
    # gradients are averaged over every rank holding the same parameters: replicas x CP ranks
    assert data_parallel_mesh(mesh, plan).mesh.tolist() == [1, 3, 5, 7]


def test_hsdp_mesh_is_replicate_by_shard_times_cp(fake_world):
    plan = uniform_plan(4, cp=2, dp=4, dp_shard=2, zero=2)
    fake_world(6, 8)
    mesh = build_mesh(plan, "cpu")
    assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    hsdp = data_parallel_mesh(mesh, plan)
    assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert hsdp.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_hsdp_with_experts_meshes(fake_world):
    """HSDP x EP: replica r = i dp_shard + j ep + b; dense parameters on (dp_replicate, dp_shard),
    the experts of EP rank b on (dp_replicate, edp_shard), tokens exchanged inside "ep"."""
    plan = uniform_plan(4, dp=8, ep=2, dp_shard=4, zero=3)
    fake_world(6, 8)
    mesh = build_mesh(plan, "cpu")
    assert mesh.mesh_dim_names == ("pp", "dp_replicate", "edp_shard", "ep", "tp")
    assert data_parallel_mesh(mesh, plan).mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    experts = data_parallel_mesh(mesh, plan, experts=True)
    assert experts.mesh.tolist() == [[0, 2], [4, 6]] and experts.mesh_dim_names[0] == "dp_replicate"
    assert mesh["ep"].mesh.tolist() == [6, 7] and locate(plan, 6).ep_rank == 0


def _apply_on_meta(plan, spec="llama:hidden=64,layers=2,heads=4,seq=32,vocab=128"):
    from nest_fx.apply import auto_parallelize
    from nest_fx.models import build_model

    model, _ = build_model(spec, device="meta")
    tokens = torch.empty(plan.global_batch, 32, dtype=torch.long, device="meta")
    return auto_parallelize(
        model, tokens, global_batch_size=plan.global_batch, loss_fn=lm_loss, plan=plan, verbose=False
    )


def test_fsdp_shards_over_replicas_and_cp_ranks_and_hsdp_replicates(fake_world):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    fake_world(5, 8)
    pm = _apply_on_meta(uniform_plan(4, tp=2, cp=2, dp=2, zero=3, microbatch_size=1))
    weight = dict(pm.named_parameters())["layers.0.mlp.up.weight"]
    assert isinstance(weight, DTensor) and weight.device_mesh.mesh_dim_names == ("dp_cp", "tp")
    assert weight.device_mesh["dp_cp"].mesh.tolist() == [1, 3, 5, 7]
    assert pm.context_parallel.rank == 0 and pm.context_parallel.cp == 2
    dist.destroy_process_group()
    fake_world(6, 8)
    pm = _apply_on_meta(uniform_plan(4, dp=8, dp_shard=4, zero=2, microbatch_size=1))
    weight = dict(pm.named_parameters())["layers.0.mlp.up.weight"]
    assert weight.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert weight.placements == (Replicate(), Shard(0))
    assert weight.device_mesh.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_the_runtime_runs_and_the_cost_model_costs_the_same_plan():
    from nest_fx.cluster import load_cluster
    from nest_fx.cost.step_time import simulate
    from nest_fx.plan.may_run import unrun_fields
    from nest_fx.workload import workload_for_model

    cluster = load_cluster("dgx-h100:16")
    work = workload_for_model("llama:hidden=256,layers=4,heads=8,seq=256,vocab=1024", cluster)
    plan = uniform_plan(
        len(work),
        cp=2,
        dp=4,
        dp_shard=2,
        zero=2,
        tp=2,
        sequence_parallel=True,
        loss_parallel=True,
        recompute="op:matmuls",
    )
    assert unrun_fields(plan) == []
    result = simulate(plan, work, cluster)
    assert result.feasible and result.stages[0].cp_comm > 0 and result.devices_used == 16
    assert unrun_fields(uniform_plan(6, dp=4, ep=2, dp_shard=2, zero=1)) == []  # HSDP x EP runs
    assert unrun_fields(uniform_plan(6, dp=8, ep=4, dp_shard=2, zero=1)) == [
        "dp_shard=2 with ep=4: under HSDP the expert groups must lie inside the shard groups (use a dp_shard "
        "that is a multiple of ep=4, dp_shard=0, or ep=1)"
    ]
