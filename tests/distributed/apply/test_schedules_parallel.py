"""The zero-bubble and V pipeline schedules at parity on 4 gloo ranks (the harness of
``test_apply_parallel.py``: 3 SGD steps, losses, full gradients and parameters within 1e-5 of the
single-device run), and the settings they do not run with refused before training.

One fast cell (zbv on a GPT with tied embeddings: the V layout puts the embedding and the LM head
on pipeline rank 0, whose one tied parameter sums both uses) and the other schedules as `slow`.
"""

from __future__ import annotations

import pytest
import torch
from parity_helpers import LAUNCH_S, LLAMA, MOE, run
from test_meta_start import MODEL as META_GPT
from test_meta_start import TOL, _reference, _run

from nest_fx.apply.launch import launch
from nest_fx.models import build_model
from nest_fx.testing import coverage_cell

GPT = "gpt:hidden=64,layers=4,heads=4,seq=32,vocab=128"  # tied input and output embeddings
LLAMA8 = "llama:hidden=64,layers=8,heads=4,seq=32,vocab=128"

pytestmark = pytest.mark.dist


def _plan(schedule: str, pp: int, dp: int = 1, **extra) -> dict:
    return {
        "pp": pp,
        "dp": dp,
        "microbatch_size": 1,
        "num_microbatches": 2 * pp,
        "schedule": schedule,
        "virtual_stages": 2,
        **extra,
    }


@pytest.mark.timeout(LAUNCH_S + 30)
def test_zbv_pp2_dp2_tied_embeddings():
    results = run(4, GPT, _plan("zbv", 2, 2), batch=8)
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    # the tied embedding is one parameter on device 0 (chunks 0 and 3); device 1 (chunks 1 and 2)
    # holds no copy of it, as the last stage does under 1F1B
    assert "embed.tok.weight" in results[0]["param_names"] and "embed.tok.weight" not in results[2]["param_names"]


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
@pytest.mark.parametrize("schedule", ["interleaved-zb", "dualpipev"])
def test_pp2_dp2(schedule):
    run(4, LLAMA, _plan(schedule, 2, 2), batch=8)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved-zb"])
def test_pp4(schedule):
    run(4, LLAMA8, _plan(schedule, 4), batch=8)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_dualpipev_tp2_pp2():
    run(4, LLAMA, _plan("dualpipev", 2, tp=2), batch=4)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_zbv_zero1_with_full_recompute():
    run(4, GPT, _plan("zbv", 2, 2, zero=1, recompute="full"), batch=8)


@pytest.mark.timeout(LAUNCH_S + 30)
def test_zero3_is_refused_before_training():
    spec = {"model": LLAMA, "plan": _plan("interleaved-zb", 2, 2, zero=3), "batch": 8, "seq": 32, "steps": 1}
    results = launch(coverage_cell, 4, spec, timeout=LAUNCH_S)
    assert all("interleaved-zb with zero=3" in r.get("refused", "") for r in results), results


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
@pytest.mark.parametrize("schedule", ["zbv", "interleaved"])
def test_ep2_moe_pipeline_with_a_chunk_without_experts(schedule):
    """Device 0's first chunk is the embedding alone: no MoE layer to convert (this crashed the
    ranks of one stage, the others waiting in a collective, before expert_parallel let it be)."""
    run(4, MOE, _plan(schedule, 2, 2, ep=2), batch=8)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_zbv_tied_gpt_started_on_meta_from_a_state_dict(tmp_path):
    """The tied embedding, one parameter in both of rank 0's chunks, materialised and read once."""
    torch.manual_seed(1)
    eager, _ = build_model(META_GPT, device="cpu")
    path = str(tmp_path / "gpt.pt")
    torch.save(eager.state_dict(), path)
    ref_losses, ref_params = _reference(eager)
    plan = {"pp": 2, "dp": 2, "microbatch_size": 1, "num_microbatches": 4, "schedule": "zbv", "virtual_stages": 2}
    for r in _run(META_GPT, plan, path):
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) < TOL
        for name, p in r["params"].items():
            torch.testing.assert_close(p, ref_params[name], rtol=0, atol=TOL)
