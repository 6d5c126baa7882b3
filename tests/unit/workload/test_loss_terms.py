"""The loss on full logits as priced (nest_fx/workload/loss_terms.py; plan.loss_kernel) against what
autograd keeps when the runtime runs it: eager ``lm_loss`` and its torch.compile'd form (inductor,
as ``nest_fx.apply.compile.compiled_loss`` builds it), and the tail's cost in a workload."""

from __future__ import annotations

from typing import Dict

import pytest
import torch

from nest_fx.apply.compile import compiled_loss
from nest_fx.apply.loss_parallel import vocab_parallel_cross_entropy
from nest_fx.apply.losses import lm_loss
from nest_fx.cluster import load_cluster
from nest_fx.workload import workload_for_model
from nest_fx.workload.block_facts import LOSS_BACKWARD_COPIES, LOSS_STATE_BYTES
from nest_fx.workload.loss_terms import ROW_STATISTICS_BYTES, loss_terms
from nest_fx.workload.types import Variant

from allocation_counting import FreshBytes

ROWS, VOCAB = 64, 1000
MODEL = "llama:hidden=64,layers=2,heads=4,seq=32,vocab=1024"


def _kept_by_loss(fn, logits: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes of every storage autograd keeps for ``fn``'s backward, each counted once, less the
    targets and 0-dim scalars (the mean's divisor: kept by both forms, priced by neither)."""
    storages: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim():
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(logits, targets)
    storages.pop(targets.untyped_storage().data_ptr(), None)
    del loss
    return sum(storages.values())


def _facts(width: int):
    """A tail's loss facts as ``block_facts._loss_facts`` gives them for ROWS x VOCAB logits of ``width`` bytes."""
    numel = ROWS * VOCAB

    class Facts:
        loss_saved = numel * LOSS_STATE_BYTES
        loss_flops = 5.0 * numel
        loss_bytes_moved = numel * width + 2 * numel * LOSS_STATE_BYTES
        loss_tokens = ROWS

    return Facts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_priced_kept_bytes_are_what_autograd_keeps(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, ROWS, VOCAB, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (1, ROWS), generator=gen)
    facts = _facts(logits.element_size())
    eager = loss_terms(facts, 1.0, compiled=False)
    compiled = loss_terms(facts, 1.0, compiled=True)
    assert _kept_by_loss(lm_loss, logits, targets) == eager.kept == ROWS * VOCAB * LOSS_STATE_BYTES
    measured = _kept_by_loss(compiled_loss(lm_loss, "inductor"), logits, targets)
    assert measured == compiled.kept == ROWS * (VOCAB * logits.element_size() + ROW_STATISTICS_BYTES)


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "op-by-op"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_priced_vocab_parallel_loss_is_what_it_keeps_and_allocates_in_backward(dtype, in_place):
    """Loss parallelism's loss (one vocabulary shard: all of it here): the fp32 softmax kept; in
    backward only the gradient's cast to the logits' dtype (none for fp32) when in place, two fp32
    gradients op by op (``loss_kernel=eager``), as priced."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, VOCAB, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    priced = loss_terms(_facts(logits.element_size()), 1.0, compiled=False, in_place=in_place)

    def loss_fn(x, y):
        return vocab_parallel_cross_entropy(x, y, 0, group=None, in_place=in_place)

    per_row = 8 + 1 + 1  # the shard-local targets (int64), which rows the shard holds, which count (bool)
    assert _kept_by_loss(loss_fn, logits, targets) - per_row * ROWS == priced.kept == ROWS * VOCAB * 4
    loss = loss_fn(logits, targets)
    with FreshBytes() as backward:
        loss.backward()
    cast = ROWS * VOCAB * 2 if dtype == torch.bfloat16 else 0  # the gradient back in the logits' dtype
    slack = 16 * 8 * ROWS  # vectors of one entry per token
    if in_place:
        assert priced.backward_scratch == cast
        assert cast <= backward.bytes <= cast + slack
    else:  # the two fp32 gradients are held at once; the cast comes after the first is freed
        assert priced.backward_scratch == LOSS_BACKWARD_COPIES * priced.kept
        assert priced.backward_scratch + cast <= backward.bytes <= priced.backward_scratch + cast + slack


def test_compiled_loss_gradient_and_value_equal_the_eager_loss():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2, 16, VOCAB, generator=gen)
    targets = torch.randint(0, VOCAB, (2, 16), generator=gen)
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    want, got = lm_loss(a, targets), compiled_loss(lm_loss, "inductor")(b, targets)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(b.grad, a.grad)


def test_the_backward_holds_the_logits_gradient_only_when_compiled():
    facts = _facts(2)
    eager, compiled = loss_terms(facts, 0.5, compiled=False), loss_terms(facts, 0.5, compiled=True)
    assert eager.backward_scratch == 0.5 * LOSS_BACKWARD_COPIES * ROWS * VOCAB * LOSS_STATE_BYTES
    assert compiled.backward_scratch == 0.5 * ROWS * VOCAB * 2
    assert compiled.flops == eager.flops
    # the run's dtype twice as wide as the trace's: the logits it keeps twice as many bytes
    assert loss_terms(facts, 1.0, compiled=True, byte_scale=2.0).backward_scratch == 2 * ROWS * VOCAB * 2


def test_a_workload_prices_its_tail_with_the_plans_loss_kernel():
    work = workload_for_model(MODEL, load_cluster("dgx-h100:8"))
    compiled = work.for_runtime(loss_kernel="compile")
    assert compiled is not work and compiled.loss_kernel == "compile"
    eager = work.for_runtime(loss_kernel="eager")  # the default without loss parallelism
    tail = len(work) - 1
    variant = Variant(microbatch_size=2)
    plain, fused = work.cost(tail, variant), compiled.cost(tail, variant)
    logits = 2 * 32 * 1024  # microbatch x sequence x vocabulary
    width = work.dims.dtype_bytes
    assert plain.act_bytes["none"] - fused.act_bytes["none"] == pytest.approx(
        logits * (LOSS_STATE_BYTES - width) - 2 * 32 * ROW_STATISTICS_BYTES
    )
    assert plain.bwd_scratch == logits * LOSS_BACKWARD_COPIES * LOSS_STATE_BYTES
    assert fused.bwd_scratch == logits * width
    block = 1
    assert compiled.cost(block, variant) == work.cost(block, variant)  # only the tail changes
    assert eager.cost(tail, variant) == plain
    # loss parallel: the vocabulary-parallel loss, compiled or not; in place unless eager
    lp = Variant(tp=2, microbatch_size=2, loss_parallel=True)
    assert compiled.cost(tail, lp).bwd_scratch == work.cost(tail, lp).bwd_scratch
    assert work.cost(tail, lp).bwd_scratch == (logits / 2 * width if width < LOSS_STATE_BYTES else 0)
    assert eager.cost(tail, lp).bwd_scratch == logits / 2 * LOSS_BACKWARD_COPIES * LOSS_STATE_BYTES
