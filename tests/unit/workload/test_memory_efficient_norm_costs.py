"""RMSNorms keeping their output for backward, not their input (plan.norm_kernel memory-efficient;
workload/fused_norms.py): the projections reading a norm's output save it anyway, so each norm
keeps its fp32 rstd alone, 2 bytes per token per hidden unit less per bf16 norm than the default
fused op (which keeps its input). The same under the ``fused`` backend's region min cuts; refused
with compile; applied on every device (nest-fx's own autograd function)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nest_fx.apply.checks import check_runtime_options
from nest_fx.apply.fused_norms import use_fused_norms
from nest_fx.cluster import load_cluster
from nest_fx.common.errors import NestFxError
from nest_fx.cost.step_time import simulate
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan
from nest_fx.plan.may_run import unrun_norm_kernel
from nest_fx.workload import workload_for_model
from nest_fx.workload.fused_norms import RSTD_BYTES
from nest_fx.workload.types import WorkloadError
from profiler.recompute_memory import kept_bytes

from norm_helpers import COST_LLAMA as LLAMA
from norm_helpers import SHAPED_H as H
from norm_helpers import SHAPED_S as S
from norm_helpers import block_norms, shaped_workload


@pytest.fixture(scope="module")
def shaped():
    return shaped_workload()


def _norm_facts(work):
    return block_norms(work)[2]


def _per_token(work, **runtime):
    return work.for_runtime(**runtime).cost(1, mbs=1).act_bytes["none"] / (S * H)


def test_each_norm_keeps_its_rstd_instead_of_its_input(shaped):
    """Eager: 2 bytes per token per hidden unit less per norm (the bf16 input); the output is the
    projections' saved input (q/k/v, gate/up), charged to them already."""
    facts = _norm_facts(shaped)
    assert [g.y_saved for g in facts.norms] == [True, True]
    for g in facts.norms:
        assert g.output_saving_bytes() == g.rows * RSTD_BYTES
    default, lean = _per_token(shaped), _per_token(shaped, norm_kernel="memory-efficient")
    assert default - lean == pytest.approx(2 * 2, rel=1e-9)
    # a norm whose output nobody saved would keep it: the same bytes as its input here
    g = dataclasses.replace(facts.norms[0], y_saved=False)
    assert g.output_saving_bytes() == g.y_bytes + g.rows * RSTD_BYTES


def test_the_fused_backend_drops_the_norm_inputs_its_min_cut_kept(shaped):
    """Korthikanti-style fused block at Llama 3 8B's ratios: 34 bytes per token per hidden unit
    with norms keeping their input, 30 + two fp32 rstd rows with norms keeping their output."""
    fused = _per_token(shaped, kernels="fused")
    lean = _per_token(shaped, kernels="fused", norm_kernel="memory-efficient")
    assert fused == pytest.approx(12 + 4 * 2 / 8 + 6 * 1792 / 512, abs=0.1)
    assert fused - lean == pytest.approx(2 * (2 - RSTD_BYTES / H), rel=1e-9)


