"""Single-process tests of the rewriter: checks and their messages, mesh layout, stage split,
TP regions, checkpointing, and a one-rank ``auto_parallelize`` round trip."""

from __future__ import annotations

import copy

import pytest
import torch

from nest_fx.apply import ApplyError, auto_parallelize, default_plan
from nest_fx.apply import checks
from nest_fx.apply.activation_checkpoint import apply_checkpointing
from nest_fx.apply.mesh import locate, rank_table, require_uniform_tp
from nest_fx.apply.pipeline import LayerSubset, interleaved_ranges, split_stages, stage_blocks, tensor_output
from nest_fx.graph.stage_modules import arm_stages, run_stages
from nest_fx.graph.stand_in import StandIn
from nest_fx.apply.tensor_parallel import block_regions
from nest_fx.apply.losses import lm_loss
from nest_fx.models import build_seeded
from nest_fx.graph import trace
from nest_fx.models import build_model
from nest_fx.plan import Plan, PlanError, StagePlan, uniform_plan
from nest_fx.plan.may_run import unrun_kernels
from nest_fx.graph.stage_layout import stage_layout

LLAMA = "llama:hidden=64,layers=4,heads=4,seq=32,vocab=128"


def _untouched(model) -> bool:
    """No module of ``model`` was replaced by a pipeline stand-in."""
    return not any(isinstance(m, StandIn) for m in model.modules())


def _traced(name=LLAMA, batch=2, seq=16):
    model, cfg = build_seeded(name)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    kwargs = {"input_ids": tokens} if name.startswith("hf:") else None
    graph = trace(model, () if kwargs else (tokens,), kwargs)
    return model, cfg, tokens, graph


# -- checks -------------------------------------------------------------------------------------


def test_world_size_mismatch_names_both_sizes_and_the_fix():
    plan = uniform_plan(6, pp=2, tp=2, dp=2)
    with pytest.raises(ApplyError) as err:
        checks.check_world(plan, 4)
    msg = str(err.value)
    assert "8 devices" in msg and "4 processes" in msg and "--nproc_per_node=8" in msg


def test_tp_must_divide_heads():
    model, _ = build_model("llama:hidden=96,layers=2,heads=6,seq=16,vocab=64", device="meta")
    with pytest.raises(ApplyError, match=r"tp=4 does not divide the model's 6 attention heads.*tp in \[1, 2, 3, 6\]"):
        checks.check_tp(uniform_plan(4, tp=4), model)
    checks.check_tp(uniform_plan(4, tp=2), model)


def test_tp_must_divide_kv_heads_and_ffn():
    model, _ = build_model("llama:hidden=64,layers=2,heads=4,kv=1,seq=16,vocab=64", device="meta")
    with pytest.raises(ApplyError, match="1 key/value heads"):
        checks.check_tp(uniform_plan(4, tp=2), model)
    model, _ = build_model("gpt:hidden=64,layers=2,heads=8,ffn=100,seq=16,vocab=64", device="meta")
    with pytest.raises(ApplyError, match="100 FFN hidden size"):
        checks.check_tp(uniform_plan(4, tp=8), model)


def test_tp_checks_traced_linears():
    model, _, _, graph = _traced()
    checks.check_tp(uniform_plan(6, tp=2), model, graph)
    # an odd FFN the config does not announce is caught on the traced parameters
    model, _, _, graph = _traced("llama:hidden=64,layers=2,heads=4,seq=32,vocab=128,ffn=171")
    model.config.ffn_hidden = None
    with pytest.raises(ApplyError, match=r"tp=2 does not divide layers.0.mlp.(gate|up|down).weight: 171 features"):
        checks.check_tp(uniform_plan(4, tp=2), model, graph)


def test_ep_must_divide_experts():
    model, _ = build_model("moe:hidden=64,layers=2,heads=4,seq=16,vocab=64,experts=6", device="meta")
    with pytest.raises(ApplyError, match=r"ep=4 does not divide the model's 6 experts.*ep in \[1, 2\]"):
        checks.check_ep(uniform_plan(4, dp=4, ep=4), model)
    dense, _ = build_model(LLAMA, device="meta")
    with pytest.raises(ApplyError, match="no experts"):
        checks.check_ep(uniform_plan(6, dp=2, ep=2), dense)
    checks.check_ep(uniform_plan(4, dp=4, ep=2), model)


