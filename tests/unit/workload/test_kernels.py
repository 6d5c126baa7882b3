"""The kernel backend as a cost input (``kernels``: eager, compile, fused; nest_fx.workload.kernels).

Activation bytes per backend are checked against autograd on CPU: eager against the traced
block itself (as the recompute policies are, tests/unit/cost/test_cost_terms.py), fused against the same
block running reference fused RMSNorm and SwiGLU (autograd Functions that keep what a fused
kernel keeps: the norm's input and per-row scale, the SwiGLU's two inputs; their gradients equal
eager's). Times: fused elementwise regions and FlashAttention-3 make a block faster, compile
realises part of it; activations of a Llama block per token per hidden unit: ~59 eager, 34 fused
for Llama 3 8B's shape (Korthikanti et al. 2022: 34 for a GPT block).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from nest_fx.cluster import load_cluster
from nest_fx.cost.step_time import simulate
from nest_fx.models import build_seeded
from nest_fx.models.layers import RMSNorm, SwiGLU
from nest_fx.plan import Plan, uniform_plan
from nest_fx.plan.vocabulary import KERNELS
from nest_fx.workload import workload_for_model
from nest_fx.workload.kernels import KERNEL_BACKENDS, kernel_backend
from nest_fx.workload.roofline import AnalyticalCompute
from profiler.recompute_memory import kept_bytes
from fused_reference import FusedRMSNormFn, full_fusion_block_seconds

LLAMA = "llama:hidden=64,layers=4,heads=4,seq=32,vocab=128"
# Llama 3 8B's shape ratios (ffn 3.5 h, 4 query heads per key/value head), small enough to trace fast
LLAMA_SHAPED = "llama:hidden=512,layers=2,heads=8,kv=2,ffn=1792,vocab=1024,seq=1024"


class _FusedSwiGLUFn(torch.autograd.Function):
    """silu(a) * b keeping its two inputs (not silu(a))."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, dz):
        a, b = ctx.saved_tensors
        s = torch.sigmoid(a)
        return dz * b * s * (1 + a * (1 - s)), dz * F.silu(a)


class _FusedRMSNorm(RMSNorm):
    def forward(self, x):
        return FusedRMSNormFn.apply(x, self.weight, self.eps)


class _FusedSwiGLU(SwiGLU):
    def forward(self, x):
        return self.down(_FusedSwiGLUFn.apply(self.gate(x), self.up(x)))


def _fused_block(block):
    for module in block.modules():
        if type(module) is RMSNorm:
            module.__class__ = _FusedRMSNorm
        elif type(module) is SwiGLU:
            module.__class__ = _FusedSwiGLU
    return block


def test_backends_are_the_plans_vocabulary():
    assert tuple(KERNEL_BACKENDS) == KERNELS == ("eager", "compile", "fused")
    assert kernel_backend("", compile=True).name == "compile" and kernel_backend(None).name == "eager"
    assert kernel_backend("fused", compile=True).name == "fused"
    with pytest.raises(ValueError, match="eager"):
        kernel_backend("te")


