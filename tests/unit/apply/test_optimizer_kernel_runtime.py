"""The plan's optimizer at run time (``nest_fx/apply/optimizers.py``): ``pm.build_optimizer`` builds
the implementation the plan's ``optimizer_kernel`` names, and an optimizer built otherwise is refused
before its first step, before the ranks' agreement (no collective)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import nest_fx.apply.runtime as runtime
from nest_fx.apply import auto_parallelize
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.optimizers import OptimizerError, build_optimizer, implementation
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan
from nest_fx.plan.constraints import Constraints

LLAMA = "llama:hidden=32,layers=2,heads=4,seq=16,vocab=64"


def _pm(**recorded):
    model, _ = build_seeded(LLAMA)
    x = torch.randint(0, 64, (2, 16))
    plan = uniform_plan(4, microbatch_size=2, num_microbatches=1)
    if recorded:
        plan = dataclasses.replace(plan, constraints=Constraints.from_dict(recorded))
    return auto_parallelize(model, x, global_batch_size=2, loss_fn=lm_loss, plan=plan, verbose=False), x


@pytest.fixture
def agreements(monkeypatch):
    """Every call of the ranks' agreement (the first collective of ``check_optimizer``)."""
    calls = []
    real = runtime.agree

    def recording(fields, **kwargs):
        calls.append(dict(fields))
        return real(fields, **kwargs)

    monkeypatch.setattr(runtime, "agree", recording)
    return calls


@pytest.mark.parametrize(
    "optimizer, kernel, cls",
    [
        ("adamw", "fused", torch.optim.AdamW),
        ("adamw", "foreach", torch.optim.AdamW),
        ("adam", "for-loop", torch.optim.Adam),
        ("sgd", "fused", torch.optim.SGD),
        ("adamw", "", torch.optim.AdamW),
    ],
)
def test_build_optimizer_runs_the_plans_implementation(single_rank, agreements, optimizer, kernel, cls):
    pm, x = _pm(optimizer=optimizer, **({"optimizer_kernel": kernel} if kernel else {}))
    opt = pm.build_optimizer(lr=1e-3)
    # '' is torch's default: the for-loop on CPU parameters (foreach where the runtime placed them on CUDA)
    default = "foreach" if next(pm.parameters()).is_cuda else "for-loop"
    assert type(opt) is cls and implementation(opt) == (kernel or default)
    before = [p.detach().clone() for p in pm.parameters()]
    pm.train_step(x, torch.randint(0, 64, (2, 16)))
    opt.step()
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, pm.parameters()))
    assert agreements and agreements[0]["optimizer implementation"] == (kernel or default)


def test_a_plan_without_constraints_builds_adam_as_torch_defaults_it(single_rank):
    pm, _ = _pm()
    opt = pm.build_optimizer()
    assert type(opt) is torch.optim.Adam and opt.param_groups[0]["foreach"] is None
    assert opt.param_groups[0]["fused"] is None


def test_an_optimizer_contradicting_the_plan_is_refused_before_any_collective(single_rank, agreements):
    pm, x = _pm(optimizer="adamw", optimizer_kernel="fused")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)
    pm.train_step(x, torch.randint(0, 64, (2, 16)))
    before = [p.detach().clone() for p in pm.parameters()]
    with pytest.raises(OptimizerError) as info:
        opt.step()
    message = str(info.value)
    assert "optimizer_kernel is 'fused'" in message and "runs foreach" in message
    assert "fused=True" in message and "--optimizer-kernel foreach" in message and "\n" not in message
    assert agreements == []  # refused before the agreement's all-gather
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, pm.parameters()))
    with pytest.raises(OptimizerError, match="runs for-loop"):
        pm.save("/nonexistent/never-written", torch.optim.AdamW(pm.parameters(), foreach=False))


class _NoOptions(torch.optim.Optimizer):
    """An optimizer without torch's foreach/fused options (named like one to read the message)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        return None


_NoOptions.__name__ = "Adagrad"


def test_an_optimizer_without_the_options_is_refused_under_an_explicit_setting(single_rank, agreements):
    pm, _ = _pm(optimizer_kernel="foreach")
    with pytest.raises(OptimizerError, match="Adagrad.*foreach.*pm.build_optimizer"):
        pm.check_optimizer(_NoOptions(pm.parameters()))
    assert agreements == []


def test_torchs_default_is_accepted_when_the_plan_names_none(single_rank, agreements):
    pm, _ = _pm(optimizer="adamw")
    for kernel in ({"foreach": True}, {"fused": True}, {}):
        pm.check_optimizer(torch.optim.AdamW(pm.parameters(), **kernel))
    default = "foreach" if next(pm.parameters()).is_cuda else "for-loop"
    assert [a["optimizer implementation"] for a in agreements] == ["foreach", "fused", default]


def test_build_optimizer_refuses_what_contradicts_the_plan():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(OptimizerError, match="plan's optimizer is sgd.*--optimizer sgd-momentum"):
        build_optimizer(params, "sgd", "", lr=0.1, momentum=0.9)
    with pytest.raises(OptimizerError, match="no momentum > 0"):
        build_optimizer(params, "sgd-momentum", "", lr=0.1)
    with pytest.raises(OptimizerError, match="optimizer_kernel .*chooses the implementation"):
        build_optimizer(params, "adamw", "fused", foreach=True)
    opt = build_optimizer(params, "sgd-momentum", "foreach", lr=0.1, momentum=0.9)
    assert opt.param_groups[0]["momentum"] == 0.9 and implementation(opt) == "foreach"


def test_a_group_without_parameters_does_not_change_what_the_optimizer_runs():
    """torch's default on an empty list says foreach on any device: a rank whose group is empty
    must resolve as the ranks whose group is not."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([{"params": [p]}, {"params": [], "weight_decay": 0.0}])
    assert implementation(opt) == "for-loop"  # CPU parameters: torch's for-loop
    assert implementation(torch.optim.AdamW([{"params": []}])) == ""


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch's default there is foreach; the CPU path: above)"
)
@pytest.mark.parametrize("kernel, expected", [("", "foreach"), ("fused", "fused")])
def test_on_cuda_the_plans_implementation_runs(single_rank, kernel, expected):
    model, _ = build_seeded(LLAMA)
    model = model.cuda()
    x = torch.randint(0, 64, (2, 16), device="cuda")
    recorded = {"optimizer": "adamw", **({"optimizer_kernel": kernel} if kernel else {})}
    plan = dataclasses.replace(
        uniform_plan(4, microbatch_size=2, num_microbatches=1), constraints=Constraints.from_dict(recorded)
    )
    pm = auto_parallelize(model, x, global_batch_size=2, loss_fn=lm_loss, plan=plan, verbose=False)
    opt = pm.build_optimizer(lr=1e-3)
    assert implementation(opt) == expected
    before = [p.detach().clone() for p in pm.parameters()]
    pm.train_step(x, torch.randint(0, 64, (2, 16), device="cuda"))
    opt.step()
    assert all(p.is_cuda for p in pm.parameters())
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, pm.parameters()))
