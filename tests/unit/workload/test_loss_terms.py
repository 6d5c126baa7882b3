"""The loss on full logits as priced (nest_fx/workload/loss_terms.py; plan.loss_kernel) against what
autograd keeps when the runtime runs it: eager ``lm_loss`` and its torch.compile'd form (inductor,
as ``nest_fx.apply.compile.compiled_loss`` builds it), and the tail's cost in a workload."""

from __future__ import annotations

from typing import Dict

import pytest
import torch

from nest_fx.apply.compile import compiled_loss
from nest_fx.apply.losses import lm_loss
from nest_fx.cluster import load_cluster
from nest_fx.workload import workload_for_model
from nest_fx.workload.block_facts import LOSS_BACKWARD_COPIES, LOSS_STATE_BYTES
from nest_fx.workload.loss_terms import ROW_STATISTICS_BYTES, loss_terms
from nest_fx.workload.types import Variant

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
    assert work.for_runtime(loss_kernel="eager") is work
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
    # loss parallel: the vocabulary-parallel loss runs as it is, compiled or not
    lp = Variant(tp=2, microbatch_size=2, loss_parallel=True)
    assert compiled.cost(tail, lp).bwd_scratch == work.cost(tail, lp).bwd_scratch
