"""plan.loss_kernel=compile (nest_fx/apply/steps.compile_loss: the loss on full logits
torch.compile'd, inductor) on 2 gloo ranks, fp32, 3 SGD steps: losses, gradients and parameters
equal the single-device run of the eager loss within the harness's tolerance, and each rank ran a
compiled graph (the blocks are not compiled: every graph is the loss's). CI cell: DP 2; the
others (`-m slow`): a 2-stage pipeline (the loss on the last stage) and TP 2 without loss
parallelism (the logits gathered from a DTensor: the input the compiled loss must own)."""

from __future__ import annotations

import pytest
import torch

from nest_fx.testing import equivalence
from parity_helpers import LLAMA, run

pytestmark = pytest.mark.dist
COMPILED = {"loss_kernel": "compile"}


def _with_graphs(spec):
    """``equivalence(spec)`` with the number of graphs dynamo compiled on this rank."""
    torch._dynamo.reset()
    out = equivalence(spec)
    out["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return out


CELLS = [(LLAMA, {"dp": 2, "microbatch_size": 4, **COMPILED})]
SLOW_CELLS = [
    (LLAMA, {"pp": 2, "num_microbatches": 2, "microbatch_size": 4, **COMPILED}),
    (LLAMA, {"tp": 2, "microbatch_size": 8, "loss_parallel": False, **COMPILED}),
]


def _check(results, last_stage_only=False):
    ran = [r["graphs"] > 0 for r in results]
    assert any(ran) if last_stage_only else all(ran), [r["graphs"] for r in results]


@pytest.mark.parametrize("model, plan", CELLS, ids=lambda v: str(v))
def test_compiled_loss_keeps_parity(model, plan):
    _check(run(2, model, plan, fn=_with_graphs))


@pytest.mark.slow
@pytest.mark.parametrize("model, plan", SLOW_CELLS, ids=lambda v: str(v))
def test_compiled_loss_keeps_parity_slow(model, plan):
    _check(run(2, model, plan, fn=_with_graphs), last_stage_only="pp" in plan)
