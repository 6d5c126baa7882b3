"""llama2-7b on the meta device for 1,024 ranks (TP8 x PP8 x DP16) in one process.

The fake process group (``torch.testing._internal.distributed.fake_pg``) lets one process
pretend to be any rank of a 1,024-rank world: collectives return immediately, so
``auto_parallelize`` builds the real DeviceMesh, pipeline split, TP/SP and FSDP rewrites
without memory or peers, and we check the local shard shapes a real rank would hold.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nest_fx.apply import auto_parallelize
from nest_fx.apply.losses import lm_loss
from nest_fx.models import build_model
from nest_fx.plan import uniform_plan

WORLD = 1024
H, FFN, VOCAB = 4096, 11008, 32000


@pytest.fixture(scope="module")
def graph7b(zoo):
    return zoo("llama2-7b")[3]


def _apply(rank: int, graph, **plan_kwargs):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    model, _ = build_model("llama2-7b", device="meta")
    plan = uniform_plan(34, pp=8, tp=8, dp=16, microbatch_size=1, num_microbatches=8, **plan_kwargs)
    tokens = torch.empty(1, 128, dtype=torch.long, device="meta")
    pm = auto_parallelize(model, tokens, global_batch_size=128, loss_fn=lm_loss, plan=plan, graph=graph, verbose=False)
    return pm


def _local_shapes(pm):
    return {n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape) for n, p in pm.named_parameters()}


@pytest.fixture
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_first_stage_tp_shards(graph7b, fake_world):
    pm = _apply(0, graph7b, zero=0)
    info = pm.rank_info
    assert (info.stage, info.replica, info.tp_rank) == (0, 0, 0)
    shapes = _local_shapes(pm)
    # chain [0, 4): embedding + layers 0-2; layers 3.. live on other stages
    assert {n.split(".")[1] for n in shapes if n.startswith("layers.")} == {"0", "1", "2"}
    assert shapes["embed.tok.weight"] == (VOCAB // 8, H)  # vocabulary-parallel embedding
    assert "lm_head.weight" not in shapes and "norm.weight" not in shapes
    for name, shape in [
        ("attn.q_proj", (H // 8, H)),
        ("attn.k_proj", (H // 8, H)),
        ("attn.v_proj", (H // 8, H)),
        ("attn.o_proj", (H, H // 8)),
        ("mlp.gate", (FFN // 8, H)),
        ("mlp.up", (FFN // 8, H)),
        ("mlp.down", (H, FFN // 8)),
        ("attn_norm", (H,)),
    ]:
        assert shapes[f"layers.1.{name}.weight"] == shape, name
    # the TP group is the 8 adjacent ranks, DP replicas are 8 apart, stages 128 apart
    assert pm.mesh["tp"].mesh.tolist() == list(range(8))
    assert pm.mesh["dp"].mesh.tolist() == list(range(0, 128, 8))
    assert pm.mesh["pp"].mesh.tolist() == list(range(0, 1024, 128))
    assert pm.pipeline_stages[0].is_first and not pm.pipeline_stages[0].is_last


def test_last_stage_zero3_sequence_parallel(graph7b, fake_world):
    pm = _apply(1023, graph7b, zero=3, sequence_parallel=True, recompute="selective")
    info = pm.rank_info
    assert (info.stage, info.replica, info.tp_rank) == (7, 15, 7)
    shapes = _local_shapes(pm)
    # chain [29, 34): layers 28-31 + final norm + LM head
    assert {n.split(".")[1] for n in shapes if n.startswith("layers.")} == {"28", "29", "30", "31"}
    # FSDP shards dim 0 of the TP shard over the 16 replicas
    assert shapes["layers.30.attn.q_proj.weight"] == (H // 8 // 16, H)
    assert shapes["layers.30.attn.o_proj.weight"] == (H // 16, H // 8)
    assert shapes["layers.30.mlp.down.weight"] == (H // 16, FFN // 8)
    assert shapes["layers.30.mlp.gate.weight"] == (-(-FFN // 8 // 16), H)  # 1376 = 16 * 86
    assert shapes["lm_head.weight"] == (VOCAB // 8 // 16, H)  # vocabulary-parallel, then FSDP
    assert shapes["norm.weight"] == (H // 16,)
    # sequence parallel: the norms inside blocks are replicated DTensors over TP (then FSDP-sharded)
    norm = dict(pm.named_parameters())["layers.30.attn_norm.weight"]
    assert isinstance(norm, DTensor) and norm.device_mesh.mesh_dim_names == ("dp", "tp")
    assert pm.mesh["tp"].mesh.tolist() == list(range(1016, 1024))
    assert pm.pipeline_stages[0].is_last
    assert getattr(pm.module.get_submodule("layers.30"), "_nest_fx_recompute") == "selective"
    # linears and the LM head are split 8 (TP) x 16 (FSDP) ways; norms (replicated over TP) 16 ways
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in pm.parameters())
    per_layer = (4 * H * H + 3 * H * FFN) // 128 + 2 * H // 16
    assert local == 4 * per_layer + VOCAB * H // 128 + H // 16


def test_replica_major_middle_rank(graph7b, fake_world):
    pm = _apply(8 * 8 * 5 + 8 * 3 + 2, graph7b, zero=1, placement="replica-major")
    info = pm.rank_info
    # replica-major: replica r owns ranks [64 r, 64 r + 64); stage i, TP rank j is 64 r + 8 i + j
    assert (info.replica, info.stage, info.tp_rank) == (5, 3, 2)
    assert pm.mesh["tp"].mesh.tolist() == list(range(64 * 5 + 24, 64 * 5 + 32))
    assert pm.mesh["pp"].mesh.tolist() == [64 * 5 + 8 * i + 2 for i in range(8)]
    assert pm.mesh["dp"].mesh.tolist() == [64 * r + 24 + 2 for r in range(16)]
    shapes = _local_shapes(pm)
    assert {n.split(".")[1] for n in shapes if n.startswith("layers.")} == {"11", "12", "13", "14", "15"}
    assert shapes["layers.12.mlp.up.weight"] == (-(-FFN // 8 // 16), H)


def test_device_order_numbers_the_world_for_the_plan(fake_world):
    """Launched rank device_order[r] plays plan rank r: it joins the default group as rank r (the
    mesh stays over plan ranks, increasing along every dim). A group the caller initialised
    cannot be renumbered: a clear error instead of silently running another placement."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nest_fx.apply.distributed import plan_rank_of
    from nest_fx.apply.checks import ApplyError
    from nest_fx.apply.mesh import build_mesh, dim_group, locate

    order = [0, 4, 1, 5, 2, 6, 3, 7]  # TP pairs on devices {0, 4}, {1, 5}, ..: e.g. one device of each island
    plan = uniform_plan(6, pp=2, tp=2, dp=2, microbatch_size=1, num_microbatches=2, device_order=order)
    assert [plan_rank_of(order, g) for g in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert plan_rank_of(None, 5) == 5
    launched = order[plan.rank(1, 0, 1)]  # the process on this device plays stage 1, replica 0, TP rank 1
    me = plan_rank_of(order, launched)
    dist.init_process_group("fake", store=FakeStore(), rank=me, world_size=8)
    mesh = build_mesh(plan, "cpu")
    info = locate(plan, me)
    assert (info.stage, info.replica, info.tp_rank) == (1, 0, 1)
    tp_group = dist.get_process_group_ranks(dim_group(mesh, "tp"))
    assert tp_group == sorted(tp_group) and [order[r] for r in tp_group] == [
        order[plan.rank(1, 0, j)] for j in range(2)
    ]
    model, _ = build_model("llama:hidden=64,layers=4,heads=4,seq=32,vocab=128", device="meta")
    with pytest.raises(ApplyError, match="device_order: .* initialised before auto_parallelize"):
        auto_parallelize(
            model,
            torch.empty(4, 32, dtype=torch.long, device="meta"),
            global_batch_size=4,
            loss_fn=lm_loss,
            plan=plan,
            verbose=False,
        )
