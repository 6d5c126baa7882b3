"""RMSNorms the runtime does not swap (torch.nn.RMSNorm with or without a weight, F.rms_norm in a
block's own forward) inside blocks under the recompute policies on CPU: off CUDA F.rms_norm
decomposes into ops some of which are in place, which selective activation checkpointing refused
in backward ("Tensor cached during selective activation checkpoint has been mutated"); the
checkpointed blocks now run them out of place (fused_norms.OutOfPlaceRMSNorms) with the model's
loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nest_fx.apply.activation_checkpoint import checkpoint_module
from nest_fx.apply.fused_norms import OutOfPlaceRMSNorms
from norm_helpers import NormCalls, build_torch_norm_llama, loss_and_grads


class FunctionalNormBlock(nn.Module):
    """A residual block normalising with ``F.rms_norm`` in its own forward (no module to swap) and
    with a ``torch.nn.RMSNorm`` without weight."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.w = nn.Parameter(1 + 0.3 * torch.randn(dim))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.plain = nn.RMSNorm(dim, elementwise_affine=False)

    def forward(self, x):
        h = self.down(F.silu(self.up(F.rms_norm(x, (x.shape[-1],), self.w, 1e-6))))
        return self.plain(x + h)


class FunctionalNormModel(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(FunctionalNormBlock(dim) for _ in range(2))
        self.head = nn.Linear(dim, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _models(kind: str):
    if kind == "torch.nn.RMSNorm":
        return build_torch_norm_llama()[0], torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    return FunctionalNormModel(), torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("recompute", ["selective", "op"])
@pytest.mark.parametrize("kind", ["torch.nn.RMSNorm", "F.rms_norm and a norm without weight"])
def test_torch_rms_norms_under_checkpointing_give_the_models_gradients(kind, recompute):
    model, inputs = _models(kind)
    checkpointed = copy.deepcopy(model)
    for block in checkpointed.layers:
        checkpoint_module(block, recompute)
    loss, grads = loss_and_grads(model, inputs)
    calls = NormCalls()
    with calls:
        got_loss, got_grads = loss_and_grads(checkpointed, inputs)
    # the blocks' norms ran out of place in the forward and the recompute; the Llama's final norm,
    # outside the blocks, is F.rms_norm
    assert calls.rms_norm == (1 if kind == "torch.nn.RMSNorm" else 0)
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=1e-6)
    for n, g in grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-5, atol=1e-6)


def test_the_mode_runs_other_calls_as_written():
    """Under OutOfPlaceRMSNorms: an RMSNorm over the last dim is F.rms_norm's output bitwise, with
    no F.rms_norm call; one over two dims and a LayerNorm run as written."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, 16, generator=gen), torch.rand(16, generator=gen) + 0.5
    calls = NormCalls()
    with calls, OutOfPlaceRMSNorms():
        last = F.rms_norm(x, (16,), w, 1e-6)
        with pytest.raises(TypeError, match="normalized_shape"):  # torch's own error, not taken by the mode
            torch.rms_norm(x, 16)
        two = torch.rms_norm(x, [4, 16], None)
        layer = F.layer_norm(x, (16,))
    assert calls.rms_norm == 1  # the norm over two dims only
    assert torch.equal(last, F.rms_norm(x, (16,), w, 1e-6))
    assert torch.equal(two, F.rms_norm(x, (4, 16), None))
    assert torch.equal(layer, F.layer_norm(x, (16,)))
