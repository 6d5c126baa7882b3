"""Single-process tests of the pipeline split (nest_fx/plan/stage_layout.py, nest_fx/apply/stage_modules.py).

Stages built from a model and run one after another compute exactly the whole model's output;
models a stage boundary cannot cut correctly are refused (``ParallelSupport.pp_problem``, the
one verdict the planner and the runtime's checks share) naming the module and the fix.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from nest_fx.apply import ApplyError, checks
from nest_fx.graph.stage_modules import arm_stages, rehearse_split, run_stages, split_stages, tensor_output
from nest_fx.graph.stand_in import SplitError
from nest_fx.graph import trace
from nest_fx.plan import uniform_plan
from nest_fx.graph.stage_layout import stage_layout
from nest_fx.plan.support import parallel_support
from nest_fx.solver import SolverOptions
from nest_fx.solver.runtime_planner import runtime_options

VOCAB, HIDDEN, LAYERS = 32, 16, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, memory=None):
        out = x + torch.tanh(self.linear(x))
        return out if memory is None else out * memory


class Toy(nn.Module):
    """Embedding, ``LAYERS`` linear layers, a norm and an LM head; ``variant`` adds what a
    pipeline cut cannot handle."""

    def __init__(self, variant: str = ""):
        super().__init__()
        self.variant = variant
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        if variant == "shared_layers":
            self.layers[2].linear.weight = self.layers[0].linear.weight
        if variant in ("root_parameter", "root_parameter_twice"):
            self.scale = nn.Parameter(torch.ones(HIDDEN))
        if variant == "tied_holder":  # BART's model.shared: the embedding's and the head's weight, never called
            self.shared = nn.Embedding(VOCAB, HIDDEN)
            self.embed.weight = self.head.weight = self.shared.weight
        if variant == "memory":
            self.encoder = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Sigmoid())

    def forward(self, tokens):
        h = first = self.embed(tokens) * 2 if self.variant == "root_skip" else self.embed(tokens)
        memory = self.encoder(first) if self.variant == "memory" else None
        if self.variant == "root_parameter_twice":
            h = h * self.scale
        for layer in self.layers:
            if self.variant == "keyword":
                h = layer(x=h)
            elif self.variant == "root_residual":
                h = h + layer(h)  # the layer's input read again by the model's own forward
            elif self.variant == "memory":
                h = layer(h, memory)  # an encoder's output read by every layer (cross-attention's role)
            else:
                h = layer(h)
        if self.variant in ("skip", "root_skip"):
            h = h + first  # the embedding's output read again after the last layer
        if self.variant in ("root_parameter", "root_parameter_twice"):
            h = h * self.scale
        return self.head(self.norm(h))


def _traced(variant: str = "", batch: int = 2, seq: int = 8):
    torch.manual_seed(0)
    model = Toy(variant)
    tokens = torch.randint(0, VOCAB, (batch, seq))
    return model, tokens, trace(model, (tokens,))


def test_toy_stages_compose_to_the_model():
    model, tokens, graph = _traced()
    n = len(graph.blocks)
    expect = model(tokens)
    for ranges in ([(0, 1), (1, n)], [(0, 2), (2, 4), (4, n)], [(0, n - 1), (n - 1, n)]):
        stages = split_stages(copy.deepcopy(model), graph, ranges)
        arm_stages(stages)
        assert torch.equal(run_stages(stages, (tokens,), {}), expect), ranges


def test_a_second_value_crossing_a_cut_is_refused():
    model, tokens, graph = _traced("skip")
    problem = parallel_support(model, graph).pp_problem(2)
    assert problem.startswith(
        "pp=2: a pipeline cut between head and layers.0: besides layers.0, code after the "
        "cut reads the activation entering it (add in <root>"
    )
    with pytest.raises(ApplyError) as err:
        checks.check_pipeline(uniform_plan(len(graph.blocks), pp=2), model, graph)
    assert str(err.value) == problem  # the runtime refuses with the planner's words
    assert runtime_options(model, graph, SolverOptions()).max_stages == 1  # and the planner never offers it


def test_a_residual_in_the_models_own_forward_is_refused():
    model, tokens, graph = _traced("root_residual")
    assert "code after the cut reads the activation entering it (add in <root>" in parallel_support(
        model, graph
    ).pp_problem(2)


def test_a_value_that_slips_through_a_cut_is_nan_not_a_plausible_number():
    """The backstop: what a stage computes from stand-ins is NaN. Were the refusal above bypassed,
    the residual added by the model's own forward would carry the stand-in's NaN into the loss."""
    model, tokens, graph = _traced("root_residual")
    layout = stage_layout(model, graph)
    layout.cut_problems.clear()
    stages = split_stages(model, graph, [(0, 2), (2, len(graph.blocks))], layout)
    arm_stages(stages)
    assert torch.isnan(run_stages(stages, (tokens,), {})).all()


def test_a_parameter_shared_by_two_layers_is_refused_with_the_models_own_config_key():
    model, tokens, graph = _traced("shared_layers")
    problem = parallel_support(model, graph).pp_problem(2)
    assert (
        "parameter layers.0.linear.weight (also ['layers.2.linear.weight']) is used by blocks layers.0, layers.2"
    ) in problem
    assert "give each module its own parameter" in problem
    model.config = SimpleNamespace(tie_word_embeddings=True)  # a HuggingFace model names its key
    assert "tie_word_embeddings=False in the HuggingFace config" in parallel_support(model, graph).pp_problem(2)
    model.config = SimpleNamespace(tie_embeddings=True)  # a zoo model
    assert "tie_embeddings=false in the model spec" in parallel_support(model, graph).pp_problem(2)


def test_a_root_parameter_lives_on_the_stage_using_it():
    """A parameter of the root module used by its own forward code (a class token, a position
    embedding) is kept by the stage owning the block that uses it; the other stages hold a NaN
    stand-in (no parameter), and the stages still compose to the model."""
    model, tokens, graph = _traced("root_parameter")
    assert parallel_support(model, graph).pp_problem(4) == ""
    layout = stage_layout(model, graph)
    assert layout.root_params == {"scale": len(graph.blocks) - 1}
    expect = model(tokens)
    stages = split_stages(copy.deepcopy(model), graph, [(0, 2), (2, len(graph.blocks))], layout)
    arm_stages(stages)
    assert torch.equal(run_stages(stages, (tokens,), {}), expect)
    assert "scale" not in dict(stages[0].named_parameters()) and torch.isnan(stages[0].scale).all()
    assert "scale" in dict(stages[1].named_parameters())


def test_a_root_parameter_used_by_two_blocks_is_refused():
    model, tokens, graph = _traced("root_parameter_twice")
    problem = parallel_support(model, graph).pp_problem(4)
    assert "parameter scale belongs to the module running the model's own forward code" in problem
    assert "used by blocks head, tail" in problem


def test_the_rehearsal_refuses_a_layer_called_without_its_activation():
    model, tokens, graph = _traced("keyword")
    problem = parallel_support(model, graph).pp_problem(2)  # the planner rehearses every cut
    assert problem.startswith("pp=2: layers.0 is called without a tensor as its first argument or hidden_states=")
    with pytest.raises(SplitError, match=r"layers\.1 is called without a tensor as its first argument"):
        rehearse_split(model, graph, [(0, 2), (2, len(graph.blocks))], (tokens,), {})
    assert isinstance(model.layers[1], Block)  # the model itself is untouched


# -- HuggingFace models: layer types by index, root-forward post-processing, encoder position bias --


def _hf(config_cls: str, task: str = "causal", **fields):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(vocab_size=64, use_cache=False, **fields)
    if task == "encoder":
        return transformers.T5EncoderModel(config).eval()
    attn = "eager" if config_cls.startswith("Gemma") else "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


LLAMA_LIKE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    tie_word_embeddings=False,
)


@pytest.mark.hf
@pytest.mark.parametrize(
    "config_cls, fields",
    [
        (
            "Qwen2Config",
            dict(
                use_sliding_window=True,
                sliding_window=4,
                max_window_layers=0,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
        ),
        ("Gemma2Config", dict(head_dim=8, sliding_window=4, final_logit_softcapping=1.5)),
    ],
    ids=["qwen2-sliding", "gemma2-softcap"],
)
def test_hf_stages_compute_exactly_the_whole_model(config_cls, fields):
    model = _hf(config_cls, **LLAMA_LIKE, **fields)
    tokens = torch.randint(0, 64, (2, 12))
    graph = trace(model, (), {"input_ids": tokens})
    n = len(graph.blocks)
    with torch.no_grad():
        expect = tensor_output(model(input_ids=tokens))
        for ranges in ([(0, 2), (2, n)], [(0, 1), (1, 3), (3, 5), (5, n)]):
            rehearse_split(model, graph, ranges, (), {"input_ids": tokens})
            stages = split_stages(copy.deepcopy(model), graph, ranges)
            arm_stages(stages)
            assert torch.equal(run_stages(stages, (), {"input_ids": tokens}), expect), ranges


@pytest.mark.hf
def test_t5_position_bias_crosses_the_cut_beside_the_activation():
    """T5's first layer computes the relative position bias (from its own parameter) and returns it
    with its output; later layers read it. It crosses every cut after that layer as a second output
    of encoder.block.0, forwarded by the stages that do not hold it; its gradient reaches the first
    layer's bias table."""
    model = _hf("T5Config", task="encoder", d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4)
    tokens = torch.randint(0, 64, (2, 12))
    graph = trace(model, (), {"input_ids": tokens})
    layout = stage_layout(model, graph)
    assert parallel_support(model, graph).pp_problem(2) == ""
    assert layout.side_values[2] == [("encoder.block.0", (1, 4, 12, 12), "float32", False)]  # the position bias
    # past encoder.block.1 it is that layer's output, the tensor block.0 gave it
    assert layout.side_values[3] == [("encoder.block.1", (1, 4, 12, 12), "float32", True)]
    n = len(graph.blocks)
    expect = tensor_output(model(input_ids=tokens))
    expect.sum().backward()
    table = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    for ranges in ([(0, 2), (2, n)], [(0, 2), (2, 3), (3, n)]):
        rehearse_split(model, graph, ranges, (), {"input_ids": tokens})
        stages = split_stages(copy.deepcopy(model), graph, ranges)
        arm_stages(stages)
        out = run_stages(stages, (), {"input_ids": tokens})
        assert torch.equal(out, expect), ranges
        out.sum().backward()
        grad = dict(stages[0].named_parameters())[table].grad
        torch.testing.assert_close(grad, model.get_submodule(table.rpartition(".")[0]).weight.grad, rtol=0, atol=0)


