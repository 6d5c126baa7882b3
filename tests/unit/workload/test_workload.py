"""Workload built from a traced model: how TP/EP/SP/recompute change each layer's cost."""

import json

import pytest
import torch

from nest_fx.cluster import load_cluster
from nest_fx.workload import workload_for_model
from nest_fx.workload.roofline import AnalyticalCompute
from nest_fx.workload import WorkloadError, load_workload, save_workload, workload_from_table, workload_to_table

SMALL = "llama:hidden=256,layers=4,heads=8,kv=4,seq=128,vocab=512"
MOE = "moe:hidden=128,layers=2,heads=4,kv=2,seq=64,vocab=256,experts=4"


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("dgx-a100:64")


@pytest.fixture(scope="module")
def small(cluster):
    return workload_for_model(SMALL, cluster)


def test_chain_is_head_blocks_tail(small):
    kinds = [layer.kind for layer in small.layers]
    assert kinds == ["head", "block", "block", "block", "block", "tail"]
    assert len({layer.signature for layer in small.layers if layer.kind == "block"}) == 1
    assert small.distinct() == [0, 1, 5]


def test_tp_shards_params_compute_and_activations(small):
    one, two, four = (small.cost(1, tp=t) for t in (1, 2, 4))
    # every parameter of a dense block but the two norm weights is in a TP pair
    norms = 2 * 256
    assert two.num_params == pytest.approx((one.num_params - norms) / 2 + norms)
    assert four.fwd_s < two.fwd_s < one.fwd_s
    assert four.act_bytes["none"] < two.act_bytes["none"] < one.act_bytes["none"]
    assert not one.comms
    kinds = sorted((c.kind, c.phase, c.count) for c in two.comms)
    assert kinds == [("all_reduce", "bwd", 2), ("all_reduce", "fwd", 2)]  # attention + MLP (Megatron f/g)
    assert two.comms[0].nbytes == 128 * 256 * 2  # b*s*h in bf16


def test_sequence_parallel_swaps_allreduce_and_shards_the_rest(small):
    # a middle block: the first one also slices the sequence (tests/unit/workload/test_sequence_edges.py)
    plain, sp = small.cost(2, tp=4), small.cost(2, tp=4, sp=True)
    # Korthikanti et al. 2022: with SP every saved activation of the layer is split over TP (the norms
    # SP shards run the model's code: tests/unit/workload/test_fused_norm_costs.py)
    model = small.for_runtime(norm_kernel="model")
    assert sp.act_bytes["none"] == pytest.approx(model.cost(2, tp=1).act_bytes["none"] / 4)
    assert sp.act_bytes["none"] < plain.act_bytes["none"]
    assert {c.kind for c in sp.comms} == {"all_gather", "reduce_scatter"}
    volume = lambda c: sum(x.nbytes * x.count * (2 if x.kind == "all_reduce" else 1) for x in c.comms)  # noqa: E731
    assert volume(sp) == volume(plain)


def test_recompute_ordering_and_time(small):
    c = small.cost(2, tp=1, mbs=2)
    act, rec = c.act_bytes, c.recompute_s
    # the op policies keep ever fewer outputs and re-run ever more of the forward
    assert act["full"] < act["op:attention"] < act["op"] < act["op:matmuls"] < act["none"]
    assert act["full"] == pytest.approx(2 * 128 * 256 * 2)  # only the layer input is kept
    assert rec["none"] == 0 < rec["op:matmuls"] < rec["op"] < rec["op:attention"] < rec["full"] == c.fwd_s
    # selective keeps every op output but the attention core's: with fused attention more than
    # autograd keeps (docs/runtime.md measures 1.54x on a Llama block), and it re-runs attention
    assert act["selective"] > act["none"] and 0 < rec["selective"] < rec["op"]


def test_microbatch_scales_linearly(small):
    one, four = small.cost(1, mbs=1), small.cost(1, mbs=4)
    assert four.act_bytes["none"] == pytest.approx(4 * one.act_bytes["none"])
    assert four.out_bytes == 4 * one.out_bytes
    assert four.num_params == one.num_params
    assert one.fwd_s < four.fwd_s <= 4 * one.fwd_s  # bigger GEMMs run closer to peak


def test_flash_attention_drops_quadratic_scores(cluster):
    cpu = load_cluster("cpu-gloo:4")
    gpu_w = workload_for_model(SMALL, cluster).for_runtime(norm_kernel="model")  # flash on GPUs (as the CPU's norms)
    cpu_w = workload_for_model(SMALL, cpu)  # the traced (math) kernel on CPU
    assert gpu_w.cost(1).act_bytes["none"] < cpu_w.cost(1).act_bytes["none"]
    # selective recomputes the attention core: it keeps no scores, on either path
    assert cpu_w.cost(1).act_bytes["selective"] == gpu_w.cost(1).act_bytes["selective"]


