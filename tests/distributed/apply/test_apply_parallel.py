"""Multi-process (gloo, CPU) equivalence: a parallel run equals the single-device run.

Each test launches N ranks (``nest_fx.apply.launch.launch``: a forkserver with torch
preloaded, killed after ``LAUNCH_S``), trains a tiny fp32 model for 3 SGD steps under a plan
with ``auto_parallelize`` and, on every rank, the same model on the whole batch; the losses of
every step, the full (unsharded) gradients of every step and the parameters after the third
step must agree within 1e-5.
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from nest_fx.apply.launch import launch
from nest_fx.models import build_seeded
from nest_fx.testing import equivalence
from parity_helpers import HF_LLAMA, LAUNCH_S, LLAMA, MOE, run

# one cell per kind of parallelism runs by default; the other cells are `slow` (pytest -m "")
pytestmark = pytest.mark.dist


@pytest.mark.timeout(LAUNCH_S + 30)
def test_dp4():
    # each rank passes only its own quarter of the batch
    run(4, LLAMA, {"dp": 4, "microbatch_size": 2}, local_batch=True)


@pytest.mark.timeout(LAUNCH_S + 30)
def test_tp2_dp2_sequence_parallel_selective_recompute():
    run(
        4,
        LLAMA,
        {
            "tp": 2,
            "dp": 2,
            "microbatch_size": 2,
            "num_microbatches": 2,
            "sequence_parallel": True,
            "recompute": "selective",
        },
    )


def _equivalence_recording_fsdp(spec: dict) -> dict:
    """``equivalence`` on this rank, with the FSDP2 warnings it raised."""
    import warnings  # only for this probe

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = equivalence(spec)
    result["fsdp_warnings"] = [str(w.message)[:80] for w in caught if "FSDP" in str(w.message)]
    return result


@pytest.mark.timeout(LAUNCH_S + 30)
def test_zero1_on_one_replica_shards_nothing_and_warns_nothing():
    """TP2 with zero=1 and dp=1: nothing to shard, so no FSDP2 (whose hooks warned that the TP
    blocks' outputs are views); the numbers equal one device's as with zero=0."""
    results = run(
        2, LLAMA, {"tp": 2, "zero": 1, "microbatch_size": 4, "num_microbatches": 2}, fn=_equivalence_recording_fsdp
    )
    assert all(r["fsdp_warnings"] == [] for r in results), results[0]["fsdp_warnings"]


def _build_llama(seed: int):
    return build_seeded(LLAMA, seed)


def _readme_loss(logits, y):
    """The README's loss_fn (a token-mean cross-entropy written by hand)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.mark.timeout(LAUNCH_S + 30)
def test_loss_parallel_with_the_readmes_own_loss():
    """TP2 with loss parallel and the README's lambda loss: accepted (it is the token cross-entropy),
    computed from vocabulary shards, equal to one device."""
    run(
        2,
        LLAMA,
        {"tp": 2, "loss_parallel": True, "microbatch_size": 4, "num_microbatches": 2},
        build=_build_llama,
        loss=_readme_loss,
    )


@pytest.mark.timeout(LAUNCH_S + 30)
def test_pp2_dp2_1f1b():
    results = run(4, LLAMA, {"pp": 2, "dp": 2, "microbatch_size": 1, "num_microbatches": 4, "schedule": "1f1b"})
    # stage 0 holds the embedding and layers 0-1, stage 1 layers 2-3, the norm and the LM head
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert results[0]["num_params"] + results[2]["num_params"] == 39


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_pp2_tp2_with_a_device_order():
    # plan rank r on the process launched as rank order[r]: stage 0's TP pair runs on launched ranks
    # {3, 0}, stage 1's on {2, 1}; launched rank 0 (hosting the rendezvous store) plays plan rank 1
    order = [3, 0, 2, 1]
    results = run(4, LLAMA, {"pp": 2, "tp": 2, "microbatch_size": 2, "num_microbatches": 4, "device_order": order})
    assert [r["stage"] for r in results] == [0, 1, 1, 0]  # results are in global rank order


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_pp2_tp2_dp2_eight_ranks():
    run(
        8,
        "llama:hidden=64,layers=2,heads=4,seq=16,vocab=128",
        {"pp": 2, "tp": 2, "dp": 2, "microbatch_size": 1, "num_microbatches": 4, "recompute": "full"},
        seq=16,
    )


@pytest.mark.timeout(LAUNCH_S + 30)
def test_ep4_moe():
    results = run(4, MOE, {"dp": 4, "ep": 4, "microbatch_size": 2})
    # 4 experts over 4 ranks: one expert (3 linears) per MoE layer per rank instead of 4
    full = 3 + 2 * (2 + 4 + 1 + 4 * 3)  # embed, norm, lm_head + per layer: norms, attn, router, experts
    assert all(r["num_params"] == full - 2 * 3 * 3 for r in results)


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.timeout(LAUNCH_S + 30)
def test_hf_llama_tp2():
    pytest.importorskip("transformers")
    run(2, HF_LLAMA, {"tp": 2, "microbatch_size": 4}, batch=4)


@pytest.mark.timeout(LAUNCH_S + 30)
def test_fsdp_zero3_interleaved_pp():
    """ZeRO-3 (FSDP2) inside an interleaved pipeline: 2 stages x 2 chunks, 2 replicas."""
    run(
        4,
        LLAMA,
        {
            "pp": 2,
            "dp": 2,
            "microbatch_size": 1,
            "num_microbatches": 4,
            "zero": 3,
            "schedule": "interleaved",
            "virtual_stages": 2,
        },
    )


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_ep2_tp2_moe_with_token_drops():
    """Expert parallel inside tensor parallel (TP-sharded experts, whose gradients are reduced over the
    edp group, not dp), selective recompute, capacity factor 1: dropped tokens are the same too."""
    run(
        4,
        "moe:hidden=64,layers=2,heads=4,seq=32,vocab=128,experts=4,top_k=2,capacity_factor=1.0",
        {"dp": 2, "ep": 2, "tp": 2, "microbatch_size": 2, "num_microbatches": 2, "recompute": "selective"},
    )


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_ep2_zero1_moe_pipeline():
    """FSDP (ZeRO-1/2) with experts sharded over their edp group, inside a 2-stage pipeline."""
    run(
        4, MOE, {"pp": 2, "dp": 2, "ep": 2, "microbatch_size": 2, "num_microbatches": 2, "zero": 1, "schedule": "gpipe"}
    )


def _fail_on_rank_one():
    import torch.distributed as dist

    from nest_fx.apply import init_distributed

    _, rank = init_distributed()
    if rank == 1:
        raise ValueError("rank one gives up")
    dist.barrier()  # the others wait forever for rank 1


@pytest.mark.timeout(60)
def test_a_failing_rank_fails_the_launch_instead_of_hanging():
    # the launch's own timeout lies beyond the test's (60 s): only the 5 s grace period ends it in time
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*ValueError: rank one gives up"):
        launch(_fail_on_rank_one, 2, timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_planner_choice_on_four_ranks():
    """No plan given: auto_parallelize runs the NEST planner on the cpu-gloo preset."""
    results = run(4, LLAMA, {})
    assert all(r["rank"] in range(4) for r in results)


def test_runtime_planner_uses_every_rank_and_respects_divisibility():
    from nest_fx.graph import trace
    from nest_fx.models import build_model, example_tokens
    from nest_fx.solver.runtime_planner import planner_for

    model, cfg = build_model("llama:hidden=64,layers=4,heads=4,kv=2,seq=32,vocab=128", device="cpu")
    graph = trace(model, example_tokens(8, 32, cfg.vocab_size))
    plan = planner_for(model)(graph, None, 4, 8)
    assert plan.devices_used == 4 and plan.global_batch == 8
    assert plan.uniform_tp in (1, 2)  # tp must divide kv_heads=2
    assert plan.num_layers == len(graph.blocks)


@pytest.mark.timeout(LAUNCH_S + 30)
def test_vocab_parallel_embedding_and_lm_head_uneven_vocab():
    # 127 tokens over tp=2: DTensor shards 64 + 63 rows; the logits are all-gathered for the loss
    results = run(2, "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=127", {"tp": 2, "microbatch_size": 4})
    for r in results:
        assert {"embed.tok.weight", "embed.pos.weight", "lm_head.weight"} <= set(r["sharded"]), r["sharded"]


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_tied_embeddings_stay_replicated_under_tp():
    results = run(
        2, "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=128,tie_embeddings=1", {"tp": 2, "microbatch_size": 4}
    )
    for r in results:
        assert "embed.tok.weight" not in r["sharded"] and "lm_head.weight" not in r["sharded"]
        assert "embed.pos.weight" in r["sharded"]
