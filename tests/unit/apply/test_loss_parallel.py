"""Loss parallel, torch.compile and Float8 in one process: the vocabulary-parallel cross-entropy
against ``F.cross_entropy``, and the refusals before training. Multi-rank parity runs are in
``tests/distributed/apply/test_runtime_features.py``."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nest_fx.apply import ApplyError, checks
from nest_fx.apply import compile as compile_mod
from nest_fx.apply.compile import compile_blocks, compile_problem
from nest_fx.apply.float8 import apply_float8, float8_linear_filter, float8_problem
from nest_fx.apply.loss_parallel import (
    VocabParallelLMLoss,
    combine_statistics,
    shard_statistics,
    vocab_parallel_cross_entropy,
    vocab_shard_sizes,
)
from nest_fx.apply.losses import lm_loss, token_cross_entropy_problem
from nest_fx.graph import trace
from nest_fx.models import build_seeded
from nest_fx.cluster import load_cluster
from nest_fx.plan import uniform_plan
from nest_fx.plan.constraints import Constraints
from nest_fx.plan.support import parallel_support
from nest_fx.solver.runtime_planner import planner_for
from allocation_counting import FreshBytes


def _logits(n=24, vocab=127, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen) * 3
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[::5] = -100  # ignored tokens
    return logits, target


def test_vocab_shards_follow_dtensor_split():
    assert vocab_shard_sizes(127, 2) == [64, 63]
    assert vocab_shard_sizes(10, 4) == [3, 3, 3, 1]
    assert vocab_shard_sizes(5, 4) == [2, 2, 1, 0]


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_shard_statistics_combine_to_cross_entropy(tp):
    logits, target = _logits()
    sizes = vocab_shard_sizes(logits.size(-1), tp)
    stats, start = [], 0
    for size in sizes:
        stats.append(shard_statistics(logits[:, start : start + size], target, start))
        start += size
    per_token = combine_statistics(*(torch.stack(s) for s in zip(*stats)))
    valid = target != -100
    expected = F.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(per_token[valid], expected[valid], rtol=0, atol=1e-5)


def test_one_shard_equals_cross_entropy_in_value_and_gradient():
    logits, target = _logits()
    mine = logits.clone().requires_grad_()
    ref = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, target, 0, group=None)
    expected = F.cross_entropy(ref, target)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(mine.grad, ref.grad, rtol=0, atol=1e-7)


def test_the_loss_reuses_one_fp32_buffer_in_forward_and_backward():
    """bf16 logits [N, V]: forward allocates one fp32 copy (4 N bytes) plus per-token vectors, backward
    only the logits' bf16 gradient (2 N): the softmax buffer becomes the gradient. The loss and the
    gradient equal F.cross_entropy's on the upcast logits."""
    logits, target = _logits(n=64, vocab=1000)
    mine = logits.bfloat16().requires_grad_()
    ref = logits.bfloat16().float().requires_grad_()
    n = mine.numel()
    with FreshBytes() as fwd:
        loss = vocab_parallel_cross_entropy(mine, target, 0, group=None)
    with FreshBytes() as bwd:
        loss.backward()
    expected = F.cross_entropy(ref, target)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    assert mine.grad.dtype == torch.bfloat16
    # the fp32 gradients round to bf16 alike but where they straddle a rounding boundary: one bf16 ulp
    torch.testing.assert_close(mine.grad.float(), ref.grad.to(torch.bfloat16).float(), rtol=2**-7, atol=0)
    per_token = 16 * 8 * 64  # up to 16 int64 or fp32 vectors of one entry per token (64 tokens)
    assert 4 * n <= fwd.bytes <= 4 * n + per_token, fwd.bytes  # separate tensors per step: 16 N
    assert 2 * n <= bwd.bytes <= 2 * n + per_token, bwd.bytes  # two fp32 gradients before: 10 N


def test_fp32_logits_are_not_overwritten():
    logits, target = _logits()
    mine = logits.clone().requires_grad_()
    before = mine.detach().clone()
    vocab_parallel_cross_entropy(mine, target, 0, group=None).backward()
    assert torch.equal(mine.detach(), before)


def test_a_second_backward_through_the_loss_is_refused():
    """Its first backward overwrote the saved softmax: a second one would give a wrong gradient."""
    logits, target = _logits()
    loss = vocab_parallel_cross_entropy(logits.clone().requires_grad_(), target, 0, group=None)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran a second time.*loss_parallel=false"):
        loss.backward()


def test_lm_loss_wrapper_checks_the_shard_width():
    loss = VocabParallelLMLoss(group=None, tp=2, tp_rank=1, vocab=127)
    assert (loss.start, loss.width) == (64, 63)
    with pytest.raises(ValueError, match="expected this rank's shard of 63 of 127"):
        loss(torch.randn(1, 4, 127), torch.zeros(1, 4, dtype=torch.long))


def _traced(spec):
    model, cfg = build_seeded(spec)
    return model, trace(model, (torch.randint(0, cfg.vocab_size, (2, 16)),))


