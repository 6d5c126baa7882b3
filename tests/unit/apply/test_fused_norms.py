"""The runtime's fused RMSNorms (nest_fx/apply/fused_norms.py, plan.norm_kernel): the recognised
norms run F.rms_norm with the model's own numbers, parameter names and state dict; mixed dtypes
and calls it cannot take fall back to the model's code; torch.compile traces the swapped forward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

from nest_fx.apply.compile import compile_problem
from nest_fx.apply.fused_norms import swaps_norms, use_fused_norms
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
    assert calls.rms_norm == 5
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
    assert y.dtype == ref(x).dtype == torch.float32 and calls.rms_norm == 0
    torch.testing.assert_close(y, ref(x))
    with calls:
        norm.to(torch.bfloat16)(x)
    assert calls.rms_norm == 1


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
