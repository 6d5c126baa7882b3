"""What ``plan.pp_shard_grads`` prices: a pipelined ZeRO-2/3 plan keeps its ZeRO stage (sharded
gradients accumulated in the reduce dtype, no unsharded gradient held across microbatches) and
pays ``m`` reduce-scatters a step, run under the ``m`` backwards; checked against FSDP2 on the
installed torch (one gloo rank) for the held bytes, and against the planner (the setting is
searched when the user sets it, never slower than a published plan using it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nest_fx.cost.collectives import collective_fn
from nest_fx.cost.dp_sync import reduce_spread
from nest_fx.cost.memory import effective_zero_stage, held_grad_bytes, model_states
from nest_fx.cost.options import CostOptions
from nest_fx.cost.stage_terms import stage_groups
from nest_fx.cost.step_time import simulate, stage_tail
from nest_fx.plan import Plan, StagePlan
from nest_fx.plan.may_run import unrun_fields, unrun_schedule
from nest_fx.solver import SolverOptions, solve
from nest_fx.solver.space import in_space
from nest_fx.workload import workload_for_model
from cluster_fixtures import h100ish
from fsdp_fixtures import bf16_fsdp2_pair

FP32_REDUCE = CostOptions(reduce_bytes=4)


def test_the_zero_stage_holds_under_pipelining_only_with_the_setting():
    assert effective_zero_stage(2, 4) == 1 and effective_zero_stage(3, 4) == 1  # torch's pipelining
    assert effective_zero_stage(2, 4, pp_shard_grads=True) == 2
    assert effective_zero_stage(3, 4, pp_shard_grads=True) == 3
    assert effective_zero_stage(1, 4, pp_shard_grads=True) == 1  # nothing to shard at ZeRO-1
    assert effective_zero_stage(3, 1) == 3  # no pipeline: FSDP reduces every microbatch anyway
    assert reduce_spread(2, 4, 8) == 8 and reduce_spread(1, 4, 8) == 1 and reduce_spread(2, 1, 8) == 1


def test_sharded_gradients_are_held_in_the_reduce_dtype_over_dp():
    assert held_grad_bytes(2, True, FP32_REDUCE) == 4  # fp32 shards, accumulated over the microbatches
    held = model_states(1e9, 1, 8, FP32_REDUCE, pipelined=True)["grads"]  # unsharded, fp32
    sharded = model_states(1e9, 2, 8, FP32_REDUCE, pipelined=True)["grads"]
    assert held == 4e9 and sharded == 4e9 / 8


def test_fsdp2_accumulates_reduced_shards_in_the_reduce_dtype(single_rank, tmp_path):
    """What ``held_grad_bytes(2, True, ...)`` prices, on the installed torch: with gradient sync
    on for every microbatch (``apply.pipeline.ShardedGradStage``) a bf16-mixed FSDP2 unit holds
    no unsharded gradient after a backward, and its sharded gradient is fp32."""
    # FSDP2 keeps the accumulated gradient on its internal FSDPParam; no public API shows it
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    model = bf16_fsdp2_pair(tmp_path)
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(False)
    for _ in range(2):
        model(torch.randn(4, 64)).float().sum().backward()
        params = [p for layer in model for p in _get_module_fsdp_state(layer)._fsdp_param_group.fsdp_params]
        assert params and all(p.unsharded_accumulated_grad is None for p in params)
        assert all(p._unsharded_param.grad is None for p in params if hasattr(p, "_unsharded_param"))
    grads = [p.sharded_param.grad for p in params]  # the module shows the gathered parameters (no grad)
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert sum(g.to_local().numel() * g.to_local().element_size() for g in grads) == 2 * 64 * 64 * held_grad_bytes(
        2, True, FP32_REDUCE
    )


@pytest.fixture(scope="module")
def work():
    return workload_for_model("llama:hidden=1024,layers=4,heads=16,kv=8,seq=2048,vocab=8192", h100ish(16))


def _plan(work, zero: int, shard: bool, schedule: str = "1f1b") -> Plan:
    n = len(work)
    return Plan(
        stages=[StagePlan(0, n // 2, 2, "none"), StagePlan(n // 2, n, 2, "none")],
        num_layers=n,
        dp=4,
        zero=zero,
        pp_shard_grads=shard,
        microbatch_size=1,
        num_microbatches=8,
        schedule=schedule,
        sequence_parallel=True,
        placement="stage-major",
        seq_len=work.dims.seq_len,
    )


def test_simulate_prices_sharded_gradients_and_m_reduce_scatters(work):
    c, options = h100ish(16), FP32_REDUCE
    held = simulate(_plan(work, 2, False), work, c, options)
    sharded = simulate(_plan(work, 2, True), work, c, options)
    for h, s in zip(held.stages, sharded.stages):
        assert h.memory["grads"] == pytest.approx(4 * h.num_params)  # unsharded fp32, all step
        assert s.memory["grads"] == pytest.approx(4 * s.num_params / 4)  # fp32 shards over dp 4
        assert s.memory["total"] < h.memory["total"]
    # the traffic: m = 8 reduce-scatters of the fp32 gradients and one bf16 all-gather per step
    # (ZeRO-2) against one all-reduce (torch's pipelining: ZeRO-1's traffic)
    plan = _plan(work, 2, True)
    for i, s in enumerate(sharded.stages):
        group = stage_groups(plan, i).dp
        rs = collective_fn("reduce_scatter", c, group)(4 * s.num_params)
        ag = collective_fn("all_gather", c, group)(2 * s.num_params)
        assert s.dp_sync == pytest.approx(8 * rs + ag, rel=1e-6)
        assert held.stages[i].dp_sync == pytest.approx(collective_fn("all_reduce", c, group)(4 * s.num_params))
    # exposed after the last backward: what the 8 backwards (not one) cannot cover (all of it is
    # overlappable: overlap_grad_sync 1)
    for s, h in zip(sharded.stages, held.stages):
        assert stage_tail(s, plan, c, options)[0] == pytest.approx(
            max(0.0, s.dp_sync - 8 * (s.bwd_compute + s.recompute_s))
        )
        unflagged = _plan(work, 2, False)
        assert stage_tail(h, unflagged, c, options)[0] == pytest.approx(
            max(0.0, h.dp_sync - (h.bwd_compute + h.recompute_s))
        )


def test_split_backward_schedules_refuse_it():
    assert "pp_shard_grads" in unrun_schedule("interleaved-zb", pp=2, zero=2, pp_shard_grads=True)
    assert "pp_shard_grads" in unrun_schedule("zbv", pp=2, zero=2, pp_shard_grads=True)
    assert unrun_schedule("interleaved-zb", pp=2, zero=1, pp_shard_grads=True) == ""  # no effect at ZeRO-1
    assert unrun_schedule("interleaved", pp=2, zero=3, pp_shard_grads=True) == ""
    # the runtime's check asks the same (auto_parallelize refuses before the first collective)
    plan = Plan(
        stages=[StagePlan(0, 2, 1, "none"), StagePlan(2, 4, 1, "none")],
        num_layers=4,
        dp=2,
        zero=2,
        pp_shard_grads=True,
        num_microbatches=4,
        schedule="interleaved-zb",
        virtual_stages=2,
    )
    assert any("pp_shard_grads" in p for p in unrun_fields(plan))
    assert not unrun_fields(dataclasses.replace(plan, schedule="interleaved"))


def test_planner_searches_it_when_set_and_is_never_slower(work):
    c = h100ish(16)
    options = SolverOptions(time_budget=None, use_all_devices=True, pp_shard_grads=True, cost=FP32_REDUCE)
    plan = _plan(work, 2, True)
    published = simulate(plan, work, c, options.cost)
    assert published.feasible
    assert in_space(plan, options, c)  # pipelined ZeRO-2 is no duplicate of ZeRO-1 with the setting
    assert not in_space(plan, SolverOptions(use_all_devices=True, cost=FP32_REDUCE), c)  # set by the user only
    found = solve(work, c, 4 * 8, options)
    assert found.complete
    assert found.result.step_s <= published.step_s * (1 + 1e-9)
    assert found.plan.pp_shard_grads