def test_a_cut_passes_a_module_output_beside_the_activation():
    """An encoder's output read by every later layer (an encoder-decoder's cross-attention input)
    crosses each cut inside the layers beside the activation (``StageLayout.side_values``), is
    forwarded by a middle stage that does not hold the encoder, and the stages compute the whole
    model's output and gradients exactly."""
    model, tokens, graph = _traced("memory")
    n = len(graph.blocks)
    layout = stage_layout(model, graph)
    assert not layout.problem and not layout.cut_problems
    assert parallel_support(model, graph).pp_problem(2) == ""
    for c in range(1, n - 1):  # the cuts before a layer: the encoder's output and the activation
        assert layout.side_values[c] == [("encoder", (2, 8, HIDDEN), "float32", False)], c
        assert layout.activations[c] == ((2, 8, HIDDEN), "float32")
    assert layout.side_values[n - 1] == []  # no layer reads it after the last one
    expect = model(tokens)
    expect.square().sum().backward()
    for ranges in ([(0, 2), (2, n)], [(0, 1), (1, 3), (3, n)], [(0, 2), (2, 3), (3, 4), (4, n)]):
        stages = split_stages(copy.deepcopy(model), graph, ranges)
        arm_stages(stages)
        out = run_stages(stages, (tokens,), {})
        assert torch.equal(out, expect), ranges
        out.square().sum().backward()
        grads = {n: p.grad for s in stages for n, p in s.named_parameters() if p.grad is not None}
        assert grads.keys() == {n for n, _ in model.named_parameters()}, ranges
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0)