@pytest.mark.hf
def test_ep_accepts_hf_stacked_experts_and_refuses_other_layouts():
    pytest.importorskip("transformers")
    from nest_fx.models.hf import build_hf_model

    model, _ = build_hf_model("hf:mixtral", device="meta")  # 4 experts stacked in [E, ...] tensors
    checks.check_ep(uniform_plan(4, dp=2, ep=2), model)
    with pytest.raises(ApplyError, match=r"ep=3 does not divide the model's 4 experts"):
        checks.check_ep(uniform_plan(4, dp=3, ep=3), model)

    class LoopMoE(torch.nn.Module):  # experts in a ModuleList with the model's own loop
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"num_experts": 4})()
            self.moe = LoopMoE()

    with pytest.raises(ApplyError, match=r"keeps experts in moe.experts in a layout expert parallelism does not split"):
        checks.check_ep(uniform_plan(4, dp=2, ep=2), Net())


def test_batch_must_divide():
    plan = uniform_plan(6, dp=2, microbatch_size=2, num_microbatches=3)
    with pytest.raises(ApplyError, match=r"global batch 10 is not divisible by .* = 12"):
        checks.check_batch(plan, 10)
    assert checks.check_batch(plan, 12) == 3
    assert checks.check_batch(plan, 24) == 6  # a multiple: more microbatches of the same size


def test_schedule_needs_enough_microbatches():
    plan = uniform_plan(6, pp=2, dp=1, num_microbatches=1)
    model, _, _, graph = _traced()
    with pytest.raises(ApplyError, match="at least 2 microbatches"):
        checks.run_all(plan, model, graph, 2, 1)


def test_plan_for_another_model():
    model, _, _, graph = _traced()
    with pytest.raises(ApplyError, match="plan.num_layers=34 but the traced model has 6"):
        checks.check_layers(uniform_plan(34), graph)


def test_non_uniform_tp_is_refused():
    plan = Plan(stages=[StagePlan(0, 3, tp=2), StagePlan(3, 6, tp=4)], dp=1)
    with pytest.raises(PlanError, match=r"same TP degree in every stage, got \[2, 4\]"):
        require_uniform_tp(plan)


def test_tied_embeddings_across_stages_accepted(single_rank):
    """Tied input/output embeddings are kept on the first and the last stage (Megatron-LM's way)."""
    model, cfg = build_model("gpt:hidden=32,layers=2,heads=2,seq=16,vocab=64,tie_embeddings=true", device="cpu")
    tokens = torch.randint(0, 64, (2, 16))
    graph = trace(model, (tokens,))
    checks.check_pipeline(uniform_plan(4, pp=2), model, graph)
    assert stage_layout(model, graph).shared == {"embed.tok.weight": ("embed.tok.weight", "lm_head.weight")}


def test_errors_come_before_any_collective(single_rank):
    """A one-rank world with a 4-rank plan fails in the checks, with no group beyond the default."""
    model, cfg = build_seeded(LLAMA)
    tokens = torch.randint(0, 128, (8, 32))
    with pytest.raises(ApplyError, match="world size mismatch"):
        auto_parallelize(model, tokens, global_batch_size=8, loss_fn=lm_loss, plan=uniform_plan(6, dp=4))
    # the model is untouched
    assert len(model.layers) == 4 and _untouched(model)


# -- mesh ---------------------------------------------------------------------------------------


def test_rank_table_follows_placement():
    plan = uniform_plan(6, pp=2, tp=2, dp=3)
    table = rank_table(plan)
    assert table.shape == (2, 3, 2)
    assert table[0].flatten().tolist() == list(range(6))  # stage-major: stage 0 owns ranks 0-5
    assert table[1, 2].tolist() == [10, 11]
    info = locate(plan, 9)
    assert (info.stage, info.replica, info.tp_rank) == (1, 1, 1)
    plan.placement = "replica-major"
    table = rank_table(plan)
    assert table[:, 0].flatten().tolist() == [0, 1, 2, 3]  # replica 0 owns ranks 0-3
    assert table[1, 2].tolist() == [10, 11]
    plan.placement, plan.ep = "stage-major", 3
    info = locate(plan, 9)
    assert (info.ep_rank, info.edp_rank) == (1, 0)


# -- pipeline split -------------------------------------------------------------------------------


def test_layer_subset_keeps_names_and_iterates_in_order():
    layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(5))
    sub = LayerSubset({3: layers[3], 1: layers[1]})
    assert sub.indices() == [1, 3]
    assert list(sub) == [layers[1], layers[3]] and sub[0] is layers[1] and len(sub) == 2
    assert list(sub[:1]) == [layers[1]]
    assert [n for n, _ in sub.named_parameters()] == ["1.weight", "1.bias", "3.weight", "3.bias"]


def test_stage_layout_names_the_modules_of_each_block():
    model, _, _, graph = _traced()
    layout = stage_layout(model, graph)
    assert layout.owned == {"embed": (0,), "norm": (5,), "lm_head": (5,)}
    assert layout.layers == {1: "layers.0", 2: "layers.1", 3: "layers.2", 4: "layers.3"}
    assert layout.modules_in(0, 2) == ["embed", "layers.0"] and layout.modules_in(4, 6) == [
        "norm",
        "lm_head",
        "layers.3",
    ]
    assert layout.first_problem() == "" and not layout.shared