def test_memory_efficient_norms_are_priced_on_a_device_without_the_fused_kernel():
    """On CPU the default prices the model's traced norm ops (no fused F.rms_norm kernel there);
    the memory-efficient norm is nest-fx's own autograd function, so it keeps rstd on CPU too."""
    work = workload_for_model(LLAMA, load_cluster("cpu-gloo:2"), dtype=torch.float32)
    facts = _norm_facts(work)
    eager = work.cost(1, mbs=2).act_bytes["none"]
    lean = work.for_runtime(norm_kernel="memory-efficient").cost(1, mbs=2).act_bytes["none"]
    traced = sum(facts.nodes[k].saved for g in facts.norms for k in g.members) * 2 / work.source.batch
    kept = sum(g.rows * RSTD_BYTES for g in facts.norms) * 2 / work.source.batch
    assert eager - lean == pytest.approx(traced - kept, rel=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_priced_saving_is_what_the_runtimes_norms_save(dtype):
    """On CPU (where the default prices the model's own norm ops, which the runtime then runs as
    F.rms_norm's decomposition), the block with the runtime's memory-efficient swap against the
    block as written: the measured difference of kept bytes is the priced one."""
    work = workload_for_model(LLAMA, load_cluster("cpu-gloo:2"), dtype=dtype)
    priced = (
        work.for_runtime(norm_kernel="model").cost(1, mbs=2).act_bytes["none"]
        - work.for_runtime(norm_kernel="memory-efficient").cost(1, mbs=2).act_bytes["none"]
    )
    block = build_seeded(LLAMA)[0].layers[0].to(dtype)
    lean = build_seeded(LLAMA)[0].layers[0].to(dtype)
    assert use_fused_norms(lean, "memory-efficient") == ["attn_norm", "mlp_norm"]
    x = torch.randn(2, 32, 64, dtype=dtype)
    measured = kept_bytes(block, [x]) - kept_bytes(lean, [x])
    if dtype == torch.float32:
        # the block's own first norm keeps the block input itself (x.float() is x), which kept_bytes leaves
        # out as an argument; in bf16 it keeps fp32 copies of it instead, which kept_bytes counts
        measured += x.numel() * x.element_size()
    assert measured > 0
    assert priced == pytest.approx(measured, rel=1e-6)


def test_not_with_compile(shaped):
    with pytest.raises(WorkloadError, match="norm_kernel=memory-efficient with compile"):
        shaped.for_runtime(compile=True, norm_kernel="memory-efficient")
    assert "fix: norm_kernel ''" in unrun_norm_kernel("memory-efficient", compile=True)
    assert unrun_norm_kernel("memory-efficient", compile=False) == ""
    assert unrun_norm_kernel("model", compile=True) == ""


def test_the_runtime_refuses_it_with_compile_before_training():
    plan = uniform_plan(4, dp=1, compile=True, norm_kernel="memory-efficient")
    with pytest.raises(NestFxError, match="memory-efficient with compile"):
        check_runtime_options(plan, torch.nn.Linear(2, 2), None, None, "cpu")


def test_simulate_prices_it(shaped):
    cluster = load_cluster("dgx-h100:8")
    plan = uniform_plan(len(shaped), dp=8, zero=3, microbatch_size=1, num_microbatches=1)
    default = simulate(plan, shaped, cluster)
    lean = simulate(dataclasses.replace(plan, norm_kernel="memory-efficient"), shaped, cluster)
    assert lean.peak_reserved < default.peak_reserved
    assert lean.step_s > default.step_s  # nest-fx's backward runs op by op, F.rms_norm's is one kernel


def test_the_op_by_op_backward_is_priced_as_it_runs(shaped):
    """apply/output_saving_norm.py's backward: 56 bytes per element in bf16 (and in fp32, where the
    upcast is free) against the fused backward's 10, in 9 kernels; the forward is F.rms_norm's."""
    g = _norm_facts(shaped).norms[0]
    weights = 2 * g.weight_bytes
    assert (g.output_saving_backward_bytes(1.0) - weights) / g.elements == pytest.approx(56)
    assert (g.backward_bytes(1.0) - weights) / g.elements == pytest.approx(10 + 2 * RSTD_BYTES / H)  # x3 y2 rstd2
    fp32 = dataclasses.replace(g, x_bytes=2 * g.x_bytes, y_bytes=2 * g.y_bytes)
    assert (fp32.output_saving_backward_bytes(1.0) - weights) / g.elements == pytest.approx(56)
    default = shaped.cost(1, mbs=1)
    lean = shaped.for_runtime(norm_kernel="memory-efficient").cost(1, mbs=1)
    assert lean.fwd_s == pytest.approx(default.fwd_s, rel=1e-12)
    assert lean.bwd_s > default.bwd_s
    compiled = shaped.for_runtime(kernels="fused", norm_kernel="memory-efficient").cost(1, mbs=1)
    assert compiled.bwd_s == shaped.for_runtime(kernels="fused").cost(1, mbs=1).bwd_s  # one fused kernel there
