"""In-place ops under op-level selective recompute (nest_fx.graph.recompute_mutations): the trace's
verdict against what torch.utils.checkpoint really does with the runtime's policies, in one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nest_fx.apply.activation_checkpoint import apply_checkpointing
from nest_fx.graph import trace
from nest_fx.graph.recompute_mutations import SAC_POLICIES, recompute_mutation_problem
from nest_fx.models import build_seeded
from nest_fx.testing_styles import STYLE_MODELS, build_style, image_data, token_data

POLICIES = ("full", "every:2") + SAC_POLICIES + ("op:default",)


class LinearThenScale(nn.Module):
    """``h = fc(x); h.mul_(2)``: an in-place op on a linear's output (bias: ``addmm``)."""

    def __init__(self, bias: bool = True):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8, bias=bias), nn.Linear(8, 8, bias=bias)

    def forward(self, x):
        h = self.fc(x)
        h.mul_(2)
        return self.out(h)


class InplaceReLU(nn.Module):
    """``nn.ReLU(inplace=True)`` straight after a linear."""

    def __init__(self):
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class ShiftedThenScaled(nn.Module):
    """An in-place op on an elementwise op's output: only ``selective`` saves that."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x) + 1.0
        h.mul_(2)
        return h.sin()


class FreshBuffer(nn.Module):
    """A tensor factory filled in place (recomputed by every policy): runs everywhere."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        buf = x.new_zeros(x.shape)
        buf.add_(1.0)
        return self.fc(x) * buf


class NativeRMSNorm(nn.Module):
    """``torch.nn.RMSNorm`` and ``F.rms_norm``: their CPU decomposition traces ``add_``; the runtime
    runs them out of place inside a checkpointed block."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.RMSNorm(8), nn.Linear(8, 8)
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x + self.fc(F.rms_norm(self.norm(x), (8,), self.weight))


class BasicBlock(nn.Module):
    """A torchvision-ResNet-style basic block: conv-bn-relu(inplace)-conv-bn, ``out += identity``
    (fx traces that out of place), relu(inplace)."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResidualAdd(nn.Module):
    """Only ``out += x`` in place: invisible in fx's graph without the tracer's marking."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        out = self.norm(self.fc(x))
        out += x
        return torch.relu(out)


class ScalesItsInput(nn.Module):
    """``x.mul_(2)`` on the block's own input: every checkpointing policy re-runs it on the mutated tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x) * 1.0


class AddsToItsInput(ScalesItsInput):
    """``x += 1`` on the block's own input (fx traces it out of place)."""

    def forward(self, x):
        x += 1.0
        return self.fc(x) * 1.0


