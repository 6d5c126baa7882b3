"""The NEST DP planner: exact against enumeration, never worse than baselines, clear failures."""

import dataclasses

import pytest
from conftest import tight_cluster

from nest_fx.cluster import load_cluster
from nest_fx.workload import workload_for_model
from nest_fx.cost.step_time import simulate
from nest_fx.solver import NoFeasiblePlan, SolverOptions, solve
from nest_fx.solver.space import in_space
from nest_fx.solver.baselines import exhaustive, mcmc, phaze
from nest_fx.solver.recipes import block_split, interleave_factors, megatron, torchtitan

SMALL_SPACE = SolverOptions(
    microbatch_sizes=(1, 2),
    tp_degrees=(1, 2),
    zero_stages=(1, 3),
    schedules=(("1f1b", 1),),
    recompute=("none", "full"),
    max_stages=4,
)


CASES = [
    ("llama:hidden=1024,layers=5,heads=8,seq=1024,vocab=8192", 0.3, 16),
    ("llama:hidden=1024,layers=5,heads=8,seq=1024,vocab=8192", 0.6, 16),
    ("moe:hidden=512,layers=4,heads=8,kv=4,seq=512,vocab=4096,experts=4,moe_every=2", 0.1, 8),
]


@pytest.mark.parametrize("model, gib, batch", CASES)
def test_dp_equals_exhaustive_optimum(model, gib, batch):
    cluster = tight_cluster(gib)
    work = workload_for_model(model, cluster)
    assert len(work) <= 8
    found = solve(work, cluster, batch, SMALL_SPACE)
    best = exhaustive(work, cluster, batch, SMALL_SPACE)
    assert best.result is not None and found.complete
    assert found.result.step_s == pytest.approx(best.result.step_s, rel=1e-9)
    # the DP's own objective is the simulator's step time, not an approximation of it
    assert found.stats["dp_objective"] == pytest.approx(found.result.step_s, rel=1e-9)


def test_tight_memory_forces_a_pipeline_with_per_stage_choices():
    cluster = tight_cluster(0.3)  # 0.28 before the pipeline's receive buffers were priced per microbatch
    work = workload_for_model(CASES[0][0], cluster)
    found = solve(work, cluster, 16, SMALL_SPACE)
    modes = [s.recompute for s in found.plan.stages]
    # the first stage holds the most in-flight microbatches (1F1B) and recomputes; middle stages
    # hold fewer and need not (the last one holds the loss's logits)
    assert found.plan.pp > 2 and modes[0] == "full" and "none" in modes[1:-1]
    assert all(s.fits for s in found.result.stages)
    # reported memory is what simulate says, and within the device
    for s in found.result.stages:  # what the allocator reserves fits in the usable memory
        assert s.reserved <= cluster.device.memory_bytes * 0.95


@pytest.mark.parametrize("model, gib, batch", CASES[:2])
def test_never_worse_than_baselines(model, gib, batch):
    cluster = tight_cluster(gib)
    work = workload_for_model(model, cluster)
    found = solve(work, cluster, batch, SMALL_SPACE)
    compared = 0
    for base in (
        megatron(work, cluster, batch, SMALL_SPACE),
        torchtitan(work, cluster, batch, SMALL_SPACE),
        phaze(work, cluster, batch, SMALL_SPACE),
        mcmc(work, cluster, batch, SMALL_SPACE, evaluations=300),
    ):
        # the recipes may choose what the space leaves out (selective recompute, v > 2): no claim then
        if base.result is not None and in_space(base.plan, SMALL_SPACE, cluster):
            assert found.result.step_s <= base.result.step_s * (1 + 1e-12), base.name
            compared += 1
    assert compared >= 2


def test_network_awareness_beats_phaze_on_a_slow_spine():
    """Phaze scores plans on a flat network; on a real hierarchy that choice can be slower."""
    cluster = load_cluster("h100-spine-leaf:64")
    work = workload_for_model("llama:hidden=2048,layers=8,heads=16,seq=2048,vocab=32000", cluster)
    opts = SolverOptions(microbatch_sizes=(1, 2), schedules=(("1f1b", 1),))
    found = solve(work, cluster, 256, opts)
    base = phaze(work, cluster, 256, opts)
    assert found.result.step_s <= base.result.step_s


def test_nothing_fits_names_binding_constraint():
    cluster = load_cluster("dgx-a100:8")
    work = workload_for_model("llama2-7b", cluster, seq=256)
    tiny = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=2 * 2**30))
    with pytest.raises(NoFeasiblePlan, match=r"binding constraint: model states.*(about|at least) \d+ devices"):
        solve(work, tiny, 64, SolverOptions(microbatch_sizes=(1,)))


