"""RMSNorms priced as the fused F.rms_norm the runtime runs (plan.norm_kernel; workload/fused_norms.py).

Saved bytes: the fused op keeps its input and one fp32 rstd per row (torch's derivatives.yaml),
so the zoo Llama block (bf16) keeps exactly the norms' two fp32 copies less per norm than its
own code (x.float() twice: 8 bytes per token per hidden unit each); the saving equals what autograd
measures on CPU between the block and the same block with a reference Function keeping what the
fused op keeps. Time: one memory-bound pass each way at the roofline's bandwidth. Only under the
eager backend, on a device with the fused kernel, and not for norms sequence parallelism shards."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from nest_fx.cluster import load_cluster
from nest_fx.cost.step_time import simulate
from nest_fx.graph import trace
from nest_fx.models import build_seeded
from nest_fx.models.layers import RMSNorm
from nest_fx.plan import Plan, uniform_plan
from nest_fx.plan.vocabulary import KERNELS
from nest_fx.workload import workload_for_model
from nest_fx.workload.build import analytical_workload
from nest_fx.workload.fused_norms import RSTD_BYTES
from nest_fx.workload.types import dims_from_config
from profiler.recompute_memory import kept_bytes
from fused_reference import FusedRMSNormFn, full_fusion_block_seconds

from norm_helpers import COST_LLAMA as LLAMA
from norm_helpers import SHAPED_H as H
from norm_helpers import SHAPED_S as S
from norm_helpers import block_norms as _norms
from norm_helpers import shaped_workload


@pytest.fixture(scope="module")
def shaped():
    return shaped_workload()


def _block(work):
    return next(i for i, layer in enumerate(work.layers) if layer.kind == "block")


class _ReferenceFusedNorm(RMSNorm):
    def forward(self, x):
        return FusedRMSNormFn.apply(x, self.weight, self.eps)


def test_the_default_keeps_the_norms_fp32_copies_less(shaped):
    """bf16 zoo Llama block at Llama 3 8B's ratios: 59.6 -> 43.6 bytes per token per hidden unit,
    16 = two norms x two fp32 copies of the input (x.float() twice) x 4 bytes."""
    model = shaped.for_runtime(norm_kernel="model").cost(1, mbs=1).act_bytes
    fused = shaped.cost(1, mbs=1).act_bytes  # '' = the runtime's default
    assert shaped.for_runtime(norm_kernel="fused") is shaped
    assert (model["none"] - fused["none"]) / (S * H) == pytest.approx(2 * 2 * 4, rel=1e-9)
    assert 56 <= model["none"] / (S * H) <= 61
    _, _, facts = _norms(shaped)
    assert [g.module for g in facts.norms] == ["layers.0.attn_norm", "layers.0.mlp_norm"]
    for g in facts.norms:  # the fused op's saved tensors: x (bf16) and one fp32 rstd per row
        assert (g.x_bytes, g.rows) == (S * H * 2, S)
    # selective keeps every op's output: the fused op's y and rstd instead of every fp32 intermediate
    assert fused["selective"] < model["selective"]
    for policy in ("full", "op", "op:matmuls", "op:attention"):
        assert fused[policy] == model[policy]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_priced_saving_is_what_autograd_measures(dtype):
    """The block's own norms against a reference Function keeping what the fused op keeps, on CPU:
    the measured difference of kept bytes is the priced one (norm_kernel model minus default)."""
    work = workload_for_model(LLAMA, load_cluster("dgx-h100:8"), dtype=dtype)
    i = _block(work)
    priced = (
        work.for_runtime(norm_kernel="model").cost(i, mbs=2).act_bytes["none"] - work.cost(i, mbs=2).act_bytes["none"]
    )
    block = build_seeded(LLAMA)[0].layers[0].to(dtype)
    fused = build_seeded(LLAMA)[0].layers[0].to(dtype)
    for name in ("attn_norm", "mlp_norm"):
        setattr(fused, name, _ReferenceFusedNorm(64).to(dtype))
    x = torch.randn(2, 32, 64, dtype=dtype)
    measured = kept_bytes(block, [x]) - kept_bytes(fused, [x])
    if dtype == torch.bfloat16:
        # the fused op keeps its input, here the block input, which kept_bytes leaves out as an argument;
        # the bf16 block's own norm keeps fp32 copies of it instead (in fp32, x.float() is x: both keep it)
        measured -= x.numel() * x.element_size()
    assert measured > 0
    assert priced == pytest.approx(measured, rel=1e-6)


def test_a_fused_norm_costs_one_memory_bound_pass_each_way(shaped):
    src, block, facts = _norms(shaped)
    timing = src.timing
    bw = timing.mem_bandwidth * timing.memory_efficiency
    fused = src.variant_times(block, 1, 1, False)
    model_src = shaped.for_runtime(norm_kernel="model").source
    model = model_src.variant_times(block, 1, 1, False)
    for g in facts.norms:
        x, w, rstd = g.x_bytes, g.weight_bytes, g.rows * RSTD_BYTES
        fwd = sum(fused[k][0] for k in g.members)
        bwd = sum(fused[k][1] for k in g.members)
        assert fwd == pytest.approx((2 * x + rstd + w) / bw + timing.launch_s, rel=1e-9)  # read x, write y, rstd
        # the input gradient (x, dy, rstd, w read, dx written), then the weight gradient (x, dy, rstd again; dw)
        assert bwd == pytest.approx((5 * x + 2 * rstd + 2 * w) / bw + 2 * timing.launch_s, rel=1e-9)
        unfused = sum(model[k][0] + model[k][1] for k in g.members)
        assert unfused > 3 * (fwd + bwd)  # nine ops, fp32 traffic and launches
    others = [k for k in range(len(fused)) if not any(k in g.members for g in facts.norms)]
    assert all(fused[k] == model[k] for k in others)
    costs = {nk: shaped.for_runtime(norm_kernel=nk).cost(1, mbs=1) for nk in ("", "model")}
    assert costs[""].fwd_s < costs["model"].fwd_s and costs[""].bwd_s < costs["model"].bwd_s


def test_fusing_backends_keep_their_bytes_and_compile_realises_half_of_what_is_left(shaped):
    """compile and fused fuse the norm's region already (their min cut keeps the norm's input too):
    their bytes do not depend on norm_kernel; compile realises half of the saving full fusion has
    over what eager runs (now with F.rms_norm), fused all of it (unchanged)."""
    cost = {
        (k, nk): shaped.for_runtime(kernels=k, norm_kernel=nk).cost(1, mbs=1) for k in KERNELS for nk in ("", "model")
    }
    for k in ("compile", "fused"):
        assert cost[(k, "")].act_bytes == cost[(k, "model")].act_bytes
    assert cost[("fused", "")] == cost[("fused", "model")]
    per = {k: cost[(k, "")].act_bytes["none"] / (S * H) for k in KERNELS}
    assert per["fused"] < per["compile"] < per["eager"]
    t = {k: cost[(k, "")].fwd_s + cost[(k, "")].bwd_s for k in KERNELS}
    assert t["fused"] < t["compile"] < t["eager"]
    assert t["compile"] < cost[("compile", "model")].fwd_s + cost[("compile", "model")].bwd_s
    t_full = full_fusion_block_seconds(shaped)
    assert t["eager"] - t["compile"] == pytest.approx(0.5 * (t["eager"] - t_full), rel=0.02)


def test_norms_sharded_by_sequence_parallelism_keep_the_models_code(shaped):
    model = shaped.for_runtime(norm_kernel="model")
    sp, sp_model = shaped.cost(1, tp=4, sp=True), model.cost(1, tp=4, sp=True)
    assert sp.act_bytes == sp_model.act_bytes and (sp.fwd_s, sp.bwd_s) == (sp_model.fwd_s, sp_model.bwd_s)
    tp, tp_model = shaped.cost(1, tp=4), model.cost(1, tp=4)  # without SP the norms see plain tensors
    assert tp.act_bytes["none"] < tp_model.act_bytes["none"] and tp.fwd_s < tp_model.fwd_s


def test_no_fused_kernel_on_cpu():
    """torch's CPU backend decomposes F.rms_norm: a CPU cluster prices the traced ops."""
    work = workload_for_model(LLAMA, load_cluster("cpu-gloo:2"), dtype=torch.float32)
    assert work.cost(1, mbs=2) == work.for_runtime(norm_kernel="model").cost(1, mbs=2)