def test_a_skip_connection_from_a_head_module_crosses_later_cuts():
    """The embedding's output added again after the last layer: the first cut refuses (the
    activation entering layers.0 is read again), the later cuts pass it beside the activation."""
    model, tokens, graph = _traced("skip")
    layout = stage_layout(model, graph)
    assert 1 in layout.cut_problems
    assert layout.side_values[2] == [("embed", (2, 8, HIDDEN), "float32", False)]
    stages = split_stages(copy.deepcopy(model), graph, [(0, 2), (2, len(graph.blocks))], layout)
    arm_stages(stages)
    assert torch.equal(run_stages(stages, (tokens,), {}), model(tokens))


def test_a_value_of_the_models_own_code_still_cannot_cross_beside_the_activation():
    """A second value computed by the model's own forward code (not a module's output) has no
    module output to be put back into on the next stage: the cut is refused naming it."""
    model, tokens, graph = _traced("root_skip")
    problem = stage_layout(model, graph).cut_problems[2]
    assert problem.startswith(
        "a pipeline cut between layers.0 and layers.1 would have to pass 1 values computed by the stage before "
        "it (mul in <root> [[2, 8, 16]]) in the model's own forward code"
    ), problem


def test_the_cost_of_a_cut_counts_the_values_passed_beside_the_activation():
    """What a stage boundary sends (``Block.out_bytes``, the pipeline send the cost model prices):
    the activation, plus the encoder's output every later layer reads, until no layer reads it."""
    model, tokens, graph = _traced("memory")
    one = 2 * 8 * HIDDEN * 4  # one [2, 8, 16] fp32 tensor
    layers = [b for b in graph.blocks if b.kind == "block"]
    assert [b.out_bytes for b in layers] == [2 * one, 2 * one, one]
    plain = [b.out_bytes for b in _traced()[2].blocks if b.kind == "block"]
    assert plain == [one, one, one]  # without it: the activation alone


