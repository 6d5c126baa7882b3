"""plan.norm_kernel=memory-efficient (nest_fx/apply/output_saving_norm.py, the swap in
nest_fx/apply/fused_norms.py): the RMSNorm that keeps its output, its fp32 rstd and its weight for
backward computes F.rms_norm's output bitwise and its gradients to fp32 rounding (bf16: within a
bound from the rounding of its output); it saves no copy of its input, so a Llama forward keeps
exactly the norms' input bytes less than under F.rms_norm; a norm whose weight has zero entries is
refused; swapped models train with the model's own loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

from nest_fx.apply import auto_parallelize, prepare
from nest_fx.apply.activation_checkpoint import apply_checkpointing
from nest_fx.apply.fused_norms import check_norm_weights, use_fused_norms
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.precision import prepare_reference
from nest_fx.apply.output_saving_norm import OutputSavingRMSNorm, ZeroNormWeightError, output_saving_rms_norm
from nest_fx.common.errors import NestFxError
from nest_fx.models import build_model, build_seeded
from nest_fx.models.layers import RMSNorm
from nest_fx.plan import uniform_plan
from norm_helpers import HF_LLAMA, LLAMA, NormCalls, loss_and_grads, saved_bytes

ME = "memory-efficient"
SHAPES = [(6, 64), (2, 32, 64), (3, 5, 1024)]
U = 2.0**-8  # bf16's unit roundoff (8 significand bits, round to nearest)


def _inputs(shape, dtype, seed=0, weight=True):
    gen = torch.Generator().manual_seed(seed)
    d = shape[-1]
    rows = torch.rand(shape[:-1] + (1,), generator=gen) * 3 + 0.01  # rows at different scales
    x = (torch.randn(shape, generator=gen) * rows).to(dtype).requires_grad_()
    w = (torch.rand(d, generator=gen) + 0.5).to(dtype).requires_grad_() if weight else None
    dy = torch.randn(shape, generator=gen).to(dtype)
    return x, w, dy


def _grads(fn, x, w, dy, eps):
    y = fn(x, (x.shape[-1],), w, eps)
    wanted = (x,) if w is None else (x, w)
    return y, torch.autograd.grad(y, wanted, dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("eps", [1e-6, None], ids=str)
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no-weight"])
def test_forward_is_f_rms_norm_bitwise(dtype, shape, eps, weight):
    x, w, _ = _inputs(shape, dtype, weight=weight)
    y = output_saving_rms_norm(x, (shape[-1],), w, eps)
    want = F.rms_norm(x, (shape[-1],), w, eps)
    assert y.dtype == want.dtype and torch.equal(y, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no-weight"])
def test_fp32_gradients_are_f_rms_norms(dtype, shape, weight):
    x, w, dy = _inputs(shape, dtype, weight=weight)
    _, got = _grads(output_saving_rms_norm, x, w, dy, 1e-6)
    _, want = _grads(F.rms_norm, x, w, dy, 1e-6)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r)  # the dtype's default tolerances


def _exact(x, w, dy, eps):
    """The gradients in fp64 from the same (bf16) inputs, and the terms of the bound."""
    x, dy = x.double(), dy.double()
    w = torch.ones(x.shape[-1], dtype=torch.float64) if w is None else w.double()
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    xh, g = x * r, dy * w
    c = (g * xh).mean(-1, keepdim=True)
    m = (g * xh).abs().mean(-1, keepdim=True)
    dx = r * (g - xh * c)
    dw = (dy * xh).reshape(-1, x.shape[-1]).sum(0)
    return dx, dw, r, xh, g, m, (dy * xh).abs().reshape(-1, x.shape[-1]).sum(0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no-weight"])
def test_bf16_gradients_within_the_rounding_of_the_output(shape, weight):
    """In bf16 the backward reads ``y = bf16(xhat * w)``, so ``xhat' = y / w = xhat (1 + d)`` with
    ``|d| <= u = 2^-8`` (one rounding to nearest with 8 significand bits), and
    ``c' = mean(dy * y)`` is off from ``c = mean(g * xhat)`` by at most ``u m`` with
    ``m = mean|g * xhat|``. So ``dx' - dx = -rstd (xhat' c' - xhat c)`` is at most
    ``rstd |xhat| m (2u + u^2)``; fp32 accumulation over the row (``s = (d + 4) 2^-24`` relative,
    recursive-sum worst case, in rstd, c and the products) adds ``rstd (2 s |g| + 8 s |xhat| m)``;
    the final cast to bf16 adds ``u |dx|`` and scales the rest by ``1 + u``. Likewise
    ``|dw' - dw| <= u |dw| + (1 + u) (u + 4 s) sum_rows |dy * xhat|``. Checked against the fp64
    gradients of the same bf16 inputs; the largest difference to F.rms_norm's own bf16 gradients
    is printed (F.rms_norm's CPU backward has rounding of its own)."""
    x, w, dy = _inputs(shape, torch.bfloat16, seed=1, weight=weight)
    eps = 1e-6
    _, got = _grads(output_saving_rms_norm, x, w, dy, eps)
    _, ref = _grads(F.rms_norm, x, w, dy, eps)
    dx, dw, r, xh, g, m, dw_abs = _exact(x.detach(), None if w is None else w.detach(), dy, eps)
    s = (shape[-1] + 4) * 2.0**-24
    dx_bound = U * dx.abs() + (1 + U) * r * (2 * s * g.abs() + xh.abs() * m * (2 * U + U * U + 8 * s))
    dx_err = (got[0].double() - dx).abs()
    assert bool((dx_err <= dx_bound).all()), float((dx_err / dx_bound).max())
    if w is not None:
        dw_err = (got[1].double() - dw).abs()
        dw_bound = U * dw.abs() + (1 + U) * (U + 4 * s) * dw_abs
        assert bool((dw_err <= dw_bound).all()), float((dw_err / dw_bound).max())
    for name, a, b in zip(("dx", "dw"), got, ref):
        rel = float((a.float() - b.float()).abs().max() / b.float().abs().max())
        print(f"\nbf16 {shape} {name}: max |memory-efficient - F.rms_norm| / max |F.rms_norm| = {rel:.2e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no-weight"])
