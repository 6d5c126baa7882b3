"""T5's cross-attention under tensor parallelism: query from the decoder's state, key and value
from the encoder's output (whole on every TP rank), sharded by heads like self-attention; the
first decoder layer's cross-attention, which has no bias table of its own, builds a zero
position bias from its (localised) head count. TP2 x DP2 on 4 gloo ranks equals one device."""

from __future__ import annotations

import pytest

from nest_fx.apply.launch import launch
from nest_fx.testing import COVERAGE_BATCH, COVERAGE_SEQ, equivalence

TOL = 1e-5
LAUNCH_S = 300
TP2_DP2 = {"tp": 2, "dp": 2, "microbatch_size": 4}


def _parity(plan: dict) -> list:
    """Every rank's ``testing.equivalence`` result of hf:t5 under ``plan``, asserted at parity."""
    spec = {"model": "hf:t5", "plan": plan, "batch": COVERAGE_BATCH, "seq": COVERAGE_SEQ, "steps": 3, "lr": 0.5}
    ranks = launch(equivalence, 4, spec, timeout=LAUNCH_S)
    worst = {
        k: max(r[k] for r in ranks) for k in ("loss_diff", "grad_diff", "param_diff", "grad_excess", "param_excess")
    }
    print(f"\nhf:t5 {plan}: " + ", ".join(f"{k}={v:.1e}" for k, v in worst.items()))
    assert worst["loss_diff"] < TOL, worst
    # gradients and parameters: |a - b| < TOL + FP32_RTOL |b| (testing.FP32_RTOL), as the coverage cells
    assert worst["grad_excess"] < TOL and worst["param_excess"] < TOL, worst
    assert all(r["num_grads"] > 0 for r in ranks)
    return ranks


@pytest.mark.hf
@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S + 60)
def test_t5_tp2_dp2_with_cross_attention_sharded_equals_one_device():
    """hf:t5 (encoder-decoder, its own loss from labels), 3 SGD steps under TP2 x DP2: losses,
    gradients and parameters equal the single-device run's to fp32 tolerance, and every
    cross-attention projection (the first decoder layer's included) is sharded."""
    pytest.importorskip("transformers")
    sharded = set(_parity(TP2_DP2)[0]["sharded"])
    for block in (0, 1):
        for proj in "qkvo":
            assert f"decoder.block.{block}.layer.1.EncDecAttention.{proj}.weight" in sharded, (block, proj)


@pytest.mark.hf
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 60)
@pytest.mark.parametrize(
    "plan",
    [{"tp": 4, "dp": 1, "microbatch_size": 8}, dict(TP2_DP2, sequence_parallel=True)],
    ids=["TP4", "TP2xDP2-SP"],
)
def test_t5_under_the_other_tp_plans_the_planner_offers(plan):
    """TP4 (one head per rank; the planner offers tp 1, 2 and 4 for hf:t5 on 4 ranks) and TP2 x DP2
    with sequence parallelism equal one device too."""
    pytest.importorskip("transformers")
    _parity(plan)
