"""Models written in the styles people bring (``nest_fx.testing_styles``): what tracing, block
detection and the support checks make of them (single process), and the rule of the coverage
suite on 4 gloo ranks: for every style model and every forced plan, the outcome is parity with one
device or a refusal before the first collective (a representative subset here; every cell under
``-m slow``; the table: ``scripts/bench_coverage.py --suite styles``)."""

from __future__ import annotations

import pytest
import torch

from nest_fx.apply import checks
from nest_fx.apply.runtime import model_loss
from nest_fx.cluster import Cluster
from nest_fx.common.errors import NestFxError
from nest_fx.graph import trace
from nest_fx.graph.tp_regions import unsharded_attention
from nest_fx.plan import uniform_plan
from nest_fx.plan.support import parallel_support
from nest_fx.solver.runtime_planner import planner_for
from nest_fx.testing import COVERAGE_PLANS
from nest_fx.testing_coverage import KEPT, run_cell
from nest_fx.testing_styles import STYLE_MODELS, build_style, image_data, style_spec, token_data
from nest_fx.workload.block_facts import block_facts

BATCH, WORLD, LAUNCH_S = 8, 4, 300
FORCED = [p for p in COVERAGE_PLANS if not p.startswith("EP")]


def _traced(name: str):
    model, _ = build_style(name)
    kind, _, loss = STYLE_MODELS[name]
    x, y = (token_data if kind == "decoder" else image_data)(torch.Generator().manual_seed(0), BATCH)
    args = (x, y) if loss == "model" else (x,)
    return model, args, trace(model, args, name=name)


def test_nanogpt_traces_both_branches_of_targets_and_trains_on_its_own_loss():
    """``forward(idx, targets=None)``: traced without targets, fx takes the ``targets is None``
    branch (no loss in the graph); with targets, the loss branch, and ``model_loss`` reads the
    scalar of its ``(logits, loss)`` output."""
    model, (x, y), graph = _traced("nanogpt")
    without = trace(model, (x,))
    assert not any(d.get("op") == "cross_entropy" for _, d in without.graph.nodes(data=True))
    assert any(d.get("op") == "cross_entropy" for _, d in graph.graph.nodes(data=True))
    logits, loss = model(x, y)
    assert model_loss((logits, loss)) is loss
    with pytest.raises(checks.ApplyError, match=r"holds no loss .* forward\(idx, targets\)"):
        model_loss(model(x))


def test_tp_refuses_a_region_whose_own_code_fails_on_one_ranks_shard():
    """nanoGPT reads the width from its input (``B, T, C = x.size()`` then ``view(B, T, C)``):
    run on one rank's shard it fails, so tp=2 is refused by the support check (the planner and the
    runtime's checks), naming the module, instead of crashing in training. The same attention
    sized with ``-1`` and ``n_embd`` (localised like the head counts) is accepted."""
    model, _, graph = _traced("nanogpt")
    problem = parallel_support(model, graph).tp_problem(2)
    assert "tp=2 cannot shard transformer.h.0.attn (GPTAttention)" in problem
    assert "x.size()" in problem and "fix:" in problem
    with pytest.raises(checks.ApplyError, match="cannot shard transformer.h.0.attn"):
        checks.run_all(
            uniform_plan(len(graph.blocks), tp=2, dp=2, microbatch_size=4), model, graph, WORLD, BATCH, model_loss=True
        )
    views, _, views_graph = _traced("nanogpt-views")
    assert parallel_support(views, views_graph).tp_problem(2) == ""
    layout = views_graph.pattern_of(views_graph.layer_blocks[0])
    c_attn = next(p for pair in layout.tp_pairs for p in pair.params if p.name == "attn.c_attn.weight")
    assert c_attn.parts == [32, 32, 32] and c_attn.units == [8, 8, 8]  # q, k, v split by heads