def test_saves_its_output_rstd_and_weight_only(dtype, weight):
    x, w, _ = _inputs((2, 32, 64), dtype, weight=weight)
    saved = []
    with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = output_saving_rms_norm(x, (64,), w, 1e-6)
    assert y.grad_fn.name() == "OutputSavingRMSNormBackward"
    ptrs = {t.untyped_storage().data_ptr() for t in saved}
    assert x.untyped_storage().data_ptr() not in ptrs
    want = {y.untyped_storage().data_ptr()} | ({w.untyped_storage().data_ptr()} if weight else set())
    rstd = [t for t in saved if t.untyped_storage().data_ptr() not in want]
    assert len(rstd) == 1 and rstd[0].dtype == torch.float32 and tuple(rstd[0].shape) == (2, 32, 1)
    assert want <= ptrs and len(saved) == len(want) + 1


def test_only_the_last_dimension():
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="last dimension only"):
        output_saving_rms_norm(x, (4, 8), torch.ones(4, 8))


class _InputSaving(torch.autograd.Function):
    """What ``F.rms_norm`` keeps on CUDA (``aten._fused_rms_norm``, torch's derivatives.yaml:
    ``input``, ``weight``, ``result1`` = the fp32 rstd); on CPU F.rms_norm decomposes into ops
    keeping fp32 copies, so the fused swap is measured with this stand-in."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        raise NotImplementedError("forward only: the bytes it saves")


class _OutputOnly(_InputSaving):
    """A norm that would keep nothing beyond its output (kept anyway by the projections) and weight."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y = F.rms_norm(x, (x.shape[-1],), weight, eps)
        ctx.save_for_backward(y, weight)
        return y


def _swapped(model, fn=None):
    """``model`` with its norms swapped for memory-efficient (fn None), or to ``fn``'s Function."""
    swapped = copy.deepcopy(model)
    names = use_fused_norms(swapped, ME)
    for name in names if fn is not None else ():
        swapped.get_submodule(name)._nest_fx_norm_fn = lambda x, shape, w, eps: fn.apply(x, w, eps)
    return swapped, names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", [LLAMA, HF_LLAMA])
def test_a_llama_forward_keeps_the_norms_input_bytes_less(name, dtype):
    """Pre-norm Llama: each norm's output is saved by the q/k/v, gate/up or LM-head linear reading
    it, its input by no one else. So the forward under memory-efficient keeps exactly the norms'
    inputs (tokens x hidden x dtype bytes each) less than under F.rms_norm as CUDA runs it (input,
    weight, rstd), and its norms add exactly their fp32 rstd (4 bytes per token) to what is saved
    anyway."""
    model, _ = build_seeded(name)
    model = model.to(dtype)
    batch, seq = 2, 32
    tokens = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0))
    memory_efficient, names = _swapped(model)
    fused, _ = _swapped(model, _InputSaving)
    output_only, _ = _swapped(model, _OutputOnly)
    hidden, tokens_n = model.get_submodule(names[0]).weight.shape[0], batch * seq
    inputs = len(names) * tokens_n * hidden * dtype.itemsize
    rstds = len(names) * tokens_n * 4
    got = {k: saved_bytes(m, tokens) for k, m in [("me", memory_efficient), ("fused", fused), ("out", output_only)]}
    saving = got["fused"] - got["me"]
    message = (
        f"{name} {dtype}: {len(names)} norms x {tokens_n} tokens x {hidden} hidden x {dtype.itemsize} B = "
        f"{inputs} B of norm inputs; measured fused {got['fused']} - memory-efficient {got['me']} = {saving} B "
        f"({saving / (tokens_n * hidden * len(names)):.2f} B per token per hidden unit per norm); the norms' "
        f"rstd {rstds} B ({len(names)} x {tokens_n} x 4), measured {got['me'] - got['out']} B"
    )
    print("\n" + message)
    assert len(names) == 5 and saving == inputs, message
    assert got["me"] - got["out"] == rstds, message


