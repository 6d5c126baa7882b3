"""plan.norm_kernel=memory-efficient (nest_fx/apply/output_saving_norm.py: RMSNorms that keep
their output, not their input, for backward) on 2 gloo ranks, fp32, 3 SGD steps: losses,
gradients and parameters equal the single-device run of the model as written (its own RMSNorm
code) to fp32 tolerance, and each rank ran the output-saving norm (counted per call). CI cells:
ZeRO-3 (FSDP2 gathers the norm weights the norm saves) and a 2-stage pipeline; the others
(`-m slow`): TP, TP + SP (the block norms, DTensors, keep the model's code: only the tail's norm
is swapped), the HF Llama under DP."""

from __future__ import annotations

import pytest

from nest_fx.testing import equivalence
from norm_helpers import NormCalls
from parity_helpers import HF_LLAMA, LLAMA, run

pytestmark = pytest.mark.dist
STEPS = 3
ME = {"norm_kernel": "memory-efficient"}


def _counted(spec):
    """``equivalence(spec)`` with the number of output-saving norm calls this rank made (the
    single-device reference runs the model's own code: it makes none)."""
    calls = NormCalls()
    with calls:
        out = equivalence(spec)
    out["output_saving_calls"] = calls.output_saving
    return out


# (model, plan, output-saving norm calls per rank in 3 steps, None: some): the zoo llama has
# 4 blocks (2 norms each) + the final norm, the HF llama 2 blocks + the final norm
CELLS = [
    (LLAMA, {"dp": 2, "zero": 3, "microbatch_size": 4, **ME}, 9 * STEPS),
    (LLAMA, {"pp": 2, "num_microbatches": 2, "microbatch_size": 4, **ME}, None),
]
SLOW_CELLS = [
    (LLAMA, {"tp": 2, "microbatch_size": 8, **ME}, 9 * STEPS),
    (LLAMA, {"tp": 2, "sequence_parallel": True, "microbatch_size": 8, **ME}, 1 * STEPS),  # the tail's norm only
    (HF_LLAMA, {"dp": 2, "microbatch_size": 4, **ME}, 5 * STEPS),
]


def _check(results, calls):
    for r in results:
        if calls is None:
            assert r["output_saving_calls"] > 0, r["output_saving_calls"]
        else:
            assert r["output_saving_calls"] == calls, r["output_saving_calls"]


@pytest.mark.parametrize("model, plan, calls", CELLS, ids=lambda v: str(v))
def test_memory_efficient_norms_keep_parity(model, plan, calls):
    _check(run(2, model, plan, fn=_counted), calls)


@pytest.mark.slow
@pytest.mark.parametrize("model, plan, calls", SLOW_CELLS, ids=lambda v: str(v))
def test_memory_efficient_norms_keep_parity_slow(model, plan, calls):
    _check(run(2, model, plan, fn=_counted), calls)
