"""The coverage suite: the planner offers every model only what the runtime runs (single process),
and a few cells of the matrix on 4 gloo ranks (the full matrix: scripts/bench_coverage.py)."""

from __future__ import annotations

import pytest
import torch

from nest_fx.apply import checks
from nest_fx.apply.launch import launch
from nest_fx.graph import trace
from nest_fx.models import build_seeded
from nest_fx.models.build import model_example
from nest_fx.models.inputs import call_args, make_batch, with_loss_fn
from nest_fx.plan.support import parallel_support
from nest_fx.solver import SolverOptions
from nest_fx.solver.runtime_planner import runtime_options
from nest_fx.testing import (
    COVERAGE_BATCH,
    COVERAGE_MODELS,
    COVERAGE_PLANS,
    COVERAGE_SEQ,
    LOSSES,
    cell_status,
    coverage_cell,
)
from nest_fx.testing_coverage import offered_plans

pytestmark = pytest.mark.hf
pytest.importorskip("transformers")
LAUNCH_S = 240


def _traced(name: str):
    model, cfg = build_seeded(name)
    example = model_example(name, model, cfg, batch=COVERAGE_BATCH, seq=COVERAGE_SEQ)
    if len(example.inputs) == 1:
        example = with_loss_fn(example)
    inputs, _ = make_batch(example, "cpu", torch.Generator().manual_seed(0))
    args, kwargs = call_args(example, inputs)
    return model, example, trace(model, args, kwargs, name=name)


@pytest.mark.slow
def test_the_planner_offers_every_coverage_model_only_what_the_runtime_runs():
    """Each model of the suite, traced with the inputs it trains on, planned by the runtime planner
    on a cpu-gloo cluster of 4, its free choice and its plan for every TP x PP pair it may choose
    (``testing_coverage.offered_plans``): the runtime's checks accept every plan; MoE models get
    expert parallelism in their search space (HF stacked experts are converted)."""
    refused = {}
    for name, kind in COVERAGE_MODELS.items():
        model, example, graph = _traced(name)
        loss_fn = LOSSES.get(example.loss)
        for label, plan in offered_plans(model, graph, 4, COVERAGE_BATCH, loss_fn).items():
            try:
                checks.run_all(plan, model, graph, 4, COVERAGE_BATCH, model_loss=example.loss == "model")
            except checks.ApplyError as exc:
                refused[f"{name} {label}"] = str(exc)
        if kind == "moe":
            experts = parallel_support(model, graph).num_experts()
            assert experts == 4, name
            assert runtime_options(model, graph, SolverOptions()).ep_degrees == (1, 2, 4), name
    assert not refused, refused


def _cell(model: str, plan: str):
    spec = {
        "model": model,
        "plan": dict(COVERAGE_PLANS[plan]),
        "batch": COVERAGE_BATCH,
        "seq": COVERAGE_SEQ,
        "steps": 3,
        "lr": 0.5,
    }
    results = launch(coverage_cell, 4, spec, timeout=LAUNCH_S)
    cell = cell_status(results)
    print(f"\n{model} {plan}: {cell}")
    return cell, results


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
@pytest.mark.parametrize(
    "model,plan",
    [
        ("hf:t5", "planner"),  # two inputs + labels, the model's own loss
        ("hf:qwen2_moe", "EP2xDP2"),  # HF stacked experts beside a shared expert
        ("cnn", "planner"),  # BatchNorm statistics over the data-parallel batch
        ("hf:deberta-v2", "TP2xDP2"),  # the head count lives on a submodule of the attention region
        ("hf:mixtral", "PP2xDP2"),  # stand-ins of grouped_mm experts on the meta device
        ("hf:convnext", "PP2xDP2"),  # a channels-last gradient sent back between stages
    ],
)
def test_coverage_cells_match_one_device(model, plan):
    cell, results = _cell(model, plan)
    assert cell["status"] == "ok", cell
    assert all(r["num_grads"] > 0 for r in results)
    if model == "cnn":
        assert cell["buffer_diff"] < 1e-5  # running statistics too
