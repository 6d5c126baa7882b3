"""Memory of the published runs' configurations, term by term (scripts/bench_published.py).

* Gradients under pipelining: FSDP2 inside ``torch.distributed.pipelining`` defers the
  gradient reduction to the last microbatch and accumulates each unsharded gradient in its
  ``reduce_dtype`` (``memory.held_grad_bytes``): fp32 for a bf16-mixed plan reducing in fp32;
  checked on the installed torch (one gloo rank, gradient sync off as the schedules turn it).
* Meta's Llama 3 405B rows (Grattafiori et al. 2024, Table 4): 8 model chunks of one layer per
  rank (the paper's "the first model chunk on the first stage has only the embedding"), the
  interleaved schedule's in-flight chunks (Narayanan et al. 2021) and the fused backend's
  activation bytes per layer; m1 and m2 differ in their microbatch count (32 vs 16), which caps
  the warm-up at m v chunks.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from nest_fx.cost.inflight import interleaved_chunk_states, pipeline_inflight_microbatches
from nest_fx.cost.memory import held_grad_bytes, model_states
from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import simulate
from nest_fx.workload import workload_for_model
from nest_fx.workload.types import Workload
from fsdp_fixtures import bf16_fsdp2_pair
from repo_root import import_script

GiB = 2**30


def test_pipelined_fsdp_accumulates_gradients_in_the_reduce_dtype():
    fp32_reduce = CostOptions(reduce_bytes=4)  # bf16-mixed: fp32 master weights hold the gradients
    assert held_grad_bytes(1, True, fp32_reduce) == 4
    assert held_grad_bytes(1, False, fp32_reduce) == 4
    assert held_grad_bytes(0, True, fp32_reduce) == 4
    no_master = CostOptions(reduce_bytes=4, master_weights=False)
    assert held_grad_bytes(1, True, no_master) == 4  # pipelined ZeRO-1 (and 2/3, which run as 1)
    assert held_grad_bytes(1, False, no_master) == 2  # no pipeline: as the parameters
    assert held_grad_bytes(0, True, no_master) == 2  # replicated: no FSDP2
    assert held_grad_bytes(1, True, CostOptions()) == 2  # reduced in bf16: accumulated in bf16
    states = model_states(1e9, 1, 8, fp32_reduce, pipelined=True)
    assert states["grads"] == 4e9 and states["weights"] == 2e9 and states["optimizer"] == 12e9 / 8
    assert model_states(1e9, 1, 8, no_master)["grads"] == 2e9


def test_fsdp2_accumulates_unsharded_gradients_in_its_reduce_dtype(single_rank, tmp_path):
    """What ``held_grad_bytes`` prices, on the installed torch: with gradient sync off (as the
    pipeline schedules turn it until the last microbatch) a bf16-mixed FSDP2 unit keeps each
    parameter's unsharded gradient in fp32 after the second microbatch's backward."""
    # FSDP2 keeps the accumulated gradient on its internal FSDPParam; no public API shows it
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    model = bf16_fsdp2_pair(tmp_path)
    model.set_requires_gradient_sync(False)
    for _ in range(2):
        model(torch.randn(4, 64)).float().sum().backward()
    held = [
        p.unsharded_accumulated_grad
        for layer in model
        for p in _get_module_fsdp_state(layer)._fsdp_param_group.fsdp_params
    ]
    assert held and all(g is not None and g.dtype == torch.float32 for g in held)
    assert sum(g.numel() * g.element_size() for g in held) == 2 * 64 * 64 * held_grad_bytes(
        1, True, CostOptions(reduce_bytes=4)
    )


@pytest.mark.parametrize(
    "m, v, stage, expected",
    [
        (32, 8, 0, (7 * 16 + 2 * 15 + 1) / 8),  # m1, first rank: (v-1) p + 2 (p-1) + 1 chunks
        (32, 8, 1, (7 * 16 + 2 * 14 + 1) / 8),  # m1, second rank: 141 chunks of one layer
        (16, 8, 1, 16 * 8 / 8),  # m2: the warm-up is capped at m v = 128 chunks (all of them)
        (32, 2, 0, 47 / 2),  # with 2 chunks, m1's first rank: 23.5 microbatches of its layers
        (16, 2, 0, 32 / 2),  # ... and m2's: 16 (capped at m v = 32), the 30 GiB between them
    ],
)
def test_meta_rows_in_flight_microbatches(m, v, stage, expected):
    assert pipeline_inflight_microbatches("interleaved", stage, 16, m, v) == pytest.approx(expected)
    assert max(s[0] for s in interleaved_chunk_states(stage, 16, m, v)) == pytest.approx(expected)


@pytest.fixture(scope="module")
def bench():
    return import_script("bench_published")  # the rows are defined once, in the benchmark script


def _chain_of(bench, row, cluster):
    """The row's model as its blocks copied from a trace of two (identical blocks cost the same:
    as tracing all of them gives, in a fraction of the time; tests/unit/cost/test_published.py
    does the same)."""
    spec = bench.MODELS[row.model]
    layers = int(re.search(r"layers=(\d+)", spec).group(1))
    short = spec.replace(f"layers={layers}", "layers=2")
    two = workload_for_model(short, cluster, seq=row.seq)
    head, block, tail = two.layers[0], two.layers[1], two.layers[-1]
    chain = [head] + [dataclasses.replace(block, name=f"layers.{i}") for i in range(layers)] + [tail]
    return Workload(two.model, chain, two.dims, two.source)


def test_meta_405b_second_rank_holds_141_layer_microbatches_of_fused_activations(bench):
    """m1's binding rank: 8 layers, 141 chunk-microbatches of one layer each, 12 + 4/16 + 6 x 3.25
    = 31.75 bytes per token per hidden unit / TP 8 with norms keeping their input
    (``workload.kernels``): about 70 GiB of activations; 4 less (plus two fp32 rstd rows) with the
    row's memory-efficient norms (``norm_kernel``: about 61 GiB); the model states and the rest are
    the other terms, the gradients sharded as Meta's FSDP shards them (``pp_shard_grads``) or,
    without the setting, held unsharded."""
    row = next(r for r in bench.published_rows() if r.key == "m1")
    assert (row.virtual_stages, row.pp, row.tp, row.local_batch) == (8, 16, 8, 32)
    cluster = bench.cluster_of(row)
    work = _chain_of(bench, row, cluster)
    assert len(work) == 128
    plan = bench.published_plan(row, work)
    result = simulate(plan, work, cluster, bench.cost_options(row))
    stage = result.stages[1]
    assert stage.layers[1] - stage.layers[0] == 8
    tokens_h = 8192 * 16384 / 8
    assert row.norm_kernel == "memory-efficient"
    held = stage.memory["activations"]
    assert held == pytest.approx(141 * (31.75 - 4 + 2 * 4 / 16384) * tokens_h, rel=0.03)  # + a backward working set
    inputs_kept = simulate(bench.published_plan(row, work, norm_kernel=""), work, cluster, bench.cost_options(row))
    assert inputs_kept.stages[1].memory["activations"] == pytest.approx(141 * 31.75 * tokens_h, rel=0.03)
    assert inputs_kept.stages[1].memory["activations"] - held == pytest.approx(
        141 * (4 - 8 / 16384) * tokens_h, rel=1e-6
    )
    weights = stage.num_params * 2
    assert stage.memory["weights"] == pytest.approx(weights)
    # Meta's FSDP shards the gradients (pp_shard_grads): fp32 shards over DP 64
    assert (plan.zero, plan.pp_shard_grads) == (2, True)
    assert stage.memory["grads"] == pytest.approx(2 * weights / 64)
    held = simulate(bench.published_plan(row, work, pp_shard_grads=False), work, cluster, bench.cost_options(row))
    assert held.stages[1].memory["grads"] == pytest.approx(2 * weights)  # unsharded fp32 (torch pipelining's FSDP2)
    assert held.stages[1].memory["total"] - stage.memory["total"] == pytest.approx(2 * weights * 63 / 64, rel=0.01)


def test_nemo_llama3_8b_cp2_row_fits_with_its_bf16_gradients(bench):
    """NeMo's Llama 3 8B row (n4: 8 GPUs, CP 2, GBS 128, MBS 1) ran, so it must fit: its
    performance script holds and reduces gradients in bf16 (``grad_reduce_in_fp32 = False``).
    Priced that way the row is feasible; fp32 gradients (as torchtitan's and Meta's rows reduce)
    hold 2 bytes more per parameter. (Until Transformer Engine's FP8 linear inputs were priced at
    one byte an element, 2026-11-27, those 2 bytes pushed the row over the device.)"""
    rows = {r.key: r for r in bench.published_rows() if r.system == "nemo"}  # NeMo's and Megatron-Bridge's
    assert sorted(rows, key=lambda k: (k[0], int(k[1:]))) == [f"n{i}" for i in range(1, 11)] + [
        f"r{i}" for i in range(1, 7)
    ]
    n7 = rows["n7"]
    assert (n7.local_batch, n7.microbatch, n7.num_microbatches) == (128, 2, 64)  # GBS 2048 over DP 16
    row = rows["n4"]
    cluster = bench.cluster_of(row)
    work = _chain_of(bench, row, cluster)
    plan = bench.published_plan(row, work)
    assert (plan.cp, plan.dp, plan.zero, plan.microbatch_size, plan.num_microbatches) == (2, 4, 1, 1, 32)
    options = bench.cost_options(row)
    assert options.reduce_dtype_bytes() == 2 and plan.kernels == "fused" and plan.float8
    result = simulate(plan, work, cluster, options)
    params = result.stages[0].num_params
    assert result.stages[0].memory["grads"] == pytest.approx(2 * params)  # ZeRO-1: whole, bf16
    assert result.feasible
    fp32 = simulate(plan, work, cluster, dataclasses.replace(options, reduce_bytes=4))
    assert fp32.stages[0].memory["grads"] == pytest.approx(4 * params)
    assert fp32.stages[0].memory["total"] - result.stages[0].memory["total"] == pytest.approx(2 * params)


def test_automodel_moe_row_fits_only_with_its_assumed_bf16_states(bench):
    """AutoModel's Qwen3-30B-A3B row (a1) ran on 8 H100s, EP 8 inside FSDP 8, and publishes no
    memory: priced with bf16 parameters and Adam states (its HF config's dtype: ``bf16-true``, the
    row's stated assumption) it fits; with fp32 masters and states (``bf16-mixed``) the 30.5 B
    parameters' 12 bytes over 8 ranks alone are 42.7 GiB and it does not."""
    row = next(r for r in bench.published_rows() if r.key == "a1")
    cluster = bench.cluster_of(row)
    work = _chain_of(bench, row, cluster)
    plan = bench.published_plan(row, work)
    assert (plan.ep, plan.dp, plan.zero, plan.precision, plan.kernels) == (8, 8, 2, "bf16-true", "fused")
    assert (plan.microbatch_size, plan.num_microbatches, plan.stages[0].recompute) == (4, 16, "full")
    fits = simulate(plan, work, cluster, bench.cost_options(row))
    assert fits.feasible
    assert fits.stages[0].memory["optimizer"] == pytest.approx(4 * work.num_params / 8, rel=0.01)
    mixed = simulate(dataclasses.replace(plan, precision="bf16-mixed"), work, cluster, bench.cost_options(row))
    assert mixed.stages[0].memory["optimizer"] == pytest.approx(12 * work.num_params / 8, rel=0.01)
    assert not mixed.feasible


@pytest.mark.parametrize("withdrawn", [None, "fp8_saved_inputs", "expert_probs_in_activation", "loss_in_place_always"])
def test_megatron_bridge_moe_row_fits_as_megatron_core_keeps_its_tensors(bench, withdrawn, monkeypatch):
    """Megatron-Bridge's Qwen3-30B-A3B row (r6: 16 H100, FP8, PP 2 VP 24 EP 8, no recompute) ran,
    so it must fit. Priced as Megatron-Core and Transformer Engine keep their tensors (the ``fused``
    backend: FP8 linear inputs quantized, the router weights in the experts' activation, the loss
    in place) it does; with any one of the three priced as nest-fx's runtime keeps it, it does not.
    Its throughput is the same either way (memory only)."""
    from nest_fx.workload.kernels import KERNEL_BACKENDS

    if withdrawn:
        monkeypatch.setitem(
            KERNEL_BACKENDS, "fused", dataclasses.replace(KERNEL_BACKENDS["fused"], **{withdrawn: False})
        )
    row = next(r for r in bench.published_rows() if r.key == "r6")
    cluster = bench.cluster_of(row)
    work = _chain_of(bench, row, cluster)
    plan = bench.published_plan(row, work)
    assert (plan.pp, plan.virtual_stages, plan.dp, plan.ep, plan.microbatch_size, plan.kernels) == (
        2,
        24,
        8,
        8,
        2,
        "fused",
    )
    result = simulate(plan, work, cluster, bench.cost_options(row))
    assert result.feasible is (withdrawn is None), max(s.memory["total"] for s in result.stages) / GiB