def test_loss_parallel_takes_any_token_cross_entropy_and_refuses_other_losses_saying_how():
    model, graph = _traced("llama:hidden=32,layers=2,heads=2,seq=16,vocab=64")
    plan = uniform_plan(4, tp=2, loss_parallel=True)
    checks.check_loss_parallel(plan, model, graph, lm_loss)
    readme_loss = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())  # the README's
    checks.check_loss_parallel(plan, model, graph, readme_loss)
    assert token_cross_entropy_problem(readme_loss, 64) == ""
    summed = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    smoothed = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten(), label_smoothing=0.1)
    for loss in (summed, smoothed):
        with pytest.raises(
            ApplyError,
            match=r"loss_parallel: .* but loss_fn .* is not the token-mean cross-entropy"
            r".*constraints=\{'fix': \{'loss_parallel': False\}\}",
        ):
            checks.check_loss_parallel(plan, model, graph, loss)
    wrong_grad = lambda logits, y: lm_loss(logits.detach(), y) + 0 * logits.sum()
    assert "another gradient" in token_cross_entropy_problem(wrong_grad, 64)
    assert "failed on a probe" in token_cross_entropy_problem(lambda logits, y: logits.view(-1, 65), 64)
    model, graph = _traced("gpt:hidden=32,layers=2,heads=2,seq=16,vocab=64,tie_embeddings=1")
    assert "lm_head shares its weight with the embedding" in parallel_support(model, graph).loss_parallel_problem(2)
    assert parallel_support(model, graph).loss_parallel_problem(1) == ""


def test_the_default_planner_keeps_loss_parallel_for_the_loss_it_can_compute():
    """auto_parallelize's planner (``planner_for``) may choose loss parallelism when the loss is the
    token cross-entropy, and never when it is not (``loss_parallel=False``)."""
    model, graph = _traced("llama:hidden=32,layers=2,heads=2,seq=16,vocab=64")
    cluster = load_cluster("cpu-gloo:2")
    tp2 = Constraints(fix={"tp": 2})
    assert planner_for(model, constraints=tp2)(graph, cluster, 2, 4).loss_parallel
    assert not planner_for(model, constraints=tp2, loss_parallel=False)(graph, cluster, 2, 4).loss_parallel


# -- torch.compile ---------------------------------------------------------------------------------


def test_compile_names_a_missing_compiler(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv(compile_mod.BACKEND_ENV, raising=False)
    assert "needs a C++ compiler" in compile_problem("cpu") and "compile=false" in compile_problem("cpu")
    monkeypatch.setenv(compile_mod.BACKEND_ENV, "aot_eager")  # generates no code: needs no compiler
    assert compile_problem("cpu") == ""
    # compile runs with TP (tests/distributed/apply/test_compile_parallel.py)
    checks.check_supported(uniform_plan(4, tp=2, compile=True))


@pytest.mark.slow
def test_inductor_compiled_blocks_train_like_eager():
    """The runtime's default backend on CPU (inductor, C++ code generation): one small block."""
    if compile_problem("cpu"):
        pytest.skip(compile_problem("cpu"))  # no C++ compiler on this machine: the refusal is tested above
    model, cfg = build_seeded("llama:hidden=32,layers=1,heads=2,seq=16,vocab=64")
    ref = copy.deepcopy(model)
    assert compile_blocks(model, ["layers.0"], backend="inductor") == 1
    tokens, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    for m in (model, ref):
        lm_loss(m(tokens), targets).backward()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


# -- Float8 ------------------------------------------------------------------------------------------


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def test_float8_is_refused_on_cpu_naming_what_is_missing():
    problem = float8_problem("cpu")
    assert "no CUDA device" in problem and "float8=false" in problem
    with pytest.raises(ApplyError, match="no CUDA device"):
        model, graph = _traced("llama:hidden=32,layers=2,heads=2,seq=16,vocab=64")
        checks.check_runtime_options(uniform_plan(4, float8=True), model, graph, lm_loss, "cpu")


def test_float8_converts_block_linears_with_aligned_sizes():
    assert float8_linear_filter(nn.Linear(32, 64), "mlp.up")
    assert not float8_linear_filter(nn.Linear(32, 40), "mlp.up")
    assert not float8_linear_filter(nn.LayerNorm(32), "norm")


@pytest.mark.skipif(not _has_fp8_gpu(), reason="needs a CUDA GPU with fp8 tensor cores (compute capability >= 8.9)")
def test_float8_training_step_on_gpu():
    pytest.importorskip("torchao")
    model, cfg = build_seeded("llama:hidden=64,layers=2,heads=4,seq=32,vocab=128")
    model = model.cuda().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    converted = apply_float8(model, ["layers.0", "layers.1"])
    assert "layers.0.mlp.up" in converted and all(
        type(model.get_submodule(p)).__name__ == "Float8Linear" for p in converted
    )
    tokens = torch.randint(0, 128, (4, 32), device="cuda")
    targets = torch.randint(0, 128, (4, 32), device="cuda")
    loss, expected = lm_loss(model(tokens), targets), lm_loss(ref(tokens), targets)
    loss.backward()
    assert abs(float(loss) - float(expected)) < 0.05 * float(expected)
    assert all(p.grad is not None for p in model.parameters())