def test_torch_rms_norm_is_fused_whatever_the_plan_says():
    """torch.nn.RMSNorm calls F.rms_norm itself: norm_kernel=model does not unfuse it."""
    model, cfg = build_seeded(LLAMA)
    for layer in model.layers:
        layer.attn_norm, layer.mlp_norm = nn.RMSNorm(64, eps=1e-5), nn.RMSNorm(64, eps=1e-5)
    model.to(torch.bfloat16)
    graph = trace(model, torch.zeros(2, 32, dtype=torch.long))
    cluster = load_cluster("dgx-h100:8")
    work = analytical_workload(graph, dims_from_config(cfg, seq_len=32), cluster, torch.bfloat16)
    i = _block(work)
    facts = _norms(work)[2]
    assert [g.kind for g in facts.norms] == ["native", "native"]
    assert work.cost(i) == work.for_runtime(norm_kernel="model").cost(i)
    for g in facts.norms:
        assert facts.nodes[g.members[0]].saved > g.x_bytes + g.rows * RSTD_BYTES  # the CPU trace's decomposition
    assert work.for_runtime(norm_kernel="model").source.runtime.model_norms_fused is False
    unfused = work.source.for_runtime()  # the same trace on a device without the fused kernel
    unfused.timing = dataclasses.replace(unfused.timing, fused_rms_norm=False)
    layer = work.layers[i]
    assert work.cost(i).act_bytes["none"] < unfused.cost(layer, 1, 1, 1, False).act_bytes["none"]


def test_plans_record_norm_kernel_and_simulate_prices_it(shaped, tmp_path):
    cluster = load_cluster("dgx-h100:8")
    plan = uniform_plan(len(shaped), dp=8, zero=3, microbatch_size=1, num_microbatches=1)
    fused = simulate(plan, shaped, cluster)
    model = simulate(dataclasses.replace(plan, norm_kernel="model"), shaped, cluster)
    assert simulate(dataclasses.replace(plan, norm_kernel="fused"), shaped, cluster).step_s == fused.step_s
    assert fused.step_s < model.step_s and fused.peak_reserved < model.peak_reserved
    path = tmp_path / "plan.json"
    dataclasses.replace(plan, norm_kernel="model").save(str(path))
    assert Plan.load(str(path)).norm_kernel == "model"
    with pytest.raises(Exception, match="norm_kernel"):
        dataclasses.replace(plan, norm_kernel="te").validate()