def test_a_module_only_holding_a_tied_weight_stays_off_the_middle_stages():
    """A module no op uses whose weight is the embedding's and the head's (BART's ``model.shared``)
    is owned by the first and last blocks: a middle stage holds no stale, never-updated copy."""
    model, tokens, graph = _traced("tied_holder")
    n = len(graph.blocks)
    layout = stage_layout(model, graph)
    assert layout.owned["shared"] == (0, n - 1) and "shared" not in layout.unused
    stages = split_stages(copy.deepcopy(model), graph, [(0, 1), (1, n - 1), (n - 1, n)], layout)
    arm_stages(stages)
    names = [{name for name, _ in s.named_parameters(remove_duplicate=False)} for s in stages]
    assert "shared.weight" in names[0] and "shared.weight" in names[2] and "shared.weight" not in names[1]
    assert torch.equal(run_stages(stages, (tokens,), {}), model(tokens))


@pytest.mark.hf
def test_tp_beside_a_cut_carrying_a_layers_extra_output_is_refused_and_not_planned():
    """T5's position bias crosses the cuts as an extra output of a layer: under TP each rank builds
    it from its own heads, so TP x PP is refused before training (the runtime's check and the
    planner's options ask the same ``tp_pp`` verdict); an encoder's output (a module outside the
    layers, whole on every rank) crossing the cuts keeps TP x PP."""
    model = _hf("T5Config", task="encoder", d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4)
    graph = trace(model, (), {"input_ids": torch.randint(0, 64, (2, 12))})
    support = parallel_support(model, graph)
    assert support.tp_problem(2) == "" and support.pp_problem(2) == ""
    assert "encoder.block.0's extra output (1, 4, 12, 12)" in support.tp_pp_problem(2)
    assert support.tp_pp_problem(1) == ""
    with pytest.raises(ApplyError, match=r"tp=2 with pp > 1: .*fix: use tp=1 or pp=1"):
        checks.check_may_run(uniform_plan(len(graph.blocks), pp=2, dp=1, tp=2), model, graph)
    narrowed = runtime_options(model, graph, SolverOptions(tp_degrees=(1, 2)))
    assert narrowed.tp_degrees == (1, 2) and narrowed.max_stages == 1
    toy, _, toy_graph = _traced("memory")
    assert parallel_support(toy, toy_graph).tp_pp_problem(2) == ""
