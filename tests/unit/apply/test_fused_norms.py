"""The runtime's fused RMSNorms (nest_fx/apply/fused_norms.py, plan.norm_kernel): the recognised
norms run F.rms_norm (off CUDA its formula out of place) with the model's own numbers, parameter
names and state dict; mixed dtypes and calls it cannot take fall back to the model's code;
selective activation checkpointing and torch.compile take the swapped forward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

from nest_fx.apply.compile import compile_problem
from nest_fx.apply.activation_checkpoint import checkpoint_module
from nest_fx.apply.fused_norms import fused_rms_norm, swaps_norms, use_fused_norms
from nest_fx.models import build_seeded
from nest_fx.models.layers import RMSNorm
from norm_helpers import HF_LLAMA, LLAMA, NormCalls, loss_and_grads


@pytest.mark.parametrize("name", [LLAMA, HF_LLAMA])
def test_swapped_norms_compute_the_models_loss_and_gradients(name):
    model, _ = build_seeded(name)
    fused = copy.deepcopy(model)
    names = use_fused_norms(fused)
    assert len(names) == 5 and use_fused_norms(fused) == []  # swapped once
    assert list(fused.state_dict()) == list(model.state_dict())
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in model.named_parameters()]
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    loss, grads = loss_and_grads(model, tokens)
    calls = NormCalls()
    with calls:
        fused_loss, fused_grads = loss_and_grads(fused, tokens)
    assert (calls.rms_norm, calls.out_of_place) == (0, 5)  # on CPU: the formula out of place, not F.rms_norm
    torch.testing.assert_close(fused_loss, loss, rtol=1e-6, atol=1e-6)
    for n, g in grads.items():
        torch.testing.assert_close(fused_grads[n], g, rtol=1e-5, atol=1e-6)


def test_mixed_dtypes_run_the_models_code():
    """HF's ``weight * x.to(input_dtype)`` with an fp32 weight and a bf16 input is fp32; F.rms_norm
    would return bf16: the model's forward runs instead."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(16)
    ref = copy.deepcopy(norm)
    assert use_fused_norms(nn.Sequential(norm)) == ["0"]
    x = torch.randn(3, 16).bfloat16()
    calls = NormCalls()
    with calls:
        y = norm(x)
    assert y.dtype == ref(x).dtype == torch.float32 and calls.fused == 0
    torch.testing.assert_close(y, ref(x))
    with calls:
        norm.to(torch.bfloat16)(x)
    assert calls.fused == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("eps", [1e-6, None], ids=str)
def test_fused_rms_norm_is_f_rms_norm_on_cpu(dtype, eps):
    """Off CUDA the out-of-place formula: F.rms_norm's output bitwise, its gradients to the dtype's
    rounding (autograd of the same ops in another order)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 16, generator=gen) * 4).to(dtype).requires_grad_()
    w = (torch.rand(16, generator=gen) + 0.5).to(dtype).requires_grad_()
    dy = torch.randn(3, 5, 16, generator=gen).to(dtype)
    y, want = fused_rms_norm(x, (16,), w, eps), F.rms_norm(x, (16,), w, eps)
    assert y.dtype == want.dtype and torch.equal(y, want)
    for g, r in zip(torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(want, (x, w), dy)):
        torch.testing.assert_close(g, r)
    with pytest.raises(ValueError, match="last dimension only"):
        fused_rms_norm(x, (5, 16), None, eps)


@pytest.mark.parametrize("recompute", ["selective", "op", "full"])
def test_swapped_norms_under_activation_checkpointing(recompute):
    """The runtime's recompute policies (activation_checkpoint.checkpoint_module) over blocks with
    swapped norms give the model's loss and gradients on CPU. Selective checkpointing refuses a
    cached tensor mutated later: F.rms_norm's CPU decomposition (add_, rsqrt_ on the mean) failed
    in backward with "Tensor cached during selective activation checkpoint has been mutated"."""
    model, _ = build_seeded(LLAMA)
    swapped = copy.deepcopy(model)
    assert len(use_fused_norms(swapped)) == 5
    for block in swapped.layers:
        checkpoint_module(block, recompute)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    loss, grads = loss_and_grads(model, tokens)
    calls = NormCalls()
    with calls:
        got_loss, got_grads = loss_and_grads(swapped, tokens)
    assert calls.fused == 5 + 4  # the blocks' 4 norms run again in backward
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=1e-6)
    for n, g in grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-5, atol=1e-6)


def test_only_recognised_norms_are_swapped():
    model = nn.Sequential(GemmaRMSNorm(16), nn.LayerNorm(16), RMSNorm(16), nn.RMSNorm(16))
    assert use_fused_norms(model) == ["2"]  # torch.nn.RMSNorm calls F.rms_norm itself
    assert "forward" not in model[0].__dict__ and "forward" not in model[3].__dict__


def test_norm_kernel_values():
    assert swaps_norms("") and swaps_norms("fused") and swaps_norms("memory-efficient") and not swaps_norms("model")
    with pytest.raises(ValueError, match="swaps no norm"):
        use_fused_norms(nn.Sequential(RMSNorm(16)), "model")


@pytest.mark.skipif(bool(compile_problem("cpu")), reason="torch.compile has no C++ compiler here")
def test_compile_traces_the_swapped_forward():
    model, _ = build_seeded(LLAMA)
    fused = copy.deepcopy(model)
    use_fused_norms(fused)
    for block in fused.layers:
        block.compile()
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(model, tokens)
    fused_loss, fused_grads = loss_and_grads(fused, tokens)
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-6)
    for n, g in grads.items():
        torch.testing.assert_close(fused_grads[n], g, rtol=1e-4, atol=1e-5)
