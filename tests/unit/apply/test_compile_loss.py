"""plan.loss_kernel=compile in the runtime (nest_fx/apply/steps.compile_loss, apply/compile.compiled_loss,
apply/checks.check_runtime_options): which loss is compiled, and what is refused before training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nest_fx.apply import compile as compile_module
from nest_fx.apply.checks import ApplyError, check_runtime_options
from nest_fx.apply.loss_parallel import VocabParallelLMLoss
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.steps import compile_loss
from nest_fx.plan import uniform_plan


def _job(**fields):
    return SimpleNamespace(plan=uniform_plan(4, **fields))


def test_only_the_loss_on_full_logits_is_compiled(monkeypatch):
    compiled = []
    monkeypatch.setattr(compile_module, "_compiled", lambda fn, backend: compiled.append((fn, backend)) or fn)
    assert compile_loss(lm_loss, _job()) is lm_loss and not compiled  # loss_kernel '' = eager
    assert compile_loss(lm_loss, _job(loss_kernel="eager")) is lm_loss and not compiled
    assert compile_loss(None, _job(loss_kernel="compile")) is None  # the model's own loss: refused earlier
    vocab_parallel = VocabParallelLMLoss.__new__(VocabParallelLMLoss)
    assert compile_loss(vocab_parallel, _job(loss_kernel="compile")) is vocab_parallel and not compiled
    compile_loss(lm_loss, _job(loss_kernel="compile"))
    assert compiled == [(lm_loss, compile_module.compile_backend())]


def test_the_models_own_loss_is_refused_before_training():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ApplyError, match="loss_kernel=compile compiles loss_fn.*loss_fn=None.*fix"):
        check_runtime_options(uniform_plan(4, loss_kernel="compile"), model, None, None, "cpu")
    check_runtime_options(uniform_plan(4, loss_kernel="compile"), model, None, lm_loss, "cpu")


def test_a_missing_compiler_is_named_before_training(monkeypatch):
    monkeypatch.setattr("nest_fx.apply.checks.compile_problem", lambda device: "compile: no C++ compiler; fix: ...")
    with pytest.raises(ApplyError, match="no C\\+\\+ compiler"):
        check_runtime_options(uniform_plan(4, loss_kernel="compile"), torch.nn.Linear(4, 4), None, lm_loss, "cpu")