@pytest.mark.parametrize("name", [LLAMA, HF_LLAMA])
def test_swapped_model_trains_with_the_models_loss_and_gradients(name):
    model, _ = build_seeded(name)
    swapped, names = _swapped(model)
    assert len(names) == 5 and use_fused_norms(swapped, ME) == []  # swapped once
    assert list(swapped.state_dict()) == list(model.state_dict())
    assert [n for n, _ in swapped.named_parameters()] == [n for n, _ in model.named_parameters()]
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    loss, grads = loss_and_grads(model, tokens)
    calls = NormCalls()
    with calls:
        got_loss, got_grads = loss_and_grads(swapped, tokens)
    assert calls.output_saving == 5 and calls.rms_norm == 0
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=1e-6)
    for n, g in grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recompute", ["full", "selective", "op"])
def test_recomputed_blocks_give_the_same_numbers(recompute):
    """Activation checkpointing re-runs the swapped norms: the same loss and gradients, bitwise.
    (Selective checkpointing refuses ops that mutate a tensor it cached: the norm's forward runs
    out of place off CUDA, where ``_fused_rms_norm`` decomposes into in-place ops.)"""
    model, _ = build_seeded(LLAMA)
    swapped, _ = _swapped(model)
    checkpointed = copy.deepcopy(swapped)
    assert apply_checkpointing(checkpointed, ["layers.0", "layers.1"], recompute) == 2
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    loss, grads = loss_and_grads(swapped, tokens)
    calls = NormCalls()
    with calls:
        got_loss, got_grads = loss_and_grads(checkpointed, tokens)
    assert calls.output_saving == 5 + 4  # the blocks' 4 norms run again in backward
    assert torch.equal(got_loss, loss) and all(torch.equal(got_grads[n], g) for n, g in grads.items())


def test_bf16_mixed_casts_reach_the_swapped_norms():
    """Under bf16-mixed (the casts of apply/precision.py) a norm sees a bf16 input and a bf16 cast
    of its fp32 weight: the output-saving norm runs, and the loss equals F.rms_norm's bitwise (the
    same forward). The gradients differ from F.rms_norm's by the rounding of the norms' outputs,
    carried through the network (bounded per norm in
    test_bf16_gradients_within_the_rounding_of_the_output; printed here next to bf16-mixed's own
    distance from the fp32 run, for scale: over six batches each was 1 to 2 bf16 ulps of the
    gradients, one above the other either way)."""
    model, _ = build_seeded(LLAMA)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    runs = {"fp32": loss_and_grads(copy.deepcopy(model), tokens)}
    for kernel in ("fused", ME):
        m = copy.deepcopy(model)
        use_fused_norms(m, kernel)
        prepare_reference(m, ["layers.0", "layers.1"], "bf16-mixed")
        calls = NormCalls()
        with calls:
            runs[kernel] = loss_and_grads(m, tokens)
        assert calls.output_saving == (5 if kernel == ME else 0)
    assert torch.equal(runs[ME][0], runs["fused"][0])
    assert all(bool(torch.isfinite(g).all()) for g in runs[ME][1].values())

    def farthest(a, b):
        return max(float((a[1][n] - g).abs().max()) for n, g in b[1].items())

    print(
        f"\nbf16-mixed llama gradients: memory-efficient - fused {farthest(runs[ME], runs['fused']):.2e}, "
        f"fused - fp32 {farthest(runs['fused'], runs['fp32']):.2e}"
    )


