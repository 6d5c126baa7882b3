"""The cost model's terms for today's PyTorch-native training, each checked against what would
make it wrong: recompute policies against the CPU autograd measurement, the layer table's
round trip, the tied copy under PP, CP traffic and causal work, loss parallel, HSDP, interleaved
in-flight activations per chunk, the allocator's reserved memory (docs/cost_model.md)."""

from __future__ import annotations

import pytest
import torch

from nest_fx.cluster import Cluster, load_cluster
from nest_fx.cost.inflight import held_activation_bytes, interleaved_chunk_states, pipeline_inflight_microbatches
from nest_fx.cost.memory import live_bytes
from nest_fx.cost.options import USABLE_MEMORY_FRACTION
from nest_fx.cost.stage_terms import stage_groups
from nest_fx.cost.step_time import simulate
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan
from nest_fx.workload import load_workload, save_workload, workload_for_model
from nest_fx.workload.traced_source import attention_work
from profiler.recompute_memory import kept_bytes

LLAMA = "llama:hidden=64,layers=4,heads=4,seq=32,vocab=128"
GPT = "gpt:hidden=256,layers=4,heads=8,seq=256,vocab=4096"


@pytest.fixture(scope="module")
def h100():
    return load_cluster("dgx-h100:16")


@pytest.fixture(scope="module")
def gpt(h100):
    return workload_for_model(GPT, h100)


def test_saved_bytes_per_block_equal_the_autograd_measurement():
    """Each op-level policy (and selective) keeps exactly the storages the runtime's checkpointed
    block keeps on CPU; full keeps the block input only; none is what the saved-tensor hooks saw
    while tracing: the measured bytes plus the block input and the tensors made outside the block
    that autograd saves (the rotary tables), so never below the measurement."""
    work = workload_for_model(LLAMA, load_cluster("cpu-gloo:1"), dtype=torch.float32)
    predicted = work.cost(1, mbs=2).act_bytes
    model, _ = build_seeded(LLAMA)
    block, x = model.layers[0], torch.randn(2, 32, 64)
    block_input = x.numel() * x.element_size()
    for policy in ("selective", "op", "op:matmuls", "op:attention"):
        assert predicted[policy] == kept_bytes(block, [x], policy), policy
    assert kept_bytes(block, [x], "full") == 0 and predicted["full"] == block_input
    measured = kept_bytes(block, [x], "none") + block_input
    assert measured <= predicted["none"] <= 1.1 * measured


def test_backward_scratch_survives_the_layer_table(gpt, tmp_path):
    path = tmp_path / "w.json"
    save_workload(gpt, str(path), tps=(1, 2))
    back = load_workload(str(path))
    tail = len(gpt) - 1
    for tp in (1, 2):
        assert back.cost(tail, tp).bwd_scratch == gpt.cost(tail, tp).bwd_scratch > 0
    plan = uniform_plan(len(gpt), dp=16, num_microbatches=1)
    assert simulate(plan, back, load_cluster("dgx-h100:16")).stages[0].memory["total"] == pytest.approx(
        simulate(plan, gpt, load_cluster("dgx-h100:16")).stages[0].memory["total"]
    )


def test_tied_head_keeps_a_second_copy_on_the_last_stage(h100):
    tied = workload_for_model(GPT + ",tie_embeddings=true", h100)
    untied = workload_for_model(GPT, h100)
    embedding = tied.cost(len(tied) - 1).tied_params
    assert embedding == 4096 * 256 and untied.cost(len(untied) - 1).tied_params == 0
    plan = uniform_plan(len(tied), pp=2, dp=8, num_microbatches=4)
    t, u = simulate(plan, tied, h100), simulate(plan, untied, h100)
    # the tied copy weighs what the untied head does: the same weights, grads and Adam states
    for term in ("weights", "grads", "optimizer"):
        assert t.stages[1].memory[term] == pytest.approx(u.stages[1].memory[term])
    assert t.breakdown["tied_grad_sync"] > 0 == u.breakdown["tied_grad_sync"]
    one = simulate(uniform_plan(len(tied), dp=16, num_microbatches=1), tied, h100)
    assert one.breakdown["tied_grad_sync"] == 0  # one stage holds one copy


