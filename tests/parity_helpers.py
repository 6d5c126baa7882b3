"""The parity harness of the multi-process tests (tests/distributed/): launch N gloo ranks, train a tiny
fp32 model for 3 SGD steps under a plan and the same model on one device on every rank, and assert
that the losses, full gradients and parameters agree within :data:`TOL` (docs/runtime.md, "Verified")."""

from __future__ import annotations

from nest_fx.apply.launch import launch
from nest_fx.testing import equivalence

TOL = 1e-5
LAUNCH_S = 150
LLAMA = "llama:hidden=64,layers=4,heads=4,seq=32,vocab=128"
# capacity_factor = experts / top_k: no token is ever dropped, whatever the routing
MOE = "moe:hidden=64,layers=2,heads=4,seq=32,vocab=128,experts=4,top_k=2,capacity_factor=2.0"
HF_LLAMA = "hf:llama:hidden=64,layers=2,heads=4,kv=2,seq=32,vocab=128"


def run(world: int, model: str, plan: dict, batch: int = 8, seq: int = 32, fn=equivalence, **extra):
    """Run ``fn`` (``nest_fx.testing.equivalence``) on ``world`` ranks and assert parity; the per-rank results."""
    spec = {"model": model, "plan": plan, "batch": batch, "seq": seq, "steps": 3, "lr": 0.5, **extra}
    results = launch(fn, world, spec, timeout=LAUNCH_S)
    worst = {k: max(r[k] for r in results) for k in ("loss_diff", "grad_diff", "param_diff")}
    print(f"\n{model} {plan}: " + ", ".join(f"{k}={v:.2e}" for k, v in worst.items()))
    for r in results:
        assert r["num_grads"] > 0 and r["num_params"] > 0, r
        assert len(r["losses"]) == 3
    assert worst["loss_diff"] < TOL, worst
    assert worst["grad_diff"] < TOL, worst
    assert worst["param_diff"] < TOL, worst
    # every rank reports the same global loss
    for step in range(3):
        assert len({round(r["losses"][step], 6) for r in results}) == 1
    return results
