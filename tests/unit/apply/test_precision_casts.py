"""``nest_fx.apply.precision`` on one process: what the casts do to parameters, gradients, inputs
and outputs (the multi-rank parity is tests/distributed/apply/test_precision.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from nest_fx.apply.activation_checkpoint import checkpoint_module
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.precision import fp32_modules, fsdp_policy, prepare_reference
from nest_fx.models import build_seeded


class Net(nn.Module):
    def __init__(self, tie: bool = False):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens, scale):
        x = self.block(self.embed(tokens) * scale)
        return self.head(self.norm(x))


def _net(tie=False) -> nn.Module:
    torch.manual_seed(0)
    return Net(tie)


def test_bf16_mixed_computes_in_bf16_and_keeps_fp32_masters():
    model = prepare_reference(_net(), ["block"], "bf16-mixed")
    seen = {}
    model.block[0].register_forward_pre_hook(lambda m, a: seen.update(weight=m.weight.dtype, input=a[0].dtype))
    tokens, scale = torch.randint(0, 16, (4,)), torch.tensor(2.0)  # an fp32 input, cast to bf16 by the block
    out = model(tokens, scale)
    assert seen == {"weight": torch.bfloat16, "input": torch.bfloat16}
    assert out.dtype == torch.float32  # the root's output feeds the loss in fp32
    out.float().pow(2).mean().backward()
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and p.dtype == torch.float32 and p.grad.dtype == torch.float32, name


def test_bf16_mixed_gradient_is_the_bf16_gradient_in_fp32():
    """The cast's backward puts exactly the bf16 model's gradient into the fp32 master (what
    FSDP2's param_dtype cast gives), for a model whose weights are each used once."""
    model = prepare_reference(_net(), ["block"], "bf16-mixed")
    low = copy.deepcopy(_net())
    for name, m in low.named_modules():
        if not isinstance(m, nn.BatchNorm1d) and name:
            for p in m.parameters(recurse=False):
                p.data = p.data.bfloat16()
    tokens = torch.randint(0, 16, (4,))
    model(tokens, torch.tensor(2.0)).float().pow(2).mean().backward()
    out = low.head(low.norm(low.block(low.embed(tokens) * torch.tensor(2.0, dtype=torch.bfloat16))))
    out.float().pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), low.parameters()):
        assert torch.equal(p.grad, q.grad.float()), name


def test_parameters_come_back_when_forward_raises():
    model = prepare_reference(_net(), ["block"], "bf16-mixed")
    with pytest.raises(IndexError):
        model(torch.tensor([99]), torch.tensor(1.0))  # token out of the embedding's range
    assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float32 for p in model.parameters())
    assert isinstance(model.embed._parameters["weight"], nn.Parameter)


def test_bf16_true_converts_in_place_keeps_ties_and_batchnorm_fp32():
    model = _net(tie=True)
    tied = model.embed.weight
    prepare_reference(model, ["block"], "bf16-true")
    assert model.head.weight is model.embed.weight is tied and tied.dtype == torch.bfloat16
    assert {p.dtype for p in model.norm.parameters()} == {torch.float32}
    assert model.norm.running_mean.dtype == torch.float32
    assert fp32_modules(model, "bf16-true") == [model.norm] and fp32_modules(model, "fp32") == []
    out = model(torch.randint(0, 16, (4,)), torch.tensor(2.0))
    assert out.dtype == torch.float32
    out.pow(2).mean().backward()
    assert tied.grad.dtype == torch.bfloat16 and model.norm.weight.grad.dtype == torch.float32


def test_bf16_mixed_upcasts_a_bf16_model_and_fp32_changes_nothing():
    model = _net().bfloat16()
    prepare_reference(model, ["block"], "bf16-mixed")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    plain = _net()
    prepare_reference(plain, ["block"], "fp32")
    assert not plain._forward_hooks and not plain._forward_pre_hooks and not plain.block._forward_pre_hooks


def test_fsdp_policy():
    policy = fsdp_policy("bf16-mixed")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_policy("fp32") is None and fsdp_policy("bf16-true") is None


class Reader(nn.Module):
    """Reads a descendant's weight dtype in its own forward, as T5's MLP and ViT's embeddings do."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8))

    def forward(self, x):
        return self.inner(x.to(self.inner[0].weight.dtype))


def test_a_unit_sees_its_descendants_weights_in_bf16():
    torch.manual_seed(0)
    model = nn.Sequential(Reader(), Reader())
    prepare_reference(model, ["0"], "bf16-mixed")  # block 0; block-less module 1 belongs to the root's unit
    assert model(torch.randn(2, 8)).dtype == torch.float32  # no dtype mismatch inside either
    assert all(p.dtype == torch.float32 and isinstance(p, nn.Parameter) for p in model.parameters())


@pytest.mark.parametrize("recompute", ["full", "selective", "op"])
def test_recomputed_blocks_cast_again_inside_the_checkpointed_region(recompute):
    plain, cfg = build_seeded("llama:hidden=32,layers=2,heads=4,seq=16,vocab=64")
    recomputed = copy.deepcopy(plain)
    blocks = ["layers.0", "layers.1"]
    for model in (plain, recomputed):
        prepare_reference(model, blocks, "bf16-mixed")
    for name in blocks:
        checkpoint_module(recomputed.get_submodule(name), recompute)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    for model in (plain, recomputed):
        lm_loss(model(x), x).backward()
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        assert torch.equal(p.grad, q.grad), name