def test_native_rms_norms_are_swapped_too():
    """torch.nn.RMSNorm (F.rms_norm already) keeps its output instead under memory-efficient;
    Gemma's ``1 + weight`` and LayerNorms keep their code; the fused swap leaves nn.RMSNorm alone."""
    torch.manual_seed(0)
    model = nn.Sequential(GemmaRMSNorm(16), nn.LayerNorm(16), RMSNorm(16), nn.RMSNorm(16, eps=1e-5), nn.Linear(16, 4))
    with torch.no_grad():
        model[3].weight.uniform_(0.5, 1.5)
    ref = copy.deepcopy(model)
    assert use_fused_norms(copy.deepcopy(model), "fused") == ["2"]
    assert use_fused_norms(model, ME) == ["2", "3"]
    assert "forward" not in model[0].__dict__ and "forward" not in model[1].__dict__
    x = torch.randn(3, 7, 16)
    calls = NormCalls()
    with calls:
        model(x).square().mean().backward()
    ref(x).square().mean().backward()
    assert calls.output_saving == 2
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_mixed_dtypes_and_extra_arguments_run_the_models_code():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(16)
    assert use_fused_norms(nn.Sequential(norm), ME) == ["0"]
    x = torch.randn(3, 16).bfloat16()
    calls = NormCalls()
    with calls:
        y = norm(x)  # HF: an fp32 weight times a bf16 input is fp32
    assert y.dtype == torch.float32 and calls.output_saving == 0
    with calls:
        norm.to(torch.bfloat16)(x)
    assert calls.output_saving == 1


def test_a_zero_weight_entry_is_refused_before_anything_is_swapped():
    model, _ = build_seeded(LLAMA)
    norm = [n for n, m in model.named_modules() if isinstance(m, RMSNorm)][1]
    with torch.no_grad():
        model.get_submodule(norm).weight[[3, 7]] = 0.0
    with pytest.raises(ZeroNormWeightError) as err:
        use_fused_norms(model, ME)
    text = str(err.value)
    assert isinstance(err.value, NestFxError) and "\n" not in text
    assert text.startswith(f"{norm}: norm_kernel=memory-efficient recovers the norm's input from its output")
    assert "zero entries (2 of 64)" in text and text.endswith("fix: norm_kernel '' (fused)")
    assert not any("_nest_fx_model_forward" in m.__dict__ for m in model.modules())
    with pytest.raises(ZeroNormWeightError, match=norm):
        check_norm_weights(model, ME)
    check_norm_weights(model, "fused")  # F.rms_norm keeps the input: a zero weight is no problem there
    assert len(use_fused_norms(model, "fused")) == 5
    on_meta, _ = build_model(LLAMA, device="meta")  # no values yet (weights= fills them later): not checked
    check_norm_weights(on_meta, ME)
    assert len(use_fused_norms(on_meta, ME)) == 5


def test_a_zero_weight_reached_in_training_gives_non_finite_gradients():
    """The documented limit: no check per call; a weight that becomes exactly 0 makes that norm's
    input and weight gradients NaN (0/0), not silently wrong numbers."""
    x, w, dy = _inputs((4, 8), torch.float32)
    with torch.no_grad():
        w[2] = 0.0
    dx, dw = torch.autograd.grad(OutputSavingRMSNorm.apply(x, w, 1e-6), (x, w), dy)
    assert not bool(torch.isfinite(dx).all()) and bool(torch.isnan(dw[2]))


def test_auto_parallelize_refuses_a_zero_weight_before_the_first_collective(single_rank, monkeypatch):
    """The check runs in ``prepare`` on the whole model, before the ranks' agreement (the first
    collective); the model is left as it was. Without the zero, one rank trains the swapped norms."""
    model, _ = build_seeded(LLAMA)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    plan = uniform_plan(4, norm_kernel=ME)
    with torch.no_grad():
        model.norm.weight[0] = 0.0

    def no_collective(*args, **kwargs):
        raise AssertionError("the first collective was reached")

    monkeypatch.setattr(prepare, "agree", no_collective)
    with pytest.raises(ZeroNormWeightError, match=r"^norm: norm_kernel=memory-efficient"):
        auto_parallelize(model, tokens, global_batch_size=2, loss_fn=lm_loss, plan=plan)
    assert not any("_nest_fx_model_forward" in m.__dict__ for m in model.modules())
    monkeypatch.undo()
    with torch.no_grad():
        model.norm.weight[0] = 1.0
    reference = copy.deepcopy(model)
    pm = auto_parallelize(model, tokens, global_batch_size=2, loss_fn=lm_loss, plan=plan)
    calls = NormCalls()
    with calls:
        loss = pm.train_step(tokens, tokens)
    assert calls.output_saving == 5 * pm.num_microbatches  # 2 blocks x 2 norms + the final norm
    torch.testing.assert_close(torch.as_tensor(float(loss)), lm_loss(reference(tokens), tokens).detach())