def test_reference_fused_kernels_compute_the_eager_gradients():
    model, _ = build_seeded(LLAMA)
    block = model.layers[0]
    fused = _fused_block(build_seeded(LLAMA)[0].layers[0])
    x = torch.randn(2, 32, 64)
    grads = []
    for b in (block, fused):
        xx = x.clone().requires_grad_(True)
        b(xx).square().sum().backward()
        grads.append([xx.grad] + [p.grad for p in b.parameters()])
    for g_eager, g_fused in zip(*grads):
        torch.testing.assert_close(g_fused, g_eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_bytes_per_backend_equal_the_autograd_measurement(dtype):
    """Eager: what the block keeps; fused: what the block with the reference fused kernels keeps
    (the predicted 'none' counts the block input too, and tensors made outside the block that
    autograd saves, as in tests/unit/cost/test_cost_terms.py). In bf16 the CPU runs SDPA's flash kernel
    where the CPU trace is costed with the math path's saved scores (``attention="traced"``), so
    there the saving of fused over eager (the norms' fp32 copies, the SiLU output) is compared."""
    work = workload_for_model(LLAMA, load_cluster("cpu-gloo:1"), dtype=dtype)
    model, _ = build_seeded(LLAMA)
    block = model.layers[0].to(dtype)
    x = torch.randn(2, 32, 64, dtype=dtype)
    block_input = x.numel() * x.element_size()
    eager = kept_bytes(block, [x], "none") + block_input
    fused = kept_bytes(_fused_block(block), [x], "none") + block_input
    predicted = {k: work.for_runtime(kernels=k).cost(1, mbs=2).act_bytes["none"] for k in KERNELS}
    assert fused < eager
    if dtype == torch.float32:
        assert eager <= predicted["eager"] <= 1.1 * eager
        assert fused <= predicted["fused"] <= 1.1 * fused
    saving = predicted["eager"] - predicted["fused"]
    assert saving == pytest.approx(eager - fused, rel=0.1)
    assert predicted["compile"] == predicted["fused"]  # AOTAutograd's min cut keeps what fused kernels keep


@pytest.fixture(scope="module")
def shaped():
    return workload_for_model(LLAMA_SHAPED, load_cluster("dgx-h100:8"))


def test_llama_block_keeps_korthikanti_bytes_fused_and_fp32_copies_eager(shaped):
    """Per token per hidden unit (bf16): eager ~59 with the model's RMSNorm code (20 of them the
    RMSNorms' fp32 copies, 7 the SiLU output), fused 12 + 4 kv/heads + 6 f/h = 34 for f/h = 3.5,
    kv/heads = 1/4 (``workload.kernels``; Korthikanti's 34 for GPT). The runtime's default eager
    (F.rms_norm) is tests/unit/workload/test_fused_norm_costs.py's."""
    s, h = 1024, 512
    per = {
        k: shaped.for_runtime(kernels=k, norm_kernel="model").cost(1, mbs=1).act_bytes["none"] / (s * h)
        for k in KERNELS
    }
    assert 56 <= per["eager"] <= 61
    assert per["fused"] == pytest.approx(12 + 4 * 2 / 8 + 6 * 1792 / 512, abs=0.1)
    assert per["eager"] - per["fused"] >= 16 + 7 - 1


def test_fused_kernels_are_faster_and_compile_realises_part_of_it(shaped):
    # compile's fusion share was measured against eager PyTorch running the model's own norm code
    costs = {k: shaped.for_runtime(kernels=k, norm_kernel="model").cost(1, mbs=1) for k in KERNELS}
    t = {k: c.fwd_s + c.bwd_s for k, c in costs.items()}
    assert t["fused"] < t["compile"] < t["eager"]
    # compile: half the saving full fusion of the same regions would give (attention unchanged)
    t_full = full_fusion_block_seconds(shaped)
    assert t["eager"] - t["compile"] == pytest.approx(0.5 * (t["eager"] - t_full), rel=0.02)


def test_fused_attention_runs_at_cudnns_measured_causal_rate_on_hopper():
    h100 = AnalyticalCompute.for_device(load_cluster("dgx-h100:8").device)
    a100 = AnalyticalCompute.for_device(load_cluster("dgx-a100:8").device)
    flash = h100.with_kernels(False, "flash")
    assert flash.attention_efficiency == 0.34  # FlashAttention-2, measured
    fused = flash.with_kernels(True, "flash")  # the fused backend's attention, whatever SDPA would pick
    assert (fused.attention_efficiency, h100.attention_efficiency) == (0.64, 0.64)  # cuDNN, measured causal
    assert fused.attention_backward_factor == pytest.approx(2.5 * 0.64 / 0.52)
    assert a100.with_kernels(True) is a100 and h100.with_kernels(False) is h100


def test_plan_records_kernels_and_simulate_prices_them(shaped, tmp_path):
    cluster = load_cluster("dgx-h100:8")
    plan = uniform_plan(len(shaped), dp=8, zero=3, microbatch_size=1, num_microbatches=1)
    steps = {k: simulate(dataclasses.replace(plan, kernels=k), shaped, cluster).step_s for k in KERNELS}
    assert steps["fused"] < steps["compile"] < steps["eager"]
    assert simulate(dataclasses.replace(plan, compile=True), shaped, cluster).step_s == steps["compile"]
    assert simulate(plan, shaped, cluster).step_s == steps["eager"]  # '' = what the runtime runs
    path = tmp_path / "plan.json"
    dataclasses.replace(plan, kernels="fused").save(str(path))
    assert json.loads(path.read_text())["kernels"] == "fused"
    assert Plan.load(str(path)).kernels == "fused"
    data = json.loads(path.read_text())
    data["kernels"] = "te"
    path.write_text(json.dumps(data))
    with pytest.raises(Exception, match="kernels"):
        Plan.load(str(path))
