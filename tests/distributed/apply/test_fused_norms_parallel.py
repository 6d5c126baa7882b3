"""The runtime's default F.rms_norm (plan.norm_kernel '' = fused; nest_fx/apply/fused_norms.py) under
DP, TP without SP and PP on 2 gloo ranks: losses, gradients and parameters equal the single-device
run of the model as written (its own RMSNorm code) to fp32 tolerance, and the parallel run did call
F.rms_norm. Under sequence parallelism the block norms (DTensor inputs) keep the model's code and
only the tail's norm (full sequences) is swapped; norm_kernel=model swaps none."""

from __future__ import annotations

import pytest

from nest_fx.apply.launch import launch
from nest_fx.testing_styles import style_spec
from norm_helpers import check_fused_calls as _check
from norm_helpers import fused_counted as _counted
from parity_helpers import HF_LLAMA, LAUNCH_S, LLAMA, TOL, run

pytestmark = pytest.mark.dist
STEPS = 3


def _style(world: int, name: str, plan: dict):
    """``run``'s assertions for a style model (testing_styles)."""
    results = launch(_counted, world, style_spec(name, plan), timeout=LAUNCH_S)
    worst = {k: max(r[k] for r in results) for k in ("loss_diff", "grad_diff", "param_diff")}
    print(f"\n{name} {plan}: " + ", ".join(f"{k}={v:.2e}" for k, v in worst.items()))
    assert all(v < TOL for v in worst.values()), worst
    return results


# (model, plan, F.rms_norm calls per rank in 3 steps of one microbatch each): zoo llama has 4 blocks
# (2 norms each) + the final norm, the HF llama 2 blocks + the final norm; None: some (a pipeline stage's share)
ONE = {"microbatch_size": 4}  # the rank's whole share of the batch of 8 under dp=2
WHOLE = {"microbatch_size": 8}
CELLS = [
    (LLAMA, {"dp": 2, **ONE}, 9 * STEPS),
    (LLAMA, {"tp": 2, **WHOLE}, 9 * STEPS),
    (LLAMA, {"pp": 2, "num_microbatches": 2, "microbatch_size": 4}, None),
    (LLAMA, {"tp": 2, "sequence_parallel": True, **WHOLE}, 1 * STEPS),  # the tail's norm only
    (LLAMA, {"dp": 2, "norm_kernel": "model", **ONE}, 0),
]
SLOW_CELLS = [
    (HF_LLAMA, {"dp": 2, **ONE}, 5 * STEPS),
    (HF_LLAMA, {"tp": 2, **WHOLE}, 5 * STEPS),
    (HF_LLAMA, {"pp": 2, "num_microbatches": 2, "microbatch_size": 4}, None),
]


@pytest.mark.parametrize("model, plan, calls", CELLS, ids=lambda v: str(v))
def test_fused_norms_keep_parity(model, plan, calls):
    _check(run(2, model, plan, fn=_counted), calls)


@pytest.mark.slow
@pytest.mark.parametrize("model, plan, calls", SLOW_CELLS, ids=lambda v: str(v))
def test_fused_norms_keep_parity_hf(model, plan, calls):
    _check(run(2, model, plan, fn=_counted), calls)


# DP swaps the whole model's norms as TP does (TP shards none of them without SP): TP, with the
# swapped norms beside complex RoPE and sharded heads, and PP (per-stage chunks) are the CI cells
@pytest.mark.parametrize(
    "plan", [pytest.param({"dp": 2}, marks=pytest.mark.slow), {"tp": 2}, {"pp": 2, "num_microbatches": 2}], ids=str
)
def test_meta_llama_style_norms_are_fused_with_parity(plan):
    """Meta's reference Llama (testing_styles): 2 blocks x 2 norms + the final norm."""
    for r in _style(2, "meta-llama", plan):
        assert r["rms_norm_calls"] > 0


def test_nanogpt_has_no_rms_norm_to_fuse():
    """nanoGPT normalises with LayerNorms: nothing is swapped, parity as before."""
    for r in _style(2, "nanogpt", {"dp": 2}):
        assert r["rms_norm_calls"] == 0