def test_batch_without_admissible_split_is_explained():
    cluster = tight_cluster(1.0)
    work = workload_for_model(CASES[0][0], cluster)
    with pytest.raises(NoFeasiblePlan, match="divides the global batch"):
        solve(work, cluster, 3, SolverOptions(microbatch_sizes=(2,)))


def test_plan_round_trips_and_resimulates(tmp_path):
    cluster = tight_cluster(0.5)
    work = workload_for_model(CASES[1][0], cluster)
    found = solve(work, cluster, 16, SMALL_SPACE)
    path = tmp_path / "plan.json"
    found.plan.save(str(path))
    from nest_fx.plan import Plan

    again = simulate(Plan.load(str(path)), work, cluster)
    assert again.step_s == pytest.approx(found.result.step_s)
    assert Plan.load(str(path)).predicted["step_s"] == pytest.approx(found.result.step_s)


# -- the recipes as their authors run them ---------------------------------------------------

GPT_SMALL = "gpt:hidden=1024,layers=8,heads=16,seq=512,vocab=8192"


def test_megatron_split_puts_the_embedding_first_and_the_head_last():
    work = workload_for_model(GPT_SMALL, load_cluster("dgx-a100:8"))
    assert [layer.kind for layer in work.layers] == ["head"] + ["block"] * 8 + ["tail"]
    # blocks 1..8 evenly over 4 stages; the head joins stage 0 and the tail the last stage
    assert block_split(work, 4) == [(0, 3), (3, 5), (5, 7), (7, 10)]
    assert block_split(work, 1) == [(0, 10)]
    assert block_split(work, 3) is None  # Megatron-LM needs p to divide the blocks


def test_megatron_interleaves_by_its_rules():
    assert interleave_factors(6, 4, 8) == [1, 2, 3, 6]  # v divides the blocks per stage
    assert interleave_factors(6, 4, 6) == [1]  # the microbatches must be a multiple of p
    assert interleave_factors(6, 1, 8) == [1]  # nothing to interleave without a pipeline


