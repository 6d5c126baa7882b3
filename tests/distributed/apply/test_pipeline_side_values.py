"""Encoder-decoder models under pipeline parallelism (4 gloo ranks, PP2xDP2): the cut inside the
decoder passes the encoder's output (and T5's position biases) beside the decoder's activation,
and the run equals one device's (loss, gradients, parameters to fp32 tolerance)."""

from __future__ import annotations

import pytest

from nest_fx.apply.launch import launch
from nest_fx.testing import COVERAGE_BATCH, COVERAGE_PLANS, COVERAGE_SEQ, cell_status, coverage_cell

pytestmark = [pytest.mark.hf, pytest.mark.dist]
pytest.importorskip("transformers")
LAUNCH_S = 240


PP4 = {"pp": 4, "dp": 1, "microbatch_size": 2, "num_microbatches": 4}


def _pp_cell(model: str, plan: dict):
    spec = {
        "model": model,
        "plan": dict(plan),
        "batch": COVERAGE_BATCH,
        "seq": COVERAGE_SEQ,
        "steps": 3,
        "lr": 0.5,
    }
    results = launch(coverage_cell, 4, spec, timeout=LAUNCH_S)
    cell = cell_status(results)
    print(f"\n{model} {plan}: {cell}")
    return cell, results


def _check(model: str, plan: dict = COVERAGE_PLANS["PP2xDP2"]) -> None:
    cell, results = _pp_cell(model, plan)
    assert cell["status"] == "ok", cell
    assert cell["plan"].startswith(f"pp={plan['pp']} dp={plan['dp']}"), cell
    assert {r["stage"] for r in results} == set(range(plan["pp"]))
    # every parameter is trained and compared, the encoder's (stage 0) and the last decoder layer's (stage 1)
    names = set().union(*(r["param_names"] for r in results))
    assert any("encoder." in n for n in names) and any(
        "decoder.layers.1." in n or "decoder.block.1." in n for n in names
    )
    assert all(r["num_grads"] > 0 for r in results)


@pytest.mark.timeout(LAUNCH_S + 30)
def test_bart_pipeline_carries_the_encoder_output_at_parity():
    _check("hf:bart")


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_t5_pipeline_carries_the_encoder_output_and_position_biases_at_parity():
    _check("hf:t5")


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
@pytest.mark.parametrize("model", ["hf:bart", "hf:t5"])
def test_four_stages_forward_the_encoder_output_through_the_middle_stages(model):
    """PP4: the middle stages hold one decoder layer each and pass the encoder's output on (T5: and
    the position biases its second layer returns as it got them); the shared embedding stays on
    the first and last stage only."""
    _check(model, PP4)