def test_a_fused_qkv_reshaped_permuted_and_unbound_is_sharded_by_heads():
    """timm's ``qkv(x).reshape(B, N, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)`` (and Swin's
    ``qkv[0]``): the dim of 3 holds the fused parts, each of H heads; a rank keeps whole heads of
    each part. timm's own ``reshape(B, N, C)`` after attention then reads the input's width (refused
    by the rehearsal); merged with ``-1`` it shards. Swin's per-head bias table is sharded with the
    heads; the original Swin's ``C // num_heads`` view is refused by the rehearsal, timm's ``-1``
    views shard."""
    for name in ("timm-vit", "timm-vit-views"):
        model, _, graph = _traced(name)
        pairs = graph.pattern_of(graph.layer_blocks[0]).tp_pairs
        qkv = next(p for pair in pairs for p in pair.params if p.name == "attn.qkv.weight")
        assert (qkv.parts, qkv.units) == ([32, 32, 32], [8, 8, 8]), name
    model, _, graph = _traced("timm-vit")
    assert "cannot shard blocks.0.attn (TimmAttention)" in parallel_support(model, graph).tp_problem(2)
    model, _, graph = _traced("timm-vit-views")
    assert parallel_support(model, graph).tp_problem(2) == ""
    model, _, graph = _traced("swin")
    assert "cannot shard layers.0.blocks.0.attn (WindowAttention)" in parallel_support(model, graph).tp_problem(2)
    model, _, graph = _traced("swin-views")
    assert parallel_support(model, graph).tp_problem(2) == ""


@pytest.mark.parametrize("name", ["timm-vit", "deit", "tv-vit", "convnext"])
def test_pipelines_place_root_parameters_and_per_stage_downsamplers(name):
    """timm's ``cls_token``/``pos_embed`` (DeiT's ``dist_token``), torchvision's ``class_token`` and
    ``encoder.pos_embedding`` stay with the stage of the head that uses them; ConvNeXt's
    ``downsample_layers[i]`` each go with the block that calls it."""
    model, _, graph = _traced(name)
    assert parallel_support(model, graph).pp_problem(2) == ""


@pytest.mark.parametrize("name", ["meta-llama", "titan-llama3"])
def test_complex_rope_is_followed_under_tp(name):
    model, _, graph = _traced(name)
    ops = {d.get("op") for _, d in graph.graph.nodes(data=True)}
    assert {"view_as_complex", "view_as_real"} <= ops
    assert parallel_support(model, graph).tp_problem(2) == ""


def test_blocks_inside_named_and_nested_containers():
    """torchvision's ViT keeps its layers as ``encoder.layers.encoder_layer_<i>``; its CNN's forward
    starts with ``self.features(x)``, whose first entry (the stem) becomes the head instead of
    leaving an empty head that the workload would drop and the runtime count."""
    _, _, vit = _traced("tv-vit")
    assert [b.name for b in vit.layer_blocks] == ["encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"]
    _, _, cnn = _traced("tv-cnn")
    assert [b.name for b in cnn.blocks] == ["head", "features.1", "features.2", "features.3", "tail"]
    assert "features.0.0" in {cnn.graph.nodes[n].get("module") for n in cnn.blocks[0].nodes}