def test_context_parallel_traffic_and_activations_per_layer(gpt):
    base = gpt.cost(1)
    kv = 2 * 256 * 256 * 2  # keys and values of one sequence of the traced microbatch, bf16
    for cp in (2, 4):
        c = gpt.cost(1, cp=cp)
        cp_comms = [(x.kind, x.nbytes, x.phase, x.count) for x in c.comms if x.group == "cp"]
        assert cp_comms == [("all_gather", kv, "fwd", 1), ("reduce_scatter", kv, "bwd", 1)]
        # a rank keeps 1/cp of the activations, plus the gathered keys and values it attends to
        assert c.act_bytes["none"] == pytest.approx(base.act_bytes["none"] / cp + kv * (1 - 1 / cp))
        assert c.fwd_s < base.fwd_s


@pytest.mark.parametrize("seq, cp", [(16, 2), (32, 4), (64, 8)])
def test_causal_work_per_rank_counts_the_masked_kernel(seq, cp):
    chunk = seq // (2 * cp)
    positions = torch.arange(seq)
    for rank in range(cp):  # chunks rank and 2 cp - 1 - rank, each up to its end under a causal mask
        scores = sum(chunk * (j + 1) * chunk for j in (rank, 2 * cp - 1 - rank))
        assert attention_work(seq, cp, True) == pytest.approx(scores / seq**2)
    lower = int((positions[:, None] >= positions[None, :]).sum())
    assert attention_work(seq, 1, True) == pytest.approx(lower / seq**2)
    assert attention_work(seq, 1, False) == 1.0


def test_loss_parallel_shards_the_loss_and_replaces_the_logit_gather(gpt):
    tail = len(gpt) - 1
    full, lp = gpt.cost(tail, tp=4), gpt.cost(tail, tp=4, lp=True)
    # two fp32 gradients of the full logits; the vocabulary-parallel loss works in place (the softmax
    # it kept becomes the fp32 gradient) and allocates only that gradient's cast to the bf16 logits
    assert full.bwd_scratch == 2 * 256 * 4096 * 4
    assert lp.bwd_scratch == 256 * 4096 * 2 / 4
    logits = 256 * 4096 * 4  # fp32 logits of the traced sequence
    assert full.act_bytes["none"] - lp.act_bytes["none"] == pytest.approx(logits * 3 / 4, rel=0.05)
    assert "all_gather" in {x.kind for x in full.comms} and "all_gather" not in {x.kind for x in lp.comms}
    # the max, then the sum of exponentials and the target logit: one fp32 value per token each
    assert sorted(x.nbytes for x in lp.comms if x.kind == "all_reduce")[:2] == [256 * 4, 2 * 256 * 4]


def test_hsdp_memory_by_shard_degree_and_traffic_by_level(gpt, h100):
    results = {s: simulate(uniform_plan(len(gpt), dp=16, zero=3, dp_shard=s), gpt, h100) for s in (0, 2, 4, 8)}
    full = results[0].stages[0].memory
    for shard in (2, 4, 8):
        mem = results[shard].stages[0].memory
        for term in ("weights", "optimizer"):
            assert mem[term] == pytest.approx(full[term] * 16 / shard)
    # sharding inside the node (8 devices) and replicating across: the parameter all-gathers and
    # gradient reduce-scatters stay on NVLink; only the 1/8 replicas' all-reduce crosses nodes
    assert results[8].stages[0].dp_sync < results[0].stages[0].dp_sync


def test_interleaved_schedule_holds_the_tail_about_once():
    p, m, v = 4, 8, 4
    states = interleaved_chunk_states(p - 1, p, m, v)
    assert max(last for _, _, last in states) <= 2  # the tail's chunk: backward right after forward
    spread = max(s for s, _, _ in states)
    assert spread == pytest.approx(pipeline_inflight_microbatches("interleaved", p - 1, p, m, v))
    act, root = 100.0, 40.0
    held = held_activation_bytes(act, root, "interleaved", p - 1, p, m, v)
    assert held < act * spread  # evenly spread, the tail would count spread times
    assert held == pytest.approx(max((act - root) * s + root * last for s, _, last in states))
    assert held_activation_bytes(act, root, "1f1b", 0, p, m) == act * pipeline_inflight_microbatches("1f1b", 0, p, m)