@pytest.mark.parametrize(
    "name",
    [
        LLAMA,
        "gpt:hidden=64,layers=3,heads=4,seq=32,vocab=128",
        pytest.param("hf:llama:hidden=64,layers=3,heads=4,seq=32,vocab=128", marks=pytest.mark.hf),
    ],
)
def test_split_stages_compose_to_the_model(name):
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    model, cfg, tokens, graph = _traced(name)
    n = len(graph.blocks)
    expect = tensor_output(model(tokens))
    ranges = [(0, 2), (2, n - 1), (n - 1, n)]
    reference_names = {k for k, _ in model.named_parameters()}
    stages = [split_stages(copy.deepcopy(model), graph, [r])[0] for r in ranges]
    arm_stages(stages)
    args, kwargs = ((), {"input_ids": tokens}) if name.startswith("hf:") else ((tokens,), {})
    torch.testing.assert_close(run_stages(stages, args, kwargs), expect, rtol=0, atol=0)
    names = [k for s in stages for k, _ in s.named_parameters()]
    assert sorted(names) == sorted(reference_names)  # every parameter once, original names


def test_split_stages_chunks_share_nothing():
    model, cfg, tokens, graph = _traced()
    expect = tensor_output(model(tokens))
    chunks = split_stages(model, graph, [(0, 1), (1, 3), (3, 5), (5, 6)])
    arm_stages(chunks)
    torch.testing.assert_close(run_stages(chunks, (tokens,), {}), expect, rtol=0, atol=0)
    ids = [id(p) for c in chunks for p in c.parameters()]
    assert len(ids) == len(set(ids)) == 39


def test_interleaved_ranges_keep_layer_counts():
    plan = Plan(
        stages=[StagePlan(0, 5), StagePlan(5, 10)], schedule="interleaved", virtual_stages=2, num_microbatches=2
    )
    chunks = interleaved_ranges(plan, 10)
    assert chunks == [[(0, 2), (4, 7)], [(2, 4), (7, 10)]]  # chunk 0 of both devices, then chunk 1
    assert [sum(e - s for s, e in c) for c in chunks] == [5, 5]
    plan.virtual_stages = 6
    with pytest.raises(ApplyError, match="fewer than virtual_stages=6"):
        interleaved_ranges(plan, 10)


# -- TP regions -----------------------------------------------------------------------------------


def test_block_regions_from_traced_pairs():
    _, _, _, graph = _traced()
    pattern = graph.patterns[graph.blocks[1].signature]
    regions = {path: (kind, len(pairs)) for path, kind, pairs in block_regions(pattern)}
    assert regions == {"attn": ("attention", 1), "mlp": ("mlp", 1)}
    _, _, _, graph = _traced("moe:hidden=64,layers=2,heads=4,seq=32,vocab=128,experts=4")
    pattern = graph.patterns[graph.blocks[1].signature]
    regions = {path: (kind, len(pairs)) for path, kind, pairs in block_regions(pattern)}
    assert regions == {"attn": ("attention", 1), "moe": ("expert", 4)}


# -- checkpointing --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_keeps_values_and_names(mode):
    model, cfg, tokens, graph = _traced()
    targets = torch.randint(0, 128, tokens.shape)
    ref = copy.deepcopy(model)
    names = stage_blocks(graph, 0, len(graph.blocks))
    assert apply_checkpointing(model, names, mode) == 4
    for m in (model, ref):
        lm_loss(m(tokens), targets).backward()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-7, msg=n)
    assert model.layers[2]._nest_fx_recompute == mode


# -- one-rank auto_parallelize ----------------------------------------------------------------------


def test_default_plan_is_pure_data_parallel():
    _, _, _, graph = _traced()
    plan = default_plan(graph, 4, 16)
    assert (plan.pp, plan.dp, plan.uniform_tp, plan.global_batch) == (1, 4, 1, 16)
    with pytest.raises(ApplyError, match="divisible by 4"):
        default_plan(graph, 4, 10)