def test_materialised_scores_cost_time_as_well_as_memory(cluster):
    # GPT-2-like layer at s = 2048 on an A100: the traced (pre-flash) attention core writes and
    # reads the (b, a, s, s) scores: the GEMMs two passes, a softmax kernel two more at 5 FLOP/score
    spec = "gpt:hidden=1024,layers=2,heads=16,seq=2048,vocab=512"
    flash = workload_for_model(spec, cluster, attention="flash").cost(1, tp=2, sp=True)
    traced = workload_for_model(spec, cluster, attention="traced").cost(1, tp=2, sp=True)
    timing = AnalyticalCompute.for_device(cluster.device, "bf16")
    scores = 16 / 2 * 2048 * 2048  # heads per TP rank x s x s, one sequence
    softmax = timing.op_seconds(5 * scores, 2 * 2 * scores, False)
    extra = traced.fwd_s - flash.fwd_s
    assert extra > softmax  # the softmax kernel, and the GEMMs' score passes on top
    assert traced.bwd_s == pytest.approx(2 * traced.fwd_s)  # backward = 2 x forward on every op
    # the fused kernel's backward runs five GEMMs for the forward's two: 2.5 x its forward
    src = workload_for_model(spec, cluster, attention="flash").source
    block = next(b for b in src.graph.blocks if b.kind == "block")
    times = src.node_times(block, 2, 1, True)
    kernel = [(f, b) for (f, b), n in zip(times, src.facts(block.index).nodes) if n.attention]
    assert len(kernel) == 1 and kernel[0][1] == pytest.approx(2.5 * kernel[0][0])
    # selective recompute re-runs the attention core, so it re-pays the score traffic
    assert traced.recompute_s["selective"] - flash.recompute_s["selective"] == pytest.approx(extra)
    assert traced.act_bytes["none"] > flash.act_bytes["none"]


def test_moe_expert_parallel(cluster):
    w = workload_for_model(MOE, cluster)
    assert w.is_moe and w.layers[1].is_moe
    c1, c2, c4 = (w.cost(1, ep=e) for e in (1, 2, 4))
    assert c1.expert_params > 0
    assert c2.expert_params == pytest.approx(c1.expert_params / 2)
    assert c4.num_params == pytest.approx(c1.num_params - c1.expert_params * 3 / 4)
    a2a = [c for c in c2.comms if c.kind == "all_to_all"]
    assert {c.phase for c in a2a} == {"fwd", "bwd"} and all(c.count == 2 for c in a2a)
    assert not [c for c in c1.comms if c.kind == "all_to_all"]


def test_table_round_trip(tmp_path, small):
    path = tmp_path / "w.json"
    save_workload(small, str(path), tps=(1, 2), mbss=(1, 2))
    loaded = load_workload(str(path))
    assert len(loaded) == len(small)
    for i in range(len(small)):
        for tp, mbs in ((1, 1), (2, 2)):
            a, b = small.cost(i, tp=tp, mbs=mbs), loaded.cost(i, tp=tp, mbs=mbs)
            assert b.fwd_s == pytest.approx(a.fwd_s) and b.act_bytes == pytest.approx(a.act_bytes)
            assert len(b.comms) == len(a.comms)
    # a microbatch size the table lacks is scaled from the nearest smaller one
    assert loaded.cost(1, tp=2, mbs=4).out_bytes == pytest.approx(2 * small.cost(1, tp=2, mbs=2).out_bytes)
    with pytest.raises(WorkloadError, match=r"no cost for tp=8"):
        loaded.cost(1, tp=8)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format="x"), "format"),
        (lambda d: d["dims"].pop("seq_len"), "seq_len"),
        (lambda d: d["layers"][1].update(kind="middle"), r"layers\[1\].kind"),
        (lambda d: d["layers"][1].update(signature="nope"), r"no costs entry"),
        (lambda d: next(iter(d["costs"].values()))[0].update(fwd_s=-1), "fwd_s"),
        (lambda d: next(iter(d["costs"].values()))[0].pop("out_bytes"), "out_bytes: missing"),
        (lambda d: next(iter(d["costs"].values()))[0].update(tp=0), r"\.tp: expected a positive integer"),
    ],
)
def test_bad_tables_name_the_field(small, mutate, message):
    data = json.loads(json.dumps(workload_to_table(small, tps=(1,))))
    mutate(data)
    with pytest.raises(WorkloadError, match=message):
        workload_from_table(data)


def test_roofline_formula_by_hand():
    comp = AnalyticalCompute(
        peak_flops=100e12,
        mem_bandwidth=1e12,
        matmul_efficiency=0.8,
        matmul_half_flops=1e9,
        memory_efficiency=0.5,
        vector_fraction=0.1,
        launch_s=1e-6,
    )
    # 1 TFLOP GEMM: efficiency 0.8 * 1e12/(1e12+1e9) -> 1e12/(100e12*0.7992) + 1 us
    assert comp.op_seconds(1e12, 1e6, True) == pytest.approx(1e12 / (100e12 * 0.8 * 1e12 / (1e12 + 1e9)) + 1e-6)
    # elementwise, memory bound: 1 GB moved at 0.5 TB/s
    assert comp.op_seconds(1e6, 1e9, False) == pytest.approx(2e-3 + 1e-6)
    assert comp.op_seconds(0, 0, False) == 0
    faster = AnalyticalCompute(peak_flops=200e12, mem_bandwidth=1e12)
    slower = AnalyticalCompute(peak_flops=100e12, mem_bandwidth=1e12)
    assert faster.op_seconds(1e11, 1e6, True) < slower.op_seconds(1e11, 1e6, True)


def test_dtype_changes_bytes(cluster):
    bf16 = workload_for_model(SMALL, cluster, dtype=torch.bfloat16)
    fp32 = workload_for_model(SMALL, cluster, dtype=torch.float32)
    assert fp32.cost(1).param_bytes == pytest.approx(2 * bf16.cost(1).param_bytes)