def test_reserved_memory_is_what_must_fit(gpt, h100):
    r = simulate(uniform_plan(len(gpt), dp=16, num_microbatches=1), gpt, h100)
    s = r.stages[0]
    assert s.memory["allocator_cache"] > 0 and s.reserved == pytest.approx(s.memory["total"])  # expandable
    assert r.peak_reserved == pytest.approx(s.reserved)
    assert s.fits and s.reserved <= h100.device.memory_bytes * USABLE_MEMORY_FRACTION
    # a device large enough for the live bytes but not for what the allocator reserves: no fit
    between = (live_bytes(s.memory) + s.reserved) / 2 / USABLE_MEMORY_FRACTION
    small = Cluster.from_dict(dict(h100.to_dict(), device=dict(h100.to_dict()["device"], memory_bytes=between)))
    tight = simulate(uniform_plan(len(gpt), dp=16, num_microbatches=1), gpt, small)
    assert live_bytes(tight.stages[0].memory) < between * USABLE_MEMORY_FRACTION and not tight.feasible


def test_fused_attention_runs_at_the_measured_rate_of_the_pinned_sdpa_kernel(h100):
    """Hopper: cuDNN's attention by default (what torch >= 2.11 picks and the runtime pins), FlashAttention-2
    when the plan names flash; forward and backward at their own measured rates; Ampere: the GEMM figure."""
    from nest_fx.workload.roofline import AnalyticalCompute

    hopper = AnalyticalCompute.for_device(h100.device)
    flash = hopper.with_kernels(False, "flash")
    ampere = AnalyticalCompute.for_device(load_cluster("dgx-a100:8").device)
    assert hopper.attention_efficiency == 0.64 and flash.attention_efficiency == 0.34
    assert ampere.attention_efficiency is None
    assert hopper.attention_backward_factor == pytest.approx(2.5 * 0.64 / 0.52)
    assert flash.attention_backward_factor == pytest.approx(2.5 * 0.34 / 0.32)
    flops = 1e12
    assert hopper.op_seconds(flops, 0, True, attention=True) == pytest.approx(
        hopper.op_seconds(flops, 0, True) * 0.75 / 0.64, rel=1e-2
    )  # + one launch
    assert flash.op_seconds(flops, 0, True, attention=True) == pytest.approx(
        hopper.op_seconds(flops, 0, True) * 0.75 / 0.34, rel=1e-2
    )
    assert ampere.op_seconds(flops, 0, True, attention=True) == ampere.op_seconds(flops, 0, True)


def test_hsdp_with_experts_shards_them_inside_the_shard_group(h100):
    """HSDP x EP (apply/mesh.py): the experts shard over the shard group's replicas owning them
    (dp_shard / ep) and replicate across the groups, so halving the shard group doubles every
    state, dense and expert alike, and their gradient traffic keeps to the shard group's node."""
    moe = workload_for_model("moe:hidden=256,layers=2,heads=8,seq=256,vocab=4096,experts=8,top_k=2", h100)
    plans = {s: uniform_plan(len(moe), dp=16, ep=2, zero=3, dp_shard=s) for s in (0, 8)}
    results = {s: simulate(plan, moe, h100) for s, plan in plans.items()}
    for term in ("weights", "optimizer"):
        assert results[8].stages[0].memory[term] == pytest.approx(2 * results[0].stages[0].memory[term])
    groups = stage_groups(plans[8], 0)
    assert len(groups.expert_shard) == 4 and set(groups.expert_shard) <= set(groups.shard)
    assert results[8].stages[0].dp_sync < results[0].stages[0].dp_sync


def test_ring_cp_hides_the_forward_transfers_under_compute(gpt, h100):
    """cp_mode=ring moves the all-gather mode's K/V bytes, the forward's under the blocks' compute
    (apply/ring_attention.py), the backward's exposed: at least half of the all-gather's seconds."""
    gather = simulate(uniform_plan(len(gpt), cp=2, dp=8), gpt, h100).stages[0]
    ring = simulate(uniform_plan(len(gpt), cp=2, dp=8, cp_mode="ring"), gpt, h100).stages[0]
    assert gather.cp_comm > 0 and gather.cp_comm / 2 <= ring.cp_comm < gather.cp_comm