def test_auto_parallelize_one_rank_matches_plain_training(single_rank, capsys):
    model, cfg = build_seeded(LLAMA)
    ref = copy.deepcopy(model)
    x, y = torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32))
    seen = {}

    def planner(graph, cluster, world, batch):
        seen.update(world=world, batch=batch, blocks=len(graph.blocks), cluster=cluster)
        return uniform_plan(len(graph.blocks), microbatch_size=2, num_microbatches=2, recompute="full")

    pm = auto_parallelize(model, x, global_batch_size=4, loss_fn=lm_loss, planner=planner, cluster="c")
    assert seen == {"world": 1, "batch": 4, "blocks": 6, "cluster": "c"}
    assert "nest-fx plan: 1 ranks = pp1 x dp1 x tp1" in capsys.readouterr().out
    loss = pm.train_step(x, y)
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    assert abs(float(loss) - float(ref_loss.detach())) < 1e-6
    grads = pm.full_tensors(grads=True)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=1e-6)
    assert pm.plan.num_microbatches == 2 and pm.num_microbatches == 2
    with pytest.raises(ApplyError, match="expected the global batch"):
        pm.train_step(x[:3], y[:3])


def test_plan_for_another_model_fails_before_any_collective(single_rank):
    """A plan made for a 34-layer model, given to a 6-layer one: refused by the checks, with the
    reason, before the mesh or any group is built; the model is untouched."""
    model, cfg = build_seeded(LLAMA)
    tokens = torch.randint(0, 128, (8, 32))
    with pytest.raises(ApplyError, match=r"plan\.num_layers=34 but the traced model has 6 layers.*another model"):
        auto_parallelize(
            model,
            tokens,
            global_batch_size=8,
            loss_fn=lm_loss,
            plan=uniform_plan(34, num_microbatches=8, model="llama2-7b"),
        )
    assert len(model.layers) == 4 and _untouched(model)


def test_plan_for_another_model_with_the_same_layer_count_is_refused(single_rank, tmp_path, capsys):
    """Same layer count, other widths: the plan's layer-chain fingerprint differs from the
    model's. `simulate`, the CLI and `auto_parallelize` refuse it with the reason; the planner's
    own plans carry the fingerprint, which is stable across batch and sequence length."""
    import torch as _torch

    from nest_fx.cluster import load_cluster
    from nest_fx.workload import workload_for_model
    from nest_fx.cli import main
    from nest_fx.cost.step_time import simulate
    from nest_fx.solver import solve

    wider = "llama:hidden=128,layers=4,heads=4,seq=32,vocab=128"
    cluster = load_cluster("cpu-gloo:1")
    wl_wide = workload_for_model(wider, cluster, dtype=_torch.float32)
    wl_small = workload_for_model(LLAMA, cluster, dtype=_torch.float32)
    assert len(wl_wide) == len(wl_small) and wl_wide.fingerprint != wl_small.fingerprint
    assert workload_for_model(LLAMA, cluster, dtype=_torch.bfloat16, seq=16).fingerprint == wl_small.fingerprint
    plan = solve(wl_wide, cluster, global_batch=8).plan
    assert plan.model_fingerprint == wl_wide.fingerprint
    simulate(plan, wl_wide, cluster)  # its own model: fine
    with pytest.raises(PlanError, match="model_fingerprint: the plan was made for .*hidden=128.*layer chain"):
        simulate(plan, wl_small, cluster)
    path = tmp_path / "wide.json"
    plan.save(str(path))
    assert Plan.load(str(path)).model_fingerprint == plan.model_fingerprint
    assert main(["simulate", "--plan", str(path), "--model", LLAMA, "--cluster", "cpu-gloo:1"]) == 2
    assert "model_fingerprint" in capsys.readouterr().err
    model, cfg = build_seeded(LLAMA)
    tokens = torch.randint(0, 128, (8, 32))
    with pytest.raises(ApplyError, match="model_fingerprint.*the traced model"):
        auto_parallelize(model, tokens, global_batch_size=8, loss_fn=lm_loss, plan=plan)
    assert _untouched(model)


def test_a_plan_priced_for_kernels_the_runtime_does_not_run_is_refused_before_training():
    """kernels=fused (or compile without plan.compile) prices other systems: plan/simulate take it,
    the runtime refuses to run it as if it were what was priced."""
    model, _ = build_seeded("llama:hidden=64,layers=2,heads=4,seq=32,vocab=128")
    for kernels in ("", "eager"):
        checks.check_runtime_options(uniform_plan(2, dp=2, kernels=kernels), model, None, lm_loss, "cpu")
    for kernels, compile in (("", False), ("eager", False), ("compile", True), ("", True)):
        assert unrun_kernels(kernels, compile) == ""
    with pytest.raises(ApplyError, match=r"kernels=fused: .*runtime runs eager kernels.*fix: use kernels ''"):
        checks.check_runtime_options(uniform_plan(2, dp=2, kernels="fused"), model, None, lm_loss, "cpu")
    with pytest.raises(ApplyError, match=r"kernels=compile: .*fix: set compile=true"):
        checks.check_runtime_options(uniform_plan(2, dp=2, kernels="compile"), model, None, lm_loss, "cpu")