class Stack(nn.Module):
    """Two copies of ``block`` in a ModuleList (the layer blocks the runtime checkpoints)."""

    def __init__(self, block):
        super().__init__()
        self.layers = nn.ModuleList([block(), block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


CASES = {
    "linear_then_scale": (lambda: Stack(LinearThenScale), (2, 3, 8)),
    "bias_free_linear_then_scale": (lambda: Stack(lambda: LinearThenScale(bias=False)), (2, 3, 8)),
    "inplace_relu": (lambda: Stack(InplaceReLU), (2, 3, 8)),
    "shifted_then_scaled": (lambda: Stack(ShiftedThenScaled), (2, 3, 8)),
    "fresh_buffer": (lambda: Stack(FreshBuffer), (2, 3, 8)),
    "native_rms_norm": (lambda: Stack(NativeRMSNorm), (2, 3, 8)),
    "resnet_basic_block": (lambda: Stack(BasicBlock), (2, 4, 6, 6)),
    "residual_add": (lambda: Stack(ResidualAdd), (2, 3, 8)),
    "scales_its_input": (lambda: Stack(ScalesItsInput), (2, 3, 8)),
    "adds_to_its_input": (lambda: Stack(AddsToItsInput), (2, 3, 8)),
}
# what torch does (CPU, torch 2.13), measured by run_checkpointed on these models
CRASHES = {
    "linear_then_scale": {"selective", "op", "op:default", "op:matmuls"},
    "bias_free_linear_then_scale": {"selective", "op", "op:default", "op:matmuls"},  # op: silently wrong
    "inplace_relu": {"selective", "op", "op:default", "op:matmuls"},
    "shifted_then_scaled": {"selective"},
    "fresh_buffer": set(),
    "native_rms_norm": set(),
    "resnet_basic_block": {"selective"},
    "residual_add": {"selective"},
    "scales_its_input": set(POLICIES),
    "adds_to_its_input": set(POLICIES),
}


def run_checkpointed(model: nn.Module, x: torch.Tensor, graph, recompute: str) -> str:
    """'parity' when training one step with ``recompute`` on the layer blocks gives the gradients of
    the plain model, 'crash' when torch raises, 'wrong' otherwise."""
    ref, ckpt = copy.deepcopy(model), copy.deepcopy(model)
    ref(x.clone()).square().mean().backward()
    apply_checkpointing(ckpt, [block.modules for block in graph.layer_blocks], recompute)
    try:
        ckpt(x.clone()).square().mean().backward()
    except RuntimeError as exc:
        assert "mutated" in str(exc) or "modified by an inplace operation" in str(exc), exc
        return "crash"
    same = all(
        torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6) for a, b in zip(ref.parameters(), ckpt.parameters())
    )
    return "parity" if same else "wrong"


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_exactly_where_torch_fails(case):
    """Every policy the verdict passes trains at parity; every one it refuses crashes or trains wrong."""
    build, shape = CASES[case]
    torch.manual_seed(0)
    model = build()
    x = torch.randn(*shape)
    graph = trace(model, (x,))
    for recompute in POLICIES:
        outcome = run_checkpointed(model, x, graph, recompute)
        refused = recompute_mutation_problem(graph, recompute)
        assert (outcome != "parity") == (recompute in CRASHES[case]), (case, recompute, outcome)
        assert bool(refused) == (outcome != "parity"), (case, recompute, outcome, refused)


def test_bias_free_linear_then_scale_trains_wrong_silently_under_op():
    """The mutation goes through the ``_unsafe_view`` of ``mm``'s output, which does not share its version
    counter: torch raises nothing and recomputes from the mutated values."""
    torch.manual_seed(0)
    model = Stack(lambda: LinearThenScale(bias=False))
    x = torch.randn(2, 3, 8)
    assert run_checkpointed(model, x, trace(model, (x,)), "op") == "wrong"


def test_message_names_the_module_the_op_the_saver_and_the_fixes():
    torch.manual_seed(0)
    model = Stack(BasicBlock)
    graph = trace(model, (torch.randn(2, 4, 6, 6),))
    problem = recompute_mutation_problem(graph, "selective")
    assert problem.startswith("recompute=selective: module 'layers.0.relu' mutates in place (relu_) the output of ")
    assert "'layers.0.bn1'" in problem and "Tensor cached during selective activation checkpoint" in problem
    assert (
        "fix: recompute full, every:<k> or none, op, op:matmuls, op:attention, or make 'layers.0.relu' out of place"
        in problem
    )


def test_input_mutation_is_refused_under_every_checkpointing_policy():
    torch.manual_seed(0)
    graph = trace(Stack(AddsToItsInput), (torch.randn(2, 3, 8),))
    assert recompute_mutation_problem(graph, "none") == ""
    problem = recompute_mutation_problem(graph, "full")
    assert problem.startswith(
        "recompute=full: module 'layers.0' mutates in place (add= (augmented assignment)) a tensor it gets from "
        "outside its checkpointed block"
    )
    assert problem.endswith("fix: recompute none, or make 'layers.0' out of place")


def test_augmented_assignment_is_marked_on_the_fx_trace():
    torch.manual_seed(0)
    graph = trace(Stack(ResidualAdd), (torch.randn(2, 3, 8),))
    assert graph.method == "fx"
    marked = {n: d["in_place_on"] for n, d in graph.graph.nodes(data=True) if "in_place_on" in d}
    assert marked == {"add": "layers_0_norm", "add_1": "layers_1_norm"}
    assert "module 'layers.0' mutates in place (add= (augmented assignment))" in recompute_mutation_problem(
        graph, "selective"
    )


def _style_input(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return token_data(gen, 2)[0] if STYLE_MODELS[name][0] == "decoder" else image_data(gen, 2)[0]


@pytest.mark.parametrize("name", sorted(STYLE_MODELS))
def test_style_models_are_not_refused(name):
    """nanoGPT, Meta-Llama, torchtitan, timm, torchvision, Swin, Mixer, ConvNeXt styles: no policy refused."""
    model, _ = build_style(name)
    graph = trace(model, (_style_input(name),))
    assert graph.layer_blocks
    assert {p: recompute_mutation_problem(graph, p) for p in POLICIES} == dict.fromkeys(POLICIES, "")


def test_zoo_and_hf_llama_are_not_refused():
    model, _ = build_seeded("llama:hidden=64,layers=2,heads=4,seq=32,vocab=128")
    graphs = [trace(model, (torch.randint(0, 128, (2, 32)),))]
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    graphs.append(trace(tf.LlamaForCausalLM(config), (torch.randint(0, 128, (2, 32)),)))
    for graph in graphs:
        assert len(graph.layer_blocks) == 2
        assert {p: recompute_mutation_problem(graph, p) for p in POLICIES} == dict.fromkeys(POLICIES, "")