@pytest.mark.parametrize("name", ["tv-cnn", "tv-vit", "convnext", "nanogpt"])
def test_the_planners_plan_passes_the_runtimes_checks(name):
    """The planner's own plan was refused on vision models (``plan.num_layers=5 but the traced
    model has 6 layers``): the plan and the runtime now count the same chain."""
    model, _, graph = _traced(name)
    plan = planner_for(model)(graph, Cluster.preset("cpu-gloo", WORLD), WORLD, BATCH)
    checks.run_all(plan, model, graph, WORLD, BATCH, model_loss=STYLE_MODELS[name][2] == "model")


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class _Stack(torch.nn.Module):
    """Identical layers fed the input directly: a head and a tail that compute nothing."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Mlp() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_costless_head_and_tail_count_in_the_planners_chain():
    """The workload keeps a head or tail that computes nothing as a layer of no cost, so the
    planner's plan indexes the chain the runtime cuts (it was refused: ``plan.num_layers=4 but the
    traced model has 6 layers``); identical layers all stay layers."""
    model = _Stack()
    graph = trace(model, (torch.randn(BATCH, 8, 32),))
    assert [b.name for b in graph.blocks] == ["head", "layers.0", "layers.1", "layers.2", "layers.3", "tail"]
    plan = planner_for(model)(graph, Cluster.preset("cpu-gloo", WORLD), WORLD, BATCH)
    assert plan.num_layers == len(graph.blocks)
    checks.run_all(plan, model, graph, WORLD, BATCH)


def test_multihead_attention_is_no_longer_left_whole_under_tp():
    """``nn.MultiheadAttention`` is one op to the tracer: it used to run whole on every rank beside
    the sharded MLP; it is now a pair of its own, sharded by heads and priced so (what stays whole
    and why: tests/distributed/apply/test_tp_attention_styles.py)."""
    for name in ("tv-vit", "meta-llama"):
        _, _, graph = _traced(name)
        assert unsharded_attention(graph) == [], name
    _, _, graph = _traced("tv-vit")
    block = graph.layer_blocks[0]
    facts = {n: f for n, f in zip(block.nodes, block_facts(graph, block).nodes)}
    ops = {n: graph.graph.nodes[n].get("op") for n in block.nodes}
    attention = [f for n, f in facts.items() if ops[n] == "multiheadattention"]
    assert attention and all(f.tp and f.flops > 0 for f in attention)
    assert sum(f.tp for n, f in facts.items() if ops[n] == "linear") == 2


def _refused_in_one_process(name: str, plan_name: str) -> str:
    """The refusal the runtime's checks give without any process group ("" when they accept)."""
    model, _, graph = _traced(name)
    kwargs = dict(COVERAGE_PLANS[plan_name])
    try:
        if kwargs:
            plan = uniform_plan(len(graph.blocks), **kwargs)
        else:
            plan = planner_for(model)(graph, Cluster.preset("cpu-gloo", WORLD), WORLD, BATCH)
        checks.run_all(plan, model, graph, WORLD, BATCH, model_loss=STYLE_MODELS[name][2] == "model")
    except NestFxError as exc:
        return str(exc)
    return ""


def _check_cell(name: str, plan_name: str) -> dict:
    cell = run_cell(style_spec(name, COVERAGE_PLANS[plan_name], batch=BATCH), WORLD, LAUNCH_S)
    assert cell["status"] in KEPT, cell  # no crash, late refusal, error, hang or mismatch
    if cell["status"] == "refused":  # refused before the first collective, by the runtime's checks
        reason = _refused_in_one_process(name, plan_name)
        assert reason and reason.splitlines()[0][:80] in cell["reason"], (cell, reason)
    return cell


@pytest.mark.dist
@pytest.mark.timeout(4 * LAUNCH_S)
@pytest.mark.parametrize(
    "name,plan_name,status",
    [
        ("nanogpt", "planner", "ok"),  # its own loss from forward(idx, targets)
        ("nanogpt", "PP2xDP2", "ok"),  # its own loss on the last stage, the targets among every stage's inputs
        ("nanogpt", "TP2xDP2", "refused"),  # crashed in training before: refused by the TP rehearsal
        ("nanogpt-views", "TP2xDP2", "ok"),  # split(n_embd) sharded by heads
        ("meta-llama", "TP2xDP2", "ok"),  # complex RoPE
        ("tv-cnn", "PP2xDP2", "ok"),  # features[i] stages, the stem as the head
        ("timm-vit-views", "TP2xDP2", "ok"),  # reshape(B, N, 3, H, hd).permute(...).unbind(0) sharded by heads
        ("timm-vit", "PP2xDP2", "ok"),  # cls_token and pos_embed on the first stage
    ],
)
def test_style_cells(name, plan_name, status):
    assert _check_cell(name, plan_name)["status"] == status


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(4 * LAUNCH_S)
@pytest.mark.parametrize("plan_name", FORCED)
@pytest.mark.parametrize("name", list(STYLE_MODELS))
def test_every_style_cell_is_parity_or_a_refusal_before_training(name, plan_name):
    _check_cell(name, plan_name)
