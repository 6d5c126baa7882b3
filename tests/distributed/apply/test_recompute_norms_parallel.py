"""The runtime's default fused RMSNorms (plan.norm_kernel ''; nest_fx/apply/fused_norms.py) inside
blocks under the recompute policies, forced plans on 2 gloo ranks, fp32, 3 SGD steps: losses,
gradients and parameters equal the single-device run of the model as written to fp32 tolerance.
Off CUDA ``F.rms_norm`` decomposes into ops some of which are in place, and selective activation
checkpointing refused them in backward ("Tensor cached during selective activation checkpoint has
been mutated"); the swapped norms now run its formula out of place there. Each rank's count of
swapped norm calls shows the recompute re-ran the blocks' norms in backward. CI cell: DP with
``recompute=selective``; the others (`-m slow`): op-level policies, a 2-stage pipeline, TP with
and without sequence parallelism (whose block norms keep the model's code: DTensor inputs).

The same Llama with ``torch.nn.RMSNorm`` norms (not swapped: ``F.rms_norm`` itself): the
checkpointed blocks run ``F.rms_norm`` out of place off CUDA (``fused_norms.OutOfPlaceRMSNorms``,
counted; the final norm, outside the blocks, is ``F.rms_norm``). CI cell:
DP; `-m slow`: TP + SP, whose norms are DTensors."""

from __future__ import annotations

import pytest

from norm_helpers import HF_LLAMA, LLAMA, build_torch_norm_llama, check_fused_calls, fused_counted
from parity_helpers import run

pytestmark = pytest.mark.dist
STEPS = 3
# the zoo llama (2 blocks x 2 norms + the final norm): per step 5 norms forward, the blocks' 4 again
# in the recompute; None: some (a pipeline stage's share)
RECOMPUTED = (5 + 4) * STEPS
ONE = {"microbatch_size": 4}  # the rank's whole share of the batch of 8 under dp=2
WHOLE = {"microbatch_size": 8}


@pytest.mark.parametrize(
    "plan, calls",
    [
        ({"dp": 2, "recompute": "selective", **ONE}, RECOMPUTED),
        pytest.param({"dp": 2, "recompute": "op", **ONE}, RECOMPUTED, marks=pytest.mark.slow),
        pytest.param({"dp": 2, "recompute": "op:matmuls", **ONE}, RECOMPUTED, marks=pytest.mark.slow),
        pytest.param(
            {"pp": 2, "num_microbatches": 2, "microbatch_size": 4, "recompute": "selective"},
            None,
            marks=pytest.mark.slow,
        ),
        pytest.param({"tp": 2, "recompute": "selective", **WHOLE}, RECOMPUTED, marks=pytest.mark.slow),
        pytest.param(  # the tail's norm only (outside the blocks: not recomputed)
            {"tp": 2, "sequence_parallel": True, "recompute": "selective", **WHOLE}, 1 * STEPS, marks=pytest.mark.slow
        ),
    ],
    ids=str,
)
def test_fused_norms_under_recompute_keep_parity(plan, calls):
    check_fused_calls(run(2, LLAMA, plan, fn=fused_counted), calls)


@pytest.mark.slow
def test_hf_llama_norms_under_selective_recompute_keep_parity():
    """HF's LlamaRMSNorm (swapped like the zoo's): 2 blocks x 2 norms + the final norm."""
    check_fused_calls(run(2, HF_LLAMA, {"dp": 2, "recompute": "selective", **ONE}, fn=fused_counted), RECOMPUTED)


@pytest.mark.parametrize(
    "plan",
    [
        {"dp": 2, "recompute": "selective", **ONE},
        pytest.param({"tp": 2, "sequence_parallel": True, "recompute": "selective", **WHOLE}, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_torch_rms_norms_under_selective_recompute_keep_parity(plan):
    results = run(2, "llama with torch.nn.RMSNorm", plan, fn=fused_counted, build=build_torch_norm_llama)
    # out of place: the blocks' 4 norms per step, again in the recompute (the single-device reference
    # and the final norm run F.rms_norm)
    assert [r["out_of_place_calls"] for r in results] == [(4 + 4) * STEPS] * 2