def test_megatron_recipe_uses_every_device_and_its_split():
    cluster = load_cluster("dgx-a100:32")
    work = workload_for_model(GPT_SMALL, cluster)
    b = megatron(work, cluster, 64)
    plan = b.plan
    assert plan.devices_used == 32 and plan.zero == 1 and plan.placement == "stage-major"
    assert [(s.start, s.end) for s in plan.stages] == block_split(work, plan.pp)
    assert all(s.recompute == "selective" for s in plan.stages)
    assert plan.sequence_parallel == (plan.stages[0].tp > 1)
    if plan.schedule == "interleaved":
        assert plan.virtual_stages in interleave_factors(8 // plan.pp, plan.pp, plan.num_microbatches)


@pytest.mark.parametrize(
    "spec, tp, recompute, zero",
    [
        (GPT_SMALL, 1, "op", 3),  # below 70B: FSDP alone, op-level SAC
        ("gpt:hidden=32768,layers=6,heads=64,seq=512,vocab=8192", 8, "full", 3),  # 77B: + TP 8, full AC
    ],
)
def test_torchtitan_recipe_by_model_size(spec, tp, recompute, zero):
    cluster = load_cluster("dgx-h100:64")
    work = workload_for_model(spec, cluster)
    b = torchtitan(work, cluster, 64)
    assert b.plan is not None
    assert (b.plan.stages[0].tp, b.plan.pp, b.plan.zero) == (tp, 1, zero)
    assert {s.recompute for s in b.plan.stages} == {recompute}
    assert b.plan.devices_used == 64 and not b.notes
    assert b.plan.loss_parallel == (tp > 1)  # torchtitan's default with TP


def test_torchtitan_pipelines_the_405b_class():
    cluster = load_cluster("dgx-h100:192")
    work = workload_for_model("gpt:hidden=65536,layers=6,heads=128,seq=512,vocab=8192", cluster)  # 310B
    b = torchtitan(work, cluster, 64)
    assert b.plan is not None and b.plan.pp > 1 and b.plan.stages[0].tp == 8 and b.plan.schedule == "1f1b"
    assert b.plan.microbatch_size == 1 and b.plan.zero == 1  # FSDP without resharding under PP
    assert [(s.start, s.end) for s in b.plan.stages] == block_split(work, b.plan.pp)


def test_the_search_never_returns_a_combination_the_runtime_refuses():
    """Under async TP the search (and its Megatron incumbent) offers only plans the runtime runs:
    tp > 1 with sequence parallelism and compile. compile alone no longer holds TP back."""
    from nest_fx.plan import uniform_plan
    from nest_fx.plan.may_run import unrun_fields

    cluster = load_cluster("dgx-h100:16")
    work = workload_for_model("llama:hidden=2048,layers=4,heads=16,seq=1024,vocab=8192", cluster)
    found = solve(work, cluster, 32, SolverOptions(compile=True, async_tp=True, time_budget=30))
    plan = found.plan
    assert plan.compile and plan.async_tp and unrun_fields(plan) == [] and plan.stages[0].tp > 1
    with_tp = uniform_plan(
        len(work), tp=2, dp=8, num_microbatches=4, compile=True, async_tp=True, sequence_parallel=True
    )
    options = SolverOptions(compile=True, async_tp=True)
    assert in_space(with_tp, options, cluster)
    assert not in_space(
        dataclasses.replace(with_tp, sequence_parallel=False), options, cluster
    )  # how the incumbent is screened


def test_forced_recompute_bounds_what_the_optimum_recomputes():
    """The first bound adds the recompute memory forces (TableCache.forced_recompute): never more
    than the optimum plan re-runs, and more than nothing where memory forces recompute."""
    from nest_fx.solver.space import GlobalConfig
    from nest_fx.solver.table_cache import TableCache

    cluster = tight_cluster(0.3)
    work = workload_for_model(CASES[0][0], cluster)
    found = solve(work, cluster, 16, SMALL_SPACE)
    plan = found.plan
    assert any(s.recompute != "none" for s in plan.stages)
    cache = TableCache(work, cluster, SMALL_SPACE.cost, SMALL_SPACE.recompute)
    bound = cache.forced_recompute(GlobalConfig.of(plan), plan.pp, plan.num_microbatches)
    spent = sum(s.recompute_s for s in found.result.stages)
    assert 0 < spent and bound <= spent * (1 + 1e-9)
    # without a pipeline the whole model's activations meet one device: memory forces recompute
    assert cache.forced_recompute(GlobalConfig.of(plan), 1, plan.num_microbatches) > 0
    roomy = tight_cluster(64.0)
    assert (
        TableCache(
            workload_for_model(CASES[0][0], roomy), roomy, SMALL_SPACE.cost, SMALL_SPACE.recompute
        ).forced_recompute(GlobalConfig.of(plan), plan.pp, plan.num_microbatches)
        == 0
    )


@pytest.mark.parametrize("model, gib, batch", CASES[::2])
def test_states_bound_never_exceeds_what_a_feasible_plan_holds(model, gib, batch, monkeypatch):
    """The bound the search and the command line check first: model states spread over every
    device. A plan that fits holds at least that on its fullest device, so the bound passes it;
    memory just under the bound is refused before the candidates are enumerated."""
    import nest_fx.solver.search as search
    from nest_fx.cost.memory import model_states, usable_bytes

    cluster = tight_cluster(gib)
    work = workload_for_model(model, cluster)
    found = solve(work, cluster, batch, SMALL_SPACE)
    held = max(s.memory["weights"] + s.memory["grads"] + s.memory["optimizer"] for s in found.result.stages)
    average = model_states(work.num_params, 3, cluster.num_devices, SMALL_SPACE.cost)["total"]
    assert held >= average * (1 - 1e-12)
    assert search.states_bound(work.num_params, cluster, SMALL_SPACE.cost) is None
    # a device just too small for the average: refused before any candidate is built
    capacity = 0.99 * average / usable_bytes(1.0, SMALL_SPACE.cost)  # usable bytes per byte of memory
    small = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=capacity))
    monkeypatch.setattr(search, "tier0", lambda *a, **k: pytest.fail("enumerated candidates"))
    with pytest.raises(NoFeasiblePlan, match=r"binding constraint: model states.* at least \d+ devices"):
        solve(work, small, batch, SMALL_SPACE)


def test_hsdp_shard_groups_with_experts_are_multiples_of_ep():
    """HSDP x EP runs when the expert groups lie inside the shard groups (plan.may_run): the
    search offers those shard groups with ep > 1, and only those."""
    from nest_fx.solver.space import shard_candidates  # the search space's own helper

    cluster = load_cluster("dgx-h100:32")  # nodes of 8
    options = SolverOptions()
    assert shard_candidates(cluster, 16, 1, 1, 2, 3, options) == [0, 8]
    assert shard_candidates(cluster, 16, 1, 1, 16, 3, options) == [0]  # no shard group holds 16 expert ranks
    bounded = dataclasses.replace(options, degree_bounds={"dp_shard": (1, 16)})
    assert shard_candidates(cluster, 16, 1, 1, 4, 3, bounded) == [4, 8, 0]
